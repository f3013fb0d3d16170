"""Shared-node attention: the decode queries of many requests attend one radix node's KV, non-causal.

API::

    shared_node_attention(q, k_cache, v_cache, page_size, q_indptr, q_rows, kv_indptr, kv_pages, kv_lens,
                          sm_scale=None, *, max_q_rows=None, max_kv_len=None, out=None) -> (o, lse)

    q:         [B, Hq, D]           fp16 / bf16 / fp32 decode queries, one per request
    k_cache:   [num_slots, Hkv, D]  paged cache (docs/kv_layout.md), v_cache the same
    q_indptr:  [G + 1] int32        group g (one shared node) owns entries q_indptr[g]:q_indptr[g + 1] ...
    q_rows:    [R] int32            ... of q_rows, the request indices into q; a request may sit in several
                                    groups (one per cascade level)
    kv_indptr: [G + 1] int32        group g's node is the first kv_lens[g] tokens of the page run
    kv_pages:  [sum pages] int32    kv_pages[kv_indptr[g]:kv_indptr[g + 1]]
    kv_lens:   [G] int32
    max_q_rows, max_kv_len: optional host ints >= max over groups of the row count / of kv_lens; they
               size the launch grid. Left out, they are read from the tensors (one device sync).
    kv_contiguous: the caller promises that each group's pages are consecutive page ids (check with
               ``pages_contiguous``); with >= TMA_MIN_ROWS folded rows (max_q_rows x GQA group) on Hopper
               (sm_90+, 16-bit, head dim 128), K/V tiles then come by TMA (faster on long nodes).
               Ignored where TMA does not apply (CPU interpreter, older GPUs, fewer rows).
    out:       optional preallocated (o [R, Hq, D] dtype of q, contiguous D; lse [R, Hq] float32)
    returns    o [R, Hq, D] dtype of q and lse [R, Hq] float32 natural log, row i for q_rows[i]; a group
               with kv_lens[g] = 0 gives o = 0, lse = -inf

One program handles (query tile, group x KV split, KV head). The tile's M rows are (request, query head
of this KV head) pairs: the GQA group folded into M, so a KV tile is loaded once per KV head for up to
BLOCK_M / group requests and both products run on the tensor cores (tl.dot). Tiles of one
(group, split, head) are adjacent in the grid, so their shared KV chunk is served from L2. When the
query tiles are too few to fill the GPU the node's KV length is split and the fp32 partials are
merged by ``merge_splits``.

The K/V tiles are gathered slot by slot (16-byte loads through the page list). Where a group's pages
are consecutive ids the node is one strided block of the cache and, on Hopper, the full tiles come by
TMA instead (``KV_TMA``): the gather is bound by the L2-to-SM traffic of many query tiles re-reading
each KV tile, which TMA relieves (benchmarks/results/kernels/attention.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixrelay.kernels._common import (LOG2E, KernelLaunch, attend_reference, check, check_index, check_out,
                                        check_qkv, dot_precision, finish_rows, gather_kv_reference, load_kv_tile,
                                        num_sms, pick_splits, softmax_step)
from radixrelay.kernels.merge import bind_merge_splits


try:  # host-side TMA descriptors (triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton: the gather path only
    TensorDescriptor = None


@triton.jit
def shared_node_program(
    m_tile, g, split, kv_head,
    q, k_cache, v_cache, k_desc, v_desc, q_indptr, q_rows, kv_indptr, kv_pages, kv_lens, o, lse,
    qk_scale, splits, group,
    stride_q_b, stride_q_h, stride_slot, stride_kv_h,
    stride_o_r, stride_o_s, stride_o_h, stride_l_r, stride_l_s, stride_l_h,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KV_TMA: tl.constexpr,
):
    """Query tile ``m_tile`` of group ``g`` against KV split ``split`` of ``splits`` of the group's node, one
    KV head. The node is cut into ``splits`` chunks of equal length (a multiple of BLOCK_N) at run time, from
    its own length: one launch (or captured graph) of S splits balances any node length.

    With ``KV_TMA`` every group's pages are consecutive page ids, so token t of the node lives in slot
    first_page * PAGE_SIZE + t: the full K/V tiles come by TMA boxes [BLOCK_N, HEAD_DIM] of the cache
    viewed as [num_slots, Hkv * HEAD_DIM] (``k_desc``, ``v_desc``); the last partial tile is gathered.

    Writes o[row, split, head, :] and lse[row, split, head] for the tile's rows (nothing if the tile is
    past the group's rows); a split past the node's end writes o = 0, lse = -inf.
    """
    row0 = tl.load(q_indptr + g)
    num_m = (tl.load(q_indptr + g + 1) - row0) * group                 # rows of this group, heads folded
    if m_tile * BLOCK_M < num_m:
        offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)              # [BM] = (row, head in group)
        offs_d = tl.arange(0, HEAD_DIM)
        offs_n = tl.arange(0, BLOCK_N)
        m_ok = offs_m < num_m
        row = row0 + offs_m // group                                   # [BM] output row
        head = kv_head * group + offs_m % group                        # [BM] query head
        req = tl.load(q_rows + row, mask=m_ok, other=0).to(tl.int64)
        q_tile = tl.load(q + req[:, None] * stride_q_b + head[:, None] * stride_q_h + offs_d[None, :],
                         mask=m_ok[:, None], other=0.0)               # [BM, D]

        kv_len = tl.load(kv_lens + g)
        chunk = tl.cdiv(tl.cdiv(kv_len, splits), BLOCK_N) * BLOCK_N
        lo = tl.multiple_of(split * chunk, BLOCK_N)
        hi = tl.minimum(kv_len, lo + chunk)
        full_hi = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
        pages = kv_pages + tl.load(kv_indptr + g)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        if KV_TMA:
            first_slot = tl.load(pages, mask=lo < hi, other=0) * PAGE_SIZE
            col = kv_head * HEAD_DIM
            for n0 in range(lo, full_hi, BLOCK_N):
                k = k_desc.load([first_slot + n0, col])
                v = v_desc.load([first_slot + n0, col])
                m_i, l_i, acc = softmax_step(q_tile, k, v, m_i, l_i, acc, qk_scale, None, False, DOT_PRECISION)
        else:
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
            m_i, l_i, acc = softmax_step(q_tile, k, v, m_i, l_i, acc, qk_scale, valid[None, :], True,
                                         DOT_PRECISION)

        out, out_lse = finish_rows(m_i, l_i, acc)
        row = row.to(tl.int64)
        tl.store(o + row[:, None] * stride_o_r + split * stride_o_s + head[:, None] * stride_o_h + offs_d[None, :],
                 out.to(o.dtype.element_ty), mask=m_ok[:, None])
        tl.store(lse + row * stride_l_r + split * stride_l_s + head * stride_l_h, out_lse, mask=m_ok)


# Not specialised (radixrelay.worker.warmup): per-step values, so that none compiles a new variant
# mid-serving: the index tensors and lse (alignment of per-step slices), the split count (1 would become a
# constant) and the lse strides that carry it. q / o / cache strides are fixed by the model or multiples of D.
@triton.jit(do_not_specialize=["q_indptr", "q_rows", "kv_indptr", "kv_pages", "kv_lens", "lse", "splits",
                               "stride_l_r", "stride_l_s"])
def _shared_node_kernel(
    q, k_cache, v_cache, k_desc, v_desc, q_indptr, q_rows, kv_indptr, kv_pages, kv_lens, o, lse,
    qk_scale, splits, group,
    stride_q_b, stride_q_h, stride_slot, stride_kv_h,
    stride_o_r, stride_o_s, stride_o_h, stride_l_r, stride_l_s, stride_l_h,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KV_TMA: tl.constexpr,
):
    # grid: (query tiles, groups * splits, Hkv); tiles of one (group, split, head) are adjacent
    shared_node_program(
        tl.program_id(0), tl.program_id(1) // splits, tl.program_id(1) % splits, tl.program_id(2),
        q, k_cache, v_cache, k_desc, v_desc, q_indptr, q_rows, kv_indptr, kv_pages, kv_lens, o, lse, qk_scale,
        splits, group,
        stride_q_b, stride_q_h, stride_slot, stride_kv_h,
        stride_o_r, stride_o_s, stride_o_h, stride_l_r, stride_l_s, stride_l_h,
        PAGE_SIZE, BLOCK_M, BLOCK_N, HEAD_DIM, DOT_PRECISION, KV_TMA,
    )


# Fewest folded query rows per group (max_q_rows x GQA group) for which consecutive node pages are loaded
# by TMA: below it TMA does not win (attention.md).
TMA_MIN_ROWS = 128


def tile_config(rows: int, kv_tma: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for ``rows`` folded query rows per group.

    Gathered K/V: BLOCK_M <= 64, 4 warps. K/V by TMA (used only with >= TMA_MIN_ROWS rows): 128 x 64 tiles,
    8 warps. Both chosen by sweeps over the grid of batch x node length (benchmarks/results/kernels/attention.md)."""
    if kv_tma:
        return 128, 64, 8, 3
    return min(64, max(16, triton.next_power_of_2(rows))), 64, 4, 3


