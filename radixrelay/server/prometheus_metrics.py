"""Prometheus metrics of one server (its own ``CollectorRegistry``, no module-global state).

Two sources: the frontend observes request-level values as they happen (tokens, TTFT,
inter-token latency, finished requests); the runtime's ``RuntimeStats`` snapshot, fetched when
/metrics is scraped, provides the scheduler's gauges and its cumulative counters, and the KV audit
the scheduler takes for each scrape: pages by holder (free, cached in the radix tree, held by
requests), radix locks, and whether ``check_integrity`` passed. Once traffic has ended a healthy
server reports ``radixrelay_kv_idle_baseline 1``: no request pages, no locks
(``radixrelay.scheduler.audit`` defines the baseline).

Host time of a request by stage is one summary without quantiles,
``radixrelay_request_stage_seconds_sum{stage=...}`` and ``_count{stage=...}``: the server's stages
(``parse``, ``render``, ``tokenize``, ``submit``: ``radixrelay.server.serving``), observed here and
reported in ``FrontendCounters``, and any stage the scheduler reports in ``SchedulerStats``
(``match``, ``queue``: ``radixrelay.scheduler.stages``). A stage's sum over its count is its mean.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import msgspec
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector

from radixrelay.protocol.stats import (
    FrontendCounters, GcStats, KVAudit, Reading, RuntimeStats, SchedulerStats, WorkerCounters, readings,
)
from radixrelay.server.api_servers import FamilyShare, MetricsShare, SampleShare

PREFIX = "radixrelay"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _RuntimeCollector(Collector):
    """Exposes the latest ``RuntimeStats`` snapshot: a metric per field of its counters structs
    (``radixrelay.protocol.stats.readings``: name, kind and help from the fields' annotations; fields of
    one metric name add up), the KV cache's usage ratio, and the KV audit."""

    def __init__(self) -> None:
        self.stats: RuntimeStats | None = None
        self.precision: dict[str, str] = {}
        self.stages: tuple[FrontendCounters | SchedulerStats, ...] = ()   # whose request stages to show

    def collect(self) -> Iterator[Metric]:
        yield from _stage_metrics(self.stages)
        if self.precision:
            info = GaugeMetricFamily(f"{PREFIX}_precision_info", "The precision each part of the model runs in "
                                     "(linear layers, KV cache, attention, embedding / LM head / norms): 1 per part.",
                                     labels=["part", "precision"])
            for part, precision in sorted(self.precision.items()):
                info.add_metric([part, precision], 1)
            yield info
        if self.stats is None:
            return
        by_metric: dict[str, Reading] = {}
        for r in readings(self.stats):
            seen = by_metric.get(r.metric)
            by_metric[r.metric] = r if seen is None else seen._replace(value=seen.value + r.value)
        for r in by_metric.values():
            family = CounterMetricFamily if r.kind == "counter" else GaugeMetricFamily
            yield family(f"{PREFIX}_{r.metric}", r.text, value=r.value)
        yield GaugeMetricFamily(f"{PREFIX}_kv_cache_usage_ratio", "Share of KV pages in use (requests or radix "
                                "cache).", value=self.stats.scheduler.kv_usage)
        if self.stats.kv_audit is not None:
            yield from _audit_metrics(self.stats.kv_audit)
        yield from _rank_metrics(self.stats.worker)


def _sum_stages(parts: Iterable[FrontendCounters | SchedulerStats]) -> tuple[dict[str, float], dict[str, int]]:
    """Request stages' seconds and counts added up over ``parts`` (a stage several report adds up)."""
    seconds: dict[str, float] = {}
    counts: dict[str, int] = {}
    for part in parts:
        for stage, value in part.stage_seconds.items():
            seconds[stage] = seconds.get(stage, 0.0) + value
        for stage, count in part.stage_counts.items():
            counts[stage] = counts.get(stage, 0) + count
    return seconds, counts


