"""Run the HTTP server: uvicorn with radixrelay's own signal handling.

uvicorn's default SIGTERM handling closes the listening socket at once and re-raises the signal
after shutdown; radixrelay instead drains (``ServerState.begin_drain``): new requests get 503 while
in-flight ones finish, then the runtime stops and the server exits 0. A second SIGINT/SIGTERM
cuts the drain short: in-flight requests end with an error at once.

Connections are limited at the connection level (``radixrelay.net.connections``): a deadline for reading
each request (``--request-read-timeout``) and a cap on open ones (``--max-connections``); uvicorn's and
asyncio's per-connection log records are rate-limited (``radixrelay.net.log_limits``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
from collections.abc import Callable, Generator

import uvicorn

from radixrelay.config import EngineConfig, ServerConfig
from radixrelay.net.connections import ConnectionLimits, uvicorn_options
from radixrelay.net.log_limits import limit_logs
from radixrelay.server.api_servers import ApiServerArgs, listening_socket
from radixrelay.server.app import ServerState, build_app

logger = logging.getLogger("radixrelay.server")
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_first_signal: Callable[[], None],
                 on_second_signal: Callable[[], None], signals: tuple[signal.Signals, ...] = _SIGNALS) -> None:
        super().__init__(config)
        self._on_first_signal = on_first_signal
        self._on_second_signal = on_second_signal
        self._signals = 0
        self._handled = signals

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        loop = asyncio.get_running_loop()
        for sig in self._handled:
            loop.add_signal_handler(sig, self._handle_signal, sig)
        try:
            yield
        finally:
            for sig in self._handled:
                loop.remove_signal_handler(sig)

    def _handle_signal(self, sig: signal.Signals) -> None:
        self._signals += 1
        if self._signals == 1:
            logger.info("%s: draining", sig.name)
            self._on_first_signal()
        else:
            logger.info("%s again: ending in-flight requests now", sig.name)
            self._on_second_signal()


def run_server(engine_config: EngineConfig, config: ServerConfig, attach: ApiServerArgs | None = None) -> int:
    """Serve until drained or the runtime dies; returns the process exit code. ``attach``: this process
    is one of servers 1..N-1 of ``--api-servers N`` (``radixrelay.server.api_servers``)."""
    sock = None
    try:
        # the descriptor limit raised and the connection cap under it, before anything opens files
        limits = ConnectionLimits(config.request_read_timeout, config.max_connections).resolved()
        if config.api_servers > 1:         # every server binds the port; the first picks it when it is 0
            sock = listening_socket(config.host, config.port, reuse_port=True)
            config = dataclasses.replace(config, port=sock.getsockname()[1])
        state = ServerState(engine_config, config, attach)
    except (ValueError, OSError) as exc:   # e.g. an unsafe --chat-template, a port in use: before anything starts
        logger.error("%s", exc)
        if sock is not None:
            sock.close()
        return 2
    app = build_app(state)
    # Servers 1..N-1 take SIGTERM from server 0 only: a terminal's Ctrl-C reaches server 0, which drains them.
    if attach is not None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    server = _DrainingServer(
        uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                       timeout_graceful_shutdown=int(config.drain_timeout) + 5, **uvicorn_options(limits)),
        on_first_signal=state.begin_drain, on_second_signal=state.hurry_drain,
        signals=(signal.SIGTERM,) if attach is not None else _SIGNALS)
    limit_logs()                   # after uvicorn.Config, which configures uvicorn's loggers
    if attach is None:
        logger.info("connections: at most %d open%s, %g s to read each request", limits.max_connections,
                    " per API server" if config.api_servers > 1 else "", limits.read_timeout_s)
    state.request_exit = lambda: setattr(server, "should_exit", True)
    state.listening = lambda: server.started
    asyncio.run(server.serve(sockets=[sock] if sock is not None else None))
    if not server.started:
        return 1               # start-up failed (runtime or port); uvicorn logged why
    return state.exit_code
