"""The offline Engine on the default model: batching, prefix reuse, cascade, errors.

Greedy outputs are compared three ways: batched vs one at a time vs transformers' own model on the
same GGUF (the reference implementation of the model). Oversubscribed KV (retraction keeps the
outputs of a pool large enough for everything) is tests/engine/test_structured.py's small pool.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time

import msgspec
import pytest
import torch

from radixrelay import Engine, SamplingParams
from radixrelay.structured import StructuredOutput
from tests.runtime.server_process import TINY_ENGINE

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 4,",
    "Translate to French: good morning",
    "List three colors:",
]


@pytest.fixture(scope="module")
def engine():
    with Engine(model="default", kv_cache_tokens=8192, page_size=16) as eng:
        yield eng


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    """The tiny dummy model (``tests/runtime/server_process.py``): for the tests whose claim holds for any
    model (one way of computing against another), at a fraction of the default model's CPU time."""
    with Engine(model=str(tiny_model_dir), **TINY_ENGINE, kv_cache_tokens=8192, page_size=16) as eng:
        yield eng


@pytest.fixture(scope="module")
def batched(engine):
    return engine.generate(PROMPTS, GREEDY)


@contextlib.contextmanager
def _one_gguf_parse():
    """transformers reads the GGUF twice (config, then weights), parsing every metadata field each time
    (the vocabulary: most of its load time), and rebuilds gguf's tensor-name map once per module: while
    the reference model loads, one reader per file and one map per (arch, layers). Same bytes read,
    same conversion; only the repeated parsing is skipped."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers = functools.cache(reader)
    gguf.GGUFReader = lambda path, *args, **kwargs: readers(os.fspath(path), *args, **kwargs)
    gguf.get_tensor_name_map = functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


@pytest.fixture(scope="module")
def hf_model():
    from tests.engine.hf_reference import _hf_model

    with _one_gguf_parse():
        return _hf_model()


def test_batch_equals_one_at_a_time(engine, batched):
    # Alone here PROMPTS[4:]; PROMPTS[2] streams alone and PROMPTS[3] stops alone below, compared with the
    # batch too; PROMPTS[:3] equal transformers.
    for prompt, out in zip(PROMPTS[4:], batched[4:]):
        single = engine.generate([prompt], GREEDY)[0]
        assert single.token_ids == out.token_ids, prompt
        assert single.text == out.text
    assert all(o.finish_reason == "length" and len(o.token_ids) == 8 for o in batched)


def test_batch_equals_transformers(engine, batched, hf_model):
    """Each greedy token is the argmax of transformers' logits after the prompt and the tokens before
    it (one forward over the whole sequence instead of a generate loop: the same condition)."""
    for prompt, got in zip(PROMPTS[:3], batched[:3]):
        ids = engine.tokenizer.encode(prompt)
        with torch.inference_mode():
            logits = hf_model(torch.tensor([ids + got.token_ids[:-1]])).logits[0, len(ids) - 1:]
        assert logits.argmax(dim=-1).tolist() == got.token_ids, prompt


def test_token_id_prompts_equal_text_prompts(engine, batched):
    """A prompt given as its ids (a list, int32 and int64 arrays, integral floats) completes token for token as
    its text does: both go through the same admission and reach the scheduler packed."""
    import numpy as np

    ids = [engine.tokenizer.encode(p) for p in PROMPTS[:2]]
    forms = [ids[0], np.array(ids[1], dtype=np.int32), np.array(ids[0], dtype=np.int64), [float(t) for t in ids[1]]]
    short = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)   # greedy: the batch's first 4 tokens
    for got, k in zip(engine.generate(forms, short), [0, 1, 0, 1]):
        assert got.token_ids == batched[k].token_ids[:4] and batched[k].text.startswith(got.text), forms
    assert engine.generate(np.array(ids[0]), short)[0].token_ids == batched[0].token_ids[:4]  # one array: one prompt
    with pytest.raises(ValueError, match="must be integers"):
        engine.generate([[5, 6.5]], GREEDY)


def test_shared_prefix_is_computed_once(engine):
    engine.generate(["warm-up so the tree has unrelated content"], SamplingParams(max_tokens=2))
    shared = " ".join(f"item{i}" for i in range(64))            # ~180 tokens
    prompts = [f"{shared} question {q}:" for q in range(4)]
    first = engine.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0))[0]
    prefix_tokens = len(engine.tokenizer.encode(shared))
    assert prefix_tokens >= 160
    before = engine.computed_tokens
    rest = engine.generate(prompts[1:], SamplingParams(max_tokens=2, temperature=0))
    computed = engine.computed_tokens - before
    for out in rest:
        assert out.cached_tokens >= 160
        assert out.cached_tokens <= out.prompt_tokens
    # Only each prompt's uncached tail and its decode steps ran through the model.
    uncached = sum(o.prompt_tokens - o.cached_tokens for o in rest)
    assert computed == uncached + sum(len(o.token_ids) - 1 for o in rest) + _stops(rest)
    assert computed < len(rest) * 64
    assert first.cached_tokens < 16


def test_a_burst_over_a_long_cached_document_matches_one_at_a_time(tiny):
    """Questions over a cached document of more than ``SHARED_PAGES_BY_REF`` pages admitted together take
    the document's page ids from the first of them (``AdmittedRequest.pages_from``, copied on the device):
    greedy outputs equal those of the same questions admitted one at a time."""
    from radixrelay.scheduler.scheduler import SHARED_PAGES_BY_REF

    doc = " ".join(f"fact{i} is {i * 7 % 13}." for i in range(160))
    assert len(tiny.tokenizer.encode(doc)) > 16 * (SHARED_PAGES_BY_REF + 4)
    questions = [f"{doc} Question {q}: what is fact{q * 11}?" for q in range(4)]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    runs = []
    for together in (False, True):
        assert tiny.flush_cache()
        tiny.generate([doc], SamplingParams(max_tokens=1))
        outs = tiny.generate(questions, params) if together else \
            [tiny.generate([q], params)[0] for q in questions]
        assert all(o.cached_tokens >= 16 * SHARED_PAGES_BY_REF for o in outs)
        runs.append([o.token_ids for o in outs])
    assert runs[0] == runs[1]


def test_a_prompt_that_diverges_mid_page_reuses_the_pages_leading_tokens(engine):
    """The tree matches whole pages; a prompt that leaves a cached one mid-page has that page's leading
    tokens copied into its own first page (``CacheManager.reuse_partial_page``) instead of computed:
    its cached tokens are not a page multiple, and its greedy completion equals the same prompt's with
    nothing cached, in a batch where several such prompts copy from the same page together."""
    doc = engine.tokenizer.encode(" ".join(f"note{i} says {i * 5 % 11}." for i in range(20)))[:45]
    prompts = [doc[:40 + k] + [1000 + 37 * k + j for j in range(6)] for k in range(3)]   # part at 40, 41, 42
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert engine.flush_cache()
    alone = [engine.generate([p], params)[0] for p in prompts if engine.flush_cache()]
    assert all(o.cached_tokens == 0 for o in alone)
    assert engine.flush_cache()
    engine.generate([doc], SamplingParams(max_tokens=5, ignore_eos=True))   # 49 computed: pages [0, 48) cached
    before = engine.computed_tokens
    reused = engine.generate(prompts, params)
    assert [o.cached_tokens for o in reused] == [40, 41, 42]
    assert engine.computed_tokens - before == sum(6 + 5 for _ in prompts)   # new prompt tokens, decodes
    assert [o.token_ids for o in reused] == [o.token_ids for o in alone]


def _stops(outs) -> int:
    """Decode steps that sampled a stop token (counted in completion_tokens, not token_ids)."""
    return sum(o.completion_tokens - len(o.token_ids) for o in outs)


def test_prompt_logprobs_of_a_cached_prompt(engine, hf_model):
    """A request with prompt logprobs recomputes a cached prefix: every position is reported, and
    equals transformers' forward of the same prompt."""
    from tests.engine.hf_reference import hf_prompt_logprobs

    prefix = "Prompt logprobs: " + " ".join(f"word{i}" for i in range(20))
    engine.generate([prefix], SamplingParams(max_tokens=1))                # caches the prefix
    prompt = prefix + " and a tail"
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2)
    out = engine.generate([prompt], params)[0]
    ids = engine.tokenizer.encode(prompt)
    assert engine.generate([prompt], SamplingParams(max_tokens=1))[0].cached_tokens >= 32
    assert out.cached_tokens == 0 and out.prompt_tokens == len(ids) == len(out.prompt_logprobs)
    assert out.prompt_logprobs[0] is None and out.logprobs is None
    values = [lp.logprob for lp in out.prompt_logprobs[1:]]
    assert values == pytest.approx(hf_prompt_logprobs(ids), abs=1e-3)
    for lp, token in zip(out.prompt_logprobs[1:], ids[1:]):
        assert len(lp.top) == 2 and lp.top[0][1] >= lp.top[1][1] and lp.top[0][1] >= lp.logprob
        assert lp.logprob == pytest.approx(lp.top[0][1]) or lp.top[0][0] != token
    again = engine.generate([prompt], params)[0]                           # cached now: same values
    assert [lp.logprob for lp in again.prompt_logprobs[1:]] == pytest.approx(values, abs=1e-5)
    assert again.token_ids == out.token_ids