def _stage_metrics(parts: tuple[FrontendCounters | SchedulerStats, ...]) -> Iterator[Metric]:
    """Request stages of the frontend and of the scheduler (a stage both report adds up), labelled ``stage``."""
    seconds, counts = _sum_stages(parts)
    family = SummaryMetricFamily(f"{PREFIX}_request_stage_seconds", "Host seconds of requests' stages, by stage: "
                                 "the server's parse (body read and JSON decode), render (chat template), tokenize "
                                 "(encoding or checking token ids, fitting to the context), submit (hand-off to the "
                                 "runtime client until sent); the scheduler's match (radix and KV tier lookups per "
                                 "admission try), queue (arrival to first admission).", labels=["stage"])
    for stage in sorted(counts.keys() | seconds.keys()):
        family.add_metric([stage], counts.get(stage, 0), seconds.get(stage, 0.0))
    yield family


def _rank_metrics(w: WorkerCounters) -> Iterator[Metric]:
    """Per tensor-parallel rank (nothing at tp=1), labelled ``rank``."""
    if not w.rank_device_s:
        return
    device = CounterMetricFamily(f"{PREFIX}_worker_rank_device_seconds", "Device seconds of the rank's steps "
                                 "(CUDA events; on the CPU its busy time): the rate is the rank's busy fraction.",
                                 labels=["rank"])
    for rank, seconds in enumerate(w.rank_device_s):
        device.add_metric([str(rank)], seconds)
    yield device


def _audit_metrics(a: KVAudit) -> Iterator[Metric]:
    """The KV audit (``radixrelay.scheduler.audit``), taken when this scrape asked for the stats (its free
    pages are the scheduler's ``kv_free_pages``)."""
    def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
        return GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)

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


class _SharedCollector(Collector):
    """This server's own request metrics (counters, histograms) with the other servers' shares added
    (``--api-servers``): samples of one name and labels add up, except ``_created`` (the earliest)."""

    def __init__(self, own: CollectorRegistry) -> None:
        self.own = own
        self.peers: list[MetricsShare] = []

    def collect(self) -> Iterator[Metric]:
        if not self.peers:
            yield from self.own.collect()
            return
        own = share_families(self.own)
        families = {f.name: f for f in own}
        merged: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
        for share in own + [f for peer in self.peers for f in peer.families]:
            families.setdefault(share.name, share)
            values = merged.setdefault(share.name, {})
            for sample in share.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                seen = values.get(key)
                if seen is None:
                    values[key] = sample.value
                else:
                    values[key] = min(seen, sample.value) if sample.name.endswith("_created") else seen + sample.value
        for name, values in merged.items():
            family = families[name]
            metric = Metric(name, family.documentation, family.type)
            for (sample_name, labels), value in values.items():
                metric.add_sample(sample_name, dict(labels), value)
            yield metric


def share_families(registry: CollectorRegistry) -> list[FamilyShare]:
    """``registry``'s metric families as plain values, for another server to add up."""
    return [FamilyShare(m.name, m.type, m.documentation,
                        [SampleShare(s.name, dict(s.labels), s.value) for s in m.samples])
            for m in registry.collect()]


def merge_frontends(parts: list[FrontendCounters]) -> FrontendCounters:
    """Several servers' frontend counters as one: counts and seconds add up, the longest pause is the
    longest of all."""
    stage_seconds, stage_counts = _sum_stages(parts)
    gcs = [p.gc for p in parts]
    gc = GcStats(sum(g.seconds for g in gcs), sum(g.collections for g in gcs),
                 sum(g.full_collections for g in gcs), max((g.longest_s for g in gcs), default=0.0),
                 sum(g.frozen for g in gcs))
    return FrontendCounters(sum(p.malformed_frames for p in parts), gc, stage_seconds, stage_counts)


