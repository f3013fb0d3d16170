"""The router against a replica that closes a kept-alive connection as a request goes out on it (a replica's
idle timeout racing the router's reuse of the connection: what a real replica does only by chance, so a
stand-in HTTP server does it on purpose here): the request is sent again on a new connection and answered,
the replica stays in the pool, and the retry is counted; a replica that drops every request is an upstream
error (502 in OpenAI's error shape), not a hang."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tests.router.router_process import RouterProcess

ANSWER = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
          "choices": [{"index": 0, "text": " ok", "finish_reason": "length", "logprobs": None}],
          "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}


class _Replica(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"          # keep-alive, as uvicorn
    drops: list[int]                       # POSTs still to drop (class attribute, set per server)

    def log_message(self, *args) -> None:
        pass

    def _send(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:           # /health, /v1/models
        self._send({"object": "list", "data": [{"id": "m", "object": "model"}]})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        if self.drops[0] > 0:           # closed without an answer
            self.drops[0] -= 1
            self.close_connection = True
            return
        self._send(ANSWER)


def _serve(drops: int) -> tuple[ThreadingHTTPServer, str]:
    handler = type("Replica", (_Replica,), {"drops": [drops]})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.mark.timeout(120)
def test_a_connection_closed_before_the_answer_is_retried_once(tmp_path):
    flaky, flaky_url = _serve(drops=1)
    dead, dead_url = _serve(drops=10**6)
    router = RouterProcess(tmp_path, flaky_url, mode="round-robin")
    try:
        body = {"model": "m", "prompt": "hello", "max_tokens": 1}
        reply = httpx.post(f"{router.base_url}/v1/completions", json=body, timeout=30)
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == " ok"
        assert 'radixrelay_router_upstream_retries_total{replica="%s"} 1.0' % flaky_url in router.metrics()
        assert httpx.post(f"{router.base_url}/v1/completions", json=body, timeout=30).status_code == 200
    finally:
        router.stop()
    router = RouterProcess(tmp_path, dead_url, mode="round-robin")
    try:
        reply = httpx.post(f"{router.base_url}/v1/completions", json=body, timeout=30)
        assert reply.status_code == 502 and reply.json()["error"]["type"] == "upstream_error"
    finally:
        router.stop()
        flaky.shutdown()
        dead.shutdown()
