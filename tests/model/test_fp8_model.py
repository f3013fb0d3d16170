"""FP8 in the model (``radixrelay.model.quantization``), on the CPU through its emulation: the FP8 linear
layer against the arithmetic's reference, weights quantized at load, FP8 checkpoints (loaded as they are,
or dequantized into a model that does not run in FP8), the emulated FP8 KV cache, the default model's
logits, and the refusals where FP8 cannot run."""

from __future__ import annotations

import json

import pytest
import torch

from radixrelay.attention import KVCache
from radixrelay.config import EngineConfig
from radixrelay.kernels.fp8 import E4M3, emulated_linear, fake_quantize_kv, quantize_weight
from radixrelay.model import ModelConfig, load_model
from radixrelay.model.loader import dummy_weights
from radixrelay.model.quantization import Fp8Linear, Precision
from tests.model.paged import PagedSession

EMULATED = Precision(weights="fp8", emulate=True)
TINY = ModelConfig(architecture="llama", vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16)


def _on_e4m3_grid(t: torch.Tensor) -> bool:
    return torch.equal(t.float(), t.float().to(E4M3).float())


def test_fp8_linear_computes_the_emulated_product():
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(48, 32, generator=gen), torch.randn(5, 32, generator=gen) * 3
    x[2] = 0                                                            # an all-zero token stays zero
    layer = Fp8Linear(32, 48, emulate=True)
    layer.load_rows(0, w[:16])                                          # loaded in two shards, as fused layers are
    layer.load_rows(16, w[16:])
    q, scale = quantize_weight(w)
    assert torch.equal(layer.weight, q.float()) and torch.equal(layer.weight_scale, scale)
    torch.testing.assert_close(layer(x), emulated_linear(x, q, scale), rtol=1e-6, atol=1e-6)
    assert layer(x)[2].eq(0).all()
    assert layer(x[None]).shape == (1, 5, 48)                           # leading dimensions kept


def test_quantized_at_load_then_tracks_the_unquantized_model():
    base, _ = load_model(TINY, load_format="dummy", seed=3)
    fp8, _ = load_model(TINY, load_format="dummy", seed=3, precision=EMULATED)
    for a, b in zip(base.model.layers, fp8.model.layers):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            full, quant = a.get_submodule(name), b.get_submodule(name)
            assert isinstance(quant, Fp8Linear) and _on_e4m3_grid(quant.weight)
            err = (quant.weight * quant.weight_scale[:, None] - full.weight).abs().max(1).values
            assert (err <= full.weight.abs().amax(1) * 2.0 ** -4).all()     # half a step of 3 mantissa bits
    assert torch.equal(fp8.model.embed_tokens.weight, base.model.embed_tokens.weight)   # stays unquantized
    one, two = (_logits(m, list(range(5, 45))) for m in (base, fp8))
    assert torch.isfinite(two).all()
    assert (one.softmax(-1) - two.softmax(-1)).abs().sum(-1).max() < 0.1         # close distributions


def _logits(model, tokens: list[int]) -> torch.Tensor:
    session = PagedSession(model, num_pages=8, page_size=16)
    session.add(0, tokens)
    return session.step([(0, len(tokens))], all_logits=True)


def _fp8_checkpoint(tmp_path, per_tensor: set[str]):
    """A safetensors checkpoint of TINY with its linear weights in e4m3 and their scales (per channel, or one
    per tensor for the leaves in ``per_tensor``), plus KV scales; returns (dir, the float32 weights)."""
    from safetensors.torch import save_file

    tensors, full = {}, {}
    for name, t in dummy_weights(TINY, "cpu", torch.float32, seed=5):
        full[name] = t
        leaf = name.split(".")[-2]
        if leaf in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            if leaf in per_tensor:
                scale = t.abs().amax() / 448
                tensors[name], tensors[name + "_scale"] = (t / scale).to(E4M3), scale.reshape(())
            else:
                q, scale = quantize_weight(t)
                tensors[name], tensors[name + "_scale"] = q, scale[:, None]
            tensors[name.replace(".weight", ".input_scale")] = torch.tensor(1.0)       # static: not used
        else:
            tensors[name] = t.contiguous()
    tensors["model.layers.1.self_attn.k_scale"] = torch.tensor(0.5)
    tensors["model.layers.1.self_attn.v_scale"] = torch.tensor(0.25)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": TINY.vocab_size,
        "hidden_size": TINY.hidden_size, "intermediate_size": TINY.intermediate_size,
        "num_hidden_layers": TINY.num_layers, "num_attention_heads": TINY.num_heads,
        "num_key_value_heads": TINY.num_kv_heads, "head_dim": TINY.head_dim, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "quantization_config": {"quant_method": "fp8"}}))
    return tmp_path, tensors


