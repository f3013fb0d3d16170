"""Tiny GGUF files written here with gguf.GGUFWriter, the way llama.cpp's converter lays them out
(Q/K rows permuted for ``llama``), in F32 / F16 / BF16 / Q8_0: we load them back correctly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixrelay.model import ModelConfig, load_model
from radixrelay.model.layers import rope_inv_freq
from tests.model.paged import PagedSession

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            initializer_range=0.1, bos_token_id=1, eos_token_id=2)
LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
}
QTYPES = {"F32": gguf.GGMLQuantizationType.F32, "F16": gguf.GGMLQuantizationType.F16,
          "BF16": gguf.GGMLQuantizationType.BF16, "Q8_0": gguf.GGMLQuantizationType.Q8_0}
TOLERANCE = {"F32": 0.0, "F16": 1e-3, "BF16": 1e-2, "Q8_0": 1e-2}  # max abs weight error (|w| < ~0.5)


def _gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{LAYER_NAMES[module]}.{kind}"


def _llamacpp_permute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's converter: rows of each head from rotate-half to interleaved pairs."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _write_gguf(path, hf, arch: str, qtype: str, rope_freqs: torch.Tensor | None = None) -> None:
    cfg = hf.config
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    if getattr(cfg, "head_dim", None):
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, p in hf.state_dict().items():
        w = p.detach().float()
        if arch == "llama" and ".q_proj." in name:
            w = _llamacpp_permute(w, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            w = _llamacpp_permute(w, cfg.num_key_value_heads)
        array = w.numpy()
        if w.dim() == 1 or qtype == "F32":
            writer.add_tensor(_gguf_name(name), array)
        elif qtype == "F16":
            writer.add_tensor(_gguf_name(name), array.astype(np.float16))
        else:
            writer.add_tensor(_gguf_name(name), gguf.quants.quantize(array, QTYPES[qtype]),
                              raw_dtype=QTYPES[qtype])
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _random_hf(config_cls, **overrides):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config_cls(**{**TINY, **overrides}))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    return hf.eval()


def _unfused(model, name: str) -> torch.Tensor:
    """Our parameter slice for an HF parameter name."""
    cfg = model.config
    for proj, fused, shard in (("q_proj", "qkv_proj", 0), ("k_proj", "qkv_proj", 1), ("v_proj", "qkv_proj", 2),
                               ("gate_proj", "gate_up_proj", 0), ("up_proj", "gate_up_proj", 1)):
        if f".{proj}." in name:
            full = model.get_parameter(name.replace(proj, fused))
            sizes = [cfg.q_size, cfg.kv_size, cfg.kv_size] if fused == "qkv_proj" else [cfg.intermediate_size] * 2
            return full.split(sizes)[shard]
    return model.get_parameter(name)


def _logits_both(model, hf, seq_len: int = 29):
    ids = torch.randint(0, TINY["vocab_size"], (seq_len,), generator=torch.Generator().manual_seed(5))
    session = PagedSession(model, num_pages=16, page_size=4)
    session.add(0, ids.tolist())
    ours = session.step([(0, seq_len)], all_logits=True)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    return ours, ref


def test_qwen3_norms_and_head_dim(tmp_path):
    """llama.cpp's qwen3: per-head q/k norms (attn_q_norm, attn_k_norm), head_dim from key_length, NEOX RoPE."""
    hf = _random_hf(transformers.Qwen3Config, head_dim=32)
    path = tmp_path / "tiny-qwen3.gguf"
    _write_gguf(path, hf, "qwen3", "F32")
    model, cfg = load_model(str(path))
    assert (cfg.architecture, cfg.head_dim, cfg.qk_norm, cfg.attention_bias) == ("qwen3", 32, True, False)
    ours, ref = _logits_both(model, hf)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("qtype", sorted(QTYPES))
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tensor_types_and_rope_permutation(tmp_path, arch, qtype):
    config_cls = transformers.LlamaConfig if arch == "llama" else transformers.Qwen2Config
    hf = _random_hf(config_cls)
    path = tmp_path / f"tiny-{arch}-{qtype}.gguf"
    _write_gguf(path, hf, arch, qtype)
    model, cfg = load_model(str(path))
    assert (cfg.architecture, cfg.attention_bias, cfg.tie_word_embeddings) == (arch, arch == "qwen2", False)
    for name, p in hf.named_parameters():
        err = (_unfused(model, name) - p).abs().max().item()
        assert err <= TOLERANCE[qtype] + 1e-7, f"{name}: max error {err}"
    if qtype == "F32":
        ours, ref = _logits_both(model, hf)
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_rope_freqs_tensor_gives_llama3_scaling(tmp_path):
    """llama.cpp stores llama3 RoPE scaling as per-frequency divisors (``rope_freqs``)."""
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16, "rope_theta": 500000.0}
    hf = _random_hf(transformers.LlamaConfig, rope_scaling=rope)
    hf_cfg = ModelConfig.from_hf(hf.config.to_dict())
    plain = ModelConfig.from_hf({**hf.config.to_dict(), "rope_parameters": {"rope_theta": 500000.0}})
    factors = rope_inv_freq(plain) / rope_inv_freq(hf_cfg)
    path = tmp_path / "tiny-llama3.gguf"
    _write_gguf(path, hf, "llama", "F32", rope_freqs=factors)
    model, _ = load_model(str(path))
    ours, ref = _logits_both(model, hf)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