def tile_configs(group: int, head_dim: int, device: torch.device) -> list[tuple[tuple[int, int, int, int], bool]]:
    """Every ``(config, kv_tma)`` a launch for this model can get (the start-up warm-up compiles each): the
    gathered configs of ``tile_config`` for folded rows ``rows x group``, rows >= 1 (BLOCK_M: the powers of two
    from max(16, group) to 64), and the TMA config where a plan asks for it (Hopper, head dim 128; whether the
    launch then loads by TMA is ``tma_usable``'s call, made in ``launch_splits`` as in serving)."""
    configs = []
    for shift in range(8):                                  # group * 128 rows reach the largest gathered tile
        config = (tile_config(group << shift), False)
        if config not in configs:
            configs.append(config)
    if head_dim == 128 and tma_capable(device):
        configs.append((tile_config(TMA_MIN_ROWS, True), True))
    return configs


# Register cap of the TMA config's programs (below what they take unbounded): faster alone, and it leaves
# room for two own-KV decode programs of 4 warps at 96 registers on the same multiprocessor (attention.md).
TMA_MAXNREG = 152


def max_registers(config: tuple[int, int, int, int], kv_tma: bool) -> int | None:
    """Registers per thread for a launch of ``config`` (None: as the compiler likes)."""
    return TMA_MAXNREG if kv_tma and config[2] == 8 else None


