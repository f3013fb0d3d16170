"""The OpenAI-compatible server as a real process, driven by the official openai client.

One server for the whole module; every test leaves it idle. It runs the tiny dummy model of
``tests/runtime/server_process.py`` (the default model's tokenizer, chat template and context, random
weights): what is tested is the API, and greedy outputs agree with each other and with an offline
Engine of the same model whatever the words are. The one test that needs the model's own end of text
(``min_tokens`` holding EOS back) runs on the session's hostile-input server (``conftest.py``: the
default model, also served as "relay"). Death, drain and queue limits have their own servers in
``test_lifecycle.py``.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest

from tests.runtime.server_process import TINY_ENGINE, ServerProcess

pytestmark = pytest.mark.timeout(300)
API_KEY = "test-key-123"
MAX_N = 4
BODY_CAP = 64 * 1024
PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model):
    # the last --served-model-name given wins: "relay", not tiny_model's
    srv = ServerProcess(tmp_path_factory.mktemp("api"), *tiny_model, "--kv-cache-tokens", "4096",
                        "--api-key", API_KEY, "--max-n", str(MAX_N),
                        "--max-body-bytes", str(BODY_CAP), "--served-model-name", "relay")
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as h:
        yield h


def metrics(http: httpx.Client) -> dict[str, float]:
    out = {}
    for line in http.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def sse_events(response: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def chat(client, content: str, **kw):
    return client.chat.completions.create(model="relay", messages=[{"role": "user", "content": content}], **kw)


# -- endpoints ----------------------------------------------------------------------------------


def test_models_health_metrics(client, http):
    assert [m.id for m in client.models.list().data] == ["relay"]
    assert http.get("/health").json() == {"status": "ok"}
    text = http.get("/metrics").text
    for name in ("radixrelay_num_requests_running", "radixrelay_num_requests_waiting",
                 "radixrelay_kv_cache_usage_ratio", "radixrelay_cache_hit_tokens_total",
                 "radixrelay_prompt_tokens_total", "radixrelay_generation_tokens_total",
                 "radixrelay_time_to_first_token_seconds_bucket",
                 "radixrelay_inter_token_latency_seconds_bucket", "radixrelay_cascade_steps_total",
                 "radixrelay_worker_busy_seconds_total", "radixrelay_scheduler_busy_seconds_total",
                 "radixrelay_prefill_cascade_steps_total", "radixrelay_prefill_cascade_tokens_read_once_total",
                 "radixrelay_prefill_long_prefix_runs_total", "radixrelay_decode_only_steps_total",
                 "radixrelay_worker_decode_only_launch_seconds_total"):
        assert name in text, name
    # Every runtime process froze its start-up heap out of the garbage collector (gc_control).
    m = metrics(http)
    for process in ("worker", "scheduler", "frontend"):
        assert m[f"radixrelay_{process}_gc_frozen_objects"] > 1000, process
        assert m[f"radixrelay_{process}_gc_seconds_total"] >= 0


def test_chat_completion(client, http):
    before = metrics(http)
    out = chat(client, "Say hello.", max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert out.object == "chat.completion" and out.model == "relay"
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert out.usage.completion_tokens == 3
    assert out.usage.total_tokens == out.usage.prompt_tokens + 3
    assert out.usage.prompt_tokens_details.cached_tokens >= 0
    after = metrics(http)
    assert after["radixrelay_generation_tokens_total"] - before["radixrelay_generation_tokens_total"] == 3
    assert after["radixrelay_time_to_first_token_seconds_count"] > before["radixrelay_time_to_first_token_seconds_count"]


def test_chat_stream_equals_non_stream(client, http):
    kw = dict(max_tokens=4, temperature=0)
    full = chat(client, "Name a fruit.", **kw)
    stream = chat(client, "Name a fruit.", stream=True, stream_options={"include_usage": True}, **kw)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    # The raw stream ends with [DONE].
    body = {"model": "relay", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1])


def test_completions_stream_echo_and_token_prompt(client, server):
    tokenizer_ids = client.completions.create(model="relay", prompt=PROMPTS[0], max_tokens=3,
                                              temperature=0)
    text = tokenizer_ids.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="relay", prompt=PROMPTS[0], max_tokens=3, temperature=0, stream=True))
    assert streamed == text
    echoed = client.completions.create(model="relay", prompt=PROMPTS[0], max_tokens=3, temperature=0,
                                       echo=True)
    assert echoed.choices[0].text == PROMPTS[0] + text
    echoed_stream = "".join(c.choices[0].text for c in client.completions.create(
        model="relay", prompt=PROMPTS[0], max_tokens=3, temperature=0, echo=True, stream=True))
    assert echoed_stream == PROMPTS[0] + text
    # A batch of prompts, one as token ids: choices are ordered prompt-major.
    batch = client.completions.create(model="relay", prompt=[PROMPTS[0], PROMPTS[2]], max_tokens=2,
                                      temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text == text[: len(batch.choices[0].text)]


def test_n_seed_and_sampling_parameters(client):
    kw = dict(model="relay", prompt="Once upon a time", max_tokens=4, temperature=1.0, top_p=0.9,
              seed=1234, presence_penalty=0.5, frequency_penalty=0.3,
              extra_body={"top_k": 40, "min_p": 0.05})
    first = client.completions.create(n=3, **kw)
    again = client.completions.create(n=3, **kw)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]    # seeded
    assert len({c.text for c in first.choices}) > 1                             # seed + j per sample
    single = client.completions.create(n=1, **{**kw, "max_tokens": 1})
    assert first.usage.prompt_tokens == single.usage.prompt_tokens          # the prompt counts once
    assert 3 <= first.usage.completion_tokens <= 12


def test_stop_strings_and_max_completion_tokens(client):
    base = client.completions.create(model="relay", prompt=PROMPTS[2], max_tokens=8, temperature=0).choices[0].text
    stop = base[3:6]
    one = client.completions.create(model="relay", prompt=PROMPTS[2], max_tokens=8, temperature=0, stop=stop)
    assert one.choices[0].finish_reason == "stop" and one.choices[0].text == base[: base.index(stop)]
    many = client.completions.create(model="relay", prompt=PROMPTS[2], max_tokens=8, temperature=0,
                                     stop=["zzz", stop])
    assert many.choices[0].text == one.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="relay", prompt=PROMPTS[2], max_tokens=8, temperature=0, stop=[stop], stream=True))
    assert streamed == one.choices[0].text
    capped = chat(client, "Count to ten.", max_completion_tokens=2, temperature=0, extra_body={"ignore_eos": True})
    assert capped.usage.completion_tokens == 2 and capped.choices[0].finish_reason == "length"


def test_logprobs(client):
    out = chat(client, "Say yes.", max_tokens=2, temperature=0, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens or len(content) == out.usage.completion_tokens - 1
    assert "".join(t.token for t in content) == out.choices[0].message.content
    for tok in content:
        assert tok.logprob <= 0 and len(tok.top_logprobs) == 3
        assert tok.top_logprobs[0].logprob >= tok.logprob - 1e-5     # greedy: the best token
    comp = client.completions.create(model="relay", prompt=PROMPTS[0], max_tokens=2, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert "".join(lp.tokens) == comp.choices[0].text
    assert all(len(t) == 2 for t in lp.top_logprobs) and lp.text_offset[0] == 0
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model="relay", prompt=PROMPTS[0], max_tokens=2, temperature=0, logprobs=2, stream=True)
        if c.choices[0].logprobs]
    assert sum((s.token_logprobs for s in streamed), []) == pytest.approx(lp.token_logprobs, abs=1e-4)


def _check_echo_logprobs(lp, text: str, num_prompt: int) -> None:
    """OpenAI's legacy format over an echoed prompt: tokens spell the text, offsets count from 0."""
    assert "".join(lp.tokens) == text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert len(lp.tokens) >= num_prompt


