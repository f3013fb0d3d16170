"""Routed experts (radixrelay.model.moe): Mixtral and Qwen3-MoE checkpoints written by transformers load and
give transformers' logits (per-expert tensors and transformers 5's stacked layout; dense layers beside sparse
ones; top-k weights renormalized or not); the grouped torch path equals a per-token float64 reference; the
config's readings and refusals. Greedy tokens through the Engine: tests/model/test_families.py; two ranks:
tests/model/test_tensor_parallel.py."""

from __future__ import annotations

import json

import pytest
import torch

from radixrelay.model import ModelConfig, load_model
from radixrelay.model.moe import grouped_experts_torch, route
from radixrelay.model.parallel import TensorParallel
from radixrelay.model.quantization import Precision
from tests.model.paged import compare_logits

transformers = pytest.importorskip("transformers")

TINY = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
        "initializer_range": 0.2, "bos_token_id": 1, "eos_token_id": 2}
CASES = {
    "mixtral": (transformers.MixtralConfig, {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # a dense layer beside a sparse one, top-k weights renormalized
    "qwen3_moe": (transformers.Qwen3MoeConfig, {"head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2,
                                                "moe_intermediate_size": 32, "mlp_only_layers": [1],
                                                "norm_topk_prob": True}),
    # every layer sparse, three of four experts, weights not renormalized
    "qwen3_moe_top3": (transformers.Qwen3MoeConfig, {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 3,
                                                     "moe_intermediate_size": 48, "norm_topk_prob": False}),
}


def _random(config_cls, overrides):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config_cls(**{**TINY, **overrides}), dtype=torch.float32)
    with torch.no_grad():
        for name, p in hf.named_parameters():      # HF inits norms to 1: perturb them
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return hf.eval()


def _compare(model, hf, page_size=4):
    compare_logits(model, hf, TINY["vocab_size"], page_size)


@pytest.mark.parametrize("case", sorted(CASES))
@torch.no_grad()
def test_logits_match_transformers(case, tmp_path):
    hf = _random(*CASES[case])
    hf.save_pretrained(tmp_path)                    # per-expert tensors (transformers' checkpoint layout)
    model, cfg = load_model(str(tmp_path), device="cpu", dtype=torch.float32)
    overrides = CASES[case][1]
    assert (cfg.num_experts, cfg.num_experts_per_tok) == (4, overrides["num_experts_per_tok"])
    assert cfg.moe_layers == ((0,) if case == "qwen3_moe" else (0, 1))
    assert cfg.moe_renormalize == overrides.get("norm_topk_prob", True)
    _compare(model, hf)


@torch.no_grad()
def test_stacked_expert_tensors(tmp_path):
    """A checkpoint holding each layer's experts in two stacked tensors (transformers 5's in-memory layout:
    ``experts.gate_up_proj`` [E, 2I, hidden], ``experts.down_proj`` [E, hidden, I]) loads the same."""
    from safetensors.torch import save_file

    hf = _random(*CASES["mixtral"])
    hf.config.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 2 * 96, 64)
    save_file(state, tmp_path / "model.safetensors")
    model, _ = load_model(str(tmp_path), device="cpu", dtype=torch.float32)
    _compare(model, hf)


