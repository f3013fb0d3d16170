"""Soak: mixed OpenAI traffic with client aborts for a given time, then the server's books are checked.

Traffic (``--concurrency`` clients, each sending its next request as soon as the last one ended, for
``--duration`` seconds): chat and completions, streaming and not, n = 1 or 2, stop strings,
logprobs, seeded sampling and greedy, ``ignore_eos`` or not, prompts that share one of a few long
prefixes. A share of the requests (``--abort-share``) is aborted by the client on purpose: a stream
closed after a few events, a non-streaming request whose connection is closed after a random delay,
or a client-side timeout.

Every request sent ends as exactly one of
  completed   200 with a well-formed body: n choices, each with a finish reason, logprobs when asked,
              no stop string in the text; a stream ends with [DONE] and holds no error event;
  failed      anything else the server answered (status and OpenAI error code, an error event in a
              stream, a malformed body) or a transport error the client did not cause: with reasons;
  aborted     by design (the client closed the connection or timed out on purpose);
  lost        no outcome within --request-timeout (a hang): expected 0.
After the traffic the server must come back to its idle baseline (``radixrelay_kv_idle_baseline``
in /metrics: no live request, no KV page held by a request, no radix lock) with
``check_integrity`` passing, which /metrics reports on every scrape (``radixrelay_kv_integrity_ok``;
also watched during the traffic). RSS (VmRSS) of the server and of each of its child processes
(scheduler, worker) is sampled at every scrape; growth = (last sample under traffic - sample at the
end of the warm-up, the first ``--warmup`` seconds of the same traffic) / the warm-up sample.

    OMP_NUM_THREADS=1 python -m benchmarks.reliability.soak --duration 300 --abort-share 0.05   # default model, CPU
    python -m benchmarks.reliability.soak --base-url http://127.0.0.1:30000 --server-pid PID # a running server
    python -m benchmarks.reliability.soak --dummy-llama3-8b --server-args "--device cuda --dtype bfloat16" \\
        --duration 1800 --concurrency 128                                         # CUDA, 8B shapes

The script starts ``radixrelay serve`` itself (``--server-args`` are passed through) unless
``--base-url`` is given; then RSS is measured only with ``--server-pid``. Results: ``--out PREFIX``
writes PREFIX.md and PREFIX.json. Exit code 0 when nothing was lost or failed, the server came back
to its idle baseline, every integrity check passed and RSS grew at most ``--max-rss-growth``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks.common import RESULTS, ROOT, Server, default_tokenizer, llama3_8b_dir
from radixrelay.bench.workloads import words
from radixrelay.bench.provenance import source_commit

Outcome = str                  # "completed" | "failed" | "aborted" | "lost"
_SAMPLE = re.compile(r"^(radixrelay_[A-Za-z0-9_]+)\s+(\S+)$")   # unlabelled samples only
STOPS = ("\n\n", ".")
_ENV_SHOWN = ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")   # named in the recorded command when set


# -- traffic ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mix:
    abort_share: float = 0.05
    stream_share: float = 0.5
    chat_share: float = 0.5
    n2_share: float = 0.25          # n = 2
    stop_share: float = 0.25
    logprobs_share: float = 0.25
    max_tokens: tuple[int, int] = (4, 33)   # [low, high)
    prefixes: int = 4               # shared prefixes
    prefix_words: int = 80
    question_words: tuple[int, int] = (4, 24)


@dataclass(frozen=True)
class Planned:
    index: int
    path: str                       # /v1/chat/completions | /v1/completions
    body: dict[str, Any]
    abort: str | None               # None | "disconnect" | "timeout"
    abort_after: float              # disconnect: events (stream) or seconds; timeout: seconds


def plan_request(index: int, rng: np.random.Generator, mix: Mix, prefixes: list[str], model: str) -> Planned:
    chat = rng.random() < mix.chat_share
    stream = rng.random() < mix.stream_share
    prefix = prefixes[int(rng.integers(len(prefixes)))]
    question = words(rng, int(rng.integers(*mix.question_words)))
    body: dict[str, Any] = {"model": model, "max_tokens": int(rng.integers(*mix.max_tokens)),
                            "n": 2 if rng.random() < mix.n2_share else 1, "stream": stream}
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body.update(temperature=0.8, seed=int(rng.integers(1 << 30)))
    if rng.random() < 0.5:
        body["ignore_eos"] = True
    if rng.random() < mix.stop_share:
        body["stop"] = list(STOPS[: int(rng.integers(1, len(STOPS) + 1))])
    logprobs = rng.random() < mix.logprobs_share
    if chat:
        body["messages"] = [{"role": "system", "content": prefix}, {"role": "user", "content": question}]
        if logprobs:
            body.update(logprobs=True, top_logprobs=2)
        path = "/v1/chat/completions"
    else:
        body["prompt"] = f"{prefix}\n\nQuestion: {question}\nAnswer:"
        if logprobs:
            body["logprobs"] = 2
        path = "/v1/completions"
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    abort, after = None, 0.0
    if rng.random() < mix.abort_share:
        abort = "disconnect" if rng.random() < 0.6 else "timeout"
        after = float(rng.integers(1, 6)) if abort == "disconnect" and stream else float(rng.uniform(0.05, 2.0))
    return Planned(index, path, body, abort, after)


@dataclass
class Result:
    index: int
    outcome: Outcome
    reason: str = ""
    abort: str | None = None          # the abort planned for the request (it may finish first)
    latency_s: float = 0.0


class _Invalid(Exception):
    """A 200 answer whose body breaks the protocol."""


def check_choices(planned: Planned, finish: dict[int, str | None], texts: dict[int, str],
                  logprobs: dict[int, bool]) -> None:
    n = planned.body["n"]
    if sorted(finish) != list(range(n)):
        raise _Invalid(f"choices {sorted(finish)} for n = {n}")
    for i in range(n):
        if finish[i] not in ("stop", "length"):
            raise _Invalid(f"choice {i}: finish_reason {finish[i]!r}")
        if any(s in texts.get(i, "") for s in planned.body.get("stop", ())):
            raise _Invalid(f"choice {i}: a stop string is in the text")
        asked = bool(planned.body.get("logprobs"))
        if asked and texts.get(i) and not logprobs.get(i):
            raise _Invalid(f"choice {i}: logprobs asked for, none returned")


def _timeout(planned: Planned) -> dict[str, Any]:
    """A 'timeout' abort is httpx's own client timeout (connect, read, write: each at most this)."""
    return {"timeout": planned.abort_after} if planned.abort == "timeout" else {}


