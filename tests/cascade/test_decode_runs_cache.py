"""``DecodeRunsCache``: the decode plan's device tensors are kept while (plan, decode order) repeat, a
plan received again by value (msgpack, as the worker process gets it) included; a new plan, a new order
or a member leaving the table rebuilds them, and what a rebuild checks of members' pages is exactly what
``decode_runs`` checks. Also the prefill side's common-prefix scan (slices compared in C)."""

from __future__ import annotations

import random

import msgspec
import pytest
import torch

from radixrelay.attention.metadata import build_shared_runs
from radixrelay.cascade.batch import DecodeRunsCache, _common_prefix, decode_runs
from radixrelay.protocol.cascade import CascadeGroup, CascadePlan

PS = 4
SHARED = list(range(400, 432)) + list(range(7, 39))     # two pieces of 32 consecutive ids (split_pages)
TOKENS = len(SHARED) * PS
HALF = TOKENS // 2


def table(n: int = 5) -> dict[int, list[int]]:
    return {rid: SHARED + [100 + rid] for rid in range(n)}


def one_group(rids: list[int], tokens: int = TOKENS) -> CascadePlan:
    return CascadePlan([CascadeGroup(list(rids), 0, tokens, 0)], dict.fromkeys(rids, tokens))


def two_levels(rids: list[int]) -> CascadePlan:
    return CascadePlan([CascadeGroup(list(rids), 0, HALF, 0), CascadeGroup(list(rids[:2]), HALF, HALF, 1)],
                       {rid: TOKENS if rid in rids[:2] else HALF for rid in rids})


def same_runs(got, plan, rids, pages, split=False) -> None:
    want = build_shared_runs(decode_runs(plan, rids, pages.__getitem__, PS, split), "cpu")
    for field in ("q_indptr", "q_rows", "kv_indptr", "kv_pages", "kv_lens"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    assert (got.host_rows, got.host_indptr, got.contiguous) == (want.host_rows, want.host_indptr, want.contiguous)


def test_kept_while_plan_and_order_repeat_by_value():
    pages = table()
    rids = list(pages)
    cache = DecodeRunsCache(PS, "cpu")
    plan = one_group(rids)
    first = cache.get(plan, rids, pages.__getitem__)
    for rid in rids:
        pages[rid].append(200 + rid)                 # page appends past the run change nothing
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(plan), type=CascadePlan)
    assert again is not plan and cache.get(again, list(rids), pages.__getitem__) is first
    assert cache.builds == 1 and cache.own_start == [TOKENS] * 5
    cache.release(99)                                # not a member: nothing to drop
    assert cache.get(plan, rids, pages.__getitem__) is first and cache.builds == 1


@pytest.mark.parametrize("split", [False, True])
def test_rebuilt_on_new_plan_order_or_member_release(split):
    pages = table()
    rids = list(pages)
    cache = DecodeRunsCache(PS, "cpu", split_pages=split)
    steps = [(one_group(rids), rids), (one_group(rids), rids[::-1]), (two_levels(rids), rids[::-1]),
             (one_group(rids[1:4], HALF), rids), (two_levels(rids), rids[::-1])]
    last = None
    for i, (plan, order) in enumerate(steps, start=1):
        runs = cache.get(plan, order, pages.__getitem__)
        # a run's rows are ascending: the whole group in another order is the same run (same tensors)
        assert (runs is last) == (i == 2) and cache.builds == i
        same_runs(runs, plan, order, pages, split)
        last = runs
    plan, order = steps[-1]
    # A member leaves and comes back with other pages (retracted, resumed elsewhere): the same plan and
    # order no longer hold, and the new pages are checked.
    cache.release(rids[2])
    pages[rids[2]] = list(range(500, 500 + len(SHARED) + 1))
    with pytest.raises(ValueError, match="does not hold the run's pages"):
        cache.get(plan, order, pages.__getitem__)
    pages[rids[2]] = list(SHARED) + [300]            # a new list with the same run: accepted
    cache.release(rids[2])
    runs = cache.get(plan, order, pages.__getitem__)
    assert runs is last                              # checked again, found equal: the same device tensors
    same_runs(runs, plan, order, pages, split)


