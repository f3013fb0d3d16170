"""Test helper: a tiny ASGI app served by uvicorn behind ``radixrelay.net``'s connection limits, as a real
process (``python -m tests.net.stand_in_app --port P [--http h11|httptools] [...]``, or ``StandInProcess``).
It doubles as a stand-in replica for the router (``/health``; the completion endpoints answer or stream
slowly).

- ``GET /health``: 200 ``{"status": "ok"}``.
- ``POST /echo``: reads the whole body, answers ``{"bytes": N}``.
- ``POST /v1/chat/completions``, ``/v1/completions``: with ``"stream": true``, ``stand_in_chunks`` SSE
  chunks (default 5) ``stand_in_delay`` seconds apart (default 0.2), then ``data: [DONE]``; else one JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import uvicorn

from radixrelay.net.connections import ConnectionLimits, uvicorn_options
from radixrelay.net.log_limits import limit_logs
from tests.runtime.server_process import free_port


async def _body(receive) -> bytes:
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionError("client left")
        body += message.get("body", b"")
        if not message.get("more_body", False):
            return bytes(body)


async def _send_json(send, status: int, payload: dict) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def app(scope, receive, send) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    path, method = scope["path"], scope["method"]
    if path == "/health":
        await _send_json(send, 200, {"status": "ok"})
        return
    try:
        raw = await _body(receive)
    except ConnectionError:
        return
    if path == "/echo":
        await _send_json(send, 200, {"bytes": len(raw)})
        return
    if method != "POST" or path not in ("/v1/chat/completions", "/v1/completions"):
        await _send_json(send, 404, {"error": {"message": "not found", "type": "invalid_request_error",
                                               "param": None, "code": None}})
        return
    request = json.loads(raw or b"{}")
    if not request.get("stream"):
        await _send_json(send, 200, {"id": "stand-in", "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hello"}, "finish_reason": "stop"}]})
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream")]})
    for i in range(int(request.get("stand_in_chunks", 5))):
        chunk = {"id": "stand-in", "object": "chat.completion.chunk",
                 "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}]}
        await send({"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\n".encode(),
                    "more_body": True})
        await asyncio.sleep(float(request.get("stand_in_delay", 0.2)))
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


REPO = Path(__file__).resolve().parents[2]         # ``-m tests.net.stand_in_app`` is found from there


class StandInProcess:
    """This app as a process on a free port (``args``: its flags), its output in ``log``."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp_path / f"stand-in-{self.port}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.net.stand_in_app", "--port", str(self.port),
                                          *args], stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        end = time.monotonic() + 30
        while time.monotonic() < end:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"stand-in not ready:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--http", default="auto", choices=("auto", "httptools", "h11"))
    parser.add_argument("--request-read-timeout", type=float, default=30.0)
    parser.add_argument("--max-connections", type=int, default=None)
    parser.add_argument("--fd-limit", type=int, default=None, help="set RLIMIT_NOFILE (soft and hard) first")
    args = parser.parse_args()
    if args.fd_limit is not None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (args.fd_limit, args.fd_limit))
    logging.basicConfig(level="INFO", format="%(asctime)s %(name)s %(levelname)s %(message)s")
    limits = ConnectionLimits(args.request_read_timeout, args.max_connections).resolved()
    config = uvicorn.Config(app, host="127.0.0.1", port=args.port, log_level="info", access_log=False,
                            loop="asyncio", **uvicorn_options(limits, args.http))
    limit_logs()
    uvicorn.Server(config).run()


if __name__ == "__main__":
    main()
