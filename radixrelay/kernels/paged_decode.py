"""Paged decode attention (split-K flash-decoding): one query token per request over its own KV.

API::

    paged_decode_attention(q, k_cache, v_cache, page_table, page_size, kv_start, kv_end,
                           sm_scale=None, *, max_kv_len=None, out=None) -> (o, lse)

    q:          [B, Hq, D]            fp16 / bf16 / fp32, one decode query per request
    k_cache:    [num_slots, Hkv, D]   paged cache (docs/kv_layout.md), v_cache the same
    page_table: [B, max_pages] int32  request b's page list (rows padded with any valid page id)
    kv_start, kv_end: [B] int32       request b attends token positions [kv_start[b], kv_end[b])
    max_kv_len: optional host int >= max(kv_end - kv_start); only sizes the split, defaults to the
                page-table capacity max_pages * page_size (no device sync either way)
    out:        optional preallocated (o [B, Hq, D] dtype of q, any strides with contiguous D;
                lse [B, Hq] float32), e.g. slices of a cascade's parts buffer
    returns     o [B, Hq, D] dtype of q, lse [B, Hq] float32 natural log; empty range -> o = 0, lse = -inf

One program handles (request, KV head, KV split): the Hq / Hkv query heads of that KV head are the
rows of a tl.dot tile, so each K/V row is read once per KV head. With more than one split, fp32
partials go through ``merge_splits``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixrelay.kernels._common import (LOG2E, KernelLaunch, attend_reference, check, check_index, check_out,
                                        check_page_table, check_qkv, dot_precision, finish_rows, gather_kv_reference,
                                        load_kv_tile, num_sms, pick_splits, softmax_step)
from radixrelay.kernels.merge import bind_merge_splits


@triton.jit
def paged_decode_program(
    b, kv_head, split,
    q, k_cache, v_cache, page_table, kv_start, kv_end, o, lse,
    qk_scale, chunk, group,
    stride_q_b, stride_q_h, stride_pt_b, stride_slot, stride_kv_h,
    stride_o_b, stride_o_s, stride_o_h, stride_l_b, stride_l_s, stride_l_h,
    PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Request ``b``, KV head ``kv_head``, positions [kv_start + split * chunk, +chunk) clipped to kv_end.

    Rows of the tile: the ``group`` query heads of the KV head. Writes o[b, split, heads, :] and
    lse[b, split, heads]; an empty range writes o = 0, lse = -inf.
    """
    offs_g = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * group + offs_g                                   # [BLOCK_H] query heads
    g_ok = offs_g < group
    q_tile = tl.load(q + b * stride_q_b + heads[:, None] * stride_q_h + offs_d[None, :],
                     mask=g_ok[:, None], other=0.0)                   # [BLOCK_H, D]

    lo = tl.load(kv_start + b) + split * chunk
    hi = tl.minimum(tl.load(kv_end + b), lo + chunk)
    full_hi = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
    pages = page_table + b * stride_pt_b

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    for n0 in range(lo, full_hi, BLOCK_N):
        pos = n0 + offs_n
        k, v = load_kv_tile(k_cache, v_cache, pages, pos, pos < hi, PAGE_SIZE, kv_head, stride_slot,
                            stride_kv_h, offs_d)
        m_i, l_i, acc = softmax_step(q_tile, k, v, m_i, l_i, acc, qk_scale, None, False, DOT_PRECISION)
    if full_hi < hi:
        pos = full_hi + offs_n
        valid = pos < hi
        k, v = load_kv_tile(k_cache, v_cache, pages, pos, valid, PAGE_SIZE, kv_head, stride_slot,
                            stride_kv_h, offs_d)
        m_i, l_i, acc = softmax_step(q_tile, k, v, m_i, l_i, acc, qk_scale, valid[None, :], True, DOT_PRECISION)

    out, out_lse = finish_rows(m_i, l_i, acc)
    tl.store(o + b * stride_o_b + split * stride_o_s + heads[:, None] * stride_o_h + offs_d[None, :],
             out.to(o.dtype.element_ty), mask=g_ok[:, None])
    tl.store(lse + b * stride_l_b + split * stride_l_s + heads * stride_l_h, out_lse, mask=g_ok)