def test_a_member_replaced_in_its_row_keeps_the_tensors():
    """A request leaves and another with the same run takes its row (churn under one shared prompt): the
    plan is new and checked, but its runs equal the last ones, so their device tensors (and a graph's
    group buffers, kept by identity) are kept."""
    pages = table(5)
    cache = DecodeRunsCache(PS, "cpu")
    first = cache.get(one_group([0, 1, 2]), [0, 1, 2], pages.__getitem__)
    pages[9] = list(SHARED) + [301]
    cache.release(1)
    again = cache.get(one_group([0, 9, 2]), [0, 9, 2], pages.__getitem__)
    assert again is first and cache.builds == 2
    moved = cache.get(one_group([0, 9]), [0, 9, 2], pages.__getitem__)      # fewer rows: new tensors
    assert moved is not first
    same_runs(moved, one_group([0, 9]), [0, 9, 2], pages)


def test_a_new_lead_member_is_compared_with_runs_checked_before():
    """Members checked against the previous plan's run are compared with the new lead's run once."""
    pages = table(4)
    cache = DecodeRunsCache(PS, "cpu")
    cache.get(one_group([1, 2, 3]), [1, 2, 3], pages.__getitem__)
    plan = one_group([0, 1, 2, 3])                    # rid 0 leads, never checked
    same_runs(cache.get(plan, [0, 1, 2, 3], pages.__getitem__), plan, [0, 1, 2, 3], pages)
    assert cache.builds == 2
    pages[0][1] = 99                                   # (a page list never changes in place; here it
    cache.release(0)                                   #  stands for rid 0 admitted again with other pages)
    with pytest.raises(ValueError, match="does not hold"):
        cache.get(one_group([0, 1, 2, 3]), [0, 1, 2, 3], pages.__getitem__)


def test_errors_match_decode_runs():
    pages = table(3)
    pages[2] = SHARED[:3] + [5] + SHARED[4:] + [102]
    cache = DecodeRunsCache(PS, "cpu")
    for plan in (one_group([0, 1, 2]), CascadePlan([CascadeGroup([0, 1], 2, 8, 0)], {0: 10, 1: 10}),
                 one_group([0, 1], TOKENS + 2 * PS)):
        with pytest.raises(ValueError) as want:
            decode_runs(plan, [0, 1, 2], pages.__getitem__, PS)
        with pytest.raises(ValueError) as got:
            cache.get(plan, [0, 1, 2], pages.__getitem__)
        assert str(got.value) == str(want.value)


def test_common_prefix_matches_a_plain_loop():
    rng = random.Random(0)
    for _ in range(2000):
        a = [rng.randrange(3) for _ in range(rng.randint(0, 300))]
        b = list(a)
        if a and rng.random() < 0.7:
            b[rng.randrange(len(a))] = 5
        b = b[:rng.randint(0, len(b))] + [rng.randrange(3) for _ in range(rng.randint(0, 5))]
        limit = rng.randint(0, min(len(a), len(b)))
        want = next((i for i in range(limit) if a[i] != b[i]), limit)
        assert [_common_prefix(a, b, limit, chunk) for chunk in (1, 3, 64)] == [want] * 3


def test_sibling_runs_at_the_same_page_indices_stay_apart():
    """Two problems under one system prompt: level-1 groups over the same positions, other pages. A member
    checked against one sibling's run is not taken to hold the other's."""
    pages = {rid: SHARED[:32] + [600 + 10 * (rid // 2) + i for i in range(32)] + [700 + rid] for rid in range(4)}

    def plan(first: list[int], second: list[int]) -> CascadePlan:
        rids = first + second
        return CascadePlan([CascadeGroup(rids, 0, HALF, 0), CascadeGroup(first, HALF, HALF, 1),
                            CascadeGroup(second, HALF, HALF, 1)], dict.fromkeys(rids, TOKENS))

    cache = DecodeRunsCache(PS, "cpu")
    good = plan([0, 1], [2, 3])
    same_runs(cache.get(good, [0, 1, 2, 3], pages.__getitem__), good, [0, 1, 2, 3], pages)
    swapped = plan([2, 3], [0, 1])
    same_runs(cache.get(swapped, [3, 2, 1, 0], pages.__getitem__), swapped, [3, 2, 1, 0], pages)
    with pytest.raises(ValueError, match="request 2 does not hold"):
        cache.get(plan([0, 2], [1, 3]), [0, 1, 2, 3], pages.__getitem__)
    with pytest.raises(ValueError, match="request 0 does not hold"):
        cache.get(plan([2, 0], [1, 3]), [0, 1, 2, 3], pages.__getitem__)
