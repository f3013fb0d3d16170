"""Tier coordinator: the scheduler's side of the lower KV tiers (``radixrelay.radix.tiers``: host memory
and disk, content-addressed by page keys).

What it does, and who asks:
- content keys of a request's pages (``page_keys``, ``shifted_keys``: ``ContentKeys``, shared with the KV
  events), the part the radix tree caches kept on its nodes, so a long shared prefix is hashed once; host
  memory and disk are looked up page by page past the device match, with keys asked for in growing runs
  (``_held_until``), so a lookup hashes the pages a tier holds (and a few more), not the whole prompt;
- saves (``save``, from the cache manager when pages enter the tree): the pages host memory lacks are
  copied there once; the path's end node stays locked until the worker acknowledges the copy
  (``take_transfers`` sends it with a step, ``on_acks`` unlocks), so device eviction never waits;
- promotion (``host_run``, ``load``, from ``CacheManager.promote``): the cache manager gets device
  pages and extends the request's locked path, this module finds the host run and queues the loads;
- the waiting queue (scheduler and prefill manager): disk reads ahead of a request's turn
  (``prefetch_window``), whether a read is still in flight (``waits_for_fetch``), lpm's hint of host
  pages after a device match (``host_extension``);
- the ``SchedulerStats`` tier fields (``stats``).

It locks and unlocks radix nodes only for its saves; a request's own KV hold is the cache manager's.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from collections.abc import Callable

from radixrelay.protocol.kv import KVAcks, KVTransfers
from radixrelay.radix.tiers import KVTiers
from radixrelay.radix.tree import RadixNode, RadixTree
from radixrelay.scheduler.scheduler_config import SchedulerConfig
from radixrelay.scheduler.content_keys import ContentKeys
from radixrelay.scheduler.request import Request
from radixrelay.scheduler.tier_costs import TierCosts
from radixrelay.scheduler.match_hint import peek

FIRST_RUN_PAGES = 4      # a lookup past the device match hashes this many pages first, then 4x as many each time
MAX_NODES_KNOWN = 1 << 16     # radix nodes whose last use a save remembers (forgotten past this)
MAX_KEYS_KNOWN = 1 << 22      # keys of the nodes known in host memory (forgotten past this)


class TierCoordinator:
    def __init__(self, config: SchedulerConfig, store: KVTiers, tree: RadixTree, keys: ContentKeys) -> None:
        self.config = config
        self.page_size = config.page_size
        self.store = store                                   # the tier state machine
        self.tree = tree
        self.keys = keys                                     # content keys (shared with the KV events)
        self._save_locks: list[RadixNode] = []              # locked for saves not yet sent
        self._locks_by_step: dict[int, list[RadixNode]] = {}  # locked for saves sent with a step
        # saves (``save``): the ids of radix nodes all of whose keys are in host memory (``_on_host``), kept
        # true by ``_forget_dropped`` (``_key_node``: key -> the id of the node it was seen in); node id ->
        # KVTiers.moves when its keys were last marked used; this step's nodes a save skipped as known
        # (``take_transfers`` marks them used again where they have aged)
        self._on_host: set[int] = set()
        self._key_node: dict[bytes, int] = {}
        self._used_at: dict[int, int] = {}
        self._retouch: dict[int, RadixNode] = {}
        self.tier_hit_tokens = 0                            # prompt tokens promoted from host memory
        self.disk_hit_tokens = 0                            # of which read from disk ahead of the turn
        self.repositioned_tokens = 0                        # of which re-positioned (truncated prompts)
        self.early_tokens = 0                               # of which loaded before their request's admission
        self.costs = TierCosts()                            # disk read and prefill rates: wait or recompute

    # -- content keys ------------------------------------------------------------------------------

    def page_keys(self, req: Request, num_pages: int) -> list[bytes]:
        """Content keys of ``req``'s first ``num_pages`` whole pages (``ContentKeys.of``)."""
        return self.keys.of(req, num_pages)

    def shifted_keys(self, req: Request, num_pages: int) -> list[bytes]:
        """Content keys of the first ``num_pages`` whole pages of a truncated prompt's previous
        sequence (``ContentKeys.shifted``)."""
        return self.keys.shifted(req, num_pages)

    def _held_until(self, req: Request, first: int, stop: int,
                    count: Callable[[list[bytes], int, int], int]) -> tuple[list[bytes], int]:
        """(keys, n): ``req``'s pages ``[first, n)`` are the run from ``first`` (before ``stop``) that
        ``count(keys, start, stop)`` (how many of ``keys[start:stop]`` in a row a tier holds) finds held;
        ``keys`` holds at least their keys. Keys are asked for in runs of 4, 16, 64, ... pages, so a
        lookup hashes at most the held pages plus a few and ~4x their number, never the rest of the prompt."""
        n, run, keys = first, FIRST_RUN_PAGES, req.prefix_keys
        while n < stop:
            end = min(stop, n + run)
            keys = self.keys.ensure(req, end)
            n += count(keys, n, end)
            if n < end:
                break
            run *= 4
        return keys, n

    def _host_count(self, keys: list[bytes], start: int, stop: int) -> int:
        return len(self.store.host_run(keys, start, stop))

    # -- promotion (``CacheManager.promote``) ----------------------------------------------------------

    def host_run(self, req: Request, start: int, stop: int, off: int = 0) -> tuple[list[bytes], list[int]]:
        """The keys and host slots of ``req``'s pages ``[start, stop)`` that host memory can load from,
        in order, up to the first it cannot (``KVTiers.host_run``). ``off``: pages of a truncated prompt's
        previous sequence (``shifted_keys``) offset by that many pages instead."""
        if off:
            keys = self.shifted_keys(req, stop)
            slots = self.store.host_run(keys, start, stop)
        else:
            keys, end = self._held_until(req, start, stop, self._host_count)
            slots = self.store.host_run(keys, start, end)
        return keys[start:start + len(slots)], slots

    def load(self, keys: list[bytes], pages: list[int], shift: int, start_now: bool = False,
             early: bool = False) -> None:
        """Queue the loads of ``keys`` (a ``host_run``) into the fresh device ``pages``, their keys rotated
        by ``shift`` positions (nonzero: a truncated prompt's KV re-positioned), and count the hits.
        ``start_now``: no step in flight writes ``pages`` (``KVTransfers.loads_start_now``); ``early``: for a
        queued request, before its admission (``CacheManager.load_early``)."""
        store, ps = self.store, self.page_size
        from_disk_before = store.counters.loaded_from_disk
        store.load(keys, pages, shift=shift, start_now=start_now)
        self.tier_hit_tokens += len(pages) * ps
        if early:
            self.early_tokens += len(pages) * ps
        self.disk_hit_tokens += (store.counters.loaded_from_disk - from_disk_before) * ps
        if shift:
            self.repositioned_tokens += len(pages) * ps

    # -- the waiting queue ---------------------------------------------------------------------------

    def host_extension(self, req: Request, matched: int) -> int:
        """Tokens of ``req``'s reusable prefix that host memory holds right after its first
        ``matched`` tokens (which the device has): what ``promote`` would load. An ordering hint
        (``lpm``), walked once per device match and then kept on the request: it may go stale as
        host memory changes, which only affects the order, never what is loaded."""
        ps, limit = self.page_size, req.reusable_prefix // self.page_size
        if matched // ps >= limit or req.modules:
            return 0
        if req.host_hint is None or req.host_hint[0] != matched:
            _, end = self._held_until(req, matched // ps, limit, self._host_count)
            req.host_hint = (matched, end * ps - matched)
        return req.host_hint[1]

    def waits_for_fetch(self, req: Request) -> bool:
        """Whether to keep ``req`` queued until the disk reads in flight for its next pages land: while
        the reads queued up to them (an upper bound: every read in flight) should finish sooner than
        computing the pages would (``TierCosts``). Otherwise it is admitted now and computes them; the
        reads still land in host memory."""
        if not req.prefix_keys or req.skipped_fetch:
            return False
        limit = min(len(req.prefix_keys), req.reusable_prefix // self.page_size)
        fetching = self.store.fetching_count(req.prefix_keys, 0, limit)
        off = len(req.shifted_prefix) // self.page_size
        if req.shifted_keys:
            fetching += self.store.fetching_count(req.shifted_keys, off, off + limit)
        if not fetching:
            return False
        if self.costs.worth_waiting(self.store.num_fetching, fetching * self.page_size):
            return True
        req.skipped_fetch = True
        self.costs.recomputed_instead += 1
        return False

    def prefetch_window(self, window: Iterable[Request]) -> None:
        """Queue disk reads for the pages of ``window`` (the next requests to admit) that host
        memory lacks, and protect their keys from host eviction (policy ``scheduler``)."""
        store = self.store
        if not store.has_disk and store.policy != "scheduler":
            return
        if not store.has_disk and store.num_free_slots * 8 > store.host_pages:
            store.protect(set())      # host memory far from full: no eviction to steer, skip the scan
            return
        # per request, the run of pages past its device match that host memory or disk holds: keys asked
        # for as far as that run goes (``_held_until``), not for the whole prompt
        chains: list[tuple[list[bytes], int, int]] = []
        for req in window:
            limit = req.reusable_prefix // self.page_size
            if limit <= 0 or req.modules:     # a modular request's spans are prefetched by their own
                continue
            _, cached = peek(self.tree, req, limit * self.page_size)
            first = cached // self.page_size
            keys, held = self._held_until(req, first, limit, store.held_run)
            chains.append((keys, first, held))
            if req.shifted_prefix:      # a truncated prompt: its previous sequence's pages too
                off = len(req.shifted_prefix) // self.page_size
                chains.append((self.shifted_keys(req, off + limit), off + first, off + limit))
        window_keys = {k for keys, first, stop in chains for k in keys[first:stop]}
        store.protect(window_keys if store.policy == "scheduler" else set())   # this window's, not the last one's
        if store.has_disk:
            min_pages = -(-self.config.disk_min_tokens // self.page_size)
            now = time.monotonic()
            for keys, first, limit in chains:       # never evict one window request's pages for another's
                reads = store.disk_run(keys[first:limit])
                if reads < min_pages or not self.costs.worth_reading(store.num_fetching + reads,
                                                                     reads * self.page_size, now):
                    store.touch(keys[first:limit])  # computing the run is cheaper than reading it
                    continue
                store.prefetch(keys, first, limit, spare=window_keys)

    # -- pinned prefixes (``pins.py``): their pages stay in host memory too ---------------------------------

    def pin(self, node: RadixNode, salt: str | None) -> list[bytes]:
        """Host memory keeps the pages of the path root -> ``node`` (saved when they entered the tree)
        until ``unpin`` of the keys returned."""
        keys = self.keys.of_node(node, salt)
        self.store.pin(keys)
        return keys

    def unpin(self, keys: list[bytes]) -> None:
        self.store.unpin(keys)

    # -- saves and the worker's acknowledgements ----------------------------------------------------------

    def save(self, req: Request, node: RadixNode, pages: list[int]) -> None:
        """Save the path's pages that host memory lacks; ``node`` (the path's end) stays locked
        until the copy is acknowledged.

        O(new pages) for requests under a long shared prefix: a path node whose keys a save found all in
        host memory (``_on_host``: none of them left host memory since, ``_forget_dropped``) is neither
        looked up nor touched by later saves; ``take_transfers`` marks it used again once it has aged by a quarter of
        host memory (``KVTiers.moves`` since it was last marked: at most that many entries are more recent),
        so the shared head stays in the recent part of the LRU order, evicted only after what is older than
        that, while a save under it costs no pass over it. Without this, every question about a 112K-token
        document looked up and moved its 7,000 keys twice."""
        store = self.store
        if not pages:
            return
        path = self.tree.path(node)
        keys = self.keys.of_path(path, req.salt, req.prefix_keys)
        if len(keys) != len(pages):       # never expected: the path is the pages being saved
            raise AssertionError(f"request {req.rid}: tree path holds {len(keys)} pages, saving {len(pages)}")
        self._forget_dropped()
        known = 0
        for nd in path:
            if nd.node_id not in self._on_host:
                break
            self._retouch[nd.node_id] = nd
            known += len(nd.pages)
        skipped = store.counters.save_skipped
        if store.save(keys, pages, known):
            self.tree.lock(node)
            self._save_locks.append(node)
        if store.counters.save_skipped == skipped:          # every key of the path is in host memory now
            if len(self._key_node) > MAX_KEYS_KNOWN:
                self._on_host.clear()
                self._key_node.clear()
            seen = 0
            for nd in path:
                if seen >= known:                           # new to _on_host: once in the node's life
                    self._on_host.add(nd.node_id)
                    self._key_node.update(dict.fromkeys(nd.page_keys, nd.node_id))
                seen += len(nd.pages)
        if len(self._used_at) > MAX_NODES_KNOWN:
            self._used_at.clear()
        seen = 0
        for nd in path:                                      # the save marked the rest used just now
            if seen >= known:
                self._used_at[nd.node_id] = store.moves
            seen += len(nd.pages)

    def take_transfers(self, step_id: int) -> KVTransfers | None:
        """The tier copies to send with plan ``step_id``; the nodes locked for its saves stay
        locked until ``on_acks`` sees them done."""
        self._touch_known()
        transfers = self.store.take(step_id)
        if transfers is not None and transfers.disk_reads:
            self.costs.reads_sent(len(transfers.disk_reads), time.monotonic())
        if transfers is not None and transfers.saves:
            self._locks_by_step[step_id] = self._save_locks
            self._save_locks = []
        return transfers

    def _forget_dropped(self) -> None:
        """Nodes with a key that left host memory are no longer known to be there."""
        dropped = self.store.take_dropped()
        if dropped is None:
            self._on_host.clear()
            self._key_node.clear()
            return
        for key in dropped:
            node_id = self._key_node.pop(key, None)
            if node_id is not None:
                self._on_host.discard(node_id)

    def _touch_known(self) -> None:
        """The step's saves skipped the path nodes known in host memory: mark those used again that have
        aged by a quarter of host memory since they last were, deepest first (a chain's head ends most
        recent)."""
        store = self.store
        aged = store.moves - store.host_pages // 4
        for nd in reversed(list(self._retouch.values())):
            if nd.page_keys is not None and self._used_at.get(nd.node_id, -1) < aged:
                store.touch(nd.page_keys)
                self._used_at[nd.node_id] = store.moves
        self._retouch.clear()

    def on_acks(self, acks: KVAcks | None) -> None:
        if acks is None:
            return
        if acks.read or acks.read_failed:
            self.costs.reads_done(len(acks.read) + len(acks.read_failed), time.monotonic())
        for step in self.store.on_acks(acks):
            for node in self._locks_by_step.pop(step, []):
                self.tree.unlock(node)

    # -- state ---------------------------------------------------------------------------------------

    def busy(self) -> bool:
        """Copies to send or to hear back about."""
        return self.store.busy()

    def has_outgoing(self) -> bool:
        return self.store.has_outgoing()

    def rates(self) -> dict[str, float]:
        """Of ``kv_schema.RATES``, those measured so far, tokens per second: prefill (device time of prefill
        steps), loads from host memory (pages loaded over the device seconds of loads), disk reads."""
        ps, rates = self.config.page_size, {}
        per_token = self.costs.prefill_s_per_token
        if per_token:
            rates["prefill_tps"] = 1.0 / per_token
        c = self.store.counters
        if c.load_s > 0 and c.loaded:
            rates["host_load_tps"] = c.loaded * ps / c.load_s
        if self.costs.read_pages_per_s:
            rates["disk_read_tps"] = self.costs.read_pages_per_s * ps
        return rates

    def stats(self) -> dict[str, int | float]:
        """``SchedulerStats`` tier fields."""
        store = self.store
        c, size = store.counters, self.config.kv_page_bytes
        return dict(tier_host_pages=store.host_pages, tier_host_used_pages=store.num_host_entries,
                    tier_disk_pages=store.disk_pages, tier_disk_used_pages=store.num_disk_entries,
                    tier_host_hit_tokens=self.tier_hit_tokens, tier_disk_hit_tokens=self.disk_hit_tokens,
                    tier_repositioned_tokens=self.repositioned_tokens,
                    tier_prefetch_used_pages=c.prefetch_used, tier_read_failed_pages=c.read_failed,
                    tier_loaded_at_once_pages=c.loaded_at_once, tier_early_load_tokens=self.early_tokens,
                    tier_saved_bytes=c.saved * size, tier_loaded_bytes=c.loaded * size,
                    tier_written_bytes=c.written * size, tier_read_bytes=c.read * size,
                    tier_load_s=c.load_s, tier_load_exposed_s=c.load_exposed_s, tier_save_s=c.save_s,
                    tier_recomputed_instead=self.costs.recomputed_instead,
                    tier_reads_skipped=self.costs.reads_skipped,
                    tier_disk_read_bytes_per_s=(self.costs.read_pages_per_s or 0.0) * size)

    def check_integrity(self) -> None:
        self.store.check_integrity()
