"""One ``radixrelay router --mode precise`` process over a real redis-server, in front of stand-in replicas (real
HTTP servers in this process): started over a stream poisoned with malformed entries (today: a start-up
failure), it routes and serves ``/metrics`` through a replica's load of Infinity or a list (today: 500s);
an address the router was never given that announces itself gets no request (today it joined the pool and
received prompts with their Authorization header); with the store gone, ``/health`` shows the reader
stalled while requests are still answered, routed approximately."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tests.router.kv_entries import append, entry, hello
from tests.router.redis_server import RedisServer
from tests.router.router_process import RouterProcess

ANSWER = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
          "choices": [{"index": 0, "text": " ok", "finish_reason": "length", "logprobs": None}],
          "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}


class StandIn:
    """A replica's stand-in: ``/health`` 200, any POST answered ``ANSWER``; ``seen`` lists each POST's
    ``(path, Authorization header)``."""

    def __init__(self) -> None:
        seen: list[tuple[str, str | None]] = []
        self.seen = seen

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _send(self, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._send({"status": "ok"})

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                seen.append((self.path, self.headers.get("authorization")))
                self._send(ANSWER)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _ask(router: RouterProcess) -> None:
    reply = httpx.post(f"{router.base_url}/v1/completions", timeout=30, headers={"Authorization": "Bearer user-key"},
                       json={"model": "m", "prompt": "The same words each time, a prompt of some length.",
                             "max_tokens": 1})
    assert reply.status_code == 200, reply.text


@pytest.mark.timeout(120)
def test_the_router_survives_its_store_and_trusts_only_its_replicas(tmp_path):
    import redis

    store = RedisServer(tmp_path)
    given, intruder = StandIn(), StandIn()
    client = redis.Redis.from_url(store.url)
    router = None
    try:
        append(client, hello(given.url), hello(given.url, seq=2, page_size=b"sixteen"),
               hello(given.url, seq=3) | {b"replica": b"http://\xff\xfe.test:1"},
               entry("load", given.url, seq=4, load=b'{"running": Infinity, "waiting": 0}'),
               hello(intruder.url, instance="other"))
        router = RouterProcess(tmp_path, given.url, mode="precise", store=store.url)
        # the intruder keeps announcing itself, fresh, while requests come
        for seq in range(2, 12):
            append(client, entry("load", intruder.url, instance="other", seq=seq,
                                 load=b'{"running": 0, "waiting": 0}'))
            _ask(router)
            if seq == 5:                                                # a list for a load, at run time
                append(client, entry("load", given.url, seq=5, load=b"[1, 2]"))
        metrics = httpx.get(f"{router.base_url}/metrics", timeout=5)
        assert metrics.status_code == 200
        assert router.metric('radixrelay_router_kv_events_rejected_total{reason="load"}') == 2
        assert router.metric('radixrelay_router_kv_events_rejected_total{reason="page_size"}') == 1
        assert router.metric('radixrelay_router_kv_events_rejected_total{reason="replica"}') == 1
        assert router.metric('radixrelay_router_kv_events_rejected_total{reason="unknown_replica"}') == 11
        assert intruder.seen == [] and intruder.url not in metrics.text
        assert len(given.seen) == 10 and all(auth == "Bearer user-key" for _, auth in given.seen)
        health = httpx.get(f"{router.base_url}/health", timeout=5).json()
        assert health["replicas_in_pool"] == 1 and health["kv_events"]["reader"] == "ok"

        store.stop()                                                    # the store goes away
        deadline = time.monotonic() + 20
        while (health := httpx.get(f"{router.base_url}/health", timeout=5)).json()["kv_events"]["reader"] != "stalled":
            assert time.monotonic() < deadline, health.text
            time.sleep(0.2)
        assert health.status_code == 200 and health.json()["kv_events"]["seconds_since_read"] > 5
        for _ in range(3):
            _ask(router)                                                # routed approximately meanwhile
        assert router.metric("radixrelay_router_precise_fallbacks_total") == 3
        assert router.metric("radixrelay_router_kv_events_reader_stalled") == 1
    finally:
        if router is not None:
            router.stop()
        client.close()
        store.stop()
        given.stop()
        intruder.stop()
