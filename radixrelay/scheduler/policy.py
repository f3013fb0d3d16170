"""Waiting-queue order: which queued request the prefill manager tries to admit first.

- ``fcfs``: queue order (retracted requests sit at the front, then arrival order).
- ``lpm``: longest cached prefix first (most reuse, least new compute); ties keep queue order. With
  KV tiers, a prefix continuing in host memory counts too (``extend``): a chat's later turn, whose
  history only needs loading, goes before a first turn that computes everything.
- ``dfs-weight``: group requests by the deepest tree node they match and walk the tree depth
  first, heavier subtrees (more waiting requests) first, so requests under one node run together
  and the node's KV is shared by the whole group (and by one cascade segment at decode).

Priority (``by_priority``, with ``enable_priority``): the order above regrouped by request priority,
smaller first; a queued request counts one level higher for every ``priority_ageing_s`` seconds it has
waited (ageing: a steady stream of higher-priority requests delays it, never forever). Within a level the
policy's order holds (a stable sort). A queue whose requests share one priority keeps the policy's order.

Cache-aware orders cost one tree walk per queued request, so queues longer than
``policy_queue_limit`` fall back to FCFS (and a queue of one needs no order: no walk). lpm keeps each
request's match until the tree's contents change (``RadixTree.version``), and then walks again only from
where the last walk ended (``RadixTree.peek_resumed``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence

from radixrelay.radix.tree import RadixNode, RadixTree
from radixrelay.scheduler.scheduler_config import SchedulerConfig
from radixrelay.scheduler.request import Request
from radixrelay.scheduler.match_hint import peek


def order_waiting(queue: Sequence[Request], tree: RadixTree, config: SchedulerConfig,
                  extend: Callable[[Request, int], int] | None = None) -> Iterable[Request]:
    """The queue in admission-priority order. FCFS returns the queue itself (no copy): the
    caller stops at the first request it cannot admit, so FCFS costs O(admitted). ``extend(req,
    matched)``: cached tokens continuing ``req``'s device match elsewhere (the host tier)."""
    policy = config.schedule_policy
    if (policy == "fcfs" or config.disable_radix_cache or len(queue) < 2
            or len(queue) > config.policy_queue_limit):
        return queue
    if policy == "lpm":
        matched = {id(r): _device_match(r, tree) for r in queue}
        if extend is not None:
            matched = {id(r): m + extend(r, m) for r in queue for m in (matched[id(r)],)}
        return sorted(queue, key=lambda r: -matched[id(r)])
    return _dfs_weight(queue, tree)


def by_priority(order: Iterable[Request], now: float, ageing_s: float) -> Iterable[Request]:
    """``order`` regrouped by aged priority (smaller first), stable within a level; ``order`` itself when
    every request has the same priority."""
    queue = order if isinstance(order, Sequence) else list(order)
    if not queue or all(r.priority == queue[0].priority for r in queue):
        return queue
    return sorted(queue, key=lambda r: r.priority - int((now - r.queued_at) // ageing_s))


def _device_match(req: Request, tree: RadixTree) -> int:
    """Cached tokens of ``req``'s prompt (all but its last token) in ``tree``: walked again only when the
    tree's contents or the request's tokens (a retracted request's outputs) changed since the last
    walk, so a queue waiting through steps that insert and evict nothing costs no walks; a walk resumes
    at the node the last one reached, while it is in the tree."""
    key = (tree.version, len(req.token_ids))
    if req.lpm_match is None or req.lpm_match[:2] != key:
        _, matched = peek(tree, req, len(req.token_ids) - 1)
        req.lpm_match = (*key, matched)
    return req.lpm_match[2]


def _dfs_weight(queue: Sequence[Request], tree: RadixTree) -> list[Request]:
    at_node: dict[RadixNode, list[Request]] = defaultdict(list)
    unmatched: list[Request] = []
    for req in queue:
        node, _ = tree.peek_prefix(req.token_ids, req.salt, length=len(req.token_ids) - 1)
        (unmatched if node is None or node.is_root else at_node[node]).append(req)
    weight: dict[RadixNode, int] = defaultdict(int)   # waiting requests in each subtree
    for node, reqs in at_node.items():
        walk: RadixNode | None = node
        while walk is not None:
            weight[walk] += len(reqs)
            walk = walk.parent
    order: list[Request] = []
    stack = sorted((r for r in tree.roots() if weight[r]), key=lambda n: weight[n])
    while stack:                       # heaviest on top; children pushed lightest first
        node = stack.pop()
        order.extend(at_node.get(node, ()))
        stack.extend(sorted((c for c in node.children.values() if weight[c]),
                            key=lambda n: weight[n]))
    return order + unmatched
