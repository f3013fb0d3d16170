"""How frontends start and reach the runtime's processes.

``launcher`` starts/stops the scheduler and worker processes (their loops live beside their packages:
``radixrelay.scheduler.scheduler_process``, ``radixrelay.worker.worker_process``; what they share is
``radixrelay.proc``); every struct they exchange over ZMQ is defined in ``radixrelay.protocol``.
``client`` states the frontend interface, implemented by ``async_client`` (HTTP server) and
``sync_client`` (offline Engine).
"""
