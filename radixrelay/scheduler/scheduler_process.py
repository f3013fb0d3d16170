"""The scheduler process: request queue, radix cache and batching, between the frontend and the
worker.

Start-up: load the tokenizer while the worker loads the model, wait for its ``WorkerReady`` (it knows
how much KV memory it got), build the ``Scheduler``, report ``RuntimeReady`` to the frontend.

Loop (``SchedulerLoop.run``), with up to ``depth`` steps in flight (2: overlap scheduling, the
default; 1 with ``disable_overlap``):

    schedule steps while fewer than depth are in flight and there is work -> send them to the worker
    block on both inboxes (never spins: an idle scheduler sleeps in poll)
    worker output   -> process_output -> token updates to the frontend
    frontend input  -> drained completely before the next schedule(), so aborts and arrivals
                       land between steps (an abort frees its KV before the next plan)
    arrivals        -> their pages in host memory start loading at once (``Scheduler.early_loads``:
                       a plan of transfers alone, sent beside the steps in flight; such plans do not
                       count against ``depth``)

With depth 2, step N+1 is planned and sent while the device computes step N; step N's output is
processed (stop checks, streaming) while N+1 computes, and only then is N+2 planned, so every plan
is at most one step ahead of what the host knows.

A frame that does not decode as its channel's message (or a worker message other than a step
output while serving) is logged and dropped; the loop keeps serving. Each ``StatsRequest`` also
audits the KV cache (``Scheduler.audit``: pages and locks by holder, ``check_integrity``) and logs
a failed check. ``check_integrity`` runs on every audit while idle, and at most every
``INTEGRITY_EVERY_S`` while requests are live (it stalls the loop for ~ms at a full host tier; a
scrape in between reports the last verdict and its age).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import msgspec
import zmq

from radixrelay.cascade.planner import CascadePlanner, make_cascade_planner
from radixrelay.config import EngineConfig
from radixrelay.env import gc_mode, overlap_depth, step_log_path
from radixrelay.model.model_registry import tokenizer_path
from radixrelay.protocol.messages import (
    AbortRequest, ChildArgs, FlushCacheReply, FlushCacheRequest, FrontendMessage, GenerateRequest, RejectReason,
    RequestRejected, RequestUpdate, RuntimeFailed, RuntimeReady, ShutdownRequest, StatsReply, StatsRequest,
    TokenUpdate, WorkerMessage, WorkerReady, WorkerStep, WorkerStepDone, WorkerStop, encoder,
)
from radixrelay.protocol.stats import CascadeCounters, GcStats, LoopCounters, RuntimeStats, WorkerCounters
from radixrelay.protocol.step import PromptLogprobsChunk, StepOutput, TokenLogprobs
from radixrelay.radix.disk_store import DiskKVStore, rank_namespace
from radixrelay.radix.tiers import KVTiers
from radixrelay.scheduler.paced_audit import PacedAudit
from radixrelay.proc.child import POLL_MS, FrameDecoder, bind_pull, connect_push, parent_gone, run_child
from radixrelay.proc.gc_control import GcControl
from radixrelay.scheduler.step_log import StepLog
from radixrelay.protocol.token_ids import unpack_token_ids
from radixrelay.scheduler.scheduler_config import SchedulerConfig
from radixrelay.scheduler.frontend_outboxes import FrontendOutboxes
from radixrelay.scheduler.scheduler import Scheduler
from radixrelay.text.tokenizer import load_tokenizer

# While requests are live, the KV integrity check (memory-bound over every page and host-tier entry)
# runs at most this often; at idle, on every stats request.
INTEGRITY_EVERY_S = 30.0

logger = logging.getLogger("radixrelay.scheduler")


class SchedulerLoop:
    def __init__(self, scheduler: Scheduler, planner: CascadePlanner | None, args: ChildArgs,
                 frontend_in: zmq.Socket, frontend_out: FrontendOutboxes, worker_in: zmq.Socket,
                 worker_out: zmq.Socket, collector: GcControl, worker_gc: GcStats) -> None:
        self.scheduler = scheduler
        self.planner = planner            # installed in the scheduler; kept here for its counters
        self.args = args
        self.max_queued = args.config.max_queued_requests
        self.frontend_in, self.frontend_out = frontend_in, frontend_out
        self.worker_in, self.worker_out = worker_in, worker_out
        self._encode = encoder().encode
        self._frontend_msgs = FrameDecoder(FrontendMessage, "frontend -> scheduler", logger)
        self._worker_msgs = FrameDecoder(WorkerMessage, "worker -> scheduler", logger)
        self._live: dict[int, _Pending] = {}
        self.depth = 1 if args.config.disable_overlap else overlap_depth()
        self._stopping = False
        self.counters = LoopCounters()    # this loop's: written here only
        self._worker = WorkerCounters(gc=worker_gc)   # the worker's, as of its latest step output (or ready)
        # Decode-only steps (decode rows, no extends): step id -> rows, while in flight; then counted with
        # their worker launch time (the launch the serving-loop target is about, apart from mixed steps)
        self._decode_only: dict[int, int] = {}
        self._extend_tokens: dict[int, int] = {}      # step id -> extend tokens, until its output arrives
        self._integrity_logged: str | None = None   # last check_integrity failure written to the log
        self._audits = PacedAudit(INTEGRITY_EVERY_S)
        self.collector = collector        # garbage collection: full collections when idle (gc_control)
        log_path = step_log_path()
        self.step_log = StepLog(log_path) if log_path else None

    def run(self) -> int:
        try:
            return self._run()
        finally:
            if self.step_log is not None:
                self.step_log.close()

    def _run(self) -> int:
        poller = zmq.Poller()
        poller.register(self.frontend_in, zmq.POLLIN)
        poller.register(self.worker_in, zmq.POLLIN)
        while not self._stopping:
            while self.scheduler.num_row_steps_in_flight < self.depth and self._start_step():
                pass
            events = dict(poller.poll(POLL_MS))
            if not events and parent_gone(self.args):
                return 1
            # idle: nothing arrived for POLL_MS and nothing is running or waiting
            self.collector.poll(idle=not events and not self.scheduler.has_work())
            self.scheduler.publish_load()
            if self.worker_in in events:
                self._drain_worker()
            self._drain_frontend()
            self._send_early_loads()
        self.worker_out.send(self._encode(WorkerStop()))
        return 0

    # -- steps ----------------------------------------------------------------------------------

    def _start_step(self) -> bool:
        """Plan and send one step; False when there is nothing to send now."""
        start = time.perf_counter()
        try:
            return self._schedule_step()
        finally:
            self.counters.scheduler_busy_s += time.perf_counter() - start

    def _schedule_step(self) -> bool:
        plan = self.scheduler.schedule()
        if plan is None:
            # With nothing in flight, admission guarantees progress (never expected); with a step
            # in flight the scheduler may wait for its output (e.g. before a retraction).
            if self.scheduler.has_work() and not self.scheduler.num_in_flight:
                self._fail_all("scheduler made no progress: no request fits the KV cache")
            return False
        c = self.counters
        c.steps += 1
        extend_tokens = sum(e.num_tokens for e in plan.extends)
        c.computed_tokens += extend_tokens + len(plan.decodes)
        if extend_tokens:
            self._extend_tokens[plan.step_id] = extend_tokens
        if self.step_log is not None:
            self.step_log.step(plan.step_id, len(plan.decodes), len(plan.extends), extend_tokens,
                               self.scheduler.num_waiting,
                               [e.rid for e in plan.extends if e.sample],
                               sum(len(a.pages) for a in plan.admitted) + sum(len(a.pages) for a in plan.page_appends))
        if plan.decodes:
            c.decode_steps += 1
            if not plan.extends:
                self._decode_only[plan.step_id] = len(plan.decodes)
        self.worker_out.send(self._encode(WorkerStep(plan)))
        return True

    def _send_early_loads(self) -> None:
        """Requests that just arrived while steps are in flight: their pages in host memory start loading
        now, in a plan of transfers alone sent beside those steps, instead of with their admission."""
        start = time.perf_counter()
        try:
            plan = self.scheduler.early_loads()
            if plan is not None:
                self.counters.steps += 1
                self.worker_out.send(self._encode(WorkerStep(plan)))
        finally:
            self.counters.scheduler_busy_s += time.perf_counter() - start

    def _on_worker(self, message: WorkerMessage | None) -> None:
        if message is None:
            return
        if not isinstance(message, WorkerStepDone):
            # The worker sends WorkerReady / RuntimeFailed only before this loop starts.
            return self._worker_msgs.drop(f"unexpected {type(message).__name__} while serving")
        start = time.perf_counter()
        c = self.counters
        c.worker_busy_s += message.busy_s
        if self.step_log is not None:
            self.step_log.done(message.output.step_id, message.busy_s, message.device_s, message.launch_s)
        c.worker_launch_s += message.launch_s
        c.worker_device_s += message.device_s
        c.graph_capture_s += message.capture_s
        if (tokens := self._extend_tokens.pop(message.output.step_id, None)) is not None:
            self.scheduler.observe_step(tokens, message.device_s)     # the prefill rate (tier cost model)
        if (rows := self._decode_only.pop(message.output.step_id, None)) is not None:
            c.decode_only_steps += 1
            c.decode_only_rows += rows
            c.decode_only_launch_s += message.launch_s - message.capture_s
        self._worker = message.counters
        try:
            self._process(message.output)
        finally:
            c.scheduler_busy_s += time.perf_counter() - start

    def _drain_worker(self) -> None:
        """Every output that has arrived, oldest first, before the next plan."""
        _drain(self.worker_in, lambda raw: self._on_worker(self._worker_msgs(raw)))

    def _process(self, out: StepOutput) -> None:
        for chunk in out.prompt_logprobs:
            pending = self._live.get(chunk.rid)
            if pending is not None:
                pending.add_prompt_logprobs(chunk)
        if out.logprobs is not None:
            for rid, lp in zip(out.rids, out.logprobs):
                pending = self._live.get(rid)
                if pending is not None and pending.logprobs is not None and lp is not None:
                    pending.logprobs.append(lp)
        try:
            updates = self.scheduler.process_output(out, defer_release=True)
            if updates:
                self._send_updates(updates)
        finally:
            self.scheduler.release_finished()       # after the tokens are on their way

    def _send_updates(self, updates: list[RequestUpdate]) -> None:
        items = []
        for update in updates:
            pending = self._live.pop(update.rid) if update.finished else self._live[update.rid]
            items.append(pending.take(update))
        self.frontend_out.updates(items)

    def _fail_all(self, error: str) -> None:
        logger.error("%s; failing %d requests", error, len(self._live))
        updates = [msgspec.structs.replace(u, error=error)
                   for rid in list(self._live) if (u := self.scheduler.abort(rid)) is not None]
        self._send_updates(updates)

    # -- frontend -------------------------------------------------------------------------------

    def _drain_frontend(self) -> None:
        _drain(self.frontend_in, lambda raw: self._on_frontend(self._frontend_msgs(raw)))

    def _on_frontend(self, message: FrontendMessage | None) -> None:
        if message is None:
            return
        if isinstance(message, GenerateRequest):
            self._add(message)
        elif isinstance(message, AbortRequest):
            update = self.scheduler.abort(message.rid)
            if update is not None:
                self._send_updates([update])
        elif isinstance(message, FlushCacheRequest):
            self.frontend_out.reply(message.call_id, FlushCacheReply(message.call_id, self.scheduler.flush_cache()))
        elif isinstance(message, StatsRequest):
            self.frontend_out.reply(message.call_id, StatsReply(message.call_id, self._stats()))
        elif isinstance(message, ShutdownRequest):
            self._stopping = True

    def _stats(self) -> RuntimeStats:
        audit = self._audits.audit(self.scheduler, time.monotonic())
        if audit.integrity_error is not None and audit.integrity_error != self._integrity_logged:
            logger.error("KV cache integrity check failed: %s", audit.integrity_error)
        self._integrity_logged = audit.integrity_error
        c = self.counters
        c.malformed_frames = self._frontend_msgs.dropped + self._worker_msgs.dropped
        c.gc = self.collector.stats()
        cascade = self.planner.counters if self.planner is not None else CascadeCounters()
        return RuntimeStats(self.scheduler.stats(), c, self._worker, cascade, kv_audit=audit)

    def _add(self, req: GenerateRequest) -> None:
        def reject(reason: RejectReason, why: str) -> None:
            self.frontend_out.reply(req.rid, RequestRejected(req.rid, reason, why))

        if req.rid in self._live:
            return reject("invalid", f"request id {req.rid} is already live")
        if self.scheduler.num_waiting >= self.max_queued:
            return reject("queue_full", f"the queue is full ({self.max_queued} waiting requests)")
        try:
            token_ids = unpack_token_ids(req.token_ids)         # int32, no Python int per token
            if self.step_log is not None:
                self.step_log.arrive(req.rid, len(token_ids))
            self.scheduler.add_request(req.rid, token_ids, req.sampling, req.cache_salt,
                                       req.shifted_prefix, req.shifted_at, req.modules, req.rope_runs,
                                       req.pins, req.priority)
        except ValueError as exc:
            return reject("invalid", str(exc))
        self._live[req.rid] = _Pending([] if req.sampling.logprobs is not None else None,
                                       [] if req.sampling.prompt_logprobs is not None else None)


def _drain(sock: zmq.Socket, handle) -> None:
    """Handle every message waiting on ``sock``, in order, without blocking."""
    while True:
        try:
            raw = sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return
        handle(raw)


@dataclass
class _Pending:
    """What a live request produced that the frontend has not received yet (None: not asked)."""

    logprobs: list[TokenLogprobs] | None          # sampled tokens' logprobs (emitted tokens are
                                                  # always a prefix of the sampled ones, in order)
    prompt_logprobs: list[TokenLogprobs] | None   # prompt tokens 1, 2, ...; None once handed out

    def add_prompt_logprobs(self, chunk: PromptLogprobsChunk) -> None:
        """Chunks arrive in order, each position once (the scheduler never recomputes one)."""
        have = self.prompt_logprobs
        if have is None or chunk.first_token != len(have) + 1:
            raise RuntimeError(f"request {chunk.rid}: prompt logprobs from token {chunk.first_token} "
                               f"arrived out of order ({'none' if have is None else len(have)} held)")
        have.extend(chunk.entries)

    def take(self, update: RequestUpdate) -> TokenUpdate:
        """The update with the logprobs of its tokens; the prompt logprobs ride on the first one."""
        logprobs = None
        if self.logprobs is not None:
            n = len(update.token_ids)
            logprobs, self.logprobs[:n] = self.logprobs[:n], []
        prompt, self.prompt_logprobs = self.prompt_logprobs, None
        return TokenUpdate(update, logprobs, prompt)


def make_tiers(cfg: EngineConfig, ready: WorkerReady) -> KVTiers | None:
    """The scheduler's index of the worker's KV tiers; pages a disk tier kept from an earlier run of
    the same model and layout (same namespace directory, same page size) are found again: with
    tensor parallelism, those every rank's directory holds."""
    if ready.host_pages < 1:
        return None
    keys: list[bytes] = []
    if ready.disk_pages and cfg.disk_kv_path is not None:
        for rank in range(cfg.tp):
            files = DiskKVStore(cfg.disk_kv_path, rank_namespace(ready.kv_namespace, rank, cfg.tp)).scan()
            mine = dict.fromkeys(key for key, size in files.items() if size == ready.page_bytes)
            keys = list(mine) if rank == 0 else [key for key in keys if key in mine]
    return KVTiers(ready.host_pages, ready.disk_pages, keys, cfg.kv_tier_policy)


