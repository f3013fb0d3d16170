"""Several HTTP server processes on one port, sharing one runtime (``serve --api-servers N``).

One server process reads, parses and tokenizes every request on one event loop; a burst of long prompts
(128 bodies of 0.75 MB) waits there in turn. With ``N`` servers the kernel spreads new connections over
``N`` listening sockets bound to the same port (``SO_REUSEPORT``), and each server handles its own
connections to the end.

- Server 0 is the process that was started: it starts the runtime (told of ``N`` inboxes), then servers
  1..N-1 as its children (``python -m radixrelay.server.api_server_process``), and starts listening only
  once they all listen. It stops them before the runtime when it drains, and exits (code 1) when one of
  them dies.
- Requests and calls are numbered so that ``id % N`` is the server's index; the scheduler answers each on
  that server's inbox (``radixrelay.scheduler.frontend_outboxes``).
- What the servers share goes over a control socket per server (ZMQ REQ/ROUTER in the runtime's socket
  directory): /metrics answered by any server sums every server's request metrics (``MetricsShare``);
  a prompt-schema change is made by server 0, which applies it in order on every server before it answers
  (``SchemaChange``).
- Each server has its own connection limits (``--max-connections``), tokenizer caches and garbage
  collector; the runtime's limits (``--max-running-requests``, the queue) are the runtime's, shared.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgspec
import zmq
import zmq.asyncio

from radixrelay.config import EngineConfig, ServerConfig
from radixrelay.protocol.messages import RuntimeReady
from radixrelay.protocol.stats import FrontendCounters
from radixrelay.runtime.attached import AttachedRuntime

logger = logging.getLogger("radixrelay.server")
CONTROL_TIMEOUT_S = 10.0       # longest one server waits for another's answer on the control socket
START_TIMEOUT_S = 120.0        # longest server 0 waits for the others to listen
PEER_EXIT_SLACK_S = 5.0        # a draining server's allowance beyond the drain timeout to exit
POLL_S = 0.05


class ApiServerArgs(msgspec.Struct, frozen=True):
    """Servers 1..N-1: their arguments, as JSON on the command line."""
    engine: EngineConfig
    server: ServerConfig           # its ``port`` is the port server 0 bound (never 0)
    index: int
    runtime: AttachedRuntime
    info: RuntimeReady
    controls: list[str]            # every server's control socket, by index
    log_level: str = "INFO"


# -- control messages --------------------------------------------------------------------------


class Ping(msgspec.Struct, tag="ping", frozen=True):
    pass


class Pong(msgspec.Struct, tag="pong", frozen=True):
    listening: bool                # the server accepts connections


class PullMetrics(msgspec.Struct, tag="pull_metrics", frozen=True):
    pass


class SampleShare(msgspec.Struct, array_like=True, frozen=True):
    name: str
    labels: dict[str, str]
    value: float


class FamilyShare(msgspec.Struct, frozen=True):
    """One metric family of a server's own registry (counters and histograms: their samples add up)."""
    name: str
    type: str
    documentation: str
    samples: list[SampleShare]


class MetricsShare(msgspec.Struct, tag="metrics_share", frozen=True):
    families: list[FamilyShare]
    frontend: FrontendCounters      # its garbage collection, request stages and dropped frames


class SchemaChange(msgspec.Struct, tag="schema_change", frozen=True):
    """Register a schema (``body``: the request body of POST /v1/schemas) or delete one (``name``)."""
    op: Literal["register", "delete"]
    body: bytes = b""
    name: str = ""
    apply_only: bool = False        # from server 0: apply here and answer (no broadcast)


class SchemaResult(msgspec.Struct, tag="schema_result", frozen=True):
    status: int
    body: bytes                     # the JSON answer, as the HTTP response has it


class ControlError(msgspec.Struct, tag="control_error", frozen=True):
    message: str


ControlRequest = Ping | PullMetrics | SchemaChange
ControlReply = Pong | MetricsShare | SchemaResult | ControlError
_encode = msgspec.msgpack.Encoder().encode
_requests = msgspec.msgpack.Decoder(ControlRequest)
_replies = msgspec.msgpack.Decoder(ControlReply)


