"""The persistent batch: which request each decode-graph row holds, from one step to the next.

One owner (``DeviceBatch``, the model runner's): the rows of the last step run on a decode graph (request
ids in row order, rid -> row, the graph whose buffers hold them, their shared runs, the own-KV length
class their launch shape was planned for), the next step's row order (``arrange``) and its changed rows,
the device rows of the step's newest tokens, and the graph page-table writes of pages appended to those
rows. The runner tells it what each step ran, in one place (``ModelRunner._forward``; a failed launch in
``launch``): ``ran_graph`` (a decode-graph step: run or advanced) or ``ran_other`` (piecewise, eager, or a
failed launch: the next step cannot advance).
``radixrelay.worker.cuda_graphs`` reads it and writes the device buffers.

The row-buffer layout is defined here once (``ROWS``): a decode graph's per-row inputs live in two
blocks, int64 ``rows64`` [ROWS64, S] and int32 ``rows32`` [ROWS32, S] (S: the graph's rows rounded up to
4, each block row 16-byte aligned). Every writer goes through it: buffer creation and the per-step fill
(``cuda_graphs``), the patch values of changed rows (``patch_values``; the ``patch_rows`` kernel reads
them in this order), the advance kernel's bound views.

Importable without Triton (a torch-only worker builds one too; it then stays empty).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

import torch

from radixrelay.attention.metadata import SharedRuns
from radixrelay.worker.graph_step import GraphStep, RowPatch

# A decode step whose rows differ from the last graph step's in at most this many rows (requests that
# joined, left, or moved into a freed row) patches those rows on the device (``arrange``, then
# ``DecodeGraphs.advance``); past it, the step's rows are filled from the host like any other step.
MAX_PATCH_ROWS = 64

T = TypeVar("T")


class RowFields(NamedTuple, Generic[T]):
    """One value per per-row input of a decode graph, in block order: the int64 block's rows, then the
    int32 block's (the order of the one-upload fill and of ``patch_rows``' values)."""

    positions: T       # int64: position of the token each row computes (its KV index)
    out_slots: T       # int64: KV slot its K/V is written to (padded rows: the scratch slot)
    rope_delta: T      # int64: RoPE position - KV index (modular rows; else 0)
    page_rows: T       # int64: row of the resident page table (``DevicePageTable``) holding its page list
    token_rows: T      # int64: row of the newest-token table (``ResidentTokens``): ids[i] = tokens[row]
    prefix_lens: T     # int32: tokens before its own (= position)
    seq_lens: T        # int32: position + 1
    kv_start: T        # int32: first position attended on its own (with shared runs; else 0)


class RowField(NamedTuple):
    block: int         # 0: rows64 (int64), 1: rows32 (int32)
    index: int         # row of that block


ROWS = RowFields(RowField(0, 0), RowField(0, 1), RowField(0, 2), RowField(0, 3), RowField(0, 4),
                 RowField(1, 0), RowField(1, 1), RowField(1, 2))
ROWS64 = sum(1 for f in ROWS if f.block == 0)      # 5 rows of int64
ROWS32 = len(ROWS) - ROWS64                        # 3 rows of int32
if list(ROWS) != [RowField(0, i) for i in range(ROWS64)] + [RowField(1, i) for i in range(ROWS32)]:
    raise AssertionError("ROWS must list the int64 block's rows, then the int32 block's, in order")
# Padded rows (past the step's rows) hold 0 everywhere but their KV slot, the scratch slot no request owns.
PAD_WITH_SCRATCH = RowFields(False, True, False, False, False, False, False, False)


def row_blocks(stride: int, scratch_slot: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows64 int64 [ROWS64, stride], rows32 int32 [ROWS32, stride]) of a new graph: every row padding."""
    rows64 = torch.zeros(ROWS64, stride, dtype=torch.int64, device=device)
    rows64[ROWS.out_slots.index].fill_(scratch_slot)
    return rows64, torch.zeros(ROWS32, stride, dtype=torch.int32, device=device)


def row_view(rows64: torch.Tensor, rows32: torch.Tensor, f: RowField, num: int) -> torch.Tensor:
    """The first ``num`` rows' values of field ``f`` (a view of its block)."""
    return (rows32 if f.block else rows64)[f.index, :num]


