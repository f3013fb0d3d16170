"""Test helpers: raw sockets against an HTTP front, for its connection limits (``radixrelay.net``).

Half-sent requests are written by hand (no HTTP client sends half a request); ``wait_closed`` reads every
socket until the server closes it, with one selector over all of them."""

from __future__ import annotations

import json
import resource
import selectors
import socket
import time
from dataclasses import dataclass

# Half a request head (the header block never ends), and a whole head with half its body.
PARTIAL_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: applic"
PARTIAL_BODY = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n{\"model\": ")


def raise_fd_limit(at_least: int) -> None:
    """This (test) process's soft descriptor limit raised to its hard one; skips the test when that is too low."""
    import pytest

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < at_least:
        pytest.skip(f"needs {at_least} descriptors, the hard limit is {hard}")
    if soft != resource.RLIM_INFINITY and soft < at_least:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


@dataclass
class Conn:
    sock: socket.socket
    opened: float                       # time.monotonic() when connected
    data: bytes = b""
    closed: float | None = None         # when the server closed it (EOF or reset)
    reset: bool = False

    def status(self) -> int | None:
        return int(self.data.split(b" ", 2)[1]) if self.data.startswith(b"HTTP/1.1 ") else None

    def error(self) -> dict:
        """The OpenAI error of the response's JSON body."""
        return json.loads(self.data.split(b"\r\n\r\n", 1)[1])["error"]


def open_conns(port: int, n: int, payloads: tuple[bytes, ...] = (b"",)) -> list[Conn]:
    """``n`` connections, connection i sending ``payloads[i % len(payloads)]`` (b"": nothing)."""
    conns = []
    for i in range(n):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        conns.append(Conn(sock, time.monotonic()))
        payload = payloads[i % len(payloads)]
        if payload:
            sock.sendall(payload)
    return conns


def wait_closed(conns: list[Conn], timeout: float) -> list[Conn]:
    """Read every connection until the server closes it or ``timeout`` passes; the ones still open."""
    with selectors.DefaultSelector() as sel:
        for c in conns:
            c.sock.setblocking(False)
            sel.register(c.sock, selectors.EVENT_READ, c)
        end = time.monotonic() + timeout
        while sel.get_map() and time.monotonic() < end:
            for key, _ in sel.select(timeout=max(0.0, end - time.monotonic())):
                c = key.data
                try:
                    chunk = c.sock.recv(65536)
                except BlockingIOError:
                    continue
                except ConnectionResetError:
                    chunk, c.reset = b"", True
                if chunk:
                    c.data += chunk
                    continue
                c.closed = time.monotonic()
                sel.unregister(c.sock)
        return [key.data for key in sel.get_map().values()]


def close_all(conns: list[Conn]) -> None:
    for c in conns:
        c.sock.close()


def send_slowly(port: int, head: bytes, body: bytes, pieces: int, pause_s: float, timeout: float = 60) -> Conn:
    """One request whose body goes out in ``pieces`` parts ``pause_s`` apart; the whole response read."""
    c = open_conns(port, 1, (head,))[0]
    step = -(-len(body) // pieces)
    for i in range(0, len(body), step):
        time.sleep(pause_s)
        c.sock.sendall(body[i:i + step])
    wait_closed([c], timeout)
    return c


def post_head(path: str, body: bytes, close: bool = True) -> bytes:
    """The head of a POST of ``body`` (JSON) to ``path``; ``close``: the server closes after answering."""
    lines = [f"POST {path} HTTP/1.1", "Host: test", "Content-Type: application/json", f"Content-Length: {len(body)}"]
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()