class ServerMetrics:
    def __init__(self, server: int = 0) -> None:
        """``server``: this process's index among the API servers (``--api-servers``)."""
        self.registry = CollectorRegistry()
        self._runtime = _RuntimeCollector()
        self.registry.register(self._runtime)
        own = CollectorRegistry()                # this server's: shared with the others, summed by each
        self._shared = _SharedCollector(own)
        self.registry.register(self._shared)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of finished requests.",
                                     registry=own)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens",
                                         "Tokens generated for finished requests.", registry=own)
        self.requests = Counter(f"{PREFIX}_requests", "Finished requests (one per choice).",
                                ["finish_reason"], registry=own)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds",
                              "Time from request arrival to its first output token.",
                              buckets=_LATENCY_BUCKETS, registry=own)
        self.inter_token = Histogram(f"{PREFIX}_inter_token_latency_seconds",
                                     "Time between consecutive output tokens of a request.",
                                     buckets=_LATENCY_BUCKETS, registry=own)
        self.api_requests = Counter(f"{PREFIX}_api_server_requests", "Completion requests received, by API "
                                    "server process (--api-servers: how the port spreads them).", ["server"],
                                    registry=own).labels(str(server))
        # Request stages (``radixrelay.server.serving``), cumulative; the event loop is the one writer.
        self._stage_seconds: dict[str, float] = {}
        self._stage_counts: dict[str, int] = {}

    def observe_stages(self, stages: Mapping[str, float]) -> None:
        """One request's host seconds by stage: each stage's sum grows by them, its count by one."""
        for stage, seconds in list(stages.items()):      # a copy: a cancelled request's thread may still add
            self._stage_seconds[stage] = self._stage_seconds.get(stage, 0.0) + seconds
            self._stage_counts[stage] = self._stage_counts.get(stage, 0) + 1

    def frontend(self, counters: FrontendCounters) -> FrontendCounters:
        """``counters`` (the runtime client's) with this server's request stages as of now."""
        return msgspec.structs.replace(counters, stage_seconds=dict(self._stage_seconds),
                                       stage_counts=dict(self._stage_counts))

    def share(self, counters: FrontendCounters) -> MetricsShare:
        """What another API server adds to its /metrics for this one: the request metrics and
        ``counters`` with the request stages."""
        return MetricsShare(share_families(self._shared.own), self.frontend(counters))

    def render(self, stats: RuntimeStats | None, precision: dict[str, str] | None = None,
               peers: list[MetricsShare] | None = None) -> bytes:
        """The exposition text; ``stats`` None (runtime gone) leaves out the runtime's metrics but this
        server's request stages; ``precision``: what each part of the model runs in
        (``radixrelay_precision_info``); ``peers``: the other API servers' shares, added to this one's."""
        peers = peers or []
        own = self.frontend(FrontendCounters()) if stats is None else stats.frontend
        frontend = merge_frontends([own, *(p.frontend for p in peers)])
        self._runtime.stats = None if stats is None else msgspec.structs.replace(stats, frontend=frontend)
        self._runtime.precision = precision or {}
        self._runtime.stages = (frontend,) if stats is None else (frontend, stats.scheduler)
        self._shared.peers = peers
        try:
            return generate_latest(self.registry)
        finally:
            self._shared.peers = []


def counters_table() -> str:
    """Every metric of the runtime's counters structs as a markdown table: name, ``Engine.stats()`` key,
    help (``python -m radixrelay.server.prometheus_metrics``; docs/metrics.md points here for the full list)."""
    required = [f for f in msgspec.structs.fields(SchedulerStats) if f.required]
    zero = RuntimeStats(SchedulerStats(*[0] * len(required)))
    rows = {}
    for r in readings(zero):
        name = f"{PREFIX}_{r.metric}" + ("_total" if r.kind == "counter" else "")
        rows.setdefault(name, f"| `{name}` | `{r.key}` | {r.text} |")
    return "\n".join(["| metric | `Engine.stats()` | |", "|---|---|---|", *rows.values()])


if __name__ == "__main__":
    print(counters_table())
