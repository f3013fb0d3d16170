"""The frontend's handle on the runtime processes (scheduler + worker), as the HTTP server and the
offline Engine use it. Requests are already tokenized; updates come back as token ids and the
caller detokenizes.

``RuntimeClient`` states the interface; ``radixrelay.runtime.async_client.AsyncRuntimeClient``
implements it over ZMQ (the server), ``radixrelay.runtime.sync_client.SyncRuntimeClient`` is its
blocking counterpart for the Engine. Differences from the first sketch, and why:
- ``generate`` yields ``TokenUpdate`` (a ``RequestUpdate`` plus the logprobs of its tokens): the
  logprobs come from the worker's ``StepOutput`` and must travel with the tokens they belong to;
- ``stats`` returns ``RuntimeStats`` (every process's counters struct, nested) so that /metrics and
  tests see what the scheduler loop and the worker did;
- a full queue raises ``QueueFullError`` (HTTP 429), distinct from invalid requests (ValueError);
- ``info`` exposes what the runtime reported at start-up (KV capacity, context length).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from radixrelay.protocol.messages import RuntimeFailed, RuntimeMessage, RuntimeReady, TokenUpdate
from radixrelay.protocol.stats import RuntimeStats
from radixrelay.sampling_params import SamplingParams


class RuntimeDiedError(RuntimeError):
    """A runtime process exited (or the runtime shut down); in-flight requests end with this."""


class QueueFullError(RuntimeError):
    """The scheduler's waiting queue is at ``max_queued_requests``."""


class RuntimeClient(Protocol):
    @property
    def alive(self) -> bool:
        """False as soon as any child process has died (checked at least every second)."""

    @property
    def info(self) -> RuntimeReady: ...

    def generate(self, token_ids: list[int], sampling: SamplingParams, *,
                 cache_salt: str | None = None, rid: int | None = None) -> AsyncIterator[TokenUpdate]:
        """Submit one request; yields its updates until the one with ``update.finished``.
        Closing the iterator early (client disconnect) aborts the request.
        Raises ``ValueError`` for requests the scheduler refuses (e.g. too long for the KV cache),
        ``QueueFullError`` when the queue is full and ``RuntimeDiedError`` when the runtime dies."""

    async def abort(self, rid: int) -> None: ...

    async def flush_cache(self) -> bool:
        """Drop every unlocked radix-cache entry; False if requests are live."""

    async def stats(self) -> RuntimeStats: ...

    async def shutdown(self, drain_timeout: float = 30.0) -> None:
        """Stop accepting requests, let in-flight ones finish (up to the timeout), stop children."""


def ready_info(message: RuntimeMessage) -> RuntimeReady:
    """The runtime's first message must say it is ready; anything else is a start-up failure."""
    if isinstance(message, RuntimeReady):
        return message
    if isinstance(message, RuntimeFailed):
        raise RuntimeError(message.error)
    raise RuntimeError(f"runtime sent {type(message).__name__} before it was ready")
