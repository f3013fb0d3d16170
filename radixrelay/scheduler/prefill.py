"""Prefill manager: spends the step's extend-token budget and admits queued requests.

Order: running requests still in prefill continue first (oldest admission first), then queued
requests are admitted in policy order while the budget, ``max_running_requests`` and the KV budget
allow. Admission stops at the first request that does not fit (no skipping ahead: a large request
is never starved by a stream of small ones).

KV budget: an admitted request gets pages for all of its known tokens at once (its chunks need no
further pages). It must fit in ``available_pages`` after reserving, for every running request and
itself, ``decode_reservation_ratio`` of the pages its remaining ``max_tokens`` could still need.
With nothing running the reservation is waived, so the queue head always makes progress (any
request fits the whole cache alone: ``Scheduler.add_request`` checks it; pinned prefixes in its way yield,
soonest expiry first, ``PinTable.yield_one``).

With ``enable_priority`` the policy order is regrouped by priority (``policy.by_priority``: smaller first,
aged), so a queued request of a higher priority is admitted first and blocks lower ones while it does
not fit.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from radixrelay.protocol.step import ModuleSpan
from radixrelay.radix.tree import RadixNode
from radixrelay.scheduler.cache import CacheManager
from radixrelay.scheduler.scheduler_config import SchedulerConfig
from radixrelay.scheduler.policy import by_priority, order_waiting
from radixrelay.scheduler.request import Phase, Request
from radixrelay.scheduler.stages import StageTimes


@dataclass
class PrefillSchedule:
    admitted: list[Request] = field(default_factory=list)
    extends: list[tuple[Request, int]] = field(default_factory=list)   # (request, tokens)
    missing: list[ModuleSpan] = field(default_factory=list)    # spans queued modular requests wait for


class PrefillManager:
    def __init__(self, config: SchedulerConfig, cache: CacheManager,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.cache = cache
        self.clock = clock           # priority ageing
        self.hit_tokens = 0          # cumulative prompt tokens served from cache (first admission)
        self.prompt_tokens = 0       # cumulative prompt tokens of first admissions
        self.stages = StageTimes()   # host time of the match and queue stages (written here only)

    def reserve_pages(self, req: Request) -> int:
        """Pages ``req`` may still need for decode growth, scaled by the reservation ratio."""
        remaining = req.sampling.max_tokens - req.num_outputs - req.num_pending
        growth = math.ceil(remaining * self.config.decode_reservation_ratio)
        known_tokens = len(req.token_ids) + req.num_pending
        known = max(len(req.hold.pages), self.config.pages_for(known_tokens))
        return max(0, self.config.pages_for(known_tokens + growth) - known)

    def schedule(self, running: list[Request], waiting: deque[Request],
                 budget: int) -> PrefillSchedule:
        out = PrefillSchedule()
        for req in running:
            if budget <= 0:
                return out
            if req.in_prefill:
                budget -= self._extend(out, req, budget)
        if budget <= 0 or not waiting or len(running) >= self.config.max_running_requests:
            return out
        reserved = sum(self.reserve_pages(r) for r in running)
        computing = {self._next_page_key(r, r.hold.num_shared_pages * self.config.page_size)
                     for r in running if not r.prefill_committed}
        tiers = self.cache.tiers
        extend = tiers.host_extension if tiers is not None else None
        stages = self.stages
        order = order_waiting(waiting, self.cache.tree, self.config, extend)
        if self.config.enable_priority:
            order = by_priority(order, self.clock(), self.config.priority_ageing_s)
        for req in order:
            if budget <= 0 or len(running) + len(out.admitted) >= self.config.max_running_requests:
                break
            start = time.perf_counter()
            if req.modules:         # waits (in the queue) until its spans are all cached
                missing = self.cache.lock_modules(req)
                if missing:
                    stages.add("match", time.perf_counter() - start)
                    out.missing.extend(missing)
                    continue
            else:
                waits, near = self._waits_for_shared_prefill(req, computing)
                if waits or (tiers is not None and tiers.waits_for_fetch(req)):
                    stages.add("match", time.perf_counter() - start)
                    continue
                self.cache.match_and_lock(req, near)
            if not self._admit(req, reserved if running or out.admitted else None, start):
                break
            out.admitted.append(req)
            # page-aligned like the running ones' keys: a reused partial page leaves kv_len mid-page
            computing.add(self._next_page_key(req, req.hold.num_shared_pages * self.config.page_size))
            reserved += self.reserve_pages(req)
            budget -= self._extend(out, req, budget)
        self._remove(waiting, out.admitted)
        return out

    @staticmethod
    def _remove(waiting: deque[Request], admitted: list[Request]) -> None:
        """Drop ``admitted`` from the queue: O(admitted) when they are its head (FCFS)."""
        if all(i < len(waiting) and waiting[i] is r for i, r in enumerate(admitted)):
            for _ in admitted:
                waiting.popleft()
            return
        chosen = set(map(id, admitted))
        kept = [r for r in waiting if id(r) not in chosen]
        waiting.clear()
        waiting.extend(kept)

    def _next_page_key(self, req: Request, cached: int) -> tuple:
        """What identifies the first page ``req`` computes past its ``cached`` prefix: requests
        with the same key would compute the same KV."""
        ps = self.config.page_size
        return req.salt, cached, req.token_ids.prefix(cached + ps)[cached:].tobytes()

    def _waits_for_shared_prefill(self, req: Request, computing: set[tuple]) -> tuple[bool, RadixNode | None]:
        """True when a running request is computing the page ``req`` would compute next: ``req``
        then waits in the queue, and once that prefill ends (``CacheManager.share_computed_prefix``)
        it is admitted with the shared prefix cached instead of computing a second copy. Also the
        deepest cached node on its path, if looked up (its admission's match starts there)."""
        if self.config.disable_radix_cache or not computing:
            return False, None
        ps = self.config.page_size
        # resumes where the queue policy's walk of this round ended (``Request.tree_hint``): one walk of a
        # long prompt per round, not one per look
        hint, cached = self.cache.tree.peek_resumed(req.token_ids, req.salt, req.tree_hint,
                                                     length=req.reusable_prefix)
        node = hint[0] if hint is not None else None
        cached -= cached % ps
        if req.reusable_prefix - cached < ps:
            return False, node                # less than a page left to share
        return self._next_page_key(req, cached) in computing, node

    def _admit(self, req: Request, reserved: int | None, match_start: float) -> bool:
        """Allocate for ``req`` (its cached prefix matched and locked since ``match_start``, a
        ``perf_counter`` time); False (holding nothing) when it does not fit."""
        cache = self.cache
        need = self.config.pages_for(len(req.token_ids)) - len(req.hold.pages)
        margin = 0 if reserved is None else reserved + self.reserve_pages(req)
        if reserved is None:          # alone: pins in the way yield (else it could never run)
            while need > cache.available_pages and cache.pins.yield_one():
                pass
        if need + margin > cache.available_pages:
            cache.unlock(req)
            self.stages.add("match", time.perf_counter() - match_start)
            return False
        need -= cache.promote(req)             # pages host memory holds: loaded, not computed
        now = time.perf_counter()
        self.stages.add("match", now - match_start)
        if req.cached_tokens is None:
            self.stages.add("queue", now - req.arrived_s)
        added = cache.add_pages(req, need)
        assert added  # need <= available_pages
        cache.reuse_partial_page(req)          # a cached page's leading tokens: copied, not computed
        req.phase = Phase.RUNNING
        req.prefill_len = len(req.token_ids)
        if req.cached_tokens is None:
            cached = req.hold.kv_len
            req.cached_tokens = cached
            req.module_tokens = cached if req.modules else 0
            self.hit_tokens += cached
            self.prompt_tokens += req.num_prompt
        return True

    @staticmethod
    def _extend(out: PrefillSchedule, req: Request, budget: int) -> int:
        n = min(req.prefill_len - req.hold.kv_len, budget)
        out.extends.append((req, n))
        return n