async def run_plain(http: httpx.AsyncClient, url: str, planned: Planned) -> Result:
    r = await http.post(url, json=planned.body, **_timeout(planned))
    if r.status_code != 200:
        return Result(planned.index, "failed", _error_reason(r.status_code, r.content))
    data = r.json()
    finish = {c["index"]: c.get("finish_reason") for c in data["choices"]}
    if "messages" in planned.body:
        texts = {c["index"]: c["message"]["content"] or "" for c in data["choices"]}
    else:
        texts = {c["index"]: c["text"] for c in data["choices"]}
    logprobs = {c["index"]: c.get("logprobs") is not None for c in data["choices"]}
    check_choices(planned, finish, texts, logprobs)
    return Result(planned.index, "completed")


async def run_stream(http: httpx.AsyncClient, url: str, planned: Planned) -> Result:
    """Streams; with a 'disconnect' abort, closes the connection after ``abort_after`` events."""
    chat = "messages" in planned.body
    finish: dict[int, str | None] = {}
    texts: dict[int, str] = {}
    logprobs: dict[int, bool] = {}
    events, done = 0, False
    async with http.stream("POST", url, json=planned.body, **_timeout(planned)) as r:
        if r.status_code != 200:
            return Result(planned.index, "failed", _error_reason(r.status_code, await r.aread()))
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if done:
                raise _Invalid("data after [DONE]")
            payload = line[6:]
            if payload == "[DONE]":
                done = True
                continue
            events += 1
            data = json.loads(payload)
            if "error" in data:
                err = data["error"]
                return Result(planned.index, "failed", f"stream error event: {err.get('code') or err.get('type')}")
            for c in data["choices"]:
                i = c["index"]
                finish.setdefault(i, None)
                texts[i] = texts.get(i, "") + ((c["delta"].get("content") or "") if chat else c["text"])
                logprobs[i] = logprobs.get(i, False) or c.get("logprobs") is not None
                if c.get("finish_reason") is not None:
                    finish[i] = c["finish_reason"]
            if planned.abort == "disconnect" and events >= planned.abort_after:
                return Result(planned.index, "aborted", "closed mid-stream", planned.abort)
    if not done:
        raise _Invalid("stream ended without [DONE]")
    check_choices(planned, finish, texts, logprobs)
    return Result(planned.index, "completed")


