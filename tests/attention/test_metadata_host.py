"""Host-side batch packing: the device page table's queued writes and kept gather rows, packed
host-to-device copies, and decodes given as flat lists instead of one ``BatchRequest`` each."""

from __future__ import annotations

import random

import pytest
import torch

from radixrelay.attention.metadata import (BatchRequest, DecodeRows, DevicePageTable, SharedRun, build_forward_batch,
                                           build_shared_runs, consecutive, pack_on_device, to_device)

PAGE = 4


def _rows(table: DevicePageTable, lists: dict[int, list[int]]) -> list[list[int]]:
    keys = list(lists)
    gathered = table.gather(keys)
    return [gathered[i, :len(lists[k])].tolist() for i, k in enumerate(keys)]


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_page_table_batched_writes_match_the_page_lists(seed):
    """Admissions (whole lists, or a resident row's leading pages copied on the device and then their own:
    from rows admitted or copied in the same batch, released before the batch is written, or reused),
    one-page and multi-page appends, releases with writes still queued and rows reused by the next
    admission in the same batch, growth in both directions: gathers always see the lists."""
    rng = random.Random(seed)
    table = DevicePageTable("cpu", rows=2, cols=4)
    lists: dict[int, list[int]] = {}
    next_key = 0
    for _ in range(60):
        for _ in range(rng.randint(0, 3)):                      # a step's diff, queued
            action = rng.random()
            if action < 0.3 or not lists:
                pages = [rng.randrange(1000) for _ in range(rng.randint(0, 9))]
                table.admit(next_key, pages)
                lists[next_key] = pages
                next_key += 1
            elif action < 0.45:
                key = rng.choice(list(lists))
                table.release(key)
                del lists[key]
            elif action < 0.6:                                     # a prefix of a resident row's pages, then its own
                source = rng.choice(list(lists))
                shared = rng.randint(0, len(lists[source]))
                pages = [rng.randrange(1000) for _ in range(rng.randint(0, 5))]
                table.admit_shared(next_key, source, shared, pages)
                lists[next_key] = lists[source][:shared] + pages
                next_key += 1
            else:
                key = rng.choice(list(lists))
                pages = [rng.randrange(1000) for _ in range(rng.choice([1, 1, 1, 2, 5]))]
                table.append(key, pages)
                lists[key] = lists[key] + pages
        if lists:
            assert _rows(table, lists) == list(lists.values())
    assert table.table.shape[1] >= max(map(len, lists.values()), default=0)


def test_page_table_release_drops_queued_writes_of_the_row():
    table = DevicePageTable("cpu", rows=1, cols=4)
    table.admit(1, [5, 6])
    table.append(1, [7])
    table.release(1)                       # row 0 is free again, its writes never made
    table.admit(2, [9])
    assert table.table[0, :3].tolist() == [9, 0, 0]


def test_page_table_gather_rows_follow_readmission():
    """The kept row index of a repeated key list is dropped when a key leaves: re-admitted, it may
    live in another row."""
    table = DevicePageTable("cpu", rows=4, cols=4)
    for key in (1, 2, 3):
        table.admit(key, [10 * key])
    assert table.gather([3, 1]).tolist() == [[30], [10]]
    table.release(1)
    table.admit(4, [40])                   # takes row of key 1
    table.admit(1, [11, 12])               # another row
    assert table.gather([3, 1]).tolist() == [[30, 0], [11, 12]]
    assert table.gather([1, 4]).tolist() == [[11, 12], [40, 0]]


def test_pack_on_device_views_are_aligned_and_exact():
    lists = [[1, 2, 3], [], [4], list(range(7))]
    for dtype in (torch.int32, torch.int64):
        views = pack_on_device(lists, dtype, "cpu")
        assert [v.tolist() for v in views] == lists
        assert all(v.dtype == dtype and v.is_contiguous() for v in views)
        base = views[0].data_ptr()
        assert all((v.data_ptr() - base) % 16 == 0 for v in views)
    assert to_device([], torch.int64, "cpu").shape == (0,)
    assert to_device([0.5, 2.0], torch.float32, "cpu").tolist() == [0.5, 2.0]
    assert to_device([True, False], torch.bool, "cpu").tolist() == [True, False]