def test_an_fp8_checkpoint_loads_as_it_is_or_dequantized(tmp_path):
    path, tensors = _fp8_checkpoint(tmp_path, per_tensor={"k_proj", "down_proj"})
    fp8, _ = load_model(str(path), precision=EMULATED)
    attn, mlp = fp8.model.layers[0].self_attn, fp8.model.layers[0].mlp
    q, k, v = attn.qkv_proj.weight.split([TINY.q_size, TINY.kv_size, TINY.kv_size])
    assert torch.equal(q, tensors["model.layers.0.self_attn.q_proj.weight"].float())          # as it is
    assert torch.equal(k, tensors["model.layers.0.self_attn.k_proj.weight"].float())
    q_s, k_s, _ = attn.qkv_proj.weight_scale.split([TINY.q_size, TINY.kv_size, TINY.kv_size])
    assert torch.equal(q_s, tensors["model.layers.0.self_attn.q_proj.weight_scale"].flatten())
    assert k_s.eq(tensors["model.layers.0.self_attn.k_proj.weight_scale"]).all()              # per tensor, expanded
    assert mlp.down_proj.weight_scale.eq(tensors["model.layers.0.mlp.down_proj.weight_scale"]).all()
    assert fp8.kv_scales == {1: (0.5, 0.25)}
    # a model that does not run in FP8 gets the weights dequantized
    plain, _ = load_model(str(path))
    want = tensors["model.layers.0.mlp.down_proj.weight"].float() * tensors["model.layers.0.mlp.down_proj.weight_scale"]
    assert torch.equal(plain.model.layers[0].mlp.down_proj.weight, want)
    # per-channel e4m3 weights quantized again at load are the same weights
    again, _ = load_model(str(path), precision=EMULATED)
    assert torch.equal(again.model.layers[1].self_attn.o_proj.weight, fp8.model.layers[1].self_attn.o_proj.weight)


def test_an_fp8_checkpoint_missing_a_scale_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = _fp8_checkpoint(tmp_path, per_tensor=set())
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight_scale"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="without their scale.*up_proj"):
        load_model(str(path), precision=EMULATED)


def test_the_emulated_fp8_kv_cache_keeps_e4m3_values_at_the_layer_s_scale():
    cache = KVCache(num_layers=2, num_pages=2, page_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                    device="cpu")
    cache.fp8_emulation = [(1.0, 1.0), (0.5, 2.0)]
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(3, 2, 8, generator=gen) * 100, torch.randn(3, 2, 8, generator=gen)
    k[0, 0, 0] = 1e4                                                   # past the format: clamped to 448 x scale
    slots = torch.tensor([5, 1, 2])
    cache.store(1, slots, k, v)
    stored_k, stored_v = cache.k[1][slots], cache.v[1][slots]
    assert _on_e4m3_grid(stored_k / 0.5) and _on_e4m3_grid(stored_v / 2.0)
    assert stored_k[0, 0, 0] == 448 * 0.5
    assert torch.equal(stored_v, fake_quantize_kv(v, 2.0))
    assert ((stored_v - v).abs() <= v.abs() * 2.0 ** -4 + 2.0 ** -8).all()