def tma_capable(device: torch.device) -> bool:
    """A GPU whose copy engine takes tensor descriptors (Hopper or newer) and a triton that has them."""
    return (TensorDescriptor is not None and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] >= 9)


def tma_usable(q, k_cache, v_cache) -> bool:
    """The K/V TMA path applies to these tensors: 16-bit, head dim 128 (the one measured; its tiles fit in
    shared memory), each slot's [Hkv, D] contiguous, 16-byte aligned."""
    return (tma_capable(q.device) and q.dtype in (torch.float16, torch.bfloat16) and q.shape[2] == 128
            and all(c.stride(1) == c.shape[2] and c.stride(2) == 1 and (c.stride(0) * c.element_size()) % 16 == 0
                    and c.data_ptr() % 16 == 0 for c in (k_cache, v_cache)))


def pages_contiguous(kv_indptr: torch.Tensor, kv_pages: torch.Tensor) -> bool:
    """Whether every group's page run is consecutive page ids (one device sync)."""
    if kv_pages.numel() < 2:
        return True
    ok = (kv_pages[1:] - kv_pages[:-1]) == 1
    starts = kv_indptr[1:-1].long() - 1                     # a group's first page may jump from the last one
    starts = starts[(starts >= 0) & (starts < ok.numel())]
    ok[starts] = True
    return bool(ok.all())


def programs_per_sm(config: tuple[int, int, int, int]) -> int:
    """Programs of ``config`` that run at once on one multiprocessor, for the split-count model: two
    of 4 warps (registers allow it), one of 8 warps."""
    return 2 if config[2] <= 4 else 1


