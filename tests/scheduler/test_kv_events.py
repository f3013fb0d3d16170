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