def test_token_id_prompts_and_per_request_params(engine):
    ids = engine.tokenizer.encode("The capital of France is")
    outs = engine.generate([ids, "Hello"], [SamplingParams(max_tokens=3, temperature=0),
                                           SamplingParams(max_tokens=5, temperature=0)])
    assert len(outs[0].token_ids) <= 3 and len(outs[1].token_ids) <= 5
    assert outs[0].prompt_tokens == len(ids)


def test_stop_string_never_reaches_the_caller(engine, batched):
    full = batched[3].text                      # "1, 2, 3, 4," continues with " 5, 6, ..."
    stop = full[4:7]
    out = engine.generate([PROMPTS[3]], SamplingParams(max_tokens=8, temperature=0, stop=(stop,)))[0]
    assert out.finish_reason == "stop"
    assert out.text == full[: full.index(stop)]
    streamed = "".join(engine.generate_stream(PROMPTS[3], SamplingParams(max_tokens=8, temperature=0,
                                                                         stop=(stop,))))
    assert streamed == out.text


def test_stream_equals_generate(engine, batched):
    text = "".join(engine.generate_stream(PROMPTS[2], GREEDY))
    assert text == batched[2].text


def test_salts_never_share(engine):
    prompt = " ".join(f"salted{i}" for i in range(24))           # ~90 tokens
    engine.generate([prompt], SamplingParams(max_tokens=1), cache_salt="alice")
    again = engine.generate([prompt], SamplingParams(max_tokens=1), cache_salt="alice")[0]
    other = engine.generate([prompt], SamplingParams(max_tokens=1), cache_salt="bob")[0]
    assert again.cached_tokens >= 64
    assert other.cached_tokens == 0


