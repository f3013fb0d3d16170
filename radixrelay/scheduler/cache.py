"""Cache manager: the page allocator plus the radix tree, seen from requests.

Page ownership (checked by ``check_integrity``): every page is in exactly one of
  the free list | a tree node | the private tail ``pages[num_shared_pages:]`` of one running
  request;
a running request's ``pages[:num_shared_pages]`` are the pages of its locked tree path. So
``free + cached + in use == capacity``.

A request leaves (finish, retraction) by inserting its computed whole pages into the tree (the next
turn of a chat, or its own resumption, hits them), freeing pages the tree already had (duplicates
computed concurrently) and its last partial page, and unlocking its path. Aborts just free.
"""

from __future__ import annotations

from collections.abc import Iterable

from radixrelay.radix.allocator import PageAllocator
from radixrelay.radix.tree import RadixNode, RadixTree
from radixrelay.scheduler.config import SchedulerConfig
from radixrelay.scheduler.request import Request


class CacheManager:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.page_size = config.page_size
        self.allocator = PageAllocator(config.num_pages)
        self.tree = RadixTree(config.page_size)

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

    def unlock(self, req: Request) -> None:
        """Undo ``match_and_lock`` for a request that was not admitted after all."""
        if req.lock_node is not None:
            self.tree.unlock(req.lock_node)
        req.pages, req.num_shared_pages, req.lock_node = [], 0, None
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
        if self.config.disable_radix_cache or num_full <= req.num_shared_pages:
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
        if keep_cache and not self.config.disable_radix_cache:
            num_full = req.kv_committed // ps
            existing = self.tree.insert(req.token_ids, req.pages[:num_full], req.salt,
                                        self._locked_start(req), length=num_full * ps)
            # pages[:own_from] are the tree's own (locked path, so existing >= own_from * ps);
            # pages[own_from:existing // ps] duplicate what another request cached meanwhile;
            # pages[existing // ps:num_full] now belong to the tree.
            self.allocator.free(req.pages[own_from: existing // ps])
            self.allocator.free(req.pages[num_full:])
        else:
            self.allocator.free(req.pages[own_from:])
        self.unlock(req)

    def check_integrity(self, running: Iterable[Request]) -> None:
        self.allocator.check_integrity()
        self.tree.check_integrity()
        free = self.allocator.free_pages()
        cached = [p for node in self.tree.nodes() for p in node.pages]
        in_use: list[int] = []
        tree_pages = set(cached)
        for req in running:
            in_use.extend(req.own_pages)
            shared = req.pages[: req.num_shared_pages]
            path = self.tree.path(req.lock_node) if req.lock_node is not None else []
            path_pages = [p for node in path for p in node.pages]
            if shared != path_pages or not tree_pages.issuperset(shared):
                raise AssertionError(f"request {req.rid}: shared pages != its locked tree path")
        owned = free + cached + in_use
        if len(owned) != self.allocator.num_pages or set(owned) != set(range(len(owned))):
            raise AssertionError(f"page accounting: free {len(free)} + cached {len(cached)} + "
                                 f"in use {len(in_use)} != capacity {self.allocator.num_pages} "
                                 f"(or a page is held twice)")