def _error_reason(status: int, content: bytes) -> str:
    try:
        err = json.loads(content)["error"]
        return f"HTTP {status} {err.get('code') or err.get('type')}"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status} (not OpenAI error JSON)"


async def run_one(http: httpx.AsyncClient, base_url: str, planned: Planned, request_timeout: float) -> Result:
    """One request to its outcome (see the module docstring); never raises."""
    url = base_url + planned.path
    t0 = time.monotonic()
    stream = planned.body["stream"]
    go = run_stream(http, url, planned) if stream else run_plain(http, url, planned)
    close_early = planned.abort == "disconnect" and not stream     # close the connection unanswered
    try:
        result = await asyncio.wait_for(go, planned.abort_after if close_early else request_timeout)
    except asyncio.TimeoutError:
        if close_early:
            result = Result(planned.index, "aborted", "closed before the answer", planned.abort)
        else:
            result = Result(planned.index, "lost", f"no outcome within {request_timeout:.0f} s")
    except httpx.TimeoutException as exc:
        if planned.abort == "timeout":
            result = Result(planned.index, "aborted", "client timeout", planned.abort)
        else:
            result = Result(planned.index, "failed", f"{type(exc).__name__}: {exc}"[:200])
    except _Invalid as exc:
        result = Result(planned.index, "failed", f"invalid response: {exc}")
    except Exception as exc:  # noqa: BLE001 - transport errors, malformed JSON: reported as failures
        result = Result(planned.index, "failed", f"{type(exc).__name__}: {exc}"[:200])
    result.latency_s = time.monotonic() - t0
    result.abort = planned.abort          # planned; the outcome says whether it happened
    return result


# -- the server's side --------------------------------------------------------------------------


async def scrape(http: httpx.AsyncClient, base_url: str) -> dict[str, float]:
    text = (await http.get(f"{base_url}/metrics", timeout=30)).text
    return {m[1]: float(m[2]) for line in text.splitlines() if (m := _SAMPLE.match(line))}


def process_tree(pid: int) -> dict[str, int]:
    """The server and its runtime children by role: {"server": pid, "scheduler": ..., "worker": ...}."""
    out = {"server": pid}
    path = Path(f"/proc/{pid}/task/{pid}/children")
    for child in (path.read_text().split() if path.exists() else []):
        try:
            cmd = Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        for role in ("scheduler", "worker"):
            if f"radixrelay.{role}.{role}_process" in cmd:
                out[role] = int(child)
    return out


