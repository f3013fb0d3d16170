"""Decode steps as CUDA graphs, cascade included.

A pure-decode step of B requests runs on fixed buffers padded to a batch bucket (1, 2, 4, 8, 16, 24, 32,
then multiples of 16 up to ``max_batch``): token ids, positions, RoPE deltas (modular prompts), KV slots, page table, own KV range, and
the cascade's shared runs padded to powers of two (groups, rows, pages; an empty group attends nothing).
Flat decode is the same launch with no groups. The kernels' launch shape (split counts and chunk sizes,
query tiles, tile config) is baked into a graph: it is what ``plan_cascade`` picks for the step's size
class (bucket, groups, rows, largest group, longest run, own KV length rounded up to a power of two, so
that a growing suffix rarely changes it), computed once per class. Graphs are keyed by (bucket, padded
sizes, launch shape) and captured on first use, unless a captured graph covers the step (a larger bucket,
larger caps, tiles and splits that reach its rows and lengths): the step runs on that one, and only a size
class seen ``CAPTURE_AFTER`` times gets a graph of its own. In steady decode a step is one launch that advances every row (``advance``) and one
replay, without a device sync (the shared runs and merge index are refilled only when the plan changes).
Padded rows write their K/V to a scratch slot that no request owns and attend nothing.

Rows are stable: a request keeps its graph row from one decode step to the next. The persistent batch
(``radixrelay.worker.device_batch.DeviceBatch``, the model runner's) owns the last graph step's rows and
orders the next step's (``arrange``: a newcomer takes a row freed by one that left, a freed row left over
takes the last row's request); ``device_batch.ROWS`` defines the row buffers' layout. A decode step whose
batch changed by up to ``MAX_PATCH_ROWS`` rows then writes only those rows' values from the host (one
upload, ``scatter_pages`` + ``patch_rows``) before the same advance, on the same graph (and, if the
cascade plan's rows changed, its groups refilled); the decode runs' rows are ascending, so a newcomer in a
departed member's row leaves the plan's tensors as they were. A batch that shrinks into a smaller bucket
stays on its graph while it fills more than half of it (rows given up become padding), so a batch going
back and forth across a bucket boundary at saturation keeps advancing instead of refilling every row on
each crossing. This module writes the device buffers; which request a row holds is the batch's alone.

On the CPU the same buffers and plans run eagerly (no capture): the padding logic is tested there
with the Triton interpreter.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from operator import sub
from typing import NamedTuple

import numpy as np
import torch
import triton

from radixrelay.attention.kv_cache import KVCache
from radixrelay.attention.metadata import ForwardBatch, SharedRuns, to_device
from radixrelay.attention.triton_backend import TritonBackend
from radixrelay.kernels import CascadePlan
from radixrelay.kernels.cascade_decode import OWN_ALIGN, CascadeHost, CascadeLaunch, cascade_launch, merge_index
from radixrelay.kernels.decode_rows import RowAdvance, advance_decode_rows
from radixrelay.kernels.host_staging import upload
from radixrelay.kernels.row_patch import PageScatter, RowPatcher, patch_rows, scatter_pages
from radixrelay.model.llama import LlamaForCausalLM
from radixrelay.protocol.stats import WorkerCounters
from radixrelay.worker.device_batch import (
    ROWS,
    ROWS32,
    ROWS64,
    DeviceBatch,
    GraphRun,
    RowFields,
    fill_values,
    patch_values,
    row_blocks,
    row_view,
)
from radixrelay.worker.graph_step import GraphStep, RowPatch, round_length

_LaunchShape = tuple   # the plan's host-side launch parameters
# A step whose size class has no graph runs on a captured graph that covers it (a larger bucket, larger
# caps, a launch shape whose tiles and splits reach its rows and lengths), if there is one, until the class
# has been seen this many times: then its own graph is captured. Transient classes (a batch shrinking as
# requests finish, a plan that lasts a few steps) never pay a capture (a stall of the serving loop).
CAPTURE_AFTER = 32
# A size class that no captured graph covers, when the caller can run it on the piecewise graphs instead
# (``run(defer=True)``), is captured once seen this many times: the first steps of a burst (a tree's
# prefill and first decodes) do not stall on captures; a class that recurs gets its graph soon.
CAPTURE_UNCOVERED_AFTER = 8
# Batch buckets of the graphs captured at start-up that cover flat decode and up to ``COVER_GROUPS`` shared
# groups (``DecodeGraphs.capture_covers``): those below ``max_batch``, and ``max_batch`` itself.
COVER_BUCKETS = (16, 64, 128, 256, 384)
# A graph captured for other sizes may read a row's own KV in one piece per KV head (``_one_split_unbounded``):
# harmless for short rows, the whole step's critical path for a long one. A step whose longest own range is
# longer than this many tokens runs on another graph only if that graph cuts the range into at least half as
# many pieces as its own size class's launch would; else it is deferred, then gets its own graph.
COVER_OWN_TOKENS = 8192
COVER_GROUPS = 4
logger = logging.getLogger("radixrelay.worker")


def batch_buckets(max_batch: int) -> list[int]:
    small = [b for b in (1, 2, 4, 8, 16, 24, 32) if b < max_batch]
    return small + list(range(48, max_batch, 16)) + [max_batch]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None   # None on the CPU: "replay" runs the forward eagerly
    ids: torch.Tensor                    # int64 [bs]
    batch: ForwardBatch                  # fixed tensors, bs decode rows
    kv_start: torch.Tensor               # int32 [bs]
    plan: CascadePlan                    # over fixed tensors
    rows64: torch.Tensor                 # int64 [ROWS64, stride] } per-row inputs, fields as in
    rows32: torch.Tensor                 # int32 [ROWS32, stride] } ``device_batch.ROWS``
    groups32: torch.Tensor               # int32: every index tensor of ``plan``, one upload (``_GroupLayout``)
    layout: _GroupLayout
    advance: RowAdvance                  # the per-step kernels bound to these buffers (one launch each)
    scatter: PageScatter                 #   page writes into ``batch.page_table``
    patch: RowPatcher                    #   changed rows into the row blocks and the page table
    logits: torch.Tensor | None = None   # [bs, V] output of the captured forward
    key: tuple = ()                      # (bucket, caps, launch shape): its entry in DecodeGraphs._graphs
    cascade: bool = False                # captured with shared runs (else flat decode)
    runs: SharedRuns | None = None       # the decode runs the group buffers hold (identity) ...
    num: int = -1                        # ... for this many real rows


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, backend: TritonBackend, *,
                 max_batch: int, max_pages: int, scratch_slot: int, max_graphs: int = 64,
                 counters: WorkerCounters | None = None) -> None:
        """``max_pages``: page-table width (pages of the longest request); ``scratch_slot``: a KV slot
        outside every request's pages, written by padded rows; ``counters``: the worker's, incremented in
        place (graph captures, decode graph steps; None: new ones)."""
        self.model, self.kv_cache, self.backend = model, kv_cache, backend
        self.max_batch, self.max_pages, self.scratch_slot = max_batch, max_pages, scratch_slot
        self.buckets = batch_buckets(max_batch)
        self.device = kv_cache.device
        cfg = model.local_config                # this rank's heads
        self.heads = dict(num_q_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
        self.node_kernel = backend.node_kernel_for(kv_cache)           # baked into the launch shapes
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self._shapes: dict[tuple, CascadeLaunch] = {}   # size class -> the launch shape its graphs use
        stride = -(-max_batch // 4) * 4
        self._zeros = array("q", bytes(8 * stride))                  # host padding of the row blocks
        self._bucket_of = [next(b for b in self.buckets if b >= n) for n in range(max_batch + 1)]
        self._scratch = array("q", [scratch_slot]) * stride
        self._max_graphs = max_graphs
        self._pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        self._side: torch.cuda.Stream | None = None         # warm-up and capture stream (``_capture``)
        self.captures = 0               # graphs captured here; the worker's total: counters.graph_captures
        self.capture_s = 0.0            # host seconds spent capturing (``_capture``)
        # Decode graph steps: advanced on the device (``advance``), run on a larger graph that covers their
        # size class, advanced with changed rows patched (of the advanced), of an uncovered size class handed
        # back (``run(defer=True)``): counters.decode_steps_{advanced, covered, patched, deferred}
        self.counters = counters if counters is not None else WorkerCounters()
        self._misses: dict[tuple, int] = {}     # size class without a graph -> steps seen
        self._group = cfg.num_heads // cfg.num_kv_heads
        self._warm_advance()

    def capture_covers(self, buckets: tuple[int, ...] = COVER_BUCKETS) -> int:
        """At start-up: per bucket (``buckets`` below ``max_batch``, and ``max_batch``), capture a flat
        graph and a cascade graph whose launch shapes cover every size class of their kind up to the
        bucket's rows: nodes split to fill the GPU (chunks cut from each node's length at run time), one
        own-KV split over any length (``_one_split_unbounded``), query tiles for a group of every row; a
        cascade graph gathering K/V (steps with or without consecutive pages) and, where TMA applies, one
        loading consecutive node pages by TMA (steps whose runs are consecutive); the cascade graphs' caps
        hold ``COVER_GROUPS`` groups, rows in two levels (twice the bucket) and a run as long as the page
        table is wide. A fresh server's first decode steps then replay one of these (``_covering``)
        instead of running on the piecewise graphs until their class recurs (a piecewise step's host launch each)
        or stalling on a capture; a class seen ``CAPTURE_AFTER`` times still gets its own graph, with the
        launch shape chosen for it. Trees of more groups are left to those. Returns the number of graphs
        captured."""
        sizes = sorted({b for b in buckets if b < self.max_batch} | {self.max_batch})
        before = self.captures
        for bs in sizes:
            bs = self._bucket_of[bs]
            for cascade, tma in ((False, False), (True, False), (True, True)):
                caps = (COVER_GROUPS, _pow2(2 * bs), _pow2(self.max_pages)) if cascade else (1, 1, 1)
                shape = self._cover_shape(bs, cascade, tma)
                key = (bs, caps, _launch_shape(shape))
                if key in self._graphs:
                    continue
                g = self._buffers(bs, caps, shape)
                g.key, g.cascade = key, cascade
                self._fill_groups(g, None, 0)        # no rows: a real step refills the groups
                self._capture(g)
                self._graphs[key] = g
        return self.captures - before

    def _cover_shape(self, bs: int, cascade: bool, tma: bool) -> CascadeLaunch:
        """The launch shape of ``capture_covers``' graph for ``bs`` rows: flat, or every row in one group
        whose run is as long as a request can be (so not a light node), its node split to fill the GPU
        once (each node's chunks are cut from its own length at run time); ``tma``: node K/V by TMA, for
        steps whose runs are consecutive pages (the same shape as without where TMA does not apply)."""
        longest = self.max_pages * self.kv_cache.page_size
        host = (CascadeHost(tuple(range(bs)), (0, bs), (longest,), 1) if cascade
                else CascadeHost((), (0,), (), 1))
        return self._one_split_unbounded(cascade_launch(host, bs, self.device, own_splits=1, allow_tma=tma,
                                                        kv_contiguous=tma, node_kernel=self.node_kernel,
                                                        **self.heads))

    def fits(self, num: int, width: int) -> bool:
        """Whether a step of ``num`` rows whose page lists span ``width`` pages can run here."""
        return num <= self.max_batch and width <= self.max_pages

    def advance(self, batch: DeviceBatch, rids: list[int], runs: SharedRuns | None, tokens: torch.Tensor,
                appends: list[tuple[int, int, list[int]]], patch: RowPatch | None = None) -> GraphRun | None:
        """The run of a decode step that continues ``batch``'s last graph step on the device: rows ``rids``
        (the last step's, or ``batch.arrange``'s order for this step), each the same request one token
        further except the rows in ``patch`` (values from the host), with the same shared runs (``runs``,
        identity) unless the graph holds the new ones; None when the step does not continue it that way
        (then ``run`` it). ``tokens``: int64 [R] newest token per ``ResidentTokens`` row, every write made;
        ``appends``: (rid, first column, pages) written to page lists since that step."""
        r = batch.last
        if r is None:
            return None
        g, num, before = r.graph, len(rids), len(r.rids)
        own_len = r.own_len + 1
        arranged = batch.arranged is rids and rids is not r.rids      # rows changed (``arrange``)
        if r.runs is not runs and not arranged:
            return None
        if not arranged:
            if patch is not None or r.rids != rids:
                return None
        else:
            if (list(patch.rows) if patch is not None else []) != batch.changed:
                return None
            if num > len(g.ids) or (self._bucket_of[num] != self._bucket_of[before] and 2 * num <= len(g.ids)):
                return None       # another graph (grown past this one, or half of it idle): the full path
            if patch is not None:
                if patch.width > self.max_pages:
                    return None
                own = (patch.positions if patch.kv_start is None
                       else list(map(sub, patch.positions, patch.kv_start)))
                if own and min(own) < 0:
                    raise ValueError("DecodeGraphs.advance: kv_start must hold, per row, 0 <= kv_start <= position")
                own_len = max(own_len, max(own, default=0) + 1)
        if _pow2(own_len) != _pow2(r.own_len):         # maybe another launch shape: take the full path
            return None
        if r.runs is not runs and not self._holds(g, runs, own_len):
            return None
        host = array("q")
        writes = batch.page_writes(appends, self.max_pages, host) if appends else 0
        if writes < 0:
            return None
        patched = patch_values(patch, num, before, host, self._zeros, self._scratch) if arranged else 0
        if writes or patched:                             # one upload: page writes, then patched rows
            dev = to_device(host, torch.int64, self.device)
            if writes:
                g.scatter(dev[:3 * writes].view(3, writes))
            if patched:
                at, n = 3 * writes, 1 + len(ROWS)
                g.patch(patch.table if patch is not None else g.batch.page_table,
                        dev[at:at + n * patched].view(n, patched), patch.width if patch is not None else 0)
        if arranged:
            if g.runs is not runs:
                self._fill_groups(g, runs, num)
                g.runs = runs
            self.counters.decode_steps_patched += 1
        token_rows = row_view(g.rows64, g.rows32, ROWS.token_rows, num)
        g.advance(num, tokens)
        self._replay(g)
        g.num = num                                       # the merge index does not depend on it
        self.counters.decode_steps_advanced += 1
        return GraphRun(g.logits[:num], g, rids, runs, own_len, token_rows, True)

    def _holds(self, g: _Graph, runs: SharedRuns | None, own_len: int) -> bool:
        """Whether graph ``g``'s buffers and launch shape can run shared runs ``runs`` (its groups refilled)."""
        if runs is None or not g.cascade:
            return runs is None and not g.cascade
        caps = (_pow2(len(runs.host_kv_lens)), _pow2(len(runs.host_rows)), _pow2(len(runs.host_pages)))
        if any(c > have for c, have in zip(caps, g.key[1])):
            return False
        return _covers(g.plan, _Need(True, runs.max_rows * self._group, own_len, runs.contiguous))

    def run(self, step: GraphStep, rids: list[int] | None = None, defer: bool = False) -> GraphRun | None:
        """The run of a decode-graph step (its logits [num, V] a view of the graph's output: read it before
        the next run). ``rids`` (the rows' request ids): the next step may ``advance`` this one. ``defer``: the
        caller can run the step another way (piecewise graphs): a size class that no captured graph
        covers returns None until it has been seen ``CAPTURE_UNCOVERED_AFTER`` times, instead of being
        captured on its first step (a capture stalls the loop: at the start of a burst, on its
        first tokens)."""
        num = step.num
        if not self.fits(num, step.width):
            raise ValueError(f"DecodeGraphs.run: {num} rows over {step.width} pages do not fit "
                             f"{self.max_batch} rows x {self.max_pages} pages")
        bs = next(b for b in self.buckets if b >= num)
        runs = step.runs
        if step.kv_start is not None:
            own = list(map(sub, step.positions, step.kv_start))
            if len(own) != num or min(own) < 0:
                raise ValueError("DecodeGraphs.run: kv_start must hold, per row, 0 <= kv_start <= position")
            own_len = max(own) + 1
        else:
            own_len = max(step.positions) + 1
        if runs is None:
            num_groups = num_rows = num_pages = max_rows = max_kv = 0
            host_lens: tuple[int, ...] = ()
        else:
            host_lens = tuple(map(round_length, runs.host_kv_lens)) if step.round_runs else runs.host_kv_lens
            num_groups, num_rows, num_pages = len(host_lens), len(runs.host_rows), len(runs.host_pages)
            max_rows, max_kv = runs.max_rows, max(host_lens)
        contiguous = runs is not None and runs.contiguous          # the graph bakes in the TMA choice
        shape_key = (bs, num_groups, num_rows, max_rows, max_kv, contiguous, _pow2(own_len))
        shape = self._shapes.get(shape_key)
        if shape is None:       # the kernels' launch choice for this size class (host arithmetic)
            if len(self._shapes) > 256:
                self._shapes.clear()
            # own KV length rounded up to a power of two, so that a growing suffix rarely changes the key
            host = (CascadeHost(runs.host_rows, runs.host_indptr, host_lens, shape_key[-1]) if runs is not None
                    else CascadeHost((), (0,), (), shape_key[-1]))
            shape = self._shapes[shape_key] = self._one_split_unbounded(cascade_launch(
                host, bs, self.device, kv_contiguous=contiguous, node_kernel=self.node_kernel, **self.heads))
        caps = (_pow2(num_groups), _pow2(num_rows), _pow2(num_pages))
        key = (bs, caps, _launch_shape(shape))
        g = self._graphs.get(key)
        fresh = False
        if g is None:
            seen = self._misses[key] = self._misses.get(key, 0) + 1
            need = _Need(runs is not None, max_rows * self._group, own_len, contiguous, shape.own_splits)
            g = self._covering(num, caps, need) if seen < CAPTURE_AFTER else None
            if g is None and defer and seen < CAPTURE_UNCOVERED_AFTER:
                self.counters.decode_steps_deferred += 1
                return None
            if g is None:
                fresh = True
                g = self._buffers(bs, caps, shape)
                g.key, g.cascade = key, runs is not None
                self._misses.pop(key, None)
                if len(self._misses) > 1024:
                    self._misses.clear()
            else:
                self.counters.decode_steps_covered += 1
        token_rows = self._fill_rows(g, step)
        if g.runs is not runs or g.num != num or fresh:
            self._fill_groups(g, runs, num)
            g.runs = runs
        if fresh:
            start = time.perf_counter()
            self._capture(g)
            self._graphs[key] = g
            logger.info("decode graph %d captured in %.0f ms: batch bucket %d, groups/rows/pages caps %s, launch "
                        "(m_tiles, shared splits, chunk, own splits, chunk, config, tma, light nodes, fa3 splits) %s, "
                        "own length class %d",
                        self.captures, 1e3 * (time.perf_counter() - start), bs, caps, key[2], shape_key[-1])
            if len(self._graphs) > self._max_graphs:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(g.key)
            self._replay(g)
        return GraphRun(g.logits[:num], g, rids, runs, own_len, token_rows, False)

    def _warm_advance(self) -> None:
        """Compile (or load) the advance and patch kernels now, for this page table's width: not while
        serving."""
        i32 = dict(dtype=torch.int32, device=self.device)
        i64 = dict(dtype=torch.int64, device=self.device)
        table = torch.zeros(2, self.max_pages, **i32)
        advance_decode_rows(torch.zeros(1, **i64), torch.zeros(1, **i32), torch.zeros(1, **i32),
                            torch.zeros(1, **i64), table, 1, self.kv_cache.page_size,
                            ids=torch.zeros(1, **i64), tokens=torch.zeros(1, **i64), token_rows=torch.zeros(1, **i64))
        scatter_pages(table, torch.zeros(3, 2, **i64))
        patch_rows(torch.zeros(ROWS64, 4, **i64), torch.zeros(ROWS32, 4, **i32), table, table,
                   torch.zeros(1 + len(ROWS), 2, **i64), 1)

    def _covering(self, num: int, caps: tuple[int, int, int], need: _Need) -> _Graph | None:
        """The smallest captured graph that can run a step of ``num`` rows with buffers of ``caps`` and the
        sizes in ``need`` (padded rows and groups attend nothing; splits past a length read nothing)."""
        best: _Graph | None = None
        for (bs, graph_caps, _), g in self._graphs.items():
            if (bs < num or g.cascade != need.cascade or any(c < n for c, n in zip(graph_caps, caps))
                    or not _covers(g.plan, need)):
                continue
            # the smallest; of equal ones, a TMA launch where the step allows it
            if best is None or (bs, graph_caps, not g.plan.kv_tma) < (*best.key[:2], not best.plan.kv_tma):
                best = g
        return best

    def _one_split_unbounded(self, plan: CascadeLaunch) -> CascadeLaunch:
        """An own-KV level with one split reads [start, end) whatever its chunk, as long as the chunk covers
        the longest possible range: give it that chunk, so that growing lengths keep the launch shape (and
        the graph) instead of changing it at every power of two. (Shared nodes cut their chunks from their
        own lengths at run time: their shape never depends on a length.)"""
        if plan.own_splits != 1:
            return plan
        longest = self.max_pages * self.kv_cache.page_size
        return plan._replace(own_chunk=-(-longest // OWN_ALIGN) * OWN_ALIGN)

    # -- buffers -----------------------------------------------------------------------------------

    def _buffers(self, bs: int, caps: tuple[int, int, int], shape: CascadeLaunch) -> _Graph:
        num_groups, num_rows, num_pages = caps
        i32 = dict(dtype=torch.int32, device=self.device)
        i64 = dict(dtype=torch.int64, device=self.device)
        stride = -(-bs // 4) * 4                # every row of the blocks starts 16-byte aligned
        rows64, rows32 = row_blocks(stride, self.scratch_slot, self.device)
        v = RowFields(*(row_view(rows64, rows32, f, bs) for f in ROWS))      # [bs] views of each field
        positions, prefix_lens, seq_lens, kv_start = v.positions, v.prefix_lens, v.seq_lens, v.kv_start
        page_table = torch.zeros(bs, self.max_pages, **i32)
        batch = ForwardBatch(
            page_size=self.kv_cache.page_size, q_indptr=torch.arange(bs + 1, **i32),
            prefix_lens=prefix_lens, seq_lens=seq_lens, page_table=page_table,
            positions=positions, out_slots=v.out_slots,
            logits_indices=torch.arange(bs, **i64), max_q_len=1,
            max_seq_len=self.max_pages * self.kv_cache.page_size, num_decodes=bs,
            rope_delta=v.rope_delta)    # modular rows rotate by position + delta; others add 0
        nnz = num_rows * shape.shared_splits + bs * shape.own_splits
        layout = _GroupLayout.of(num_groups + 1, num_rows, num_groups + 1, num_pages, num_groups, bs + 1,
                                 max(nnz, 1))
        groups32 = torch.zeros(layout.total, **i32)
        q_indptr, q_rows, kv_indptr, kv_pages, kv_lens, merge_indptr, merge_part_ids = layout.views(groups32)
        plan = CascadePlan(   # the size class's launch shape over fixed, padded tensors
            q_indptr=q_indptr, q_rows=q_rows, kv_indptr=kv_indptr, kv_pages=kv_pages, kv_lens=kv_lens,
            page_table=page_table, kv_start=kv_start, kv_end=seq_lens, merge_indptr=merge_indptr,
            merge_part_ids=merge_part_ids, page_size=self.kv_cache.page_size, head_dim=self.heads["head_dim"],
            group=self._group, **shape._asdict())
        ids = torch.zeros(bs, **i64)
        advance = RowAdvance(positions, prefix_lens, seq_lens, v.out_slots, page_table, self.kv_cache.page_size, ids,
                             v.token_rows, bs)
        return _Graph(None, ids, batch, kv_start, plan, rows64, rows32, groups32, layout, advance,
                      PageScatter(page_table), RowPatcher(rows64, rows32, page_table))

    def _fill_rows(self, g: _Graph, step: GraphStep) -> torch.Tensor | None:
        """Per-row inputs, every step, in one upload (both blocks, padded rows included: they write the
        scratch slot and attend nothing), then the rows' page lists gathered from ``step.table``; returns
        the rows' newest-token rows when their ids are gathered by them (``step.ids`` None), else None."""
        num, stride = step.num, g.rows64.shape[1]
        dev = to_device(fill_values(step, stride, self._zeros, self._scratch), torch.int64, self.device)
        g.rows64.view(-1).copy_(dev[:ROWS64 * stride])
        g.rows32.view(-1).copy_(dev[ROWS64 * stride:])              # int64 -> int32
        width = step.width
        g.batch.page_table[:num, :width].copy_(
            step.table[:, :width].index_select(0, row_view(g.rows64, g.rows32, ROWS.page_rows, num)))
        if step.ids is None:
            token_rows = row_view(g.rows64, g.rows32, ROWS.token_rows, num)
            torch.index_select(step.tokens, 0, token_rows, out=g.ids[:num])
            return token_rows
        g.ids[:num].copy_(step.ids)
        return None

    def _fill_groups(self, g: _Graph, runs: SharedRuns | None, num: int) -> None:
        """The shared runs and the merge index, in one upload: only when the step's runs or row count
        changed. Padded groups have no rows and no KV."""
        p, lay = g.plan, g.layout
        host = np.zeros(lay.total, dtype=np.int32)
        q_indptr, q_rows, kv_indptr, kv_pages, kv_lens, merge_indptr, merge_parts = lay.views(host)
        rows: tuple[int, ...] = ()
        if runs is not None:
            rows, groups, pages = runs.host_rows, len(runs.host_kv_lens), len(runs.host_pages)
            q_indptr[:groups + 1] = runs.host_indptr
            q_indptr[groups + 1:] = len(rows)
            q_rows[:len(rows)] = rows
            kv_indptr[:groups + 1] = runs.host_kv_indptr
            kv_indptr[groups + 1:] = pages
            kv_pages[:pages] = runs.host_pages
            kv_lens[:groups] = runs.host_kv_lens
        indptr, part_ids = merge_index(rows, g.batch.num_requests, p.shared_splits, p.own_splits,
                                       rows_cap=len(q_rows))
        merge_indptr[:] = indptr
        merge_parts[:len(part_ids)] = part_ids
        if g.groups32.is_cuda:
            upload(host, torch.int32, self.device, out=g.groups32)
        else:
            g.groups32.copy_(torch.from_numpy(host))
        g.num = num

    # -- capture / replay --------------------------------------------------------------------------

    def _forward(self, g: _Graph) -> torch.Tensor:
        self.backend.bind(g.batch, g.kv_start, g.plan)
        return self.model(g.ids, g.batch, self.kv_cache, self.backend)

    def _capture(self, g: _Graph) -> None:
        start = time.perf_counter()
        try:
            self._capture_graph(g)
        finally:
            self.capture_s += time.perf_counter() - start

    def _capture_graph(self, g: _Graph) -> None:
        self.captures += 1
        self.counters.graph_captures += 1
        if self.device.type != "cuda":
            g.logits = self._forward(g)
            return
        stream = torch.cuda.current_stream(self.device)
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        side = self._side
        side.wait_stream(stream)
        with torch.cuda.stream(side):
            g.logits = self._forward(g)          # warm-up (loads kernels); the same step's work, so harmless
            # Captured right behind it, not through ``torch.cuda.graph``: that context synchronizes the
            # device, runs ``gc.collect()`` and empties the allocator's cache on entry, a stall of the
            # serving loop (the queued steps drain) and cudaMallocs again for later eager work.
            g.graph = torch.cuda.CUDAGraph()
            g.graph.capture_begin(pool=self._pool)
            try:
                g.logits = self._forward(g)
            finally:
                g.graph.capture_end()
        stream.wait_stream(side)
        g.graph.replay()

    def _replay(self, g: _Graph) -> None:
        if g.graph is None:
            g.logits = self._forward(g)
        else:
            g.graph.replay()


class _GroupLayout(NamedTuple):
    """Where a graph's cascade index tensors lie in its one int32 block, in this order: q_indptr, q_rows,
    kv_indptr, kv_pages, kv_lens, merge_indptr, merge_part_ids; each starts 16-byte aligned."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    total: int

    @classmethod
    def of(cls, *sizes: int) -> _GroupLayout:
        offsets, at = [], 0
        for n in sizes:
            offsets.append(at)
            at += -(-n // 4) * 4
        return cls(tuple(offsets), sizes, max(at, 1))

    def views(self, block):
        """The seven views of ``block`` (a device tensor or a host numpy array of ``total`` int32)."""
        return [block[o:o + n] for o, n in zip(self.offsets, self.sizes)]


class _Need(NamedTuple):
    """What a step asks of a graph's launch shape."""
    cascade: bool        # shared runs (else flat)
    query_rows: int      # most rows of a group x query heads per KV head (folded rows of a tile)
    own_len: int         # longest own KV range, tokens
    contiguous: bool     # every run's pages contiguous (a TMA launch needs it)
    own_splits: int = 0  # own-KV splits of the step's size class launch (0: not checked)


def _covers(plan: CascadePlan, need: _Need) -> bool:
    own = plan.own_splits * plan.own_chunk >= need.own_len and _splits_long_rows(plan, need)
    if not need.cascade:
        return own
    return (own and plan.m_tiles * plan.shared_config[0] >= need.query_rows
            and (need.contiguous or not plan.kv_tma))


def _splits_long_rows(plan: CascadePlan, need: _Need) -> bool:
    """Whether ``plan`` reads the step's longest own range in enough pieces (``COVER_OWN_TOKENS``)."""
    if need.own_len <= COVER_OWN_TOKENS or need.own_splits <= 1:
        return True
    pieces = min(plan.own_splits, -(-need.own_len // plan.own_chunk))
    return 2 * pieces >= need.own_splits


def _launch_shape(plan: CascadePlan | CascadeLaunch) -> _LaunchShape:
    return (plan.m_tiles, plan.shared_splits, plan.own_splits, plan.own_chunk,
            plan.shared_config, plan.kv_tma, plan.light_nodes, plan.fa3_splits)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(n, 1))