def test_consecutive():
    assert consecutive([]) and consecutive([7]) and consecutive([3, 4, 5])
    assert not consecutive([3, 5]) and not consecutive([0, 2, 1, 3]) and not consecutive([2, 1])


def _same_batch(a, b) -> None:
    for field in ("q_indptr", "prefix_lens", "seq_lens", "page_table", "positions", "out_slots", "logits_indices"):
        x, y = getattr(a, field), getattr(b, field)
        assert x.dtype == y.dtype and torch.equal(x, y), field
    assert (a.max_q_len, a.max_seq_len, a.num_decodes) == (b.max_q_len, b.max_seq_len, b.num_decodes)
    assert (a.cascade is None) == (b.cascade is None)
    if a.cascade is not None:
        assert torch.equal(a.cascade.kv_start, b.cascade.kv_start)
        assert a.cascade.max_own_len == b.cascade.max_own_len


@pytest.mark.parametrize("num_extends", [0, 2])
def test_decode_rows_give_the_batch_of_decode_requests(num_extends):
    extends = [BatchRequest([1, 2, 3], 5, 4), BatchRequest([8, 9], 0, 7, num_logits=3)][:num_extends]
    decodes = [BatchRequest([4, 6, 20], 9, 1), BatchRequest([5], 0, 1), BatchRequest([7, 30], 6, 1)]
    table = torch.tensor([[1, 2, 3], [8, 9, 0], [4, 6, 20], [5, 0, 0], [7, 30, 0]], dtype=torch.int32)
    table = table[2 - num_extends:] if num_extends < 2 else table
    kv_start = [4, 0][:num_extends] + [8, 0, 4]
    shared = build_shared_runs([SharedRun([0, 2], [4], 4)], "cpu")
    rows = DecodeRows([r.start for r in decodes],
                      [r.pages[r.start // PAGE] * PAGE + r.start % PAGE for r in decodes])
    for starts in (None, kv_start):
        ref = build_forward_batch(extends + decodes, PAGE, "cpu", page_table=table, num_decodes=len(decodes),
                                  kv_start=starts, decode_runs=shared if starts else None)
        flat = build_forward_batch(extends, PAGE, "cpu", page_table=table, decodes=rows,
                                   kv_start=starts, decode_runs=shared if starts else None)
        _same_batch(flat, ref)
        assert flat.num_decodes == len(decodes) and flat.out_slots[-3:].tolist() == [81, 20, 122]


def test_decode_rows_validation():
    with pytest.raises(ValueError, match="page_table"):
        build_forward_batch([], PAGE, "cpu", decodes=DecodeRows([3], [3]))
    with pytest.raises(ValueError, match="empty"):
        build_forward_batch([], PAGE, "cpu", page_table=torch.zeros(0, 1, dtype=torch.int32),
                            decodes=DecodeRows([], []))
    with pytest.raises(ValueError, match="kv_start"):
        build_forward_batch([], PAGE, "cpu", page_table=torch.zeros(1, 1, dtype=torch.int32),
                            decodes=DecodeRows([3], [3]), kv_start=[4])
    with pytest.raises(ValueError, match="slots"):
        DecodeRows([1, 2], [1])


def test_page_table_copies_a_burst_of_shared_prefixes_in_one_device_copy():
    table = DevicePageTable("cpu", rows=2, cols=4)
    prefix = list(range(100, 170))
    table.admit(0, prefix + [1])
    for key in range(1, 9):
        table.admit_shared(key, 0, len(prefix), [key + 1, key + 2])
    assert len(table._copies) == 8 and len(table._pending) == 9
    rows = table.gather(list(range(9)))
    assert rows[0, :71].tolist() == prefix + [1]
    for key in range(1, 9):
        assert rows[key, :72].tolist() == prefix + [key + 1, key + 2]
    with pytest.raises(ValueError, match="fewer than"):
        table.admit_shared(9, 3, 80, [])