def rss_kib(pid: int) -> dict[str, int] | None:
    """VmRSS and VmHWM (peak) in KiB; None once the process is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {k: int(fields[k].split()[0]) for k in ("VmRSS", "VmHWM") if k in fields}


METRIC_KEYS = ("radixrelay_kv_idle_baseline", "radixrelay_kv_integrity_ok", "radixrelay_kv_request_pages",
               "radixrelay_radix_locked_nodes", "radixrelay_radix_lock_refs", "radixrelay_radix_lock_holders",
               "radixrelay_num_requests_running", "radixrelay_num_requests_waiting",
               "radixrelay_kv_free_pages", "radixrelay_kv_cached_pages", "radixrelay_kv_total_pages",
               "radixrelay_malformed_frames_total", "radixrelay_retractions_total")


@dataclass
class Watch:
    """What the periodic scrapes saw."""
    pids: dict[str, int] = field(default_factory=dict)
    rss: list[dict[str, Any]] = field(default_factory=list)     # {"t": s, role: VmRSS KiB}
    scrapes: int = 0
    integrity_failures: int = 0
    scrape_errors: list[str] = field(default_factory=list)
    max_running: float = 0.0

    def sample_rss(self, t: float) -> dict[str, Any]:
        row: dict[str, Any] = {"t": round(t, 1)}
        for role, pid in self.pids.items():
            got = rss_kib(pid)
            if got is not None:
                row[role] = got["VmRSS"]
                row[f"{role}_peak"] = got["VmHWM"]
        self.rss.append(row)
        return row


# -- the run ------------------------------------------------------------------------------------


@dataclass
class Soak:
    base_url: str
    duration: float
    warmup: float
    concurrency: int
    request_timeout: float
    scrape_interval: float
    mix: Mix
    seed: int
    watch: Watch
    results: list[Result] = field(default_factory=list)
    sent: int = 0
    model: str = "default"
    warmup_rss: dict[str, Any] | None = None
    traffic_end_rss: dict[str, Any] | None = None

    async def run(self) -> None:
        rng = np.random.default_rng([self.seed, 0])
        prefixes = [words(rng, self.mix.prefix_words) for _ in range(self.mix.prefixes)]
        t0 = time.monotonic()
        deadline = t0 + self.duration
        limits = httpx.Limits(max_connections=self.concurrency + 8, max_keepalive_connections=self.concurrency)
        # httpx's own timeout is longer than request_timeout: a hang ends as lost, not as a read timeout.
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.request_timeout + 30), limits=limits) as http:
            self.model = (await http.get(f"{self.base_url}/v1/models")).json()["data"][0]["id"]
            watcher = asyncio.create_task(self._watch(http, t0, deadline))
            clients = [asyncio.create_task(self._client(http, k, prefixes, deadline))
                       for k in range(self.concurrency)]
            await asyncio.gather(*clients)
            self.traffic_end_rss = self.watch.sample_rss(time.monotonic() - t0)
            watcher.cancel()

    async def _client(self, http: httpx.AsyncClient, k: int, prefixes: list[str], deadline: float) -> None:
        rng = np.random.default_rng([self.seed, 1, k])
        while time.monotonic() < deadline:
            planned = plan_request(self.sent, rng, self.mix, prefixes, self.model)
            self.sent += 1
            self.results.append(await run_one(http, self.base_url, planned, self.request_timeout))

    async def _watch(self, http: httpx.AsyncClient, t0: float, deadline: float) -> None:
        warm_at = t0 + self.warmup
        while True:
            await asyncio.sleep(min(self.scrape_interval, max(0.05, warm_at - time.monotonic()))
                                if self.warmup_rss is None else self.scrape_interval)
            now = time.monotonic()
            row = self.watch.sample_rss(now - t0)
            if self.warmup_rss is None and now >= warm_at:
                self.warmup_rss = row
            try:
                m = await scrape(http, self.base_url)
            except (httpx.HTTPError, ValueError) as exc:
                self.watch.scrape_errors.append(f"{type(exc).__name__}: {exc}"[:200])
                continue
            self.watch.scrapes += 1
            self.watch.integrity_failures += m.get("radixrelay_kv_integrity_ok", 0.0) != 1.0
            self.watch.max_running = max(self.watch.max_running, m.get("radixrelay_num_requests_running", 0.0))


async def wait_idle_baseline(base_url: str, timeout: float) -> tuple[bool, dict[str, float], float]:
    """Poll /metrics until the idle baseline holds (or ``timeout``): (reached, metrics, seconds)."""
    t0 = time.monotonic()
    m: dict[str, float] = {}
    async with httpx.AsyncClient() as http:
        while True:
            try:
                m = await scrape(http, base_url)
            except (httpx.HTTPError, ValueError):
                m = {}
            if m.get("radixrelay_kv_idle_baseline") == 1.0 or time.monotonic() - t0 > timeout:
                return m.get("radixrelay_kv_idle_baseline") == 1.0, m, time.monotonic() - t0
            await asyncio.sleep(0.2)


# -- report -------------------------------------------------------------------------------------


def rss_growth(before: dict[str, Any] | None, after: dict[str, Any] | None,
               roles: list[str]) -> dict[str, dict[str, float | None]]:
    out: dict[str, dict[str, float | None]] = {}
    for role in roles:
        b = before.get(role) if before else None
        a = after.get(role) if after else None
        out[role] = {"warmup_mib": b and b / 1024, "end_mib": a and a / 1024,
                     "peak_mib": (after or {}).get(f"{role}_peak", 0) / 1024 or None,
                     "growth": (a - b) / b if a and b else None}
    return out


def summarize(soak: Soak, baseline: tuple[bool, dict[str, float], float], shutdown: dict[str, Any] | None,
              max_rss_growth: float) -> dict[str, Any]:
    counts = Counter(r.outcome for r in soak.results)
    reasons = Counter(r.reason for r in soak.results if r.outcome == "failed")
    abort_kinds = Counter(f"{r.abort}: {r.reason}" for r in soak.results if r.outcome == "aborted")
    planned_aborts = sum(r.abort is not None for r in soak.results)
    reached, m, waited = baseline
    roles = list(soak.watch.pids)
    growth = rss_growth(soak.warmup_rss, soak.traffic_end_rss, roles)
    worst = max((g["growth"] for g in growth.values() if g["growth"] is not None), default=None)
    integrity_ok = soak.watch.integrity_failures == 0 and m.get("radixrelay_kv_integrity_ok") == 1.0
    # Requests without a recorded outcome count as lost too (none expected: every client awaits its own).
    lost = soak.sent - counts["completed"] - counts["failed"] - counts["aborted"]
    verdict = {
        "no_lost": lost == 0, "no_failed": counts["failed"] == 0, "idle_baseline": reached,
        "integrity_ok": integrity_ok,
        "rss_growth_ok": worst is None or worst <= max_rss_growth,
    }
    if shutdown is not None:
        verdict["clean_shutdown"] = shutdown["exit_code"] == 0 and not shutdown["survivors"]
    return {
        "sent": soak.sent, "completed": counts["completed"], "failed": counts["failed"],
        "failed_reasons": dict(reasons), "aborted": counts["aborted"], "aborted_kinds": dict(abort_kinds),
        "aborts_planned": planned_aborts, "lost": lost,
        "idle_baseline": {"reached": reached, "seconds_to_reach": round(waited, 2),
                          "metrics": {k: m.get(k) for k in METRIC_KEYS}},
        "integrity": {"ok": integrity_ok, "scrapes": soak.watch.scrapes,
                      "failures_during_traffic": soak.watch.integrity_failures,
                      "scrape_errors": soak.watch.scrape_errors[:10]},
        "max_running": soak.watch.max_running,
        "rss": growth, "rss_max_growth": worst, "rss_samples": soak.watch.rss,
        "latency_s": _latency(soak.results),
        "shutdown": shutdown, "verdict": verdict, "ok": all(verdict.values()),
    }


def _latency(results: list[Result]) -> dict[str, float | None]:
    done = [r.latency_s for r in results if r.outcome == "completed"]
    if not done:
        return {"p50": None, "p99": None, "max": None}
    return {"p50": float(np.percentile(done, 50)), "p99": float(np.percentile(done, 99)), "max": max(done)}


def markdown(meta: dict[str, Any], s: dict[str, Any]) -> str:
    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:+.1f}%"

    def mib(x: float | None) -> str:
        return "n/a" if x is None else f"{x:,.0f}"

    yes = {True: "yes", False: "**no**"}
    m = s["idle_baseline"]["metrics"]
    lines = [
        f"# Soak ({meta['device']})", "",
        f"{meta['date']}; commit {meta['commit']}; {meta['machine']}.", "",
        f"Command: `{meta['command']}`", "",
        f"Server: `{meta['server']}`. {meta['minutes']:.1f} minutes of traffic ({meta['warmup_s']:.0f} s of it "
        f"warm-up), {meta['concurrency']} concurrent clients, {100 * meta['abort_share']:.0f}% of the "
        "requests aborted by the client on purpose (stream closed after a few events, connection closed "
        "before the answer, client timeout). Mix: chat and completions, streaming and not, n = 1 or 2, "
        "stop strings, logprobs, greedy and seeded sampling, prompts over a few shared prefixes.", "",
        "| figure | value |", "|---|---|",
        f"| requests sent | {s['sent']} |",
        f"| completed | {s['completed']} |",
        f"| failed | {s['failed']}" + (f" ({', '.join(f'{k}: {v}' for k, v in s['failed_reasons'].items())})"
                                       if s["failed_reasons"] else "") + " |",
        f"| aborted by design | {s['aborted']} (planned {s['aborts_planned']}; the rest finished first) |",
        f"| lost | {s['lost']} |",
        f"| KV pages and radix locks back to the idle baseline | {yes[s['idle_baseline']['reached']]} "
        f"(request pages {m['radixrelay_kv_request_pages']}, locked nodes {m['radixrelay_radix_locked_nodes']}, "
        f"lock refs {m['radixrelay_radix_lock_refs']}; free {m['radixrelay_kv_free_pages']} + cached "
        f"{m['radixrelay_kv_cached_pages']} of {m['radixrelay_kv_total_pages']} pages; "
        f"{s['idle_baseline']['seconds_to_reach']} s after the last request) |",
        f"| check_integrity ok | {yes[s['integrity']['ok']]} ({s['integrity']['scrapes']} scrapes during "
        f"the traffic, {s['integrity']['failures_during_traffic']} failed) |",
        f"| most requests running at once | {s['max_running']:.0f} |",
    ]
    lat = s["latency_s"]
    if lat["p50"] is not None:
        lines.append(f"| completed latency p50 / p99 / max (s) | {lat['p50']:.2f} / {lat['p99']:.2f} / {lat['max']:.2f} |")
    if s["shutdown"] is not None:
        sd = s["shutdown"]
        lines.append(f"| clean shutdown (SIGTERM) | {yes[s['verdict']['clean_shutdown']]} (exit code "
                     f"{sd['exit_code']}, {len(sd['survivors'])} processes left) |")
    lines += ["", "RSS (VmRSS, MiB) after the warm-up and at the end of the traffic; peak = VmHWM:", "",
              "| process | after warm-up | end | growth | peak |", "|---|---|---|---|---|"]
    for role, g in s["rss"].items():
        lines.append(f"| {role} | {mib(g['warmup_mib'])} | {mib(g['end_mib'])} | {pct(g['growth'])} | "
                     f"{mib(g['peak_mib'])} |")
    lines += ["", f"Verdict: {'PASS' if s['ok'] else 'FAIL'} "
              f"({', '.join(f'{k} {yes[v]}' for k, v in s['verdict'].items())}; RSS growth limit "
              f"{100 * meta['max_rss_growth']:.0f}%).", ""]
    return "\n".join(lines)


# -- command line -------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=300.0, help="seconds of traffic (default: %(default)s)")
    p.add_argument("--warmup", type=float, default=None,
                   help="seconds of the traffic after which RSS is first sampled (default: 10%% of the "
                        "duration, 5 to 60 s)")
    p.add_argument("--concurrency", type=int, default=8, help="(default: %(default)s)")
    p.add_argument("--abort-share", type=float, default=0.05, help="(default: %(default)s)")
    p.add_argument("--max-tokens", default="4,32", help="MIN,MAX of max_tokens (default: %(default)s)")
    p.add_argument("--prefix-words", type=int, default=80, help="words per shared prefix (default: %(default)s)")
    p.add_argument("--request-timeout", type=float, default=120.0,
                   help="a request without an outcome after this many seconds is lost (default: %(default)s)")
    p.add_argument("--baseline-timeout", type=float, default=30.0,
                   help="seconds the server may take to return to the idle baseline (default: %(default)s)")
    p.add_argument("--scrape-interval", type=float, default=5.0, help="(default: %(default)s)")
    p.add_argument("--max-rss-growth", type=float, default=0.05,
                   help="largest RSS growth per process that passes (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--base-url", default=None, help="a running server (default: start one)")
    p.add_argument("--server-pid", type=int, default=None, help="with --base-url: its pid, for RSS")
    p.add_argument("--server-args", default="", help="`radixrelay serve` options, one string")
    p.add_argument("--dummy-llama3-8b", action="store_true",
                   help="serve Llama-3-8B shapes with dummy weights and the default tokenizer "
                        "(add --device/--dtype through --server-args)")
    p.add_argument("--layers", type=int, default=32, help="layers of the dummy model (default: %(default)s)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=RESULTS / "reliability" / "soak_cpu",
                   help="results prefix: writes PREFIX.md and PREFIX.json (default: %(default)s)")
    p.add_argument("--server-log", type=Path, default=None,
                   help="where the started server logs (default: a temporary file, its tail printed on failure)")
    p.add_argument("--commit", default=None)
    return p


def _meta(args: argparse.Namespace, server: str, warmup: float) -> dict[str, Any]:
    commit = args.commit or source_commit(ROOT)
    device = "CPU"
    if "cuda" in server:
        try:
            device = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
        except (OSError, IndexError, subprocess.TimeoutExpired):
            device = "CUDA device"
    return {"device": device, "commit": commit,
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": shlex.join([*(f"{k}={os.environ[k]}" for k in _ENV_SHOWN if k in os.environ),
                                   "python", "-m", "benchmarks.reliability.soak", *sys.argv[1:]]), "server": server,
            "minutes": args.duration / 60, "warmup_s": warmup, "concurrency": args.concurrency,
            "abort_share": args.abort_share, "max_rss_growth": args.max_rss_growth}


async def _main(args: argparse.Namespace, tmp: Path) -> int:
    lo, hi = (int(x) for x in args.max_tokens.split(","))
    mix = Mix(abort_share=args.abort_share, max_tokens=(lo, hi + 1), prefix_words=args.prefix_words)
    warmup = args.warmup if args.warmup is not None else min(60.0, max(5.0, args.duration / 10))
    server: Server | None = None
    if args.base_url is None:
        argv = shlex.split(args.server_args)
        if args.dummy_llama3_8b:
            model = llama3_8b_dir(tmp / "llama3-8b-shapes", args.layers, 49152)
            argv = ["--model", str(model), "--load-format", "dummy", "--tokenizer", default_tokenizer(), *argv]
        args.out.parent.mkdir(parents=True, exist_ok=True)
        server = Server(argv, args.server_log or tmp / "server.log")
        base_url, described = server.base_url, "radixrelay serve " + (shlex.join(argv) or "(the default model)")
    else:
        base_url, described = args.base_url.rstrip("/"), args.base_url
    watch = Watch()
    shutdown = None
    try:
        if server is not None:
            async with httpx.AsyncClient() as http:
                await server.wait_ready(http, args.startup_timeout)
            watch.pids = process_tree(server.proc.pid)
        elif args.server_pid is not None:
            watch.pids = process_tree(args.server_pid)
        soak = Soak(base_url, args.duration, warmup, args.concurrency, args.request_timeout,
                    args.scrape_interval, mix, args.seed, watch)
        print(f"soak: {described}; {args.duration:.0f} s, concurrency {args.concurrency}, "
              f"aborts {100 * args.abort_share:.0f}%; processes {watch.pids}", flush=True)
        await soak.run()
        baseline = await wait_idle_baseline(base_url, args.baseline_timeout)
    finally:
        if server is not None:
            server.stop()
            time.sleep(1.0)
            shutdown = {"exit_code": server.proc.returncode,
                        "survivors": [p for p in watch.pids.values() if rss_kib(p) is not None]}
    summary = summarize(soak, baseline, shutdown, args.max_rss_growth)
    meta = _meta(args, described, warmup)
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "summary": summary,
                                                         "mix": asdict(mix)}, indent=1) + "\n")
    text = markdown(meta, summary)
    args.out.with_suffix(".md").write_text(text)
    print(text)
    if server is not None and not summary["ok"]:
        print(f"server log (tail):\n{server.log_tail(4000)}")
    return 0 if summary["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="radixrelay-soak-") as tmp:
        return asyncio.run(_main(args, Path(tmp)))


if __name__ == "__main__":
    sys.exit(main())
