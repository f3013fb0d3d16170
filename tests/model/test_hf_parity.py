"""Tiny random HF checkpoints (saved by transformers' save_pretrained as safetensors) loaded by
us: logits match transformers' own forward, for each supported architecture and config switch."""

from __future__ import annotations

import json

import pytest
import torch

from radixrelay.model import load_model
from tests.model.paged import PagedSession, compare_logits

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            initializer_range=0.1, bos_token_id=1, eos_token_id=2)

CASES = {
    "llama": (transformers.LlamaConfig, {}),
    "llama_tied_mha": (transformers.LlamaConfig, {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    "llama3_rope": (transformers.LlamaConfig, {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}}),
    "llama_linear_rope_head_dim": (transformers.LlamaConfig, {"head_dim": 32, "rope_scaling": {
        "rope_type": "linear", "factor": 2.0}}),
    "mistral": (transformers.MistralConfig, {"sliding_window": None}),
    "qwen2": (transformers.Qwen2Config, {"tie_word_embeddings": True}),
    "qwen3_head_dim": (transformers.Qwen3Config, {"head_dim": 32}),
    # Phi-3: fused qkv / gate_up split at load; LongRoPE below its original context (short factors, the
    # attention factor of a 128 / 64 context extension)
    "phi3_longrope": (transformers.Phi3Config, {"pad_token_id": 0, "original_max_position_embeddings": 64,
                                                "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.1 * i for i in range(8)],
        "long_factor": [2.0 + 0.3 * i for i in range(8)]}}),
    # sliding windows shorter than the sequences (37 and 11 tokens)
    "mistral_window": (transformers.MistralConfig, {"sliding_window": 8}),
    "gemma2": (transformers.Gemma2Config, {"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 24,
                                           "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0}),
    "gemma3": (transformers.Gemma3TextConfig, {
        "head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 24,
        "layer_types": ["sliding_attention", "full_attention"], "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}}}),
}


def _save_random(path, config_cls, overrides, max_shard_size=None):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config_cls(**{**TINY, **overrides}))
    with torch.no_grad():
        for name, p in hf.named_parameters():  # HF inits norms to 1 and biases to 0: perturb them
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    hf.generation_config.eos_token_id = [2, 5]
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    hf.save_pretrained(path, **kwargs)
    return hf.eval()


def _compare(model, hf, page_size=4):
    compare_logits(model, hf, TINY["vocab_size"], page_size)


@pytest.mark.parametrize("case", sorted(CASES))
@torch.no_grad()
def test_logits_match_transformers(case, tmp_path):
    config_cls, overrides = CASES[case]
    hf = _save_random(tmp_path, config_cls, overrides)
    model, cfg = load_model(str(tmp_path), device="cpu", dtype=torch.float32)
    assert cfg.eos_token_ids == (2, 5)  # generation_config.json wins over config.json
    assert cfg.attention_bias == (case == "qwen2")
    _compare(model, hf)


@torch.no_grad()
def test_sharded_checkpoint(tmp_path):
    hf = _save_random(tmp_path, transformers.LlamaConfig, {}, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model, _ = load_model(str(tmp_path), load_format="safetensors")
    _compare(model, hf, page_size=1)


def test_llama3_config_parsed(tmp_path):
    _save_random(tmp_path, *CASES["llama3_rope"])
    _, cfg = load_model(str(tmp_path), load_format="dummy")
    assert cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "llama3"
    assert cfg.rope_scaling.original_max_position_embeddings == 16 and cfg.rope_theta == 500000.0


@torch.no_grad()
def test_phi3_long_factors_per_position(tmp_path):
    """LongRoPE past the original context: positions from it on take the long factors, the earlier ones
    keep the short factors' K/V, as transformers' forward computes decodes over its cache."""
    hf = _save_random(tmp_path, *CASES["phi3_longrope"])
    model, cfg = load_model(str(tmp_path), device="cpu", dtype=torch.float32)
    assert cfg.rope_scaling.original_max_position_embeddings == 64 and cfg.rope_scaling.attention_factor > 1
    seq = torch.randint(0, TINY["vocab_size"], (70,), generator=torch.Generator().manual_seed(2)).tolist()
    session = PagedSession(model, num_pages=64, page_size=4, seed=3)
    session.add(0, seq)
    ours = [session.step([(0, 60)])] + [session.step([(0, 1)]) for _ in range(10)]
    out = hf(torch.tensor([seq[:60]]), use_cache=True)
    ref, cache = [out.logits[:, -1]], out.past_key_values
    for p in range(60, 70):
        out = hf(torch.tensor([[seq[p]]]), cache=cache, position_ids=torch.tensor([[p]]), use_cache=True)
        ref.append(out.logits[:, -1])
        cache = out.past_key_values
    torch.testing.assert_close(torch.cat(ours), torch.cat(ref).float(), atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_gemma3_multimodal_checkpoint_served_as_text(tmp_path):
    """Gemma 3 4B and up ship as Gemma3ForConditionalGeneration: the text_config and the language model's
    tensors are the decoder; the vision tower is skipped."""
    text = {**TINY, **CASES["gemma3"][1]}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 28, "patch_size": 14}
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4))
    for name, p in hf.named_parameters():
        if "norm" in name:
            p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    model, cfg = load_model(str(tmp_path), device="cpu", dtype=torch.float32)
    assert (cfg.architecture, cfg.vocab_size, cfg.layer_windows, cfg.qk_norm) == ("gemma3", 96, (8, 0), True)
    _compare(model, hf.eval())


@torch.no_grad()
def test_phi3_fused_tensors_split_before_tensor_parallel_slicing(tmp_path):
    """Phi-3's fused qkv_proj / gate_up_proj are split at load, so a rank keeps its heads of q, k and v and its
    columns of gate and up, as from a Llama checkpoint."""
    from radixrelay.model.parallel import TensorParallel

    _save_random(tmp_path, *CASES["phi3_longrope"])
    full, cfg = load_model(str(tmp_path))
    rank, _ = load_model(str(tmp_path), tp=TensorParallel(1, 2))
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    w = full.model.layers[0].self_attn.qkv_proj.weight
    want = torch.cat([w[q // 2:q], w[q + kv // 2:q + kv], w[q + kv + kv // 2:]])
    torch.testing.assert_close(rank.model.layers[0].self_attn.qkv_proj.weight, want, rtol=0, atol=0)
    w = full.model.layers[1].mlp.gate_up_proj.weight
    want = torch.cat([w[inter // 2:inter], w[inter + inter // 2:]])
    torch.testing.assert_close(rank.model.layers[1].mlp.gate_up_proj.weight, want, rtol=0, atol=0)
