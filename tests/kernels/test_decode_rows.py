"""The decode-row advance kernel (one step forward of fixed row buffers) against its torch reference."""

from __future__ import annotations

import pytest
import torch

from radixrelay.kernels.decode_rows import advance_decode_rows, advance_decode_rows_reference
from tests.kernels.helpers import DEVICE


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("num, rows", [(1, 1), (5, 8), (300, 320)])     # 300: two programs, a masked tail
def test_advance_matches_reference(page_size, num, rows):
    gen = torch.Generator().manual_seed(num * page_size)
    width = 40
    table = torch.randint(0, 1000, (rows, width), generator=gen, dtype=torch.int32).to(DEVICE)
    # each row's next position still inside its page list, some of them crossing into a new page
    positions = torch.randint(0, width * page_size - 1, (rows,), generator=gen).to(DEVICE)
    prefix, seq = torch.full((rows,), -7, dtype=torch.int32, device=DEVICE), torch.full((rows,), -7, dtype=torch.int32,
                                                                                       device=DEVICE)
    slots = torch.full((rows,), -7, dtype=torch.int64, device=DEVICE)
    before = positions.clone()
    want = advance_decode_rows_reference(before, table, num, page_size)
    advance_decode_rows(positions, prefix, seq, slots, table, num, page_size)
    for got, ref in zip((positions, prefix, seq, slots), want):
        assert torch.equal(got[:num], ref)
    # rows past num (padding) are untouched
    assert torch.equal(positions[num:], before[num:])
    assert (prefix[num:] == -7).all() and (seq[num:] == -7).all() and (slots[num:] == -7).all()


def test_advance_rejects_bad_buffers():
    table = torch.zeros(4, 8, dtype=torch.int32, device=DEVICE)
    i32 = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    i64 = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="positions"):
        advance_decode_rows(i32, i32, i32, i64, table, 2, 4)
    with pytest.raises(ValueError, match="page_table"):
        advance_decode_rows(i64, i32, i32, i64, table.long(), 2, 4)
    with pytest.raises(ValueError, match="seq_lens"):
        advance_decode_rows(i64, i32, i32[:1], i64, table, 2, 4)


@pytest.mark.parametrize("num, rows", [(1, 1), (5, 8), (300, 320)])
def test_advance_gathers_each_rows_newest_token(num, rows):
    """With ``ids``, the same launch writes ids[r] = tokens[token_rows[r]] for rows < num, nothing past."""
    gen = torch.Generator().manual_seed(num)
    table = torch.randint(0, 1000, (rows, 8), generator=gen, dtype=torch.int32).to(DEVICE)
    positions = torch.randint(0, 30, (rows,), generator=gen).to(DEVICE)
    prefix, seq = (torch.zeros(rows, dtype=torch.int32, device=DEVICE) for _ in range(2))
    slots = torch.zeros(rows, dtype=torch.int64, device=DEVICE)
    tokens = torch.randint(0, 50_000, (500,), generator=gen).to(DEVICE)
    token_rows = torch.randint(0, 500, (rows,), generator=gen).to(DEVICE)
    ids = torch.full((rows,), -1, dtype=torch.int64, device=DEVICE)
    want = advance_decode_rows_reference(positions.clone(), table, num, 4)
    advance_decode_rows(positions, prefix, seq, slots, table, num, 4, ids=ids, tokens=tokens, token_rows=token_rows)
    assert torch.equal(ids[:num], tokens[token_rows[:num]]) and (ids[num:] == -1).all()
    for got, ref in zip((positions, prefix, seq, slots), want):
        assert torch.equal(got[:num], ref)
    with pytest.raises(ValueError, match="together"):
        advance_decode_rows(positions, prefix, seq, slots, table, num, 4, ids=ids)


def test_bound_advance_matches_the_function_step_after_step():
    """``RowAdvance`` (buffers bound once, each call one launch) makes the same rows as the function, over
    steps whose row count and newest-token table change (on CUDA: the launch bound at the first call is
    reused with a new count, grid and table)."""
    from radixrelay.kernels.decode_rows import RowAdvance

    gen = torch.Generator().manual_seed(3)
    rows, width, page_size = 320, 40, 4
    table = torch.randint(0, 1000, (rows, width), generator=gen, dtype=torch.int32).to(DEVICE)
    start = torch.randint(0, 60, (rows,), generator=gen).to(DEVICE)
    token_rows = torch.randint(0, 500, (rows,), generator=gen).to(DEVICE)

    def buffers():
        return (start.clone(), torch.zeros(rows, dtype=torch.int32, device=DEVICE),
                torch.zeros(rows, dtype=torch.int32, device=DEVICE), torch.zeros(rows, dtype=torch.int64, device=DEVICE),
                torch.full((rows,), -1, dtype=torch.int64, device=DEVICE))

    bound, free = buffers(), buffers()
    advance = RowAdvance(*bound[:4], table, page_size, bound[4], token_rows, rows)
    for step, num in enumerate((300, 300, 7, 1, 0, 320)):
        tokens = torch.randint(0, 50_000, (500 + step,), generator=gen).to(DEVICE)   # a new table each step
        advance(num, tokens)
        pos, pre, seq, slots, ids = free
        advance_decode_rows(pos, pre, seq, slots, table, num, page_size, ids=ids, tokens=tokens, token_rows=token_rows)
        for got, want in zip(bound, free):
            assert torch.equal(got, want), step
    with pytest.raises(ValueError, match="321 rows"):
        advance(321, tokens)
    with pytest.raises(ValueError, match="tokens"):
        advance(2, tokens.int())
