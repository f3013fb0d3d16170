"""The router's KV-event reader over a real redis-server, fed entries that are not what a replica writes:
each malformed kind is skipped and counted by reason (logged once per reason), later good entries are
applied by a running reader, and a new index over the same stream starts; a load of Infinity or a list
never reaches the routing arithmetic; silent replicas' announcements expire and their holdings go; the
number of announced names is bounded; a reader that stops reading shows as stalled, and one whose thread
ended is started again."""

from __future__ import annotations

import logging
import re
import time

import pytest

from radixrelay.kv_schema import MAX_ENTRY_KEYS
from radixrelay.kv_store import STREAM
from radixrelay.radix.page_keys import KEY_BYTES, chain_seed, extend_keys
from radixrelay.router.kv_index import KVEventIndex
from radixrelay.router.replicas import Pool, Replica
from radixrelay.router.trust import Trust
from tests.router.kv_entries import NS, PS, append, entry, hello, read_all
from tests.router.redis_server import RedisServer, redis_store  # noqa: F401 - a fixture

A = "http://a.test:1"
GIVEN = Trust(given=frozenset({A}))
TOKENS = list(range(100, 124))                                # 6 pages of 4


@pytest.fixture(scope="module")
def client(redis_store):
    import redis

    c = redis.Redis.from_url(redis_store.url)
    yield c
    c.close()


@pytest.fixture
def store(redis_store, client):
    client.delete(STREAM)                                     # each test on an empty stream
    return redis_store


def _keys(n: int) -> bytes:
    return b"".join(extend_keys([], chain_seed(NS, None), TOKENS, PS, n))


def _load(replica: str, seq: int, body: bytes, **kw) -> dict[bytes, bytes]:
    return entry("load", replica, seq=seq, load=body, **kw)


BAD = {                                                       # reason -> entries for replica A, instance i1
    "page_size": [hello(A, seq=2, page_size=b"sixteen"), hello(A, seq=3, page_size=b"0"),
                  hello(A, seq=4, page_size=b"99999999999")],
    "replica": [hello(A, seq=5) | {b"replica": b"http://\xff\xfe.test:1"},
                hello("ftp://a.test:1", seq=6), hello("http://a.test:1/v1", seq=7)],
    "load": [_load(A, 8, b'{"running": Infinity, "waiting": 0}'), _load(A, 9, b"[1, 2]"),
             _load(A, 10, b'{"running": 1e400, "waiting": 0}'), _load(A, 11, b'{"running": -1, "waiting": 0}'),
             _load(A, 12, b'{"running": NaN, "waiting": 0}'), _load(A, 13, b'{"running": true, "waiting": 0}'),
             _load(A, 14, b"not json"), _load(A, 15, b'{"running": ' + b"9" * 2000 + b', "waiting": 0}')],
    "keys": [entry("stored", A, seq=16, keys=b"x" * (KEY_BYTES - 1)),
             entry("stored", A, seq=17, keys=b"x" * KEY_BYTES * (MAX_ENTRY_KEYS + 1)), entry("removed", A, seq=18)],
    "t": [hello(A, seq=19, t=float("nan")), hello(A, seq=20, t=float("inf")), hello(A, seq=21, t=time.time() + 3600)],
    "seq": [hello(A, seq=None), entry("cleared", A, seq=0), entry("cleared", A, seq=None) | {b"seq": b"-3"}],
    "instance": [hello(A, instance=""), hello(A, instance="a b")],
    "kind": [entry("bogus", A, seq=22)],
    "version": [hello(A, seq=23, v=b"2"), hello(A, seq=24, v=b"x")],
    "namespace": [hello(A, seq=25, namespace=b"\xff\xfe"), hello(A, seq=26, namespace=b"")],
    "size": [hello(A, seq=27, padding=b"p" * (1 << 20))],
    "unknown_replica": [hello("http://intruder.test:1", seq=1)],
    "tier": [entry("tier_stored", A, seq=28, tier=b"gpu", keys=b"x" * KEY_BYTES), entry("tier_cleared", A, seq=29),
             entry("tier_removed", A, seq=30, tier=b"HOST", keys=b"x" * KEY_BYTES)],
}
BAD["load"] += [_load(A, 31, b'{"running": 1, "waiting": 0, "prefill_tps": -5}'),
                _load(A, 32, b'{"running": 1, "waiting": 0, "host_load_tps": "fast"}'),
                _load(A, 33, b'{"running": 1, "waiting": 0, "disk_read_tps": 1e13}')]


def test_each_malformed_entry_is_skipped_and_counted_and_reading_goes_on(store, client, caplog):
    """Today: ``int(b'sixteen')`` in the reader thread ended it for good, and a restart failed in start()."""
    running = KVEventIndex(store.url, trust=GIVEN)
    running.start()                                          # reads while the entries arrive
    try:
        append(client, hello(A, seq=1))
        for entries in BAD.values():
            append(client, *entries)
        # later good entries of the same instance: applied
        append(client, entry("stored", A, seq=40, keys=_keys(5)), _load(A, 41, b'{"running": 2, "waiting": 1}'),
               entry("stored", A, seq=42, keys=_keys(6), future_field=b"ignored"))
        for index in (running, KVEventIndex(store.url, trust=GIVEN)):        # ... and a router started now
            with caplog.at_level(logging.WARNING, "radixrelay.events"):
                if index is not running:
                    index.start()
                read_all(index)
            try:
                assert index.matched_tokens(A, TOKENS, None) == 24
                assert index.reported_load(A) == 3
                assert index.status().reader == "ok"
                for reason, entries in BAD.items():
                    assert index.rejected[reason] == len(entries), (reason, index.rejected)
            finally:
                if index is not running:
                    index.close()
        # logged once per reason by each index, not once per entry
        lines = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
        assert len([m for m in lines if "load:" in m]) == 2, lines
    finally:
        running.close()


