"""Small scatters of a changed decode batch, one launch each (``radixrelay.worker.cuda_graphs``: a decode
step whose rows changed patches them in place; ``DevicePageTable``: page-list writes of a step).

API::

    scatter_pages(table, writes)
        table:  int32 [R, C], unit column stride
        writes: int64 [3, n] (any row stride, unit column stride): rows, columns, values;
                table[rows[i], columns[i]] = values[i]

    patch_rows(rows64, rows32, page_table, source, patch, width)
        rows64:     int64 [5, S] } per-row blocks of a decode graph, unit column stride: which field each
        rows32:     int32 [3, S] } row holds is ``radixrelay.worker.device_batch.ROWS`` (defined there only)
        page_table: int32 [B, W] the graph's page table, unit column stride
        source:     int32 [R, C] page lists of resident requests (``DevicePageTable``), unit column stride
        patch:      int64 [9, n] (any row stride, unit column stride): per patched row its graph row,
                    then its 5 rows64 values and its 3 rows32 values (``device_batch.patch_values``)
        width:      columns copied: page_table[row, :width] = source[its ``ROWS.page_rows`` value, :width]
                    (rows64 row 3: patch row 4)

    PageScatter(table), RowPatcher(rows64, rows32, page_table)
        the same bound to one table (a decode graph's, ``DevicePageTable``'s), checked once: a step pays
        one launch each, no per-call argument checks or binding (``KernelLaunch``)

Both take a host-built buffer that reached the device in one copy; ``n`` and ``width`` vary per step and
are not specialised (no compilation while serving). On the CPU without ``TRITON_INTERPRET=1`` the same
writes run as torch ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixrelay.kernels._common import KernelLaunch, check, torch_fallback

BLOCK = 256          # writes per program (scatter_pages)
BLOCK_W = 128        # page-table columns per iteration (patch_rows)


@triton.jit(do_not_specialize=["num", "stride_w", "stride_t"])
def _scatter_kernel(table, writes, num, stride_w, stride_t, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < num
    row = tl.load(writes + i, mask=ok, other=0)
    col = tl.load(writes + stride_w + i, mask=ok, other=0)
    val = tl.load(writes + 2 * stride_w + i, mask=ok, other=0)
    tl.store(table + row * stride_t + col, val.to(tl.int32), mask=ok)


@triton.jit(do_not_specialize=["stride_p", "width", "stride64", "stride32", "stride_pt", "stride_src"])
def _patch_kernel(rows64, rows32, page_table, source, patch, stride_p, width, stride64, stride32, stride_pt,
                  stride_src, BLOCK_W: tl.constexpr):
    p = tl.program_id(0)                       # one patched row per program
    row = tl.load(patch + p)
    for k in tl.static_range(5):
        tl.store(rows64 + k * stride64 + row, tl.load(patch + (1 + k) * stride_p + p))
    for k in tl.static_range(3):
        tl.store(rows32 + k * stride32 + row, tl.load(patch + (6 + k) * stride_p + p).to(tl.int32))
    src = tl.load(patch + 4 * stride_p + p)    # its page-table row value: the row of ``source``
    for start in range(0, width, BLOCK_W):
        cols = start + tl.arange(0, BLOCK_W)
        ok = cols < width
        pages = tl.load(source + src * stride_src + cols, mask=ok, other=0)
        tl.store(page_table + row * stride_pt + cols, pages, mask=ok)


def _check_table(name: str, t: torch.Tensor) -> None:
    check(t.dim() == 2 and t.dtype == torch.int32 and t.stride(1) == 1,
          f"{name} must be int32 [rows, columns] with unit column stride")


def _check_block(name: str, t: torch.Tensor, rows: int, dtype: torch.dtype) -> None:
    if not (t.dim() == 2 and t.shape[0] == rows and t.dtype == dtype and t.stride(1) == 1):
        raise ValueError(f"{name} must be {dtype} [{rows}, n] with unit column stride, got {t.dtype} {tuple(t.shape)}")


def scatter_pages(table: torch.Tensor, writes: torch.Tensor) -> None:
    """See the module docstring."""
    _check_table("scatter_pages: table", table)
    _check_block("scatter_pages: writes", writes, 3, torch.int64)
    num = writes.shape[1]
    if num == 0:
        return
    if torch_fallback(table):
        table.index_put_((writes[0], writes[1]), writes[2].to(torch.int32))
        return
    _scatter_kernel[(triton.cdiv(num, BLOCK),)](table, writes, num, writes.stride(0), table.stride(0),
                                                BLOCK=BLOCK, num_warps=4)


def patch_rows(rows64: torch.Tensor, rows32: torch.Tensor, page_table: torch.Tensor, source: torch.Tensor,
               patch: torch.Tensor, width: int) -> None:
    """See the module docstring."""
    for name, t, rows, dtype in (("rows64", rows64, 5, torch.int64), ("rows32", rows32, 3, torch.int32),
                                 ("patch", patch, 9, torch.int64)):
        _check_block(f"patch_rows: {name}", t, rows, dtype)
    for name, t in (("page_table", page_table), ("source", source)):
        _check_table(f"patch_rows: {name}", t)
    if not 0 <= width <= min(page_table.shape[1], source.shape[1]):
        raise ValueError(f"patch_rows: width {width} past the tables' columns")
    num = patch.shape[1]
    if num == 0:
        return
    if torch_fallback(rows64):
        rows = patch[0]
        rows64.index_copy_(1, rows, patch[1:6])
        rows32.index_copy_(1, rows, patch[6:9].to(torch.int32))
        page_table[:, :width].index_copy_(0, rows, source[:, :width].index_select(0, patch[4]))
        return
    _patch_kernel[(num,)](rows64, rows32, page_table, source, patch, patch.stride(0), width, rows64.stride(0),
                          rows32.stride(0), page_table.stride(0), source.stride(0), BLOCK_W=BLOCK_W, num_warps=1)


class PageScatter:
    """``scatter_pages`` into one table (fixed for this object's life), checked once: a call checks only the
    write block's layout and pays one launch."""

    def __init__(self, table: torch.Tensor) -> None:
        _check_table("PageScatter: table", table)
        self.table = table
        self._launch = None if torch_fallback(table) else KernelLaunch(_scatter_kernel, (1,), dict(
            table=table, writes=table, num=0, stride_w=0, stride_t=table.stride(0), BLOCK=BLOCK), dict(num_warps=4))

    def __call__(self, writes: torch.Tensor) -> None:
        if self._launch is None:
            scatter_pages(self.table, writes)
            return
        _check_block("PageScatter: writes", writes, 3, torch.int64)
        num = writes.shape[1]
        if num:
            self._launch((triton.cdiv(num, BLOCK),), writes=writes, num=num, stride_w=writes.stride(0))


class RowPatcher:
    """``patch_rows`` into one decode graph's row blocks and page table (fixed for this object's life),
    checked once: a call checks the patch block and the source table's layout and pays one launch."""

    def __init__(self, rows64: torch.Tensor, rows32: torch.Tensor, page_table: torch.Tensor) -> None:
        _check_block("RowPatcher: rows64", rows64, 5, torch.int64)
        _check_block("RowPatcher: rows32", rows32, 3, torch.int32)
        _check_table("RowPatcher: page_table", page_table)
        self._buffers = rows64, rows32, page_table
        self._launch = None if torch_fallback(rows64) else KernelLaunch(_patch_kernel, (1,), dict(
            rows64=rows64, rows32=rows32, page_table=page_table, source=page_table, patch=rows64, stride_p=0,
            width=0, stride64=rows64.stride(0), stride32=rows32.stride(0), stride_pt=page_table.stride(0),
            stride_src=0, BLOCK_W=BLOCK_W), dict(num_warps=1))

    def __call__(self, source: torch.Tensor, patch: torch.Tensor, width: int) -> None:
        rows64, rows32, page_table = self._buffers
        if self._launch is None:
            patch_rows(rows64, rows32, page_table, source, patch, width)
            return
        _check_block("RowPatcher: patch", patch, 9, torch.int64)
        _check_table("RowPatcher: source", source)
        if not 0 <= width <= min(page_table.shape[1], source.shape[1]):
            raise ValueError(f"RowPatcher: width {width} past the tables' columns")
        num = patch.shape[1]
        if num:
            self._launch((num,), source=source, patch=patch, stride_p=patch.stride(0), width=width,
                         stride_src=source.stride(0))