# Not specialised (radixrelay.worker.warmup): arguments that change from step to step, so that a new value
# never compiles a new variant mid-serving. Index tensors are slices at per-step offsets (``[num_extends:]``:
# their 16-byte alignment varies), the page table's row stride is the step's page-table width, the lse
# strides carry the split count. ``chunk`` stays specialised: always a positive multiple of BLOCK_N
# (checked in ``launch_splits``), so its key never changes; q / o / cache strides are fixed by the model or
# multiples of D (never 1, always divisible by 16).
@triton.jit(do_not_specialize=["page_table", "kv_start", "kv_end", "lse", "stride_pt_b", "stride_l_b",
                               "stride_l_s"])
def _paged_decode_kernel(
    q, k_cache, v_cache, page_table, kv_start, kv_end, o, lse,
    qk_scale, chunk, group,
    stride_q_b, stride_q_h, stride_pt_b, stride_slot, stride_kv_h,
    stride_o_b, stride_o_s, stride_o_h, stride_l_b, stride_l_s, stride_l_h,
    PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # grid: (B, Hkv, splits)
    paged_decode_program(
        tl.program_id(0), tl.program_id(1), tl.program_id(2),
        q, k_cache, v_cache, page_table, kv_start, kv_end, o, lse, qk_scale, chunk, group,
        stride_q_b, stride_q_h, stride_pt_b, stride_slot, stride_kv_h,
        stride_o_b, stride_o_s, stride_o_h, stride_l_b, stride_l_s, stride_l_h,
        PAGE_SIZE, BLOCK_H, BLOCK_N, HEAD_DIM, DOT_PRECISION,
    )


def bind_splits(q, k_cache, v_cache, page_table, page_size, kv_start, kv_end, sm_scale, o_dst, lse_dst,
                group: int, chunk: int, block_n: int = 128, num_warps: int = 4, num_stages: int = 3,
                maxnreg: int | None = None) -> KernelLaunch:
    """The launch of ``launch_splits``, to repeat with new ``q``, ``k_cache``, ``v_cache``, ``o``, ``lse`` of
    the same shapes and strides (``KernelLaunch``)."""
    batch, splits = o_dst.shape[:2]
    check(chunk > 0 and chunk % 16 == 0, f"chunk must be a positive multiple of 16, got {chunk}")
    return KernelLaunch(_paged_decode_kernel, (batch, k_cache.shape[1], splits), dict(
        q=q, k_cache=k_cache, v_cache=v_cache, page_table=page_table, kv_start=kv_start, kv_end=kv_end,
        o=o_dst, lse=lse_dst,
        qk_scale=sm_scale * LOG2E, chunk=chunk, group=group,
        stride_q_b=q.stride(0), stride_q_h=q.stride(1), stride_pt_b=page_table.stride(0),
        stride_slot=k_cache.stride(0), stride_kv_h=k_cache.stride(1),
        stride_o_b=o_dst.stride(0), stride_o_s=o_dst.stride(1), stride_o_h=o_dst.stride(2),
        stride_l_b=lse_dst.stride(0), stride_l_s=lse_dst.stride(1), stride_l_h=lse_dst.stride(2),
        PAGE_SIZE=page_size, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        HEAD_DIM=q.shape[2], DOT_PRECISION=dot_precision(q.dtype),
    ), dict(num_warps=num_warps, num_stages=num_stages, maxnreg=maxnreg))


def launch_splits(q, k_cache, v_cache, page_table, page_size, kv_start, kv_end, sm_scale, o_dst, lse_dst,
                  group: int, chunk: int, block_n: int = 128, num_warps: int = 4, num_stages: int = 3,
                  maxnreg: int | None = None):
    """Launch into o_dst [B, S, Hq, D], lse_dst [B, S, Hq]: split s covers ``chunk`` positions from
    kv_start + s * chunk; ``maxnreg`` caps registers per thread. Returns the compiled kernel."""
    return bind_splits(q, k_cache, v_cache, page_table, page_size, kv_start, kv_end, sm_scale, o_dst, lse_dst, group,
                       chunk, block_n, num_warps, num_stages, maxnreg)()


class PagedDecode:
    """``paged_decode_attention`` bound to one step: checked, split, buffered and bound once; then called
    (every layer) with ``q``, caches and outputs of the shapes, dtypes and strides given here. The split
    partials' buffer is allocated here and rewritten by every call (stream-ordered: one call's merge reads
    it before the next call's kernel writes it)."""

    def __init__(self, q, k_cache, v_cache, page_table, page_size, kv_start, kv_end, sm_scale=None, *,
                 max_kv_len: int | None = None, out=None, block_n: int = 128, num_warps: int = 4,
                 num_stages: int = 3, slots_per_sm: int = 8, overhead: int = 256) -> None:
        group = check_qkv(q, k_cache, v_cache, page_size)
        batch, num_q_heads, head_dim = q.shape
        check_page_table(page_table, batch, q.device)
        check_index("kv_start", kv_start, q.device, batch)
        check_index("kv_end", kv_end, q.device, batch)
        self.out = o, lse = check_out(out, tuple(q.shape), q.dtype, q.device)   # the given or new outputs
        sm_scale = head_dim ** -0.5 if sm_scale is None else float(sm_scale)
        max_kv_len = page_table.shape[1] * page_size if max_kv_len is None else int(max_kv_len)
        self.kernel = self.merge = None
        if batch == 0:
            return
        splits, chunk = pick_splits(batch * k_cache.shape[1], max_kv_len, block_n, slots_per_sm * num_sms(q.device),
                                    overhead)
        if splits == 1:
            o_dst, lse_dst = o.unsqueeze(1), lse.unsqueeze(1)                 # [B, 1, Hq, D], [B, 1, Hq]
        else:
            o_dst = torch.empty((batch, splits, num_q_heads, head_dim), dtype=torch.float32, device=q.device)
            lse_dst = torch.empty((batch, splits, num_q_heads), dtype=torch.float32, device=q.device)
            self.merge = bind_merge_splits(o_dst, lse_dst, o, lse)
        self.kernel = bind_splits(q, k_cache, v_cache, page_table, page_size, kv_start, kv_end, sm_scale, o_dst,
                                  lse_dst, group, chunk, block_n, num_warps, num_stages)

    def __call__(self, q, k_cache, v_cache, o, lse) -> None:
        """q, o [B, Hq, D], lse [B, Hq] (a kernel reads only their addresses: same layouts as at binding)."""
        if self.kernel is None:
            return
        if self.merge is None:
            self.kernel(q=q, k_cache=k_cache, v_cache=v_cache, o=o, lse=lse)
        else:
            self.kernel(q=q, k_cache=k_cache, v_cache=v_cache)
            self.merge(o_out=o, lse_out=lse)


def _launch(q, k_cache, v_cache, page_table, page_size, kv_start, kv_end, sm_scale, o, lse, group: int,
            max_kv_len: int, **options) -> None:
    """One launch into (o, lse) with ``PagedDecode``'s tile and split ``options`` (tests, benchmarks)."""
    run = PagedDecode(q, k_cache, v_cache, page_table, page_size, kv_start, kv_end, sm_scale, max_kv_len=max_kv_len,
                      out=(o, lse), **options)
    run(q, k_cache, v_cache, o, lse)


def paged_decode_attention(q, k_cache, v_cache, page_table, page_size, kv_start, kv_end, sm_scale=None, *,
                           max_kv_len: int | None = None, out=None):
    run = PagedDecode(q, k_cache, v_cache, page_table, page_size, kv_start, kv_end, sm_scale, max_kv_len=max_kv_len,
                      out=out)
    run(q, k_cache, v_cache, *run.out)
    return run.out


def paged_decode_attention_reference(q, k_cache, v_cache, page_table, page_size, kv_start, kv_end, sm_scale=None,
                                     dtype: torch.dtype = torch.float64):
    """Pure torch, one request at a time, in ``dtype``; same contract as ``paged_decode_attention``."""
    sm_scale = q.shape[2] ** -0.5 if sm_scale is None else float(sm_scale)
    o = torch.zeros(q.shape, dtype=dtype, device=q.device)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=dtype, device=q.device)
    for b in range(q.shape[0]):
        positions = torch.arange(int(kv_start[b]), int(kv_end[b]), device=q.device)
        k = gather_kv_reference(k_cache, page_table[b], positions, page_size)
        v = gather_kv_reference(v_cache, page_table[b], positions, page_size)
        o[b : b + 1], lse[b : b + 1] = attend_reference(q[b : b + 1], k, v, sm_scale, dtype=dtype)
    return o, lse
