"""KV audit: pages and radix locks by holder, the idle baseline, and check_integrity's verdict."""

from __future__ import annotations

from radixrelay.sampling_params import SamplingParams
from radixrelay.scheduler import Scheduler, SchedulerConfig
from tests.scheduler.fake_worker import FakeWorker, Run, collect, drive

PS = 4


def make(kv_tokens: int = 128) -> tuple[Scheduler, FakeWorker]:
    cfg = SchedulerConfig(kv_cache_tokens=kv_tokens, page_size=PS)
    return Scheduler(cfg), FakeWorker(PS, cfg.num_pages)


def test_fresh_scheduler_is_at_idle_baseline():
    sched, _ = make()
    audit = sched.audit()
    assert audit.at_idle_baseline and audit.integrity_ok
    assert (audit.total_pages, audit.free_pages, audit.cached_pages, audit.request_pages) == (32, 32, 0, 0)


def test_holders_while_running_then_back_to_baseline():
    sched, worker = make()
    system = list(range(100, 116))                     # 4 whole pages, shared by both requests
    sched.add_request(1, system + [1, 2], SamplingParams(max_tokens=6))
    run = Run()
    collect(run, sched.process_output(worker.step(sched.schedule())))   # 1's prefill: shares 4 pages
    sched.add_request(2, system + [3, 4, 5], SamplingParams(max_tokens=6))
    collect(run, sched.process_output(worker.step(sched.schedule())))   # 2 admitted on the cached prefix
    audit = sched.audit()
    assert audit.integrity_ok and not audit.at_idle_baseline
    assert audit.live_requests == 2 and audit.lock_holders == 2
    assert audit.cached_pages == 4 and audit.locked_nodes == 1 and audit.lock_refs == 2
    # free + cached + request pages partition the cache
    assert audit.free_pages + audit.cached_pages + audit.request_pages == audit.total_pages
    assert audit.request_pages == 2            # each request's partial last page (18, 19 + 1 tokens)
    drive(sched, worker, run)
    assert set(run.finals) == {1, 2}
    audit = sched.audit()
    assert audit.at_idle_baseline and audit.cached_pages > 0       # the cache stays, unlocked
    assert audit.free_pages + audit.cached_pages == audit.total_pages


def test_abort_returns_to_baseline():
    sched, worker = make()
    sched.add_request(1, list(range(30)), SamplingParams(max_tokens=20))
    run = drive(sched, worker, until=lambda: sched.audit().request_pages > 0 and
                sched.stats().num_running == 1 and sched.num_in_flight == 0 and
                sched._running[1].num_outputs > 2)
    assert not sched.audit().at_idle_baseline
    sched.abort(1)
    assert sched.audit().at_idle_baseline
    assert 1 not in run.finals


def test_a_leaked_lock_or_page_is_visible():
    sched, worker = make()
    sched.add_request(1, list(range(20)), SamplingParams(max_tokens=2))
    drive(sched, worker)
    assert sched.audit().at_idle_baseline
    node = next(sched.cache.tree.nodes())
    sched.cache.tree.lock(node)                  # a lock nobody holds
    audit = sched.audit()
    assert audit.locked_nodes == 1 and audit.lock_refs == 1 and audit.lock_holders == 0
    assert not audit.at_idle_baseline
    sched.cache.tree.unlock(node)
    leaked = sched.cache.allocator.alloc(1)      # a page nobody holds
    audit = sched.audit()
    assert leaked and not audit.integrity_ok and "page accounting" in audit.integrity_error
    assert not audit.at_idle_baseline