def test_grouped_experts_equal_a_per_token_reference():
    """Tokens grouped by expert (some experts chosen by none) against each token's experts one by one, in
    float64."""
    gen = torch.Generator().manual_seed(0)
    tokens, hidden, inter, experts, k = 9, 16, 24, 6, 2
    x = torch.randn(tokens, hidden, generator=gen)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.3
    down = torch.randn(experts, hidden, inter, generator=gen) * 0.3
    logits = torch.randn(tokens, experts, generator=gen)
    logits[:, 4:] -= 100                                                  # experts 4 and 5 never chosen
    ids, weights = route(logits, k, renormalize=True)
    assert torch.allclose(weights, torch.softmax(torch.gather(logits, 1, ids), -1))   # softmax over the top-k
    got = grouped_experts_torch(x, ids, weights, gate_up, down)
    want = torch.zeros(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        for j in range(k):
            e = int(ids[t, j])
            g, u = (gate_up[e].double() @ x[t].double()).chunk(2)
            want[t] += weights[t, j].double() * (down[e].double() @ (torch.nn.functional.silu(g) * u))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert got.dtype == torch.float32


def _config(**over) -> ModelConfig:
    base = {"architecture": "mixtral", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96,
            "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "num_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 96, "moe_layers": (0, 1)}
    return ModelConfig(**{**base, **over})


def test_config_checks_and_refusals(tmp_path):
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        _config(num_experts_per_tok=5)
    with pytest.raises(ValueError, match="moe_layers"):
        _config(moe_layers=(1, 0))
    with pytest.raises(ValueError, match="moe_layers"):
        _config(moe_layers=(2,))
    with pytest.raises(ValueError, match="num_experts"):
        _config(num_experts=0)
    assert _config(moe_intermediate_size=35).tensor_parallel_problem(2) == (
        "tensor parallel size 2 does not split an expert width of 35")
    with pytest.raises(ValueError, match="not supported in FP8"):
        load_model(_config(), load_format="dummy", precision=Precision(weights="fp8", emulate=True))
    # Qwen3-MoE's sparse layers: every decoder_sparse_step-th outside mlp_only_layers
    cfg = {**TINY, "architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 6, "num_experts": 8,
           "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    _, read = load_model(str(tmp_path), load_format="dummy")
    assert (read.architecture, read.moe_layers, read.moe_renormalize, read.qk_norm) == ("qwen3_moe", (1, 5), False,
                                                                                          True)


def test_what_a_rank_holds():
    """Every expert on every rank, each expert's width split: gate/up rows and down columns."""
    config = _config(moe_intermediate_size=48)
    full, _ = load_model(config, load_format="dummy", seed=1)
    rank, _ = load_model(config, load_format="dummy", seed=1, tp=TensorParallel(1, 2))
    ours, theirs = rank.model.layers[1].mlp, full.model.layers[1].mlp
    assert ours.experts.gate_up_proj.shape == (4, 48, 64) and ours.experts.down_proj.shape == (4, 64, 24)
    w = theirs.experts.gate_up_proj
    torch.testing.assert_close(ours.experts.gate_up_proj, torch.cat([w[:, 24:48], w[:, 72:]], dim=1), rtol=0, atol=0)
    torch.testing.assert_close(ours.experts.down_proj, theirs.experts.down_proj[:, :, 24:], rtol=0, atol=0)
    torch.testing.assert_close(ours.gate.weight, theirs.gate.weight, rtol=0, atol=0)


@torch.no_grad()
def test_e4m3_expert_weights_dequantized():
    """An FP8 checkpoint's expert weight (e4m3 with its scale) loads into a model in its dtype dequantized."""
    from radixrelay.model.loader import dummy_weights

    config = _config()
    model, _ = load_model(config, load_format="dummy", seed=2)
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    weights = dict(dummy_weights(config, "cpu", torch.float32, seed=2))
    scale = weights[name].abs().max() / 448
    e4m3 = (weights[name] / scale).to(torch.float8_e4m3fn)
    weights[name] = e4m3
    model.load_weights([*weights.items(), (name.removesuffix("weight") + "weight_scale", scale)])
    torch.testing.assert_close(model.model.layers[1].mlp.experts.shard("gate_up_proj", 5), e4m3.float() * scale)


_GGUF_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _write_moe_gguf(path, hf, arch: str) -> None:
    """As llama.cpp's converter writes Mixtral (``llama``: q/k rows interleaved per head) and ``qwen3moe``
    (F32): each layer's experts stacked per projection (ffn_gate_exps, ffn_up_exps, ffn_down_exps)."""
    gguf = pytest.importorskip("gguf")
    cfg = hf.config
    writer = gguf.GGUFWriter(path, arch)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    for key, value in (("block_count", cfg.num_hidden_layers), ("context_length", cfg.max_position_embeddings),
                       ("embedding_length", cfg.hidden_size), ("feed_forward_length", cfg.intermediate_size),
                       ("attention.head_count", cfg.num_attention_heads),
                       ("attention.head_count_kv", cfg.num_key_value_heads), ("attention.key_length", head_dim),
                       ("expert_count", experts), ("expert_used_count", cfg.num_experts_per_tok)):
        writer.add_uint32(f"{arch}.{key}", value)
    if arch == "qwen3moe":
        writer.add_uint32(f"{arch}.expert_feed_forward_length", cfg.moe_intermediate_size)
    writer.add_float32(f"{arch}.rope.freq_base", cfg.rope_parameters["rope_theta"])
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)

    def interleaved(w, heads):       # llama.cpp's llama: each head's rows from rotate-half to interleaved pairs
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)

    for name, p in hf.state_dict().items():
        w = p.detach().float()
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                         "lm_head.weight": "output.weight"}[name]
            writer.add_tensor(gguf_name, w.numpy())
            continue
        _, _, layer, rest = name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        if module == "mlp.experts":                    # kind: gate_up_proj [E, 2I, H] or down_proj [E, H, I]
            parts = dict(zip(("gate", "up"), w.chunk(2, dim=1))) if kind == "gate_up_proj" else {"down": w}
            for proj, part in parts.items():
                writer.add_tensor(f"blk.{layer}.ffn_{proj}_exps.weight", part.contiguous().numpy())
            continue
        if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            w = interleaved(w, cfg.num_attention_heads if "q_proj" in module else cfg.num_key_value_heads)
        writer.add_tensor(f"blk.{layer}.{_GGUF_LAYER[module]}.{kind}", w.contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("case, arch", [("mixtral", "llama"), ("qwen3_moe", "qwen3moe")])
@torch.no_grad()
def test_gguf_files(case, arch, tmp_path):
    """llama.cpp's layouts: Mixtral as ``llama`` (q/k rows interleaved), Qwen3-MoE as ``qwen3moe`` with a dense
    layer (no router) beside a sparse one: transformers' logits."""
    hf = _random(*CASES[case])
    path = tmp_path / f"tiny-{case}.gguf"
    _write_moe_gguf(path, hf, arch)
    model, cfg = load_model(str(path))
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_renormalize) == (4, 2, True)
    assert cfg.moe_layers == ((0,) if case == "qwen3_moe" else (0, 1))
    _compare(model, hf)


def test_warm_up_names_one_variant_per_expert_shape():
    """Start-up warm-up launches the grouped-expert kernels once per distinct expert shape (every layer of
    a model shares one); under the interpreter the launches run, the block sizes they pick reported."""
    from radixrelay.worker.warmup import expert_variants

    model, _ = load_model(_config(), load_format="dummy", seed=3)
    variants = expert_variants(model)
    assert len(variants) == 1 and variants[0].name.startswith("grouped_experts")
    assert variants[0].launch() == [16, 32, 64]
