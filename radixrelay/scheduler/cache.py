"""Cache manager: the page allocator plus the radix tree, seen from requests.

Page ownership (checked by ``check_integrity``): every page is in exactly one of
  the free list | a tree node | the private tail ``pages[num_shared_pages:]`` of one running
  request;
a running request's ``pages[:num_shared_pages]`` are the pages of its locked tree path. So
``free + cached + in use == capacity``.

A request leaves (finish, retraction) by inserting its computed whole pages into the tree (the next
turn of a chat, or its own resumption, hits them), freeing pages the tree already had (duplicates
computed concurrently) and its last partial page, and unlocking its path. Aborts just free.

Lower tiers (``radixrelay.radix.tiers``, optional): whole pages that enter the tree are saved to host
memory once (their node stays locked until the worker acknowledges the copy, so device eviction never
waits for one); an admission continues its device match with the pages host memory holds, loading
them into fresh device pages (``promote``); requests near the head of the queue get their pages on
disk read into host memory ahead of their turn (``prefetch_window``).
"""

from __future__ import annotations

from collections.abc import Iterable

from radixrelay.protocol.kv import KVAcks, KVTransfers
from radixrelay.protocol.step import ModuleSpan
from radixrelay.radix.allocator import PageAllocator
from radixrelay.radix.page_keys import chain_seed, extend_keys
from radixrelay.radix.tiers import KVTiers
from radixrelay.radix.tree import RadixNode, RadixTree
from radixrelay.scheduler.config import SchedulerConfig
from radixrelay.scheduler.request import Request


