"""Connection limits of the HTTP fronts (``radixrelay serve``, ``radixrelay router``): a deadline for reading
each request and a cap on open connections, enforced in uvicorn's HTTP protocol classes.

uvicorn holds a connection that sends half a request for ever: its keep-alive timeout covers only idle
connections between requests, and an ASGI middleware never sees a request whose headers are incomplete.
About 20,000 such connections exhausted the server's descriptors (then /health timed out and asyncio's
accept loop logged a traceback per retry). So both limits live at the connection level, in subclasses of
uvicorn's protocols (httptools' and h11's; ``uvicorn.Config(http=cls)``), built by ``uvicorn_options``:

- Read deadline (``--request-read-timeout``, default 30 s): a request's headers and body must arrive within
  it, counted from the request's first byte (a new connection's first request: from the connection, so a
  connection that sends nothing is closed too). On expiry the client gets a 408 (OpenAI error JSON) and
  the connection is closed. It covers reading only: it stops when the body is complete, so a response (a
  stream) however long is never cut; and while a response of the connection is being produced or sent,
  an expired deadline starts again instead (the client may be pipelining).
- Connection cap (``--max-connections``; default from the descriptor limit, ``default_max_connections``): a
  connection past it gets a 503 (OpenAI error JSON) and is closed at once, before anything is read.
- Header size (httptools only; h11 refuses past 16 KiB itself): a request head still incomplete 64 KiB
  past the read it began in gets a 431.

Each of these events is logged on ``radixrelay.net``, which ``log_limits`` bounds to one line per cause
per interval.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import resource
from dataclasses import dataclass, replace
from http import HTTPStatus
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("radixrelay.net")

READ_TIMEOUT_S = 30.0
MAX_HEAD_BYTES = 64 * 1024
# Descriptors the default cap leaves to the process itself: model and log files, ZMQ sockets and pipes
# to the runtime processes, the KV store's and the health polls' connections, tokenizer threads' files.
RESERVED_FDS = 1024
# asyncio accepts up to the listen backlog (uvicorn's default 2,048) sockets in one turn of the event loop
# before any of them reaches ``connection_made``, where the cap is checked: the descriptors of a burst
# exist before they are refused, so the default cap leaves room for one burst too.
ACCEPT_BURST = 2048
# A given --max-connections must leave at least this many descriptors to the process.
MIN_RESERVED_FDS = 256
# The default cap's ceiling whatever the descriptor limit: an idle connection still costs memory in uvicorn.
MAX_CONNECTIONS_CEILING = 65536
IMPLEMENTATIONS = ("auto", "httptools", "h11")


@dataclass(frozen=True)
class ConnectionLimits:
    read_timeout_s: float = READ_TIMEOUT_S
    max_connections: int | None = None    # None: derived from the descriptor limit (``resolved``)
    # descriptors one client connection may hold: 1 at the server; 2 at the router (its upstream one)
    fds_per_connection: int = 1

    def __post_init__(self) -> None:
        t = self.read_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and 0 < t <= 3600):
            raise ValueError(f"--request-read-timeout must be in (0, 3600] seconds, got {t!r}")
        n = self.max_connections
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"--max-connections must be an integer >= 1, got {n!r}")
        if self.fds_per_connection not in (1, 2):
            raise ValueError(f"fds_per_connection must be 1 or 2, got {self.fds_per_connection!r}")

    def resolved(self) -> ConnectionLimits:
        """These limits for this process, after raising its soft descriptor limit to the hard one:
        ``max_connections`` filled in when None; ValueError when a given one does not fit under the limit."""
        nofile = raise_fd_limit()
        if self.max_connections is None:
            return replace(self, max_connections=default_max_connections(nofile, self.fds_per_connection))
        most = max(1, (nofile - MIN_RESERVED_FDS) // self.fds_per_connection)
        if self.max_connections > most:
            raise ValueError(f"--max-connections {self.max_connections} does not fit under this process's "
                             f"descriptor limit ({nofile}, ulimit -n; {MIN_RESERVED_FDS} kept for the process "
                             f"itself{', two per connection' if self.fds_per_connection == 2 else ''}): at most "
                             f"{most}, or raise the limit")
        return self


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard one (as far as the kernel allows); the soft limit after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft if soft != resource.RLIM_INFINITY else target
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):      # e.g. a hard limit above the kernel's nr_open: keep the soft one
        return soft
    return target


def default_max_connections(nofile: int, fds_per_connection: int = 1) -> int:
    """The default cap under a descriptor limit of ``nofile``: what is left after the process's reserve and
    one accept burst (at most half the limit), per connection's descriptors, at most the ceiling."""
    reserve = min(RESERVED_FDS + ACCEPT_BURST, nofile // 2)
    return max(1, min(MAX_CONNECTIONS_CEILING, (nofile - reserve) // fds_per_connection))


def uvicorn_options(limits: ConnectionLimits, implementation: str = "auto") -> dict[str, Any]:
    """``uvicorn.Config`` keyword arguments enforcing ``limits`` (resolved: ``max_connections`` set) over one
    server's connections. ``implementation``: uvicorn's HTTP parser, 'auto' picking httptools when installed
    as uvicorn does. WebSockets are off: neither front serves them, and an upgraded connection would leave
    the protocol that counts it."""
    return {"http": http_protocol(limits, implementation), "ws": "none"}


def http_protocol(limits: ConnectionLimits, implementation: str = "auto") -> type[asyncio.Protocol]:
    """A uvicorn HTTP protocol class enforcing ``limits``; the connections of all its instances (one server's)
    count against one cap."""
    if limits.max_connections is None:
        raise ValueError("resolve the limits first (ConnectionLimits.resolved): max_connections is None")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if implementation in ("auto", "httptools"):
        try:
            from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
        except ImportError:
            if implementation == "httptools":
                raise
        else:
            return type("LimitedHttpToolsProtocol", (_HttpToolsLimits, HttpToolsProtocol), {"_gate": _Gate(limits)})
    return type("LimitedH11Protocol", (_H11Limits, H11Protocol), {"_gate": _Gate(limits)})


def error_response(status: int, message: str, type_: str, code: str) -> bytes:
    """A whole HTTP/1.1 response with an OpenAI error JSON body, closing the connection."""
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()
    head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("ascii") + body


class _Gate:
    """One server's limits and its open connections (its protocols run on one event loop: no lock)."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.read_timeout_s = limits.read_timeout_s
        self.cap = limits.max_connections
        self.open = 0
        self.timed_out = error_response(
            408, f"the request was not received whole within {limits.read_timeout_s:g} s "
                 "(--request-read-timeout); the connection is closed", "invalid_request_error", "request_timeout")
        self.refused = error_response(
            503, f"the server holds its most connections ({self.cap}, --max-connections); retry later",
            "server_error", "too_many_connections")
        self.head_too_large = error_response(
            431, f"the request's head (request line and headers) exceeds {MAX_HEAD_BYTES} bytes",
            "invalid_request_error", "headers_too_large")


class _Limits:
    """The limits over a uvicorn HTTP protocol (mixed in before it). Invariants: a connection counts in
    ``_gate.open`` from an accepted ``connection_made`` to its ``connection_lost``; ``_deadline`` is a timer
    exactly while a request is being read (from its first byte, or the connection, to its body's end)."""

    _gate: ClassVar[_Gate]
    _deadline: asyncio.TimerHandle | None = None
    _refused = False
    # the base protocol's (uvicorn) attributes used here
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    cycle: Any
    client: tuple[str, int] | None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        gate = self._gate
        if gate.open >= gate.cap:
            # refused before the base protocol sees it: not in uvicorn's connections, nothing read or held
            self._refused = True
            transport.write(gate.refused)
            transport.close()
            logger.warning("refused a connection with 503: %d open, the most allowed (--max-connections)",
                           gate.open)
            return
        gate.open += 1
        super().connection_made(transport)  # type: ignore[misc]
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            return
        self._gate.open -= 1
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        if not self._refused:
            super().data_received(data)  # type: ignore[misc]

    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(self._gate.read_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _answering(self) -> bool:
        """Whether a response of this connection is being produced or sent: its request was read whole, or
        its response started (an app may answer before reading the body)."""
        c = self.cycle
        return c is not None and not c.response_complete and (c.response_started or not c.more_body)

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self._answering():       # never cut a response: the reading waits for it, with a fresh deadline
            self._arm()
            return
        c = self.cycle
        if c is not None and c.more_body and c.response_complete:
            self.transport.close()  # answered already (e.g. a 413) while the body still trickles in
            return
        self._close_with(self._gate.timed_out)
        logger.warning("closed a connection with 408: no whole request within %g s (--request-read-timeout), "
                       "e.g. from %s", self._gate.read_timeout_s, _address(self.client))

    def _close_with(self, response: bytes) -> None:
        """Answer ``response`` (nothing was sent for the request being read) and close. The app, if it is
        waiting for this request's body, sees a disconnect; whatever it sends later is dropped."""
        c = self.cycle
        if c is not None and not c.response_complete:
            c.disconnected = True
            c.message_event.set()
        self.transport.write(response)
        self.transport.close()


class _HttpToolsLimits(_Limits):
    """httptools' parser calls back on each request's first byte and on its end: the deadline's bounds."""

    pipeline: Any
    # The head's size: httptools keeps a head of any size (uvicorn collects its headers). A read in which a
    # head begins may hold other bytes before it (a body's end): only later reads that the head continues
    # through are counted whole, so a head is refused once it has outgrown one read by MAX_HEAD_BYTES.
    _in_head = False                # a request's head has begun and is not complete
    _head_began = False             # ... in the read being parsed
    _head_bytes = 0                 # its bytes in the reads after that one

    def _answering(self) -> bool:
        # a pipelined request whose head is complete waits in ``pipeline`` behind an earlier one's response
        return bool(self.pipeline) or super()._answering()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        self._head_began = False
        super().data_received(data)
        if self._in_head and not self._head_began and not self.transport.is_closing():
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._close_with(self._gate.head_too_large)
                logger.warning("closed a connection with 431: a request head over %d bytes, e.g. from %s",
                               MAX_HEAD_BYTES, _address(self.client))

    def on_message_begin(self) -> None:
        super().on_message_begin()  # type: ignore[misc]
        self._in_head, self._head_began, self._head_bytes = True, True, 0
        self._arm()

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()  # type: ignore[misc]

    def on_message_complete(self) -> None:
        super().on_message_complete()  # type: ignore[misc]
        self._disarm()


class _H11Limits(_Limits):
    """h11 has no callbacks: after each batch of events, its state says whether a request is being read."""

    conn: h11.Connection
    _fresh = True                   # no request has begun on this connection yet

    def handle_events(self) -> None:
        super().handle_events()  # type: ignore[misc]
        if self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is h11.SEND_BODY:            # head read, body not yet whole
            self._fresh = False
            reading = True
        elif state is h11.IDLE:               # between requests: reading if the next one has begun
            reading = self._fresh or bool(self.conn.trailing_data[0])
        elif state is h11.DONE:               # read whole; pipelined bytes wait for the response
            self._fresh = False
            reading = bool(self.conn.trailing_data[0])
        else:                                 # MUST_CLOSE, CLOSED, ERROR: nothing more is read
            reading = False
        if reading:
            self._arm()
        else:
            self._disarm()


def _address(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "an unknown address"
