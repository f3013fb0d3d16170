"""ModelConfig parsing/validation, the model registry and load_model's format handling."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from radixrelay.model import ModelConfig, RopeScaling, load_model, resolve_model_path
from radixrelay.model.architectures import (
    ARCHITECTURES,
    architecture,
    from_gguf_name,
    from_hf_config,
)

HF_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 100, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5, "max_position_embeddings": 64, "bos_token_id": 1, "eos_token_id": 2,
}


def test_from_hf_transformers4_style():
    cfg = ModelConfig.from_hf({**HF_LLAMA, "rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 4.0}})
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.group_size, cfg.q_size, cfg.kv_size) == (8, 2, 2, 32, 16)
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling == RopeScaling("linear", factor=4.0)
    assert cfg.eos_token_ids == (2,) and not cfg.tie_word_embeddings and not cfg.attention_bias


def test_from_hf_defaults_and_generation_eos():
    cfg = ModelConfig.from_hf({k: v for k, v in HF_LLAMA.items() if k != "num_key_value_heads"},
                              generation={"eos_token_id": [2, 7]})
    assert cfg.num_kv_heads == 4 and cfg.eos_token_ids == (2, 7) and cfg.rope_scaling is None
    qwen = ModelConfig.from_hf({**HF_LLAMA, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"})
    assert qwen.architecture == "qwen2" and qwen.attention_bias


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "unsupported architecture"),
    ({"num_key_value_heads": 3}, "does not divide"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "unsupported 'yarn'"),
    ({"mlp_bias": True}, "not supported"),
    ({"eos_token_id": 100}, "eos_token_ids"),
    ({"hidden_size": 0}, "hidden_size"),
])
def test_from_hf_rejects(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**HF_LLAMA, **change})


def test_sliding_windows_per_layer():
    """Windows are the model's (the context is not capped at them): every layer for Mistral and Phi-3, the
    layers from max_window_layers on for Qwen2 with use_sliding_window, layer_types where given."""
    mistral = {**HF_LLAMA, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
               "max_position_embeddings": 32768, "sliding_window": 4096}
    cfg = ModelConfig.from_hf(mistral)
    assert cfg.max_position_embeddings == 32768 and cfg.layer_windows == (4096, 4096)
    assert (cfg.window(0), cfg.window(1)) == (4096, 4096)
    qwen = {**HF_LLAMA, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
            "max_position_embeddings": 32768, "sliding_window": 4096, "use_sliding_window": False}
    assert ModelConfig.from_hf(qwen).layer_windows == () and ModelConfig.from_hf(qwen).window(1) is None
    qwen.update(use_sliding_window=True, max_window_layers=1)
    assert ModelConfig.from_hf(qwen).layer_windows == (0, 4096)
    typed = {**mistral, "layer_types": ["full_attention", "sliding_attention"]}
    assert ModelConfig.from_hf(typed).layer_windows == (0, 4096)
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_hf({**mistral, "layer_types": ["sliding_attention"]})


def test_gemma_configs():
    """Gemma 2 / 3 switches, from transformers 4's spelling (no layer_types: Gemma 2 windows every other
    layer from the first, Gemma 3 all but every sliding_window_pattern-th)."""
    gemma = {**HF_LLAMA, "head_dim": 16, "sliding_window": 512, "query_pre_attn_scalar": 144,
             "hidden_activation": "gelu_pytorch_tanh", "num_hidden_layers": 6}
    g2 = ModelConfig.from_hf({**gemma, "architectures": ["Gemma2ForCausalLM"], "attn_logit_softcapping": 50.0,
                              "final_logit_softcapping": 30.0})
    assert g2.layer_windows == (512, 0) * 3 and (g2.attn_logit_softcap, g2.final_logit_softcap) == (50.0, 30.0)
    assert g2.sandwich_norms and g2.embedding_scale and g2.hidden_act == "gelu_tanh" and g2.tie_word_embeddings
    assert g2.attn_scale == 144 ** -0.5 and not g2.qk_norm and g2.local_rope_theta is None
    g3 = ModelConfig.from_hf({**gemma, "architectures": ["Gemma3ForCausalLM"], "rope_theta": 1e6,
                              "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                              "sliding_window_pattern": 3})
    assert g3.layer_windows == (512, 512, 0) * 2 and g3.qk_norm and g3.attn_logit_softcap is None
    assert (g3.rope_theta, g3.local_rope_theta, g3.rope_scaling) == (1e6, 1e4, RopeScaling("linear", factor=8.0))
    with pytest.raises(ValueError, match="hidden_activation"):
        ModelConfig.from_hf({**gemma, "architectures": ["Gemma2ForCausalLM"], "hidden_activation": "relu"})


def test_from_hf_missing_key():
    with pytest.raises(ValueError, match="vocab_size"):
        ModelConfig.from_hf({k: v for k, v in HF_LLAMA.items() if k != "vocab_size"})


def test_from_gguf_metadata():
    meta = {"general.architecture": "qwen2", "qwen2.block_count": 2, "qwen2.context_length": 128,
            "qwen2.embedding_length": 32, "qwen2.feed_forward_length": 64, "qwen2.attention.head_count": 4,
            "qwen2.attention.head_count_kv": 2, "qwen2.attention.layer_norm_rms_epsilon": 1e-6,
            "qwen2.rope.freq_base": 1e6, "qwen2.rope.scaling.type": "linear",
            "qwen2.rope.scaling.factor": 2.0, "tokenizer.ggml.eos_token_id": 5}
    shapes = {"token_embd.weight": (100, 32), "blk.0.attn_q.bias": (32,)}
    cfg = ModelConfig.from_gguf(meta, shapes)
    assert (cfg.vocab_size, cfg.head_dim, cfg.attention_bias, cfg.tie_word_embeddings) == (100, 8, True, True)
    assert cfg.rope_scaling == RopeScaling("linear", factor=2.0) and cfg.eos_token_ids == (5,)
    with pytest.raises(ValueError, match="qwen2.block_count"):
        ModelConfig.from_gguf({k: v for k, v in meta.items() if k != "qwen2.block_count"}, shapes)
    with pytest.raises(ValueError, match="general.architecture"):
        ModelConfig.from_gguf({**meta, "general.architecture": "gemma"}, shapes)


def test_resolve_model_path(tmp_path):
    assert resolve_model_path("default").name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert resolve_model_path(str(tmp_path)) == tmp_path
    with pytest.raises(ValueError, match="never downloaded"):
        resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_load_model_format_errors(tmp_path):
    with pytest.raises(ValueError, match="neither"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(HF_LLAMA))
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_model(str(tmp_path), load_format="safetensors")
    cfg = ModelConfig.from_hf(HF_LLAMA)
    with pytest.raises(ValueError, match="dummy"):
        load_model(cfg, load_format="gguf")


def test_dummy_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(HF_LLAMA))
    model, cfg = load_model(str(tmp_path), load_format="dummy", seed=3)
    again, _ = load_model(cfg, seed=3)
    assert cfg == ModelConfig.from_hf(HF_LLAMA)
    for (name, p), (_, q) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(p, q), name
        assert not p.requires_grad
    assert (model.model.norm.weight == 1).all()
    assert 0.01 < model.model.layers[0].mlp.down_proj.weight.std().item() < 0.03


def test_config_is_frozen():
    cfg = ModelConfig.from_hf(HF_LLAMA)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_layers = 3  # type: ignore[misc]


def test_architecture_registry():
    """config.json and GGUF names resolve through the registry; unknown names are refused by name."""
    for entry in ARCHITECTURES.values():
        for hf_class in entry.hf_classes:
            assert from_hf_config({"architectures": [hf_class]}) is entry
        assert from_hf_config({"model_type": entry.name}) is entry
        if entry.gguf_name:
            assert from_gguf_name(entry.gguf_name) is entry
    assert architecture("llama").gguf_rope_permuted and not architecture("qwen2").gguf_rope_permuted
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        architecture("gpt2")
    with pytest.raises(ValueError, match="ModelConfig.architecture"):
        ModelConfig(architecture="gpt2", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                    num_heads=1, num_kv_heads=1, head_dim=8)


def test_phi3_longrope_config():
    """transformers 4's spelling (``rope_scaling`` type ``su``, the original context at the top level): the
    attention factor derived from the contexts' ratio; partial rotary refused."""
    phi3 = {**HF_LLAMA, "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "max_position_embeddings": 4096,
            "original_max_position_embeddings": 256, "sliding_window": None,
            "rope_scaling": {"type": "su", "short_factor": [1.0] * 4, "long_factor": [2.0, 3.0, 4.0, 5.0]}}
    cfg = ModelConfig.from_hf(phi3)
    s = cfg.rope_scaling
    assert (cfg.architecture, s.rope_type, s.original_max_position_embeddings, s.factor) == ("phi3", "longrope", 256, 16)
    assert s.attention_factor == pytest.approx(math.sqrt(1 + math.log(16) / math.log(256)))
    assert s.long_factor == (2.0, 3.0, 4.0, 5.0) and cfg.max_position_embeddings == 4096
    with pytest.raises(ValueError, match="head_dim / 2 = 4 factors"):
        ModelConfig.from_hf({**phi3, "rope_scaling": {**phi3["rope_scaling"], "short_factor": [1.0] * 3,
                                                      "long_factor": [1.0] * 3}})
    with pytest.raises(ValueError, match="partial rotary"):
        ModelConfig.from_hf({**phi3, "partial_rotary_factor": 0.75})
