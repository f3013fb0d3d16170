"""Rotary embedding of q and k plus the K/V store into the paged cache, in one launch.

API::

    rope_and_store(qkv, cos, sin, slots, k_cache, v_cache, num_q_heads, num_kv_heads) -> q

    qkv:      [T, (Hq + 2 * Hkv) * D] fp16 / bf16 / fp32, the fused projection's output (q | k | v heads)
    cos, sin: [T, D] float32 from ``RotaryEmbedding``: ``cos`` repeated over both halves, ``sin`` as
              ``[-sin, sin]``
    slots:    [T] int64, the KV slot of each token
    k_cache, v_cache: [num_slots, Hkv, D] (one layer's); written at ``slots``: k rotated, v as is
    q:        [T, Hq, D] new tensor, rotated, dtype of qkv

Rotate-half RoPE with the roundings of ``radixrelay.model.layers.apply_rope`` in 16-bit dtypes: cos and
sin rounded to the dtype, each product rounded, then their sum (``x * cos + rotate_half(x) * sin``): the
unfused ops' result, bit for bit under the interpreter, within a rounding step of the dtype compiled for a
GPU. Replaces ~14 small kernels a layer on the GPU (two
``apply_rope`` of 6 each and two ``index_copy_``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixrelay.kernels._common import FLOAT_DTYPES, check


@triton.jit
def _rotate(x1, x2, c1, c2, s1, s2):
    """Halves of ``x * cos + rotate_half(x) * sin``, each product and the sum rounded to x's dtype."""
    dt = x1.dtype
    a1 = (x1.to(tl.float32) * c1).to(dt)
    b1 = (x2.to(tl.float32) * s1).to(dt)
    a2 = (x2.to(tl.float32) * c2).to(dt)
    b2 = (x1.to(tl.float32) * s2).to(dt)
    return (a1.to(tl.float32) + b1.to(tl.float32)).to(dt), (a2.to(tl.float32) + b2.to(tl.float32)).to(dt)


# num_tokens varies per step; not specialised (radixrelay.worker.warmup: no compiles after ready).
@triton.jit(do_not_specialize=["num_tokens"])
def _rope_store_kernel(
    qkv, cos, sin, slots, q_out, k_cache, v_cache, num_tokens,
    stride_qkv, stride_cs, stride_q_t, stride_q_h, stride_c_slot, stride_c_h,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, FP8: tl.constexpr,
):
    # grid: (T, Hq + Hkv); a program rotates one q head, or one k head and copies the v head beside it.
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, HALF)
    dt = qkv.dtype.element_ty
    cs = t * stride_cs
    c1 = tl.load(cos + cs + offs).to(dt).to(tl.float32)
    c2 = tl.load(cos + cs + HALF + offs).to(dt).to(tl.float32)
    s1 = tl.load(sin + cs + offs).to(dt).to(tl.float32)
    s2 = tl.load(sin + cs + HALF + offs).to(dt).to(tl.float32)
    row = qkv + t * stride_qkv
    src = row + h * (2 * HALF)                           # q head h, or k head h - Hq (k follows q)
    x1 = tl.load(src + offs)
    x2 = tl.load(src + HALF + offs)
    r1, r2 = _rotate(x1, x2, c1, c2, s1, s2)
    if h < NUM_Q_HEADS:
        q_dst = q_out + t * stride_q_t + h * stride_q_h
        tl.store(q_dst + offs, r1)
        tl.store(q_dst + HALF + offs, r2)
    else:
        kv_head = h - NUM_Q_HEADS
        slot = tl.load(slots + t)
        at = slot * stride_c_slot + kv_head * stride_c_h     # (names differ from the q branch: Triton types them)
        v = row + (NUM_Q_HEADS + NUM_KV_HEADS + kv_head) * (2 * HALF)
        _store_kv(k_cache + at + offs, r1, FP8)
        _store_kv(k_cache + at + HALF + offs, r2, FP8)
        _store_kv(v_cache + at + offs, tl.load(v + offs), FP8)
        _store_kv(v_cache + at + HALF + offs, tl.load(v + HALF + offs), FP8)


@triton.jit
def _store_kv(dst, x, FP8: tl.constexpr):
    # an FP8 cache (e4m3, scale 1) keeps x clamped to the format's range (+-448), rounded to nearest
    if FP8:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0)
    tl.store(dst, x.to(dst.dtype.element_ty))


def rope_and_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, num_q_heads: int, num_kv_heads: int) -> torch.Tensor:
    """See the module docstring."""
    check(qkv.dim() == 2 and qkv.dtype in FLOAT_DTYPES,
          f"rope_and_store: qkv must be [tokens, width] fp16/bf16/fp32, got {tuple(qkv.shape)} {qkv.dtype}")
    check(k_cache.dtype == v_cache.dtype and k_cache.dtype in (qkv.dtype, torch.float8_e4m3fn),
          f"rope_and_store: the cache must be qkv's dtype or float8_e4m3fn, got {k_cache.dtype}, {v_cache.dtype}")
    check(k_cache.dim() == 3 and k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride(),
          f"rope_and_store: k_cache/v_cache must be [slots, Hkv, D] alike, got {tuple(k_cache.shape)}, "
          f"{tuple(v_cache.shape)}")
    num, head_dim = qkv.shape[0], k_cache.shape[2]
    check(k_cache.shape[1] == num_kv_heads, f"rope_and_store: cache has {k_cache.shape[1]} kv heads, "
          f"expected {num_kv_heads}")
    check(qkv.shape[1] == (num_q_heads + 2 * num_kv_heads) * head_dim,
          f"rope_and_store: qkv width {qkv.shape[1]} != (Hq + 2 Hkv) * D = "
          f"{(num_q_heads + 2 * num_kv_heads) * head_dim}")
    check(head_dim % 2 == 0 and (head_dim // 2) & (head_dim // 2 - 1) == 0,
          f"rope_and_store: head_dim / 2 must be a power of two, got head_dim {head_dim}")
    check(cos.shape == sin.shape == (num, head_dim) and cos.dtype == sin.dtype == torch.float32,
          f"rope_and_store: cos, sin must be float32 [{num}, {head_dim}], got {tuple(cos.shape)} {cos.dtype}, "
          f"{tuple(sin.shape)} {sin.dtype}")
    check(cos.stride() == sin.stride() and cos.stride(1) == 1, "rope_and_store: cos and sin must share a row layout")
    check(slots.shape == (num,) and slots.dtype == torch.int64, f"rope_and_store: slots must be int64 [{num}]")
    check(qkv.device == cos.device == slots.device == k_cache.device == v_cache.device,
          "rope_and_store: all tensors must be on one device")
    check(qkv.stride(1) == 1 and k_cache.stride(2) == 1, "rope_and_store: rows and head_dim must be contiguous")
    q = torch.empty(num, num_q_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num:
        _rope_store_kernel[(num, num_q_heads + num_kv_heads)](
            qkv, cos, sin, slots, q, k_cache, v_cache, num,
            qkv.stride(0), cos.stride(0), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
            NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HALF=head_dim // 2,
            FP8=k_cache.dtype == torch.float8_e4m3fn, num_warps=1)
    return q
