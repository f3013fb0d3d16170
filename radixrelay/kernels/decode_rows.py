"""One decode step forward for fixed per-row buffers, in one launch: the device-side half of a repeated
decode batch (``radixrelay.worker.cuda_graphs``: a step whose rows are the previous step's rows, in the
same order, each one token further).

API::

    advance_decode_rows(positions, prefix_lens, seq_lens, out_slots, page_table, num, page_size,
                        ids=None, tokens=None, token_rows=None)

    positions:   int64 [>= num]  position of each row's token; becomes position + 1
    prefix_lens: int32 [>= num]  becomes the new position (tokens before the new one)
    seq_lens:    int32 [>= num]  becomes the new position + 1
    out_slots:   int64 [>= num]  becomes the KV slot of the new position:
                                 page_table[row, pos // page_size] * page_size + pos % page_size
    page_table:  int32 [R >= num, W], row stride W, unit column stride (pages of row r's request)
    ids:         optional int64 [>= num]: becomes tokens[token_rows] (each row's newest token, gathered
                 in the same launch); tokens int64 [T], token_rows int64 [>= num], both contiguous

    RowAdvance(positions, prefix_lens, seq_lens, out_slots, page_table, page_size, ids, token_rows)
        the same bound to one set of row buffers (a decode graph's: views of its row blocks, whose fields
        ``radixrelay.worker.device_batch.ROWS`` defines), checked once; each step calls
        ``advance(num, tokens)``: one launch, no per-call argument binding (``KernelLaunch``)

Rows ``num`` and beyond are not touched (padded rows keep their values). The caller guarantees that
each row's page list holds the new position (``pos // page_size < W`` and the page written there): the
kernel reads the page table without bounds checks, as the attention kernels do. On the CPU without
``TRITON_INTERPRET=1`` (no Triton driver) the same update runs as torch ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixrelay.kernels._common import KernelLaunch, check, torch_fallback

BLOCK = 256


# num varies per step; not specialised (radixrelay.worker.warmup: no compiles after ready).
@triton.jit(do_not_specialize=["num"])
def _advance_kernel(positions, prefix_lens, seq_lens, out_slots, page_table, num, stride_pt, ids, tokens,
                    token_rows, PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr, GATHER: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < num
    if GATHER:
        tl.store(ids + rows, tl.load(tokens + tl.load(token_rows + rows, mask=ok, other=0), mask=ok), mask=ok)
    pos = tl.load(positions + rows, mask=ok, other=0) + 1                 # int64
    page = tl.load(page_table + rows.to(tl.int64) * stride_pt + pos // PAGE_SIZE, mask=ok, other=0)
    tl.store(positions + rows, pos, mask=ok)
    tl.store(prefix_lens + rows, pos.to(tl.int32), mask=ok)
    tl.store(seq_lens + rows, (pos + 1).to(tl.int32), mask=ok)
    tl.store(out_slots + rows, page.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE, mask=ok)


def _check_rows(positions: torch.Tensor, prefix_lens: torch.Tensor, seq_lens: torch.Tensor, out_slots: torch.Tensor,
                page_table: torch.Tensor, num: int, page_size: int, ids: torch.Tensor | None,
                token_rows: torch.Tensor | None) -> None:
    buffers = [("positions", positions, torch.int64), ("prefix_lens", prefix_lens, torch.int32),
               ("seq_lens", seq_lens, torch.int32), ("out_slots", out_slots, torch.int64)]
    if ids is not None:
        buffers += [("ids", ids, torch.int64), ("token_rows", token_rows, torch.int64)]
    for name, t, dtype in buffers:
        if not (t.dim() == 1 and t.dtype == dtype and t.stride(0) == 1 and t.numel() >= num):
            raise ValueError(f"advance_decode_rows: {name} must be contiguous {dtype} [>= {num}], got {t.dtype} "
                             f"{tuple(t.shape)}")
    check(page_table.dim() == 2 and page_table.dtype == torch.int32 and page_table.stride(1) == 1
          and page_table.shape[0] >= num,
          "advance_decode_rows: page_table must be int32 [>= num, W] with unit column stride")
    check(page_size >= 1, "advance_decode_rows: page_size must be >= 1")


def _check_tokens(tokens: torch.Tensor) -> None:
    check(tokens.dim() == 1 and tokens.dtype == torch.int64 and tokens.stride(0) == 1,
          "advance_decode_rows: tokens must be contiguous int64 [T]")


def advance_decode_rows(positions: torch.Tensor, prefix_lens: torch.Tensor, seq_lens: torch.Tensor,
                        out_slots: torch.Tensor, page_table: torch.Tensor, num: int, page_size: int, *,
                        ids: torch.Tensor | None = None, tokens: torch.Tensor | None = None,
                        token_rows: torch.Tensor | None = None) -> None:
    """See the module docstring."""
    gather = ids is not None
    check(gather == (tokens is not None) == (token_rows is not None),
          "advance_decode_rows: ids, tokens and token_rows go together")
    _check_rows(positions, prefix_lens, seq_lens, out_slots, page_table, num, page_size, ids, token_rows)
    if gather:
        _check_tokens(tokens)
    if num > 0 and torch_fallback(positions):
        pos, prefix, seq, slots = advance_decode_rows_reference(positions, page_table, num, page_size)
        for t, v in ((positions, pos), (prefix_lens, prefix), (seq_lens, seq), (out_slots, slots)):
            t[:num] = v
        if gather:
            torch.index_select(tokens, 0, token_rows[:num], out=ids[:num])
    elif num > 0:
        _advance_kernel[(triton.cdiv(num, BLOCK),)](positions, prefix_lens, seq_lens, out_slots, page_table, num,
                                                  page_table.stride(0), ids if gather else positions,
                                                  tokens if gather else positions,
                                                  token_rows if gather else positions, PAGE_SIZE=page_size,
                                                  BLOCK=BLOCK, GATHER=gather, num_warps=4)


class RowAdvance:
    """``advance_decode_rows`` with newest-token gathering, bound to one set of row buffers (a decode graph's:
    fixed for its life), so that a step pays one launch and no argument checks or binding. The buffers are
    checked here for ``capacity`` rows; ``tokens`` (the newest-token table, replaced when it grows) is
    checked when it changes."""

    def __init__(self, positions: torch.Tensor, prefix_lens: torch.Tensor, seq_lens: torch.Tensor,
                 out_slots: torch.Tensor, page_table: torch.Tensor, page_size: int, ids: torch.Tensor,
                 token_rows: torch.Tensor, capacity: int) -> None:
        _check_rows(positions, prefix_lens, seq_lens, out_slots, page_table, capacity, page_size, ids, token_rows)
        self.capacity, self.page_size = capacity, page_size
        self._buffers = (positions, prefix_lens, seq_lens, out_slots, page_table, ids, token_rows)
        self._tokens: torch.Tensor | None = None
        self._launch = None if torch_fallback(positions) else KernelLaunch(_advance_kernel, (1,), dict(
            positions=positions, prefix_lens=prefix_lens, seq_lens=seq_lens, out_slots=out_slots,
            page_table=page_table, num=capacity, stride_pt=page_table.stride(0), ids=ids, tokens=ids,
            token_rows=token_rows, PAGE_SIZE=page_size, BLOCK=BLOCK, GATHER=True), dict(num_warps=4))

    def __call__(self, num: int, tokens: torch.Tensor) -> None:
        """Advance rows ``[0, num)`` one token; ``ids[i] = tokens[token_rows[i]]``."""
        if not 0 <= num <= self.capacity:
            raise ValueError(f"RowAdvance: {num} rows, bound for {self.capacity}")
        if tokens is not self._tokens:
            _check_tokens(tokens)
            self._tokens = tokens
        if num == 0:
            return
        if self._launch is None:
            positions, prefix_lens, seq_lens, out_slots, page_table, ids, token_rows = self._buffers
            advance_decode_rows(positions, prefix_lens, seq_lens, out_slots, page_table, num, self.page_size,
                                ids=ids, tokens=tokens, token_rows=token_rows)
            return
        self._launch((triton.cdiv(num, BLOCK),), num=num, tokens=tokens)


def advance_decode_rows_reference(positions: torch.Tensor, page_table: torch.Tensor, num: int,
                                  page_size: int) -> tuple[torch.Tensor, ...]:
    """(positions, prefix_lens, seq_lens, out_slots) of the first ``num`` rows after the step."""
    pos = positions[:num] + 1
    page = page_table[:num].gather(1, (pos // page_size).view(-1, 1)).view(-1).long()
    return pos, pos.int(), (pos + 1).int(), page * page_size + pos % page_size
