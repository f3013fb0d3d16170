"""Modular prompts in the scheduler (``radixrelay.modules.compose``): module spans computed once by
internal requests, then locked and concatenated into the page lists of the requests that import them.

The fake worker checks the KV each position reads: a span's pages must hold that span's own KV
(its hash chain restarts at the span's first position), computed by the internal request.
"""

from __future__ import annotations

import pytest

from radixrelay.protocol.step import ModuleSpan
from radixrelay.sampling_params import SamplingParams
from radixrelay.scheduler.cascade_hook import decode_rows

from .fake_worker import Run, drive
from .test_scheduler_basic import expected_outputs, make

A = ModuleSpan("\x1fmodule\x1fd\x1fA", list(range(10, 18)), [(0, 0)], 8)       # 2 pages of 4, positions 0..7
B = ModuleSpan("\x1fmodule\x1fd\x1fB", list(range(30, 34)), [(0, 20)], 3)      # 1 page, positions 20..23
TEXT = [50, 51, 52]


def _submit(sched, worker, rid, spans, max_tokens=3):
    ids = [t for s in spans for t in s.token_ids] + TEXT
    starts, at = set(), 0
    for s in spans:
        starts.add(at)
        at += len(s.token_ids)
    worker.span_starts[rid] = frozenset(starts)
    sched.add_request(rid, ids, SamplingParams(max_tokens=max_tokens), modules=spans, rope_runs=[(at, 40 - at)])
    return ids


def test_spans_are_computed_once_then_reused_in_any_order():
    sched, worker = make(page_size=4, kv_tokens=256)
    ids = _submit(sched, worker, 1, [A, B])
    run = drive(sched, worker)
    assert set(run.finals) == {1}                            # internal requests are never reported
    assert run.tokens[1] == expected_outputs(1, ids, 3)
    children = [a for p in worker.plans for a in p.admitted if a.rid < 0]
    assert sorted((c.token_ids, c.rope_runs) for c in children) == sorted(
        [(A.token_ids, [(0, 0)]), (B.token_ids, [(0, 20)])])
    parent = next(a for p in worker.plans for a in p.admitted if a.rid == 1)
    assert parent.token_offset == 12 and parent.token_ids == TEXT and parent.rope_runs == [(12, 28)]
    assert run.finals[1].cached_tokens == run.finals[1].module_tokens == 12

    first_plan = len(worker.plans)
    ids2 = _submit(sched, worker, 2, [B, A])                 # same spans, other order: nothing computed
    run2 = drive(sched, worker)
    assert run2.tokens[2] == expected_outputs(2, ids2, 3)
    assert not [a for p in worker.plans[first_plan:] for a in p.admitted if a.rid < 0]
    parent2 = next(a for p in worker.plans[first_plan:] for a in p.admitted if a.rid == 2)
    assert parent2.pages[:1] == parent.pages[2:3] and parent2.pages[1:3] == parent.pages[:2]
    stats = sched.stats()
    assert stats.locked_tokens == 0 and stats.cached_tokens == 12    # spans stay cached, unlocked


def test_requests_sharing_spans_share_cascade_nodes():
    sched, worker = make(page_size=4, kv_tokens=256)
    _submit(sched, worker, 1, [A, B], max_tokens=8)
    _submit(sched, worker, 2, [A], max_tokens=8)
    run = Run()
    drive(sched, worker, run, until=lambda: len(sched._running) == 2 and all(
        not r.in_prefill for r in sched._running.values()))
    rows = {r.rid: r for r in decode_rows(sched.cache.tree, list(sched._running.values()))}
    a_nodes = [s.node_id for s in rows[2].path]
    assert [s.node_id for s in rows[1].path][:len(a_nodes)] == a_nodes     # A: the same nodes, first
    assert sum(s.num_tokens for s in rows[1].path) == 12 and sum(s.num_tokens for s in rows[2].path) == 8
    drive(sched, worker, run)
    assert set(run.finals) == {1, 2}


def test_span_evicted_after_arrival_is_computed_again():
    sched, worker = make(page_size=4, kv_tokens=256)
    _submit(sched, worker, 1, [A, B])
    drive(sched, worker)
    ids = _submit(sched, worker, 2, [A, B])                  # cached now: no internal request yet
    assert len(sched._waiting) == 1
    sched.cache.allocator.free(sched.cache.tree.evict(sched.cache.tree.evictable_pages))
    first_plan = len(worker.plans)
    run = drive(sched, worker)
    assert run.tokens[2] == expected_outputs(2, ids, 3)
    assert len([a for p in worker.plans[first_plan:] for a in p.admitted if a.rid < 0]) == 2


def test_failed_span_fails_the_requests_waiting_for_it():
    sched, worker = make(page_size=4, kv_tokens=256)
    worker.error_at_step = 0
    _submit(sched, worker, 1, [A, B])
    run = drive(sched, worker)
    assert set(run.finals) == {1}
    assert run.finals[1].finish_reason == "abort" and run.finals[1].error == "boom"
    assert sched.stats().locked_tokens == 0 and not sched.has_work()


@pytest.mark.parametrize("spans, ids, why", [
    ([ModuleSpan("k", [1, 2, 3], [], 3)], [1, 2, 3, 9], "whole pages"),
    ([A], A.token_ids, "then new text"),
    ([A], [0] * 8 + TEXT, "then new text"),
])
def test_malformed_modular_requests_are_refused(spans, ids, why):
    sched, _ = make(page_size=4, kv_tokens=256)
    with pytest.raises(ValueError, match=why):
        sched.add_request(1, ids, SamplingParams(max_tokens=2), modules=spans)
    assert not sched.has_work()


def test_modular_requests_refuse_prompt_logprobs_and_a_disabled_cache():
    sched, _ = make(page_size=4, kv_tokens=256)
    with pytest.raises(ValueError, match="prompt logprobs"):
        sched.add_request(1, A.token_ids + TEXT, SamplingParams(max_tokens=2, prompt_logprobs=1), modules=[A])
    sched, _ = make(page_size=4, kv_tokens=256, disable_radix_cache=True)
    with pytest.raises(ValueError, match="radix cache"):
        sched.add_request(1, A.token_ids + TEXT, SamplingParams(max_tokens=2), modules=[A])


def test_aborted_modular_request_frees_its_pages_and_span_locks():
    sched, worker = make(page_size=4, kv_tokens=256)
    _submit(sched, worker, 1, [A, B], max_tokens=8)
    drive(sched, worker, until=lambda: 1 in sched._running and not sched._running[1].in_prefill)
    assert sched.stats().locked_tokens == 12
    final = sched.abort(1)
    assert final.finished and final.finish_reason == "abort"
    sched.check_integrity()
    stats = sched.stats()
    assert stats.locked_tokens == 0 and stats.kv_used_pages == 3      # only the spans' cached pages
    drive(sched, worker)
