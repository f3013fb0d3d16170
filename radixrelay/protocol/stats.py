"""The counters structs each process owns and reports (``StatsReply``, ``/metrics``, ``Engine.stats()``).

One struct per owner, each the only writer of its fields: the scheduler's queue and cache
(``SchedulerStats``, built per request), the scheduler loop's step counters (``LoopCounters``), the
worker's (``WorkerCounters``, incremented in place by the worker and sent as it is with every step
output), the cascade planner's (``CascadeCounters``), the frontend's (``FrontendCounters``), garbage
collection per process (``GcStats``). ``RuntimeStats`` nests them, with the KV audit taken per request.

Each field says once what it is, in its annotation: ``counter(...)`` (cumulative since start) or
``gauge(...)`` (a current value), with its description and, where they differ from the field's name, its
name and its Prometheus name; a nested counters struct is a ``part(...)``, whose ``prefix`` goes before
the names of its fields. ``readings(stats)`` walks them: ``/metrics`` (``radixrelay.server.prometheus_metrics``) and
``Engine.stats()`` (``stats_values``) are derived from it, so a new field is a new metric and a new stats key. Names:

    Engine.stats() key   the parts' prefixes, then its name (the field's)    (tier_load_s, worker_gc_seconds)
    Prometheus metric    radixrelay_, the prefixes, then its metric name     (radixrelay_kv_tier_load_seconds)

Fields of one metric name in several structs (``malformed_frames``: each process's inbox) add up.
"""

from __future__ import annotations

import functools
import typing
from collections.abc import Iterator
from typing import Annotated, Literal, NamedTuple

import msgspec

from radixrelay.protocol.cascade import CascadePlan

Kind = Literal["counter", "gauge", "part", "apart"]


def counter(description: str, metric: str | None = None, *, name: str | None = None) -> msgspec.Meta:
    """A cumulative field (a Prometheus counter). ``name``: its key and metric name where not the field's;
    ``metric``: its metric name where not that."""
    return msgspec.Meta(description=description, extra={"kind": "counter", "metric": metric, "name": name})


def gauge(description: str, metric: str | None = None, *, name: str | None = None) -> msgspec.Meta:
    """A current value (a Prometheus gauge); ``name``, ``metric`` as for ``counter``."""
    return msgspec.Meta(description=description, extra={"kind": "gauge", "metric": metric, "name": name})


def part(description: str, prefix: str = "", label: str | None = None) -> msgspec.Meta:
    """A nested counters struct: ``prefix`` goes before its fields' keys and metric names, ``label``
    (if any) before their help text."""
    return msgspec.Meta(description=description, extra={"kind": "part", "prefix": prefix, "label": label})


def apart(description: str) -> msgspec.Meta:
    """A nested struct that is no counters struct: its consumers read it by hand (the KV audit)."""
    return msgspec.Meta(description=description, extra={"kind": "apart"})


# -- the scheduler ------------------------------------------------------------------------------


