"""Pinned prefixes (kept through eviction pressure until their TTL, within a budget, per salt) and request
priorities (admission order, ageing, retraction, eviction class), on the fake worker."""

from __future__ import annotations

import pytest

from radixrelay.protocol.messages import PinSpec
from radixrelay.radix.tiers import KVTiers
from radixrelay.radix.tree import RadixTree
from radixrelay.sampling_params import SamplingParams
from radixrelay.scheduler import Scheduler, SchedulerConfig
from tests.scheduler.fake_worker import FakeWorker, Run, collect, drive

SYSTEM = list(range(1000, 1032))              # 32 tokens: 8 pages of 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(kv_tokens=128, **kw):
    clock = Clock()
    cfg = SchedulerConfig(kv_cache_tokens=kv_tokens, page_size=4, **kw)
    return Scheduler(cfg, clock=clock), FakeWorker(4, cfg.num_pages), clock


def one(sched, worker, rid, prompt, max_tokens=2, **kw):
    """Run one request alone to the end; its final update."""
    sched.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens), **kw)
    return drive(sched, worker).finals[rid]


def churn(sched, worker, first_rid, n=12):
    """``n`` unrelated 40-token prompts: more than the pool holds beside the system prompt."""
    for i in range(n):
        one(sched, worker, first_rid + i, [2000 + 50 * i + j for j in range(40)])


@pytest.mark.parametrize("pinned", [False, True])
def test_pinned_prefix_survives_eviction_that_drops_an_unpinned_one(pinned):
    sched, worker, _ = make(pinned_kv_tokens=64)
    pins = [PinSpec(len(SYSTEM), 300.0)] if pinned else None
    assert one(sched, worker, 1, SYSTEM + [1, 2, 3], pins=pins).cached_tokens == 0
    churn(sched, worker, 100)
    later = one(sched, worker, 2, SYSTEM + [7, 8, 9])
    assert later.cached_tokens == (32 if pinned else 0)
    stats = sched.stats()
    assert (stats.pinned_tokens, stats.num_pins, stats.pins_created) == ((32, 1, 1) if pinned else (0, 0, 0))
    assert stats.pin_hits == (1 if pinned else 0)
    sched.check_integrity()


def test_pin_expires_after_its_ttl_and_hits_refresh_it():
    sched, worker, clock = make(pinned_kv_tokens=64, pin_ttl_scale=0.01)      # 300 s -> 3 s
    one(sched, worker, 1, SYSTEM + [1], pins=[PinSpec(32, 300.0)])
    clock.now = 2.0
    assert one(sched, worker, 2, SYSTEM + [2]).cached_tokens == 32     # a hit: expires at 5 s now
    clock.now = 4.0
    assert sched.stats().num_pins == 1
    clock.now = 5.5
    stats = sched.stats()
    assert (stats.num_pins, stats.pinned_tokens, stats.pin_expiries) == (0, 0, 1)
    churn(sched, worker, 100)
    assert one(sched, worker, 3, SYSTEM + [3]).cached_tokens == 0          # evicted like any prefix
    sched.check_integrity()


def test_budget_refuses_pins_past_it_and_same_prefix_counts_once():
    sched, worker, _ = make(pinned_kv_tokens=40)
    sched.add_request(1, SYSTEM + [1], SamplingParams(max_tokens=2), pins=[PinSpec(32, 60.0)])
    # the same prefix again (queued beside the first): one reservation
    sched.add_request(2, SYSTEM + [2], SamplingParams(max_tokens=2), pins=[PinSpec(32, 60.0)])
    with pytest.raises(ValueError, match="exceed the pinned KV budget"):
        sched.add_request(3, list(range(500, 532)) + [1], SamplingParams(max_tokens=2), pins=[PinSpec(32, 60.0)])
    drive(sched, worker)
    # a longer pin over the pinned system prompt costs only its new tokens (8 <= 40 - 32)
    sched.add_request(4, SYSTEM + list(range(9)), SamplingParams(max_tokens=2), pins=[PinSpec(40, 60.0)])
    drive(sched, worker)
    stats = sched.stats()
    assert (stats.pinned_tokens, stats.num_pins, stats.pin_refusals) == (40, 2, 1)
    assert sched.cache.pins.reserved_tokens == 0
    disabled, _, _ = make()
    with pytest.raises(ValueError, match="pinned prefixes are disabled"):
        disabled.add_request(1, SYSTEM, SamplingParams(max_tokens=2), pins=[PinSpec(32, 60.0)])
    assert disabled.num_waiting == 0


def test_pins_are_per_salt():
    sched, worker, _ = make(pinned_kv_tokens=64)
    one(sched, worker, 1, SYSTEM + [1], pins=[PinSpec(32, 300.0)], cache_salt="a")
    churn(sched, worker, 100)
    assert one(sched, worker, 2, SYSTEM + [2], cache_salt="b").cached_tokens == 0
    churn(sched, worker, 200)
    assert one(sched, worker, 3, SYSTEM + [3], cache_salt="a").cached_tokens == 32


def test_pins_yield_to_a_request_that_cannot_fit_beside_them():
    sched, worker, _ = make(kv_tokens=64, pinned_kv_tokens=64)
    one(sched, worker, 1, SYSTEM + [1], pins=[PinSpec(32, 300.0)])
    # 60 tokens + 4 outputs need the whole pool: the pin goes, the request runs
    final = one(sched, worker, 2, list(range(3000, 3060)), max_tokens=4)
    assert final.completion_tokens == 4
    stats = sched.stats()
    assert (stats.num_pins, stats.pin_yields) == (0, 1)


