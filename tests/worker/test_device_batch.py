"""The persistent batch (``DeviceBatch``) and the one definition of the decode graphs' row buffers (``ROWS``).

- The layout: the per-step fill (``fill_values``, one upload into both blocks) and the patch values of
  changed rows (``patch_values``, written by the ``patch_rows`` kernel) put each field where ``row_view``
  reads it; padded rows hold 0 and the scratch slot; the advance kernel bound to the views moves the
  fields it owns.
- What the runner tells it: a graph step it may advance, an advanced step (rows and rid -> row kept), a
  step without rids, another path; the graph page-table writes of appended pages.
"""

from __future__ import annotations

from array import array

import torch

from radixrelay.kernels.decode_rows import RowAdvance
from radixrelay.kernels.row_patch import patch_rows
from radixrelay.worker.device_batch import (
    ROWS, ROWS32, ROWS64, DeviceBatch, GraphRows, GraphRun, RowFields, fill_values, patch_values, row_blocks,
    row_view,
)
from radixrelay.worker.graph_step import GraphStep, RowPatch
from tests.kernels.helpers import DEVICE

SCRATCH = 999
STRIDE = 8


def padding(n: int) -> tuple[array, array]:
    return array("q", bytes(8 * n)), array("q", [SCRATCH]) * n


def fields(rows64: torch.Tensor, rows32: torch.Tensor, num: int) -> RowFields:
    return RowFields(*(row_view(rows64, rows32, f, num).tolist() for f in ROWS))


def test_layout_is_the_kernels():
    """The blocks' shapes and the ``patch_rows`` block (graph row, then the fields in ``ROWS`` order; the
    kernel reads the page-table row at 1 + its index) agree with the kernels' own checks."""
    assert (ROWS64, ROWS32) == (5, 3) and ROWS.page_rows == (0, 3)
    rows64, rows32 = row_blocks(STRIDE, SCRATCH, torch.device(DEVICE))
    assert rows64.shape == (ROWS64, STRIDE) and rows32.shape == (ROWS32, STRIDE) and rows32.dtype == torch.int32
    assert fields(rows64, rows32, STRIDE).out_slots == [SCRATCH] * STRIDE        # a new graph: all padding


def test_fill_puts_each_field_where_it_is_read():
    step = GraphStep(None, [5, 9, 2], [50, 90, 20], torch.zeros(1, 1, dtype=torch.int32), [7, 8, 6], 1,
                     kv_start=[1, 0, 2], rope_delta=[0, -3, 4], token_rows=[11, 12, 13])
    host = fill_values(step, STRIDE, *padding(STRIDE))
    assert len(host) == len(ROWS) * STRIDE
    rows64, rows32 = row_blocks(STRIDE, SCRATCH, torch.device(DEVICE))
    dev = torch.tensor(host, dtype=torch.int64, device=DEVICE)
    rows64.view(-1).copy_(dev[:ROWS64 * STRIDE])
    rows32.view(-1).copy_(dev[ROWS64 * STRIDE:])
    pad = [0] * (STRIDE - 3)
    assert fields(rows64, rows32, STRIDE) == RowFields(
        positions=[5, 9, 2] + pad, out_slots=[50, 90, 20] + [SCRATCH] * (STRIDE - 3), rope_delta=[0, -3, 4] + pad,
        page_rows=[7, 8, 6] + pad, token_rows=[11, 12, 13] + pad, prefix_lens=[5, 9, 2] + pad,
        seq_lens=[6, 10, 3] + pad, kv_start=[1, 0, 2] + pad)