class SchedulerStats(msgspec.Struct, frozen=True):
    """The scheduler's queue, KV cache and tiers, as of the stats request."""

    num_running: Annotated[int, gauge("Requests admitted and holding KV.", "num_requests_running")]
    num_waiting: Annotated[int, gauge("Requests queued for admission.", "num_requests_waiting")]
    kv_total_pages: Annotated[int, gauge("KV pages in the cache.")]
    kv_free_pages: Annotated[int, gauge("KV pages on the free list.")]
    kv_used_pages: Annotated[int, gauge("KV pages in use (requests or radix cache).")]
    cached_tokens: Annotated[int, gauge("Tokens held by the radix tree.", "radix_cached_tokens")]
    evictable_tokens: Annotated[int, gauge("Radix-tree tokens no running request locks (evictable).",
                                           "radix_evictable_tokens")]
    locked_tokens: Annotated[int, gauge("Radix-tree tokens locked by running requests.", "radix_locked_tokens")]
    cache_hit_tokens: Annotated[int, counter("Prompt tokens served from the radix cache.")]
    prompt_tokens: Annotated[int, counter("Prompt tokens admitted by the scheduler (first admissions).",
                                          "scheduled_prompt_tokens")]
    num_retractions: Annotated[int, counter("Requests retracted to the queue for lack of KV.", "retractions")]
    # -- pinned prefixes (``radixrelay.scheduler.pins``) ----------------------------------------------------
    pinned_tokens: Annotated[int, gauge("Radix-tree tokens held by pinned prefixes (overlaps counted once).",
                                        "radix_pinned_tokens")] = 0
    num_pins: Annotated[int, gauge("Pinned prefixes held.", "pinned_prefixes")] = 0
    pins_created: Annotated[int, counter("Pinned prefixes established.", "pins_created")] = 0
    pin_expiries: Annotated[int, counter("Pinned prefixes released after their time-to-live.", "pin_expiries")] = 0
    pin_yields: Annotated[int, counter("Pinned prefixes released early to fit a request that could not fit "
                                       "beside them.", "pin_yields")] = 0
    pin_hits: Annotated[int, counter("Pinned prefixes found in admissions' cached prefixes (each hit refreshes "
                                     "the pin's time-to-live).", "pin_hits")] = 0
    pin_refusals: Annotated[int, counter("Requests refused because their pins exceeded the pinned KV budget.",
                                         "pin_refusals")] = 0
    # -- KV tiers below the device (0 without): capacity, hits, bytes moved, load time -------------
    tier_host_pages: Annotated[int, gauge("KV pages the host tier can hold.", "kv_tier_host_pages")] = 0
    tier_host_used_pages: Annotated[int, gauge("KV pages held by the host tier.", "kv_tier_host_used_pages")] = 0
    tier_disk_pages: Annotated[int, gauge("KV pages the disk tier can hold.", "kv_tier_disk_pages")] = 0
    tier_disk_used_pages: Annotated[int, gauge("KV pages held by the disk tier.", "kv_tier_disk_used_pages")] = 0
    tier_host_hit_tokens: Annotated[int, counter("Prompt tokens loaded from host memory instead of computed.",
                                                 "kv_tier_host_hit_tokens")] = 0
    tier_disk_hit_tokens: Annotated[int, counter("Prompt tokens loaded from disk (through host memory; of the "
                                                 "host hits).", "kv_tier_disk_hit_tokens")] = 0
    tier_repositioned_tokens: Annotated[int, counter(
        "Prompt tokens of truncated prompts loaded from a tier with their keys rotated to new positions.",
        "kv_tier_repositioned_tokens")] = 0
    tier_prefetch_used_pages: Annotated[int, counter("Pages read from disk ahead of a turn and then used.",
                                                     "kv_tier_prefetch_used_pages")] = 0
    tier_loaded_at_once_pages: Annotated[int, counter(
        "Pages loaded from host memory whose copies could start at once, beside the steps before their own (their "
        "device pages written by no step in flight).", "kv_tier_loaded_at_once_pages")] = 0
    tier_early_load_tokens: Annotated[int, counter(
        "Prompt tokens loaded from host memory while their request was still queued (started at its arrival, "
        "beside the steps in flight; of the host hits).", "kv_tier_early_load_tokens")] = 0
    tier_read_failed_pages: Annotated[int, counter("Disk pages found missing, truncated or corrupt (misses).",
                                                   "kv_tier_read_failed_pages")] = 0
    tier_saved_bytes: Annotated[int, counter("KV bytes copied device to host.", "kv_tier_saved_bytes")] = 0
    tier_loaded_bytes: Annotated[int, counter("KV bytes copied host to device.", "kv_tier_loaded_bytes")] = 0
    tier_written_bytes: Annotated[int, counter("KV bytes copied host to disk.", "kv_tier_written_bytes")] = 0
    tier_read_bytes: Annotated[int, counter("KV bytes copied disk to host.", "kv_tier_read_bytes")] = 0
    tier_load_s: Annotated[float, counter("Device seconds of host-to-device KV loads.", "kv_tier_load_seconds")] = 0.0
    tier_load_exposed_s: Annotated[float, counter("Seconds of those loads that steps waited for.",
                                                  "kv_tier_load_exposed_seconds")] = 0.0
    tier_save_s: Annotated[float, counter("Device seconds of device-to-host KV saves.", "kv_tier_save_seconds")] = 0.0
    tier_recomputed_instead: Annotated[int, counter(
        "Queued requests admitted without waiting for their disk reads in flight, because computing those "
        "pages was estimated cheaper (measured disk read and prefill rates); the reads still land in host "
        "memory.", "kv_tier_recomputed_instead")] = 0
    tier_reads_skipped: Annotated[int, counter(
        "Runs of pages on disk not read ahead for a queued request because computing them was estimated "
        "cheaper (one read ahead every 5 s still measures the disk).", "kv_tier_reads_skipped")] = 0
    tier_disk_read_bytes_per_s: Annotated[float, gauge(
        "The disk tier's measured read rate while reading (bytes per second; 0 until measured).",
        "kv_tier_disk_read_bytes_per_second")] = 0.0
    # -- host time of requests' scheduler stages, by stage (``radixrelay.scheduler.stages``): read by hand
    # (labelled metrics ``radixrelay_request_stage_seconds_sum{stage=...}`` / ``_count``) --------------------
    stage_seconds: Annotated[dict[str, float], apart(
        "Scheduler host seconds of requests' stages, by stage: match (the radix tree and KV tier lookups of a "
        "queued request tried for admission), queue (arrival at the scheduler to first admission).")] = {}
    stage_counts: Annotated[dict[str, int], apart(
        "Of stage_seconds: the number of times each stage was timed (match: per admission try; queue: per "
        "request).")] = {}

    @property
    def kv_usage(self) -> float:
        return self.kv_used_pages / self.kv_total_pages


