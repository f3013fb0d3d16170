"""The counters structs (``radixrelay.protocol.stats``) are the one place a counter is declared: every field
carries its description and kind, and ``/metrics`` and ``Engine.stats()`` show every field with no list
of their own. The metric names and stats keys that existed before the structs were nested keep their
names, types and values."""

from __future__ import annotations

import dataclasses
import itertools
import typing

import msgspec
import pytest

from radixrelay.config import EngineConfig
from radixrelay.engine import Engine
from radixrelay.protocol.messages import WorkerMessage, WorkerStepDone, decoder, encoder
from radixrelay.protocol.stats import (
    CascadeCounters, GcStats, KVAudit, RuntimeStats, SchedulerStats, WorkerCounters, counter, field_specs, readings,
)
from radixrelay.protocol.step import StepOutput
from radixrelay.server.prometheus_metrics import ServerMetrics

# Exposition names of the runtime's metrics before the counters became nested structs (docs/metrics.md).
COUNTERS = {
    "cache_hit_tokens", "cascade_groups", "cascade_levels", "cascade_steps", "cascade_tokens_read_once",
    "computed_tokens", "decode_only_rows", "decode_only_steps", "decode_steps_advanced", "decode_steps_covered",
    "decode_steps_deferred", "decode_steps_patched", "decode_steps", "eager_steps", "frontend_gc_full_collections",
    "frontend_gc_seconds", "graph_captures", "graph_replays", "kv_tier_disk_hit_tokens", "kv_tier_host_hit_tokens",
    "kv_tier_load_exposed_seconds", "kv_tier_load_seconds", "kv_tier_loaded_bytes", "kv_tier_prefetch_used_pages",
    "kv_tier_read_bytes", "kv_tier_read_failed_pages", "kv_tier_repositioned_tokens", "kv_tier_saved_bytes",
    "kv_tier_written_bytes", "malformed_frames", "prefill_cascade_runs", "prefill_cascade_steps",
    "prefill_cascade_tokens_read_once", "prefill_long_prefix_runs", "retractions", "scheduled_prompt_tokens",
    "scheduler_busy_seconds", "scheduler_gc_full_collections", "scheduler_gc_seconds", "steps",
    "worker_busy_seconds", "worker_decode_only_launch_seconds", "worker_device_seconds",
    "worker_gc_full_collections", "worker_gc_seconds", "worker_graph_capture_seconds", "worker_launch_seconds",
}
GAUGES = {
    "frontend_gc_frozen_objects", "frontend_gc_longest_pause_seconds", "jit_compilations_after_ready",
    "kv_cache_usage_ratio", "kv_cached_pages", "kv_free_pages", "kv_idle_baseline", "kv_integrity_age_seconds",
    "kv_integrity_ok", "kv_request_pages", "kv_tier_disk_pages", "kv_tier_disk_used_pages", "kv_tier_host_pages",
    "kv_tier_host_used_pages", "kv_total_pages", "kv_used_pages", "num_requests_running", "num_requests_waiting",
    "radix_cached_tokens", "radix_lock_holders", "radix_lock_refs", "radix_locked_nodes", "radix_locked_tokens",
    "scheduler_gc_frozen_objects", "scheduler_gc_longest_pause_seconds", "worker_gc_frozen_objects",
    "worker_gc_longest_pause_seconds",
}
# Engine.stats() keys besides the configuration's, before the counters became nested structs.
STATS_KEYS = {
    "cache_hit_tokens", "cached_tokens", "cascade_groups", "cascade_levels", "cascade_steps",
    "cascade_tokens_read_once", "computed_tokens", "decode_only_launch_s", "decode_only_rows", "decode_only_steps",
    "decode_steps", "decode_steps_advanced", "decode_steps_covered", "decode_steps_deferred", "decode_steps_patched",
    "eager_steps", "evictable_tokens", "gc_full_collections", "gc_longest_pause_s", "graph_capture_s",
    "graph_captures", "graph_replays", "jit_after_ready", "kv_free_pages", "kv_idle_baseline", "kv_total_pages",
    "kv_used_pages", "locked_tokens", "num_retractions", "num_running", "num_waiting", "prefill_cascade_runs",
    "prefill_cascade_steps", "prefill_cascade_tokens_read_once", "prefill_long_prefix_runs", "prompt_tokens",
    "scheduler_busy_s", "scheduler_gc_s", "steps", "tier_disk_hit_tokens", "tier_disk_pages", "tier_disk_used_pages",
    "tier_host_hit_tokens", "tier_host_pages", "tier_host_used_pages", "tier_load_exposed_s", "tier_load_s",
    "tier_loaded_bytes", "tier_prefetch_used_pages", "tier_read_bytes", "tier_read_failed_pages",
    "tier_repositioned_tokens", "tier_saved_bytes", "tier_written_bytes", "worker_busy_s", "worker_device_s",
    "worker_gc_s", "worker_launch_s",
}