def test_fp8_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="quantization: FP8 needs a CUDA device"):
        EngineConfig(device="cpu", quantization="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype: FP8 needs a CUDA device"):
        EngineConfig(device="cpu", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="quantization: must be one of"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype: must be one of"):
        EngineConfig(kv_cache_dtype="fp16")
    EngineConfig(device="cpu", quantization="fp8", kv_cache_dtype="fp8", fp8_emulation=True)     # emulated: fine
    with pytest.raises(ValueError, match="FP8 tensor cores.*on cpu"):
        load_model(TINY, precision=Precision(weights="fp8"))


def test_fp8_changes_the_tiers_page_keys():
    """An FP8 tier never serves a server of another precision: the namespace of the page keys differs."""
    from types import SimpleNamespace

    from radixrelay.worker.kv_tiers import kv_namespace

    kv = KVCache(num_layers=1, num_pages=1, page_size=16, num_kv_heads=1, head_dim=8, dtype=torch.float32,
                 device="cpu")
    names = set()
    for quantization, kv_dtype, kept in ((None, "auto", ()), ("fp8", "auto", ()), (None, "fp8", ()),
                                         ("fp8", "fp8", ()), ("fp8", "auto", (-1,))):
        cfg = SimpleNamespace(model="default", load_format="auto", seed=0, tp=1, quantization=quantization,
                              kv_cache_dtype=kv_dtype, fp8_keep_layers=kept)
        names.add(kv_namespace(cfg, SimpleNamespace(vocab_size=10), kv))
    assert len(names) == 5


def test_the_precision_is_in_the_metrics():
    from radixrelay.server.prometheus_metrics import ServerMetrics

    parts = Precision(weights="fp8", kv="fp8", emulate=True).describe(torch.bfloat16)
    text = ServerMetrics().render(None, parts).decode()
    assert 'radixrelay_precision_info{part="linear",precision="fp8-e4m3-emulated (per channel) x ' in text
    assert 'radixrelay_precision_info{part="kv_cache",precision="fp8-e4m3-emulated (per-layer scale)"} 1.0' in text
    assert 'part="embedding_lm_head_norms",precision="bfloat16"' in text


def test_kept_layers_stay_in_the_model_dtype_and_the_others_run_in_fp8():
    """``keep_layers`` (negative from the end): those decoder layers' projections are plain linear layers with
    the unquantized weights, the others FP8; the model's logits lie between the unquantized and all-FP8 ones."""
    base, _ = load_model(TINY, load_format="dummy", seed=3)
    fp8, _ = load_model(TINY, load_format="dummy", seed=3, precision=EMULATED)
    kept, _ = load_model(TINY, load_format="dummy", seed=3,
                         precision=Precision(weights="fp8", emulate=True, keep_layers=(-1,)))
    first, last = kept.model.layers
    assert isinstance(first.self_attn.qkv_proj, Fp8Linear) and isinstance(first.mlp.down_proj, Fp8Linear)
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        module = last.get_submodule(name)
        assert not isinstance(module, Fp8Linear), name
        assert torch.equal(module.weight, base.model.layers[1].get_submodule(name).weight), name
    assert not last.input_layernorm.quantize_output and not last.mlp.quantized_down
    ids = torch.arange(24) * 5 % TINY.vocab_size

    def logits(net):
        session = PagedSession(net, num_pages=8, page_size=4)
        session.add(0, ids.tolist())
        return session.step([(0, len(ids))], all_logits=True)

    want, all_fp8, some_fp8 = logits(base), logits(fp8), logits(kept)
    assert 0 < (some_fp8 - want).norm() < (all_fp8 - want).norm()


def test_kept_layers_are_checked():
    with pytest.raises(ValueError, match="only with quantization fp8"):
        Precision(keep_layers=(-1,))
    with pytest.raises(ValueError, match="appears twice"):
        Precision(weights="fp8", emulate=True, keep_layers=(1, 1))
    with pytest.raises(ValueError, match="tuple of layer indices"):
        Precision(weights="fp8", emulate=True, keep_layers=[0])
    with pytest.raises(ValueError, match="layer 2 is not in a model of 2 layers"):
        load_model(TINY, load_format="dummy", precision=Precision(weights="fp8", emulate=True, keep_layers=(2,)))
    with pytest.raises(ValueError, match="fp8_keep_layers: only with quantization fp8"):
        EngineConfig(fp8_keep_layers=(-1,))
    with pytest.raises(ValueError, match="fp8_keep_layers: must be a tuple"):
        EngineConfig(quantization="fp8", fp8_emulation=True, fp8_keep_layers=-1)
    parts = Precision(weights="fp8", emulate=True, keep_layers=(0, -1)).describe(torch.bfloat16)
    assert parts["linear"].endswith("; layers 0, -1 in bfloat16")
