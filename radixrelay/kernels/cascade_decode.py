"""Cascaded decode attention: every shared radix node and every request's own KV, merged in one pass.

API::

    plan = plan_cascade(q_indptr, q_rows, kv_indptr, kv_pages, kv_lens, page_table, kv_start, kv_end,
                        num_q_heads=..., num_kv_heads=..., head_dim=..., page_size=...)   # once per step
    o, lse = cascade_decode_attention(q, k_cache, v_cache, plan, sm_scale=None,
                                      side_stream=None)                                # once per layer

    shared nodes: as shared_node_attention (group g: requests q_rows[q_indptr[g]:q_indptr[g + 1]] over
                  the first kv_lens[g] tokens of the page run kv_pages[kv_indptr[g]:kv_indptr[g + 1]])
    own KV:       as paged_decode_attention (request b: positions [kv_start[b], kv_end[b]) of
                  page_table[b])
    q:            [B, Hq, D] with B = page_table.shape[0]
    returns       o [B, Hq, D] dtype of q, lse [B, Hq] float32 natural log: request b attends every node
                  of its groups and its own range (nothing at all: o = 0, lse = -inf)

Three launches per layer: the shared-node kernel and the paged-decode kernel write their KV-split
partials (fp32) into one parts buffer, and one merge combines, per request, all splits of all its
levels (the standalone kernels would each merge their own splits first: five launches). Given a
``side_stream``, the tensor-core-bound shared node runs beside the memory-bound own-KV decode. The
plan (split counts and the merge index; one device-to-host copy of the small index tensors) serves
every layer of the step. ``worth_cascading`` is the measured rule for when a node earns its level.
Where every node's pages are consecutive page ids (``kv_contiguous``: the caller knows, else one more
device sync) and the groups have >= 128 folded query rows, on Hopper, the plan has the shared-node
kernel load K/V by TMA (``plan.kv_tma``, with the launch options below; shared_node.py), or, planned with
``node_kernel="fa3"``, FlashAttention-3 attend those nodes instead (``plan.fa3_splits``; fa3_node.py): one
variable-length call over the groups, its output copied into the same parts the merge reads.

Both kinds of programs stay in separate kernels: one kernel interleaving them gives every program the
larger register budget and runs slower (benchmarks/results/HISTORY.md, 2026-11-21, v3).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import triton

from radixrelay.kernels import fa3_node, paged_decode, shared_node
from radixrelay.kernels._common import check, check_index, check_out, check_page_table, check_qkv, num_sms, pick_splits
from radixrelay.kernels.host_staging import tensor_to_device
from radixrelay.kernels.merge import bind_merge, merge_attention_states_reference
from radixrelay.kernels.paged_decode import paged_decode_attention_reference
from radixrelay.kernels.shared_node import shared_node_attention_reference

# A node shared by n requests saves (n - 1) * node_tokens KV reads; below this the extra launches and
# partial states may cost more than they save (small batches over short nodes tie flat decode;
# benchmarks/results/kernels/attention.md).
MIN_SAVED_TOKENS = 32768

# Own-KV decode launch options: alone it has the GPU and takes 128-token tiles; beside the shared node
# (side stream) it takes 64-token tiles, 2 stages and at most 96 registers (38 KB of shared memory), so
# that its programs fit on a multiprocessor next to the node's: one beside two gathered-node programs
# of 4 warps, two beside one TMA-node program of 8 warps at ``shared_node.TMA_MAXNREG`` registers.
OWN_ALIGN = 128
OWN_ALONE = dict(block_n=128)
OWN_BESIDE = dict(block_n=64, num_stages=2, maxnreg=96)
# Beside a light node (every shared run <= LIGHT_NODE_TOKENS: a 2K system prompt, a few-shot prefix) the node's
# programs finish early and the own-KV decode has the GPU most of the time; short own ranges (a chat's
# question and answer) then do better in 32-token tiles of 2 warps; beside a long node OWN_BESIDE stays
# ahead (benchmarks/results/HISTORY.md, own-KV tiles).
OWN_BESIDE_LIGHT = dict(block_n=32, num_warps=2, num_stages=2)
LIGHT_NODE_TOKENS = 4096


def worth_cascading(num_requests: int, node_tokens: int) -> bool:
    """Cost rule for the planner: give a radix node its own cascade level, or leave it to flat decode."""
    return (num_requests - 1) * node_tokens >= MIN_SAVED_TOKENS


@dataclass(frozen=True)
class CascadePlan:
    """Launch plan of one decode step's cascade; device tensors are int32 and valid while the step's
    page lists are (indices are not copied)."""

    q_indptr: torch.Tensor        # [G + 1] shared groups
    q_rows: torch.Tensor          # [R]
    kv_indptr: torch.Tensor       # [G + 1]
    kv_pages: torch.Tensor        # [sum pages]
    kv_lens: torch.Tensor         # [G]
    page_table: torch.Tensor      # [B, max_pages] own KV
    kv_start: torch.Tensor        # [B]
    kv_end: torch.Tensor          # [B]
    merge_indptr: torch.Tensor    # [B + 1] request b merges parts merge_part_ids[merge_indptr[b]:...]
    merge_part_ids: torch.Tensor  # part i * shared_splits + s: row i, split s; then R * shared_splits + ...
    page_size: int
    head_dim: int
    group: int                    # Hq / Hkv
    m_tiles: int                  # query tiles per group (grid bound)
    shared_splits: int            # each group's node cut in this many equal chunks (at run time, by its length)
    own_splits: int
    own_chunk: int
    shared_config: tuple[int, int, int, int]   # BLOCK_M, BLOCK_N, warps, stages
    kv_tma: bool = False          # every group's pages are consecutive ids: node K/V by TMA (Hopper)
    light_nodes: bool = False     # every shared run <= LIGHT_NODE_TOKENS: own KV beside them in OWN_BESIDE_LIGHT
    fa3_splits: int = 0           # > 0: the nodes through FlashAttention-3 (fa3_node.py), split this many ways
                                  # by FA3 itself (then shared_splits = 1 part per row; needs kv_tma's pages)

    @property
    def own_options(self) -> dict:
        """Launch options of the own-KV decode when it runs beside the shared nodes (side stream)."""
        return OWN_BESIDE_LIGHT if self.light_nodes else OWN_BESIDE

    @property
    def num_requests(self) -> int:
        return self.page_table.shape[0]


def merge_index(q_rows: Sequence[int], num_requests: int, shared_splits: int, own_splits: int,
                rows_cap: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The parts layout of ``cascade_decode_attention``: shared row i, split s is part
    ``i * shared_splits + s`` (``rows_cap`` rows reserved, default ``len(q_rows)``; CUDA graphs pad),
    then request b's own split s is part ``rows_cap * shared_splits + b * own_splits + s``. Returns the
    merge's (indptr, part ids) as int32 arrays: request b merges every split of its shared rows (in row
    order), then its own. Vectorised: O(parts) in numpy, no Python loop over rows."""
    S, O = shared_splits, own_splits
    rows = np.fromiter(q_rows, dtype=np.int64, count=len(q_rows))
    counts = np.bincount(rows, minlength=num_requests)[:num_requests]          # shared rows per request
    sizes = counts * S + O                                                     # parts per request
    indptr = np.zeros(num_requests + 1, dtype=np.int64)
    np.cumsum(sizes, out=indptr[1:])
    ids = np.empty(int(indptr[-1]), dtype=np.int64)
    base = (len(rows) if rows_cap is None else rows_cap) * S
    requests = np.arange(num_requests, dtype=np.int64)
    # own splits: after the request's shared parts
    own_at = (indptr[:-1] + counts * S)[:, None] + np.arange(O)                 # [B, O]
    ids[own_at] = base + requests[:, None] * O + np.arange(O)
    if len(rows):
        order = np.argsort(rows, kind="stable")                                 # rows grouped by request
        b = rows[order]
        first = indptr[:-1] - np.concatenate(([0], np.cumsum(counts)[:-1])) * S  # block start - earlier rows' parts
        at = (first[b] + np.arange(len(rows)) * S)[:, None] + np.arange(S)      # [R, S] destinations
        ids[at] = order[:, None] * S + np.arange(S)
    return indptr.astype(np.int32), ids.astype(np.int32)


