"""The row-patch kernels of a changed decode batch (``scatter_pages``, ``patch_rows``) against torch
indexing on the same buffers."""

from __future__ import annotations

import pytest
import torch

from radixrelay.kernels.row_patch import patch_rows, scatter_pages
from tests.kernels.helpers import DEVICE


@pytest.mark.parametrize("n", [1, 7, 600])          # 600: three programs, a masked tail
def test_scatter_pages_writes_each_cell(n):
    gen = torch.Generator().manual_seed(n)
    table = torch.randint(0, 100, (40, 64), generator=gen, dtype=torch.int32)
    cells = torch.randperm(40 * 64, generator=gen)[:n]                   # distinct cells
    values = torch.randint(0, 1 << 30, (n,), generator=gen)
    writes = torch.stack((cells // 64, cells % 64, values))               # [3, n] rows, columns, values
    want = table.clone()
    want[writes[0], writes[1]] = values.to(torch.int32)
    got = table.to(DEVICE)
    # a strided view of a larger block, as the worker passes it (rows of one uploaded buffer)
    block = torch.zeros(3, n + 5, dtype=torch.int64)
    block[:, :n] = writes
    scatter_pages(got, block.to(DEVICE)[:, :n])
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("n, width", [(1, 3), (4, 130), (9, 64)])    # 130: two column blocks
def test_patch_rows_writes_rows_and_page_rows(n, width):
    gen = torch.Generator().manual_seed(n * width)
    stride, batch, cols = 16, 12, 160
    rows64 = torch.randint(0, 1000, (5, stride), generator=gen)
    rows32 = torch.randint(0, 1000, (3, stride), generator=gen, dtype=torch.int32)
    page_table = torch.randint(0, 1000, (batch, cols), generator=gen, dtype=torch.int32)
    source = torch.randint(0, 1000, (30, cols), generator=gen, dtype=torch.int32)
    patch = torch.randint(0, 1 << 20, (9, n), generator=gen)
    patch[0] = torch.randperm(batch, generator=gen)[:n]                   # distinct graph rows
    patch[4] = torch.randint(0, 30, (n,), generator=gen)                  # page-table rows of ``source``
    want64, want32, want_pt = rows64.clone(), rows32.clone(), page_table.clone()
    want64[:, patch[0]] = patch[1:6]
    want32[:, patch[0]] = patch[6:9].to(torch.int32)
    want_pt[patch[0], :width] = source[patch[4], :width]
    got = [t.to(DEVICE) for t in (rows64, rows32, page_table)]
    patch_rows(*got, source.to(DEVICE), patch.to(DEVICE), width)
    for g, w in zip(got, (want64, want32, want_pt)):
        assert torch.equal(g.cpu(), w)


def test_patch_kernels_reject_bad_buffers():
    i64 = torch.zeros(5, 4, dtype=torch.int64, device=DEVICE)
    i32 = torch.zeros(3, 4, dtype=torch.int32, device=DEVICE)
    table = torch.zeros(4, 8, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="writes"):
        scatter_pages(table, torch.zeros(2, 4, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="table"):
        scatter_pages(table.long(), torch.zeros(3, 4, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="patch"):
        patch_rows(i64, i32, table, table, torch.zeros(8, 2, dtype=torch.int64, device=DEVICE), 4)
    with pytest.raises(ValueError, match="width"):
        patch_rows(i64, i32, table, table, torch.zeros(9, 2, dtype=torch.int64, device=DEVICE), 9)


def test_bound_scatter_and_patch_match_the_functions_step_after_step():
    """``PageScatter`` and ``RowPatcher`` (bound once, each call one launch) write what the functions write,
    over calls whose counts, widths and source tables change (on CUDA: the bound launch reused)."""
    from radixrelay.kernels.row_patch import PageScatter, RowPatcher

    gen = torch.Generator().manual_seed(11)
    table = torch.randint(0, 100, (48, 160), generator=gen, dtype=torch.int32).to(DEVICE)   # a row per graph row
    rows64 = torch.randint(0, 100, (5, 48), generator=gen).to(DEVICE)
    rows32 = torch.randint(0, 100, (3, 48), generator=gen, dtype=torch.int32).to(DEVICE)
    bound, free = [t.clone() for t in (table, rows64, rows32)], [t.clone() for t in (table, rows64, rows32)]
    scatter, patcher = PageScatter(bound[0]), RowPatcher(bound[1], bound[2], bound[0])
    for step, (n, width) in enumerate(((5, 3), (600, 130), (1, 160), (0, 0), (9, 64))):
        cells = torch.randperm(40 * 160, generator=gen)[:n]
        writes = torch.stack((cells // 160, cells % 160, torch.randint(0, 1 << 30, (n,), generator=gen))).to(DEVICE)
        scatter(writes)
        scatter_pages(free[0], writes)
        k = min(n, 12)
        patch = torch.randint(0, 40, (9, k), generator=gen)
        patch[0] = torch.randperm(48, generator=gen)[:k]                  # distinct graph rows
        source = torch.randint(0, 1000, (40, 200), generator=gen, dtype=torch.int32).to(DEVICE)
        patcher(source, patch.to(DEVICE), width)
        patch_rows(free[1], free[2], free[0], source, patch.to(DEVICE), width)
        for got, want in zip(bound, free):
            assert torch.equal(got, want), step
    with pytest.raises(ValueError, match="writes"):
        scatter(torch.zeros(2, 4, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="width"):
        patcher(source, patch.to(DEVICE), 161)