def test_patch_values_through_the_kernel_then_advance():
    """Rows 1 and 3 patched, row 4 given up (the batch shrank from 5 rows to 4); then the advance kernel bound
    to the field views: the patched rows reach their positions, the others move one token on."""
    rows64, rows32 = row_blocks(STRIDE, SCRATCH, torch.device(DEVICE))
    width = 4
    page_table = torch.zeros(STRIDE, width, dtype=torch.int32, device=DEVICE)
    source = torch.arange(40, dtype=torch.int32, device=DEVICE).view(10, width)     # page list of row r: 4r..4r+3
    step = GraphStep(None, [4, 5, 6, 7, 8], [0] * 5, source, [0, 0, 0, 0, 0], width)
    host = fill_values(step, STRIDE, *padding(STRIDE))
    dev = torch.tensor(host, dtype=torch.int64, device=DEVICE)
    rows64.view(-1).copy_(dev[:ROWS64 * STRIDE])
    rows32.view(-1).copy_(dev[ROWS64 * STRIDE:])
    patch = RowPatch([1, 3], [2, 9], [0, 0], source, [2, 5], width, [21, 23], kv_start=[1, 3])
    host = array("q")
    n = patch_values(patch, 4, 5, host, *padding(STRIDE))
    assert n == 3 and len(host) == (1 + len(ROWS)) * n
    patch_rows(rows64, rows32, page_table, source, torch.tensor(host, device=DEVICE).view(1 + len(ROWS), n), width)
    got = fields(rows64, rows32, 5)
    assert got.positions == [4, 1, 6, 8, 0] and got.seq_lens == [5, 2, 7, 9, 0]      # patched rows: position - 1
    assert got.page_rows == [0, 2, 0, 5, 0] and got.token_rows == [0, 21, 0, 23, 0]
    assert got.kv_start == [0, 1, 0, 3, 0] and got.out_slots[4] == SCRATCH and got.rope_delta == [0] * 5
    assert page_table[1].tolist() == [8, 9, 10, 11] and page_table[3].tolist() == [20, 21, 22, 23]
    v = RowFields(*(row_view(rows64, rows32, f, STRIDE) for f in ROWS))
    ids = torch.zeros(STRIDE, dtype=torch.int64, device=DEVICE)
    advance = RowAdvance(v.positions, v.prefix_lens, v.seq_lens, v.out_slots, page_table, 4, ids, v.token_rows, STRIDE)
    advance(4, torch.arange(100, 130, dtype=torch.int64, device=DEVICE))
    got = fields(rows64, rows32, 5)
    assert got.positions == [5, 2, 7, 9, 0] and got.prefix_lens == [5, 2, 7, 9, 0] and got.seq_lens == [6, 3, 8, 10, 0]
    assert got.out_slots[1] == 8 * 4 + 2 and got.out_slots[3] == 22 * 4 + 1 and got.out_slots[4] == SCRATCH
    assert ids[:4].tolist() == [100, 121, 100, 123]


def run_of(graph: object, rids: list[int] | None, advanced: bool = False, own_len: int = 4) -> GraphRun:
    return GraphRun(torch.zeros(0), graph, rids, None, own_len, None, advanced)


def test_told_what_ran():
    batch, graph = DeviceBatch(), object()
    assert batch.last is None and batch.arrange([1, 2]) == [1, 2] and batch.changed_rows([1, 2]) is None
    batch.ran_graph(run_of(graph, [1, 2, 3]))
    assert batch.last == GraphRows(graph, [1, 2, 3], None, 4)
    assert batch.changed_rows([1, 2, 3]) == [] and batch.changed_rows([3, 2, 1]) is None
    order = batch.arrange([1, 3, 4])                     # 4 takes 2's row
    assert order == [1, 4, 3] and batch.changed_rows(order) == [1]
    last = batch.last
    batch.ran_graph(run_of(graph, order, advanced=True, own_len=5))
    assert batch.last is last and last.rids == [1, 4, 3] and last.own_len == 5 and last.row_of == {1: 0, 4: 1, 3: 2}
    assert batch.arranged is None and batch.changed == []
    batch.ran_graph(run_of(graph, None))                 # extend rows: nothing to advance
    assert batch.last is None
    batch.ran_graph(run_of(graph, [7]))
    batch.ran_other()
    assert batch.last is None and batch.token_rows is None and batch.changed_rows([7]) is None


def test_page_writes_of_the_rows():
    batch = DeviceBatch()
    batch.ran_graph(run_of(object(), [10, 11, 12]))
    host = array("q")
    assert batch.page_writes([(11, 2, [40, 41]), (99, 0, [5]), (12, 3, [50])], 8, host) == 4   # 99: no row
    assert list(host) == [1, 1, 2, 2] + [2, 3, 3, 3] + [40, 41, 50, 50]    # rows, columns, pages; even count
    assert batch.page_writes([(10, 7, [1, 2])], 8, array("q")) == -1           # past the graph's columns
