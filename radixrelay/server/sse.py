"""Server-sent events: message framing and a streaming response that notices disconnects.

``EventStreamResponse`` listens for the client's disconnect while it streams (not only when a write
fails), so a client that goes away during a long prefill is noticed at once; either way it runs
``on_close`` (which aborts the generation and frees its KV) exactly once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import msgspec
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode


def event(payload: Any) -> bytes:
    """One ``data:`` message holding ``payload`` as JSON (a msgspec struct or plain data)."""
    return b"data: " + _encode(payload) + b"\n\n"


class EventStreamResponse(StreamingResponse):
    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:             # the client went away mid-write
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            self._on_close()