def test_pins_and_priority_through_the_engine(engine):
    prompt = [7, 8, 9, 10] * 12                                     # 48 tokens: 3 pages
    engine.generate([prompt], SamplingParams(max_tokens=1), pin_ttl_s=60.0, pin_tokens=40)
    stats = engine.stats()
    assert stats["num_pins"] == 1 and stats["pinned_tokens"] == 32 and stats["kv_idle_baseline"]
    with pytest.raises(ValueError, match="--enable-priority"):
        engine.generate(["hi"], SamplingParams(max_tokens=1), priority=2)


def test_bad_input_raises_clear_errors(engine):
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    for bad in (-1, 21):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.generate([""], GREEDY)
    with pytest.raises(ValueError, match="out of range"):
        engine.generate([[10**9]], GREEDY)
    with pytest.raises(ValueError, match="out of range"):
        engine.generate([[5, -1]], GREEDY)
    for bad in (["x"], [2**70], [None]):
        with pytest.raises(ValueError, match="must be integers"):
            engine.generate([bad], GREEDY)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="context"):
        engine.generate(["hi"], SamplingParams(max_tokens=10**6))
    with pytest.raises(ValueError, match="SamplingParams for"):
        engine.generate(["a", "b"], [GREEDY])
    with pytest.raises(ValueError, match=r"stop_token_ids: must be in \[0, "):
        engine.generate(["hi"], SamplingParams(max_tokens=2, stop_token_ids=(1, engine.vocab_size)))
    with pytest.raises(ValueError, match="no JSON value matches"):
        engine.generate(["hi"], SamplingParams(structured=StructuredOutput.json_schema(
            {"anyOf": [{"$ref": "#"}, {"$ref": "#"}]})))
    # The engine still works afterwards.
    assert engine.generate(["ok"], SamplingParams(max_tokens=2, temperature=0))[0].token_ids


