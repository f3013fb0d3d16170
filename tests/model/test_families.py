"""Each model family as a new user meets it: a tiny random checkpoint written by transformers
(float32, SmolLM2's vocabulary of 49,152, 2 layers), served by ``Engine(model=DIR,
tokenizer="default", device="cpu", dtype="float32")`` with cascade forced on every shared node, gives
the greedy tokens of transformers' own ``generate``: prompts that share a prefix (read once by the
cascade), longer than the window where the family has one. One Engine per family (Mistral's window, the Llama
block with Phi-3's window, is covered by tests/model/test_hf_parity)."""

from __future__ import annotations

import pytest
import torch

from radixrelay import Engine, SamplingParams

pytestmark = pytest.mark.slow            # one Engine per family: starts early (tests/conftest.py)

transformers = pytest.importorskip("transformers")

VOCAB = 49152                      # the default tokenizer's
NEW_TOKENS = 40
WINDOW = 64                        # where the family has a sliding window
BASE = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "initializer_range": 0.2, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}

# family -> (transformers config class name, overrides of BASE). Embeddings untied: a tied random model
# repeats a few tokens (tied embeddings are covered by tests/model/test_hf_parity).
FAMILIES = {
    "qwen3": ("Qwen3Config", {"head_dim": 32}),
    # LongRoPE within the original context (short factors, the attention factor of a 256 / 128 extension;
    # past it, transformers' generate re-encodes the whole sequence with the long factors: docs/models.md,
    # and tests/model/test_hf_parity for the long factors), and a sliding window
    "phi3": ("Phi3Config", {"pad_token_id": 0, "sliding_window": WINDOW, "original_max_position_embeddings": 128,
                            "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.05 * i for i in range(8)],
        "long_factor": [1.5 + 0.4 * i for i in range(8)]}}),
    # routed experts: 4 experts, top-2 (Mixtral: renormalized; Qwen3-MoE here: not, norm_topk_prob false)
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 64, "norm_topk_prob": False}),
    "gemma2": ("Gemma2Config", {"head_dim": 16, "sliding_window": WINDOW, "query_pre_attn_scalar": 24,
                                "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0}),
    "gemma3": ("Gemma3TextConfig", {
        "head_dim": 16, "sliding_window": WINDOW, "query_pre_attn_scalar": 24,
        "layer_types": ["sliding_attention", "full_attention"], "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}}}),
}


def _write_checkpoint(path, config_name: str, overrides: dict):
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**{**BASE, **overrides})
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in hf.named_parameters():  # HF inits norms to 1 (or 0) and biases to 0: perturb them
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(path)
    hf.generation_config.eos_token_id = None       # generate exactly NEW_TOKENS, like ignore_eos
    hf.generation_config.pad_token_id = 0
    return hf.eval()


def _prompts(lengths: tuple[int, ...], shared: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, VOCAB, (shared,), generator=gen).tolist()
    return [prefix + torch.randint(3, VOCAB, (n - shared,), generator=gen).tolist() for n in lengths]


def _hf_greedy(hf, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' generate, greedy, prompts of one length batched."""
    out = []
    with torch.no_grad():
        for length in sorted({len(p) for p in prompts}):
            batch = [p for p in prompts if len(p) == length]
            ids = hf.generate(torch.tensor(batch), attention_mask=torch.ones(len(batch), length, dtype=torch.long),
                              max_new_tokens=NEW_TOKENS, do_sample=False)
            out += [(p, row[length:].tolist()) for p, row in zip(batch, ids)]
    by_prompt = {tuple(p): toks for p, toks in out}
    return [by_prompt[tuple(p)] for p in prompts]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    name = request.param
    config_name, overrides = FAMILIES[name]
    path = tmp_path_factory.mktemp(name)
    hf = _write_checkpoint(path, config_name, overrides)
    with Engine(model=str(path), tokenizer="default", device="cpu", dtype="float32", cascade="on",
                page_size=16, kv_cache_tokens=2048) as engine:
        yield name, engine, hf


def test_greedy_tokens_equal_transformers_with_a_shared_prefix(family):
    """Two prompts of 72 tokens sharing 48 (cached first, then read once by the cascade): longer than the
    window of the families that have one."""
    name, engine, hf = family
    prompts = _prompts((72, 72), shared=48, seed=1)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    engine.generate(prompts[:1], SamplingParams(max_tokens=1, temperature=0))   # the prefix cached first
    before = engine.stats()["cascade_steps"]
    outs = engine.generate(prompts, params)
    assert [o.error for o in outs] == [None] * len(prompts)
    assert engine.stats()["cascade_steps"] > before                        # the shared prefix read once
    assert all(o.cached_tokens >= 48 for o in outs)
    expected = _hf_greedy(hf, prompts)
    assert len({t for toks in expected for t in toks}) > 10                 # the model is not degenerate
    assert [o.token_ids for o in outs] == expected, name
