"""The whole runtime on a GPU: Triton backend, cascade plans and CUDA graphs through the Engine.

A small Llama with dummy weights (head dim 128, GQA 4) and a word-level tokenizer built here, so the
test needs no model files. Kernel- and backend-level exactness is tested in tests/kernels and
tests/cascade; this checks the processes, the wiring and the counters on a real device.
"""

from __future__ import annotations

import json

import pytest

from radixrelay import Engine, SamplingParams

pytestmark = pytest.mark.gpu

WORDS = [f"w{i}" for i in range(500)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


def make_tiny_model_dir(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": None}))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
        "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 4,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096,
        "tie_word_embeddings": False, "eos_token_id": 1}))
    return path


def _prompts() -> list[str]:
    shared = " ".join(WORDS[:300])                       # ~300 shared tokens
    return [f"{shared} {WORDS[300 + q]} {WORDS[400 + q]}" for q in range(12)]


def _run(model_dir, cascade: str):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    with Engine(model=str(model_dir), load_format="dummy", device="cuda", cascade=cascade,
                kv_cache_tokens=65536) as engine:
        engine.generate(_prompts()[:1], params)          # cache the shared prefix first
        outs = engine.generate(_prompts(), params)
        return outs, engine.stats()


def test_cascade_and_graphs_through_the_engine(model_dir):
    flat, flat_stats = _run(model_dir, "off")
    cascaded, stats = _run(model_dir, "on")
    assert all(len(o.token_ids) == 24 for o in cascaded)
    assert flat_stats["cascade_steps"] == 0
    assert stats["cascade_steps"] > 0 and stats["cascade_tokens_read_once"] > 0
    # steady decode steps repeat the previous step's rows: advanced on the device, no host packing
    assert stats["decode_steps_advanced"] > 0 and flat_stats["decode_steps_advanced"] > 0
    # bf16: cascade and flat round differently
    assert greedy_close(flat, cascaded, "cascade") >= 4 * len(flat)


def greedy_close(reference, got, what: str) -> int:
    """Greedy outputs (logprobs 2) of two bf16 runs of the same prompts: while two sequences agree their
    logprobs agree within bf16 tolerance, and they may only part where the reference's top two choices
    nearly tie. Returns the positions compared."""
    compared = 0
    for r, g in zip(reference, got, strict=True):
        for tr, tg, lr, lg in zip(r.token_ids, g.token_ids, r.logprobs, g.logprobs):
            if tr != tg:
                assert lr.top[0][1] - lr.top[1][1] < 0.1, f"{what} changed a clear greedy choice"
                break
            assert abs(lr.logprob - lg.logprob) < 0.05
            compared += 1
    return compared


def test_host_tier_loads_beside_steps_in_flight_give_the_tokens_of_recompute(model_dir):
    """Sessions pushed off a small device pool come back from the pinned host tier while other sessions decode,
    two at a time: an admission's loads start when its plan reaches the worker, beside the step before it,
    and a queued session's start at once, in a plan of transfers alone that the later steps wait for; both
    into pages no step in flight writes. Float32: the greedy tokens of an engine without tiers."""
    reference, first, again, stats = host_tier_sessions(model_dir, max_running_requests=2)
    assert [o.token_ids for o in first] == [o.token_ids for o in again] == reference
    assert stats["tier_host_hit_tokens"] > 0 and all(o.cached_tokens > 0 for o in again)
    assert stats["tier_loaded_at_once_pages"] > 0 and stats["tier_early_load_tokens"] > 0


def host_tier_sessions(model_dir, **options):
    """Six 200-word sessions, float32: their greedy tokens on a roomy pool without tiers, then on a 1024-token
    pool with a 0.5 GiB host tier (``options`` added): the sessions, a 400-word distractor that pushes them
    off the device, the sessions again. Returns (reference tokens, first outputs, later outputs, stats)."""
    import random

    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    sessions = [" ".join(random.Random(i).choice(WORDS) for _ in range(200)) for i in range(6)]
    distractor = " ".join(WORDS[:400])
    with Engine(model=str(model_dir), load_format="dummy", device="cuda", dtype="float32",
                kv_cache_tokens=65536, host_kv_gib=0) as engine:
        reference = [o.token_ids for o in engine.generate(sessions, params)]
    with Engine(model=str(model_dir), load_format="dummy", device="cuda", dtype="float32",
                kv_cache_tokens=1024, host_kv_gib=0.5, **options) as engine:
        first = engine.generate(sessions, params)
        engine.generate([distractor], params)
        again = engine.generate(sessions, params)
        stats = engine.stats()
    return reference, first, again, stats


def test_prompts_leaving_a_cached_page_mid_page_give_the_tokens_of_recompute(model_dir):
    """Float32, Triton: 8 prompts over a cached 300-token document that leave it 1-15 tokens into a page copy
    those tokens' KV from the cached page (``StepPlan.page_copies``) and extend from mid-page, together in
    one step (the prefill cascade over the document); greedy tokens equal those of each prompt alone on an
    empty cache."""
    doc = [2 + i for i in range(300)]                        # WORDS[:300] as token ids
    prompts = [doc[:256 + 1 + 2 * q] + [2 + 300 + q, 2 + 400 + q] for q in range(8)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with Engine(model=str(model_dir), load_format="dummy", device="cuda", dtype="float32",
                kv_cache_tokens=65536, host_kv_gib=0) as engine:     # no host tier: a flush forgets all
        alone = []
        for p in prompts:
            assert engine.flush_cache()
            alone.append(engine.generate([p], params)[0].token_ids)
        assert engine.flush_cache()
        engine.generate([doc], SamplingParams(max_tokens=2, ignore_eos=True))
        outs = engine.generate(prompts, params)
    assert [o.cached_tokens for o in outs] == [257 + 2 * q for q in range(8)]
    assert [o.token_ids for o in outs] == alone