def test_a_bad_prompt_late_in_a_batch_leaves_nothing_running(engine):
    """Prompts are submitted as they are encoded: the ones before a bad prompt reach the scheduler, and
    the error aborts them (no request stays live, none of their KV stays held)."""
    good = [[5 + i, 6, 7, 8] * 8 for i in range(3)]
    with pytest.raises(ValueError, match="out of range"):
        engine.generate(good + [[5, 10**9]], SamplingParams(max_tokens=2000, ignore_eos=True))
    deadline = time.monotonic() + 10             # running to max_tokens would take ~a minute
    while not engine.stats()["kv_idle_baseline"] and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = engine.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0 and stats["kv_idle_baseline"]
    out = engine.generate(good[:1], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 3


def test_cascade_on_gives_identical_greedy_outputs(tiny, tiny_model_dir):
    """Cascade is a reformulation: forcing it on every shared node changes no greedy token (the tiny model:
    the claim is one way of computing attention against another)."""
    shared = "You are a helpful assistant. " + " ".join(f"rule{i}" for i in range(90))
    prompts = [f"{shared} Question {q}: what is {q} plus {q}?" for q in range(5)]
    n = 4
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    flat = tiny.generate(prompts, params)
    with Engine(model=str(tiny_model_dir), **TINY_ENGINE, kv_cache_tokens=4096, cascade="on") as cascaded:
        cascaded.generate(prompts[:1], params)
        outs = cascaded.generate(prompts, params)
        stats = cascaded.stats()
    assert [o.token_ids for o in outs] == [o.token_ids for o in flat]
    assert stats["cascade_steps"] > 0 and stats["cascade_groups"] > 0
    assert stats["cascade_tokens_read_once"] >= 4 * 160 * stats["cascade_steps"] // 2
    # the batch's prefill read the cached prefix once for the requests sharing it (prefill cascade)
    assert stats["prefill_cascade_steps"] >= 1 and stats["prefill_cascade_runs"] >= stats["prefill_cascade_steps"]
    assert stats["prefill_cascade_tokens_read_once"] >= 128
    # where the serving loop's time went: every step spent time in the worker, launching before waiting
    assert 0 < stats["worker_launch_s"] <= stats["worker_busy_s"] and stats["scheduler_busy_s"] > 0
    # of it, the decode-only steps: 1 row, then up to 5 (how many of the batch's decodes ride along with
    # other prompts' extends depends on arrival timing); n - 1 of each request's n tokens come from decodes
    assert n - 1 <= stats["decode_only_steps"] < stats["steps"]
    assert stats["decode_only_steps"] <= stats["decode_only_rows"] <= min(5 * stats["decode_only_steps"], 6 * (n - 1))
    assert 0 < stats["decode_only_launch_s"] < stats["worker_launch_s"]
    assert stats["graph_capture_s"] == 0.0                  # the CPU captures no graphs


def test_concurrent_requests_compute_a_new_shared_prefix_once(engine):
    """Requests that arrive together with a prefix nobody cached yet: the first computes it, the
    others wait for its prefill and reuse it (and their outputs do not change)."""
    shared = "Context: " + " ".join(f"fact{i}" for i in range(48))
    prompts = [f"{shared} Question {q}?" for q in range(3)]
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    prefix = len(engine.tokenizer.encode(shared))
    assert prefix >= 128
    before = engine.computed_tokens
    outs = engine.generate(prompts, params)
    computed = engine.computed_tokens - before
    assert outs[0].cached_tokens == 0
    assert all(o.cached_tokens >= prefix - 16 for o in outs[1:])
    uncached = sum(o.prompt_tokens - o.cached_tokens for o in outs)
    assert computed == uncached + sum(o.completion_tokens - 1 for o in outs)
    again = engine.generate(prompts, params)        # the prefix cached now: every request reads it
    assert all(o.cached_tokens >= prefix - 16 for o in again)
    assert [o.token_ids for o in outs] == [o.token_ids for o in again]


def test_logit_bias_bans_and_forces_tokens(engine):
    """-100 on the greedy token makes another one win; +100 on a token makes it every output token, sampled
    or greedy; logprobs stay the raw model's."""
    prompt = "The capital of France is"
    greedy = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    plain = engine.generate([prompt], greedy)[0].token_ids
    banned = engine.generate([prompt], msgspec.structs.replace(greedy, logit_bias=((plain[0], -100.0),)))[0]
    assert banned.token_ids[0] != plain[0]
    forced_id = engine.tokenizer.encode(" banana", add_special_tokens=False)[0]
    forced = msgspec.structs.replace(greedy, logit_bias=((forced_id, 100.0),), logprobs=0)
    sampled = msgspec.structs.replace(forced, temperature=1.0, seed=3)
    outs = engine.generate([prompt, prompt], [forced, sampled])
    assert [o.token_ids for o in outs] == [[forced_id] * 3] * 2
    assert outs[0].logprobs[0].logprob < -1.0          # the raw distribution did not favour it
    with pytest.raises(ValueError, match="logit_bias"):
        engine.generate([prompt], msgspec.structs.replace(greedy, logit_bias=((engine.vocab_size, 1.0),)))


def test_min_tokens_holds_back_eos(engine):
    """A chat answer that ends with EOS after a few tokens runs to ``min_tokens`` with EOS banned, then
    may stop; without ``min_tokens`` it stops where it did."""
    prompt = "<|im_start|>user\nSay yes.<|im_end|>\n<|im_start|>assistant\n"      # the model's ChatML
    free = engine.generate([prompt], SamplingParams(max_tokens=64, temperature=0))[0]
    assert free.finish_reason == "stop" and len(free.token_ids) < 24
    held = engine.generate([prompt], SamplingParams(max_tokens=64, temperature=0,
                                                    min_tokens=len(free.token_ids) + 8))[0]
    assert len(held.token_ids) >= len(free.token_ids) + 8
    assert held.token_ids[:len(free.token_ids)] == free.token_ids       # greedy until EOS would have won
    eos = engine.tokenizer.eos_token_ids
    assert not eos & set(held.token_ids[:len(free.token_ids) + 8])
