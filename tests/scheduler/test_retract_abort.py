"""Retraction under a tiny KV budget and abort at every stage."""

from __future__ import annotations

import random

import pytest

from radixrelay.sampling_params import SamplingParams
from radixrelay.scheduler import Scheduler, SchedulerConfig
from tests.scheduler.fake_worker import FakeWorker, Run, collect, drive


def make(page_size=2, kv_tokens=64, **kw):
    cfg = SchedulerConfig(kv_cache_tokens=kv_tokens, page_size=page_size, **kw)
    return Scheduler(cfg), FakeWorker(page_size, cfg.num_pages)


def workload(seed: int):
    rng = random.Random(seed)
    system = [rng.randrange(50) for _ in range(9)]
    def prompt() -> list[int]:
        return system[: rng.randrange(10)] + [rng.randrange(50) for _ in range(rng.randrange(1, 8))]

    return [(rid, prompt(), rng.randrange(1, 20)) for rid in range(12)]


@pytest.mark.parametrize("page_size", [1, 2, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_retraction_matches_unconstrained_run(page_size, seed):
    reqs = workload(seed)
    outs = []
    for kv_tokens, ratio in ((4096, 0.3), (40, 0.0)):
        sched, worker = make(page_size, kv_tokens, decode_reservation_ratio=ratio,
                             chunked_prefill_tokens=6)
        for rid, prompt, n in reqs:
            sched.add_request(rid, prompt, SamplingParams(max_tokens=n))
        run = drive(sched, worker)
        assert all(run.finals[rid].completion_tokens == n for rid, _, n in reqs)
        outs.append((run.tokens, sched.stats().num_retractions))
        sched.cache.allocator.free(sched.cache.tree.evict(10**9))
        assert sched.cache.allocator.num_free == sched.config.num_pages     # nothing leaked
    (big, big_retractions), (small, small_retractions) = outs
    assert big == small
    assert big_retractions == 0 and small_retractions > 0


def test_retracted_request_resumes_from_its_cached_prefix():
    sched, worker = make(page_size=2, kv_tokens=16, decode_reservation_ratio=0.0)
    # 8 pages: rid 1 grows to 7 pages, rid 2 to 5; at step 5 both need a page and rid 2 (the
    # newest) is retracted with 4 whole pages computed; rid 1 then evicts 3 of them (tail first)
    sched.add_request(1, [1, 2, 3], SamplingParams(max_tokens=12))
    sched.add_request(2, [6, 7, 8, 9, 10], SamplingParams(max_tokens=6))
    run = Run()
    retracted_plan = None
    resumes = 0
    while sched.has_work():
        plan = sched.schedule()
        assert plan is not None
        if plan.released and retracted_plan is None:
            retracted_plan = plan
        if any(a.rid == 2 for a in plan.admitted) and retracted_plan is not None:
            resumed = next(a for a in plan.admitted if a.rid == 2)
            ext = next(e for e in plan.extends if e.rid == 2)
            # its computed whole pages came back from the tree: only the tail is recomputed
            assert ext.start == 2 == resumed.token_offset and len(resumed.token_ids) == 7
            assert resumed.num_prompt_tokens == 5
            resumes += 1
        collect(run, sched.process_output(worker.step(plan)))
        sched.check_integrity()
    assert retracted_plan is not None and retracted_plan.released == [2]
    assert sched.stats().num_retractions == 1 and retracted_plan.step_id == 4
    assert resumes == 1 and len(run.tokens[1]) == 12 and len(run.tokens[2]) == 6


def _pages_held(sched):
    cache = sched.cache
    in_tree = cache.tree.cached_tokens // cache.page_size
    return cache.allocator.num_pages - cache.num_free_pages - in_tree


def test_abort_queued():
    sched, worker = make(max_running_requests=1)
    sched.add_request(1, [1, 2, 3], SamplingParams(max_tokens=4))
    sched.add_request(2, [4, 5, 6], SamplingParams(max_tokens=4))
    plan = sched.schedule()
    sched.process_output(worker.step(plan))
    update = sched.abort(2)
    assert update is not None and update.finish_reason == "abort" and update.finished
    assert sched.abort(2) is None
    sched.check_integrity()
    plan = sched.schedule()
    assert plan is not None and plan.released == []        # the worker never saw rid 2
    sched.process_output(worker.step(plan))
    run = drive(sched, worker)
    assert 2 not in run.finals


def test_abort_while_prefilling_frees_kv_now():
    sched, worker = make(page_size=2, chunked_prefill_tokens=4)
    sched.add_request(1, list(range(20)), SamplingParams(max_tokens=4))
    plan = sched.schedule()
    sched.process_output(worker.step(plan))                # 4 of 20 tokens computed
    assert _pages_held(sched) == 10
    sched.abort(1)
    assert _pages_held(sched) == 0 and sched.stats().cached_tokens == 0
    sched.check_integrity()
    assert not sched.has_work() and sched.schedule() is None
    sched.add_request(2, [1], SamplingParams(max_tokens=1))
    plan = sched.schedule()
    assert plan is not None and plan.released == [1]


def test_abort_while_decoding_and_in_flight():
    sched, worker = make(page_size=2)
    sched.add_request(1, [1, 2, 3], SamplingParams(max_tokens=50))
    sched.add_request(2, [1, 2, 3, 4], SamplingParams(max_tokens=5))
    for _ in range(3):
        sched.process_output(worker.step(sched.schedule()))
    plan = sched.schedule()                                 # in flight: 1 and 2 decode
    assert plan is not None and plan.decodes == [1, 2]
    held = _pages_held(sched)
    in_tree = {p for node in sched.cache.tree.nodes() for p in node.pages}
    own = [p for p in worker.table[1].pages if p not in in_tree]
    assert len(own) < len(worker.table[1].pages)            # its prompt's whole page is shared
    sched.abort(1)                                          # frees its own pages, not the tree's
    assert _pages_held(sched) == held - len(own)
    # the step in flight may still write them: they cool until it is processed
    assert set(own).isdisjoint(sched.cache.allocator.free_pages())
    sched.check_integrity()
    updates = sched.process_output(worker.step(plan))
    assert set(own) <= set(sched.cache.allocator.free_pages())
    assert [u.rid for u in updates] == [2]                  # rid 1's token is dropped
    run = drive(sched, worker)
    assert 1 not in run.finals and run.finals[2].finish_reason == "length"
    assert worker.plans[-1].released == [1] or 1 not in worker.table


def test_overlapped_plans_stop_at_max_tokens_and_outputs_answer_in_order():
    sched, worker = make()
    sched.add_request(1, [1, 2], SamplingParams(max_tokens=2))
    first = sched.schedule()
    second = sched.schedule()                 # planned before the first output is known
    assert second is not None and second.decodes == [1] and sched.num_in_flight == 2
    assert sched.schedule() is None           # both max_tokens are in flight: nothing to plan
    out1, out2 = worker.step(first), worker.step(second)
    with pytest.raises(ValueError):
        sched.process_output(out2)            # the oldest step must be answered first
    assert sched.process_output(out1)[0].token_ids == out1.token_ids
    final = sched.process_output(out2)[0]
    assert final.finished and final.finish_reason == "length" and final.completion_tokens == 2
    sched.check_integrity()


def _owed_positions(plans, rid):
    """Positions whose prompt logprob the plans asked ``rid`` for, in plan order, each chunk
    checked against the worker's rule (a trailing run, ending one before a sampling row)."""
    owed = []
    for plan in plans:
        for ext in plan.extends:
            if ext.rid == rid and ext.num_prompt_logprobs:
                end = ext.start + ext.num_tokens
                assert ext.prompt_logprobs_start >= ext.start
                assert ext.prompt_logprobs_start + ext.num_prompt_logprobs == end - ext.sample
                owed.extend(range(ext.prompt_logprobs_start, ext.prompt_logprobs_start + ext.num_prompt_logprobs))
    return owed


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_prompt_logprobs_owed_once_across_cache_hits_and_retraction(seed):
    """Every prompt position 0 .. P - 2 is asked for its prompt logprob exactly once, in order,
    though the prompt is cached already and the request is retracted (mid-prefill too) and resumed."""
    rng = random.Random(seed)
    system = [rng.randrange(50) for _ in range(12)]
    reqs = [(rid, system + [rng.randrange(50) for _ in range(rng.randrange(1, 10))], rng.randrange(1, 12))
            for rid in range(10)]
    sched, worker = make(page_size=2, kv_tokens=40, decode_reservation_ratio=0.0, chunked_prefill_tokens=5)
    sched.add_request(100, system, SamplingParams(max_tokens=1))         # caches the shared prefix
    drive(sched, worker)
    for rid, prompt, n in reqs:
        sched.add_request(rid, prompt, SamplingParams(max_tokens=n, prompt_logprobs=rid % 2 or None))
    run = drive(sched, worker)
    admissions = [a for plan in worker.plans for a in plan.admitted if a.rid % 2]
    mid_prefill = [a for a in admissions if len(a.token_ids) == a.num_prompt_tokens]
    assert len(mid_prefill) > len({a.rid for a in admissions})     # some resumed before sampling
    for rid, prompt, n in reqs:
        assert run.finals[rid].completion_tokens == n
        if rid % 2:
            assert _owed_positions(worker.plans, rid) == list(range(len(prompt) - 1))
            assert run.finals[rid].cached_tokens == 0
        else:
            assert _owed_positions(worker.plans, rid) == []
    assert any(run.finals[rid].cached_tokens > 0 for rid, _, _ in reqs if rid % 2 == 0)


def test_finish_found_one_step_late_drops_the_extra_token_and_frees_its_page():
    cfg = SchedulerConfig(kv_cache_tokens=64, page_size=4, eos_token_ids=(0,))
    sched = Scheduler(cfg)
    worker = FakeWorker(4, cfg.num_pages, token_fn=lambda rid, toks: 0 if len(toks) == 5 else 7)
    sched.add_request(1, [1, 2, 3, 4], SamplingParams(max_tokens=10))
    outs = [worker.step(sched.schedule())]              # prefill: samples 7 (position 4)
    outs.append(worker.step(sched.schedule()))          # decode of the pending 7: samples EOS
    updates = sched.process_output(outs.pop(0))
    assert updates[0].token_ids == [7]
    third = sched.schedule()                            # planned before the EOS is known
    assert third is not None and third.decodes == [1]
    outs.append(worker.step(third))                     # computes one token past EOS
    final = sched.process_output(outs.pop(0))[0]
    assert final.finished and final.finish_reason == "stop" and final.completion_tokens == 2
    assert sched.process_output(outs.pop(0)) == []      # the extra token is never emitted
    sched.check_integrity()
    # prompt + 7 committed = 5 positions: one whole page cached, the page the extra token wrote is free
    assert sched.stats().cached_tokens == 4 and sched.cache.allocator.num_free == cfg.num_pages - 1
