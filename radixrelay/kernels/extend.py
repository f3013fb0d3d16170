"""Extend (prefill) attention: ragged new tokens attend their cached paged prefix and themselves, causally.

API::

    extend_attention(q, k_cache, v_cache, page_table, page_size, q_indptr, kv_start, prefix_lens,
                     sm_scale=None, *, max_new_tokens=None, out=None) -> (o, lse)

    q:           [T, Hq, D]           fp16 / bf16 / fp32 new tokens of B requests, ragged
    k_cache:     [num_slots, Hkv, D]  paged cache (docs/kv_layout.md) that ALREADY holds the new tokens' K/V
    page_table:  [B, max_pages] int32 request b's page list
    q_indptr:    [B + 1] int32        request b's tokens are q[q_indptr[b]:q_indptr[b + 1]]
    prefix_lens: [B] int32            new token i of request b sits at position prefix_lens[b] + i
    kv_start:    [B] int32            token i attends positions [kv_start[b], prefix_lens[b] + i] (inclusive);
                                      kv_start > 0 leaves the front to a shared-node call (prompt cascade)
    max_new_tokens: optional host int >= max new tokens of a request (sizes the grid; read from
                    q_indptr with one device sync when left out)
    out:         optional preallocated (o [T, Hq, D] dtype of q, contiguous D; lse [T, Hq] float32)
    returns      o [T, Hq, D] dtype of q, lse [T, Hq] float32 natural log (a token that attends nothing:
                 o = 0, lse = -inf)

One program handles (query tile, request, query head). Key blocks wholly below the tile's first
position run without a mask; the blocks across the diagonal run with the causal mask. Tiles are
issued longest-first (highest positions first) to balance the causal work.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixrelay.kernels._common import (LOG2E, KernelLaunch, attend_reference, check, check_index, check_out,
                                        check_page_table, check_qkv, dot_precision, finish_rows, gather_kv_reference,
                                        load_kv_tile, softmax_step)


# Not specialised (radixrelay.worker.warmup): the index tensors and lse (slices of the step's batch) and
# the page table's row stride (the step's page-table width), so that no new value compiles a new variant.
@triton.jit(do_not_specialize=["page_table", "q_indptr", "kv_start", "prefix_lens", "lse", "stride_pt_b"])
def _extend_kernel(
    q, k_cache, v_cache, page_table, q_indptr, kv_start, prefix_lens, o, lse,
    qk_scale, group,
    stride_q_t, stride_q_h, stride_pt_b, stride_slot, stride_kv_h, stride_o_t, stride_o_h, stride_l_t, stride_l_h,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # grid: (query tiles, B, Hq); tile index reversed so that the longest tiles start first
    m_tile = tl.num_programs(0) - 1 - tl.program_id(0)
    b = tl.program_id(1)
    head = tl.program_id(2)
    t0 = tl.load(q_indptr + b)
    num_new = tl.load(q_indptr + b + 1) - t0
    if m_tile * BLOCK_M >= num_new:
        return

    kv_head = head // group
    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)                  # [BM] index among the new tokens
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    m_ok = offs_m < num_new
    tok = (t0 + offs_m).to(tl.int64)
    q_tile = tl.load(q + tok[:, None] * stride_q_t + head * stride_q_h + offs_d[None, :],
                     mask=m_ok[:, None], other=0.0)                   # [BM, D]

    prefix = tl.load(prefix_lens + b)
    q_pos = prefix + offs_m                                            # [BM] positions of the queries
    lo = tl.load(kv_start + b)
    hi = prefix + tl.minimum((m_tile + 1) * BLOCK_M, num_new)          # exclusive end of the last row's keys
    full_hi = lo + tl.maximum(prefix + m_tile * BLOCK_M - lo, 0) // BLOCK_N * BLOCK_N
    pages = page_table + b * stride_pt_b

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for n0 in range(lo, full_hi, BLOCK_N):                             # below the diagonal: no mask
        pos = n0 + offs_n
        k, v = load_kv_tile(k_cache, v_cache, pages, pos, pos < hi, PAGE_SIZE, kv_head, stride_slot,
                            stride_kv_h, offs_d)
        m_i, l_i, acc = softmax_step(q_tile, k, v, m_i, l_i, acc, qk_scale, None, False, DOT_PRECISION)
    for n0 in range(full_hi, hi, BLOCK_N):                             # across the diagonal: causal mask
        pos = n0 + offs_n
        k, v = load_kv_tile(k_cache, v_cache, pages, pos, pos < hi, PAGE_SIZE, kv_head, stride_slot,
                            stride_kv_h, offs_d)
        causal = pos[None, :] <= q_pos[:, None]
        m_i, l_i, acc = softmax_step(q_tile, k, v, m_i, l_i, acc, qk_scale, causal, True, DOT_PRECISION)

    out, out_lse = finish_rows(m_i, l_i, acc)
    tl.store(o + tok[:, None] * stride_o_t + head * stride_o_h + offs_d[None, :],
             out.to(o.dtype.element_ty), mask=m_ok[:, None])
    tl.store(lse + tok * stride_l_t + head * stride_l_h, out_lse, mask=m_ok)


def tile_rows(max_new_tokens: int, block_m: int = 128) -> int:
    """BLOCK_M for a step whose longest extend has ``max_new_tokens`` tokens: one of ``tile_rows_choices``."""
    return min(block_m, max(16, triton.next_power_of_2(max_new_tokens)))


def tile_rows_choices(block_m: int = 128) -> list[int]:
    """Every BLOCK_M ``tile_rows`` can return (the powers of two from 16 to ``block_m``; the start-up
    warm-up compiles each)."""
    return sorted({tile_rows(1 << i, block_m) for i in range(block_m.bit_length())})


def bind(q, k_cache, v_cache, page_table, page_size, q_indptr, kv_start, prefix_lens, sm_scale, o, lse,
         group: int, max_new_tokens: int, block_m: int = 128, block_n: int = 128, num_warps: int = 8,
         num_stages: int = 2) -> KernelLaunch | None:
    """The launch of ``_launch`` (None: nothing to compute), to repeat with new ``q``, ``k_cache``,
    ``v_cache``, ``o``, ``lse`` of the same shapes and strides (``KernelLaunch``)."""
    batch = page_table.shape[0]
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    if batch == 0 or q.shape[0] == 0 or max_new_tokens == 0:
        return None
    if q.element_size() >= 4 and head_dim > 64:
        # fp32 tiles take twice the shared memory: 128 x 128 tiles of a 128-wide head need 256 KB (the
        # H100 has 227 KB a block); 64 x 64 fit with room for the pipeline's stages.
        block_m, block_n = min(block_m, 64), min(block_n, 64)
    block_m = tile_rows(max_new_tokens, block_m)
    return KernelLaunch(_extend_kernel, (triton.cdiv(max_new_tokens, block_m), batch, num_q_heads), dict(
        q=q, k_cache=k_cache, v_cache=v_cache, page_table=page_table, q_indptr=q_indptr, kv_start=kv_start,
        prefix_lens=prefix_lens, o=o, lse=lse,
        qk_scale=sm_scale * LOG2E, group=group,
        stride_q_t=q.stride(0), stride_q_h=q.stride(1), stride_pt_b=page_table.stride(0),
        stride_slot=k_cache.stride(0), stride_kv_h=k_cache.stride(1),
        stride_o_t=o.stride(0), stride_o_h=o.stride(1), stride_l_t=lse.stride(0), stride_l_h=lse.stride(1),
        PAGE_SIZE=page_size, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=head_dim,
        DOT_PRECISION=dot_precision(q.dtype),
    ), dict(num_warps=num_warps, num_stages=num_stages))


def _launch(q, k_cache, v_cache, page_table, page_size, q_indptr, kv_start, prefix_lens, sm_scale, o, lse,
            group: int, max_new_tokens: int, block_m: int = 128, block_n: int = 128, num_warps: int = 8,
            num_stages: int = 2) -> None:
    launch = bind(q, k_cache, v_cache, page_table, page_size, q_indptr, kv_start, prefix_lens, sm_scale, o, lse,
                  group, max_new_tokens, block_m, block_n, num_warps, num_stages)
    if launch is not None:
        launch()


class Extend:
    """``extend_attention`` bound to one step: checked, sized and bound once; then called (every layer) with
    ``q``, caches and outputs of the shapes, dtypes and strides given here."""

    def __init__(self, q, k_cache, v_cache, page_table, page_size, q_indptr, kv_start, prefix_lens, sm_scale=None,
                 *, max_new_tokens: int | None = None, out=None) -> None:
        group = check_qkv(q, k_cache, v_cache, page_size)
        device = q.device
        check_index("q_indptr", q_indptr, device)
        check(q_indptr.numel() >= 1, "q_indptr needs at least one entry")
        batch = q_indptr.numel() - 1
        check_page_table(page_table, batch, device)
        check_index("kv_start", kv_start, device, batch)
        check_index("prefix_lens", prefix_lens, device, batch)
        self.out = o, lse = check_out(out, tuple(q.shape), q.dtype, device)     # the given or new outputs
        if max_new_tokens is None:
            max_new_tokens = int((q_indptr[1:] - q_indptr[:-1]).max()) if batch else 0
        sm_scale = q.shape[2] ** -0.5 if sm_scale is None else float(sm_scale)
        self.kernel = bind(q, k_cache, v_cache, page_table, page_size, q_indptr, kv_start, prefix_lens, sm_scale, o,
                           lse, group, int(max_new_tokens))

    def __call__(self, q, k_cache, v_cache, o, lse) -> None:
        """q, o [T, Hq, D], lse [T, Hq] (a kernel reads only their addresses: same layouts as at binding)."""
        if self.kernel is not None:
            self.kernel(q=q, k_cache=k_cache, v_cache=v_cache, o=o, lse=lse)


def extend_attention(q, k_cache, v_cache, page_table, page_size, q_indptr, kv_start, prefix_lens, sm_scale=None,
                     *, max_new_tokens: int | None = None, out=None):
    run = Extend(q, k_cache, v_cache, page_table, page_size, q_indptr, kv_start, prefix_lens, sm_scale,
                 max_new_tokens=max_new_tokens, out=out)
    run(q, k_cache, v_cache, *run.out)
    return run.out


def extend_attention_reference(q, k_cache, v_cache, page_table, page_size, q_indptr, kv_start, prefix_lens,
                               sm_scale=None, dtype: torch.dtype = torch.float64):
    """Pure torch, one request at a time, in ``dtype``; same contract as ``extend_attention``.

    Tokens outside every request's range (beyond q_indptr[-1]) are left o = 0, lse = -inf.
    """
    sm_scale = q.shape[2] ** -0.5 if sm_scale is None else float(sm_scale)
    o = torch.zeros(q.shape, dtype=dtype, device=q.device)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=dtype, device=q.device)
    for b in range(q_indptr.numel() - 1):
        t0, t1 = int(q_indptr[b]), int(q_indptr[b + 1])
        lo, prefix = int(kv_start[b]), int(prefix_lens[b])
        positions = torch.arange(lo, prefix + t1 - t0, device=q.device)
        k = gather_kv_reference(k_cache, page_table[b], positions, page_size)
        v = gather_kv_reference(v_cache, page_table[b], positions, page_size)
        q_pos = prefix + torch.arange(t1 - t0, device=q.device)
        allowed = positions[None, :] <= q_pos[:, None]
        o[t0:t1], lse[t0:t1] = attend_reference(q[t0:t1], k, v, sm_scale, allowed, dtype=dtype)
    return o, lse