class BoundSplits:
    """The launch of ``launch_splits``, to repeat with new ``q``, caches, ``o``, ``lse`` of the same shapes and
    strides: a ``KernelLaunch`` plus the caches' TMA descriptors, made again for new caches."""

    def __init__(self, q, k_cache, v_cache, page_size, q_indptr, q_rows, kv_indptr, kv_pages, kv_lens, sm_scale,
                 o_dst, lse_dst, group: int, m_tiles: int, config: tuple[int, int, int, int],
                 kv_tma: bool = False, maxnreg: int | None = None) -> None:
        block_m, block_n, num_warps, num_stages = config
        splits = o_dst.shape[1]
        self.kv_tma = kv_tma = kv_tma and tma_usable(q, k_cache, v_cache)
        self.block_n = block_n
        maxnreg = max_registers(config, kv_tma) if maxnreg is None else maxnreg
        k_desc, v_desc = self._descriptors(k_cache, v_cache)
        grid = (m_tiles, (q_indptr.numel() - 1) * splits, k_cache.shape[1])
        self.kernel = KernelLaunch(_shared_node_kernel, grid, dict(
            q=q, k_cache=k_cache, v_cache=v_cache, k_desc=k_desc, v_desc=v_desc, q_indptr=q_indptr, q_rows=q_rows,
            kv_indptr=kv_indptr, kv_pages=kv_pages, kv_lens=kv_lens, o=o_dst, lse=lse_dst,
            qk_scale=sm_scale * LOG2E, splits=splits, group=group,
            stride_q_b=q.stride(0), stride_q_h=q.stride(1), stride_slot=k_cache.stride(0),
            stride_kv_h=k_cache.stride(1),
            stride_o_r=o_dst.stride(0), stride_o_s=o_dst.stride(1), stride_o_h=o_dst.stride(2),
            stride_l_r=lse_dst.stride(0), stride_l_s=lse_dst.stride(1), stride_l_h=lse_dst.stride(2),
            PAGE_SIZE=page_size, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=q.shape[2],
            DOT_PRECISION=dot_precision(q.dtype), KV_TMA=kv_tma,
        ), dict(num_warps=num_warps, num_stages=num_stages, maxnreg=maxnreg))

    def _descriptors(self, k_cache, v_cache):
        """TMA descriptors of the caches viewed as [num_slots, Hkv * D] (the caches themselves without TMA:
        unused by the gather path)."""
        if not self.kv_tma:
            return k_cache, v_cache
        slots, width = k_cache.shape[0], k_cache.shape[1] * k_cache.shape[2]
        return tuple(TensorDescriptor(c.view(slots, width), [slots, width], [c.stride(0), 1],
                                      [self.block_n, c.shape[2]]) for c in (k_cache, v_cache))

    def __call__(self, q=None, k_cache=None, v_cache=None, o=None, lse=None):
        """Launch with the given tensors replaced (the caches together); returns the compiled kernel."""
        new = {name: t for name, t in (("q", q), ("o", o), ("lse", lse)) if t is not None}
        if k_cache is not None:
            new["k_desc"], new["v_desc"] = self._descriptors(k_cache, v_cache)
            new["k_cache"], new["v_cache"] = k_cache, v_cache
        return self.kernel(**new)


def launch_splits(q, k_cache, v_cache, page_size, q_indptr, q_rows, kv_indptr, kv_pages, kv_lens, sm_scale, o_dst,
                  lse_dst, group: int, m_tiles: int, config: tuple[int, int, int, int],
                  kv_tma: bool = False, maxnreg: int | None = None):
    """Launch into o_dst [R, S, Hq, D], lse_dst [R, S, Hq]: split s of group g covers node tokens
    [s * chunk, +chunk), chunk = kv_lens[g] / S rounded up to a multiple of BLOCK_N (splits past the node's
    end: o = 0, lse = -inf);
    ``m_tiles`` query tiles of BLOCK_M rows per group, ``config`` = (BLOCK_M, BLOCK_N, warps, stages).
    ``kv_tma``: the caller promises that every group's pages are consecutive ids; full K/V tiles are then
    loaded by TMA where ``tma_usable`` (else the page gather runs); ``maxnreg`` caps registers per thread
    (default ``max_registers``). Returns the compiled kernel."""
    return BoundSplits(q, k_cache, v_cache, page_size, q_indptr, q_rows, kv_indptr, kv_pages, kv_lens, sm_scale,
                       o_dst, lse_dst, group, m_tiles, config, kv_tma, maxnreg)()


