"""A minimal HTTP/1.1 client over asyncio streams, for benchmarks that must not measure their client.

A general-purpose client (httpx) spends milliseconds of its one event loop per request on its
connection pool and protocol objects; in a burst of a hundred requests that delays the sending of
the last ones by far more than the server takes, and it depends on what the pool held before. Here a
burst's connections are opened before it is timed (as a proxy or a load balancer in front of a
server keeps them), and a request is one write and a read of its answer: its latency is the server's.

Only what ``radixrelay serve`` answers is understood: a status line, headers, then a body of
``Content-Length`` bytes or ``Transfer-Encoding: chunked`` (streams)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit


class HTTPStatusError(Exception):
    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:200]!r}")
        self.status = status


class Connection:
    """One kept-alive connection; one request at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str) -> None:
        self._reader, self._writer, self._host = reader, writer, host

    @classmethod
    async def open(cls, base_url: str) -> Connection:
        parts = urlsplit(base_url)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port or 80, limit=1 << 24)
        return cls(reader, writer, parts.netloc)

    def close(self) -> None:
        self._writer.close()

    async def post_json(self, path: str, body: bytes) -> dict[str, Any]:
        """The decoded JSON answer of a POST; ``HTTPStatusError`` for a status other than 200."""
        await self._send(path, body)
        status, headers = await self._head()
        data = b"".join([chunk async for chunk in self._body(headers)])
        if status != 200:
            raise HTTPStatusError(status, data)
        return json.loads(data)

    async def post_stream(self, path: str, body: bytes) -> AsyncIterator[str]:
        """The lines of a streamed answer (server-sent events), as they arrive."""
        await self._send(path, body)
        status, headers = await self._head()
        if status != 200:
            raise HTTPStatusError(status, b"".join([chunk async for chunk in self._body(headers)]))
        pending = b""
        async for chunk in self._body(headers):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                yield line.rstrip(b"\r").decode()
        if pending:
            yield pending.decode()

    async def _send(self, path: str, body: bytes) -> None:
        head = (f"POST {path} HTTP/1.1\r\nHost: {self._host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        self._writer.write(head + body)
        await self._writer.drain()

    async def _head(self) -> tuple[int, dict[str, str]]:
        raw = await self._reader.readuntil(b"\r\n\r\n")
        status_line, *lines = raw.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        return int(status_line.split()[1]), headers

    async def _body(self, headers: dict[str, str]) -> AsyncIterator[bytes]:
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await self._reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    await self._reader.readuntil(b"\r\n")          # the (empty) trailer's end
                    return
                chunk = await self._reader.readexactly(size + 2)  # the chunk and its CRLF
                yield chunk[:-2]
        else:
            yield await self._reader.readexactly(int(headers.get("content-length", "0")))


async def open_connections(base_url: str, count: int) -> list[Connection]:
    return list(await asyncio.gather(*(Connection.open(base_url) for _ in range(count))))
