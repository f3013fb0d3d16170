"""Shared-node attention through FlashAttention-3 (optional: the ``fa3_fwd`` wheel, Hopper, 16-bit caches).

A cascade step's shared groups as one FA3 variable-length call, no K/V copy: where every group's pages are
consecutive page ids (``kv_contiguous``), the node of group g is the slot range
``[kv_pages[kv_indptr[g]] * page_size, + kv_lens[g])`` of the cache, so the cache itself is FA3's packed K/V
with sequence g starting at that slot (``cu_seqlens_k``) and ``kv_lens[g]`` long (``seqused_k``). The
queries of group g are the rows ``q_rows[q_indptr[g]:q_indptr[g + 1]]`` gathered into one packed block
(``cu_seqlens_q`` = ``q_indptr``). Every bound tensor is read on the device at call time: a captured CUDA
graph replays any nodes of up to ``max_rows`` rows (``max_seqlen_q`` sizes FA3's grid) with FA3 splitting
each node ``splits`` ways by its own length (``num_splits``; FA3 merges its splits itself).

FA3 returns o [R, Hq, D] in the queries' dtype (normalised) and lse [Hq, R] (natural log); ``Fa3Node``
writes them into the caller's fp32 part slots (o [R, Hq, D], lse [R, Hq]), where the cascade's merge reads
them like any other part. Where FA3 does not apply (no wheel, CPU, pre-Hopper, fp32 or FP8 caches, pages
not consecutive) the Triton shared-node kernel runs (``shared_node.py``); ``NODE_KERNELS`` names the choice.

Measured on an H100 (benchmarks/results/kernels/attention_rates_h100_80gb_hbm3.md; benchmarks/results/HISTORY.md,
2026-11-27 2160cc3): FA3's variable-length form (what a graph can replay over changing nodes) attends a node
faster than the Triton kernel by TMA, but a cascade step built on it is slower: FA3's programs take every
multiprocessor, so the own-KV decode of the suffixes cannot run beside the node as it does beside the Triton
kernel. So ``auto`` runs the Triton kernel, and ``fa3`` is there to measure and for steps without own KV worth
hiding.

``varlen_reference`` is the contract of the FA3 call in pure torch: the CPU tests bind ``Fa3Node`` to it to
check everything around the call (gathers, slot offsets, output layout, padding) under the interpreter.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from radixrelay.config import NODE_KERNELS
from radixrelay.kernels._common import check

try:  # FlashAttention-3 forward (pip install radixrelay[fa3]: the fa3_fwd wheel)
    from fa3_fwd_interface import flash_attn_varlen_func as _fa3_varlen
except ImportError:
    _fa3_varlen = None

# NODE_KERNELS: "auto" (today the Triton kernel), "triton", "fa3" (FA3 required: a clear error without it)
FA3_DTYPES = (torch.float16, torch.bfloat16)
FA3_HEAD_DIMS = (64, 96, 128, 192, 256)


def fa3_installed() -> bool:
    return _fa3_varlen is not None


def fa3_capable(device: torch.device) -> bool:
    """The wheel imports and the device is a Hopper GPU (FA3's kernels are built for sm_90)."""
    device = torch.device(device)
    return (fa3_installed() and device.type == "cuda"
            and torch.cuda.get_device_capability(device) == (9, 0))


def fa3_cache_usable(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """A cache FA3 reads as packed K/V: 16-bit (FP8 caches hold scale-1 pages FA3 does not take with bf16
    queries), a head dim it is built for, each slot's [Hkv, D] contiguous."""
    return all(c.dtype in FA3_DTYPES and c.shape[2] in FA3_HEAD_DIMS and c.stride(2) == 1
               and c.stride(1) == c.shape[2] for c in (k_cache, v_cache))


def resolve_node_kernel(name: str, device: torch.device) -> str:
    """``NODE_KERNELS`` name -> the one this process runs ("triton" or "fa3"); "fa3" without FA3 is an error.
    "auto" is the Triton kernel: measured faster in the cascade at every shape (module docstring)."""
    check(name in NODE_KERNELS, f"node kernel must be one of {NODE_KERNELS}, got {name!r}")
    if name != "fa3":
        return "triton"
    if not fa3_capable(device):
        why = ("the fa3_fwd wheel is not installed (pip install 'radixrelay[fa3]')" if not fa3_installed()
               else f"FlashAttention-3 runs on Hopper GPUs (sm_90), not on {device}")
        raise ValueError(f"node kernel fa3: {why}")
    return "fa3"


def fa3_splits(num_groups: int, max_rows: int, group: int, num_kv_heads: int, max_kv: int, num_sms: int) -> int:
    """FA3's split count for nodes of up to ``max_kv`` tokens: enough (query tile x KV head x split) work
    items to fill the GPU about twice, each split at least 1,024 tokens long (its 128-row tiles, GQA packed)."""
    tiles = num_groups * max(1, -(-max_rows * group // 128)) * num_kv_heads
    fill = max(1, -(-2 * num_sms // max(tiles, 1)))
    return max(1, min(fill, max_kv // 1024, 64))


def varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, seqused_k,
                     softmax_scale, num_splits=1, return_attn_probs=True):
    """What the FA3 variable-length call computes, in float64: sequence b is query rows
    ``[cu_seqlens_q[b], cu_seqlens_q[b + 1])`` (at most ``max_seqlen_q`` of them) against K/V rows
    ``[cu_seqlens_k[b], + seqused_k[b])``, non-causal, GQA by head groups. Returns o [T, Hq, D] in q's
    dtype (rows of no sequence: zero) and lse [Hq, T] float32 (-inf where nothing is attended)."""
    total, num_q_heads, _ = q.shape
    group = num_q_heads // k.shape[1]
    o = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    lse = torch.full((num_q_heads, total), float("-inf"), dtype=torch.float64, device=q.device)
    cu_q, cu_k, used = cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), seqused_k.tolist()
    for b in range(len(used)):
        r0, r1 = cu_q[b], min(cu_q[b + 1], cu_q[b] + max_seqlen_q)
        n = used[b]
        if r1 <= r0 or n == 0:
            continue
        kk = k[cu_k[b]:cu_k[b] + n].double().repeat_interleave(group, dim=1)             # [n, Hq, D]
        vv = v[cu_k[b]:cu_k[b] + n].double().repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[r0:r1].double(), kk) * softmax_scale          # [Hq, rows, n]
        lse[:, r0:r1] = torch.logsumexp(s, -1)
        o[r0:r1] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv)
    return o.to(q.dtype), lse.float()


class Fa3Node:
    """The shared groups of a step through one FA3 call per layer, bound once (buffers, offsets); called per
    layer with ``q`` and caches of the binding's layouts. Writes o_dst [R, Hq, D] and lse_dst [R, Hq]
    (float32 part slots); rows past ``q_indptr[-1]`` (padding) get values no merge reads."""

    def __init__(self, q, k_cache, v_cache, page_size: int, q_indptr, q_rows, kv_indptr, kv_pages, kv_lens,
                 sm_scale: float, o_dst, lse_dst, *, max_rows: int, splits: int,
                 varlen: Callable | None = None) -> None:
        self.varlen = varlen or _fa3_varlen
        check(self.varlen is not None, "FlashAttention-3 is not installed (pip install 'radixrelay[fa3]')")
        check(fa3_cache_usable(k_cache, v_cache) and q.dtype == k_cache.dtype,
              f"FA3 node attention takes 16-bit caches of q's dtype, got q {q.dtype}, cache {k_cache.dtype}")
        num_rows = q_rows.numel()
        check(o_dst.shape == (num_rows, *q.shape[1:]) and lse_dst.shape == (num_rows, q.shape[1]),
              "FA3 node outputs must be o [R, Hq, D] and lse [R, Hq]")
        self.page_size, self.sm_scale = page_size, float(sm_scale)
        self.q_indptr, self.q_rows, self.kv_lens, self.kv_indptr = q_indptr, q_rows.long(), kv_lens, kv_indptr
        self.kv_pages = kv_pages if kv_pages.numel() else torch.zeros(1, dtype=kv_pages.dtype, device=q.device)
        num_groups = q_indptr.numel() - 1
        # cu_seqlens_k: group g's first slot; the last entry (unused beside seqused_k) is the cache's end
        self.starts = torch.full((num_groups + 1,), k_cache.shape[0], dtype=torch.int32, device=q.device)
        self.q_packed = torch.empty((num_rows, *q.shape[1:]), dtype=q.dtype, device=q.device)   # [R, Hq, D]
        self.o_dst, self.lse_dst = o_dst, lse_dst
        self.max_rows, self.max_kv = max(int(max_rows), 1), k_cache.shape[0]
        self.splits = int(splits)

    def __call__(self, q, k_cache, v_cache) -> None:
        num_groups = self.starts.numel() - 1
        if num_groups == 0 or self.q_packed.shape[0] == 0:
            return
        torch.index_select(q, 0, self.q_rows, out=self.q_packed)
        first = self.kv_indptr[:-1].long().clamp(max=self.kv_pages.numel() - 1)       # [G] each group's first page
        torch.mul(self.kv_pages[first], self.page_size, out=self.starts[:-1])
        o, lse = self.varlen(self.q_packed, k_cache, v_cache, self.q_indptr, self.starts, self.max_rows,
                             self.max_kv, seqused_k=self.kv_lens, softmax_scale=self.sm_scale,
                             num_splits=self.splits, return_attn_probs=True)
        self.o_dst.copy_(o)                          # [R, Hq, D] -> fp32 parts
        self.lse_dst.copy_(lse.t())                  # [Hq, R] -> [R, Hq]