class SharedNode:
    """``shared_node_attention`` bound to one step: checked, tiled, split, buffered and bound once; then called
    (every layer) with ``q``, caches and outputs of the shapes, dtypes and strides given here. The split
    partials' buffer is allocated here and rewritten by every call (stream-ordered)."""

    def __init__(self, q, k_cache, v_cache, page_size, q_indptr, q_rows, kv_indptr, kv_pages, kv_lens, sm_scale=None,
                 *, max_q_rows: int | None = None, max_kv_len: int | None = None, out=None,
                 kv_contiguous: bool = False, config=None, slots_per_sm: int | None = None,
                 overhead: int = 256) -> None:
        group = check_qkv(q, k_cache, v_cache, page_size)
        device = q.device
        check_index("q_indptr", q_indptr, device)
        check(q_indptr.numel() >= 1, "q_indptr needs at least one entry")
        num_groups = q_indptr.numel() - 1
        check_index("q_rows", q_rows, device)
        check_index("kv_indptr", kv_indptr, device, num_groups + 1)
        check_index("kv_pages", kv_pages, device)
        check_index("kv_lens", kv_lens, device, num_groups)
        self.out = o, lse = check_out(out, (q_rows.numel(), q.shape[1], q.shape[2]), q.dtype, device)
        if max_q_rows is None:
            max_q_rows = int((q_indptr[1:] - q_indptr[:-1]).max()) if num_groups else 0
        if max_kv_len is None:
            max_kv_len = int(kv_lens.max()) if num_groups else 0
        max_q_rows, max_kv_len = int(max_q_rows), int(max_kv_len)
        sm_scale = q.shape[2] ** -0.5 if sm_scale is None else float(sm_scale)
        self.kernel = self.merge = None
        num_rows, num_q_heads, head_dim = o.shape
        if num_rows == 0 or num_groups == 0:
            return
        kv_tma = kv_contiguous and max_q_rows * group >= TMA_MIN_ROWS and tma_usable(q, k_cache, v_cache)
        config = config or tile_config(max_q_rows * group, kv_tma)
        block_m, block_n = config[:2]
        slots_per_sm = programs_per_sm(config) if slots_per_sm is None else slots_per_sm
        m_tiles = triton.cdiv(max(max_q_rows, 1) * group, block_m)
        live_tiles = min(num_groups * m_tiles, triton.cdiv(num_rows * group, block_m) + num_groups)
        splits, _ = pick_splits(live_tiles * k_cache.shape[1], max_kv_len, block_n,
                                slots_per_sm * num_sms(device), overhead)
        if splits == 1:
            o_dst, lse_dst = o.unsqueeze(1), lse.unsqueeze(1)                 # [R, 1, Hq, D], [R, 1, Hq]
        else:
            o_dst = torch.empty((num_rows, splits, num_q_heads, head_dim), dtype=torch.float32, device=device)
            lse_dst = torch.empty((num_rows, splits, num_q_heads), dtype=torch.float32, device=device)
            self.merge = bind_merge_splits(o_dst, lse_dst, o, lse)
        self.kernel = BoundSplits(q, k_cache, v_cache, page_size, q_indptr, q_rows, kv_indptr, kv_pages, kv_lens,
                                  sm_scale, o_dst, lse_dst, group, m_tiles, config, kv_tma)

    def __call__(self, q, k_cache, v_cache, o, lse) -> None:
        """q [B, Hq, D]; o [R, Hq, D], lse [R, Hq] (addresses only: same layouts as at binding)."""
        if self.kernel is None:
            return
        if self.merge is None:
            self.kernel(q, k_cache, v_cache, o, lse)
        else:
            self.kernel(q, k_cache, v_cache)
            self.merge(o_out=o, lse_out=lse)


def _launch(q, k_cache, v_cache, page_size, q_indptr, q_rows, kv_indptr, kv_pages, kv_lens, sm_scale, o, lse,
            group: int, max_q_rows: int, max_kv_len: int, **options) -> None:
    """One launch into (o, lse) with ``SharedNode``'s tile and split ``options`` (tests, benchmarks)."""
    run = SharedNode(q, k_cache, v_cache, page_size, q_indptr, q_rows, kv_indptr, kv_pages, kv_lens, sm_scale,
                     max_q_rows=max_q_rows, max_kv_len=max_kv_len, out=(o, lse), **options)
    run(q, k_cache, v_cache, o, lse)


def shared_node_attention(q, k_cache, v_cache, page_size, q_indptr, q_rows, kv_indptr, kv_pages, kv_lens,
                          sm_scale=None, *, max_q_rows: int | None = None, max_kv_len: int | None = None, out=None,
                          kv_contiguous: bool = False):
    run = SharedNode(q, k_cache, v_cache, page_size, q_indptr, q_rows, kv_indptr, kv_pages, kv_lens, sm_scale,
                     max_q_rows=max_q_rows, max_kv_len=max_kv_len, out=out, kv_contiguous=kv_contiguous)
    run(q, k_cache, v_cache, *run.out)
    return run.out


def shared_node_attention_reference(q, k_cache, v_cache, page_size, q_indptr, q_rows, kv_indptr, kv_pages,
                                    kv_lens, sm_scale=None, dtype: torch.dtype = torch.float64):
    """Pure torch, one group at a time, in ``dtype``; same contract as ``shared_node_attention``."""
    sm_scale = q.shape[2] ** -0.5 if sm_scale is None else float(sm_scale)
    num_rows = q_rows.numel()
    o = torch.zeros((num_rows, *q.shape[1:]), dtype=dtype, device=q.device)
    lse = torch.full((num_rows, q.shape[1]), float("-inf"), dtype=dtype, device=q.device)
    for g in range(q_indptr.numel() - 1):
        r0, r1 = int(q_indptr[g]), int(q_indptr[g + 1])
        pages = kv_pages[int(kv_indptr[g]) : int(kv_indptr[g + 1])]
        positions = torch.arange(int(kv_lens[g]), device=q.device)
        k = gather_kv_reference(k_cache, pages, positions, page_size)
        v = gather_kv_reference(v_cache, pages, positions, page_size)
        o[r0:r1], lse[r0:r1] = attend_reference(q[q_rows[r0:r1].long()], k, v, sm_scale, dtype=dtype)
    return o, lse