# llama.cpp's names for the modules of Gemma's and Phi-3's blocks (beside LAYER_NAMES')
FAMILY_NAMES = {
    "gemma": {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
              "post_feedforward_layernorm": "post_ffw_norm"},
    "phi3": {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
}
FAMILY_CASES = {   # arch -> (config class, overrides, extra metadata); Gemma's query scalar is head_dim below 27B
    "gemma2": (transformers.Gemma2Config, {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8,
                                           "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0},
               {"attention.sliding_window": 8, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0}),
    "gemma3": (transformers.Gemma3TextConfig, {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 8,
                                               "num_hidden_layers": 3, "sliding_window_pattern": 3,
                                               "layer_types": ["sliding_attention", "sliding_attention",
                                                               "full_attention"]},
               {"attention.sliding_window": 8, "attention.sliding_window_pattern": 3}),
    "phi3": (transformers.Phi3Config, {"pad_token_id": 0, "sliding_window": 8}, {"attention.sliding_window": 8}),
}


def _write_family_gguf(path, hf, arch: str, metadata: dict, tensors: dict | None = None) -> None:
    """As llama.cpp's converter writes these families (F32): Gemma's norms with the 1 added, Phi-3's fused
    tensors kept fused, NEOX RoPE (no row permutation)."""
    cfg = hf.config
    names = {**LAYER_NAMES, **FAMILY_NAMES["phi3" if arch == "phi3" else "gemma"]}
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = cfg.rope_parameters
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"] if "full_attention" in rope else rope["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    for key, value in metadata.items():
        (writer.add_float32 if isinstance(value, float) else writer.add_uint32)(f"{arch}.{key}", value)
    for name, p in hf.state_dict().items():
        w = p.detach().float() + (1.0 if arch != "phi3" and name.endswith("norm.weight") else 0.0)
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            gguf_name = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{names[module]}.{kind}"
        writer.add_tensor(gguf_name, w.numpy())
    for name, array in (tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", sorted(FAMILY_CASES))
def test_gemma_and_phi3_files(tmp_path, arch):
    """llama.cpp's gemma2, gemma3 and phi3 files (sliding windows shorter than the 29-token sequence): the logits
    of the HF model they were written from."""
    config_cls, overrides, metadata = FAMILY_CASES[arch]
    hf = _random_hf(config_cls, **overrides)
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_family_gguf(path, hf, arch, metadata)
    model, cfg = load_model(str(path))
    assert cfg.layer_windows == {"gemma2": (8, 0), "gemma3": (8, 8, 0), "phi3": (8, 8)}[arch]
    ours, ref = _logits_both(model, hf)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_phi3_longrope_factors(tmp_path):
    """llama.cpp's Phi-3 128k layout: LongRoPE's factors as F32 tensors, the original context and the attention
    factor in the metadata: the RoPE of the HF directory, and its logits below the original context."""
    factors = {"short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [2.0 + 0.3 * i for i in range(8)]}
    hf = _random_hf(transformers.Phi3Config, pad_token_id=0, sliding_window=None, original_max_position_embeddings=32,
                    rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, **factors})
    hf.save_pretrained(tmp_path / "hf")
    from_dir, cfg = load_model(str(tmp_path / "hf"))
    path = tmp_path / "tiny-phi3-128k.gguf"
    _write_family_gguf(path, hf, "phi3", {"rope.scaling.original_context_length": 32,
                                          "rope.scaling.attn_factor": cfg.rope_scaling.attention_factor},
                       {f"rope_factors_{kind}.weight": np.array(factors[f"{kind}_factor"], dtype=np.float32)
                        for kind in ("long", "short")})
    model, gguf_cfg = load_model(str(path))
    ours_s, theirs = gguf_cfg.rope_scaling, cfg.rope_scaling           # (the file holds float32 factors)
    assert (ours_s.rope_type, ours_s.original_max_position_embeddings, ours_s.factor) == ("longrope", 32, 4.0)
    assert ours_s.attention_factor == pytest.approx(theirs.attention_factor, rel=1e-6)
    for name in ("inv_freq", "long_inv_freq"):
        torch.testing.assert_close(getattr(model.rotary, name), getattr(from_dir.rotary, name), rtol=0, atol=0)
    ours, ref = _logits_both(model, hf, seq_len=29)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
