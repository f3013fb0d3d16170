"""The scheduler's side of KV events (``radixrelay.kv_events``): the page keys of what enters the
radix tree and of what eviction takes out of it, handed to a ``KVEventPublisher`` (which never blocks).

Keys are the lower tiers' (``radixrelay.radix.page_keys``, under ``SchedulerConfig.kv_namespace`` and the
request's salt), from the same ``ContentKeys`` as the tiers': a node's kept on the node
(``RadixNode.page_keys``), a request's on it (``Request.page_keys``, its tree path's read off the nodes), so
a prefix is hashed once whichever needs it first, and a request over a cached prefix hashes only its own
new pages.
"""

from __future__ import annotations

import time
from typing import Protocol

from radixrelay.radix.tree import RadixNode, RadixTree
from radixrelay.scheduler.content_keys import ContentKeys
from radixrelay.scheduler.request import Request

LOAD_EVERY_S = 1.0             # load events at most this often


class Publisher(Protocol):
    def stored(self, keys: list[bytes]) -> None: ...
    def removed(self, keys: list[bytes]) -> None: ...
    def cleared(self) -> None: ...
    def load(self, running: int, waiting: int, kv_usage: float) -> None: ...


def told_at_match(req: Request, num_pages: int) -> None:
    """At ``req``'s match: its first ``num_pages`` whole pages are the tree's, so events have told them."""
    req.events_told = num_pages


class KVEventHook:
    def __init__(self, publisher: Publisher, tree: RadixTree, keys: ContentKeys) -> None:
        self.publisher = publisher
        self.tree = tree
        self.page_size = tree.page_size
        self.keys = keys
        self._load_at = 0.0
        tree.on_evict = self._evicted

    def stored(self, req: Request, num_pages: int) -> None:
        """``req``'s first ``num_pages`` whole pages are in the tree; those not yet told are published."""
        if num_pages <= req.events_told:
            return
        keys = self.keys.ensure(req, num_pages)
        self.publisher.stored(keys[req.events_told:num_pages])
        req.events_told = num_pages

    def _evicted(self, leaf: RadixNode) -> None:
        """``leaf`` is about to leave the tree (still attached: its path gives its keys)."""
        path: list[RadixNode] = []
        node = leaf
        while node.parent is not None:
            path.append(node)
            node = node.parent
        path.reverse()
        self.keys.of_path(path, node.salt)          # fills the nodes' page_keys
        self.publisher.removed(list(leaf.page_keys))

    def cleared(self) -> None:
        self.publisher.cleared()

    def load(self, running: int, waiting: int, kv_usage: float) -> None:
        """At most once per ``LOAD_EVERY_S``."""
        now = time.monotonic()
        if now - self._load_at >= LOAD_EVERY_S:
            self._load_at = now
            self.publisher.load(running, waiting, kv_usage)
