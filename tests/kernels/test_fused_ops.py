"""The model's fused elementwise kernels (RMSNorm + residual, RoPE + K/V store, SiLU-and-mul) against the
unfused torch ops they replace and a float64 reference; on the CPU under the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

from radixrelay.attention import BatchRequest, KVCache, TorchBackend, build_forward_batch
from radixrelay.kernels.rms_norm import rms_norm, rms_norm_reference
from radixrelay.kernels.rope_store import rope_and_store
from radixrelay.kernels.silu_mul import silu_mul, silu_mul_reference
from radixrelay.model import ModelConfig, RopeScaling, load_model
from radixrelay.model.model_config import ModelConfig as _Cfg
from radixrelay.model.layers import RotaryEmbedding, rope_and_store_reference, set_fused_kernels
from tests.kernels.helpers import DEVICE, tolerance

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _assert_same_roundings(got, want, dtype):
    """The kernels round where the unfused ops round. Under the interpreter in float16 that makes them
    bit-identical. Compiled for a GPU, a few elements land one rounding step apart (measured on an H100:
    the code generator's float math is not torch's op by op); the interpreter truncates to bfloat16
    (numpy has no bfloat16), which compounds over an op's roundings to a few steps."""
    if DEVICE == "cpu" and dtype == torch.float16:
        assert torch.equal(got, want)
    elif dtype == torch.bfloat16 and DEVICE == "cpu":
        torch.testing.assert_close(got, want, atol=0.1, rtol=2 ** -5)
    else:
        step = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10
        torch.testing.assert_close(got, want, atol=step * want.abs().max().item(), rtol=step)


def _rand(shape, dtype, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(shape, generator=gen)).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])      # 96: a masked tail (BLOCK 128)
def test_rms_norm(dtype, hidden):
    x, r = _rand((5, hidden), dtype, 0, 3.0), _rand((5, hidden), dtype, 1)
    w = _rand((hidden,), dtype, 2)
    eps = 1e-5
    tol = tolerance(dtype)
    want = rms_norm_reference(x.double(), w.double(), eps)
    torch.testing.assert_close(rms_norm(x, w, eps).double(), want, atol=tol, rtol=tol)
    # against the unfused ops in the same dtype: equal up to one rounding step of the dtype
    torch.testing.assert_close(rms_norm(x, w, eps), rms_norm_reference(x, w, eps), atol=tol, rtol=tol)
    y, s = rms_norm(x, w, eps, residual=r)
    y_ref, s_ref = rms_norm_reference(x, w, eps, residual=r)
    _assert_same_roundings(s, s_ref, dtype)            # the residual sum rounds exactly as torch's add
    torch.testing.assert_close(y, y_ref, atol=tol, rtol=tol)