def test_echo_with_logprobs_returns_prompt_logprobs(client):
    prompt = "Echo the prompt logprobs: the quick brown fox"
    kw = dict(model="relay", temperature=0, logprobs=2)
    plain = client.completions.create(prompt=prompt, max_tokens=2, **kw)
    out = client.completions.create(prompt=prompt, max_tokens=2, echo=True, **kw)
    choice, n = out.choices[0], out.usage.prompt_tokens
    assert choice.text == prompt + plain.choices[0].text
    _check_echo_logprobs(choice.logprobs, choice.text, n)
    assert len(choice.logprobs.tokens) == n + out.usage.completion_tokens
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs[1:])
    assert choice.logprobs.token_logprobs[n:] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-4)
    streamed = [c.choices[0] for c in client.completions.create(prompt=prompt, max_tokens=2, echo=True,
                                                                stream=True, **kw)]
    assert "".join(c.text for c in streamed) == choice.text
    parts = [c.logprobs for c in streamed if c.logprobs]
    assert sum((p.tokens for p in parts), []) == choice.logprobs.tokens
    assert sum((p.text_offset for p in parts), []) == choice.logprobs.text_offset
    values = sum((p.token_logprobs for p in parts), [])
    assert values[0] is None and values[1:] == pytest.approx(choice.logprobs.token_logprobs[1:], abs=1e-4)
    # A list of prompts; max_tokens 0 (with echo only) returns just the prompts, as vLLM does.
    batch = client.completions.create(prompt=[prompt, *PROMPTS], max_tokens=0, echo=True, model="relay",
                                      logprobs=0)
    assert [c.text for c in batch.choices] == [prompt, *PROMPTS]
    for c in batch.choices:
        _check_echo_logprobs(c.logprobs, c.text, 1)
        assert all(top == {} for top in c.logprobs.top_logprobs[1:])
    assert len(batch.choices[0].logprobs.tokens) == n
    assert batch.choices[0].logprobs.token_logprobs[1:] == pytest.approx(choice.logprobs.token_logprobs[1:n],
                                                                          abs=1e-4)