class CascadeHost(NamedTuple):
    """What ``plan_cascade`` needs to know on the host about its index tensors."""

    rows: tuple[int, ...]        # q_rows
    indptr: tuple[int, ...]      # q_indptr
    kv_lens: tuple[int, ...]     # kv_lens
    max_own: int                 # max over requests of kv_end - kv_start


def plan_cascade(q_indptr, q_rows, kv_indptr, kv_pages, kv_lens, page_table, kv_start, kv_end, *,
                 num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 shared_splits: int | None = None, own_splits: int | None = None,
                 shared_config: tuple[int, int, int, int] | None = None, allow_tma: bool = True,
                 kv_contiguous: bool | None = None, host: CascadeHost | None = None,
                 node_kernel: str = "triton") -> CascadePlan:
    """``host``: the host's copies of (q_rows, q_indptr, kv_lens) and max(kv_end - kv_start); without
    it they are read from the device (a sync: avoid it on the serving path). ``node_kernel``: as
    ``cascade_launch``."""
    device = page_table.device
    check(num_q_heads % num_kv_heads == 0, f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads")
    check_index("q_indptr", q_indptr, device)
    check(q_indptr.numel() >= 1, "q_indptr needs at least one entry")
    num_groups = q_indptr.numel() - 1
    check(page_table.dim() == 2, f"page_table must be [B, max_pages], got shape {tuple(page_table.shape)}")
    num_requests = page_table.shape[0]
    check_page_table(page_table, num_requests, device)
    check_index("q_rows", q_rows, device)
    check_index("kv_indptr", kv_indptr, device, num_groups + 1)
    check_index("kv_pages", kv_pages, device)
    check_index("kv_lens", kv_lens, device, num_groups)
    check_index("kv_start", kv_start, device, num_requests)
    check_index("kv_end", kv_end, device, num_requests)
    if host is None:
        host = CascadeHost(tuple(q_rows.tolist()), tuple(q_indptr.tolist()), tuple(kv_lens.tolist()),
                           max((kv_end - kv_start).tolist(), default=0))
    rows_host, indptr_host = host.rows, host.indptr
    check(len(rows_host) == q_rows.numel() and len(indptr_host) == num_groups + 1
          and len(host.kv_lens) == num_groups, "host copies disagree with the plan's tensors")
    check(all(0 <= b < num_requests for b in rows_host), f"q_rows must index the {num_requests} requests")
    # ``kv_contiguous`` None: checked on the device only if the rest allows TMA (one more sync)
    contiguous = ((lambda: shared_node.pages_contiguous(kv_indptr, kv_pages)) if kv_contiguous is None
                  else kv_contiguous)
    launch = cascade_launch(host, num_requests, device, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                            head_dim=head_dim, shared_splits=shared_splits, own_splits=own_splits,
                            shared_config=shared_config, allow_tma=allow_tma, kv_contiguous=contiguous,
                            node_kernel=node_kernel)
    indptr, ids = merge_index(rows_host, num_requests, launch.shared_splits, launch.own_splits)
    return CascadePlan(
        q_indptr, q_rows, kv_indptr, kv_pages, kv_lens, page_table, kv_start, kv_end,
        tensor_to_device(torch.from_numpy(indptr), device),
        tensor_to_device(torch.from_numpy(ids), device),
        page_size, head_dim, num_q_heads // num_kv_heads, **launch._asdict(),
    )


class CascadeLaunch(NamedTuple):
    """A step's launch shape (``CascadePlan``'s launch fields), chosen from sizes known on the host."""

    m_tiles: int
    shared_splits: int
    own_splits: int
    own_chunk: int
    shared_config: tuple[int, int, int, int]
    kv_tma: bool
    light_nodes: bool
    fa3_splits: int = 0


def cascade_launch(host: CascadeHost, num_requests: int, device: torch.device, *, num_q_heads: int,
                   num_kv_heads: int, head_dim: int, shared_splits: int | None = None, own_splits: int | None = None,
                   shared_config: tuple[int, int, int, int] | None = None, allow_tma: bool = True,
                   kv_contiguous: bool | Callable[[], bool] = False, node_kernel: str = "triton") -> CascadeLaunch:
    """``plan_cascade``'s launch choice for a step of ``num_requests`` requests whose shared groups are
    ``host`` (rows, indptr, run lengths, longest own range): host arithmetic only, no tensors. Given
    ``shared_splits`` / ``own_splits`` / ``shared_config`` are kept. ``kv_contiguous``: whether every
    group's pages are consecutive ids (a callable is asked only when the rest allows TMA). ``node_kernel``
    "fa3" (the caller checked that FA3 runs here, ``fa3_node.resolve_node_kernel``): the nodes that would
    load K/V by TMA go through FlashAttention-3 instead."""
    num_groups = len(host.indptr) - 1
    indptr = host.indptr
    max_rows = max((indptr[g + 1] - indptr[g] for g in range(num_groups)), default=0)
    max_kv = max(host.kv_lens, default=0)
    group = num_q_heads // num_kv_heads
    # nodes whose pages are consecutive ids load K/V by TMA (Hopper, >= TMA_MIN_ROWS rows); a 32-bit cache
    # then still runs the gather, with 128-row tiles
    fa3 = node_kernel == "fa3" and head_dim in fa3_node.FA3_HEAD_DIMS
    kv_tma = bool(allow_tma and num_groups > 0 and (head_dim == 128 or fa3)
                  and max_rows * group >= shared_node.TMA_MIN_ROWS and shared_node.tma_capable(device)
                  and (kv_contiguous() if callable(kv_contiguous) else kv_contiguous))
    shared_config = shared_config or shared_node.tile_config(max_rows * group, kv_tma)
    block_m, block_n = shared_config[:2]
    m_tiles = triton.cdiv(max(max_rows, 1) * group, block_m)
    live_tiles = min(num_groups * m_tiles, triton.cdiv(len(host.rows) * group, block_m) + num_groups)
    slots = shared_node.programs_per_sm(shared_config) * num_sms(device)
    fa3_splits = 0
    if fa3 and kv_tma:              # FA3 splits each node itself; one part per row for the merge
        fa3_splits = fa3_node.fa3_splits(num_groups, max_rows, group, num_kv_heads, max_kv, num_sms(device))
        shared_splits = 1
    if shared_splits is None:
        shared_splits, _ = pick_splits(live_tiles * num_kv_heads, max_kv, block_n, slots, 256)
    if own_splits is None:
        own_splits, own_chunk = pick_splits(num_requests * num_kv_heads, host.max_own, OWN_ALIGN, 4 * slots, 256)
    else:
        own_chunk = triton.cdiv(triton.cdiv(max(host.max_own, 1), own_splits), OWN_ALIGN) * OWN_ALIGN
    return CascadeLaunch(m_tiles, shared_splits, own_splits, own_chunk, shared_config, kv_tma,
                         max_kv <= LIGHT_NODE_TOKENS, fa3_splits)


class CascadeDecode:
    """``cascade_decode_attention`` bound to one step: checked, buffered and bound once; then called (every
    layer) with ``q``, caches and outputs of the shapes, dtypes and strides given here. The parts buffer is
    allocated here and rewritten by every call: the next call's kernels write it only after this call's
    merge read it (the own-KV decode follows the merge on the current stream; the side stream first waits
    for the current one, merge included)."""

    def __init__(self, q, k_cache, v_cache, plan: CascadePlan, sm_scale=None,
                 side_stream: torch.cuda.Stream | None = None, out=None) -> None:
        group = check_qkv(q, k_cache, v_cache, plan.page_size)
        check(group == plan.group, f"q / cache heads give GQA group {group}, the plan was made for {plan.group}")
        check(q.shape[2] == plan.head_dim, f"q has head_dim {q.shape[2]}, the plan was made for {plan.head_dim}")
        check(q.shape[0] == plan.num_requests, f"q has {q.shape[0]} requests, the plan {plan.num_requests}")
        check(q.device == plan.page_table.device, "q and the plan are on different devices")
        check(side_stream is None or q.is_cuda, "side_stream needs CUDA tensors")
        batch, num_q_heads, head_dim = q.shape
        num_rows, num_groups = plan.q_rows.numel(), plan.q_indptr.numel() - 1
        sm_scale = head_dim ** -0.5 if sm_scale is None else float(sm_scale)
        self.out = o, lse = check_out(out, tuple(q.shape), q.dtype, q.device)   # the given or new outputs
        self.batch = batch
        if batch == 0:
            return
        # parts: [R * shared_splits + B * own_splits, Hq, D] fp32; shared rows first, then own KV
        shared_parts = num_rows * plan.shared_splits
        o_parts = torch.empty((shared_parts + batch * plan.own_splits, num_q_heads, head_dim), dtype=torch.float32,
                              device=q.device)
        lse_parts = torch.empty(o_parts.shape[:2], dtype=torch.float32, device=q.device)
        self.side = side_stream if num_groups > 0 else None
        self.shared = None
        if num_groups and plan.fa3_splits:
            self.shared = fa3_node.Fa3Node(
                q, k_cache, v_cache, plan.page_size, plan.q_indptr, plan.q_rows, plan.kv_indptr, plan.kv_pages,
                plan.kv_lens, sm_scale, o_parts[:shared_parts], lse_parts[:shared_parts],
                max_rows=plan.m_tiles * plan.shared_config[0] // group, splits=plan.fa3_splits)
        elif num_groups:
            self.shared = shared_node.BoundSplits(
                q, k_cache, v_cache, plan.page_size, plan.q_indptr, plan.q_rows, plan.kv_indptr, plan.kv_pages,
                plan.kv_lens, sm_scale,
                o_parts[:shared_parts].view(num_rows, plan.shared_splits, num_q_heads, head_dim),
                lse_parts[:shared_parts].view(num_rows, plan.shared_splits, num_q_heads),
                group, plan.m_tiles, plan.shared_config, plan.kv_tma)
        self.own = paged_decode.bind_splits(
            q, k_cache, v_cache, plan.page_table, plan.page_size, plan.kv_start, plan.kv_end, sm_scale,
            o_parts[shared_parts:].view(batch, plan.own_splits, num_q_heads, head_dim),
            lse_parts[shared_parts:].view(batch, plan.own_splits, num_q_heads), group, plan.own_chunk,
            **(plan.own_options if self.side is not None else OWN_ALONE))
        self.merge = bind_merge(o_parts, lse_parts, plan.merge_indptr, plan.merge_part_ids, o, lse, 0)

    def __call__(self, q, k_cache, v_cache, o, lse) -> None:
        """q, o [B, Hq, D], lse [B, Hq] (addresses only: same layouts as at binding)."""
        if self.batch == 0:
            return
        side = self.side
        if side is not None:
            main = torch.cuda.current_stream(q.device)
            side.wait_stream(main)
        if self.shared is not None:
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                self.shared(q, k_cache, v_cache)
        self.own(q=q, k_cache=k_cache, v_cache=v_cache)
        if side is not None:
            main.wait_stream(side)
        self.merge(o_out=o, lse_out=lse)


def cascade_decode_attention(q, k_cache, v_cache, plan: CascadePlan, sm_scale=None,
                             side_stream: torch.cuda.Stream | None = None, out=None):
    """See the module docstring. With ``side_stream`` (CUDA), the shared-node kernel runs on it, beside
    the own-KV decode on the current stream; the merge waits for both (CUDA-graph capturable).
    ``out``: optional preallocated (o [B, Hq, D] dtype of q, contiguous D; lse [B, Hq] float32)."""
    run = CascadeDecode(q, k_cache, v_cache, plan, sm_scale, side_stream, out)
    run(q, k_cache, v_cache, *run.out)
    return run.out


def cascade_decode_attention_reference(q, k_cache, v_cache, page_size, q_indptr, q_rows, kv_indptr, kv_pages,
                                       kv_lens, page_table, kv_start, kv_end, sm_scale=None,
                                       dtype: torch.dtype = torch.float64):
    """Pure torch in ``dtype``: shared-node and own-KV references merged; contract of cascade_decode_attention."""
    o_sh, lse_sh = shared_node_attention_reference(q, k_cache, v_cache, page_size, q_indptr, q_rows, kv_indptr,
                                                   kv_pages, kv_lens, sm_scale, dtype)
    o_own, lse_own = paged_decode_attention_reference(q, k_cache, v_cache, page_table, page_size, kv_start, kv_end,
                                                      sm_scale, dtype)
    indptr, ids = merge_index(q_rows.tolist(), q.shape[0], 1, 1)
    as_index = lambda x: torch.from_numpy(x).to(q.device)  # noqa: E731
    return merge_attention_states_reference(torch.cat([o_sh, o_own]), torch.cat([lse_sh, lse_own]),
                                            as_index(indptr), as_index(ids), dtype)
