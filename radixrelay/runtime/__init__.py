"""The runtime's processes and how frontends reach them.

``launcher`` starts/stops the scheduler and worker processes (``scheduler_process``,
``worker_process``, sharing ``child``); ``messages`` defines every struct they exchange over ZMQ;
``client`` states the frontend interface, implemented by ``async_client`` (HTTP server) and
``sync_client`` (offline Engine).
"""
