"""Prometheus metrics of one server (its own ``CollectorRegistry``, no module-global state).

Two sources: the frontend observes request-level values as they happen (tokens, TTFT,
inter-token latency, finished requests); the runtime's ``RuntimeStats`` snapshot, fetched when
/metrics is scraped, provides the scheduler's gauges and its cumulative counters, and the KV audit
the scheduler takes for each scrape: pages by holder (free, cached in the radix tree, held by
requests), radix locks, and whether ``check_integrity`` passed. Once traffic has ended a healthy
server reports ``radixrelay_kv_idle_baseline 1``: no request pages, no locks
(``radixrelay.scheduler.audit`` defines the baseline).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from radixrelay.protocol.stats import KVAudit, RuntimeStats

PREFIX = "radixrelay"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _tier_metrics(sched, gauge, counter) -> Iterator[Metric]:
    """KV tiers below the device (host memory, disk): capacity, hits, bytes moved, load time."""
    for tier in ("host", "disk"):
        yield gauge(f"kv_tier_{tier}_pages", f"KV pages the {tier} tier can hold.", getattr(sched, f"tier_{tier}_pages"))
        yield gauge(f"kv_tier_{tier}_used_pages", f"KV pages held by the {tier} tier.",
                    getattr(sched, f"tier_{tier}_used_pages"))
    yield counter("kv_tier_host_hit_tokens", "Prompt tokens loaded from host memory instead of computed.",
                  sched.tier_host_hit_tokens)
    yield counter("kv_tier_disk_hit_tokens", "Prompt tokens loaded from disk (through host memory).",
                  sched.tier_disk_hit_tokens)
    yield counter("kv_tier_repositioned_tokens", "Prompt tokens of truncated prompts loaded from a tier "
                  "with their keys rotated to new positions.", sched.tier_repositioned_tokens)
    yield counter("kv_tier_prefetch_used_pages", "Pages read from disk ahead of a turn and then used.",
                  sched.tier_prefetch_used_pages)
    yield counter("kv_tier_read_failed_pages", "Disk pages found missing, truncated or corrupt (misses).",
                  sched.tier_read_failed_pages)
    for name, doc in (("saved", "device to host"), ("loaded", "host to device"),
                      ("written", "host to disk"), ("read", "disk to host")):
        yield counter(f"kv_tier_{name}_bytes", f"KV bytes copied {doc}.", getattr(sched, f"tier_{name}_bytes"))
    yield counter("kv_tier_load_seconds", "Device seconds of host-to-device KV loads.", sched.tier_load_s)
    yield counter("kv_tier_load_exposed_seconds", "Seconds of those loads that steps waited for.",
                  sched.tier_load_exposed_s)


class _RuntimeCollector(Collector):
    """Exposes the latest ``RuntimeStats`` snapshot."""

    def __init__(self) -> None:
        self.stats: RuntimeStats | None = None

    def collect(self) -> Iterator[Metric]:
        if self.stats is None:
            return
        s, sched = self.stats, self.stats.scheduler

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)

        yield gauge("num_requests_running", "Requests admitted and holding KV.", sched.num_running)
        yield gauge("num_requests_waiting", "Requests queued for admission.", sched.num_waiting)
        yield gauge("kv_cache_usage_ratio", "Share of KV pages in use (requests or radix cache).",
                    sched.kv_usage)
        yield gauge("kv_used_pages", "KV pages in use (requests or radix cache).", sched.kv_used_pages)
        yield gauge("kv_total_pages", "KV pages in the cache.", sched.kv_total_pages)
        yield gauge("radix_cached_tokens", "Tokens held by the radix tree.", sched.cached_tokens)
        yield gauge("radix_locked_tokens", "Radix-tree tokens locked by running requests.",
                    sched.locked_tokens)
        yield counter("cache_hit_tokens", "Prompt tokens served from the radix cache.",
                      sched.cache_hit_tokens)
        yield counter("scheduled_prompt_tokens", "Prompt tokens admitted by the scheduler.",
                      sched.prompt_tokens)
        yield counter("retractions", "Requests retracted to the queue for lack of KV.",
                      sched.num_retractions)
        yield from _tier_metrics(sched, gauge, counter)
        yield counter("steps", "Model steps run by the worker.", s.steps)
        yield counter("computed_tokens", "Tokens run through the model.", s.computed_tokens)
        yield counter("decode_steps", "Steps with decode rows.", s.decode_steps)
        yield counter("cascade_steps", "Decode steps run with a cascade plan.", s.cascade_steps)
        yield counter("cascade_groups", "Cascade groups (shared node runs attended once), summed "
                      "over steps.", s.cascade_groups)
        yield counter("cascade_levels", "Cascade levels, summed over steps.", s.cascade_levels)
        yield counter("cascade_tokens_read_once", "KV token reads saved by cascading: (members - 1)"
                      " x tokens per group and step.", s.cascade_tokens_read_once)
        yield counter("worker_busy_seconds", "Worker host time on steps (launch, then waiting for and "
                      "reading results).", s.worker_busy_s)
        yield counter("worker_launch_seconds", "Of the worker's step time: host work until the model's "
                      "kernels were launched.", s.worker_launch_s)
        yield counter("scheduler_busy_seconds", "Time spent scheduling steps and processing their outputs.",
                      s.scheduler_busy_s)
        yield counter("worker_device_seconds", "Device time of the worker's steps (CUDA events; on the "
                      "CPU the worker's busy time): its rate is the device's busy fraction.", s.worker_device_s)
        yield gauge("jit_compilations_after_ready", "Triton kernel variants the worker compiled or loaded "
                    "after it was ready (0 in steady serving: the warm-up covers every variant).",
                    s.jit_after_ready)
        yield counter("graph_captures", "CUDA graphs captured by the worker (start-up included).", s.graph_captures)
        yield counter("graph_replays", "Steps that replayed a captured CUDA graph.", s.graph_replays)
        yield counter("eager_steps", "Steps whose forward pass ran eagerly.", s.eager_steps)
        yield counter("decode_steps_advanced", "Decode graph steps that repeated the previous step's rows one "
                      "token further, advanced on the device (no batch packing on the host).", s.decode_steps_advanced)
        yield counter("decode_steps_covered", "Decode graph steps run on a larger captured graph covering "
                      "their size class (instead of capturing one).", s.decode_steps_covered)
        yield counter("decode_steps_patched", "Advanced decode graph steps whose batch changed (requests joined "
                      "or left): only the changed rows were written from the host.", s.decode_steps_patched)
        yield counter("decode_steps_deferred", "Decode steps of a size class no captured decode graph covered "
                      "yet, run on the piecewise graphs instead (until the class is captured).",
                      s.decode_steps_deferred)
        yield counter("decode_only_steps", "Steps with decode rows and no extend rows.", s.decode_only_steps)
        yield counter("decode_only_rows", "Decode rows of the decode-only steps, summed (over decode_only_steps: "
                      "their mean batch).", s.decode_only_rows)
        yield counter("worker_decode_only_launch_seconds", "Of worker_launch_seconds: the decode-only steps', "
                      "graph captures excluded (over decode_only_steps: host launch time per decode step).",
                      s.decode_only_launch_s)
        yield counter("worker_graph_capture_seconds", "Of worker_launch_seconds: capturing CUDA graphs while "
                      "serving (size classes seen for the first times).", s.graph_capture_s)
        yield counter("prefill_cascade_steps", "Steps whose extend rows read a cached run shared between"
                      " requests once (prefill cascade).", s.prefill_cascade_steps)
        yield counter("prefill_cascade_runs", "Prefill cascade shared runs, summed over steps.",
                      s.prefill_cascade_runs)
        yield counter("prefill_cascade_tokens_read_once", "KV token reads saved by the prefill cascade:"
                      " (members - 1) x tokens per run and step.", s.prefill_cascade_tokens_read_once)
        yield counter("prefill_long_prefix_runs", "Long cached prefixes of short extends read split along"
                      " their length.", s.prefill_long_prefix_runs)
        yield counter("malformed_frames", "Runtime messages dropped because they did not decode as their "
                      "channel's messages (garbage, truncated, wrong type); the process kept serving.",
                      s.malformed_frames)
        for process, gc_stats in (("worker", s.worker_gc), ("scheduler", s.scheduler_gc),
                                  ("frontend", s.frontend_gc)):
            yield counter(f"{process}_gc_seconds", f"Time the {process} process spent paused in Python's "
                          "garbage collector.", gc_stats.seconds)
            yield counter(f"{process}_gc_full_collections", f"Full (generation 2) garbage collections of the "
                          f"{process} process.", gc_stats.full_collections)
            yield gauge(f"{process}_gc_longest_pause_seconds", f"Longest garbage-collection pause of the "
                        f"{process} process since start.", gc_stats.longest_s)
            yield gauge(f"{process}_gc_frozen_objects", f"Objects of the {process} process's start-up heap "
                        "frozen out of the garbage collector (RADIXRELAY_GC=managed; 0 otherwise).",
                        gc_stats.frozen)
        if s.kv_audit is not None:
            yield from _audit_metrics(s.kv_audit)


def _audit_metrics(a: KVAudit) -> Iterator[Metric]:
    """The KV audit (``radixrelay.scheduler.audit``), taken when this scrape asked for the stats."""
    def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
        return GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)

    yield gauge("kv_free_pages", "KV pages on the free list.", a.free_pages)
    yield gauge("kv_cached_pages", "KV pages held by radix-tree nodes (locked or evictable).", a.cached_pages)
    yield gauge("kv_request_pages", "KV pages held privately by running requests (0 at the idle baseline).",
                a.request_pages)
    yield gauge("radix_locked_nodes", "Radix nodes locked by running requests (0 at the idle baseline).",
                a.locked_nodes)
    yield gauge("radix_lock_refs", "Lock references summed over radix nodes (0 at the idle baseline).",
                a.lock_refs)
    yield gauge("radix_lock_holders", "Running requests holding a lock on their cached prefix.",
                a.lock_holders)
    yield gauge("kv_integrity_ok", "1 when the scheduler's last check_integrity passed (free + cached + "
                "request pages == total, tree and allocator invariants), else 0; the reason is in the "
                "scheduler's log. Checked at every scrape while idle, at most every 30 s under load.",
                int(a.integrity_ok))
    yield gauge("kv_integrity_age_seconds", "Seconds since the check behind kv_integrity_ok ran (0: at "
                "this scrape).", a.integrity_age_s)
    yield gauge("kv_idle_baseline", "1 when no request is live and no KV page or radix lock is held for "
                "one (only cached, unlocked pages besides free ones), with integrity ok; expected 1 once "
                "traffic has ended.", int(a.at_idle_baseline))


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._runtime = _RuntimeCollector()
        self.registry.register(self._runtime)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of finished requests.",
                                     registry=self.registry)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens",
                                         "Tokens generated for finished requests.", registry=self.registry)
        self.requests = Counter(f"{PREFIX}_requests", "Finished requests (one per choice).",
                                ["finish_reason"], registry=self.registry)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds",
                              "Time from request arrival to its first output token.",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.inter_token = Histogram(f"{PREFIX}_inter_token_latency_seconds",
                                     "Time between consecutive output tokens of a request.",
                                     buckets=_LATENCY_BUCKETS, registry=self.registry)

    def render(self, stats: RuntimeStats | None) -> bytes:
        """The exposition text; ``stats`` None (runtime gone) leaves out the runtime's metrics."""
        self._runtime.stats = stats
        return generate_latest(self.registry)