class KVAudit(msgspec.Struct, frozen=True):
    total_pages: int
    free_pages: int
    cached_pages: int                 # held by radix-tree nodes (locked or evictable)
    request_pages: int                # private pages of running requests (beyond their locked path)
    locked_nodes: int                 # radix nodes with lock_ref > 0 beyond their pins
    lock_refs: int                    # lock_ref summed over nodes (a lock counts once per node of its path), pins apart
    lock_holders: int                 # running requests holding a lock on their matched path
    live_requests: int                # running + waiting
    integrity_error: str | None = None   # check_integrity's failure, None when every invariant holds
    integrity_age_s: float = 0.0         # seconds since that verdict was computed (0: by this audit)
    pin_refs: int = 0                    # pin_ref summed over nodes: pinned prefixes' locks (not leaks)

    @property
    def integrity_ok(self) -> bool:
        return self.integrity_error is None

    @property
    def at_idle_baseline(self) -> bool:
        """No live request and nothing held on behalf of one (see ``radixrelay.scheduler.audit``)."""
        return (self.live_requests == 0 and self.request_pages == 0 and self.locked_nodes == 0
                and self.lock_refs == 0 and self.lock_holders == 0
                and self.free_pages + self.cached_pages == self.total_pages and self.integrity_ok)


# -- counters of every process ------------------------------------------------------------------


class GcStats(msgspec.Struct, frozen=True):
    """One process's collections since start (``radixrelay.proc.gc_control``)."""

    seconds: Annotated[float, counter("Time paused in Python's garbage collector.")] = 0.0
    collections: Annotated[int, counter("Garbage collections of any generation.")] = 0
    full_collections: Annotated[int, counter("Full (generation 2) garbage collections.")] = 0
    longest_s: Annotated[float, gauge("Longest garbage-collection pause since start.",
                                      "longest_pause_seconds")] = 0.0
    frozen: Annotated[int, gauge("Objects of the start-up heap frozen out of the garbage collector "
                                 "(RADIXRELAY_GC=managed; 0 otherwise).", "frozen_objects")] = 0


# One quantity counted by every process on its own inbox; the metric and the stats key are their sum.
_MALFORMED_FRAMES = counter("Runtime messages dropped because they did not decode as their channel's messages "
                            "(garbage, truncated, wrong type); the process kept serving. Summed over the "
                            "scheduler's, the worker's and the frontend's inboxes.")


