"""The router's approximate index and its choice of replica."""

from __future__ import annotations

import pytest

from radixrelay.router.index import PrefixIndex
from radixrelay.router.routing import LOAD_TOKENS, Candidate, choose
from radixrelay.router.replicas import check_replica_url

K = [bytes([i]) * 16 for i in range(8)]


def test_index_matches_leading_pages_and_forgets_old_ones():
    index = PrefixIndex(capacity=6)
    index.record("a", K[:4])
    assert index.matched("a", K) == 4 and index.matched("b", K) == 0
    assert index.matched("a", [b"q" * 16] + K[1:]) == 0          # another first page: another prefix
    index.record("a", [b"x" * 16, b"y" * 16, b"z" * 16])         # over capacity: the oldest keys go
    assert index.size("a") == 6 and index.matched("a", K) == 0
    index.drop("a")
    assert index.size("a") == 0
    with pytest.raises(ValueError):
        PrefixIndex(capacity=0)


def test_cached_prefix_against_load():
    held = Candidate("a", 4096, in_flight=3)
    idle = Candidate("b", 0, in_flight=0)
    assert choose("approximate", [held, idle], turn=0) is held        # 4096 - 3 x 256 > 0
    busy = Candidate("a", 512, in_flight=3)
    assert choose("approximate", [busy, idle], turn=0) is idle        # 512 - 768 < 0
    assert 512 - 3 * LOAD_TOKENS < 0
    # nothing held anywhere: fewest in flight; ties in turn
    a, b = Candidate("a", 0, 1), Candidate("b", 0, 0)
    assert choose("approximate", [a, b], turn=0) is b
    a, b = Candidate("a", 0, 0), Candidate("b", 0, 0)
    assert [choose("approximate", [a, b], turn=t).replica for t in range(4)] == ["a", "b", "a", "b"]
    assert [choose("round-robin", [held, idle], turn=t).replica for t in range(3)] == ["a", "b", "a"]
    with pytest.raises(ValueError, match="routing mode"):
        choose("random", [a], 0)


def test_replica_urls():
    assert check_replica_url("http://127.0.0.1:30000/") == "http://127.0.0.1:30000"
    assert check_replica_url("https://replica-1.internal") == "https://replica-1.internal"
    for bad in ("127.0.0.1:30000", "http://:80", "http://h:x", "http://h:1/v1", "http://h:1?a=b"):
        with pytest.raises(ValueError, match="replica"):
            check_replica_url(bad)


def test_requests_with_one_prompt_cache_key_go_to_one_replica():
    from radixrelay.router.router_app import Router, RouterConfig
    from radixrelay.router.routing import CacheKeyAffinity

    router = Router(RouterConfig(("http://a:1", "http://b:1", "http://c:1")), prompt_keys=None)
    for replica in router.pool.replicas:
        replica.healthy = True
    first, _ = router.pick([], None, (None, "agent-7"))
    first.in_flight = 10                                  # busier than the others: the key still sticks
    assert all(router.pick([], None, (None, "agent-7"))[0] is first for _ in range(5))
    assert router.pick([], None, ("tenant-b", "agent-7"))[0] is not first      # another salt, another key
    first.healthy = False                                 # gone: the key moves and sticks to the new one
    moved, _ = router.pick([], None, (None, "agent-7"))
    assert moved is not first and router.pick([], None, (None, "agent-7"))[0] is moved
    affinity = CacheKeyAffinity(capacity=2)
    for i in range(3):
        affinity.set((None, str(i)), "a")
    assert len(affinity) == 2 and affinity.get((None, "0")) is None
    affinity.drop("a")
    assert len(affinity) == 0
