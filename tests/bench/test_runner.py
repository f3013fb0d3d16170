"""The runner against a mock server: multi-turn history, arrival times, the concurrency limit, and
token counts without usage."""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np

from radixrelay.bench.http_client import BenchClient, ClientConfig
from radixrelay.bench.runner import run_sessions, token_counter
from radixrelay.bench.workloads import Session, Turn


class MockServer:
    """Replies 'reply N' (N: the request's number) after ``delay`` seconds, without usage."""

    def __init__(self, delay: float) -> None:
        self.delay, self.bodies, self.in_flight, self.max_in_flight = delay, [], 0, 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append(json.loads(request.content))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(self.delay)
        self.in_flight -= 1
        text = f"reply {len(self.bodies)}"
        chunk = {"choices": [{"index": 0, "delta": {"content": text}}]}
        return httpx.Response(200, content=f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())


def run(server: MockServer, sessions, arrivals, max_concurrency=None):
    async def go():
        config = ClientConfig(base_url="http://mock")
        async with BenchClient(config, httpx.MockTransport(server)) as client:
            return await run_sessions(client, sessions, np.asarray(arrivals, dtype=float),
                                      max_concurrency=max_concurrency, counter=token_counter(None))
    return asyncio.run(go())


def test_turns_send_the_growing_history_after_think_time():
    server = MockServer(delay=0.01)
    session = Session("s", "sys", (Turn("one", 2), Turn("two", 3, think_time=0.2)))
    result = run(server, [session], [0.0])
    first, second = server.bodies
    assert first["messages"] == [{"role": "system", "content": "sys"},
                                 {"role": "user", "content": "one"}]
    assert second["messages"] == [*first["messages"], {"role": "assistant", "content": "reply 1"},
                                  {"role": "user", "content": "two"}]
    r1, r2 = result.records
    assert (r1.turn, r2.turn, r2.max_tokens) == (0, 1, 3)
    assert r2.start_s - r1.start_s >= 0.2 + 0.01
    # no usage: token counts estimated from the text ("sys one" and "reply 1")
    assert (r1.token_source, r1.prompt_tokens, r1.completion_tokens) == ("estimate", 2, 2)
    assert r1.cached_tokens is None and r1.ok


def test_arrival_times_and_concurrency_limit():
    sessions = [Session("s", None, (Turn(f"q{i}", 1),)) for i in range(4)]
    server = MockServer(delay=0.05)
    result = run(server, sessions, [0.0, 0.0, 0.3, 0.3])
    assert server.max_in_flight == 2
    starts = [r.start_s for r in result.records]
    assert starts[1] < 0.2 and 0.29 <= starts[2] < 0.5 and result.duration_s >= 0.34

    server = MockServer(delay=0.1)
    result = run(server, sessions, [0.0] * 4, max_concurrency=1)
    assert server.max_in_flight == 1 and sorted(r.session for r in result.records) == [0, 1, 2, 3]
    # timed from sending, not from arrival: the last one waited 0.3 s for its turn
    assert max(r.e2e_ms for r in result.records) < 300


def test_token_counters():
    assert token_counter(None).count("Hello, world!") == 4
    counter = token_counter("default")
    assert counter.name == "tokenizer" and counter.count("the of and to") == 4