def _wait_for_worker(args: ChildArgs, worker_in: zmq.Socket) -> WorkerReady | RuntimeFailed | None:
    """The worker's first message (malformed frames dropped); None when the parent died meanwhile."""
    frames = FrameDecoder(WorkerMessage, "worker -> scheduler", logger)
    message = None
    while message is None:
        while not worker_in.poll(POLL_MS):
            if parent_gone(args):
                return None
        message = frames(worker_in.recv())
    if isinstance(message, WorkerStepDone):
        return RuntimeFailed("worker sent a step output before it was ready")
    return message


def _kv_events(cfg, ready: WorkerReady):
    """The replica's KV event publisher (``--kv-events``), or None; ``ConnectionError`` when the store
    does not answer (a start-up error)."""
    if cfg.kv_events is None:
        return None
    from radixrelay.kv_auth import read_key
    from radixrelay.kv_events import KVEventPublisher
    from radixrelay.kv_store import read_password

    key = read_key(cfg.kv_events_key_file, "--kv-events-key-file") if cfg.kv_events_key_file else None
    password = read_password(cfg.kv_events_password_file, "--kv-events-password-file")
    return KVEventPublisher(cfg.kv_events, cfg.kv_events_name or "", ready.kv_namespace, cfg.page_size,
                            key=key, password=password)


