"""The timing client against canned HTTP responses (httpx.MockTransport) and a closed port."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx

from radixrelay.bench.http_client import STREAMS_PER_POOL, BenchClient, ClientConfig, render_prompt, served_model

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def sse(*payloads) -> bytes:
    return b"".join(b"data: " + (p if isinstance(p, bytes) else json.dumps(p).encode()) + b"\n\n"
                    for p in payloads)


def chat_chunk(content=None, role=None):
    delta = {k: v for k, v in (("role", role), ("content", content)) if v is not None}
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}], "usage": None}


USAGE = {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15,
                                  "prompt_tokens_details": {"cached_tokens": 8}}}


def send(handler, messages=MESSAGES, max_tokens=3, **config):
    seen = []

    def record(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return handler(request)

    async def go():
        cfg = ClientConfig(base_url="http://bench.test", **config)
        async with BenchClient(cfg, transport=httpx.MockTransport(record)) as client:
            return await client.send(messages, max_tokens)

    return asyncio.run(go()), seen


def test_chat_stream_times_chunks_and_reads_usage():
    body = sse(chat_chunk("", role="assistant"), chat_chunk("Hel"), chat_chunk("lo"), chat_chunk("!"),
               USAGE, b"[DONE]")
    reply, [request] = send(lambda r: httpx.Response(200, content=body), api_key="k", model="m")
    assert reply.ok and reply.error is None and reply.text == "Hello!"
    assert reply.ttft is not None and len(reply.itl) == 2 and reply.latency >= reply.ttft
    assert (reply.prompt_tokens, reply.completion_tokens, reply.cached_tokens) == (12, 3, 8)
    assert request.url.path == "/v1/chat/completions"
    assert request.headers["authorization"] == "Bearer k"
    assert json.loads(request.content) == {
        "model": "m", "max_tokens": 3, "temperature": 0.0, "stream": True, "ignore_eos": True,
        "stream_options": {"include_usage": True}, "messages": MESSAGES}


def test_completions_stream_without_usage():
    chunks = [{"choices": [{"index": 0, "text": t}]} for t in ("a", "b")]
    reply, [request] = send(lambda r: httpx.Response(200, content=sse(*chunks, b"[DONE]")),
                            endpoint="completions", ignore_eos=False)
    assert reply.ok and reply.text == "ab" and reply.prompt_tokens is None
    body = json.loads(request.content)
    assert request.url.path == "/v1/completions" and "ignore_eos" not in body
    assert body["prompt"] == "System: Be brief.\n\nUser: Hi\n\nAssistant:"


def test_render_prompt():
    assert render_prompt([{"role": "user", "content": "just this"}]) == "just this"


def test_non_streaming():
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Hey"}}],
            "usage": USAGE["usage"]}
    reply, [request] = send(lambda r: httpx.Response(200, json=body), stream=False)
    assert reply.ok and reply.text == "Hey" and reply.ttft is not None and reply.itl == []
    assert reply.completion_tokens == 3 and "stream_options" not in json.loads(request.content)


def test_http_error_status():
    error = {"error": {"message": "model 'x' is not served", "type": "invalid_request_error"}}
    reply, _ = send(lambda r: httpx.Response(400, json=error))
    assert not reply.ok and reply.error == "HTTP 400: model 'x' is not served"
    reply, _ = send(lambda r: httpx.Response(502, content=b"bad gateway"))
    assert reply.error == "HTTP 502: bad gateway"


def test_error_event_mid_stream():
    body = sse(chat_chunk("partial"), {"error": {"message": "runtime died", "type": "server_error"}},
               b"[DONE]")
    reply, _ = send(lambda r: httpx.Response(200, content=body))
    assert not reply.ok and reply.error == "stream error: runtime died"


def test_truncated_empty_or_malformed_streams():
    reply, _ = send(lambda r: httpx.Response(200, content=sse(b"[DONE]")))
    assert reply.error == "stream ended without any output"
    reply, _ = send(lambda r: httpx.Response(200, content=b"data: {not json\n\n"))
    assert not reply.ok and reply.error.startswith("bad response:")
    reply, _ = send(lambda r: httpx.Response(200, content=sse(chat_chunk("cut"))))
    assert not reply.ok and reply.error == "stream ended before 'data: [DONE]'" and reply.text == "cut"


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_dead_server_is_an_error_not_an_exception():
    url = f"http://127.0.0.1:{closed_port()}"

    async def go():
        async with BenchClient(ClientConfig(base_url=url, timeout=5)) as client:
            return await client.send(MESSAGES, 3), await served_model(url, None, timeout=5)

    reply, model = asyncio.run(go())
    assert not reply.ok and reply.error.startswith("ConnectError") and model is None


def test_concurrent_streams_spread_over_pools_of_bounded_size():
    """Requests in flight fill connection pools of STREAMS_PER_POOL; finished ones free their slot."""
    in_flight, most = 0, 0

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        await asyncio.sleep(0.05)
        in_flight -= 1
        return httpx.Response(200, content=sse(chat_chunk("x"), b"[DONE]"))

    async def go():
        async with BenchClient(ClientConfig(base_url="http://mock"), httpx.MockTransport(handler)) as client:
            first = await asyncio.gather(*(client.send(MESSAGES, 1) for _ in range(STREAMS_PER_POOL + 5)))
            pools = len(client._pools)
            second = await asyncio.gather(*(client.send(MESSAGES, 1) for _ in range(STREAMS_PER_POOL + 5)))
            return first + second, pools, len(client._pools)

    replies, pools, pools_after = asyncio.run(go())
    assert all(r.ok and r.text == "x" for r in replies)
    assert most == STREAMS_PER_POOL + 5
    assert pools == pools_after == 2        # the second wave reuses the first wave's slots