def fill_values(step: GraphStep, stride: int, zeros: array, scratch: array) -> array:
    """Every field of both blocks for ``step``'s rows, padded to ``stride`` rows, in block order (one
    upload: ``stride * ROWS64`` int64 values, then ``stride * ROWS32`` to be narrowed to int32). ``zeros``,
    ``scratch``: at least ``stride`` zeros / scratch slots (host padding)."""
    num = step.num
    pad = stride - num
    positions = array("q", step.positions)
    values = RowFields(positions, step.slots, step.rope_delta, step.page_rows, step.token_rows, positions,
                       array("q", [p + 1 for p in positions]), step.kv_start)
    zero_pad, scratch_pad = zeros[:pad], scratch[:pad]
    host = array("q")
    for v, with_scratch in zip(values, PAD_WITH_SCRATCH):
        host += zeros[:num] if v is None else v if isinstance(v, array) else array("q", v)
        host += scratch_pad if with_scratch else zero_pad
    return host


def patch_values(patch: RowPatch | None, num: int, before: int, host: array, zeros: array,
                 scratch: array) -> int:
    """Append to ``host`` the ``patch_rows`` block of a step that advances the last graph step's rows:
    per row its graph row, then its fields in ``ROWS`` order, for the patched rows and then for rows
    [num, before) that the batch gave up (padding again); returns how many rows. A patched row holds its
    position - 1: the advance that follows makes its position, sequence lengths and slot from its new page
    row (rows past ``num`` do not advance); its RoPE delta is 0 (modular rows take the full path)."""
    vacated = before - num if num < before else 0
    if patch is None:                                  # rows given up, none changed
        patch = RowPatch((), (), (), torch.empty(0), (), 0, ())
    n = len(patch.rows) + vacated
    positions = array("q", [p - 1 for p in patch.positions])
    host.extend(patch.rows)
    host.extend(range(num, num + vacated))
    values = RowFields(positions, patch.slots, None, patch.page_rows, patch.token_rows, positions,
                       patch.positions, patch.kv_start)
    zero_pad, scratch_pad = zeros[:vacated], scratch[:vacated]
    for v, with_scratch in zip(values, PAD_WITH_SCRATCH):
        host.extend(zeros[:len(positions)] if v is None else v)
        host.extend(scratch_pad if with_scratch else zero_pad)
    return n


class GraphRun(NamedTuple):
    """What a decode-graph step ran (``DecodeGraphs.run`` / ``advance``), for ``DeviceBatch.ran_graph``."""

    logits: torch.Tensor                # [num, V] a view of the graph's output: read it before the next run
    graph: object                       # the graph whose buffers hold the rows (``cuda_graphs._Graph``)
    rids: list[int] | None              # the rows' requests in row order; None: the next step cannot advance
    runs: SharedRuns | None             # the shared runs of the step (identity)
    own_len: int                        # longest own KV range its launch shape was planned for, tokens
    token_rows: torch.Tensor | None     # int64 [num] rows' newest-token rows (ids gathered on the device), or
                                        # None when the ids came from the caller
    advanced: bool                      # the last step's rows advanced (else filled from the host)


@dataclass
class GraphRows:
    """The rows of the last step run on a decode graph."""

    graph: object                       # the graph holding them (``cuda_graphs._Graph``)
    rids: list[int]                     # request of each row, in row order
    runs: SharedRuns | None             # their shared runs (identity)
    own_len: int                        # own-KV length their launch shape was chosen for, tokens
    row_of: dict[int, int] | None = None   # rid -> row, built on first use (kept by ``arrange``)