def _serve(args: ChildArgs, ctx: zmq.Context) -> int:
    ep = args.endpoints
    frontend_in = bind_pull(ctx, ep.frontend_to_scheduler)
    worker_in = bind_pull(ctx, ep.worker_to_scheduler)
    worker_out = connect_push(ctx, ep.scheduler_to_worker)
    encode = encoder().encode
    frontend_out = FrontendOutboxes([connect_push(ctx, inbox) for inbox in ep.frontend_inboxes()], encode)
    cfg = args.config
    # The tokenizer loads on a thread while the worker loads the model (seconds each); this thread stays
    # on the worker's socket, so a worker that fails to start is reported at once.
    with ThreadPoolExecutor(1, thread_name_prefix="tokenizer") as pool:
        loading = pool.submit(load_tokenizer, tokenizer_path(cfg))
        ready = _wait_for_worker(args, worker_in)
        if ready is None:
            return 1
        if isinstance(ready, RuntimeFailed):
            frontend_out.first(ready)
            return 1
    publisher = None
    try:
        tokenizer = loading.result()
        eos = tuple(sorted(tokenizer.eos_token_ids | set(ready.eos_token_ids)))
        publisher = _kv_events(cfg, ready)
        scheduler = Scheduler(
            SchedulerConfig(kv_cache_tokens=ready.num_pages * cfg.page_size, page_size=cfg.page_size,
                            max_running_requests=cfg.max_running_requests,
                            chunked_prefill_tokens=cfg.chunked_prefill_tokens,
                            schedule_policy=cfg.schedule_policy,
                            disable_radix_cache=cfg.disable_radix_cache, eos_token_ids=eos,
                            kv_namespace=ready.kv_namespace, kv_page_bytes=ready.page_bytes,
                            pinned_kv_tokens=cfg.pinned_kv_budget(ready.num_pages * cfg.page_size),
                            pin_ttl_scale=cfg.pin_ttl_scale, enable_priority=cfg.enable_priority,
                            priority_ageing_s=cfg.priority_ageing_s),
            detokenize=tokenizer.decode, tiers=make_tiers(cfg, ready), events=publisher)
        planner = make_cascade_planner(cfg.cascade, cfg.page_size)
        scheduler.set_cascade_planner(planner)
    except Exception as exc:  # noqa: BLE001 - reported to the frontend, which raises it
        if publisher is not None:
            publisher.close()
        frontend_out.first(RuntimeFailed(f"scheduler start-up failed: {type(exc).__name__}: {exc}"))
        return 1
    collector = GcControl("scheduler", gc_mode(), logger)
    collector.settle()                 # the tokenizer and the scheduler's structures: never scanned again
    frontend_out.first(RuntimeReady(ready.num_pages * cfg.page_size, ready.max_context,
                                    ready.vocab_size, ready.precision))
    try:
        return SchedulerLoop(scheduler, planner, args, frontend_in, frontend_out, worker_in, worker_out,
                             collector, GcStats(frozen=ready.gc_frozen)).run()
    finally:
        if publisher is not None:
            publisher.close()               # what is queued goes out (bounded), then its thread ends


if __name__ == "__main__":
    run_child("scheduler", _serve)