def test_rms_norm_empty_and_errors():
    w = _rand((64,), torch.float32, 0)
    assert rms_norm(torch.empty(0, 64, device=DEVICE), w, 1e-6).shape == (0, 64)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(_rand((2, 32), torch.float32, 0), w, 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(_rand((2, 64), torch.float32, 0), w, 1e-6, residual=_rand((3, 64), torch.float32, 1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_and_store_matches_unfused_ops(dtype):
    hq, hkv, d, t = 4, 2, 32, 6
    cfg = _Cfg(architecture="llama", vocab_size=8, hidden_size=hq * d, intermediate_size=8, num_layers=1,
               num_heads=hq, num_kv_heads=hkv, head_dim=d, rope_theta=10000.0)
    rotary = RotaryEmbedding(cfg, device=DEVICE)
    positions = torch.tensor([0, 1, 7, 100, 4095, 3], device=DEVICE)
    cos, sin = rotary(positions)
    qkv = _rand((t, (hq + 2 * hkv) * d), dtype, 3, 2.0)
    slots = torch.tensor([5, 0, 9, 2, 11, 7], dtype=torch.int64, device=DEVICE)
    caches = [torch.zeros(12, hkv, d, dtype=dtype, device=DEVICE) for _ in range(4)]
    q = rope_and_store(qkv, cos, sin, slots, caches[0], caches[1], hq, hkv)
    q_ref = rope_and_store_reference(qkv, cos, sin, slots, caches[2], caches[3], hq, hkv)
    # the same roundings in the same order: bit-identical (fp32 products may fuse into an FMA: 1e-6)
    for got, want in ((q, q_ref), (caches[0], caches[2]), (caches[1], caches[3])):
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        else:
            _assert_same_roundings(got, want, dtype)
    untouched = [i for i in range(12) if i not in slots.tolist()]
    assert not caches[0][untouched].any() and not caches[1][untouched].any()


def test_rope_and_store_errors():
    cos = sin = torch.zeros(2, 32, device=DEVICE)
    cache = torch.zeros(4, 2, 32, device=DEVICE)
    slots = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="width"):
        rope_and_store(torch.zeros(2, 100, device=DEVICE), cos, sin, slots, cache, cache, 4, 2)
    with pytest.raises(ValueError, match="slots"):
        rope_and_store(torch.zeros(2, 256, device=DEVICE), cos, sin, slots.int(), cache, cache, 4, 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [48, 1100])        # 1100: two column blocks, a masked tail
def test_silu_mul(dtype, inter):
    x = _rand((3, 2 * inter), dtype, 4, 2.0)
    tol = tolerance(dtype)
    torch.testing.assert_close(silu_mul(x).double(), silu_mul_reference(x.double()), atol=tol, rtol=tol)
    torch.testing.assert_close(silu_mul(x), silu_mul_reference(x), atol=tol, rtol=tol)


@pytest.fixture
def fused_everywhere():
    set_fused_kernels("on")
    yield
    set_fused_kernels("auto")


_TINY = {"architecture": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_layers": 2,
         "num_heads": 4, "num_kv_heads": 2, "head_dim": 16}
_FAMILIES = {       # the families' switches where the fused kernels meet them (docs/models.md)
    "llama": {},
    "qwen3": {"architecture": "qwen3", "qk_norm": True},
    "phi3-longrope": {"architecture": "phi3", "max_position_embeddings": 64, "rope_scaling": RopeScaling(
        "longrope", factor=2.0, original_max_position_embeddings=8, short_factor=(1.0,) * 8,
        long_factor=tuple(1.0 + i for i in range(8)), attention_factor=1.2)},
    "gemma": {"architecture": "gemma3_text", "qk_norm": True, "sandwich_norms": True, "hidden_act": "gelu_tanh",
              "embedding_scale": True, "layer_windows": (4, 0), "local_rope_theta": 1e4, "attn_logit_softcap": 5.0,
              "final_logit_softcap": 3.0, "attn_scale": 0.2},
}


@pytest.mark.parametrize("family", sorted(_FAMILIES))
def test_model_with_fused_kernels_matches_unfused(fused_everywhere, family):
    """A prefill then a decode of a small random model: logits and the KV cache agree, fused or not (fp32)."""
    cfg = ModelConfig(**{**_TINY, **_FAMILIES[family]})
    model, _ = load_model(cfg, seed=0, device=DEVICE, dtype=torch.float32)   # (bfloat16 by default on CUDA)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, cfg.vocab_size, (11,), generator=gen).to(DEVICE)
    out = {}
    for mode in ("on", "off"):
        set_fused_kernels(mode)
        cache = KVCache(num_layers=2, num_pages=4, page_size=4, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                        device=DEVICE)
        prefill = model(ids[:10], build_forward_batch([BatchRequest([2, 0, 3], 0, 10)], 4, DEVICE), cache,
                        TorchBackend())
        decode = model(ids[10:], build_forward_batch([BatchRequest([2, 0, 3], 10, 1)], 4, DEVICE), cache,
                       TorchBackend())
        out[mode] = (prefill, decode, cache.k[1].clone(), cache.v[1].clone())
    for got, want in zip(out["on"], out["off"]):    # fp32: last-bit differences (sum order, exp, rsqrt)
        torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=1e-4)


def test_set_fused_kernels_rejects_unknown_mode():
    with pytest.raises(ValueError, match="auto, on or off"):
        set_fused_kernels("yes")
