"""KV events from the scheduler (``scheduler/kv_event_hook.py``) through a real redis-server to a router's
index: what the radix tree holds after prefill, release, eviction and a flush is what the index says
the replica holds, salts apart."""

from __future__ import annotations

import time

import pytest

from radixrelay.kv_events import KVEventPublisher
from radixrelay.router.kv_index import KVEventIndex
from radixrelay.router.trust import Trust
from radixrelay.sampling_params import SamplingParams
from radixrelay.scheduler import Scheduler, SchedulerConfig
from tests.router.redis_server import redis_store  # noqa: F401 - a fixture
from tests.scheduler.fake_worker import FakeWorker, drive

PS = 4
NS = "test-model/layout"


@pytest.fixture(scope="module")
def store(redis_store):
    return redis_store


def _settled(index: KVEventIndex, name: str, want, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        index.catch_up(50)
        got = want()
        if got is True:
            return
        assert time.monotonic() < deadline, got


def test_the_index_holds_what_the_tree_holds(store):
    name = "http://replica:1"
    publisher = KVEventPublisher(store.url, name, NS, PS)
    sched = Scheduler(SchedulerConfig(kv_cache_tokens=64, page_size=PS, kv_namespace=NS), events=publisher)
    worker = FakeWorker(PS, sched.config.num_pages)
    index = KVEventIndex(store.url, trust=Trust(given=frozenset({name})))     # the router believes this replica
    try:
        first = list(range(1, 27))                     # 26 tokens + 4 outputs -> 7 whole pages computed
        sched.add_request(1, first, SamplingParams(max_tokens=5))
        sched.add_request(2, first[:12] + [90, 91, 92, 93], SamplingParams(max_tokens=1), cache_salt="b")
        drive(sched, worker)
        assert sched.stats().cached_tokens == 28 + 16
        _settled(index, name, lambda: index.matched_tokens(name, first, None) == 24 or
                 index.matched_tokens(name, first, None))
        salted = first[:12] + [90, 91, 92, 93]          # published after request 1's first pages
        _settled(index, name, lambda: index.matched_tokens(name, salted, "b") == 16 or
                 index.matched_tokens(name, salted, "b"))
        assert index.matched_tokens(name, first[:12] + [90, 91, 92, 93], None) == 12   # unsalted: request 1's
        # other prompts fill the 16-page pool: the least recently used pages leave the tree, and the index
        for rid, base in ((3, 200), (4, 300), (5, 400)):
            sched.add_request(rid, list(range(base, base + 20)), SamplingParams(max_tokens=1))
            drive(sched, worker)
        held = sched.cache.tree.match_prefix(first, None).num_tokens
        assert held < 24
        _settled(index, name, lambda: index.matched_tokens(name, first, None) == held or
                 (held, index.matched_tokens(name, first, None)))
        assert sched.flush_cache()
        _settled(index, name, lambda: index.holds(name) == 0 or index.holds(name))
        assert publisher.dropped == 0 and publisher.failed == 0
    finally:
        publisher.close()
        index.close()


def test_the_index_follows_pages_into_host_memory_and_out_of_it(store):
    """A replica with a host tier: a prompt's pages evicted from its device stay in host memory, and the
    router's index counts them there (past what the device kept, the rest of its 5 whole pages in host
    memory) instead of as gone; once host memory drops them too, only what the device kept is left.
    Through a real redis-server and a real publisher."""
    import msgspec

    from radixrelay.radix.tiers import KVTiers
    from tests.radix.test_tiers_state_machine import TierWorker

    name = "http://replica:2"
    ns = "test-model;page_size=4"                  # the tier worker's namespace
    publisher = KVEventPublisher(store.url, name, ns, PS)
    sched = Scheduler(SchedulerConfig(kv_cache_tokens=12 * PS, page_size=PS, kv_namespace=ns),
                      tiers=KVTiers(host_pages=16), events=publisher)
    salts: dict[int, str | None] = {}
    history: dict[int, list[int]] = {}
    worker = TierWorker(PS, sched.config.num_pages, 16, __import__("random").Random(0), salts, history)
    index = KVEventIndex(store.url, trust=Trust(given=frozenset({name})))

    def run(rid: int, prompt: list[int]) -> None:
        salts[rid], history[rid] = None, list(prompt)
        sched.add_request(rid, prompt, SamplingParams(max_tokens=1))
        while sched.has_work() or sched._tiers_busy():
            plan = sched.schedule()
            if plan is None:
                break
            sched.process_output(msgspec.structs.replace(worker.step(plan), kv_acks=worker.collect_acks(True)))

    try:
        prompt = list(range(1, 22))                                    # 5 whole pages
        run(1, prompt)
        run(2, list(range(100, 121)))                                   # pushes it out of the 12-page device
        run(3, list(range(200, 221)))
        held = sched.cache.tree.peek_prefix(prompt, None)[1]            # what the device kept of it
        assert held < 20
        _settled(index, name, lambda: index.matched_tiers_many([name], prompt, None) == [(held, 20 - held, 0)] or
                 (held, index.matched_tiers_many([name], prompt, None)))
        for rid, base in ((4, 300), (5, 400), (6, 500)):                # and out of the 16-page host memory
            run(rid, list(range(base, base + 21)))
        held = sched.cache.tree.peek_prefix(prompt, None)[1]
        _settled(index, name, lambda: index.matched_tiers_many([name], prompt, None) == [(held, 0, 0)] or
                 (held, index.matched_tiers_many([name], prompt, None)))
        assert publisher.dropped == 0 and publisher.failed == 0
    finally:
        publisher.close()
        index.close()
