"""The scheduler's side of KV events (``radixrelay.kv_events``): the page keys of what enters the
radix tree and of what eviction takes out of it, of what enters and leaves the lower tiers (host memory,
disk; ``KVTiers.take_changes``, with a snapshot of both every ``SNAPSHOT_EVERY_S`` and when the tiers lost
track), and the replica's load with its measured rates, handed to a ``KVEventPublisher`` (which never
blocks). Every ``SNAPSHOT_EVERY_S`` the device's pages are announced whole too (``cleared``, then
``stored`` of every key the tree holds), so a router that missed entries catches up.

Keys are the lower tiers' (``radixrelay.radix.page_keys``, under ``SchedulerConfig.kv_namespace`` and the
request's salt), from the same ``ContentKeys`` as the tiers': a node's kept on the node
(``RadixNode.page_keys``), a request's on it (``Request.prefix_keys``, its tree path's read off the nodes), so
a prefix is hashed once whichever needs it first, and a request over a cached prefix hashes only its own
new pages.
"""

from __future__ import annotations

import time
from itertools import groupby
from operator import itemgetter
from typing import Protocol

from radixrelay.radix.tiers import KVTiers
from radixrelay.radix.tree import RadixNode, RadixTree
from radixrelay.scheduler.content_keys import ContentKeys
from radixrelay.scheduler.request import Request

LOAD_EVERY_S = 1.0             # load events at most this often
SNAPSHOT_EVERY_S = 60.0        # the lower tiers' keys announced whole this often (routers that missed entries)


class Publisher(Protocol):
    def stored(self, keys: list[bytes]) -> None: ...
    def removed(self, keys: list[bytes]) -> None: ...
    def cleared(self) -> None: ...
    def tier_stored(self, tier: str, keys: list[bytes]) -> None: ...
    def tier_removed(self, tier: str, keys: list[bytes]) -> None: ...
    def tier_cleared(self, tier: str) -> None: ...
    def load(self, running: int, waiting: int, kv_usage: float, rates: dict[str, float] | None = None) -> None: ...


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
        self._snapshot_at: float | None = None      # the lower tiers' last snapshot (None: none yet)
        self._device_snapshot_at = time.monotonic()   # the device's (its first events are its whole state)
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

    def tiers(self, store: KVTiers) -> None:
        """What entered or left host memory and disk since the last call, in order (runs of one tier and
        direction in one entry); instead, a snapshot of both (``tier_cleared``, then the keys held) at the
        first call, every ``SNAPSHOT_EVERY_S`` and when ``store`` lost track."""
        changes = store.take_changes()
        now = time.monotonic()
        if changes is None or self._snapshot_at is None or now - self._snapshot_at >= SNAPSHOT_EVERY_S:
            self._snapshot_at = now
            host, disk = store.snapshot()
            for tier, keys in (("host", host), ("disk", disk)) if store.has_disk else (("host", host),):
                self.publisher.tier_cleared(tier)
                if keys:
                    self.publisher.tier_stored(tier, keys)
            return
        for (tier, entered), run in groupby(changes, key=itemgetter(0, 1)):
            keys = [key for _, _, key in run]
            (self.publisher.tier_stored if entered else self.publisher.tier_removed)(tier, keys)

    def load(self, running: int, waiting: int, kv_usage: float, rates: dict[str, float] | None = None) -> None:
        """At most once per ``LOAD_EVERY_S``; ``rates``: the measured ones (``kv_schema.RATES``)."""
        now = time.monotonic()
        if now - self._load_at >= LOAD_EVERY_S:
            self._load_at = now
            self.publisher.load(running, waiting, kv_usage, rates)
        if now - self._device_snapshot_at >= SNAPSHOT_EVERY_S:
            self._device_snapshot_at = now
            self.publisher.cleared()
            keys = self.keys.of_tree()
            if keys:
                self.publisher.stored(keys)
