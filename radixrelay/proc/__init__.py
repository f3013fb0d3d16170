"""What every runtime child process shares: its ZMQ sockets, frame decoding, heartbeat and main
(``child``) and its garbage-collector policy (``gc_control``). Below the scheduler and the worker,
whose process loops live beside their packages (``radixrelay.scheduler.scheduler_process``,
``radixrelay.worker.worker_process``)."""
