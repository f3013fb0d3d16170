"""The runtime's processes and how frontends reach them.

``launcher`` starts/stops the scheduler and worker processes (``scheduler_process``,
``worker_process``, sharing ``child``; ``audit`` paces the scheduler's KV audit); every struct they
exchange over ZMQ is defined in ``radixrelay.protocol``. ``client`` states the frontend interface,
implemented by ``async_client`` (HTTP server) and ``sync_client`` (offline Engine).
"""