def _counters_structs(cls: type = RuntimeStats) -> list[type]:
    """``cls`` and every counters struct it nests (its ``part`` fields), depth first."""
    hints = typing.get_type_hints(cls)
    found = [cls]
    for spec in field_specs(cls):
        if spec.kind == "part":
            found += [c for c in _counters_structs(hints[spec.name]) if c not in found]
    return found


def _filled(cls: type, numbers: typing.Iterator[int]):
    """An instance of counters struct ``cls`` whose every counter and gauge holds its own number."""
    hints = typing.get_type_hints(cls)
    values = {}
    for spec in field_specs(cls):
        if spec.kind == "part":
            values[spec.name] = _filled(hints[spec.name], numbers)
        elif spec.kind in ("counter", "gauge"):
            values[spec.name] = hints[spec.name](next(numbers))
    if cls is RuntimeStats:
        values["kv_audit"] = KVAudit(total_pages=8, free_pages=values["scheduler"].kv_free_pages, cached_pages=2,
                                     request_pages=0, locked_nodes=0, lock_refs=0, lock_holders=0, live_requests=0)
    return cls(**values)


def _exposition(stats: RuntimeStats) -> dict[str, tuple[str, str, float]]:
    """name -> (type, help, value) of the runtime's metrics in the /metrics text, ``radixrelay_`` dropped."""
    text = ServerMetrics().render(stats).decode()
    types = dict(line.split(" ")[2:4] for line in text.splitlines() if line.startswith("# TYPE"))
    helps = dict(line.split(" ", 3)[2:4] for line in text.splitlines() if line.startswith("# HELP"))
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        name, value = line.rsplit(" ", 1)
        if types.get(name) in ("counter", "gauge"):
            out[name.removeprefix("radixrelay_")] = (types[name], helps[name], float(value))
    return out


def _engine_stats(stats: RuntimeStats) -> dict:
    class Client:
        def stats(self) -> RuntimeStats:
            return stats

    engine = Engine.__new__(Engine)                   # no runtime: only what stats() reads
    engine.config, engine._client = EngineConfig(), Client()
    return engine.stats()


def test_every_field_of_every_counters_struct_is_described():
    structs = _counters_structs()
    assert {SchedulerStats, WorkerCounters, CascadeCounters, GcStats} <= set(structs)
    for cls in structs:
        for spec in field_specs(cls):               # TypeError for a field without its annotation
            assert spec.description.strip() and spec.kind in ("counter", "gauge", "part", "apart"), (cls, spec)

    class Undescribed(msgspec.Struct):
        steps: typing.Annotated[int, counter("Described.")] = 0
        new_counter: int = 0

    with pytest.raises(TypeError, match="Undescribed.new_counter"):
        field_specs(Undescribed)


def test_every_field_is_a_metric_and_a_stats_key():
    stats = _filled(RuntimeStats, itertools.count(1))
    metrics, engine = _exposition(stats), _engine_stats(stats)
    shown = {}
    for r in readings(stats):
        name = f"{r.metric}_total" if r.kind == "counter" else r.metric
        assert metrics[name][:2] == (r.kind, r.text), name
        shown.setdefault(name, []).append(r)
        assert r.key in engine, r.key
    for name, rs in shown.items():                  # fields of one metric (each process's inbox) add up
        assert len({(r.kind, r.text) for r in rs}) == 1, name
        assert metrics[name][2] == sum(r.value for r in rs), name
        for key in {r.key for r in rs}:
            assert engine[key] == sum(r.value for r in rs if r.key == key), key
    keys = {r.key for r in readings(stats)}          # none hidden by a configuration key or a derived one
    assert keys.isdisjoint(dataclasses.asdict(EngineConfig()))
    assert keys.isdisjoint({"worker_gc_s", "scheduler_gc_s", "gc_full_collections", "gc_longest_pause_s",
                            "kv_idle_baseline"})