class LoopCounters(msgspec.Struct):
    """The scheduler loop's (``radixrelay.scheduler.scheduler_process``), cumulative. The worker's seconds
    are its step outputs' per-step values, summed here; with overlap the worker's host work, the
    scheduler's and the device's run at the same time."""

    steps: Annotated[int, counter("Model steps run by the worker.")] = 0
    computed_tokens: Annotated[int, counter("Tokens run through the model (cache hits excluded).")] = 0
    decode_steps: Annotated[int, counter("Steps with decode rows.")] = 0
    worker_busy_s: Annotated[float, counter("Worker host time on steps (launch, then waiting for and reading "
                                            "results).", "worker_busy_seconds")] = 0.0
    worker_launch_s: Annotated[float, counter("Of the worker's step time: host work until the model's kernels "
                                              "were launched.", "worker_launch_seconds")] = 0.0
    scheduler_busy_s: Annotated[float, counter("Time spent scheduling steps and processing their outputs.",
                                               "scheduler_busy_seconds")] = 0.0
    worker_device_s: Annotated[float, counter("Device time of the worker's steps (CUDA events; on the CPU the "
                                              "worker's busy time): its rate is the device's busy fraction.",
                                              "worker_device_seconds")] = 0.0
    decode_only_steps: Annotated[int, counter("Steps with decode rows and no extend rows.")] = 0
    decode_only_rows: Annotated[int, counter("Decode rows of the decode-only steps, summed (over "
                                             "decode_only_steps: their mean batch).")] = 0
    decode_only_launch_s: Annotated[float, counter(
        "Of worker_launch_seconds: the decode-only steps', graph captures excluded (over decode_only_steps: "
        "host launch time per decode step).", "worker_decode_only_launch_seconds")] = 0.0
    graph_capture_s: Annotated[float, counter("Of worker_launch_seconds: capturing CUDA graphs while serving "
                                              "(size classes seen for the first times).",
                                              "worker_graph_capture_seconds")] = 0.0
    malformed_frames: Annotated[int, _MALFORMED_FRAMES] = 0
    gc: Annotated[GcStats, part("the scheduler process's garbage collection", "scheduler_gc_",
                                "Scheduler process")] = GcStats()


