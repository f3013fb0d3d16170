"""Radix tree of token-id prefixes mapping cached prefixes to KV page ids.

Structure: one root per cache salt (``None`` is the default namespace); requests with different
salts never share a node. Each non-root node holds a run of tokens (``key``: an int32 array,
``radix.tokens``) and the pages holding their KV (``pages``); a path root -> node spells a cached prefix
and the concatenated pages are that prefix's page list.

Matching is exact and at C speed: a child is found by its first page's bytes (a dict lookup), then its
key is compared with the prompt's tokens in one array pass (``_common_pages``), so a walk costs a few
Python steps per node on the path plus memcmp-speed passes over the matched tokens. No hash stands in
for tokens: two prompts share a node only if their tokens are equal. (A per-page hash of the prompt,
even computed with numpy in one pass, costs far more than the compare that would have to confirm it:
benchmarks/results/HISTORY.md, 2026-11-29.) Token arrays are accepted in any form
(``as_tokens``); a request's ``TokenArray`` or an int32 array is used without a copy.

Invariants (checked by ``check_integrity``):
- page alignment: every key length is a positive multiple of ``page_size`` and
  ``len(pages) == len(key) // page_size``, so every node begins at a page boundary; only whole pages
  are ever cached or matched;
- children are keyed by the bytes of the first page of their key (``key[:page_size].tobytes()``), so
  siblings never share a first page;
- ``lock_ref`` counts the holders whose path passes through the node; a lock on a node implies one
  on every ancestor, so ``parent.lock_ref >= child.lock_ref``. Locked nodes are never evicted, and
  a holder's page ids stay valid only while its node is locked;
- ``_evictable_leaves`` is exactly the set of non-root leaves with ``lock_ref == 0``;
  ``_cached_tokens`` / ``_evictable_tokens`` sum key lengths over all / unlocked nodes;
- pins (``pin``/``unpin``: pinned prefixes, ``radixrelay.scheduler.pins``) are locks that also count in
  ``pin_ref``: ``parent.pin_ref >= child.pin_ref`` and ``lock_ref >= pin_ref``; ``_pinned_tokens`` sums
  key lengths over nodes with ``pin_ref > 0`` (overlapping pins count their shared tokens once).

Eviction order: lowest priority first (``priority``: the scheduler's request priority, a larger number is
lower; a node counts at the highest priority of the requests that locked it since it was last unlocked,
``lock``), then least recently used. With every request at the default priority 0 that is plain LRU.

The tree deals in page ids only; evicted pages are returned to the caller, who frees them.
All operations cost O(path depth) Python steps plus C-speed passes over the matched or inserted
tokens; eviction costs
O(evictable leaves + evicted nodes * log(evictable leaves)).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from radixrelay.radix.tokens import TOKEN_DTYPE, TokenArray, as_tokens, first_difference

Tokens = TokenArray | np.ndarray | Sequence[int]


_EMPTY = np.empty(0, dtype=TOKEN_DTYPE)          # a root's key


class RadixNode:
    __slots__ = ("node_id", "key", "pages", "children", "parent", "lock_ref", "last_access", "salt", "page_keys",
                 "pin_ref", "priority", "first_pages")

    def __init__(self, node_id: int, key: np.ndarray, pages: list[int],
                 parent: RadixNode | None, salt: str | None = None) -> None:
        self.node_id = node_id
        # token ids (int32), len a multiple of page_size; never written (a split takes views of it, so
        # the parts of a split node share one buffer)
        self.key = key
        self.pages = pages                              # len(key) // page_size page ids
        self.children: dict[bytes, RadixNode] = {}      # by the bytes of the child's first page
        self.parent = parent                            # None only for a namespace root
        self.lock_ref = 0
        self.pin_ref = 0                                # of lock_ref: pins (pinned prefixes)
        self.priority = 0                               # eviction class: larger evicted first
        self.last_access = 0                            # logical clock, larger = more recent
        self.salt = salt                                # meaningful on roots only
        # Lower KV tiers' content keys of ``pages`` (``radix.page_keys``), once computed; None before.
        # They name the prefix ending at each page, so they hold as long as the node does.
        self.page_keys: list[bytes] | None = None
        # The children's keys and their first pages as one int32 array [len(children), page_size], made by
        # ``partial_page`` and dropped when a child is added or removed (a split keeps the key set).
        self.first_pages: tuple[list[bytes], np.ndarray] | None = None

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def __repr__(self) -> str:
        return f"RadixNode(id={self.node_id}, tokens={len(self.key)}, lock_ref={self.lock_ref})"


@dataclass(frozen=True)
class MatchResult:
    node: RadixNode | None  # deepest matched node, None when nothing matched; lock it to keep pages
    pages: list[int]        # page ids of the matched prefix, root to node
    num_tokens: int         # == len(pages) * page_size


class RadixTree:
    def __init__(self, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"RadixTree: page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self._ids = itertools.count()
        self._clock = itertools.count(1)
        self.splits = 0                 # nodes split so far: paths above a split get new node ids
        # Bumped whenever the cached contents change (a leaf added, pages evicted): a match length
        # computed at one version holds until the next (splits change nodes, not what matches).
        self.version = 0
        self._roots: dict[str | None, RadixNode] = {}
        self._evictable_leaves: set[RadixNode] = set()
        self._cached_tokens = 0
        self._evictable_tokens = 0
        self._pinned_tokens = 0
        # Called with each leaf eviction is about to detach (its path to the root still intact): KV
        # events (``radixrelay.scheduler.kv_event_hook``).
        self.on_evict: Callable[[RadixNode], None] | None = None

    # -- statistics --------------------------------------------------------------------------

    @property
    def cached_tokens(self) -> int:
        return self._cached_tokens

    @property
    def evictable_tokens(self) -> int:
        return self._evictable_tokens

    @property
    def pinned_tokens(self) -> int:
        """Tokens of nodes some pin holds (each counted once)."""
        return self._pinned_tokens

    @property
    def locked_tokens(self) -> int:
        return self._cached_tokens - self._evictable_tokens

    @property
    def evictable_pages(self) -> int:
        return self._evictable_tokens // self.page_size

    # -- lookups -----------------------------------------------------------------------------

    def match_prefix(self, token_ids: Tokens, salt: str | None = None,
                     start: tuple[RadixNode, int] | None = None, length: int | None = None) -> MatchResult:
        """Longest cached whole-page prefix of ``token_ids``; splits a node the match ends inside
        (on a page boundary) so that the result is exactly a root-to-node path. Marks the path
        used. ``start`` = (node, its end position): a node whose root path spells
        ``token_ids[:position]`` (e.g. a locked one); the walk begins there, and the result's pages
        are only those below it. ``length``: match ``token_ids[:length]`` (without copying it)."""
        node, num_tokens, pages, _ = self._walk(token_ids, salt, split=True, start=start, length=length)
        if node is None or node.parent is None:
            return MatchResult(None, [], 0)
        self._touch(node)
        return MatchResult(node, pages, num_tokens)

    def match_prefix_below(self, token_ids: Tokens, node: RadixNode, salt: str | None = None,
                           length: int | None = None) -> MatchResult:
        """``match_prefix`` when ``node`` is known to spell a prefix of ``token_ids`` (e.g. from
        ``peek_prefix`` of the same tokens just before): only the tokens below it are compared, the
        pages above are read off the path."""
        if node.parent is None:
            return self.match_prefix(token_ids, salt, length=length)
        above = self.path(node)
        end = sum(len(n.key) for n in above)
        # a walk from a non-root node ends at that node or below it: never without a node
        below = self.match_prefix(token_ids, salt, start=(node, end), length=length)
        pages: list[int] = []
        for n in above:
            pages.extend(n.pages)
        pages.extend(below.pages)
        return MatchResult(below.node, pages, below.num_tokens)

    def peek_prefix(self, token_ids: Tokens, salt: str | None = None,
                    start: tuple[RadixNode, int] | None = None,
                    length: int | None = None) -> tuple[RadixNode | None, int]:
        """Read-only match for scheduling policies: the deepest fully matched node (None for an
        unknown salt, the root when nothing matched) and the matched length, which may end inside
        one of its children. Changes neither structure nor LRU. ``start``, ``length``: as for
        ``match_prefix``."""
        node, num_tokens, _, _ = self._walk(token_ids, salt, split=False, start=start, length=length)
        return node, num_tokens

    def peek_resumed(self, token_ids: Tokens, salt: str | None, hint: tuple[RadixNode, int] | None,
                     length: int | None = None) -> tuple[tuple[RadixNode, int] | None, int]:
        """``peek_prefix`` that resumes from ``hint`` = (node, the position it ends at), returned by an
        earlier call for a prefix of the same tokens, while that node is still in the tree: then only the
        tokens below it are compared, and a queue re-peeked every step costs O(new pages) per request,
        not O(prompt). Returns (the hint for the next call: the deepest fully matched node and its end,
        None when nothing matched) and the matched length (as ``peek_prefix``).

        A hint stays exact while its node is attached: a split above it keeps its end position, and
        eviction detaches whatever it removes (a partly evicted leaf's removed part is the old node)."""
        end = len(token_ids) if length is None else min(length, len(token_ids))
        start = hint if hint is not None and hint[1] <= end and self._attached(hint[0], salt) else None
        node, matched, _, node_end = self._walk(token_ids, salt, split=False, start=start, length=length)
        return ((node, node_end) if node is not None and node.parent is not None else None), matched

    def partial_page(self, token_ids: Tokens, node: RadixNode | None, pos: int, limit: int,
                     salt: str | None = None) -> tuple[RadixNode, int] | None:
        """Where a whole-page match ends (at ``node``, ending at position ``pos``; None: nothing
        matched, the salt's root), the child of that node whose first page begins with the longest run of
        ``token_ids[pos:pos + limit]`` and that run's length (>= 1), or None. A copy of those leading
        tokens' KV spares computing them again: the page-granular match stops one page short of a
        prompt that diverges mid-page (a question after a document whose last token it merged with).
        One vectorized compare of every child's first page (the children's dict keys are those bytes, kept
        as one array on the node while its children stay the same)."""
        ps = self.page_size
        parent = node if node is not None else self._roots.get(salt)
        if parent is None or not parent.children or limit <= 0:
            return None
        m = min(limit, ps)
        want = as_tokens(token_ids, pos + m)[pos:pos + m]
        if len(want) < m:
            return None
        if parent.first_pages is None:
            keys = list(parent.children)
            parent.first_pages = keys, np.frombuffer(b"".join(keys), dtype=TOKEN_DTYPE).reshape(len(keys), ps)
        keys, firsts = parent.first_pages
        rows = np.flatnonzero(firsts[:, 0] == want[0])          # the children that share a first token
        if not len(rows):
            return None
        runs = np.logical_and.accumulate(firsts[rows, :m] == want, axis=1).sum(axis=1)
        best = int(runs.argmax())
        return parent.children[keys[rows[best]]], int(runs[best])

    def _attached(self, node: RadixNode, salt: str | None) -> bool:
        """Whether ``node`` is still in the tree, under ``salt``'s root. O(depth)."""
        ps = self.page_size
        while node.parent is not None:
            if node.parent.children.get(node.key[:ps].tobytes()) is not node:
                return False
            node = node.parent
        return self._roots.get(salt) is node

    def path(self, node: RadixNode) -> list[RadixNode]:
        """Non-root nodes from the namespace root down to ``node``."""
        out: list[RadixNode] = []
        while node.parent is not None:
            out.append(node)
            node = node.parent
        out.reverse()
        return out

    def roots(self) -> list[RadixNode]:
        return list(self._roots.values())

    # -- updates -----------------------------------------------------------------------------

    def insert(self, token_ids: Tokens, pages: list[int], salt: str | None = None,
               start: tuple[RadixNode, int] | None = None, length: int | None = None,
               priority: int = 0) -> int:
        """Cache ``token_ids[:length]`` (all of it by default; a whole number of pages) with KV in
        ``pages``.

        Returns the length of the prefix that was already cached. The tree adopts
        ``pages[existing // page_size:]``; the caller still owns ``pages[:existing // page_size]``
        and must free those that are not the tree's own (its duplicates). ``start``: as for
        ``match_prefix`` (the walk, and its cost, begins below that node). ``priority``: the new
        leaf's eviction class (``lock``).
        """
        ps = self.page_size
        token_ids = as_tokens(token_ids, length)
        n = len(token_ids) if length is None else length
        if n % ps or len(pages) * ps != n or n > len(token_ids):
            raise ValueError(f"RadixTree.insert: {n} tokens / {len(pages)} pages "
                             f"are not whole pages of size {ps}")
        if not n:
            return 0
        node, existing, _, _ = self._walk(token_ids, salt, split=True, start=start, length=n)
        if node is None:
            node = self._roots[salt] = RadixNode(next(self._ids), _EMPTY, [], None, salt)
        if existing < n:
            self.version += 1
            # a copy: the node must not keep the caller's (growing) buffer alive
            leaf = RadixNode(next(self._ids), token_ids[existing:n].copy(), pages[existing // ps:], node)
            leaf.priority = priority
            if not node.children and node.lock_ref == 0:
                self._evictable_leaves.discard(node)
            node.children[leaf.key[:ps].tobytes()] = leaf
            node.first_pages = None
            self._evictable_leaves.add(leaf)
            self._cached_tokens += len(leaf.key)
            self._evictable_tokens += len(leaf.key)
            node = leaf
        self._touch(node)
        return existing

    def lock(self, node: RadixNode, priority: int | None = None) -> None:
        """Lock the path root -> ``node``: none of it is evicted until ``unlock(node)``. ``priority``
        (a request's; smaller is higher): each node of the path counts at the highest priority of the
        requests that locked it since it was last unlocked (its eviction class)."""
        while node.parent is not None:
            if node.lock_ref == 0:
                self._evictable_tokens -= len(node.key)
                self._evictable_leaves.discard(node)
                if priority is not None:
                    node.priority = priority
            elif priority is not None and priority < node.priority:
                node.priority = priority
            node.lock_ref += 1
            node = node.parent

    def pin(self, node: RadixNode) -> None:
        """A lock on the path root -> ``node`` counted as a pin (``pinned_tokens``); ``unpin`` ends it."""
        self.lock(node)
        while node.parent is not None:
            if node.pin_ref == 0:
                self._pinned_tokens += len(node.key)
            node.pin_ref += 1
            node = node.parent

    def unpin(self, node: RadixNode) -> None:
        walk = node
        while walk.parent is not None:
            if walk.pin_ref <= 0:
                raise ValueError(f"RadixTree.unpin: {walk} is not pinned")
            walk.pin_ref -= 1
            if walk.pin_ref == 0:
                self._pinned_tokens -= len(walk.key)
            walk = walk.parent
        self.unlock(node)

    def unlock(self, node: RadixNode) -> None:
        while node.parent is not None:
            if node.lock_ref <= 0:
                raise ValueError(f"RadixTree.unlock: {node} is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable_tokens += len(node.key)
                if not node.children:
                    self._evictable_leaves.add(node)
            node = node.parent

    def evict(self, num_pages: int) -> list[int]:
        """Evict unlocked leaves, lowest priority then least recently used first, until ``num_pages``
        pages are freed (fewer only when nothing evictable is left). A leaf longer than what is still
        needed loses only its tail pages: the prefix other requests would match stays cached. Returns
        the freed page ids; the caller frees them."""
        heap = [(-n.priority, n.last_access, n.node_id, n) for n in self._evictable_leaves]
        heapq.heapify(heap)
        freed: list[int] = []
        while len(freed) < num_pages and heap:
            leaf = heapq.heappop(heap)[-1]
            keep = len(leaf.pages) - (num_pages - len(freed))
            if keep > 0:
                self._evictable_leaves.add(self._split(leaf, keep * self.page_size))
            parent = leaf.parent
            assert parent is not None  # roots are never in _evictable_leaves
            if self.on_evict is not None:
                self.on_evict(leaf)
            del parent.children[leaf.key[:self.page_size].tobytes()]
            parent.first_pages = None
            self._evictable_leaves.discard(leaf)
            self._cached_tokens -= len(leaf.key)
            self._evictable_tokens -= len(leaf.key)
            freed.extend(leaf.pages)
            self.version += 1
            if parent.children:
                continue
            if parent.parent is not None:
                if parent.lock_ref == 0:
                    self._evictable_leaves.add(parent)
                    heapq.heappush(heap, (-parent.priority, parent.last_access, parent.node_id, parent))
            elif parent.salt is not None:
                del self._roots[parent.salt]   # drop empty salted namespaces (unbounded salts)
        return freed

    # -- integrity ---------------------------------------------------------------------------

    def nodes(self) -> Iterator[RadixNode]:
        """Every non-root node, depth first."""
        stack = [c for r in self._roots.values() for c in r.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check_integrity(self) -> None:
        ps = self.page_size
        cached = evictable = pinned = 0
        leaves: set[RadixNode] = set()
        for salt, root in self._roots.items():
            if root.salt != salt or root.parent is not None or len(root.key) or root.pages:
                raise AssertionError(f"RadixTree: bad root for salt {salt!r}")
        for node in [*self._roots.values(), *self.nodes()]:
            if node.first_pages is not None and node.first_pages[0] != list(node.children):
                raise AssertionError(f"RadixTree: {node}'s first pages are stale")
        for node in self.nodes():
            parent = node.parent
            if not isinstance(node.key, np.ndarray) or node.key.dtype != TOKEN_DTYPE or node.key.ndim != 1:
                raise AssertionError(f"RadixTree: {node}'s key is not an int32 array")
            if parent is None or parent.children.get(node.key[:ps].tobytes()) is not node:
                raise AssertionError(f"RadixTree: {node} is not reachable under its first page")
            if not len(node.key) or len(node.key) % ps or len(node.pages) * ps != len(node.key):
                raise AssertionError(f"RadixTree: {node} is not page aligned")
            if node.lock_ref < 0 or (not parent.is_root and parent.lock_ref < node.lock_ref):
                raise AssertionError(f"RadixTree: {node} lock_ref exceeds its parent's")
            if not 0 <= node.pin_ref <= node.lock_ref or (not parent.is_root and parent.pin_ref < node.pin_ref):
                raise AssertionError(f"RadixTree: {node} pin_ref exceeds its lock_ref or its parent's")
            cached += len(node.key)
            pinned += len(node.key) if node.pin_ref else 0
            if node.lock_ref == 0:
                evictable += len(node.key)
                if not node.children:
                    leaves.add(node)
        if cached != self._cached_tokens or evictable != self._evictable_tokens:
            raise AssertionError(f"RadixTree: counters ({self._cached_tokens}, "
                                 f"{self._evictable_tokens}) != recount ({cached}, {evictable})")
        if pinned != self._pinned_tokens:
            raise AssertionError(f"RadixTree: pinned tokens {self._pinned_tokens} != recount {pinned}")
        if leaves != self._evictable_leaves:
            raise AssertionError("RadixTree: evictable-leaf set is stale")

    # -- internals ---------------------------------------------------------------------------

    def _walk(self, token_ids: Tokens, salt: str | None, split: bool,
              start: tuple[RadixNode, int] | None = None,
              length: int | None = None) -> tuple[RadixNode | None, int, list[int], int]:
        """Follow whole pages of ``token_ids[:length]`` down from the salt's root (or from ``start``:
        a node and the position it ends at; the pages returned are then those below it).

        Returns (deepest node on the match, matched tokens, matched pages, the position that node ends
        at); the node is None when the salt has no namespace yet (roots are created by ``insert``
        only). With ``split`` a match ending inside a node splits it, so the node returned ends
        exactly at the match; without, the node is the deepest *fully* matched one and the count may
        go further.
        """
        ps = self.page_size
        token_ids = as_tokens(token_ids, length)
        end = len(token_ids) if length is None else min(length, len(token_ids))
        end -= end % ps
        node, pos = start if start is not None else (self._roots.get(salt), 0)
        pages: list[int] = []
        if node is None:
            return None, 0, pages, 0
        while pos < end:
            child = node.children.get(token_ids[pos:pos + ps].tobytes())
            if child is None:
                break
            key = child.key
            limit = min(len(key), end - pos)    # both page multiples
            n = self._common_pages(key, token_ids, pos, limit)
            if n < len(key):
                if not split:
                    return node, pos + n, pages, pos
                child = self._split(child, n)
            pages.extend(child.pages)
            pos += n
            node = child
            if n < len(key):
                break
        return node, pos, pages, pos

    def _common_pages(self, key: np.ndarray, token_ids: np.ndarray, pos: int, limit: int) -> int:
        """Tokens in the longest whole-page common prefix of ``key`` and ``token_ids[pos:]``, up
        to ``limit``; the first page is known to match. One array compare (C speed)."""
        ps = self.page_size
        if limit <= ps:
            return limit
        same = first_difference(key[ps:limit], token_ids[pos + ps:pos + limit])
        return ps + same - same % ps

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Cut ``node`` after ``at`` tokens (a page multiple); returns the new upper part, which
        inherits the lock count (every lock through ``node`` passes through it) and recency."""
        ps = self.page_size
        parent = node.parent
        assert parent is not None and 0 < at < len(node.key) and at % ps == 0
        self.splits += 1
        upper = RadixNode(next(self._ids), node.key[:at], node.pages[: at // ps], parent)
        upper.lock_ref = node.lock_ref
        upper.pin_ref = node.pin_ref
        upper.priority = node.priority
        upper.last_access = node.last_access
        parent.children[upper.key[:ps].tobytes()] = upper
        node.key = node.key[at:]
        node.pages = node.pages[at // ps:]
        if node.page_keys is not None:
            upper.page_keys, node.page_keys = node.page_keys[: at // ps], node.page_keys[at // ps:]
        node.parent = upper
        upper.children[node.key[:ps].tobytes()] = node
        return upper

    def _touch(self, node: RadixNode) -> None:
        now = next(self._clock)
        while node.parent is not None:
            node.last_access = now
            node = node.parent