def test_cached_tokens_and_cache_salt(client, http):
    prompt = " ".join(f"shared{i}" for i in range(50))
    client.completions.create(model="relay", prompt=prompt, max_tokens=1)
    hits_before = metrics(http)["radixrelay_cache_hit_tokens_total"]
    again = client.completions.create(model="relay", prompt=prompt, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens >= 128
    assert metrics(http)["radixrelay_cache_hit_tokens_total"] - hits_before >= 128
    salted = client.completions.create(model="relay", prompt=prompt, max_tokens=1, extra_body={"cache_salt": "a"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    salted = client.completions.create(model="relay", prompt=prompt, max_tokens=1, extra_body={"cache_salt": "a"})
    assert salted.usage.prompt_tokens_details.cached_tokens >= 128
    other = client.completions.create(model="relay", prompt=prompt, max_tokens=1, extra_body={"cache_salt": "b"})
    assert other.usage.prompt_tokens_details.cached_tokens == 0


def test_flush_cache(client, http):
    prompt = " ".join(f"flush{i}" for i in range(20))
    client.completions.create(model="relay", prompt=prompt, max_tokens=1)
    assert http.post("/flush_cache").json() == {"flushed": True}
    assert metrics(http)["radixrelay_radix_cached_tokens"] == 0
    out = client.completions.create(model="relay", prompt=prompt, max_tokens=1)
    assert out.usage.prompt_tokens_details.cached_tokens == 0


def test_pinned_prefixes_and_priority(client, http):
    # the default pinned budget: a quarter of the 4,096-token cache
    system = " ".join(f"pinned{i}" for i in range(45))
    mark = {"type": "ephemeral", "ttl": "1h"}
    messages = [{"role": "system", "content": system, "cache_control": mark},
                {"role": "user", "content": "Hello there, how are you today?"}]
    first = client.chat.completions.create(model="relay", messages=messages, max_tokens=1)
    m = metrics(http)
    pinned = m["radixrelay_radix_pinned_tokens"]
    assert m["radixrelay_pinned_prefixes"] == 1 and pinned % 16 == 0
    assert 128 <= pinned <= first.usage.prompt_tokens - 10        # up to the system message, not the user's
    again = client.chat.completions.create(model="relay", max_tokens=1,
                                           messages=[messages[0], {"role": "user", "content": "Bye"}])
    assert again.usage.prompt_tokens_details.cached_tokens >= pinned
    assert metrics(http)["radixrelay_pin_hits_total"] >= 1
    long_prompt = " ".join(f"long{i}" for i in range(700))          # > 1,024 tokens: past the budget
    with pytest.raises(openai.BadRequestError, match="pinned KV budget"):
        client.completions.create(model="relay", prompt=long_prompt, max_tokens=1,
                                  extra_body={"prompt_cache_retention": "24h"})
    with pytest.raises(openai.BadRequestError, match="--enable-priority"):
        client.completions.create(model="relay", prompt="Hi", max_tokens=1, extra_body={"priority": -1})
    bad = [{"role": "user", "content": "Hi", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]
    with pytest.raises(openai.BadRequestError, match="ttl"):
        client.chat.completions.create(model="relay", messages=bad, max_tokens=1)
    assert http.post("/flush_cache").json() == {"flushed": True}          # drops the pins too
    m = metrics(http)
    assert m["radixrelay_pinned_prefixes"] == 0 == m["radixrelay_radix_cached_tokens"]


def _assert_kv_freed(http: httpx.Client) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        m = metrics(http)
        if m["radixrelay_num_requests_running"] == 0 and m["radixrelay_kv_used_pages"] == 0:
            break
        time.sleep(0.1)
    assert m["radixrelay_num_requests_running"] == 0
    assert m["radixrelay_kv_used_pages"] == 0          # aborted: nothing kept, nothing leaked


LONG_BODY = {"model": "relay", "prompt": "Write a long story about a dragon.", "max_tokens": 4000,
             "temperature": 0, "ignore_eos": True}


def test_disconnect_mid_stream_frees_kv(http):
    assert http.post("/flush_cache").status_code == 200
    with http.stream("POST", "/v1/completions", json={**LONG_BODY, "stream": True}) as r:
        lines = r.iter_lines()
        got = [line for line, _ in zip(lines, range(3)) if line.startswith("data:")]
        assert got
        assert metrics(http)["radixrelay_num_requests_running"] == 1
    _assert_kv_freed(http)


def test_disconnect_while_waiting_for_a_full_response_frees_kv(server, http):
    assert http.post("/flush_cache").status_code == 200
    with pytest.raises(httpx.ReadTimeout):     # the client gives up and closes the connection
        httpx.post(f"{server.base_url}/v1/completions", json=LONG_BODY, timeout=1.0,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    _assert_kv_freed(http)


def test_server_equals_offline_engine(client, tiny_model_dir):
    from radixrelay import Engine, SamplingParams

    served = [c.text for c in client.completions.create(model="relay", prompt=PROMPTS, max_tokens=8, temperature=0,
                                                        extra_body={"ignore_eos": True}).choices]
    echoed = client.completions.create(model="relay", prompt=PROMPTS, max_tokens=1, temperature=0, echo=True,
                                       logprobs=1).choices
    with Engine(model=str(tiny_model_dir), **TINY_ENGINE, kv_cache_tokens=2048) as engine:
        offline = engine.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        prompt_logprobs = [o.prompt_logprobs for o in engine.generate(
            PROMPTS, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))]
    assert served == [o.text for o in offline]
    for choice, expected in zip(echoed, prompt_logprobs):
        assert expected[0] is None and choice.logprobs.token_logprobs[0] is None
        got = choice.logprobs.token_logprobs[1:len(expected)]
        assert got == pytest.approx([lp.logprob for lp in expected[1:]], abs=1e-4)


@pytest.fixture(scope="module")
def tokenizer():
    from radixrelay.model.model_registry import resolve_model_path
    from radixrelay.text.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model_path("default"))


def test_token_id_prompts_give_the_text_prompts_completions(client, tokenizer):
    """Greedy fp32: a prompt sent as the ids the server's encoding gives completes token for token as the
    text does (one prompt, integral floats, a batch, streamed, echoed)."""
    kw = dict(model="relay", max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    texts = client.completions.create(prompt=PROMPTS, **kw).choices
    ids = [tokenizer.encode(p) for p in PROMPTS]
    out = client.completions.create(prompt=ids[0], **kw)
    assert out.choices[0].text == texts[0].text and out.usage.prompt_tokens == len(ids[0])
    floats = client.completions.create(prompt=[float(t) for t in ids[0]], **kw).choices[0]
    assert floats.text == texts[0].text
    batch = client.completions.create(prompt=ids, **kw)
    assert [c.text for c in batch.choices] == [t.text for t in texts]
    assert batch.usage.prompt_tokens == sum(len(i) for i in ids)
    streamed = "".join(c.choices[0].text for c in client.completions.create(prompt=ids[1], stream=True, **kw))
    assert streamed == texts[1].text
    echoed = client.completions.create(prompt=ids[2], echo=True, **kw).choices[0]
    assert echoed.text == PROMPTS[2] + texts[2].text


def test_token_id_prompts_are_checked_whole(http):
    """Token ids: integers within the vocabulary, an integral float counting as its integer; anything else is
    OpenAI's 400 naming ``prompt``, and the server goes on."""
    vocab = 49152
    ok = {"model": "relay", "max_tokens": 1}
    for prompt in ([5, 6.0], [[5, 6], [7.0]], [vocab - 1]):
        r = http.post("/v1/completions", json={**ok, "prompt": prompt})
        assert r.status_code == 200, (prompt, r.text)
    bad = [[4.5], [5, 4.5], [True], [5, False], [-1], [vocab], [5, [6]], [[5, [6]]], [], [[]], [[5], []],
           [2**63], [2**64], [2**70], [5, None], [5, "6"], [1e300], [[5.5]]]
    for prompt in bad:
        r = http.post("/v1/completions", json={**ok, "prompt": prompt})
        assert r.status_code == 400, (prompt, r.text)
        assert r.headers["content-type"] == "application/json"
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "prompt" and error["message"], prompt
    r = http.post("/v1/completions", json={**ok, "prompt": [vocab, 5]})
    assert r.json()["error"]["message"] == f"prompt token ids out of range [0, {vocab}): [{vocab}]"
    assert http.get("/health").status_code == 200


STAGES = {"parse", "render", "tokenize", "submit"}


def _stages(http: httpx.Client) -> dict[tuple[str, str], float]:
    """(stage, "sum" | "count") -> value of radixrelay_request_stage_seconds."""
    found = re.findall(r'^radixrelay_request_stage_seconds_(sum|count)\{stage="(\w+)"\} (\S+)$',
                       http.get("/metrics").text, re.M)
    return {(stage, kind): float(value) for kind, stage, value in found}


def test_request_stages_in_metrics(client, http):
    before = _stages(http)
    chat(client, "Stage one.", max_tokens=1)
    client.completions.create(model="relay", prompt=[5, 6, 7], max_tokens=1)
    after = _stages(http)
    assert {stage for stage, _ in after} >= STAGES
    grew = {stage: after[stage, "count"] - before.get((stage, "count"), 0) for stage in STAGES}
    assert grew == {"parse": 2, "render": 1, "tokenize": 2, "submit": 2}
    for stage in STAGES:
        assert after[stage, "sum"] > before.get((stage, "sum"), 0)
    assert "# TYPE radixrelay_request_stage_seconds summary" in http.get("/metrics").text


# -- errors -------------------------------------------------------------------------------------

LONG = "word " * 9000          # more tokens than the model's 8192-token context


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"model": "relay", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "3"}, "max_tokens"),
    ("/v1/chat/completions", {"model": "relay", "messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
    ("/v1/chat/completions", {"model": "relay", "messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}, "top_p"),
    ("/v1/chat/completions", {"model": "relay", "messages": [{"role": "user", "content": "hi"}], "n": MAX_N + 1}, "n"),
    ("/v1/chat/completions", {"model": "relay", "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": "relay", "messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, "model"),
    ("/v1/chat/completions", {"model": "relay", "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ("/v1/chat/completions", {"model": "relay", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9000}, "max_tokens"),
    ("/v1/completions", {"model": "relay", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"model": "relay", "prompt": "hi", "echo": True, "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"model": "relay", "prompt": ["hi", "yo"], "echo": True, "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"model": "relay", "prompt": "hi", "max_tokens": 8192}, "max_tokens"),
    ("/v1/completions", {"model": "relay", "prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"model": "relay", "prompt": "hi", "stop": [""]}, "stop"),
    ("/v1/completions", {"model": "relay", "prompt": [10**9]}, "prompt"),
    ("/v1/completions", {"model": "relay", "prompt": ""}, "prompt"),
    ("/v1/completions", {"model": "relay"}, None),
    ("/v1/completions", {"model": "relay", "prompt": "hi", "stream": "yes"}, "stream"),
])
def test_invalid_requests_get_400(http, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param
    assert http.get("/health").status_code == 200


def test_prompt_longer_than_context_gets_400(client, http):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="relay", prompt=LONG, max_tokens=4)
    assert "context" in str(info.value)
    r = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_body_over_cap_gets_413(http):
    body = {"model": "relay", "prompt": "x" * (BODY_CAP + 10), "max_tokens": 1}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert http.get("/health").status_code == 200


def test_api_key_required(server):
    body = {"model": "relay", "prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(f"{server.base_url}/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.post(f"{server.base_url}/flush_cache").status_code == 401
    for path, payload in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        assert httpx.post(f"{server.base_url}{path}", json=payload).status_code == 401
        keyed = httpx.post(f"{server.base_url}{path}", json=payload, headers={"Authorization": f"Bearer {API_KEY}"})
        assert keyed.status_code == 200
    assert httpx.get(f"{server.base_url}/health").status_code == 200        # health is open
    bad = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_errors_leave_metrics_consistent(http):
    m = metrics(http)
    assert m["radixrelay_num_requests_running"] == 0 and m["radixrelay_num_requests_waiting"] == 0
    assert re.search(r"radixrelay_kv_total_pages \d", http.get("/metrics").text)


@pytest.fixture(scope="module")
def model_client(hostile_server):
    """A client of the session's hostile-input server: the default model, whose answers end (EOS)."""
    return openai.OpenAI(base_url=f"{hostile_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def model_http(hostile_server):
    with httpx.Client(base_url=hostile_server.base_url, timeout=120) as h:
        yield h


def test_logit_bias_and_min_tokens(model_client, model_http):
    """OpenAI's ``logit_bias`` (string token ids) bans and forces tokens; ``min_tokens`` (extra body)
    holds EOS back. On the default model (``model_client``): an answer that ends by itself."""
    client, http = model_client, model_http
    prompt = "The capital of France is"
    plain = client.completions.create(model="relay", prompt=prompt, max_tokens=2, temperature=0, logprobs=0)
    first = plain.choices[0].logprobs.tokens[0]
    tok = http.post("/tokenize", json={"prompt": first, "add_special_tokens": False}).json()
    banned = client.completions.create(model="relay", prompt=prompt, max_tokens=2, temperature=0,
                                       logit_bias={str(tok["tokens"][0]): -100})
    assert not banned.choices[0].text.startswith(first)
    forced = client.completions.create(model="relay", prompt=prompt, max_tokens=3, temperature=0.8, seed=1,
                                       logit_bias={str(tok["tokens"][0]): 100})
    assert forced.choices[0].text == first * 3
    question = "<|im_start|>user\nSay yes.<|im_end|>\n<|im_start|>assistant\n"       # the model's ChatML
    free = client.completions.create(model="relay", prompt=question, max_tokens=64, temperature=0)
    assert free.choices[0].finish_reason == "stop"
    n = free.usage.completion_tokens + 6
    held = client.completions.create(model="relay", prompt=question, max_tokens=64, temperature=0,
                                     extra_body={"min_tokens": n})
    assert held.usage.completion_tokens >= n and held.choices[0].text.startswith(free.choices[0].text)