class WorkerCounters(msgspec.Struct):
    """The worker's, cumulative since start: ``ModelRunner`` and its graphs increment one instance in
    place, the worker loop sets the values it reads from elsewhere (JIT, dropped frames, gc) and sends
    the struct with every step output (``WorkerStepDone.counters``)."""

    jit_after_ready: Annotated[int, gauge(
        "Triton kernel variants the worker compiled or loaded after it was ready (0 in steady serving: the "
        "warm-up covers every variant).", "jit_compilations_after_ready")] = 0
    graph_captures: Annotated[int, counter("CUDA graphs captured by the worker (start-up included).")] = 0
    graph_replays: Annotated[int, counter("Steps that replayed a captured CUDA graph.")] = 0
    eager_steps: Annotated[int, counter("Steps whose forward pass ran eagerly.")] = 0
    extend_row_steps: Annotated[int, counter("Steps whose small extends ran on a decode graph, a row per token "
                                             "(of graph_replays).")] = 0
    decode_steps_advanced: Annotated[int, counter(
        "Decode graph steps that repeated the previous step's rows one token further, advanced on the device "
        "(no batch packing on the host).")] = 0
    decode_steps_covered: Annotated[int, counter(
        "Decode graph steps run on a larger captured graph covering their size class (instead of capturing "
        "one).")] = 0
    decode_steps_patched: Annotated[int, counter(
        "Advanced decode graph steps whose batch changed (requests joined or left): only the changed rows "
        "were written from the host.")] = 0
    decode_steps_deferred: Annotated[int, counter(
        "Decode steps of a size class no captured decode graph covered yet, run on the piecewise graphs "
        "instead (until the class is captured).")] = 0
    prefill_cascade_steps: Annotated[int, counter("Steps whose extend rows read a cached run shared between "
                                                  "requests once (prefill cascade).")] = 0
    prefill_cascade_runs: Annotated[int, counter("Prefill cascade shared runs, summed over steps.")] = 0
    prefill_cascade_tokens_read_once: Annotated[int, counter(
        "KV token reads saved by the prefill cascade: (members - 1) x tokens per run and step.")] = 0
    prefill_long_prefix_runs: Annotated[int, counter("Long cached prefixes of short extends read split along "
                                                     "their length.")] = 0
    masked_steps_deferred: Annotated[int, counter(
        "Steps with structured-output rows launched before the previous step's tokens were known: their masking "
        "and sampling were queued after the previous step's output was sent, so the grammars' host work is off "
        "the path to the next plan.")] = 0
    grammar_budget_failures: Annotated[int, counter(
        "Requests failed because their grammar took more host time than its budget (RADIXRELAY_GRAMMAR_BUDGET_MS; "
        "over HTTP a 400 request_too_costly); their batch mates went on.")] = 0
    malformed_frames: Annotated[int, _MALFORMED_FRAMES] = 0
    gc: Annotated[GcStats, part("the worker process's garbage collection", "worker_gc_", "Worker process")] = GcStats()
    disk_read_s: Annotated[float, counter(
        "Seconds the disk tier's I/O threads spent reading pages, summed over threads (0 without a disk tier).",
        "kv_tier_disk_read_seconds")] = 0.0
    disk_write_s: Annotated[float, counter("Seconds the disk tier's I/O threads spent writing pages, summed "
                                           "over threads.", "kv_tier_disk_write_seconds")] = 0.0
    disk_full_writes: Annotated[int, counter(
        "Page writes refused or failed because the disk (or quota) was full; writes pause, serving goes on.",
        "kv_tier_disk_full_writes")] = 0
    disk_jobs_given_up: Annotated[int, counter(
        "Disk reads, writes or deletes given up after their deadline (storage that hangs); a read given up "
        "is a miss.", "kv_tier_disk_jobs_given_up")] = 0
    tp_all_reduce_s: Annotated[float, counter(
        "Seconds rank 0 spent in tensor-parallel all-reduces (0 at tp=1): on the CPU each call timed; on CUDA, "
        "where they run inside graphs, each forward's calls at the device time measured for their size at "
        "start-up. Its rate over the step rate is the all-reduce time per step.", "tp_all_reduce_seconds")] = 0.0
    tp_all_reduces: Annotated[int, counter("Tensor-parallel all-reduces rank 0 ran (0 at tp=1).")] = 0
    # Tensor parallelism (empty at tp=1): per rank, read by hand (labelled metrics, ``rank<r>_...`` stats keys)
    rank_device_s: Annotated[list[float], apart(
        "Device seconds of each tensor-parallel rank's steps (CUDA events; on the CPU the rank's busy time): "
        "its rate is that rank's busy fraction.")] = []


class CascadeCounters(msgspec.Struct):
    """The cascade planner's (``radixrelay.cascade.planner``), cumulative since it was made (all 0 with
    cascade off: no planner)."""

    decode_steps: Annotated[int, counter("Decode steps the cascade planner saw (its share of decode_steps).")] = 0
    cascade_steps: Annotated[int, counter("Decode steps run with a cascade plan.", name="steps")] = 0
    groups: Annotated[int, counter("Cascade groups (shared node runs attended once), summed over steps.")] = 0
    levels: Annotated[int, counter("Cascade levels, summed over steps.")] = 0
    max_levels: Annotated[int, gauge("Levels of the deepest cascade plan so far.")] = 0
    tokens_read_once: Annotated[int, counter("KV token reads saved by cascading: (members - 1) x tokens per "
                                             "group and step.")] = 0

    def record(self, plan: CascadePlan | None) -> None:
        """One decode step's plan (None: flat)."""
        self.decode_steps += 1
        if plan is None:
            return
        self.cascade_steps += 1
        self.groups += len(plan.groups)
        self.levels += plan.num_levels
        self.max_levels = max(self.max_levels, plan.num_levels)
        self.tokens_read_once += plan.tokens_read_once()


class FrontendCounters(msgspec.Struct, frozen=True):
    """The frontend's (the HTTP server's; empty from the ``Engine``), filled in by its runtime client and
    the server (its garbage collection, its requests' stages)."""

    malformed_frames: Annotated[int, _MALFORMED_FRAMES] = 0
    gc: Annotated[GcStats, part("the frontend process's garbage collection", "frontend_gc_",
                                "Frontend process")] = GcStats()
    # -- host time of requests' server stages, by stage (``radixrelay.server.serving``): read by hand, like
    # the scheduler's (labelled metrics ``radixrelay_request_stage_seconds_sum{stage=...}`` / ``_count``) ----
    stage_seconds: Annotated[dict[str, float], apart(
        "Server host seconds of requests' stages, by stage: parse (body read and JSON decode), render (chat "
        "template), tokenize (encoding or checking token ids, fitting to the context), submit (hand-off to "
        "the runtime client until sent).")] = {}
    stage_counts: Annotated[dict[str, int], apart(
        "Of stage_seconds: the number of requests timed in each stage.")] = {}


