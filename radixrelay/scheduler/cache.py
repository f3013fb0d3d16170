"""Cache manager: the page allocator plus the radix tree, seen from requests. It is the only writer of
a request's KV hold (``Request.hold``, ``KVHold``: its pages, shared count, locked nodes, ``kv_len`` and
``kv_committed``); the scheduler and its managers ask it (``tests/scheduler/test_kv_owner.py``).

Page ownership (checked by ``check_integrity``): every page is in exactly one of
  the free list | a tree node | the private tail ``hold.pages[num_shared_pages:]`` of one running
  request;
a running request's ``hold.pages[:num_shared_pages]`` are the pages of its locked tree path. So
``free + cached + in use == capacity``.

A request leaves (finish, retraction) by inserting its computed whole pages into the tree (the next
turn of a chat, or its own resumption, hits them), freeing pages the tree already had (duplicates
computed concurrently) and its last partial page, and unlocking its path. Aborts just free.

Pages freed while steps are in flight (a finished or aborted request's own pages) may still be written
by those steps (a request found finished one step late computes one more position; an aborted one's
chunk may be on the device). A later step's kernels run after them on the compute stream, but a
host -> device load runs on its own stream: so freed pages cool (``_cooling``) until the steps in
flight when they were freed are processed (``step_planned``, ``step_processed``), and a promotion whose
pages are all cool starts its loads at once, beside the steps queued before it, instead of after them
(``KVTransfers.loads_start_now``). Cooling pages count as available: an allocation short of free pages
takes them before it evicts cache (they are then ``_warm`` until their steps are done).

Lower tiers (optional; ``TierCoordinator`` in ``tier_coordinator.py`` runs them): whole pages that
enter the tree are saved to host memory once (``TierCoordinator.save``); an admission continues its
device match with the pages host memory holds, loaded into fresh device pages (``promote``: the device
pages and the tree here, the host run and the loads there); a queued request's are loaded before its
admission, while steps are in flight (``load_early``).

Pinned prefixes (``pins.py``, ``PinTable``): a request's pins are established here once its computed prefix
is in the tree (after its prefill, else when it leaves), refreshed by every admission whose match covers
them, and their reservations end when it leaves. Every tree lock a request takes carries its priority
(the nodes' eviction class, ``RadixTree.lock``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

from radixrelay.protocol.step import ModuleSpan
from radixrelay.radix.allocator import PageAllocator
from radixrelay.radix.tiers import KVTiers
from radixrelay.radix.tree import RadixNode, RadixTree
from radixrelay.scheduler.scheduler_config import SchedulerConfig
from radixrelay.scheduler.content_keys import ContentKeys
from radixrelay.scheduler.request import KVHold, Request
from radixrelay.scheduler.kv_event_hook import KVEventHook, Publisher, told_at_match
from radixrelay.scheduler.pins import PinTable
from radixrelay.scheduler.tier_coordinator import TierCoordinator
from radixrelay.scheduler.match_hint import peek


class CacheManager:
    def __init__(self, config: SchedulerConfig, tiers: KVTiers | None = None,
                 events: Publisher | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.page_size = config.page_size
        self.allocator = PageAllocator(config.num_pages)
        self.tree = RadixTree(config.page_size)
        self.pins = PinTable(self.tree, config.pinned_kv_tokens, config.pin_ttl_scale, clock)
        # content keys of pages, for the tiers and the events alike (computed only when one of them asks)
        self.keys = ContentKeys(self.tree, config.kv_namespace, use_tree=not config.disable_radix_cache)
        # the lower tiers' coordinator (None: no tiers): saves, promotion's host side, prefetch, acks
        self.tiers = (TierCoordinator(config, tiers, self.tree, self.keys)
                      if tiers is not None and not config.disable_radix_cache else None)
        if self.tiers is not None:                 # pinned prefixes stay in host memory too
            self.pins.on_pin, self.pins.on_unpin = self.tiers.pin, self.tiers.unpin
        # KV events: what enters and leaves the tree, for precise routers (None: not published)
        self.events = (KVEventHook(events, self.tree, self.keys)
                       if events is not None and not config.disable_radix_cache else None)
        if self.events is not None and self.tiers is not None:      # the lower tiers' pages too
            self.tiers.store.track_changes()
            self.events.tiers(self.tiers.store)     # at start: what a disk tier kept from an earlier run
        # step ids: the newest planned, the newest whose output was processed (in flight between them)
        self._planned = self._processed = -1
        self._cooling: deque[tuple[int, list[int]]] = deque()   # (newest step in flight when freed, pages)
        self._num_cooling = 0
        self._warm: dict[int, int] = {}      # page -> that step: taken from cooling early, in the free pool
        # Partial pages reused by the plan being built (``reuse_partial_page``): the copies the worker makes
        # before its forward, (source page, destination page, tokens), and the nodes holding the sources,
        # locked until the step is processed (then no copy of theirs is pending on the device).
        self._page_copies: list[tuple[int, int, int]] = []
        self._copy_locks: list[RadixNode] = []
        self._copy_locks_in_flight: deque[tuple[int, list[RadixNode]]] = deque()   # (step, nodes)
        self.partial_page_tokens = 0         # cumulative tokens copied from partial pages instead of computed

    @property
    def available_pages(self) -> int:
        """Pages an allocation can get right now: free ones (cooling included) plus evictable cached ones."""
        return self.allocator.num_free + self._num_cooling + self.tree.evictable_pages

    @property
    def num_free_pages(self) -> int:
        """Pages no request or tree node holds (cooling included)."""
        return self.allocator.num_free + self._num_cooling

    def publish_tiers(self) -> None:
        """KV events: what entered or left host memory and disk since the last call (nothing without both)."""
        if self.events is not None and self.tiers is not None:
            self.events.tiers(self.tiers.store)

    def flush(self) -> None:
        """Drop every cached prefix of the radix tree (the lower tiers keep theirs); the caller makes sure
        no request holds a path. Its pages go back through cooling (a step may still be in flight), and
        the KV events say the replica's device cache was cleared. Pins are dropped too."""
        self.pins.clear()
        self._free(self.tree.evict(self.tree.evictable_pages))
        if self.events is not None:
            self.events.cleared()

    # -- steps in flight: pages freed meanwhile cool until they are done -------------------------------

    def step_planned(self, step_id: int) -> None:
        self._planned = step_id
        if self._copy_locks:
            self._copy_locks_in_flight.append((step_id, self._copy_locks))
            self._copy_locks = []

    def step_processed(self, step_id: int) -> None:
        """Step ``step_id``'s output was processed: its kernels (and every earlier step's) are done."""
        self._processed = step_id
        self._uncool(step_id)
        while self._copy_locks_in_flight and self._copy_locks_in_flight[0][0] <= step_id:
            for node in self._copy_locks_in_flight.popleft()[1]:
                self.tree.unlock(node)
        if self._warm:
            self._warm = {p: s for p, s in self._warm.items() if s > step_id}

    def _free(self, pages: list[int]) -> None:
        """Give pages no holder keeps any more back to the allocator, through cooling while steps that
        may write them are in flight."""
        if not pages:
            return
        if self._planned > self._processed:
            self._cooling.append((self._planned, list(pages)))
            self._num_cooling += len(pages)
        else:
            self.allocator.free(pages)

    def _uncool(self, done: int | None) -> list[tuple[int, list[int]]]:
        """Cooling pages back to the allocator: those freed while only steps up to ``done`` were in flight
        (None: all of them). Returns the entries released."""
        released = []
        while self._cooling and (done is None or self._cooling[0][0] <= done):
            step, pages = entry = self._cooling.popleft()
            self._num_cooling -= len(pages)
            self.allocator.free(pages)
            released.append(entry)
        return released

    def _take_cooling(self) -> None:
        """Short of free pages: the cooling ones join the free pool (``_warm`` until their steps are done)."""
        for step, pages in self._uncool(None):
            self._warm.update(dict.fromkeys(pages, step))

    def cool(self, pages: list[int]) -> bool:
        """Whether no step in flight may write ``pages`` (fresh from ``alloc``)."""
        return not self._warm or not any(p in self._warm for p in pages)

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
        hold = req.hold
        if matched is None or matched.node is None:
            hold.pages, hold.num_shared_pages, hold.lock_node = [], 0, None
            hold.kv_len = hold.kv_committed = 0
        else:
            self.tree.lock(matched.node, req.priority)
            self.pins.touch(matched.node)
            hold.pages = list(matched.pages)
            hold.num_shared_pages = len(matched.pages)
            hold.lock_node = matched.node
            hold.kv_len = hold.kv_committed = matched.num_tokens
        told_at_match(req, hold.num_shared_pages)        # the tree holds (and events told) the match

    def reuse_partial_page(self, req: Request) -> int:
        """After ``req``'s admission (its whole-page match locked, promoted, its own pages added): when a
        cached page continues its match with some of its next tokens (the match is page-granular: a prompt
        that diverges mid-page stops a page short), plan a copy of those tokens' KV into ``req``'s first
        own page and count them as cached (``kv_len``, ``kv_committed``): the worker makes the copy before
        the step's forward (``StepPlan.page_copies``), so the step computes only the tokens after them.
        The source page's node stays locked until that step is processed (no eviction, tier load or reuse
        of the page races the copy). Returns the tokens reused (0: none)."""
        hold, ps = req.hold, self.page_size
        pos = hold.num_shared_pages * ps
        if (self.config.disable_radix_cache or req.modules or hold.kv_len != pos
                or len(hold.pages) <= hold.num_shared_pages):
            return 0
        found = self.tree.partial_page(req.token_ids, hold.lock_node, pos, req.reusable_prefix - pos, req.salt)
        if found is None:
            return 0
        node, n = found
        self.tree.lock(node, req.priority)
        self._copy_locks.append(node)
        self._page_copies.append((node.pages[0], hold.pages[hold.num_shared_pages], n))
        hold.kv_len = hold.kv_committed = pos + n
        self.partial_page_tokens += n
        return n

    def take_page_copies(self) -> list[tuple[int, int, int]]:
        """The partial-page copies of the plan being built (``reuse_partial_page``), handed over once."""
        copies, self._page_copies = self._page_copies, []
        return copies

    def missing_modules(self, req: Request) -> list[ModuleSpan]:
        """The spans of a modular request that the tree does not hold whole."""
        return [span for span, ids in zip(req.modules, req.module_ids, strict=True)
                if self.tree.peek_prefix(ids, span.key)[1] < len(ids)]

    def lock_modules(self, req: Request) -> list[ModuleSpan]:
        """Attach the cached spans of modular ``req`` (holding nothing) as its shared pages, each path
        locked. Returns the spans missing (then nothing is attached or locked)."""
        found = [self.tree.match_prefix(ids, span.key) for span, ids in zip(req.modules, req.module_ids, strict=True)]
        missing = [span for span, ids, m in zip(req.modules, req.module_ids, found) if m.num_tokens < len(ids)]
        if missing:
            return missing
        hold = req.hold
        hold.pages, hold.module_nodes = [], []
        for m in found:
            self.tree.lock(m.node, req.priority)
            hold.module_nodes.append(m.node)
            hold.pages.extend(m.pages)
        hold.num_shared_pages = len(hold.pages)
        hold.kv_len = hold.kv_committed = len(hold.pages) * self.page_size
        return []

    def unlock(self, req: Request) -> None:
        """Undo ``match_and_lock`` / ``lock_modules`` for a request that was not admitted after all."""
        hold = req.hold
        if hold.lock_node is not None:
            self.tree.unlock(hold.lock_node)
        for node in hold.module_nodes:
            self.tree.unlock(node)
        hold.pages, hold.num_shared_pages, hold.lock_node, hold.module_nodes = [], 0, None, []
        hold.kv_len = hold.kv_committed = 0

    def alloc(self, n: int, *, one_run: bool = True, cooling: bool = True) -> list[int] | None:
        """``n`` pages, evicting LRU cache as needed; None when even eviction cannot supply them.
        ``one_run``: pages of one request, consecutive ids where possible (``PageAllocator.alloc``);
        ``cooling``: cooling pages may be taken (before evicting)."""
        short = n - self.allocator.num_free
        if short > 0 and self._cooling and cooling:
            self._take_cooling()
            short = n - self.allocator.num_free
        if short > 0:
            if short > self.tree.evictable_pages:
                return None
            self.allocator.free(self.tree.evict(short))
        return self.allocator.alloc(n, one_run=one_run)

    def add_pages(self, req: Request, n: int) -> bool:
        """Append ``n`` fresh pages to ``req``'s hold (admission: its uncached tokens); False (nothing
        changed) when even eviction cannot supply them."""
        pages = self.alloc(n)
        if pages is None:
            return False
        req.hold.pages.extend(pages)
        return True

    def add_decode_pages(self, reqs: list[Request]) -> list[int] | None:
        """One fresh page appended to each of ``reqs``' holds (for the position a decode feeds next), in
        one eviction pass; the pages in ``reqs`` order, or None (nothing changed) when they cannot all
        be supplied."""
        pages = self.alloc(len(reqs), one_run=False)
        if pages is None:
            return None
        for req, page in zip(reqs, pages, strict=True):
            req.hold.pages.append(page)
        return pages

    # -- step accounting: [kv_committed, kv_len) is in flight ----------------------------------------

    def advance(self, extends: list[tuple[Request, int]], decodes: list[Request]) -> None:
        """A planned step computes ``n`` positions for each ``(req, n)`` of ``extends`` and one for each
        of ``decodes``: in flight from now on (``kv_len``)."""
        for req, n in extends:
            req.hold.kv_len += n
        for req in decodes:
            req.hold.kv_len += 1

    def commit(self, req: Request, num_tokens: int) -> None:
        """The output of a step that computed ``num_tokens`` positions of ``req`` was processed."""
        req.hold.kv_committed += num_tokens

    def commit_decodes(self, decodes: list[Request]) -> None:
        """``commit(req, 1)`` for each of a processed step's decodes."""
        for req in decodes:
            req.hold.kv_committed += 1

    def share_computed_prefix(self, req: Request) -> None:
        """After ``req``'s prefill: hand its computed whole pages to the tree and lock the deeper
        path, so that requests arriving while it decodes reuse them (and the cascade planner sees
        them share its node). Skipped when the tree already holds other pages past ``req``'s
        match (a copy computed concurrently): ``req`` then keeps its pages private until it leaves.
        """
        ps, hold = self.page_size, req.hold
        num_full = hold.kv_committed // ps
        if self.config.disable_radix_cache or num_full <= hold.num_shared_pages or req.modules:
            return
        tokens, n = req.token_ids, num_full * ps
        start = self._locked_start(hold)         # walks cover only the pages below the lock
        _, cached = self.tree.peek_prefix(tokens, req.salt, start, length=n)
        if cached != hold.num_shared_pages * ps:
            return
        self.tree.insert(tokens, hold.pages[:num_full], req.salt, start, length=n, priority=req.priority)
        node = self.tree.match_prefix(tokens, req.salt, start, length=n).node
        self.tree.lock(node, req.priority)      # the new path contains the old one: lock first
        if hold.lock_node is not None:
            self.tree.unlock(hold.lock_node)
        hold.lock_node = node
        hold.num_shared_pages = num_full
        if self.events is not None:
            self.events.stored(req, num_full)
        if self.tiers is not None:
            self.tiers.save(req, node, hold.pages[:num_full])
        self._establish_pins(req)

    def _establish_pins(self, req: Request) -> None:
        """Pin those of ``req``'s asked pins whose prefix the tree now holds whole."""
        left = []
        for p in req.pins:
            found = self.tree.match_prefix(req.token_ids, req.salt, length=p.num_tokens)
            if found.num_tokens == p.num_tokens:
                self.pins.establish(p, found.node)
                self.pins.unreserve([p])
            else:
                left.append(p)
        req.pins = left

    def forget_pins(self, req: Request) -> None:
        """``req`` leaves for good (finished, aborted, failed; not retracted): the reservations of its
        pins not established end."""
        self.pins.unreserve(req.pins)
        req.pins = []

    def _locked_start(self, hold: KVHold):
        """Where a walk for the holder's tokens may begin: its locked node (which the lock keeps, ending
        at the same position even if the tree splits it), or None (from the root)."""
        if hold.lock_node is None:
            return None
        return hold.lock_node, hold.num_shared_pages * self.page_size

    def release(self, req: Request, keep_cache: bool) -> None:
        """Give back everything ``req`` holds; with ``keep_cache`` its computed whole pages stay
        in the tree. Afterwards ``req`` holds no pages and no lock (kv_len resets to 0).

        Only committed KV enters the tree: a step still in flight may write past it (a request found
        finished one step late computes one extra position), into pages freed here; any later user
        of such a page is a later step, which the device runs after the one in flight."""
        ps, hold = self.page_size, req.hold
        own_from = hold.num_shared_pages
        if keep_cache and not self.config.disable_radix_cache and not req.modules:
            num_full = hold.kv_committed // ps
            existing = self.tree.insert(req.token_ids, hold.pages[:num_full], req.salt,
                                        self._locked_start(hold), length=num_full * ps, priority=req.priority)
            # pages[:own_from] are the tree's own (locked path, so existing >= own_from * ps);
            # pages[own_from:existing // ps] duplicate what another request cached meanwhile;
            # pages[existing // ps:num_full] now belong to the tree.
            self._free(hold.pages[own_from: existing // ps] + hold.pages[num_full:])
            if self.events is not None:
                self.events.stored(req, num_full)
            if self.tiers is not None and num_full:
                n = num_full * ps
                found = (self.tree.match_prefix_below(req.token_ids, hold.lock_node, req.salt, length=n)
                         if hold.lock_node is not None else self.tree.match_prefix(req.token_ids, req.salt, length=n))
                if found.num_tokens == n:
                    self.tiers.save(req, found.node, found.pages)
            self._establish_pins(req)
        else:
            self._free(hold.pages[own_from:])
        self.unlock(req)

    # -- promotion from host memory (``TierCoordinator``) -------------------------------------------

    def promote(self, req: Request) -> int:
        """Continue ``req``'s device match (``match_and_lock``) with the pages host memory holds:
        fresh device pages, a load for each, inserted into the tree and locked as ``req``'s path.
        A truncated prompt continues further with its previous sequence's pages, loaded with their
        keys rotated to the new positions. Returns the pages promoted (0 without tiers, hits or
        free device pages)."""
        tiers, ps = self.tiers, self.page_size
        if tiers is None or req.modules or req.reusable_prefix // ps <= req.hold.num_shared_pages:
            return 0
        limit = req.reusable_prefix // ps
        promoted = self._promote_run(req, 0, limit)
        # pages before shifted_at are the previous sequence's own (same keys): promoted above
        if req.shifted_prefix and req.shifted_at // ps <= req.hold.num_shared_pages < limit:
            off = len(req.shifted_prefix) // ps
            promoted += self._promote_run(req, off, limit)
        return promoted

    def load_early(self, req: Request, max_pages: int) -> int:
        """For queued ``req`` (holding nothing), before its admission: the pages host memory holds past its
        device match, loaded now (at most ``max_pages``) into free pages or pages of LRU cache evicted for
        them, as its admission would a moment later, never into cooling pages, and inserted into the tree,
        unlocked. Its admission then finds them as a device match. A later step that reads or writes them
        does so after the loads: the plan that carries them is one of transfers alone, and the worker
        makes the next step with rows wait for them, layer by layer (``TierStore.after_forward``).
        Returns the pages loaded. Each request is looked at once (``Request.early_load_tried``)."""
        tiers, ps = self.tiers, self.page_size
        req.early_load_tried = True
        if tiers is None or req.modules or req.shifted_prefix or req.hold.pages or max_pages <= 0:
            return 0
        # the usual case, nothing in host memory past the device match: found from the kept hints, no lock
        _, matched = peek(self.tree, req, req.reusable_prefix)
        if not tiers.host_extension(req, matched - matched % ps):
            return 0
        self.match_and_lock(req, req.tree_hint[0] if req.tree_hint is not None else None)   # resumes the peek
        try:
            limit = req.reusable_prefix // ps
            if limit <= req.hold.num_shared_pages:
                return 0
            return self._promote_run(req, 0, limit, max_pages, early=True)
        finally:
            self.unlock(req)

    def _promote_run(self, req: Request, off: int, limit: int, max_pages: int | None = None,
                     early: bool = False) -> int:
        """Promote the host pages of ``req``'s pages ``have .. limit - 1`` (``have``: its shared pages; the
        first ``max_pages`` of them) that host memory holds in a row; ``off`` > 0: those of a truncated
        prompt's previous sequence, ``off`` pages further on, loaded with their keys rotated by
        ``-off * page_size`` positions."""
        tiers, ps, hold = self.tiers, self.page_size, req.hold
        have = hold.num_shared_pages
        keys, slots = tiers.host_run(req, off + have, off + limit, off)
        if max_pages is not None:
            keys, slots = keys[:max_pages], slots[:max_pages]
        if not slots:
            return 0
        pages = self.alloc(len(slots), cooling=not early)
        if pages is None:
            return 0
        n = (have + len(slots)) * ps
        start = self._locked_start(hold)
        existing = self.tree.insert(req.token_ids, hold.pages[:have] + pages, req.salt, start, length=n)
        if existing != have * ps:        # never expected: the match was the longest; keep it simple
            self.allocator.free(pages)
            raise AssertionError(f"request {req.rid}: promotion found {existing} tokens cached, "
                                 f"expected {have * ps}")
        node = self.tree.match_prefix(req.token_ids, req.salt, start, length=n).node
        if not off and node.page_keys is None and len(node.pages) == len(keys):
            node.page_keys = list(keys)          # the new node's content keys: the ones just looked up
        self.tree.lock(node, req.priority)
        if hold.lock_node is not None:
            self.tree.unlock(hold.lock_node)
        tiers.load(keys, pages, shift=-off * ps, start_now=self.cool(pages), early=early)
        hold.pages = hold.pages[:have] + pages
        hold.lock_node = node
        hold.num_shared_pages = have + len(slots)
        hold.kv_len = hold.kv_committed = n
        if self.events is not None:
            self.events.stored(req, hold.num_shared_pages)
        return len(slots)

    def check_integrity(self, running: Iterable[Request]) -> None:
        self.allocator.check_integrity()
        self.tree.check_integrity()
        self.pins.check_integrity()
        if self.tiers is not None:
            self.tiers.check_integrity()
        free = self.allocator.free_pages() + [p for _, pages in self._cooling for p in pages]
        if self._num_cooling != len(free) - self.allocator.num_free:
            raise AssertionError("cooling page count is stale")
        cached = [p for node in self.tree.nodes() for p in node.pages]
        in_use: list[int] = []
        tree_pages = set(cached)
        for req in running:
            hold = req.hold
            in_use.extend(hold.own_pages)
            shared = hold.pages[: hold.num_shared_pages]
            ends = [hold.lock_node] if hold.lock_node is not None else hold.module_nodes
            path_pages = [p for end in ends for node in self.tree.path(end) for p in node.pages]
            if shared != path_pages or not tree_pages.issuperset(shared):
                raise AssertionError(f"request {req.rid}: shared pages != its locked tree path")
        owned = free + cached + in_use
        if len(owned) != self.allocator.num_pages or set(owned) != set(range(len(owned))):
            raise AssertionError(f"page accounting: free {len(free)} + cached {len(cached)} + "
                                 f"in use {len(in_use)} != capacity {self.allocator.num_pages} "
                                 f"(or a page is held twice)")
