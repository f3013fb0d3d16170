"""Queue policies (lpm, dfs-weight, fcfs fallback) and the cascade planner hook."""

from __future__ import annotations

from radixrelay.protocol.cascade import DecodeRow
from radixrelay.sampling_params import SamplingParams
from radixrelay.scheduler import Scheduler, SchedulerConfig
from radixrelay.scheduler.scheduler_config import SchedulePolicy
from tests.scheduler.fake_worker import FakeWorker, drive

A = [1] * 8            # two cached system prompts of different lengths
B = [2] * 4


def warmed(policy: SchedulePolicy, **kw):
    cfg = SchedulerConfig(kv_cache_tokens=512, page_size=2, schedule_policy=policy,
                          max_running_requests=1, **kw)
    sched, worker = Scheduler(cfg), FakeWorker(2, cfg.num_pages)
    sched.add_request(100, A + [9], SamplingParams(max_tokens=1))
    sched.add_request(101, B + [9], SamplingParams(max_tokens=1))
    drive(sched, worker)
    return sched, worker


def admission_order(sched, worker):
    order = []
    while sched.has_work():
        plan = sched.schedule()
        order += [a.rid for a in plan.admitted]
        sched.process_output(worker.step(plan))
    return order


def add_mix(sched):
    sched.add_request(0, [7, 7, 7], SamplingParams(max_tokens=1))
    sched.add_request(1, B + [5, 5], SamplingParams(max_tokens=1))
    sched.add_request(2, A + [5, 5], SamplingParams(max_tokens=1))
    sched.add_request(3, B + [6, 6], SamplingParams(max_tokens=1))
    sched.add_request(4, B + [4, 4], SamplingParams(max_tokens=1))


def test_lpm_prefers_longest_cached_prefix():
    sched, worker = warmed("lpm")
    add_mix(sched)
    assert admission_order(sched, worker)[:2] == [2, 1]


def test_dfs_weight_groups_requests_under_the_heaviest_node():
    sched, worker = warmed("dfs-weight")
    add_mix(sched)
    # B has three waiting requests under it, A one, the unmatched request goes last
    assert admission_order(sched, worker) == [1, 3, 4, 2, 0]


def test_fcfs_and_long_queue_fallback():
    sched, worker = warmed("fcfs")
    add_mix(sched)
    assert admission_order(sched, worker) == [0, 1, 2, 3, 4]
    sched, worker = warmed("lpm", policy_queue_limit=3)
    add_mix(sched)
    assert admission_order(sched, worker) == [0, 1, 2, 3, 4]


def test_cascade_hook_sees_shared_radix_nodes():
    cfg = SchedulerConfig(kv_cache_tokens=512, page_size=2)
    sched, worker = Scheduler(cfg), FakeWorker(2, cfg.num_pages)
    system = list(range(10))
    sched.add_request(0, system + [50], SamplingParams(max_tokens=1))
    drive(sched, worker)
    seen: list[list[DecodeRow]] = []
    sched.set_cascade_planner(lambda rows: seen.append(rows) or {"rows": len(rows)})
    sched.add_request(1, system + [60, 61], SamplingParams(max_tokens=3))
    sched.add_request(2, system[:6] + [70], SamplingParams(max_tokens=3))
    plan = sched.schedule()
    assert plan is not None and plan.cascade is None and not seen   # prefill only
    sched.process_output(worker.step(plan))
    plan = sched.schedule()
    assert plan is not None and plan.cascade == {"rows": 2}
    rows = {r.rid: r for r in seen[-1]}
    (n0, n1, n2), (m0,) = rows[1].path, rows[2].path
    # request 2 matched 6 tokens: the system prompt node was split there and both share it;
    # request 1's own whole prompt pages entered the tree when its prefill ended
    assert m0 == n0 and (n0.start, n0.num_tokens) == (0, 6) and (n1.start, n1.num_tokens) == (6, 4)
    assert (n2.start, n2.num_tokens) == (10, 2)
    assert rows[1].seq_len == 13 and rows[2].seq_len == 8
    sched.process_output(worker.step(plan))
    drive(sched, worker)


def test_lpm_counts_a_prefix_held_in_host_memory():
    """With KV tiers, a queued request whose prefix host memory holds (a chat's later turn, evicted
    from the device) counts as cached: lpm admits it before an earlier request that hits nothing."""
    from radixrelay.protocol.kv import KVAcks
    from radixrelay.radix.page_keys import chain_seed, extend_keys
    from radixrelay.radix.tiers import KVTiers
    from radixrelay.scheduler.cache import CacheManager
    from radixrelay.scheduler.policy import order_waiting
    from radixrelay.scheduler.request import Request

    cfg = SchedulerConfig(kv_cache_tokens=64, page_size=2, kv_namespace="ns")
    cache = CacheManager(cfg, KVTiers(host_pages=8))
    history = [3, 1, 4, 1, 5, 9, 2, 6]
    cache.tiers.store.save(extend_keys([], chain_seed("ns", None), history, 2, 4), [0, 1, 2, 3])
    cache.tiers.store.take(0)
    cache.tiers.store.on_acks(KVAcks(saved_steps=[0]))
    fresh = Request(0, [8] * 12, 12, SamplingParams(max_tokens=1), None, 0)
    later = Request(1, history + [7, 7], 10, SamplingParams(max_tokens=1), None, 1)
    assert cache.tiers.host_extension(later, 0) == 8 and cache.tiers.host_extension(fresh, 0) == 0
    assert list(order_waiting([fresh, later], cache.tree, cfg, cache.tiers.host_extension)) == [later, fresh]
    assert list(order_waiting([fresh, later], cache.tree, cfg)) == [fresh, later]     # device only