class RuntimeStats(msgspec.Struct, frozen=True):
    """What a ``StatsRequest`` answers: every process's counters, as of that request (the worker's as of
    its latest step output)."""

    scheduler: Annotated[SchedulerStats, part("the scheduler's queue, KV cache and tiers")]
    loop: Annotated[LoopCounters, part("the scheduler loop's step counters")] = \
        msgspec.field(default_factory=LoopCounters)
    worker: Annotated[WorkerCounters, part("the worker's counters")] = msgspec.field(default_factory=WorkerCounters)
    cascade: Annotated[CascadeCounters, part("the cascade planner's counters", "cascade_")] = \
        msgspec.field(default_factory=CascadeCounters)
    frontend: Annotated[FrontendCounters, part("the frontend's counters")] = FrontendCounters()
    # KV pages and radix locks by holder, and check_integrity's verdict, taken when these stats were asked
    # for (None from a runtime that does not audit):
    kv_audit: Annotated[KVAudit | None, apart("the KV audit (radixrelay.scheduler.audit)")] = None


# -- reading them -------------------------------------------------------------------------------


class Reading(NamedTuple):
    """One counter or gauge of a ``RuntimeStats`` (or of any counters struct)."""

    key: str          # Engine.stats() key
    metric: str       # Prometheus name, without the ``radixrelay_`` prefix and a counter's ``_total``
    kind: Kind        # "counter" | "gauge"
    text: str         # the help text: the field's description (after its part's label, if any)
    value: float


class FieldSpec(NamedTuple):
    name: str
    kind: Kind
    description: str
    key: str = ""                   # counter, gauge: its key and metric name (before the parts' prefixes)
    metric: str = ""                # counter, gauge: its metric name (before the parts' prefixes)
    prefix: str = ""                # part: before its fields' keys and metric names
    label: str | None = None        # part: before its fields' help text


@functools.cache
def field_specs(cls: type[msgspec.Struct]) -> tuple[FieldSpec, ...]:
    """The annotated metadata of every field of ``cls``, in field order; TypeError for a field without it."""
    hints = typing.get_type_hints(cls, include_extras=True)
    specs = []
    for name in cls.__struct_fields__:
        meta = next((m for m in getattr(hints[name], "__metadata__", ()) if isinstance(m, msgspec.Meta)), None)
        extra = meta.extra if meta is not None and meta.extra is not None else {}
        if extra.get("kind") not in typing.get_args(Kind) or not meta.description:
            raise TypeError(f"{cls.__name__}.{name}: annotate it as a counter, gauge or part with a description "
                            f"(radixrelay.protocol.stats)")
        key = extra.get("name") or name
        specs.append(FieldSpec(name, extra["kind"], meta.description, key, extra.get("metric") or key,
                               extra.get("prefix", ""), extra.get("label")))
    return tuple(specs)


def readings(stats: msgspec.Struct, prefix: str = "", label: str | None = None) -> Iterator[Reading]:
    """Every counter and gauge of ``stats`` and of the parts it nests, in field order (parts in place)."""
    for spec in field_specs(type(stats)):
        value = getattr(stats, spec.name)
        if spec.kind == "part":
            yield from readings(value, prefix + spec.prefix, spec.label or label)
        elif spec.kind != "apart":
            text = spec.description if label is None else f"{label}: {spec.description}"
            yield Reading(prefix + spec.key, prefix + spec.metric, spec.kind, text, value)


def stats_values(stats: msgspec.Struct) -> dict[str, float]:
    """``readings(stats)`` by key (``Engine.stats()``); fields of one key add up."""
    values: dict[str, float] = {}
    for reading in readings(stats):
        values[reading.key] = values.get(reading.key, 0) + reading.value
    return values