def test_metric_names_types_and_stats_keys_are_kept():
    stats = _filled(RuntimeStats, itertools.count(1))
    metrics = _exposition(stats)
    kept = {f"{n}_total": "counter" for n in COUNTERS} | {n: "gauge" for n in GAUGES}
    assert {name: metrics[name][0] for name in kept if name in metrics} == kept
    engine = _engine_stats(stats)
    assert STATS_KEYS <= engine.keys()
    s = stats
    assert engine["worker_gc_s"] == s.worker.gc.seconds and engine["scheduler_gc_s"] == s.loop.gc.seconds
    assert engine["gc_full_collections"] == s.worker.gc.full_collections + s.loop.gc.full_collections
    assert engine["gc_longest_pause_s"] == max(s.worker.gc.longest_s, s.loop.gc.longest_s)
    assert engine["kv_idle_baseline"] is False          # free + cached pages short of the total
    assert metrics["malformed_frames_total"][2] == (s.loop.malformed_frames + s.worker.malformed_frames
                                                    + s.frontend.malformed_frames)
    assert metrics["kv_free_pages"][2] == s.scheduler.kv_free_pages == s.kv_audit.free_pages


def test_worker_counters_travel_as_they_are():
    counters = _filled(WorkerCounters, itertools.count(1))
    done = WorkerStepDone(StepOutput(3, [1], [7]), 0.5, 0.25, 0.4, 0.125, counters)
    got = decoder(WorkerMessage).decode(encoder().encode(done))
    assert got == done and got.counters == counters
    counters.graph_replays += 1                         # the worker's instance, incremented in place
    assert got.counters.graph_replays == counters.graph_replays - 1


def test_tensor_parallel_ranks_get_labelled_device_seconds():
    """Per rank (tp > 1): a ``rank``-labelled counter in /metrics and ``rank<r>_device_s`` stats keys; none
    at tp=1. The all-reduce counters are plain ones."""
    scheduler = msgspec.structs.replace(_zero_scheduler(), kv_total_pages=8)
    worker = WorkerCounters(rank_device_s=[1.5, 2.25], tp_all_reduce_s=0.5, tp_all_reduces=130)
    text = ServerMetrics().render(RuntimeStats(scheduler, worker=worker)).decode()
    assert 'radixrelay_worker_rank_device_seconds_total{rank="0"} 1.5' in text
    assert 'radixrelay_worker_rank_device_seconds_total{rank="1"} 2.25' in text
    assert "radixrelay_tp_all_reduce_seconds_total 0.5" in text and "radixrelay_tp_all_reduces_total 130.0" in text
    stats = _engine_stats(RuntimeStats(scheduler, worker=worker))
    assert (stats["rank0_device_s"], stats["rank1_device_s"]) == (1.5, 2.25)
    assert "rank_device_seconds" not in ServerMetrics().render(RuntimeStats(scheduler)).decode()
    assert not [k for k in _engine_stats(RuntimeStats(scheduler)) if k.startswith("rank")]


def _zero_scheduler() -> SchedulerStats:
    """A ``SchedulerStats`` of zeros (its fields with defaults keep them)."""
    return SchedulerStats(*[0] * len([f for f in msgspec.structs.fields(SchedulerStats) if f.required]))


def test_request_stages_are_one_labelled_summary_from_the_server_and_the_scheduler():
    """``radixrelay_request_stage_seconds_{sum,count}{stage=...}``: the server's stages (observed per request,
    reported in ``FrontendCounters``) and the scheduler's (``SchedulerStats``), a stage both report added up;
    without the runtime, the server's own."""
    metrics = ServerMetrics()
    metrics.observe_stages({"parse": 0.25, "tokenize": 0.5})
    metrics.observe_stages({"parse": 0.5, "submit": 0.125})
    scheduler = msgspec.structs.replace(_zero_scheduler(), kv_total_pages=8, stage_seconds={"match": 1.5, "queue": 2.0},
                                        stage_counts={"match": 3, "queue": 2})
    stats = RuntimeStats(scheduler)
    stats = msgspec.structs.replace(stats, frontend=metrics.frontend(stats.frontend))
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
               for line in metrics.render(stats).decode().splitlines() if line.startswith("radixrelay_request_stage")}
    want = {"parse": (2, 0.75), "tokenize": (1, 0.5), "submit": (1, 0.125), "match": (3, 1.5), "queue": (2, 2.0)}
    assert samples == {**{f'radixrelay_request_stage_seconds_count{{stage="{k}"}}': c for k, (c, _) in want.items()},
                       **{f'radixrelay_request_stage_seconds_sum{{stage="{k}"}}': s for k, (_, s) in want.items()}}
    alone = metrics.render(None).decode()
    assert 'radixrelay_request_stage_seconds_count{stage="parse"} 2.0' in alone and 'stage="match"' not in alone
    assert "# TYPE radixrelay_request_stage_seconds summary" in alone
    # Engine.stats() keys: the stage dicts are read by hand, not counters of their own.
    assert not [k for k in _engine_stats(stats) if k.startswith("stage")]
