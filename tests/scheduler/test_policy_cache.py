"""lpm keeps a waiting request's match while the tree's contents do not change: a queue waiting through
steps that insert and evict nothing is not walked again; an insert or an eviction is seen at once."""

from __future__ import annotations

from radixrelay.radix.tree import RadixTree
from radixrelay.sampling_params import SamplingParams
from radixrelay.scheduler.scheduler_config import SchedulerConfig
from radixrelay.scheduler.policy import order_waiting
from radixrelay.scheduler.request import Request

PS = 4


def request(rid: int, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), len(tokens), SamplingParams(max_tokens=4), None, rid)


def test_lpm_walks_again_only_after_the_tree_changed(monkeypatch):
    tree = RadixTree(PS)
    cfg = SchedulerConfig(kv_cache_tokens=1024, page_size=PS, schedule_policy="lpm")
    a = request(1, list(range(100, 140)))
    b = request(2, list(range(200, 240)))
    walks = []
    peek = tree.peek_resumed
    monkeypatch.setattr(tree, "peek_resumed", lambda *args, **kw: walks.append(1) or peek(*args, **kw))
    assert list(order_waiting([a, b], tree, cfg)) == [a, b] and len(walks) == 2
    assert list(order_waiting([a, b], tree, cfg)) == [a, b] and len(walks) == 2      # nothing changed
    tree.insert(list(range(200, 216)), [1, 2, 3, 4])                                 # b's first 16 tokens
    assert list(order_waiting([a, b], tree, cfg)) == [b, a] and len(walks) == 4
    b.token_ids.append(7)                                # retracted with an output: its tokens changed
    assert list(order_waiting([a, b], tree, cfg)) == [b, a] and len(walks) == 5
    assert tree.evict(4) == [1, 2, 3, 4]
    assert list(order_waiting([b, a], tree, cfg)) == [b, a] and len(walks) == 7      # ties: queue order
    assert a.lpm_match[2] == b.lpm_match[2] == 0
