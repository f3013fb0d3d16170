"""``SyncRuntimeClient``: the runtime over blocking ZMQ sockets, for the offline Engine.

The Engine is single-threaded: it submits requests and then pulls scheduler messages with
``recv`` until its requests finish. ``recv`` blocks in slices of ``WATCH_INTERVAL`` and checks the
children between slices, so a dead runtime raises ``RuntimeDiedError`` instead of hanging.
"""

from __future__ import annotations

import itertools
import time
from collections import deque

import numpy as np
import zmq

from radixrelay.config import EngineConfig
from radixrelay.protocol.messages import (
    AbortRequest, FlushCacheReply, FlushCacheRequest, FrontendMessage, GenerateRequest, PinSpec, RuntimeMessage,
    RuntimeReady, ShutdownRequest, StatsReply, StatsRequest, decoder, encoder,
)
from radixrelay.protocol.stats import RuntimeStats
from radixrelay.protocol.step import ModuleSpan
from radixrelay.runtime.async_client import WATCH_INTERVAL
from radixrelay.runtime.client import RuntimeDiedError, ready_info
from radixrelay.runtime.launcher import RuntimeProcesses
from radixrelay.protocol.token_ids import pack_token_ids
from radixrelay.sampling_params import SamplingParams

_POLL_MS = int(WATCH_INTERVAL * 1000)


class SyncRuntimeClient:
    def __init__(self, config: EngineConfig) -> None:
        self._processes = RuntimeProcesses(config)
        self._ctx = zmq.Context()
        self._inbox = self._ctx.socket(zmq.PULL)
        self._inbox.bind(self._processes.endpoints.scheduler_to_frontend)
        self._outbox = self._ctx.socket(zmq.PUSH)
        self._outbox.connect(self._processes.endpoints.frontend_to_scheduler)
        self._encode = encoder().encode
        self._decode = decoder(RuntimeMessage).decode
        self._call_ids = itertools.count()
        self._backlog: deque[RuntimeMessage] = deque()   # read while waiting for a call's reply
        self._closed = False
        try:
            self._processes.spawn()
            self.info: RuntimeReady = ready_info(self._recv_raw(config.startup_timeout, starting=True))
            self._processes.watch_hangs = True
        except BaseException:
            self._ctx.destroy(linger=0)
            self._processes.stop(0.0)
            raise

    def submit(self, rid: int, token_ids: list[int] | np.ndarray, sampling: SamplingParams,
               cache_salt: str | None = None, shifted_prefix: list[int] | None = None,
               shifted_at: int = 0, modules: list[ModuleSpan] | None = None,
               rope_runs: list[tuple[int, int]] | None = None, pins: list[PinSpec] | None = None,
               priority: int = 0) -> None:
        """``token_ids``: a numpy integer array is sent packed (``runtime/token_ids.py``). ``pins``,
        ``priority``: see ``Scheduler.add_request``."""
        self._send(GenerateRequest(rid, pack_token_ids(token_ids), sampling, cache_salt, shifted_prefix or [],
                                   shifted_at, modules or [], rope_runs or [], pins or [], priority))

    def abort(self, rid: int) -> None:
        self._send(AbortRequest(rid))

    def recv(self) -> RuntimeMessage:
        """The next scheduler message (updates or a rejection); blocks."""
        if self._backlog:
            return self._backlog.popleft()
        return self._recv_raw(None)

    def stats(self) -> RuntimeStats:
        reply = self._call(StatsRequest)
        assert isinstance(reply, StatsReply)
        return reply.stats

    def flush_cache(self) -> bool:
        reply = self._call(FlushCacheRequest)
        assert isinstance(reply, FlushCacheReply)
        return reply.flushed

    def close(self) -> None:
        """Stop the children and remove the socket directory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._processes.dead_child() is None:
            self._outbox.send(self._encode(ShutdownRequest()))
        self._ctx.destroy(linger=100)
        self._processes.stop()

    # -- internals ------------------------------------------------------------------------------

    def _send(self, message: FrontendMessage) -> None:
        if self._closed:
            raise RuntimeDiedError("the engine is closed")
        self._outbox.send(self._encode(message))

    def _call(self, make: type[StatsRequest] | type[FlushCacheRequest]) -> RuntimeMessage:
        call_id = next(self._call_ids)
        self._send(make(call_id))
        while True:
            message = self._recv_raw(None)
            if isinstance(message, StatsReply | FlushCacheReply) and message.call_id == call_id:
                return message
            self._backlog.append(message)

    def _recv_raw(self, timeout: float | None, starting: bool = False) -> RuntimeMessage:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._inbox.poll(_POLL_MS):
            death = self._processes.dead_child()
            if death is not None:
                if self._inbox.poll(100):     # the message that explains the death, if any
                    break
                raise RuntimeDiedError(f"the runtime {'failed to start' if starting else 'died'}: {death}")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"runtime not ready after {timeout} s")
        return self._decode(self._inbox.recv())
