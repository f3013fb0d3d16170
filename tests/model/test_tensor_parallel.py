"""Tensor parallelism in the model (radixrelay.model.parallel): two ranks in two processes (gloo on the
CPU) give the single-rank model's greedy tokens (64 per prompt, fp32, paged KV) and its logits within
float rounding, with KV heads split or replicated, an untied or tied LM head, a vocabulary that does
not divide (padded rows), q/k/v biases, Gemma's switches and routed experts; what a rank holds and what
cannot be split is checked without processes."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from radixrelay.model import ModelConfig, load_model
from radixrelay.model.parallel import TensorParallel
from tests.model import tp_rank

BASE = dict(architecture="llama", vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2,
            num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256)
CASES = {
    "kv-split": ModelConfig(**BASE),
    "kv-replicated-tied-odd-vocab": ModelConfig(**{**BASE, "num_kv_heads": 1, "vocab_size": 97,
                                                   "tie_word_embeddings": True}),
    "qkv-bias": ModelConfig(**{**BASE, "architecture": "qwen2", "attention_bias": True}),
    # Gemma's switches at once: q/k norms, norms around each half, GELU, scaled embeddings, soft-capping, a
    # window of 8 beside a full layer with two RoPE bases, a softmax scale of its own
    "gemma-switches": ModelConfig(**{**BASE, "architecture": "gemma3_text", "qk_norm": True, "sandwich_norms": True,
                                     "hidden_act": "gelu_tanh", "embedding_scale": True, "attn_logit_softcap": 5.0,
                                     "final_logit_softcap": 3.0, "layer_windows": (8, 0), "rope_theta": 1e6,
                                     "local_rope_theta": 1e4, "attn_scale": 0.2}),
    # routed experts (Qwen3-MoE): every expert on each rank, each expert's width split; a sparse layer beside a
    # dense one, top-k weights not renormalized
    "experts": ModelConfig(**{**BASE, "architecture": "qwen3_moe", "qk_norm": True, "num_experts": 4,
                              "num_experts_per_tok": 2, "moe_intermediate_size": 48, "moe_layers": (0,),
                              "moe_renormalize": False}),
}


def _run_ranks(configs: dict[str, ModelConfig], size: int, tmp_path) -> list[dict]:
    """``size`` rank processes, each running every config of ``configs`` in turn: per rank, the results by
    config name. The ranks are forked from this process, which has torch and the model code imported
    already (a spawned rank spent more CPU importing them than decoding the three tiny models)."""
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=tp_rank.run, args=(r, size, str(tmp_path / "rendezvous"), str(tmp_path),
                                                   configs, torch.float32)) for r in range(size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0] * size
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(size)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    return _run_ranks(CASES, 2, tmp_path_factory.mktemp("tp"))


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_decode_like_one(case, two_ranks):
    config = CASES[case]
    reference = tp_rank.greedy(config, TensorParallel(), torch.float32)
    for ranks in two_ranks:                               # every rank computes the same outputs
        result = ranks[case]
        assert result["tokens"] == reference["tokens"]
        torch.testing.assert_close(result["logits"], reference["logits"], rtol=1e-5, atol=1e-5)
    assert len({t for toks in reference["tokens"].values() for t in toks}) > 1     # not a constant


def test_what_a_rank_holds():
    config = ModelConfig(**{**BASE, "num_heads": 8, "num_kv_heads": 2, "vocab_size": 97})
    local = TensorParallel(1, 4).local_config(config)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 24)
    assert [TensorParallel(r, 4).kv_heads(config) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [TensorParallel(r, 2).kv_heads(config) for r in range(2)] == [(0, 1), (1, 1)]
    assert [TensorParallel(r, 4).vocab_rows(97) for r in range(4)] == [(0, 25, 25), (25, 25, 25), (50, 25, 25),
                                                                      (75, 25, 22)]
    model, _ = load_model(config, load_format="dummy", tp=TensorParallel(3, 4))
    assert model.model.embed_tokens.weight.shape == (25, 64)
    assert torch.all(model.model.embed_tokens.weight[22:] == 0)          # padding rows
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.shape == ((2 + 2 * 1) * 16, 64)
    assert layer.self_attn.o_proj.weight.shape == (64, 2 * 16)
    assert layer.mlp.gate_up_proj.weight.shape == (2 * 24, 64)
    assert layer.mlp.down_proj.weight.shape == (64, 24)


def test_what_cannot_be_split_is_refused():
    with pytest.raises(ValueError, match="does not split 4 query heads"):
        TensorParallel(0, 3).check(ModelConfig(**BASE))
    with pytest.raises(ValueError, match="3 KV heads"):
        TensorParallel(0, 2).check(ModelConfig(**{**BASE, "num_heads": 6, "num_kv_heads": 3}))
    with pytest.raises(ValueError, match="MLP width of 90"):
        TensorParallel(0, 4).check(ModelConfig(**{**BASE, "intermediate_size": 90}))
    with pytest.raises(ValueError, match="rank 2 outside"):
        TensorParallel(2, 2)
    with pytest.raises(ValueError, match="expected 64 along dimension 0"):
        TensorParallel(0, 2).weight_slice("model.layers.0.self_attn.q_proj.weight", torch.zeros(32, 64),
                                          ModelConfig(**BASE))