class CacheManager:
    def __init__(self, config: SchedulerConfig, tiers: KVTiers | None = None) -> None:
        self.config = config
        self.page_size = config.page_size
        self.allocator = PageAllocator(config.num_pages)
        self.tree = RadixTree(config.page_size)
        self.tiers = None if config.disable_radix_cache else tiers
        self._seeds: dict[str | None, bytes] = {}
        self._save_locks: list[RadixNode] = []              # locked for saves not yet sent
        self._locks_by_step: dict[int, list[RadixNode]] = {}  # locked for saves sent with a step
        # this step's saves (``_save``): node id -> KVTiers.epoch at which all its keys were in host memory,
        # and the nodes a save skipped as known (touched once by ``take_transfers``)
        self._on_host: dict[int, int] = {}
        self._retouch: dict[int, RadixNode] = {}
        self.tier_hit_tokens = 0                            # prompt tokens promoted from host memory
        self.disk_hit_tokens = 0                            # of which read from disk ahead of the turn
        self.repositioned_tokens = 0                        # of which re-positioned (truncated prompts)

    @property
    def available_pages(self) -> int:
        """Pages an allocation can get right now: free ones plus evictable cached ones."""
        return self.allocator.num_free + self.tree.evictable_pages

    def match_and_lock(self, req: Request, near: RadixNode | None = None) -> None:
        """Attach the longest cached prefix to ``req`` (which holds no pages) and lock it.

        At least the last known token is left to compute (its logits sample the next token), and
        every position that still owes a prompt logprob (``Request.reusable_prefix``). ``near``: a
        node just found on the request's path (``RadixTree.peek_prefix``): the match starts there.
        """
        if self.config.disable_radix_cache:
            matched = None
        elif near is not None:
            matched = self.tree.match_prefix_below(req.token_ids, near, req.salt, length=req.reusable_prefix)
        else:
            matched = self.tree.match_prefix(req.token_ids, req.salt, length=req.reusable_prefix)
        if matched is None or matched.node is None:
            req.pages, req.num_shared_pages, req.lock_node = [], 0, None
            req.kv_len = req.kv_committed = 0
        else:
            self.tree.lock(matched.node)
            req.pages = list(matched.pages)
            req.num_shared_pages = len(matched.pages)
            req.lock_node = matched.node
            req.kv_len = req.kv_committed = matched.num_tokens

    def missing_modules(self, req: Request) -> list[ModuleSpan]:
        """The spans of a modular request that the tree does not hold whole."""
        return [span for span in req.modules
                if self.tree.peek_prefix(span.token_ids, span.key)[1] < len(span.token_ids)]

    def lock_modules(self, req: Request) -> list[ModuleSpan]:
        """Attach the cached spans of modular ``req`` (holding nothing) as its shared pages, each path
        locked. Returns the spans missing (then nothing is attached or locked)."""
        found = [self.tree.match_prefix(span.token_ids, span.key) for span in req.modules]
        missing = [span for span, m in zip(req.modules, found) if m.num_tokens < len(span.token_ids)]
        if missing:
            return missing
        req.pages, req.module_nodes = [], []
        for m in found:
            self.tree.lock(m.node)
            req.module_nodes.append(m.node)
            req.pages.extend(m.pages)
        req.num_shared_pages = len(req.pages)
        req.kv_len = req.kv_committed = len(req.pages) * self.page_size
        return []

    def unlock(self, req: Request) -> None:
        """Undo ``match_and_lock`` / ``lock_modules`` for a request that was not admitted after all."""
        if req.lock_node is not None:
            self.tree.unlock(req.lock_node)
        for node in req.module_nodes:
            self.tree.unlock(node)
        req.pages, req.num_shared_pages, req.lock_node, req.module_nodes = [], 0, None, []
        req.kv_len = req.kv_committed = 0

    def alloc(self, n: int, *, one_run: bool = True) -> list[int] | None:
        """``n`` pages, evicting LRU cache as needed; None when even eviction cannot supply them.
        ``one_run``: pages of one request, consecutive ids where possible (``PageAllocator.alloc``)."""
        short = n - self.allocator.num_free
        if short > 0:
            if short > self.tree.evictable_pages:
                return None
            self.allocator.free(self.tree.evict(short))
        return self.allocator.alloc(n, one_run=one_run)

    def share_computed_prefix(self, req: Request) -> None:
        """After ``req``'s prefill: hand its computed whole pages to the tree and lock the deeper
        path, so that requests arriving while it decodes reuse them (and the cascade planner sees
        them share its node). Skipped when the tree already holds other pages past ``req``'s
        match (a copy computed concurrently): ``req`` then keeps its pages private until it leaves.
        """
        ps = self.page_size
        num_full = req.kv_committed // ps
        if self.config.disable_radix_cache or num_full <= req.num_shared_pages or req.modules:
            return
        tokens, n = req.token_ids, num_full * ps
        start = self._locked_start(req)          # walks cover only the pages below the lock
        _, cached = self.tree.peek_prefix(tokens, req.salt, start, length=n)
        if cached != req.num_shared_pages * ps:
            return
        self.tree.insert(tokens, req.pages[:num_full], req.salt, start, length=n)
        node = self.tree.match_prefix(tokens, req.salt, start, length=n).node
        self.tree.lock(node)                    # the new path contains the old one: lock first
        if req.lock_node is not None:
            self.tree.unlock(req.lock_node)
        req.lock_node = node
        req.num_shared_pages = num_full
        self._save(req, node, req.pages[:num_full])

    def _locked_start(self, req: Request):
        """Where a walk for ``req``'s tokens may begin: its locked node (which the lock keeps, ending
        at the same position even if the tree splits it), or None (from the root)."""
        if req.lock_node is None:
            return None
        return req.lock_node, req.num_shared_pages * self.page_size

    def release(self, req: Request, keep_cache: bool) -> None:
        """Give back everything ``req`` holds; with ``keep_cache`` its computed whole pages stay
        in the tree. Afterwards ``req`` holds no pages and no lock (kv_len resets to 0).

        Only committed KV enters the tree: a step still in flight may write past it (a request found
        finished one step late computes one extra position), into pages freed here; any later user
        of such a page is a later step, which the device runs after the one in flight."""
        ps = self.page_size
        own_from = req.num_shared_pages
        if keep_cache and not self.config.disable_radix_cache and not req.modules:
            num_full = req.kv_committed // ps
            existing = self.tree.insert(req.token_ids, req.pages[:num_full], req.salt,
                                        self._locked_start(req), length=num_full * ps)
            # pages[:own_from] are the tree's own (locked path, so existing >= own_from * ps);
            # pages[own_from:existing // ps] duplicate what another request cached meanwhile;
            # pages[existing // ps:num_full] now belong to the tree.
            self.allocator.free(req.pages[own_from: existing // ps])
            self.allocator.free(req.pages[num_full:])
            if self.tiers is not None and num_full:
                found = self.tree.match_prefix_below(req.token_ids, req.lock_node, req.salt, length=num_full * ps) \
                    if req.lock_node is not None else self.tree.match_prefix(req.token_ids, req.salt, length=num_full * ps)
                if found.num_tokens == num_full * ps:
                    self._save(req, found.node, found.pages)
        else:
            self.allocator.free(req.pages[own_from:])
        self.unlock(req)

    # -- lower tiers ---------------------------------------------------------------------------

    def page_keys(self, req: Request, num_pages: int) -> list[bytes]:
        """Content keys of ``req``'s first ``num_pages`` whole pages (cached on the request). The part
        of them the device tree caches comes off its nodes (``_node_keys``): a long shared prefix is
        hashed once, not once per request that asks."""
        if not req.page_keys and num_pages and not self.config.disable_radix_cache:
            hint, _ = self.tree.peek_resumed(req.token_ids, req.salt, req.tree_hint,
                                             length=num_pages * self.page_size)
            if hint is not None:
                req.page_keys = self._node_keys(req, hint[0])
        keys = extend_keys(req.page_keys, self._seed(req), req.token_ids, self.page_size, num_pages)
        return keys if len(keys) == num_pages else keys[:num_pages]

    def _node_keys(self, req: Request, node: RadixNode, path: list[RadixNode] | None = None) -> list[bytes]:
        """Content keys of the pages of the tree path root -> ``node`` (a prefix of ``req``'s tokens),
        kept on the nodes (``RadixNode.page_keys``), computed where a node has none yet. ``path``: that
        path (``RadixTree.path(node)``) if the caller has it."""
        keys: list[bytes] = []
        prev = self._seed(req)
        for nd in self.tree.path(node) if path is None else path:
            if nd.page_keys is None:
                nd.page_keys = extend_keys([], prev, nd.key, self.page_size, len(nd.pages))
            keys.extend(nd.page_keys)
            prev = keys[-1]
        return keys

    def shifted_keys(self, req: Request, num_pages: int) -> list[bytes]:
        """Content keys of the first ``num_pages`` whole pages of a truncated prompt's previous
        sequence (``Request.shifted_prefix``, ``radixrelay.radix.truncation``)."""
        if len(req.shifted_keys) < num_pages:
            at = req.shifted_at
            previous = req.token_ids[:at] + req.shifted_prefix + req.token_ids[at:]
            extend_keys(req.shifted_keys, self._seed(req), previous, self.page_size, num_pages)
        return req.shifted_keys[:num_pages]

    def _seed(self, req: Request) -> bytes:
        seed = self._seeds.get(req.salt)
        if seed is None:
            seed = self._seeds[req.salt] = chain_seed(self.config.kv_namespace, req.salt)
        return seed

    def promote(self, req: Request) -> int:
        """Continue ``req``'s device match (``match_and_lock``) with the pages host memory holds:
        fresh device pages, a load for each, inserted into the tree and locked as ``req``'s path.
        A truncated prompt continues further with its previous sequence's pages, loaded with their
        keys rotated to the new positions. Returns the pages promoted (0 without tiers, hits or
        free device pages)."""
        if (self.tiers is None or req.modules
                or req.reusable_prefix // self.page_size <= req.num_shared_pages):
            return 0
        limit = req.reusable_prefix // self.page_size
        promoted = self._promote_run(req, self.page_keys(req, limit), 0, limit)
        # pages before shifted_at are the previous sequence's own (same keys): promoted above
        if req.shifted_prefix and req.shifted_at // self.page_size <= req.num_shared_pages < limit:
            off = len(req.shifted_prefix) // self.page_size
            found = self._promote_run(req, self.shifted_keys(req, off + limit), off, limit)
            self.repositioned_tokens += found * self.page_size
            promoted += found
        return promoted

    def _promote_run(self, req: Request, keys: list[bytes], off: int, limit: int) -> int:
        """Promote the host pages ``keys[off + have : off + limit]`` as ``req``'s pages
        ``have .. limit - 1`` (``have``: its shared pages); ``off`` pages of offset are loaded with
        their keys rotated by ``-off * page_size`` positions."""
        tiers, ps = self.tiers, self.page_size
        have = req.num_shared_pages
        slots = tiers.host_run(keys, off + have, off + limit)
        if not slots:
            return 0
        pages = self.alloc(len(slots))
        if pages is None:
            return 0
        n = (have + len(slots)) * ps
        start = self._locked_start(req)
        existing = self.tree.insert(req.token_ids, req.pages[:have] + pages, req.salt, start, length=n)
        if existing != have * ps:        # never expected: the match was the longest; keep it simple
            self.allocator.free(pages)
            raise AssertionError(f"request {req.rid}: promotion found {existing} tokens cached, "
                                 f"expected {have * ps}")
        node = self.tree.match_prefix(req.token_ids, req.salt, start, length=n).node
        self.tree.lock(node)
        if req.lock_node is not None:
            self.tree.unlock(req.lock_node)
        from_disk_before = tiers.counters.loaded_from_disk
        tiers.load(keys[off + have:off + have + len(slots)], pages, shift=-off * ps)
        self.tier_hit_tokens += len(slots) * ps
        self.disk_hit_tokens += (tiers.counters.loaded_from_disk - from_disk_before) * ps
        req.pages = req.pages[:have] + pages
        req.lock_node = node
        req.num_shared_pages = have + len(slots)
        req.kv_len = req.kv_committed = n
        return len(slots)

    def host_extension(self, req: Request, matched: int) -> int:
        """Tokens of ``req``'s reusable prefix that host memory holds right after its first
        ``matched`` tokens (which the device has): what ``promote`` would load. An ordering hint
        (``lpm``), walked once per device match and then kept on the request: it may go stale as
        host memory changes, which only affects the order, never what is loaded."""
        ps, limit = self.page_size, req.reusable_prefix // self.page_size
        if self.tiers is None or matched // ps >= limit or req.modules:
            return 0
        if req.host_hint is None or req.host_hint[0] != matched:
            found = len(self.tiers.host_run(self.page_keys(req, limit), matched // ps, limit)) * ps
            req.host_hint = (matched, found)
        return req.host_hint[1]

    def waits_for_fetch(self, req: Request) -> bool:
        """Whether a disk read for one of ``req``'s next pages is in flight (admit it afterwards)."""
        if self.tiers is None or not req.page_keys:
            return False
        limit = min(len(req.page_keys), req.reusable_prefix // self.page_size)
        if self.tiers.fetching_in(req.page_keys, 0, limit):
            return True
        off = len(req.shifted_prefix) // self.page_size
        return bool(req.shifted_keys) and self.tiers.fetching_in(req.shifted_keys, off, off + limit)

    def prefetch_window(self, window: Iterable[Request]) -> None:
        """Queue disk reads for the pages of ``window`` (the next requests to admit) that host
        memory lacks, and protect their keys from host eviction (policy ``scheduler``)."""
        tiers = self.tiers
        if tiers is None or (not tiers.has_disk and tiers.policy != "scheduler"):
            return
        if not tiers.has_disk and tiers.num_free_slots * 8 > tiers.host_pages:
            tiers.protect(set())      # host memory far from full: no eviction to steer, skip the scan
            return
        chains: list[tuple[list[bytes], int, int]] = []
        for req in window:
            limit = req.reusable_prefix // self.page_size
            if limit <= 0 or req.modules:     # a modular request's spans are prefetched by their own
                continue
            keys = self.page_keys(req, limit)
            req.tree_hint, cached = self.tree.peek_resumed(req.token_ids, req.salt, req.tree_hint,
                                                           length=limit * self.page_size)
            chains.append((keys, cached // self.page_size, limit))
            if req.shifted_prefix:      # a truncated prompt: its previous sequence's pages too
                off = len(req.shifted_prefix) // self.page_size
                chains.append((self.shifted_keys(req, off + limit), off + cached // self.page_size, off + limit))
        window_keys = {k for keys, first, _ in chains for k in keys[first:]}
        tiers.protect(window_keys if tiers.policy == "scheduler" else set())   # this window's, not the last one's
        if tiers.has_disk:
            for keys, first, limit in chains:       # never evict one window request's pages for another's
                tiers.prefetch(keys, first, limit, spare=window_keys)

    def take_transfers(self, step_id: int) -> KVTransfers | None:
        """The tier copies to send with plan ``step_id``; the nodes locked for its saves stay
        locked until ``on_acks`` sees them done."""
        if self.tiers is None:
            return None
        self._touch_known()
        transfers = self.tiers.take(step_id)
        if transfers is not None and transfers.saves:
            self._locks_by_step[step_id] = self._save_locks
            self._save_locks = []
        return transfers

    def _touch_known(self) -> None:
        """The step's saves skipped the path nodes known in host memory: mark them used once now, deepest
        first (a chain's head ends most recent), and start the next step's bookkeeping afresh."""
        for nd in reversed(list(self._retouch.values())):
            if nd.page_keys is not None:
                self.tiers.touch(nd.page_keys)
        self._retouch.clear()
        self._on_host.clear()

    def on_acks(self, acks: KVAcks | None) -> None:
        if self.tiers is None or acks is None:
            return
        for step in self.tiers.on_acks(acks):
            for node in self._locks_by_step.pop(step, []):
                self.tree.unlock(node)

    def tier_stats(self) -> dict[str, int | float]:
        """``SchedulerStats`` tier fields (empty without tiers)."""
        tiers = self.tiers
        if tiers is None:
            return {}
        c, size = tiers.counters, self.config.kv_page_bytes
        return dict(tier_host_pages=tiers.host_pages, tier_host_used_pages=tiers.num_host_entries,
                    tier_disk_pages=tiers.disk_pages, tier_disk_used_pages=tiers.num_disk_entries,
                    tier_host_hit_tokens=self.tier_hit_tokens, tier_disk_hit_tokens=self.disk_hit_tokens,
                    tier_repositioned_tokens=self.repositioned_tokens,
                    tier_prefetch_used_pages=c.prefetch_used, tier_read_failed_pages=c.read_failed,
                    tier_saved_bytes=c.saved * size, tier_loaded_bytes=c.loaded * size,
                    tier_written_bytes=c.written * size, tier_read_bytes=c.read * size,
                    tier_load_s=c.load_s, tier_load_exposed_s=c.load_exposed_s)

    def tiers_busy(self) -> bool:
        return self.tiers is not None and self.tiers.busy()

    def _save(self, req: Request, node: RadixNode, pages: list[int]) -> None:
        """Save the path's pages that host memory lacks; ``node`` (the path's end) stays locked
        until the copy is acknowledged.

        O(new pages) for requests under a long shared prefix: a path node whose keys this step found all
        in host memory (``_on_host``: nothing left host memory since, ``KVTiers.epoch``) is neither looked
        up nor touched again by the step's later saves; ``take_transfers`` touches it once, after them,
        so the shared head stays more recent than every tail saved under it (as a touch per save left it).
        Without this, 256 questions about a 16K-token document cost 256 x 1,024 lookups and LRU moves."""
        tiers = self.tiers
        if tiers is None or not pages:
            return
        path = self.tree.path(node)
        keys = self._node_keys(req, node, path)
        if len(keys) != len(pages):       # never expected: the path is the pages being saved
            raise AssertionError(f"request {req.rid}: tree path holds {len(keys)} pages, saving {len(pages)}")
        known = 0
        for nd in path:
            if self._on_host.get(nd.node_id) != tiers.epoch:
                break
            self._retouch[nd.node_id] = nd
            known += len(nd.pages)
        skipped = tiers.counters.save_skipped
        if tiers.save(keys, pages, known):
            self.tree.lock(node)
            self._save_locks.append(node)
        if tiers.counters.save_skipped == skipped:          # every key of the path is in host memory now
            for nd in path:
                self._on_host[nd.node_id] = tiers.epoch

    def check_integrity(self, running: Iterable[Request]) -> None:
        self.allocator.check_integrity()
        self.tree.check_integrity()
        if self.tiers is not None:
            self.tiers.check_integrity()
        free = self.allocator.free_pages()
        cached = [p for node in self.tree.nodes() for p in node.pages]
        in_use: list[int] = []
        tree_pages = set(cached)
        for req in running:
            in_use.extend(req.own_pages)
            shared = req.pages[: req.num_shared_pages]
            ends = [req.lock_node] if req.lock_node is not None else req.module_nodes
            path_pages = [p for end in ends for node in self.tree.path(end) for p in node.pages]
            if shared != path_pages or not tree_pages.issuperset(shared):
                raise AssertionError(f"request {req.rid}: shared pages != its locked tree path")
        owned = free + cached + in_use
        if len(owned) != self.allocator.num_pages or set(owned) != set(range(len(owned))):
            raise AssertionError(f"page accounting: free {len(free)} + cached {len(cached)} + "
                                 f"in use {len(in_use)} != capacity {self.allocator.num_pages} "
                                 f"(or a page is held twice)")