class PeerError(RuntimeError):
    """Another server did not answer on its control socket."""


def listening_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    """A TCP socket bound to (host, port), not listening yet (uvicorn starts listening once the app is
    ready). ``reuse_port``: ``SO_REUSEPORT`` set, so that the other servers bind the same port. Binding
    the port of another user's socket is refused by the kernel; another process of the same user can
    join the group, as with any ``SO_REUSEPORT`` server."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto named: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on sockets whose proto says TCP, and
    # accepted connections take this one's; with Nagle on, a kept-alive connection's answers wait ~40 ms
    # for the client's delayed ACKs
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


@dataclass
class Handlers:
    """What a server answers on its control socket (set by the app's state)."""
    listening: Callable[[], bool]
    metrics: Callable[[], MetricsShare]
    schema: Callable[[SchemaChange], Awaitable[SchemaResult]]


class ServerGroup:
    """This process's place among the servers sharing the port: index ``index`` of ``count``. Server 0
    also starts, watches and stops the others."""

    def __init__(self, index: int, count: int, controls: list[str] | None = None) -> None:
        if count < 1 or not 0 <= index < count:
            raise ValueError(f"server index {index} out of range for {count} servers")
        self.index, self.count = index, count
        self.controls = controls or []
        self.peers: list[subprocess.Popen[bytes]] = []     # server 0: servers 1..N-1
        self.stopping = False
        self._ctx: zmq.asyncio.Context | None = None
        self._serving: asyncio.Task[None] | None = None
        self._schema_lock = asyncio.Lock()
        self._answering: set[asyncio.Task[None]] = set()

    @property
    def shared(self) -> bool:
        return self.count > 1

    # -- server 0: the others' lifetime --------------------------------------------------------

    async def start_peers(self, engine: EngineConfig, server: ServerConfig, runtime: AttachedRuntime,
                          info: RuntimeReady, log_level: str) -> None:
        """Start servers 1..N-1 and wait until each listens (``START_TIMEOUT_S``)."""
        assert self.index == 0 and self.shared
        for index in range(1, self.count):
            args = ApiServerArgs(engine, server, index, runtime, info, self.controls, log_level)
            # the arguments on stdin, not the command line: they hold the API key, which every user of the
            # machine could read in the process list
            proc = subprocess.Popen([sys.executable, "-m", "radixrelay.server.api_server_process"],
                                    stdin=subprocess.PIPE)
            self.peers.append(proc)
            assert proc.stdin is not None
            proc.stdin.write(msgspec.json.encode(args))
            proc.stdin.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        for index in range(1, self.count):
            while True:
                if (dead := self.dead_peer()) is not None:
                    raise RuntimeError(f"API server start-up failed: {dead}")
                with contextlib.suppress(PeerError):
                    reply = await self.ask(index, Ping(), timeout=1.0)
                    if isinstance(reply, Pong) and reply.listening:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"API server {index} not listening after {START_TIMEOUT_S:g} s")
                await asyncio.sleep(POLL_S)
        logger.info("%d API servers share port %d", self.count, server.port)

    def dead_peer(self) -> str | None:
        for index, proc in enumerate(self.peers, 1):
            code = proc.poll()
            if code is not None:
                return f"API server {index} (pid {proc.pid}) exited with code {code}"
        return None

    def signal_peers(self) -> None:
        """SIGTERM to every server still running: a first one drains it, a second hurries it."""
        self.stopping = True
        for proc in self.peers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    async def stop_peers(self, drain_timeout: float, slack: float = PEER_EXIT_SLACK_S) -> None:
        """Drain the others (SIGTERM) and wait for them to exit; killed past the drain and ``slack``."""
        self.signal_peers()
        deadline = time.monotonic() + drain_timeout + slack
        while any(p.poll() is None for p in self.peers) and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        for proc in self.peers:
            if proc.poll() is None:
                logger.warning("API server pid %d did not exit in time: killed", proc.pid)
                proc.kill()
                await asyncio.to_thread(proc.wait)

    def kill_peers(self) -> None:
        """At once (server 0 is failing): no drain."""
        self.stopping = True
        for proc in self.peers:
            if proc.poll() is None:
                proc.kill()
        for proc in self.peers:
            proc.wait()

    # -- the control sockets -------------------------------------------------------------------

    def serve_control(self, handlers: Handlers) -> None:
        """Answer this server's control socket until ``close``."""
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.controls[self.index])
        self._serving = asyncio.create_task(self._serve(sock, handlers))

    async def _serve(self, sock: zmq.asyncio.Socket, handlers: Handlers) -> None:
        while True:
            frames = await sock.recv_multipart()
            # every request is answered on a task of its own: a schema change (server 0 waits for the
            # others) must not hold up a metrics pull; held here until done (the loop keeps weak references)
            task = asyncio.create_task(self._answer(sock, frames, handlers))
            self._answering.add(task)
            task.add_done_callback(self._answering.discard)

    async def _answer(self, sock: zmq.asyncio.Socket, frames: list[bytes], handlers: Handlers) -> None:
        identity, payload = frames[0], frames[-1]
        try:
            request = _requests.decode(payload)
            if isinstance(request, Ping):
                reply: ControlReply = Pong(handlers.listening())
            elif isinstance(request, PullMetrics):
                reply = handlers.metrics()
            else:
                reply = await handlers.schema(request)
        except Exception as exc:  # noqa: BLE001 - the asking server raises it as a PeerError
            logger.exception("control request failed")
            reply = ControlError(f"{type(exc).__name__}: {exc}")
        with contextlib.suppress(zmq.ZMQError):
            await sock.send_multipart([identity, b"", _encode(reply)])

    async def ask(self, index: int, request: ControlRequest, timeout: float = CONTROL_TIMEOUT_S) -> ControlReply:
        """Server ``index``'s answer to ``request``; ``PeerError`` when it gives none within ``timeout``."""
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.controls[index])
            await sock.send(_encode(request))
            if not await sock.poll(int(timeout * 1000)):
                raise PeerError(f"API server {index} did not answer within {timeout:g} s")
            reply = _replies.decode(await sock.recv())
        finally:
            sock.close()
        if isinstance(reply, ControlError):
            raise PeerError(f"API server {index}: {reply.message}")
        return reply

    async def pull_metrics(self) -> list[MetricsShare]:
        """Every other server's request metrics (a server that does not answer is left out, logged)."""
        others = [i for i in range(self.count) if i != self.index]
        replies = await asyncio.gather(*(self.ask(i, PullMetrics()) for i in others), return_exceptions=True)
        shares = []
        for index, reply in zip(others, replies):
            if isinstance(reply, MetricsShare):
                shares.append(reply)
            else:
                logger.warning("metrics of API server %d left out: %s", index, reply)
        return shares

    async def change_schema(self, change: SchemaChange, apply: Callable[[SchemaChange], Awaitable[SchemaResult]]
                            ) -> SchemaResult:
        """A schema change made on every server: by server 0 in the order it takes changes (``apply`` here,
        then on the others), asked of server 0 by the others."""
        if self.index != 0:
            reply = await self.ask(0, change)
            assert isinstance(reply, SchemaResult)
            return reply
        async with self._schema_lock:
            result = await apply(change)
            if result.status == 200:
                relayed = msgspec.structs.replace(change, apply_only=True)
                for index in range(1, self.count):
                    other = await self.ask(index, relayed)
                    if not isinstance(other, SchemaResult) or other.status != result.status:
                        logger.error("API server %d did not apply the schema change as server 0 did: %s",
                                     index, other)
            return result

    def close(self) -> None:
        if self._serving is not None:
            self._serving.cancel()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None


def control_addresses(ipc_dir: str | Path, count: int) -> list[str]:
    return [f"ipc://{Path(ipc_dir) / f'control{i}'}" for i in range(count)]