class DeviceBatch:
    """The persistent batch of the decode graphs (module docstring). Invariant: ``last`` describes what
    the device's graph buffers hold for the next step, or is None when the next step must fill them."""

    def __init__(self) -> None:
        self.last: GraphRows | None = None
        # int64 [num] newest-token rows of the last step when a decode graph gathered its ids by them
        # (``ResidentTokens.record`` writes the sampled tokens there); None otherwise
        self.token_rows: torch.Tensor | None = None
        self.arranged: list[int] | None = None      # ``arrange``'s order for the next step ...
        self.changed: list[int] = []                 # ... its rows holding another request, ascending

    def ran_graph(self, run: GraphRun) -> None:
        """The step ran on a decode graph: its rows are what the next step may advance (unless
        ``run.rids`` is None)."""
        self.token_rows = run.token_rows
        self.arranged, self.changed = None, []
        last = self.last
        if run.advanced and last is not None:        # the same rows (``arrange``'s order), one token further
            last.rids, last.runs, last.own_len = run.rids, run.runs, run.own_len
        else:
            self.last = GraphRows(run.graph, run.rids, run.runs, run.own_len) if run.rids is not None else None

    def ran_other(self) -> None:
        """The step ran another way (piecewise graphs, eager), or its launch failed: the next step does not
        continue the last graph step."""
        self.last = None
        self.token_rows = None
        self.arranged, self.changed = None, []

    def arrange(self, rids: list[int]) -> list[int]:
        """The row order of a decode-only step (a permutation of ``rids``): a request of the last graph
        step keeps its row; a newcomer takes a row freed by one that left, else a row past the end; a
        row left empty takes the last row's request (rows stay dense). The changed rows are kept for
        ``changed_rows`` / ``DecodeGraphs.advance``, which patch them instead of refilling the whole batch.
        Returns ``rids`` itself when there is no last step or more than ``MAX_PATCH_ROWS`` rows would
        change. O(len(rids)) in C-level set operations, O(changes) in Python."""
        r = self.last
        if r is None or r.rids == rids:
            return rids
        if r.row_of is None:
            r.row_of = {rid: i for i, rid in enumerate(r.rids)}
        row_of = r.row_of
        now = set(rids)
        left = row_of.keys() - now
        joined = sorted(now - row_of.keys())
        if not left and not joined:
            self.arranged, self.changed = r.rids, []
            return r.rids
        if len(left) + len(joined) > MAX_PATCH_ROWS or len(now) != len(rids):
            return rids
        freed = sorted(map(row_of.pop, left))
        order = r.rids.copy()
        changed = []
        for row, rid in zip(freed, joined):
            order[row] = rid
            changed.append(row)
        for rid in joined[len(freed):]:
            changed.append(len(order))
            order.append(rid)
        holes = freed[len(joined):]               # ascending; filled from the end of the batch
        lo, hi = 0, len(holes)
        while lo < hi:
            if holes[hi - 1] == len(order) - 1:
                order.pop()
                hi -= 1
            else:
                order[holes[lo]] = order.pop()
                changed.append(holes[lo])
                lo += 1
        changed = sorted(row for row in changed if row < len(order))
        for row in changed:
            row_of[order[row]] = row
        self.arranged, self.changed = order, changed
        return order

    def changed_rows(self, rids: list[int]) -> list[int] | None:
        """Rows of ``rids`` (the next step's rows) that hold another request than in the last graph step
        (``arrange``); None when the step does not continue that step (its rows are filled)."""
        r = self.last
        if r is None:
            return None
        if self.arranged is rids:
            return self.changed
        return [] if r.rids == rids else None

    def page_writes(self, appends: list[tuple[int, int, list[int]]], max_pages: int, host: array) -> int:
        """Append to ``host`` the graph page-table writes of pages appended to the last step's rows' page
        lists (rows a patch refills get theirs there whole) as rows, columns, pages; returns how many
        (padded to an even count: the next block stays 16-byte aligned), or -1 when one would pass
        ``max_pages`` columns. ``appends``: (rid, first column, pages) written since that step."""
        r = self.last
        if r.row_of is None:
            r.row_of = {rid: i for i, rid in enumerate(r.rids)}
        rows: list[int] = []
        cols: list[int] = []
        pages: list[int] = []
        for rid, start, new in appends:
            row = r.row_of.get(rid)
            if row is None:
                continue
            if start + len(new) > max_pages:
                return -1
            rows.extend([row] * len(new))
            cols.extend(range(start, start + len(new)))
            pages.extend(new)
        if len(rows) % 2:                                 # a repeated write: the same value again
            rows.append(rows[-1])
            cols.append(cols[-1])
            pages.append(pages[-1])
        host.extend(rows)
        host.extend(cols)
        host.extend(pages)
        return len(rows)
