"""The router sees a replica's lower KV tiers: ``tier_stored`` / ``tier_removed`` / ``tier_cleared`` entries
(host memory, disk) read from a real redis-server into the index, a prompt's pages counted by where they
live (device, then host memory or disk after them), and a prefix in host memory scored by the replica's
reported rates: a replica holding it there wins over one holding nothing."""

from __future__ import annotations

import pytest

from radixrelay.kv_schema import Load
from radixrelay.kv_store import STREAM
from radixrelay.radix.page_keys import chain_seed, extend_keys
from radixrelay.router.kv_index import KVEventIndex
from radixrelay.router.routing import HOST_SHARE_UNKNOWN, Candidate, choose, tier_tokens
from radixrelay.router.trust import Trust
from tests.router.kv_entries import NS, PS, append, entry, hello, read_all
from tests.router.redis_server import redis_store  # noqa: F401 - a fixture

A, B, C = "http://a.test:1", "http://b.test:1", "http://c.test:1"
TOKENS = list(range(300, 324))                                # 6 pages of 4
KEYS = extend_keys([], chain_seed(NS, None), TOKENS, PS, 6)
RATES = b'{"running": 0, "waiting": 0, "kv_usage": 0.1, "prefill_tps": 10000, "host_load_tps": 100000, ' \
        b'"disk_read_tps": 20000}'


@pytest.fixture
def client(redis_store):
    import redis

    c = redis.Redis.from_url(redis_store.url)
    c.delete(STREAM)
    yield c
    c.close()


@pytest.fixture
def index(redis_store, client):
    index = KVEventIndex(redis_store.url, trust=Trust(given=frozenset({A, B, C})))
    yield index
    index.close()


def _keys(first: int, stop: int) -> bytes:
    return b"".join(KEYS[first:stop])


def test_a_prefix_in_host_memory_wins_over_nothing(client, index):
    append(client, hello(A, seq=1), entry("tier_stored", A, seq=2, tier=b"host", keys=_keys(0, 6)),
           entry("load", A, seq=3, load=RATES), hello(B, seq=1))
    read_all(index)
    assert index.matched_tiers_many([A, B], TOKENS, None) == [(0, 24, 0), (0, 0, 0)]
    assert index.matched_tokens(A, TOKENS, None) == 0                # nothing on its device
    load = index.reported_rates(A)
    assert load == Load(0, 0, 0.1, 10000.0, 100000.0, 20000.0)
    held = tier_tokens(0, 24, 0, load)                                # a load saves 90% of the prefill
    assert held == int(24 * 0.9)
    a, b = Candidate(A, held, in_flight=0), Candidate(B, 0, in_flight=0)
    assert all(choose("precise", [a, b], turn=t) is a for t in range(4))
    assert tier_tokens(0, 24, 0, None) == int(24 * HOST_SHARE_UNKNOWN)      # no rates reported yet


def test_pages_count_by_tier_in_prompt_order_and_leave_with_their_tier(client, index):
    append(client, hello(C, seq=1),
           entry("stored", C, seq=2, keys=_keys(0, 2)),                                # device: pages 0-1
           entry("tier_stored", C, seq=3, tier=b"host", keys=_keys(0, 4)),             # host: pages 0-3
           entry("tier_stored", C, seq=4, tier=b"disk", keys=_keys(3, 6)),             # disk: pages 3-5
           entry("load", C, seq=5, load=RATES))
    read_all(index)
    assert index.matched_tiers_many([C], TOKENS, None) == [(8, 8, 8)]
    # a disk page is read into host memory, then loaded: 1 - 10000 x (1/20000 + 1/100000) = 0.4 of its prefill
    assert tier_tokens(8, 8, 8, index.reported_rates(C)) == 8 + int(8 * 0.9) + int(8 * 0.4)
    append(client, entry("tier_removed", C, seq=6, tier=b"host", keys=_keys(2, 3)))   # page 2 left host memory
    read_all(index)
    assert index.matched_tiers_many([C], TOKENS, None) == [(8, 0, 0)]                # the walk stops there
    append(client, entry("tier_stored", C, seq=7, tier=b"disk", keys=_keys(2, 3)),
           entry("tier_cleared", C, seq=8, tier=b"host"))
    read_all(index)
    assert index.matched_tiers_many([C], TOKENS, None) == [(8, 0, 16)]
    assert index.matched_tiers_many([C], TOKENS, "salted") == [(0, 0, 0)]              # another salt's keys
    append(client, entry("cleared", C, seq=9))             # the device's tree emptied: pages 0-1 are nowhere
    read_all(index)
    assert index.matched_tiers_many([C], TOKENS, None) == [(0, 0, 0)]