def test_a_pinned_prefix_stays_in_host_memory_too():
    clock = Clock()
    cfg = SchedulerConfig(kv_cache_tokens=128, page_size=4, kv_namespace="ns", pinned_kv_tokens=64,
                          pin_ttl_scale=0.01)
    tiers = KVTiers(host_pages=16)                    # 16 pages: the churn alone would evict the system prompt
    sched, worker = Scheduler(cfg, tiers=tiers, clock=clock), FakeWorker(4, cfg.num_pages)
    one(sched, worker, 1, SYSTEM + [1], pins=[PinSpec(32, 300.0)])
    pinned = list(tiers._pinned)
    assert len(pinned) == 8 == tiers.num_pinned
    churn(sched, worker, 100)
    assert all(tiers.host_state(key) == "ready" for key in pinned)
    clock.now = 10.0
    assert sched.stats().pin_expiries == 1 and tiers.num_pinned == 0
    churn(sched, worker, 200)
    assert not any(tiers.host_state(key) == "ready" for key in pinned)
    sched.check_integrity()


def test_abort_ends_a_pending_pin_reservation():
    sched, _, _ = make(pinned_kv_tokens=32)
    sched.add_request(1, SYSTEM + [1], SamplingParams(max_tokens=2), pins=[PinSpec(32, 60.0)])
    assert sched.cache.pins.reserved_tokens == 32
    sched.abort(1)
    assert sched.cache.pins.reserved_tokens == 0
    sched.add_request(2, list(range(500, 533)), SamplingParams(max_tokens=2), pins=[PinSpec(32, 60.0)])


# -- priority ---------------------------------------------------------------------------------------


def admission_order(sched, worker) -> list[int]:
    order: list[int] = []
    run = Run()
    while sched.has_work():
        plan = sched.schedule()
        order += [a.rid for a in plan.admitted if a.rid not in order]
        collect(run, sched.process_output(worker.step(plan)))
        worker.delivered(plan.step_id)
        sched.check_integrity()
    return order


def test_priority_needs_enabling():
    sched, _, _ = make()
    with pytest.raises(ValueError, match="--enable-priority"):
        sched.add_request(1, [1, 2, 3], SamplingParams(max_tokens=2), priority=1)
    sched.add_request(2, [1, 2, 3], SamplingParams(max_tokens=2), priority=0)


def test_admission_by_priority_then_prefix_under_a_full_pool():
    sched, worker, _ = make(enable_priority=True, max_running_requests=1)
    one(sched, worker, 99, [7] * 12)                                   # cached: [7] * 8 matches 8 tokens
    for rid, prio, prompt in ((1, 5, [1] * 8), (2, 0, [2] * 8), (3, 5, [7] * 9), (4, -2, [4] * 8),
                              (5, 0, [7] * 10)):
        sched.add_request(rid, prompt, SamplingParams(max_tokens=2), priority=prio)
    # by priority; within one, the longest cached prefix first (lpm), then arrival
    assert admission_order(sched, worker) == [4, 5, 2, 3, 1]


def test_admission_by_priority_when_the_kv_pool_holds_one_request_at_a_time():
    sched, worker, _ = make(kv_tokens=48, enable_priority=True)       # 12 pages; each request needs 7
    for rid, prio in ((1, 2), (2, 1), (3, 2), (4, 0)):
        sched.add_request(rid, [rid] * 24, SamplingParams(max_tokens=5), priority=prio)
    assert admission_order(sched, worker) == [4, 2, 1, 3]


def test_ageing_lifts_a_long_queued_request():
    sched, worker, clock = make(enable_priority=True, max_running_requests=1, priority_ageing_s=1.0)
    sched.add_request(1, [1] * 8, SamplingParams(max_tokens=2), priority=3)
    clock.now = 3.5                        # waited 3 levels: counts as 0, before a fresh priority 1
    sched.add_request(2, [2] * 8, SamplingParams(max_tokens=2), priority=1)
    sched.add_request(3, [3] * 8, SamplingParams(max_tokens=2), priority=0)
    assert admission_order(sched, worker) == [1, 3, 2]


def test_retraction_takes_the_lowest_priority_first():
    # 8 pages of 2: both grow until one must go back to the queue
    clock = Clock()
    cfg = SchedulerConfig(kv_cache_tokens=16, page_size=2, decode_reservation_ratio=0.0, enable_priority=True)
    sched, worker = Scheduler(cfg, clock=clock), FakeWorker(2, cfg.num_pages)
    sched.add_request(1, [1, 2, 3], SamplingParams(max_tokens=8), priority=3)      # admitted first
    sched.add_request(2, [6, 7, 8, 9, 10], SamplingParams(max_tokens=6), priority=0)
    run = Run()
    released: list[int] = []
    while sched.has_work():
        plan = sched.schedule()
        released += [r for r in plan.released if r in (1, 2) and 1 not in run.finals and 2 not in run.finals]
        collect(run, sched.process_output(worker.step(plan)))
        worker.delivered(plan.step_id)
        sched.check_integrity()
    assert sched.stats().num_retractions >= 1 and released[0] == 1     # the older but lower priority one
    assert len(run.tokens[1]) == 8 and len(run.tokens[2]) == 6


def test_eviction_spares_high_priority_nodes():
    tree = RadixTree(2)
    tree.insert([1, 2, 3, 4], [0, 1])
    tree.lock(tree.match_prefix([1, 2, 3, 4]).node, priority=-1)     # shared by a priority -1 request
    tree.lock(tree.match_prefix([1, 2, 3, 4]).node, priority=4)
    for _ in range(2):
        tree.unlock(tree.match_prefix([1, 2, 3, 4]).node)
    tree.insert([5, 6, 7, 8], [2, 3], priority=0)
    tree.match_prefix([1, 2, 3, 4])                                  # the most recently used
    assert sorted(tree.evict(2)) == [2, 3]                           # yet the priority-0 prefix goes first
    tree.check_integrity()
