"""KV events through a real redis-server: a replica's publisher and a router's index agree on what the
replica holds (stored, removed, cleared, a restarted replica), a restarted index rebuilds from the
stream, salts and namespaces never match each other, and a store that does not answer is a clear error."""

from __future__ import annotations

import re
import time

import pytest

from radixrelay.radix.page_keys import chain_seed, extend_keys
from radixrelay.kv_events import KVEventPublisher, check_store_url, connect
from radixrelay.router.kv_index import KVEventIndex
from radixrelay.router.trust import Trust
from tests.router.redis_server import redis_store  # noqa: F401 - a fixture

PS = 4
NS = "model-a/layout-1"
ANY = Trust(pattern=re.compile(r"http://[a-z0-9]+:1"))       # the test's replica names announce themselves


@pytest.fixture(scope="module")
def store(redis_store):
    return redis_store


def _keys(tokens: list[int], salt: str | None = None, namespace: str = NS) -> list[bytes]:
    return extend_keys([], chain_seed(namespace, salt), tokens, PS, len(tokens) // PS)


def _until(index: KVEventIndex, check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "the index did not see the events"
        index.catch_up(100)


def test_the_index_follows_what_a_replica_stores_and_evicts(store):
    tokens = list(range(100, 124))                       # 6 pages
    pub = KVEventPublisher(store.url, "http://r1:1", NS, PS)
    index = KVEventIndex(store.url, trust=ANY)
    try:
        pub.stored(_keys(tokens)[:4])
        _until(index, lambda: index.matched_tokens("http://r1:1", tokens, None) == 16)
        assert index.matched_tokens("http://r1:1", tokens, "tenant-b") == 0      # another salt
        assert index.matched_tokens("http://r2:1", tokens, None) == 0            # another replica
        pub.removed(_keys(tokens)[2:4])                    # the tail evicted
        _until(index, lambda: index.matched_tokens("http://r1:1", tokens, None) == 8)
        pub.load(3, 5, 0.5)
        _until(index, lambda: index.reported_load("http://r1:1") == 8)
        pub.cleared()
        _until(index, lambda: index.matched_tokens("http://r1:1", tokens, None) == 0)
        assert pub.dropped == 0 and pub.failed == 0
    finally:
        pub.close()
        index.close()


def test_a_restarted_index_rebuilds_and_a_restarted_replica_starts_empty(store):
    tokens = list(range(500, 532))
    first = KVEventPublisher(store.url, "http://r3:1", NS, PS)
    first.stored(_keys(tokens))
    first.close()
    index = KVEventIndex(store.url, trust=ANY)                        # a router started after the events
    index.start()
    try:
        _until(index, lambda: index.matched_tokens("http://r3:1", tokens, None) == 32)
        again = KVEventPublisher(store.url, "http://r3:1", "model-b/layout-1", PS)   # restarted, another model
        try:
            _until(index, lambda: index.replicas["http://r3:1"].instance == again.instance)
            assert index.matched_tokens("http://r3:1", tokens, None) == 0
            again.stored(_keys(tokens, namespace="model-b/layout-1")[:2])
            _until(index, lambda: index.matched_tokens("http://r3:1", tokens, None) == 8)
        finally:
            again.close()
    finally:
        index.close()


def test_store_urls_are_checked_and_an_unreachable_store_is_a_clear_error():
    for bad in ("http://127.0.0.1:6379", "redis://", "redis://h:99999/0", "redis://h:1/x", "redis://h:1/0?x=1",
                "rediss://h:1/0?db=2"):
        with pytest.raises(ValueError, match="store"):
            check_store_url(bad)
    with pytest.raises(ConnectionError, match="does not answer"):
        connect("redis://127.0.0.1:1/0", timeout=0.5)


def test_many_replicas_are_matched_under_each_one_s_layout(store):
    tokens = list(range(900, 932))                       # 32 tokens
    four = KVEventPublisher(store.url, "http://m1:1", NS, 4)
    eight = KVEventPublisher(store.url, "http://m2:1", NS, 8)
    index = KVEventIndex(store.url, trust=ANY)
    try:
        four.stored(_keys(tokens)[:5])                    # 20 tokens in pages of 4
        eight.stored(extend_keys([], chain_seed(NS, None), tokens, 8, 4)[:2])   # 16 tokens in pages of 8
        names = ["http://m1:1", "http://m2:1", "http://unknown:1"]
        _until(index, lambda: index.matched_tokens_many(names, tokens, None) == [20, 16, 0])
        assert index.matched_tokens_many(names, tokens, "salted") == [0, 0, 0]
        assert [index.matched_tokens(n, tokens, None) for n in names] == [20, 16, 0]
    finally:
        four.close()
        eight.close()
        index.close()
