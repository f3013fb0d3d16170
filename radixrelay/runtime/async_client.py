"""``AsyncRuntimeClient``: the runtime over ZMQ for asyncio frontends (the HTTP server).

Two background tasks: the reader routes every scheduler message to the request stream or pending
call it answers; the watcher polls the children every ``WATCH_INTERVAL`` seconds and, when one has
died, marks the client dead (``alive`` is False from then on), fails every stream and call with
``RuntimeDiedError`` and runs the ``on_death`` callbacks. Failing requests logs one line per request
(no traceback) and yields to the event loop every ``FAIL_BATCH`` requests, so a long queue never
holds up other handlers (a /health probe). A frame on the inbox that is not a runtime message is
logged and dropped (the reader keeps going).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from radixrelay.config import EngineConfig
from radixrelay.protocol.messages import (
    AbortRequest, FlushCacheReply, FlushCacheRequest, FrontendMessage, GenerateRequest, PinSpec, RequestRejected,
    RuntimeMessage, RuntimeReady, ShutdownRequest, StatsReply, StatsRequest, TokenUpdate, UpdateBatch, decoder,
    encoder,
)
from radixrelay.protocol.stats import RuntimeStats
from radixrelay.protocol.step import ModuleSpan
from radixrelay.proc.child import FrameDecoder
from radixrelay.runtime.client import QueueFullError, RuntimeDiedError, ready_info
from radixrelay.runtime.attached import AttachedRuntime
from radixrelay.runtime.launcher import RuntimeProcesses
from radixrelay.protocol.token_ids import pack_token_ids
from radixrelay.sampling_params import SamplingParams

logger = logging.getLogger("radixrelay.runtime")
WATCH_INTERVAL = 0.5                  # seconds between child liveness checks
CALL_TIMEOUT = 30.0                   # seconds a stats / flush call may take
FAIL_BATCH = 64                       # requests failed between two yields to the event loop
ABORT_LINGER_MS = 1000                # an attached server's exit: longest its last aborts may wait to go out

_StreamItem = TokenUpdate | BaseException


class AsyncRuntimeClient:
    def __init__(self, processes: RuntimeProcesses | AttachedRuntime, ctx: zmq.asyncio.Context,
                 inbox: zmq.asyncio.Socket, outbox: zmq.asyncio.Socket, info: RuntimeReady,
                 server: int = 0, servers: int = 1) -> None:
        """``server`` of ``servers``: this HTTP server's index among those sharing the runtime; its request
        and call ids are ``server`` modulo ``servers`` (the scheduler routes their answers by it:
        ``radixrelay.scheduler.frontend_outboxes``)."""
        if not 0 <= server < servers:
            raise ValueError(f"server index {server} out of range for {servers} servers")
        self._processes = processes
        self._ctx, self._inbox, self._outbox = ctx, inbox, outbox
        self._info = info
        self._encode = encoder().encode
        self._frames = FrameDecoder(RuntimeMessage, "scheduler -> frontend", logger)
        self._rids = itertools.count(server, servers)
        self._call_ids = itertools.count(server, servers)
        self._streams: dict[int, asyncio.Queue[_StreamItem]] = {}
        self._calls: dict[int, asyncio.Future[FlushCacheReply | StatsReply]] = {}
        self._death: str | None = None
        self._closed = False
        self._drain_deadline = math.inf
        self.on_death: list[Callable[[str], None]] = []
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._watch())]

    @classmethod
    async def start(cls, config: EngineConfig, servers: int = 1) -> AsyncRuntimeClient:
        """Spawn the runtime and wait until it is ready (model loaded, KV allocated); this client is server
        0 of ``servers`` (the others ``attach``)."""
        processes = RuntimeProcesses(config, servers)
        ctx = zmq.asyncio.Context()
        inbox = ctx.socket(zmq.PULL)
        inbox.bind(processes.endpoints.scheduler_to_frontend)
        outbox = ctx.socket(zmq.PUSH)
        outbox.connect(processes.endpoints.frontend_to_scheduler)
        try:
            processes.spawn()
            info = await _wait_ready(processes, inbox, config.startup_timeout)
            processes.watch_hangs = True
        except BaseException:
            ctx.destroy(linger=0)
            await asyncio.to_thread(processes.stop, 0.0)
            raise
        return cls(processes, ctx, inbox, outbox, info, 0, servers)

    @classmethod
    def attach(cls, runtime: AttachedRuntime, info: RuntimeReady, server: int) -> AsyncRuntimeClient:
        """Server ``server`` (>= 1) of a runtime that server 0 started and made ready: its own inbox, the
        shared outbox. A runtime death is seen by its heartbeats (``AttachedRuntime``)."""
        inboxes = runtime.endpoints.frontend_inboxes()
        if not 1 <= server < len(inboxes):
            raise ValueError(f"server index {server} out of range for {len(inboxes)} servers")
        ctx = zmq.asyncio.Context()
        inbox = ctx.socket(zmq.PULL)
        inbox.bind(inboxes[server])
        outbox = ctx.socket(zmq.PUSH)
        outbox.connect(runtime.endpoints.frontend_to_scheduler)
        return cls(runtime, ctx, inbox, outbox, info, server, len(inboxes))

    @property
    def alive(self) -> bool:
        return self._death is None

    @property
    def num_live(self) -> int:
        """Requests whose results are still streaming."""
        return len(self._streams)

    @property
    def info(self) -> RuntimeReady:
        return self._info

    @property
    def malformed_frames(self) -> int:
        """Frames dropped on this client's inbox."""
        return self._frames.dropped

    def attachable(self) -> AttachedRuntime:
        """How other servers attach to the runtime this client started (``attach``)."""
        processes = self._processes
        if not isinstance(processes, RuntimeProcesses):
            raise RuntimeError("only the server that started the runtime can share it")
        return AttachedRuntime(processes.endpoints, str(processes.ipc_dir), os.getpid(),
                               {name: proc.pid for name, proc in processes.children.items()})

    async def generate(self, token_ids: Sequence[int] | np.ndarray, sampling: SamplingParams, *,
                       cache_salt: str | None = None, rid: int | None = None,
                       shifted_prefix: list[int] | None = None,
                       shifted_at: int = 0, modules: list[ModuleSpan] | None = None,
                       rope_runs: list[tuple[int, int]] | None = None,
                       on_sent: Callable[[], None] | None = None, pins: list[PinSpec] | None = None,
                       priority: int = 0) -> AsyncIterator[TokenUpdate]:
        """``token_ids``: a numpy integer array is sent packed (``runtime/token_ids.py``), a list as it
        is. ``modules``/``rope_runs``: a modular prompt (``radixrelay.modules.compose.ComposedPrompt``).
        ``on_sent``: called once the request is on its way to the scheduler. ``pins``, ``priority``: see
        ``Scheduler.add_request``."""
        self._check_usable()
        rid = next(self._rids) if rid is None else rid
        queue: asyncio.Queue[_StreamItem] = asyncio.Queue()
        self._streams[rid] = queue
        done = False
        try:
            await self._outbox.send(self._encode(GenerateRequest(rid, pack_token_ids(token_ids), sampling,
                                                                 cache_salt, shifted_prefix or [], shifted_at,
                                                                 modules or [], rope_runs or [], pins or [],
                                                                 priority)))
            if on_sent is not None:
                on_sent()
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                done = item.update.finished
                yield item
                if done:
                    return
        finally:
            self._streams.pop(rid, None)
            if not done:
                self._abort_nowait(rid)

    async def abort(self, rid: int) -> None:
        await self._send(AbortRequest(rid))

    async def flush_cache(self) -> bool:
        reply = await self._call(FlushCacheRequest)
        assert isinstance(reply, FlushCacheReply)
        return reply.flushed

    async def stats(self) -> RuntimeStats:
        reply = await self._call(StatsRequest)
        assert isinstance(reply, StatsReply)
        stats = reply.stats
        frontend = msgspec.structs.replace(stats.frontend, malformed_frames=self._frames.dropped)
        return msgspec.structs.replace(stats, frontend=frontend)

    async def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Refuse new requests, give in-flight ones ``drain_timeout`` seconds, fail the rest, stop
        the children and remove the socket directory (a server that attached leaves the runtime running). A later call only shortens the drain of the
        first one (a second SIGTERM) and returns at once."""
        self._drain_deadline = min(self._drain_deadline, time.monotonic() + drain_timeout)
        if self._closed:
            return
        self._closed = True
        while self._streams and self.alive and time.monotonic() < self._drain_deadline:
            await asyncio.sleep(0.05)
        await self._fail_everything("the server shut down before the request finished")
        owner = isinstance(self._processes, RuntimeProcesses)
        if self.alive and owner:
            await self._outbox.send(self._encode(ShutdownRequest()))
        for task in self._tasks:
            task.cancel()
        # a server that shares the runtime leaves it running: its aborts must reach the scheduler
        self._ctx.destroy(linger=0 if owner or not self.alive else ABORT_LINGER_MS)
        # After a death nobody tells the survivor to stop (its peer is gone): terminate it at once.
        await asyncio.to_thread(self._processes.stop, 5.0 if self.alive else 0.0)

    # -- internals ------------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._death is not None:
            raise RuntimeDiedError(self._death)
        if self._closed:
            raise RuntimeDiedError("the runtime is shutting down")

    async def _send(self, message: FrontendMessage) -> None:
        self._check_usable()
        await self._outbox.send(self._encode(message))

    async def _call(self, make: Callable[[int], FrontendMessage]) -> FlushCacheReply | StatsReply:
        call_id = next(self._call_ids)
        future: asyncio.Future[FlushCacheReply | StatsReply] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            await self._send(make(call_id))
            return await asyncio.wait_for(future, CALL_TIMEOUT)
        finally:
            self._calls.pop(call_id, None)

    async def _read(self) -> None:
        while True:
            message = self._frames(await self._inbox.recv())
            if message is None:
                continue                     # malformed frame: logged and dropped
            if isinstance(message, UpdateBatch):
                for item in message.items:
                    queue = self._streams.get(item.update.rid)
                    if queue is not None:
                        queue.put_nowait(item)
            elif isinstance(message, RequestRejected):
                queue = self._streams.get(message.rid)
                if queue is not None:
                    error = QueueFullError if message.reason == "queue_full" else ValueError
                    queue.put_nowait(error(message.message))
            elif isinstance(message, FlushCacheReply | StatsReply):
                future = self._calls.get(message.call_id)
                if future is not None and not future.done():
                    future.set_result(message)
            else:
                self._frames.drop(f"unexpected {type(message).__name__} while serving")

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_INTERVAL)
            death = self._processes.dead_child()
            if death is not None:
                break
        self._death = death
        logger.error("runtime died: %s; failing %d requests", death, len(self._streams))
        await self._fail_everything(f"the runtime died: {death}")
        for callback in self.on_death:
            callback(death)

    def _abort_nowait(self, rid: int) -> None:
        """Abort without awaiting: the caller may be a cancelled task (client disconnect), which
        cannot await. The message goes out at once (a PUSH socket with room in its queue)."""
        if self.alive and not self._ctx.closed:
            self._outbox.send(self._encode(AbortRequest(rid)))

    async def _fail_everything(self, why: str) -> None:
        """Every stream and call ends with its own ``RuntimeDiedError(why)`` (a shared instance
        would grow its traceback with every handler that raises it). Each stream is failed once:
        it leaves ``_streams`` here."""
        for future in self._calls.values():
            if not future.done():
                future.set_exception(RuntimeDiedError(why))
        for i, rid in enumerate(list(self._streams), 1):
            queue = self._streams.pop(rid, None)
            if queue is None:
                continue                 # failed meanwhile (by a shutdown) or ended
            logger.warning("request %d failed: %s", rid, why)
            queue.put_nowait(RuntimeDiedError(why))
            self._abort_nowait(rid)
            if i % FAIL_BATCH == 0:
                await asyncio.sleep(0)


async def _wait_ready(processes: RuntimeProcesses, inbox: zmq.asyncio.Socket,
                      timeout: float) -> RuntimeReady:
    deadline = time.monotonic() + timeout
    while not await inbox.poll(int(WATCH_INTERVAL * 1000)):
        death = processes.dead_child()
        if death is not None:
            if await inbox.poll(100):   # a RuntimeFailed that explains the death
                break
            raise RuntimeDiedError(f"runtime failed to start: {death}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"runtime not ready after {timeout} s")
    return ready_info(decoder(RuntimeMessage).decode(await inbox.recv()))
