"""Randomized workloads: arrivals, aborts at any stage, salts, EOS, tiny KV and all policies.

Every step: integrity holds and the fake worker's simulated KV agrees. At the end: nothing leaked,
and every request that was not aborted produced exactly the tokens of an unconstrained run. With
``depth`` 2 the scheduler plans each step before the previous one's output arrives (overlap
scheduling): the outputs must not change. With a host-memory KV tier, evicted prefixes come back by
loads (the fake worker copies the simulated KV), also before admission (``Scheduler.early_loads``, sent
beside the steps in flight), and a load that starts at once never lands in a page a step in flight
writes: the outputs must not change either.
"""

from __future__ import annotations

import random
from collections import deque

import pytest

from radixrelay.protocol.step import StepOutput
from radixrelay.radix.tiers import KVTiers
from radixrelay.sampling_params import SamplingParams
from radixrelay.scheduler import Scheduler, SchedulerConfig
from radixrelay.scheduler.scheduler_config import SchedulePolicy
from tests.scheduler.fake_worker import FakeWorker, Run, collect

EOS = 0


def token_fn(rid: int, tokens: list[int]) -> int:
    return (rid * 13 + len(tokens) * 5) % 40       # hits EOS (0) now and then


def simulate(seed: int, policy: SchedulePolicy, page_size: int, kv_tokens: int, aborts: bool,
             depth: int = 1, tiers: bool = False):
    rng = random.Random(seed)
    cfg = SchedulerConfig(kv_cache_tokens=kv_tokens, page_size=page_size, schedule_policy=policy,
                          chunked_prefill_tokens=rng.choice([3, 8, 64]), max_running_requests=6,
                          decode_reservation_ratio=0.0 if aborts else 0.5, eos_token_ids=(EOS,))
    sched = Scheduler(cfg, tiers=KVTiers(host_pages=256) if tiers else None)
    worker = FakeWorker(page_size, cfg.num_pages, token_fn=token_fn)
    rng2 = random.Random(seed)          # the workload itself does not depend on the config
    systems = [[rng2.randrange(1, 40) for _ in range(rng2.randrange(4, 14))] for _ in range(3)]
    pending = [(rid, rng2.choice([None, "s"]),
                rng2.choice(systems)[: rng2.randrange(15)] + [rng2.randrange(1, 40)],
                rng2.randrange(1, 12)) for rid in range(25)]
    aborted: set[int] = set()
    run = Run()
    in_flight: deque[StepOutput] = deque()     # outputs computed, not yet seen by the scheduler
    while pending or sched.has_work() or in_flight:
        if pending and rng.random() < 0.8:
            rid, salt, prompt, n = pending.pop(0)
            sched.add_request(rid, prompt, SamplingParams(max_tokens=n), cache_salt=salt)
        if aborts and rng.random() < 0.1:
            rid = rng.randrange(25)
            if sched.abort(rid) is not None:
                aborted.add(rid)
                sched.check_integrity()
        if tiers and rng.random() < 0.5:      # arrivals seen while steps are in flight
            early = sched.early_loads()
            if early is not None:
                in_flight.append(worker.step(early))
        plan = sched.schedule() if sched.num_row_steps_in_flight < depth else None
        if plan is not None:
            in_flight.append(worker.step(plan))
        if in_flight and (plan is None or sched.num_row_steps_in_flight >= depth):
            out = in_flight.popleft()
            collect(run, sched.process_output(out))
            worker.delivered(out.step_id)
        sched.check_integrity()
    sched.cache.allocator.free(sched.cache.tree.evict(10**9))
    assert sched.cache.allocator.num_free == cfg.num_pages
    finished = {rid: run.tokens.get(rid, []) for rid in run.finals}
    return finished, run, aborted, sched.stats()


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("policy", ["lpm", "dfs-weight", "fcfs"])
@pytest.mark.parametrize("seed", range(4))
def test_random_workload(seed, policy, depth):
    page_size = [1, 2, 4][seed % 3]
    reference, _, _, _ = simulate(seed, policy, page_size, 4096, aborts=False)
    overlapped, _, _, _ = simulate(seed, policy, page_size, 4096, aborts=False, depth=depth)
    assert overlapped == reference
    tight, run, aborted, stats = simulate(seed, policy, page_size, 28, aborts=True, depth=depth)
    assert stats.num_retractions > 0
    for rid, toks in tight.items():
        assert toks == reference[rid]
        assert run.finals[rid].finish_reason in ("stop", "length")
    assert set(run.finals) | aborted == set(range(25)) and not set(run.finals) & aborted


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("seed", range(8))
def test_random_workload_with_a_host_tier(seed, depth):
    """A tight device pool behind a host-memory tier: prefixes evicted from the device come back by loads
    (at admission, or before it while steps are in flight), with aborts and retractions; the tokens of a
    roomy pool without tiers."""
    page_size = [1, 2, 4][seed % 3]
    reference, _, _, _ = simulate(seed, "lpm", page_size, 4096, aborts=False)
    tight, run, aborted, stats = simulate(seed, "lpm", page_size, 28, aborts=True, depth=depth, tiers=True)
    for rid, toks in tight.items():
        assert toks == reference[rid]
    assert set(run.finals) | aborted == set(range(25))
    assert stats.tier_host_hit_tokens > 0
