"""Scheduler: continuous batching over a radix prefix cache (CPU only, no GPU imports).

What belongs here: the public API and the step loop glue. Policy lives in the managers
(``prefill``, ``decode``, ``policy``), KV ownership in ``cache`` (the only writer of a request's
``KVHold``), the lower tiers in ``tier_coordinator``, cascade paths in ``cascade_hook``, stop rules in
``stop``.

Usage contract: steps are answered in order. The plain loop is
``plan = schedule(); out = worker(plan); updates = process_output(out)``. Overlap scheduling calls
``schedule()`` again while a step is in flight: the new plan assumes every in-flight sampler
produces its token (the worker feeds it to the decode on the device; the host learns it from
``process_output``), so a request found finished one step late computes one extra token, which is
dropped (never emitted, never counted). ``add_request`` and ``abort`` may be called anywhere in
between (an abort frees the request's KV at once; its tokens in in-flight steps are dropped, and
its pages are reused only by later plans, which the worker runs after the in-flight ones).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable

import msgspec
import numpy as np
from dataclasses import dataclass

from radixrelay.protocol.kv import KVTransfers
from radixrelay.protocol.messages import FinishReason, PinSpec, RequestUpdate
from radixrelay.protocol.stats import KVAudit, SchedulerStats
from radixrelay.protocol.step import (
    AdmittedRequest, ExtendItem, ModuleSpan, PageAppend, StepOutput, StepPlan, needs_all_tokens, needs_outputs,
)
from radixrelay.radix.tiers import KVTiers
from radixrelay.radix.tokens import TokenArray, as_tokens
from radixrelay.scheduler.kv_event_hook import Publisher
from radixrelay.sampling_params import SamplingParams
from radixrelay.scheduler.audit import audit_kv
from radixrelay.scheduler.cache import CacheManager
from radixrelay.scheduler.cascade_hook import CascadeHook, CascadePlanner
from radixrelay.scheduler.scheduler_config import SchedulerConfig
from radixrelay.scheduler.decode import DecodeManager
from radixrelay.scheduler.prefill import PrefillManager
from radixrelay.scheduler.request import Phase, Request
from radixrelay.scheduler.stop import Detokenize, StopChecker


MAX_PINS = 4          # pinned prefixes one request may ask for (Anthropic's limit on cache marks)
# An admission whose locked cached prefix has at least this many pages in common with that of a request admitted
# before it in the same plan (the path to a node both paths pass through) takes them by reference from it
# (``AdmittedRequest.pages_from``)
SHARED_PAGES_BY_REF = 64

# An internal request computing a module span: its prompt's KV is the point; the one token sampled
# (greedy, never reported) ends it.
_SPAN_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0)


def _span_key(salt: str | None, token_ids) -> tuple[str | None, bytes]:
    """A module span's identity: its cache key (salt) and its tokens' int32 bytes."""
    return salt, as_tokens(token_ids).tobytes()


@dataclass(frozen=True)
class _Extend:
    req: Request
    num_tokens: int
    ends_prefill: bool
    prompt_logprobs: tuple[int, int]      # (first position, count) owed by this chunk


@dataclass(frozen=True)
class _InFlight:
    step_id: int
    extends: list[_Extend]
    decodes: list[Request]
    samplers: dict[int, Request]          # rid -> request expected to sample this step


class Scheduler:
    def __init__(self, config: SchedulerConfig, detokenize: Detokenize | None = None,
                 tiers: KVTiers | None = None, events: Publisher | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``clock``: seconds, for pin lifetimes and priority ageing (tests pass their own)."""
        self.config = config
        self._clock = clock
        self.cache = CacheManager(config, tiers, events, clock)
        self._tiers = self.cache.tiers                # the lower tiers' coordinator (None: no tiers)
        self._stop = StopChecker(config.eos_token_ids, detokenize)
        self._prefill = PrefillManager(config, self.cache, clock)
        self._decode = DecodeManager(config, self.cache, self._retract)
        self._requests: dict[int, Request] = {}       # every live request
        self._waiting: deque[Request] = deque()
        self._running: dict[int, Request] = {}        # admission order
        self._released: list[int] = []               # rids the worker must drop next plan
        self._finished: list[tuple[Request, bool]] = []   # finished, KV not yet given back (keep cache?)
        self._inflight: deque[_InFlight] = deque()   # oldest first
        self._next_step = 0
        self._arrivals = 0
        self._retractions = 0
        self._cascade: CascadeHook | None = None     # the cascade planner and its path cache
        self._span_jobs: dict[tuple[str | None, bytes], int] = {}   # module span (_span_key) -> internal rid
        self._internal_rids = 0                      # internal requests count down from -1

    # -- public API ----------------------------------------------------------------------------

    def add_request(self, rid: int, token_ids: TokenArray | np.ndarray | list[int], sampling: SamplingParams,
                    cache_salt: str | None = None, shifted_prefix: list[int] | None = None,
                    shifted_at: int = 0, modules: list[ModuleSpan] | None = None,
                    rope_runs: list[tuple[int, int]] | None = None, pins: list[PinSpec] | None = None,
                    priority: int = 0) -> None:
        """``shifted_prefix``: a truncated prompt's tokens dropped since the previous truncation
        point, at ``shifted_at`` (``radixrelay.radix.truncation``): KV cached for
        ``token_ids[:shifted_at] + shifted_prefix + token_ids[shifted_at:]`` is reused for
        ``token_ids``, re-positioned. ``modules``/``rope_runs``: a modular prompt
        (``radixrelay.modules.compose``; ``token_ids`` begins with the spans' tokens): the spans' KV
        comes from their own cache entries, computed first where missing. ``token_ids``: any sequence of
        ids; an int32 array (``radixrelay.protocol.token_ids.unpack_token_ids``) is taken without a Python
        object per token. ``pins``: prefixes of the prompt to pin (``scheduler/pins.py``; each rounded
        down to whole pages, one shorter than a page pins nothing); refused past the pinned KV budget.
        ``priority``: smaller is admitted first (``policy.by_priority``); only with ``enable_priority``."""
        arrived = time.perf_counter()
        if rid in self._requests:
            raise ValueError(f"request {rid} is already live")
        try:
            token_ids = as_tokens(token_ids)
        except ValueError as exc:
            raise ValueError(f"request {rid}: {exc}") from None
        if not len(token_ids):
            raise ValueError(f"request {rid}: empty prompt")
        # KV is needed for every position but the last sampled token's.
        need = self.config.pages_for(len(token_ids) + sampling.max_tokens - 1)
        if need > self.config.num_pages:
            raise ValueError(f"request {rid}: prompt ({len(token_ids)} tokens) + max_tokens "
                             f"({sampling.max_tokens}) needs {need} KV pages, the cache has "
                             f"{self.config.num_pages}")
        if sampling.stop and self._stop.detokenize is None:
            raise ValueError(f"request {rid}: stop strings need a scheduler built with detokenize")
        ps = self.config.page_size
        if shifted_prefix and (len(shifted_prefix) % ps or shifted_at % ps or not 0 <= shifted_at < len(token_ids)):
            raise ValueError(f"request {rid}: shifted_prefix ({len(shifted_prefix)} tokens at {shifted_at}) "
                             f"must be whole pages of {ps} tokens inside the prompt")
        if rid < 0:
            raise ValueError(f"request {rid}: request ids must be >= 0")
        module_ids = self._check_modular(rid, token_ids, modules, rope_runs or [], sampling) if modules else []
        if priority and not self.config.enable_priority:
            raise ValueError(f"request {rid}: priority {priority} needs a server started with --enable-priority "
                             f"(without it every request has priority 0)")
        asked = self._check_pins(rid, len(token_ids), pins, bool(modules)) if pins else []
        req = Request(rid, TokenArray(token_ids), len(token_ids), sampling, cache_salt, self._arrivals)
        req.priority, req.queued_at = priority, self._clock()
        if asked:                                   # the last check: nothing is reserved for a refused request
            req.pins = self.cache.pins.reserve(rid, req.token_ids, cache_salt, asked)
        req.shifted_prefix, req.shifted_at = list(shifted_prefix or ()), shifted_at
        req.modules, req.rope_runs, req.module_ids = list(modules or ()), list(rope_runs or ()), module_ids
        req.arrived_s = arrived
        self._arrivals += 1
        self._requests[rid] = req
        for span in self.cache.missing_modules(req):
            self._compute_span(span)
        self._waiting.append(req)

    def _check_pins(self, rid: int, num_tokens: int, pins: list[PinSpec], modular: bool) -> list[tuple[int, float]]:
        """The pins asked, as (whole-page prefix length, TTL), those shorter than a page left out."""
        if self.config.disable_radix_cache or modular:
            raise ValueError(f"request {rid}: pinned prefixes need the radix cache"
                             + (" (modular prompts cannot pin)" if modular else ""))
        if len(pins) > MAX_PINS:
            raise ValueError(f"request {rid}: at most {MAX_PINS} pinned prefixes per request, got {len(pins)}")
        ps, out = self.config.page_size, []
        for pin in pins:
            if pin.num_tokens < 0 or not pin.ttl_s > 0:
                raise ValueError(f"request {rid}: a pin needs num_tokens >= 0 and ttl_s > 0, got {pin}")
            n = min(pin.num_tokens, num_tokens)
            if n >= ps:
                out.append((n - n % ps, pin.ttl_s))
        return out

    def _check_modular(self, rid: int, token_ids: np.ndarray, modules: list[ModuleSpan],
                       rope_runs: list[tuple[int, int]], sampling: SamplingParams) -> list[np.ndarray]:
        """The spans' token ids as int32 arrays, once the modular request checks out."""
        ps = self.config.page_size
        if self.config.disable_radix_cache:
            raise ValueError(f"request {rid}: modular prompts need the radix cache")
        if any(not span.token_ids or len(span.token_ids) % ps for span in modules):
            raise ValueError(f"request {rid}: every module span must be whole pages of {ps} tokens")
        try:
            ids = [as_tokens(span.token_ids) for span in modules]
        except ValueError as exc:
            raise ValueError(f"request {rid}: a module span's {exc}") from None
        head = np.concatenate(ids)
        if len(token_ids) <= len(head) or not np.array_equal(token_ids[:len(head)], head):
            raise ValueError(f"request {rid}: a modular prompt's tokens must be its spans' tokens, then new text")
        if sampling.prompt_logprobs is not None:
            raise ValueError(f"request {rid}: prompt logprobs are not available for modular prompts")
        if any(not isinstance(i, int) or i < 0 for i, _ in rope_runs):
            raise ValueError(f"request {rid}: malformed rope_runs")
        return ids

    def _compute_span(self, span: ModuleSpan) -> None:
        """Queue an internal request that computes ``span``'s KV into the tree (once per span at a time),
        ahead of the requests waiting for it."""
        key = _span_key(span.key, span.token_ids)
        if key in self._span_jobs:
            return
        self._internal_rids -= 1
        rid = self._internal_rids
        child = Request(rid, TokenArray(span.token_ids), len(span.token_ids), _SPAN_SAMPLING, span.key, self._arrivals)
        child.rope_runs, child.internal = list(span.rope_runs), True
        child.arrived_s = time.perf_counter()
        self._arrivals += 1
        self._requests[rid] = child
        self._span_jobs[key] = rid
        self._waiting.appendleft(child)

    def abort(self, rid: int) -> RequestUpdate | None:
        """Drop ``rid`` at any stage, freeing its KV now; None if it is not live."""
        req = self._requests.pop(rid, None)
        if req is None:
            return None
        if req.phase is Phase.RUNNING:
            del self._running[rid]
            self.cache.release(req, keep_cache=False)
            self._forget_path(rid)
        else:
            self._waiting.remove(req)
        self.cache.forget_pins(req)
        if req.on_worker:
            self._released.append(rid)
        return self._final_update(req, [], "abort")

    def has_work(self) -> bool:
        """Live requests, or KV tier copies to send or to hear back about."""
        return bool(self._requests) or self._tiers_busy()

    @property
    def num_waiting(self) -> int:
        """Queued requests (``stats().num_waiting`` without building the stats)."""
        return len(self._waiting)

    @property
    def num_in_flight(self) -> int:
        """Steps planned whose output has not been processed yet."""
        return len(self._inflight)

    @property
    def num_row_steps_in_flight(self) -> int:
        """Of those, the steps with rows (a plan of transfers alone keeps no step of the device waiting)."""
        return sum(1 for s in self._inflight if s.extends or s.decodes)

    def early_loads(self) -> StepPlan | None:
        """With steps in flight: loads from host memory for queued requests not looked at yet, started now
        (``CacheManager.load_early``: free or evictable pages, never cooling ones, beyond the running
        requests' decode reservation),
        as a plan of transfers alone to send at once, beside the steps in flight. The admission that follows
        (usually the next plan) finds the pages on the device instead of loading them then. None when
        there is nothing to load."""
        if self._tiers is None or not self._inflight or not self._waiting:
            return None
        new = [r for r in itertools.islice(self._waiting, self.config.tier_lookahead) if not r.early_load_tried]
        if not new:                          # the common case, checked every loop: O(window), no more
            return None
        cache = self.cache
        free = (cache.allocator.num_free + cache.tree.evictable_pages
                - sum(self._prefill.reserve_pages(r) for r in self._running.values()))
        loaded = 0
        for req in new:                      # each looked at once, at arrival: never a cost per step
            loaded += cache.load_early(req, max(0, free - loaded))
        return self._transfers_plan() if loaded else None

    def flush_cache(self) -> bool:
        """Drop every cached prefix from the radix tree; refused (False) while requests are live."""
        if self._requests:
            return False
        self.cache.flush()
        return True

    def publish_load(self) -> None:
        """KV events: running and waiting requests and KV use (at most once a second; no-op without events)."""
        if self.cache.events is not None:
            used = 1.0 - self.cache.available_pages / max(1, self.config.num_pages)
            rates = self._tiers.rates() if self._tiers is not None else None
            self.cache.events.load(len(self._running), len(self._waiting), used, rates)

    def set_cascade_planner(self, planner: CascadePlanner | None) -> None:
        """``planner(rows)`` sees each step's decode rows with their radix paths; its result
        becomes ``StepPlan.cascade``."""
        self._cascade = None if planner is None else CascadeHook(planner)

    def schedule(self) -> StepPlan | None:
        """Plan one step; None when there is nothing to compute (or, with a step in flight, when
        only a retraction would make room: call again after ``process_output``).

        Scheduling model: every step is one mixed batch under a token budget of
        ``chunked_prefill_tokens``. (1) Decode first: each running request past prefill computes
        one token; its page for that token is allocated now, evicting LRU cache, and when even
        that fails the newest running requests are retracted to the queue. (2) Prefill spends the
        rest of the budget: running requests mid-prefill continue with their next chunk, then
        queued requests are admitted in policy order (lpm | dfs-weight | fcfs) while the KV budget
        (with its decode reservation) and ``max_running_requests`` allow; each admission reuses
        the longest cached prefix and locks it. (3) The plan is a diff for the worker: released
        rids, admissions with their page lists, page appends, extend chunks and decode rids.
        Planned work counts as done for the next plan (``KVHold.kv_len``, ``Request.num_pending``).
        With ``enable_priority`` the queue is taken by priority first (aged: ``policy.by_priority``), the
        policy order within a priority, and retraction takes the lowest priority first.
        """
        self.cache.pins.expire()
        running = list(self._running.values())
        dec = self._decode.schedule(running, can_retract=not self._inflight)  # may retract
        if dec is None:
            return None
        if self._tiers is not None:                 # an empty window clears the protection too
            window = itertools.islice(self._waiting, self.config.tier_lookahead)
            self._tiers.prefetch_window(window)
        budget = self.config.chunked_prefill_tokens - len(dec.decodes)
        pre = self._prefill.schedule(running, self._waiting, budget)
        if pre.missing:                             # evicted since the request arrived: compute again
            for span in pre.missing:
                self._compute_span(span)
            if not pre.extends:                     # nothing else to do: start on them now
                pre = self._prefill.schedule(running, self._waiting, budget)
        if not dec.decodes and not pre.extends:
            return self._transfers_only()
        for req in pre.admitted:
            self._running[req.rid] = req
        sources: dict[int, Request] = {}
        admitted = [self._admission(r, sources) for r in pre.admitted]
        for req in pre.admitted:
            req.on_worker = True
        extends = [_Extend(r, n, r.hold.kv_len + n == r.prefill_len, r.owed_prompt_logprobs(n))
                   for r, n in pre.extends]
        items = [ExtendItem(e.req.rid, e.req.hold.kv_len, e.num_tokens, e.ends_prefill, *e.prompt_logprobs)
                 for e in extends]
        samplers = {r.rid: r for r in dec.decodes}
        samplers.update((e.req.rid, e.req) for e in extends if e.ends_prefill)
        cascade = None
        if self._cascade is not None and dec.decodes:
            cascade = self._cascade.plan(self.cache.tree, dec.decodes)
        plan = StepPlan(
            step_id=self._next_step,
            released=self._released,
            admitted=admitted,
            page_appends=[PageAppend(r.rid, pages) for r, pages in dec.page_appends],
            extends=items,
            decodes=[r.rid for r in dec.decodes],
            cascade=cascade,
            transfers=self._take_transfers(),
            page_copies=self.cache.take_page_copies(),
        )
        self.cache.advance(pre.extends, dec.decodes)
        for req in samplers.values():
            req.num_pending += 1
        self._released = []
        self._inflight.append(_InFlight(self._next_step, extends, dec.decodes, samplers))
        self.cache.step_planned(self._next_step)
        self._next_step += 1
        return plan

    def observe_step(self, extend_tokens: int, device_s: float) -> None:
        """A finished step's extend tokens and device time (the tiers' wait-or-recompute rates)."""
        if self._tiers is not None:
            self._tiers.costs.step(extend_tokens, device_s)

    def process_output(self, out: StepOutput, *, defer_release: bool = False) -> list[RequestUpdate]:
        """Apply the output of the oldest step in flight. With ``defer_release`` the requests it finishes
        give their KV back (tree inserts, tier saves) only at ``release_finished()``, which the caller
        makes before any other call: the runtime loop sends the step's updates first, so that the last
        tokens of a wave of finishing requests do not wait for their releases."""
        try:
            return self._process_output(out)
        finally:
            if not defer_release:
                self.release_finished()

    def release_finished(self) -> None:
        """Give back the KV of the requests finished since the last call (``process_output``)."""
        finished, self._finished = self._finished, []
        for req, keep_cache in finished:
            self.cache.release(req, keep_cache=keep_cache)
            self.cache.forget_pins(req)
            self._released.append(req.rid)

    def _process_output(self, out: StepOutput) -> list[RequestUpdate]:
        if not self._inflight or out.step_id != self._inflight[0].step_id:
            raise ValueError(f"StepOutput {out.step_id} does not answer the oldest step in flight")
        step = self._inflight.popleft()
        self.cache.step_processed(step.step_id)
        if self._tiers is not None:
            self._tiers.on_acks(out.kv_acks)
            self.cache.publish_tiers()
        for req in step.samplers.values():
            req.num_pending -= 1
        if out.error is not None:   # fail every request of the step
            batch = {id(r): r for r in [*(e.req for e in step.extends), *step.decodes]}
            failed = [self._finish(r, "abort", error=out.error) for r in batch.values()
                      if self._running.get(r.rid) is r]
            spans = {_span_key(r.salt, r.token_ids.prefix(r.num_prompt)) for r in batch.values() if r.internal}
            if spans:                          # requests waiting for a span that failed fail too
                failed += self._fail_waiting(spans, out.error)
            return [u for u in failed if u.rid >= 0]
        for ext in step.extends:
            req = ext.req
            if self._running.get(req.rid) is not req:
                continue                       # aborted while in flight
            first, owed = ext.prompt_logprobs
            req.prompt_logprob_pos = max(req.prompt_logprob_pos, first + owed)
            self.cache.commit(req, ext.num_tokens)
            if ext.ends_prefill:
                self.cache.share_computed_prefix(req)
        self.cache.commit_decodes(step.decodes)
        updates = []
        for rid, why in out.failed:            # failed alone (e.g. a grammar over its time budget)
            req = step.samplers.get(rid)
            if req is not None and self._running.get(rid) is req:
                update = self._finish(req, "abort", error=why)
                updates.append(msgspec.structs.replace(update, error_type="invalid_request_error"))
        for rid, token in zip(out.rids, out.token_ids, strict=True):
            req = step.samplers.get(rid)
            if req is None or self._running.get(rid) is not req:
                continue                       # aborted, or found finished one step late
            req.token_ids.append(token)
            decision = self._stop.on_token(req)
            base = req.num_prompt
            new = req.token_ids[base + req.num_emitted: base + decision.emit_upto]
            req.num_emitted = decision.emit_upto
            if decision.finish_reason is None:
                updates.append(self._update(req, new))
            else:
                updates.append(self._finish(req, decision.finish_reason, new,
                                            decision.matched_stop, decision.trim_chars))
        return [u for u in updates if u.rid >= 0]          # internal requests are never reported

    def stats(self) -> SchedulerStats:
        self.cache.pins.expire()
        alloc, tree = self.cache.allocator, self.cache.tree
        tier_stats = self._tiers.stats() if self._tiers is not None else {}
        return msgspec.structs.replace(self._base_stats(alloc, tree), **tier_stats)

    def _base_stats(self, alloc, tree) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self._running), num_waiting=len(self._waiting),
            kv_total_pages=alloc.num_pages, kv_free_pages=self.cache.num_free_pages,
            kv_used_pages=alloc.num_pages - self.cache.num_free_pages,
            cached_tokens=tree.cached_tokens, evictable_tokens=tree.evictable_tokens,
            locked_tokens=tree.locked_tokens, cache_hit_tokens=self._prefill.hit_tokens,
            prompt_tokens=self._prefill.prompt_tokens, num_retractions=self._retractions,
            stage_seconds=dict(self._prefill.stages.seconds), stage_counts=dict(self._prefill.stages.counts),
            **self._pin_stats())

    def _pin_stats(self) -> dict[str, int]:
        pins = self.cache.pins
        c = pins.counters
        return {"pinned_tokens": pins.pinned_tokens, "num_pins": len(pins), "pins_created": c.created,
                "pin_expiries": c.expired, "pin_yields": c.yielded, "pin_hits": c.hits, "pin_refusals": c.refused}

    def audit(self, integrity: bool = True) -> KVAudit:
        """Who holds the KV pages and radix locks, and (``integrity``) ``check_integrity``'s verdict; without
        it ``integrity_error`` is None: the caller supplies its last verdict."""
        return audit_kv(self.cache, self._running.values(), len(self._requests),
                        self.check_integrity if integrity else None)

    def check_integrity(self) -> None:
        """Raise AssertionError unless KV accounting and request state agree."""
        self.cache.check_integrity(self._running.values())
        for req in self._running.values():
            hold = req.hold
            if (req.phase is not Phase.RUNNING or len(hold.pages) < self.config.pages_for(hold.kv_len)
                    or hold.kv_committed > hold.kv_len or req.num_pending < 0):
                raise AssertionError(f"running request {req.rid} is inconsistent")
        for req in self._waiting:
            if req.phase is not Phase.WAITING or req.hold.pages or req.hold.holds_locks:
                raise AssertionError(f"queued request {req.rid} holds KV")
        if len(self._running) + len(self._waiting) != len(self._requests):
            raise AssertionError("request table disagrees with the queue and the running set")

    # -- internals -----------------------------------------------------------------------------

    def _transfers_only(self) -> StepPlan | None:
        """A plan without rows when KV tier copies wait to be sent, or (nothing in flight) their
        acknowledgements are awaited: the worker answers it once every copy has completed or after a few
        milliseconds with those done so far (a plan with rows arriving meanwhile is launched at once), and
        another follows while any is left."""
        if not self._tiers_busy() or (self._inflight and not self._tiers.has_outgoing()):
            return None
        return self._transfers_plan()

    def _transfers_plan(self) -> StepPlan:
        plan = StepPlan(step_id=self._next_step, released=self._released, transfers=self._take_transfers())
        self._released = []
        self._inflight.append(_InFlight(self._next_step, [], [], {}))
        self.cache.step_planned(self._next_step)
        self._next_step += 1
        return plan

    def _tiers_busy(self) -> bool:
        return self._tiers is not None and self._tiers.busy()

    def _take_transfers(self) -> KVTransfers | None:
        """The tier copies to send with the step being planned."""
        return None if self._tiers is None else self._tiers.take_transfers(self._next_step)

    def _admission(self, req: Request, sources: dict[int, Request]) -> AdmittedRequest:
        """The worker needs the tokens it will compute, not the cached prefix (O(new tokens)); nor the page ids
        of a cached prefix that a request admitted before it in this plan holds too (``sources``: tree node
        id -> the first request of this plan whose locked path passes through it; see ``_page_source``)."""
        offset = 0 if needs_all_tokens(req.sampling) else req.hold.kv_len
        if needs_outputs(req.sampling):
            offset = min(offset, req.num_prompt)
        sp = req.sampling
        ban = (sorted(set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self.config.eos_token_ids)))
               if sp.min_tokens > req.num_outputs else [])
        hold = req.hold
        source, shared = self._page_source(req, sources)
        if source is None:
            return AdmittedRequest(req.rid, req.token_ids[offset:], req.num_prompt, list(hold.pages), req.sampling,
                                   offset, req.rope_runs, ban)
        return AdmittedRequest(req.rid, req.token_ids[offset:], req.num_prompt, hold.pages[shared:], req.sampling,
                               offset, req.rope_runs, ban, pages_from=source.rid, pages_shared=shared)

    @staticmethod
    def _page_source(req: Request, sources: dict[int, Request]) -> tuple[Request | None, int]:
        """(an earlier admission of the plan whose page list starts with ``req``'s first ``shared`` pages,
        ``shared``), or (None, 0). The first ``num_shared_pages`` pages of a hold are the tree path to its lock
        node (KVHold's invariant), so two holds whose paths pass through one node agree on the pages up to
        it. The walk goes up from ``req``'s lock node to the deepest node an earlier admission passed
        through, registering ``req`` for the nodes below it (its whole page list is on the worker once
        admitted); it stops where fewer than ``SHARED_PAGES_BY_REF`` pages remain above. Questions over one
        document whose last page each holds a different token (locking different one-page children of the
        document's node) share the document's pages this way."""
        hold = req.hold
        node, end = hold.lock_node, hold.num_shared_pages
        if node is None or hold.module_nodes:
            return None, 0
        # a split of a node keeps its object as the lower part, ending where it did: ids stay valid in a plan
        while node.parent is not None and end >= SHARED_PAGES_BY_REF:
            source = sources.setdefault(id(node), req)
            if source is not req:
                return source, end
            end -= len(node.pages)
            node = node.parent
        return None, 0

    def _retract(self, req: Request) -> None:
        del self._running[req.rid]
        self.cache.release(req, keep_cache=True)
        self._forget_path(req.rid)
        req.phase = Phase.WAITING
        req.on_worker = False
        self._released.append(req.rid)
        self._waiting.appendleft(req)
        self._retractions += 1

    def _finish(self, req: Request, reason: FinishReason, new: list[int] | None = None,
                matched_stop: int | str | None = None, trim_chars: int = 0,
                error: str | None = None) -> RequestUpdate:
        del self._requests[req.rid]
        del self._running[req.rid]
        self._forget_path(req.rid)
        if req.internal:
            self._span_jobs.pop(_span_key(req.salt, req.token_ids.prefix(req.num_prompt)), None)
        self._finished.append((req, error is None))      # released by ``release_finished``
        return self._final_update(req, new or [], reason, matched_stop, trim_chars, error)

    def _forget_path(self, rid: int) -> None:
        if self._cascade is not None:
            self._cascade.forget(rid)

    def _fail_waiting(self, spans: set[tuple[str | None, bytes]], error: str) -> list[RequestUpdate]:
        waiting = [r for r in self._waiting
                   if any(_span_key(s.key, ids) in spans for s, ids in zip(r.modules, r.module_ids))]
        for req in waiting:
            self._waiting.remove(req)
            del self._requests[req.rid]
            self.cache.forget_pins(req)
        return [self._final_update(r, [], "abort", error=error) for r in waiting]

    def _update(self, req: Request, new: list[int]) -> RequestUpdate:
        return RequestUpdate(req.rid, new, prompt_tokens=req.num_prompt,
                             completion_tokens=req.num_outputs,
                             cached_tokens=req.cached_tokens or 0, module_tokens=req.module_tokens)

    @staticmethod
    def _final_update(req: Request, new: list[int], reason: FinishReason,
                      matched_stop: int | str | None = None, trim_chars: int = 0,
                      error: str | None = None) -> RequestUpdate:
        return RequestUpdate(req.rid, new, True, reason, matched_stop, trim_chars, req.num_prompt,
                             req.num_outputs, req.cached_tokens or 0, error, req.module_tokens)
