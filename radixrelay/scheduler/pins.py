"""Pinned prefixes: prompt prefixes kept in the radix cache, unevicted, until a time-to-live has passed
since their last use (OpenAI's ``prompt_cache_retention``, Anthropic's ``cache_control`` marks).

A pin is a lock on the radix path of its prefix (``RadixTree.pin``), so its pages are never evicted and
its nodes keep their identity: the pinned node always ends at the pin's boundary (a split above it keeps
its end; eviction never touches a locked node). Pins are keyed by (salt, the prefix's tokens): a pin of
the same prefix under the same salt is one pin, refreshed (its expiry pushed to now + its TTL, the
longer TTL kept) by every request that asks for it again and by every admission whose cached prefix
covers it (``touch``). Different salts never share a pin.

Life of a pin asked by a request (``PinSpec``: tokens, TTL):
  reserve (arrival: counted against the budget, or refused past it) -> establish (once the request's
  computed prefix is in the tree: after its prefill, ``CacheManager.share_computed_prefix``, else when
  it leaves, ``CacheManager.release``) -> refreshed by hits -> expire (``expire``, each schedule) or
  yield (``yield_one``: a request that cannot fit with nothing running takes pinned pages back, soonest
  expiry first) or cleared (``clear``: cache flush).

With KV tiers, a pinned prefix's pages, saved to host memory as every cached page is when they enter the
tree, are pinned there too (``TierCoordinator.pin``: host eviction passes them over) for the pin's life, so
a pin that yields or expires is still a host-memory hit for a while.

Budget: ``pinned_kv_tokens`` counts the tokens the tree holds pinned (``RadixTree.pinned_tokens``, each
once however many pins overlap it) plus the reservations of pins not yet established (each counted in
full less what is already pinned on its path at arrival). A new pin past it is refused (ValueError: a
400 at the server). Only this class writes pins (and the tree's pin counts).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from radixrelay.radix.tokens import TokenArray
from radixrelay.radix.tree import RadixNode, RadixTree

PinKey = tuple[str | None, bytes]            # (salt, the prefix's int32 token bytes)


@dataclass(eq=False)
class Pin:
    key: PinKey
    node: RadixNode            # end of the pinned path (``RadixTree.pin`` holds it)
    num_tokens: int
    ttl_s: float               # seconds after the last use (already scaled by ``ttl_scale``)
    expires: float             # clock time
    tier_keys: object = None   # what ``PinTable.on_pin`` returned (the host tier's pinned keys)


@dataclass(eq=False)
class PendingPin:
    """A pin a live request asked for, not established yet; its reservation is shared by every request
    asking for the same key."""
    key: PinKey
    num_tokens: int
    ttl_s: float


@dataclass
class _Reservation:
    tokens: int
    holders: int = 1


@dataclass
class PinCounters:
    created: int = 0           # pins established
    expired: int = 0           # pins dropped after their TTL
    yielded: int = 0           # pins dropped to make room for a request that could not fit otherwise
    hits: int = 0              # admissions whose cached prefix covered a pin (each refreshes it)
    refused: int = 0           # pins refused past the budget


@dataclass
class PinTable:
    tree: RadixTree
    budget_tokens: int
    ttl_scale: float = 1.0
    clock: Callable[[], float] = field(default=lambda: 0.0)
    counters: PinCounters = field(default_factory=PinCounters)
    # the lower tiers' side (``TierCoordinator.pin`` / ``unpin``), None without tiers
    on_pin: Callable[[RadixNode, str | None], object] | None = None
    on_unpin: Callable[[object], None] | None = None

    def __post_init__(self) -> None:
        self._pins: dict[PinKey, Pin] = {}
        self._by_node: dict[RadixNode, Pin] = {}
        self._reserved: dict[PinKey, _Reservation] = {}
        self._reserved_tokens = 0
        self._expiry: list[tuple[float, int, PinKey]] = []      # lazy heap: a popped entry is checked
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._pins)

    @property
    def pinned_tokens(self) -> int:
        return self.tree.pinned_tokens

    @property
    def reserved_tokens(self) -> int:
        return self._reserved_tokens

    # -- arrival --------------------------------------------------------------------------------

    def reserve(self, rid: int, tokens: TokenArray, salt: str | None,
                asked: list[tuple[int, float]]) -> list[PendingPin]:
        """The pins a request asks for, as ``(whole-page tokens, unscaled TTL)``, reserved against the
        budget; an already established one is refreshed instead. ValueError (nothing reserved) when the
        budget cannot take them."""
        self.expire()
        now = self.clock()
        pending: list[PendingPin] = []
        new: dict[PinKey, int] = {}
        for n, ttl in asked:
            key = (salt, tokens.array[:n].tobytes())
            ttl_s = ttl * self.ttl_scale
            pin = self._pins.get(key)
            if pin is not None:
                pin.ttl_s = max(pin.ttl_s, ttl_s)
                self._refresh(pin, now)
                continue
            pending.append(PendingPin(key, n, ttl_s))
            if key not in self._reserved and key not in new:
                new[key] = n - self._pinned_on_path(tokens, salt, n)
        cost = sum(new.values())
        used = self.tree.pinned_tokens + self._reserved_tokens
        if used + cost > self.budget_tokens:
            self.counters.refused += 1
            longest = max(p.num_tokens for p in pending)
            if self.budget_tokens == 0:
                raise ValueError(f"request {rid}: pinned prefixes are disabled on this server "
                                 f"(pinned KV budget 0 tokens: --pinned-kv-tokens)")
            raise ValueError(f"request {rid}: pinning {longest} prompt tokens would exceed the pinned KV "
                             f"budget ({used} of {self.budget_tokens} tokens pinned or being pinned; "
                             f"--pinned-kv-tokens)")
        for p in pending:
            res = self._reserved.get(p.key)
            if res is None:
                self._reserved[p.key] = _Reservation(new[p.key])
                self._reserved_tokens += new[p.key]
            else:
                res.holders += 1
        return pending

    def _pinned_on_path(self, tokens: TokenArray, salt: str | None, n: int) -> int:
        node, _ = self.tree.peek_prefix(tokens.array, salt, length=n)
        if node is None or node.is_root:
            return 0
        return sum(len(x.key) for x in self.tree.path(node) if x.pin_ref)

    def unreserve(self, pending: list[PendingPin]) -> None:
        """The request holding ``pending`` left (or established them): their reservations end."""
        for p in pending:
            res = self._reserved.get(p.key)
            if res is None:
                continue
            res.holders -= 1
            if res.holders <= 0:
                del self._reserved[p.key]
                self._reserved_tokens -= res.tokens

    # -- establishment, hits ----------------------------------------------------------------------

    def establish(self, p: PendingPin, node: RadixNode) -> None:
        """``node`` ends exactly ``p``'s prefix (under its salt) in the tree: pin it (or refresh the pin
        another request established meanwhile)."""
        now = self.clock()
        pin = self._pins.get(p.key)
        if pin is not None:
            pin.ttl_s = max(pin.ttl_s, p.ttl_s)
            self._refresh(pin, now)
            return
        self.tree.pin(node)
        pin = Pin(p.key, node, p.num_tokens, p.ttl_s, now + p.ttl_s)
        if self.on_pin is not None:
            pin.tier_keys = self.on_pin(node, p.key[0])
        self._pins[p.key] = pin
        self._by_node[node] = pin
        heapq.heappush(self._expiry, (pin.expires, next(self._seq), p.key))
        self.counters.created += 1

    def touch(self, node: RadixNode) -> None:
        """An admission matched the path root -> ``node``: every pin on it is refreshed."""
        if not self._by_node:
            return
        now = self.clock()
        while node.parent is not None:
            if node.pin_ref:
                pin = self._by_node.get(node)
                if pin is not None:
                    self._refresh(pin, now)
                    self.counters.hits += 1
            node = node.parent

    def _refresh(self, pin: Pin, now: float) -> None:
        pin.expires = max(pin.expires, now + pin.ttl_s)    # the heap entry is corrected when popped

    # -- ending pins ----------------------------------------------------------------------------

    def expire(self) -> int:
        """Drop the pins whose TTL has passed since their last use; returns how many."""
        heap = self._expiry
        if not heap:
            return 0
        now = self.clock()
        dropped = 0
        while heap and heap[0][0] <= now:
            _, _, key = heapq.heappop(heap)
            pin = self._pins.get(key)
            if pin is None:
                continue
            if pin.expires > now:                         # refreshed since: requeued at its expiry
                heapq.heappush(heap, (pin.expires, next(self._seq), key))
                continue
            self._drop(pin)
            self.counters.expired += 1
            dropped += 1
        return dropped

    def yield_one(self) -> bool:
        """Drop the pin that would expire soonest (to make room); False when there is none."""
        if not self._pins:
            return False
        pin = min(self._pins.values(), key=lambda p: p.expires)
        self._drop(pin)
        self.counters.yielded += 1
        return True

    def clear(self) -> None:
        for pin in list(self._pins.values()):
            self._drop(pin)
        self._expiry.clear()

    def _drop(self, pin: Pin) -> None:
        del self._pins[pin.key]
        del self._by_node[pin.node]
        self.tree.unpin(pin.node)
        if self.on_unpin is not None:
            self.on_unpin(pin.tier_keys)

    def check_integrity(self) -> None:
        for pin in self._pins.values():
            if self._by_node.get(pin.node) is not pin or pin.node.pin_ref <= 0:
                raise AssertionError(f"pin of {pin.num_tokens} tokens is not held in the tree")
            if sum(len(n.key) for n in self.tree.path(pin.node)) != pin.num_tokens:
                raise AssertionError(f"pinned node no longer ends at its pin's {pin.num_tokens} tokens")
        if self._reserved_tokens != sum(r.tokens for r in self._reserved.values()):
            raise AssertionError("pin reservations are stale")