def test_a_new_index_over_a_poisoned_stream_starts_and_the_reader_survives_its_thread_ending(store, client):
    append(client, hello(A, seq=1, page_size=b"NaN"), hello(A, instance="i2", seq=2))
    index = KVEventIndex(store.url, trust=GIVEN, stall_s=3.0)
    index.start()
    try:
        assert index.replicas[A].page_size == PS and index.rejected["page_size"] == 1
        thread = index._thread
        index._stop.set()                                    # the reader thread ends (as if it had died)
        thread.join(5)
        index._stop.clear()
        assert not thread.is_alive()
        assert index.status().reader == "ok" and index.restarts == 1      # asked: a new thread started
        append(client, entry("stored", A, instance="i2", seq=3, keys=_keys(2)))
        read_all(index)
        assert index.matched_tokens(A, TOKENS, None) == 8
    finally:
        index.close()


def test_a_reader_whose_store_stops_answering_shows_as_stalled(tmp_path):
    server = RedisServer(tmp_path)
    try:
        index = KVEventIndex(server.url, trust=GIVEN, stall_s=0.5)
        index.start()
        assert index.status().reader == "ok"
        server.stop()                                        # the store goes away
        deadline = time.monotonic() + 10
        while not index.stalled():
            assert time.monotonic() < deadline, index.status()
            time.sleep(0.1)
        status = index.status()
        assert status.reader == "stalled" and status.seconds_since_read > 0.5
        assert index._thread.is_alive()                      # still trying
        index.close()
    finally:
        server.stop()


def test_announcements_expire_and_their_holdings_go(store, client):
    """Announced names (matching the pattern) leave ``replica_names`` and their keys are dropped once silent
    for ``expire_s``; a given replica keeps its keys but its stale load counts for nothing."""
    trust = Trust(given=frozenset({A}), pattern=re.compile(r"http://b[0-9]\.test:1"))
    index = KVEventIndex(store.url, trust=trust, expire_s=1.0)
    try:
        for name in (A, "http://b1.test:1"):
            append(client, hello(name), entry("stored", name, seq=2, keys=_keys(3)),
                   _load(name, 3, b'{"running": 4, "waiting": 0}'))
        read_all(index)
        assert index.replica_names() == ["http://b1.test:1"]          # the given one is no announcement
        assert index.reported_load(A) == 4 and index.holds("http://b1.test:1") == 3
        # an old announcement (a replica long gone, or a replay of one) never joins
        append(client, hello("http://b2.test:1", t=time.time() - 60),
               _load("http://b2.test:1", 2, b'{"running": 0, "waiting": 0}', t=time.time() - 60))
        read_all(index)
        assert "http://b2.test:1" not in index.replica_names()
        time.sleep(1.2)
        append(client, hello("http://b3.test:1"))      # anything read runs the expiry
        read_all(index)
        assert index.replica_names() == ["http://b3.test:1"]
        assert index.holds("http://b1.test:1") == 0 and index.reported_load("http://b1.test:1") == 0
        assert index.reported_load(A) == 0 and index.holds(A) == 3     # given: stale load ignored, keys kept
    finally:
        index.close()


def test_announced_names_are_bounded(store, client):
    trust = Trust(pattern=re.compile(r"http://n[0-9]+\.test:1"))
    index = KVEventIndex(store.url, trust=trust, max_announced=3)
    try:
        append(client, *(hello(f"http://n{i}.test:1", t=time.time() - 60) for i in range(3)))     # silent
        append(client, *(hello(f"http://n{i}.test:1") for i in range(3, 8)))
        read_all(index)
        # the silent ones made room for the first three fresh ones; then there was none
        assert sorted(index.replicas) == [f"http://n{i}.test:1" for i in range(3, 6)]
        assert index.rejected["too_many_replicas"] == 2
    finally:
        index.close()


def test_an_announced_replica_that_expires_leaves_the_pool():
    announced = ["http://b1.test:1"]
    left: list[str] = []
    pool = Pool([Replica(A)], on_leave=lambda r: left.append(r.url), discover=lambda: list(announced))
    pool.add_discovered()
    assert [r.url for r in pool.replicas] == [A, "http://b1.test:1"]
    pool.replicas[1].healthy = True
    announced.clear()
    pool.add_discovered()
    assert [r.url for r in pool.replicas] == [A] and left == ["http://b1.test:1"]


def test_the_keys_held_per_replica_are_bounded(store, client, monkeypatch):
    from radixrelay.router import kv_index

    monkeypatch.setattr(kv_index, "MAX_REPLICA_KEYS", 5)
    index = KVEventIndex(store.url, trust=GIVEN)
    try:
        append(client, hello(A), entry("stored", A, seq=2, keys=_keys(4)), entry("stored", A, seq=3, keys=_keys(6)))
        read_all(index)
        assert index.holds(A) == 4 and index.rejected["keys"] == 1
    finally:
        index.close()
