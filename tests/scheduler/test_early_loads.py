"""Loads that start before admission (``Scheduler.early_loads``): while steps are in flight, a queued request's
pages in host memory are loaded at once, in a plan of transfers alone; its admission then finds them on the
device. Into free pages or evicted cache, never cooling pages, beyond the running requests' decode reservation,
once per request."""

from __future__ import annotations

from radixrelay.protocol.kv import KVAcks
from radixrelay.protocol.step import StepOutput
from radixrelay.sampling_params import SamplingParams
from tests.scheduler.test_cool_pages import HISTORY, _scheduler, cache_prompt

LATER_TURN = HISTORY + [1, 2, 3]           # 8 pages of history in host memory, then new tokens


def _running_step(sched):
    """A request decoding, one of its steps in flight."""
    sched.add_request(1, [9] * 8, SamplingParams(max_tokens=20))
    sched.process_output(StepOutput(sched.schedule().step_id, [1], [4]))
    plan = sched.schedule()
    assert plan.decodes == [1]
    return plan


def test_a_queued_turn_loads_its_history_beside_the_step_in_flight():
    sched = _scheduler(24)
    in_flight = _running_step(sched)
    sched.add_request(2, LATER_TURN, SamplingParams(max_tokens=2))
    plan = sched.early_loads()
    assert plan is not None and not plan.extends and not plan.decodes and not plan.admitted
    assert len(plan.transfers.loads) == 8 and plan.transfers.loads_start_now
    assert sched.num_in_flight == 2 and sched.num_row_steps_in_flight == 1
    assert sched.num_waiting == 1                       # still queued, holding nothing
    assert sched.stats().tier_early_load_tokens == 32 == sched.stats().tier_host_hit_tokens
    sched.check_integrity()
    assert sched.early_loads() is None                  # once per request

    sched.process_output(StepOutput(in_flight.step_id, [1], [4]))
    sched.process_output(StepOutput(plan.step_id, [], []))
    admitting = sched.schedule()
    assert [a.rid for a in admitting.admitted] == [2]
    assert admitting.transfers is None or not admitting.transfers.loads      # on the device already
    assert admitting.admitted[0].pages[:8] == [page for _, page in plan.transfers.loads]
    [extend] = [e for e in admitting.extends if e.rid == 2]
    assert extend.start == 32 and extend.num_tokens == 3                     # only the new tokens computed
    sched.check_integrity()


def test_nothing_loads_early_without_a_step_in_flight_or_free_pages():
    sched = _scheduler(24)
    sched.add_request(2, LATER_TURN, SamplingParams(max_tokens=2))
    assert sched.early_loads() is None                  # nothing in flight: the next plan admits it

    sched = _scheduler(10)                              # 7 free pages once the decoding request runs
    _running_step(sched)
    free = sched.cache.allocator.num_free
    sched.add_request(2, LATER_TURN, SamplingParams(max_tokens=2))
    plan = sched.early_loads()
    # what is free beyond the running request's decode reservation (1 page): the history's first 6 pages
    assert free == 7 and len(plan.transfers.loads) == 6
    assert sched.cache.allocator.num_free == free - len(plan.transfers.loads)
    sched.check_integrity()

    sched = _scheduler(10)
    _running_step(sched)
    sched.add_request(3, [7] * 20, SamplingParams(max_tokens=2))      # queued first: no history anywhere
    sched.add_request(2, LATER_TURN, SamplingParams(max_tokens=4))
    sched.add_request(4, LATER_TURN, SamplingParams(max_tokens=2))
    loads = sched.early_loads().transfers.loads
    assert sched.early_loads() is None                  # every queued request looked at once
    assert len({page for _, page in loads}) == len(loads) <= 8   # the history loaded once, into free pages


def test_early_loads_evict_cache_but_never_take_cooling_pages():
    sched = _scheduler(16)
    # cached but unlocked: 6 pages of another prompt (computed, saved), then a decoding request, a step in flight
    cache_prompt(sched, 5, [3] * 24 + [1])
    in_flight = _running_step(sched)
    sched.add_request(6, [8] * 12, SamplingParams(max_tokens=8))           # mid-prefill, then aborted
    chunk = sched.schedule()
    own = set(chunk.admitted[0].pages)
    sched.abort(6)                                      # its pages cool while ``chunk`` is in flight
    assert own.isdisjoint(sched.cache.allocator.free_pages())
    evictable = sched.cache.tree.evictable_pages
    assert evictable >= 6
    sched.add_request(2, LATER_TURN, SamplingParams(max_tokens=2))
    plan = sched.early_loads()
    loaded = {page for _, page in plan.transfers.loads}
    assert len(loaded) == 8 and plan.transfers.loads_start_now
    assert loaded.isdisjoint(own)                       # never the cooling pages
    assert sched.cache.tree.evictable_pages < evictable + len(loaded)     # cache was evicted for them
    sched.check_integrity()
    sched.process_output(StepOutput(in_flight.step_id, [1], [4]))
    sched.process_output(StepOutput(chunk.step_id, [], []))
    sched.process_output(StepOutput(plan.step_id, [], []))
    sched.check_integrity()


def _done(sched, plan, rids=(), tokens=()):
    """``plan``'s output, its saves (if any) acknowledged."""
    saved = [plan.step_id] if plan.transfers is not None and plan.transfers.saves else []
    sched.process_output(StepOutput(plan.step_id, list(rids), list(tokens), kv_acks=KVAcks(saved_steps=saved)))


def test_an_aborted_queued_request_leaves_its_early_loaded_pages_as_cache():
    """Aborted after its history was loaded early: it holds nothing; the loaded pages are unlocked cache that
    a later turn of the same history hits, and once idle every page is free or cached."""
    sched = _scheduler(24)
    in_flight = _running_step(sched)
    sched.add_request(2, LATER_TURN, SamplingParams(max_tokens=2))
    plan = sched.early_loads()
    loaded = {page for _, page in plan.transfers.loads}
    assert sched.abort(2) is not None
    sched.check_integrity()
    cached = {p for node in sched.cache.tree.nodes() for p in node.pages}
    assert loaded <= cached and sched.cache.tree.evictable_pages >= len(loaded)
    _done(sched, in_flight, [1], [4])
    _done(sched, plan)
    sched.abort(1)
    sched.add_request(3, LATER_TURN, SamplingParams(max_tokens=2))
    admitting = sched.schedule()
    assert admitting.admitted[0].pages[:8] == [page for _, page in plan.transfers.loads]   # a device hit
    assert admitting.transfers is None or not admitting.transfers.loads
    sched.abort(3)
    _done(sched, admitting)
    for _ in range(10):                                 # the saves left to acknowledge
        if not sched.has_work():
            break
        _done(sched, sched.schedule())
    assert not sched.has_work()
    stats = sched.stats()
    assert stats.kv_free_pages + stats.cached_tokens // 4 == stats.kv_total_pages
    sched.check_integrity()
