"""The router's exchanges with its replicas (aiohttp's client, a C parser): the session and its timeouts, a
request sent and its whole answer read within ``ProxyLimits``, a stream relayed to the client, a client
that leaves while it waits. A replica's failures surface as ``UPSTREAM_ERRORS`` or ``ProxyError``s (a
redirect, an answer too large); what they mean for the pool is the router's to decide."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TypeVar

import aiohttp
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from radixrelay.router.proxy import ProxyError, ProxyLimits, read_capped, upstream_error

T = TypeVar("T")

# Request headers passed on to the replica (the rest are the router's own connection's).
FORWARDED_HEADERS = ("authorization", "content-type", "accept")
# A replica's failures while the router proxies to it (timeouts included: aiohttp's are both).
UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)
# Seconds an idle connection to a replica is kept for reuse: below the replicas' own keep-alive (uvicorn's
# default, 5 s), so that the router rarely sends a request on a connection the replica is closing.
KEEPALIVE_S = 4.0
# How often a request waiting for its replica's answer checks that its client is still there.
DISCONNECT_POLL_S = 0.1
STREAM_END = b"data: [DONE]\n\n"            # the last event of an OpenAI stream


class ClientGone(Exception):
    """The client disconnected while its request waited for the replica."""


def open_session(limits: ProxyLimits) -> aiohttp.ClientSession:
    """The proxied requests' session: bodies passed through as the replica sent them (no decompression), no
    total timeout (a stream lasts as long as it generates), but connecting and each silence bounded."""
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=limits.upstream_connect_timeout,
                                    sock_read=limits.upstream_read_timeout)
    return aiohttp.ClientSession(connector=connector, auto_decompress=False, timeout=timeout,
                                 skip_auto_headers=("Accept-Encoding", "User-Agent"))


def forwarded_headers(request: Request) -> dict[str, str]:
    """The client's headers a replica reads (``FORWARDED_HEADERS``, ``Authorization`` first of them)."""
    return {k: v for k, v in request.headers.items() if k in FORWARDED_HEADERS}


def refuse_redirect(replica: str, resp: aiohttp.ClientResponse) -> None:
    """A redirect is never followed (``allow_redirects=False`` everywhere): it would send the client's body
    and ``Authorization`` to wherever the replica points."""
    if 300 <= resp.status < 400:
        where = resp.headers.get("location", "")[:200]
        raise upstream_error(502, f"replica {replica} answered {resp.status} (a redirect to {where!r}), which the "
                             "router does not follow", "upstream_redirect")


async def until_client_leaves(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result, unless the client disconnects first: then it is cancelled (closing the upstream
    connection) and ``ClientGone`` raised."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            raise ClientGone


async def post(session: aiohttp.ClientSession, replica: str, url: str, raw: bytes, headers: dict[str, str], *,
               stream: bool, cap: int, on_retry: Callable[[], None]) -> tuple[aiohttp.ClientResponse, bytes | None]:
    """POST ``raw`` to ``url``: (the response, its whole body of at most ``cap`` bytes), or (the response,
    None) for a stream answered 200 (its body not read yet). A redirect, or a whole answer over ``cap``, is
    a ``ProxyError`` (502). Cancelled (the client left) or failed, the connection is closed.
    A connection the replica closed before answering (a kept-alive one it timed out as the request went
    out: no response byte came, so the replica did not take the request) is retried once on a new one
    (``on_retry`` counts it)."""
    try:
        resp = await session.post(url, data=raw, headers=headers, allow_redirects=False)
    except aiohttp.ServerDisconnectedError:
        on_retry()
        resp = await session.post(url, data=raw, headers=headers, allow_redirects=False)
    try:
        refuse_redirect(replica, resp)
        if stream and resp.status == 200:
            return resp, None
        content = await read_capped(resp, cap, replica)
    except BaseException:
        resp.close()
        raise
    resp.release()
    return resp, content


async def get_models(session: aiohttp.ClientSession, replicas: list[str], headers: dict[str, str], cap: int
                     ) -> Response | None:
    """The first of ``replicas`` to answer ``GET /v1/models`` (asked with the client's headers: a replica
    started with ``--api-key`` wants its ``Authorization`` there too), as it answered; None if none did."""
    for replica in replicas:
        try:
            resp = await session.get(f"{replica}/v1/models", headers=headers, allow_redirects=False)
            try:
                refuse_redirect(replica, resp)
                content = await read_capped(resp, cap, replica)
            finally:
                resp.close()
        except UPSTREAM_ERRORS:
            continue
        return Response(content, status_code=resp.status, media_type=resp.headers.get("content-type"))
    return None


def relay(resp: aiohttp.ClientResponse, on_failure: Callable[[BaseException], ProxyError],
          release: Callable[[bool], None]) -> RelayedStream:
    """``resp``'s stream as the client's answer, chunk by chunk as it arrives (each chunk bounded by aiohttp's
    read buffer; no total). A replica that fails or stays silent mid-stream: ``on_failure``'s error as an
    event, then ``data: [DONE]``. Once the answer is over, ``release(ended)`` (``ended``: relayed to its end;
    False when the client left) runs once and the upstream connection is closed, which aborts the request
    on the replica if it was not done."""
    ended = False

    async def chunks() -> AsyncGenerator[bytes, None]:
        nonlocal ended
        tail = b"\n\n"                           # the last bytes relayed: the error event starts an event
        try:
            async for chunk in resp.content.iter_any():
                tail = (tail + chunk)[-len(STREAM_END):]
                yield chunk
                # sent: a client that closes once it has the final event has had the whole answer, though
                # the replica's end of stream may reach the router after it left
                ended = tail == STREAM_END
        except UPSTREAM_ERRORS as exc:
            yield (b"" if tail.endswith(b"\n\n") else b"\n\n") + on_failure(exc).sse()
        ended = True

    def over() -> None:
        resp.close()                             # read to the end or not: this connection is not reused
        release(ended)

    return RelayedStream(chunks(), over, resp.headers.get("content-type"))


class RelayedStream(StreamingResponse):
    """A replica's stream on its way to the client. ``release`` runs exactly once, when the response is over
    (sent whole, failed, or its client left), also when the body was never started (a client that left
    before the first byte): an async generator that never started runs no ``finally`` of its own."""

    def __init__(self, chunks: AsyncGenerator[bytes, None], release: Callable[[], None],
                 media_type: str | None) -> None:
        super().__init__(chunks, status_code=200, media_type=media_type)
        self._chunks = chunks
        self._release: Callable[[], None] | None = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._chunks.aclose()        # a suspended generator (client gone): its cleanup runs now
            finally:
                self.release()

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()
