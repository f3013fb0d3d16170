"""Pages freed while steps are in flight cool until those steps are processed (``CacheManager``), and
a promotion from host memory into cool pages starts its loads at once (``KVTransfers.loads_start_now``),
beside the steps queued before it; one that had to take cooling pages waits for those steps."""

from __future__ import annotations

import pytest

from radixrelay.protocol.kv import KVAcks
from radixrelay.protocol.step import StepOutput
from radixrelay.radix.tiers import KVTiers
from radixrelay.sampling_params import SamplingParams
from radixrelay.scheduler import Scheduler, SchedulerConfig

PS = 4
HISTORY = [5, 6, 7, 8] * 8                  # 8 whole pages


def _scheduler(num_pages: int) -> Scheduler:
    cfg = SchedulerConfig(kv_cache_tokens=num_pages * PS, page_size=PS, kv_namespace="ns",
                          chunked_prefill_tokens=8)
    sched = Scheduler(cfg, tiers=KVTiers(host_pages=64))
    # the history: computed, saved to host memory (acknowledged), then dropped from the device
    cache_prompt(sched, 0, HISTORY + [1])
    assert sched.flush_cache()
    return sched


def cache_prompt(sched: Scheduler, rid: int, prompt: list[int]) -> None:
    """``prompt`` computed (one token out), its pages cached and saved to host memory (acknowledged)."""
    sched.add_request(rid, prompt, SamplingParams(max_tokens=1))
    while True:
        plan = sched.schedule()
        sampled = [e.rid for e in plan.extends if e.sample]
        sched.process_output(StepOutput(plan.step_id, sampled, [2] * len(sampled)))
        if sampled:
            break
    plan = sched.schedule()
    assert plan.transfers is not None and plan.transfers.saves
    sched.process_output(StepOutput(plan.step_id, [], [], kv_acks=KVAcks(saved_steps=[plan.step_id])))
    assert not sched.has_work()


@pytest.mark.parametrize("num_pages, start_now", [(24, True), (16, False)])
def test_loads_start_now_only_into_pages_no_step_in_flight_writes(num_pages, start_now):
    sched = _scheduler(num_pages)
    cache = sched.cache
    # a prompt of 10 pages mid-prefill: its first chunk is in flight when it is aborted
    sched.add_request(1, [9] * 40, SamplingParams(max_tokens=4))
    in_flight = sched.schedule()
    own = list(cache.allocator.free_pages())
    sched.abort(1)
    cooling = set(range(num_pages)) - set(own)
    assert len(cooling) == 10 and cooling.isdisjoint(cache.allocator.free_pages())
    assert cache.num_free_pages == num_pages and sched.stats().kv_free_pages == num_pages
    sched.check_integrity()

    # a later turn of the history arrives: promoted from host memory while that chunk is in flight
    sched.add_request(2, HISTORY + [1, 2, 3], SamplingParams(max_tokens=2))
    plan = sched.schedule()
    assert [a.rid for a in plan.admitted] == [2]
    loads = plan.transfers.loads
    loaded = {page for _, page in loads}
    assert len(loads) == 8 and loaded == set(plan.admitted[0].pages[:8])
    # 24 pages: 14 free, the 8 loaded into come from them; 16 pages: only 6 free, so the cooling pages
    # (which the aborted chunk in flight may still write) joined the pool and the loads wait for it
    assert plan.transfers.loads_start_now is start_now
    assert bool(loaded & cooling) is not start_now
    assert sched.stats().tier_loaded_at_once_pages == (8 if start_now else 0)
    sched.check_integrity()

    sched.process_output(StepOutput(in_flight.step_id, [], []))
    assert cache.num_free_pages == cache.allocator.num_free       # nothing cools once it is processed
    sched.check_integrity()


def test_pages_freed_with_nothing_in_flight_are_free_at_once():
    sched = _scheduler(24)
    sched.add_request(1, [9] * 40, SamplingParams(max_tokens=4))
    plan = sched.schedule()
    sched.process_output(StepOutput(plan.step_id, [], []))
    sched.abort(1)
    assert sched.cache.allocator.num_free == 24
    sched.check_integrity()


def test_a_flush_while_a_step_is_in_flight_cools_the_pages_it_drops():
    """``flush_cache`` goes through the cache manager: the cached pages it drops while a step that may
    read them is in flight cool like any freed page, free once that step is processed."""
    sched = Scheduler(SchedulerConfig(kv_cache_tokens=24 * PS, page_size=PS, kv_namespace="ns",
                                      chunked_prefill_tokens=8), tiers=KVTiers(host_pages=64))
    cache_prompt(sched, 0, HISTORY + [1])
    cached = set(range(24)) - set(sched.cache.allocator.free_pages())
    assert len(cached) >= 8
    sched.add_request(1, HISTORY + [1, 2, 3], SamplingParams(max_tokens=2))
    in_flight = sched.schedule()                       # reads the cached history
    sched.abort(1)
    assert sched.flush_cache()
    assert cached.isdisjoint(sched.cache.allocator.free_pages())      # cooling, not handed out
    assert sched.cache.num_free_pages == 24
    sched.check_integrity()
    sched.process_output(StepOutput(in_flight.step_id, [], []))
    assert cached <= set(sched.cache.allocator.free_pages())
