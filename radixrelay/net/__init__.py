"""What the HTTP fronts (``radixrelay serve`` and ``radixrelay router``, both uvicorn) share at the connection
level: a deadline for reading each request, a connection cap below the descriptor limit
(``connections``), and logging that stays bounded under a flood of bad connections (``log_limits``)."""
