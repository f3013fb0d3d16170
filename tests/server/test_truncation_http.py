"""``--truncation`` over HTTP with the official client: a conversation that outgrows the context is
served with its oldest tokens dropped (and its cached KV re-positioned from host memory) instead of
refused; a max_tokens no truncation can make room for is still a 400. The server runs the tiny dummy
model of ``tests/runtime/server_process.py`` (what is tested is which tokens are kept, not their words)."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.runtime.server_process import ServerProcess

CONTEXT = 256


@pytest.fixture(scope="module")
def client(tmp_path_factory, tiny_model):
    srv = ServerProcess(tmp_path_factory.mktemp("trunc"), *tiny_model, "--kv-cache-tokens", "1024", "--context-length",
                        str(CONTEXT), "--truncation", "0.5", "--host-kv-gib", "0.05")
    try:
        srv.wait_ready()
        yield openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0, timeout=120), srv
    finally:
        srv.stop()


def test_overflowing_chat_is_truncated_not_refused(client):
    api, srv = client
    history = [{"role": "user", "content": " ".join(f"fact{i} is stone" for i in range(45))}]
    first = api.chat.completions.create(model="default", messages=history, max_tokens=8, temperature=0)
    assert first.usage.prompt_tokens + 8 <= CONTEXT
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": " ".join(f"more{i} is sand" for i in range(20))}]
    second = api.chat.completions.create(model="default", messages=history, max_tokens=8, temperature=0)
    assert second.choices[0].finish_reason == "length"
    assert second.usage.prompt_tokens + 8 <= CONTEXT
    metrics = httpx.get(f"{srv.base_url}/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith("radixrelay_kv_tier_repositioned_tokens"))
    assert float(line.split()[-1]) > 0


def test_max_tokens_beyond_any_truncation_is_a_400(client):
    api, _ = client
    with pytest.raises(openai.BadRequestError, match="cannot make it fit"):
        api.completions.create(model="default", prompt="word " * 300, max_tokens=250)


def test_a_huge_prompt_is_truncated_holding_only_what_it_keeps(client):
    api, srv = client
    words = " ".join(f"w{i % 977}x{i % 13}" for i in range(100_000))     # ~0.9 MB, ~300K tokens: 1,000 contexts
    out = api.completions.create(model="default", prompt=words + " The end.", max_tokens=8, temperature=0)
    assert 8 < out.usage.prompt_tokens and out.usage.prompt_tokens + 8 <= CONTEXT
    assert httpx.get(f"{srv.base_url}/health", timeout=5).status_code == 200
