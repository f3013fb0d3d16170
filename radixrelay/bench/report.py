"""Reports: the end-of-run summary table, the results JSON, and markdown tables of several runs.

Results JSON: ``{"config": {...}, "runs": [{"request_rate", "summary", "requests"}, ...]}``, one run
per request rate (one for a plain run, several for ``--sweep-rates``). A rate of ``inf`` is written
as the string ``"inf"`` (JSON has no infinity).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from radixrelay.bench.metrics import RequestRecord

Run = dict[str, Any]
_LATENCIES = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms"))


def make_run(rate: float, summary: dict[str, Any], records: list[RequestRecord]) -> Run:
    return {"request_rate": "inf" if math.isinf(rate) else rate, "summary": summary,
            "requests": [r.to_json() for r in records]}


def write_results(path: Path, config: dict[str, Any], runs: list[Run]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"config": config, "runs": runs}, indent=1) + "\n", encoding="utf-8")


def load_results(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read results {path}: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list) or not data["runs"]:
        raise ValueError(f"{path}: not a bench_serving results file (no 'runs')")
    return data


def rate_of(run: Run) -> float:
    return float(run["request_rate"])


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def summary_table(title: str, s: dict[str, Any]) -> str:
    """The human-readable summary of one run."""
    width = 64
    lines = [f" {title} ".center(width, "="),
             f"{'Completed / failed requests:':<36}{s['completed']} / {s['failed']}",
             f"{'Duration (s):':<36}{s['duration_s']:.2f}",
             f"{'Request throughput (req/s):':<36}{s['request_throughput']:.2f}",
             f"{'Input token throughput (tok/s):':<36}{s['input_token_throughput']:.1f}",
             f"{'Output token throughput (tok/s):':<36}{s['output_token_throughput']:.1f}",
             f"{'Total prompt / completion tokens:':<36}{s['total_prompt_tokens']} / "
             f"{s['total_completion_tokens']}"]
    if s["cache_hit_ratio"] is not None:
        lines.append(f"{'Cached prompt tokens (hit ratio):':<36}{s['total_cached_tokens']} "
                     f"({100 * s['cache_hit_ratio']:.1f}%)")
    if "goodput" in s:
        lines.append(f"{'Goodput (req/s), SLO attainment:':<36}{s['goodput']:.2f}, "
                     f"{100 * (s['slo_attainment'] or 0):.1f}%")
    if set(s["token_sources"]) - {"usage"}:
        lines.append(f"{'Token counts from:':<36}{s['token_sources']}")
    lines.append(f"{'Latency (ms)':<12}{'mean':>12}{'p50':>12}{'p90':>12}{'p99':>12}")
    for name, key in _LATENCIES:
        st = s[key]
        cells = "".join(f"{_num(st[k]):>12}" for k in ("mean", "p50", "p90", "p99"))
        lines.append(f"{name:<12}{cells}")
    for message, count in s["errors"].items():
        lines.append(f"error x{count}: {message}")
    lines.append("=" * width)
    return "\n".join(lines)


def markdown_table(labelled_runs: list[tuple[str, Run]]) -> str:
    """One row per (label, run): throughput, TTFT and TPOT p50/p99, cache hit ratio."""
    header = ("| run | rate (req/s) | completed | failed | req/s | output tok/s | TTFT p50 (ms) "
              "| TTFT p99 (ms) | TPOT p50 (ms) | TPOT p99 (ms) | cache hit |")
    rows = [header, "|" + "---|" * (header.count("|") - 1)]
    for label, run in labelled_runs:
        s = run["summary"]
        hit = "-" if s["cache_hit_ratio"] is None else f"{100 * s['cache_hit_ratio']:.1f}%"
        rows.append(
            f"| {label} | {run['request_rate']} | {s['completed']} | {s['failed']} "
            f"| {s['request_throughput']:.2f} | {s['output_token_throughput']:.1f} "
            f"| {_num(s['ttft_ms']['p50'])} | {_num(s['ttft_ms']['p99'])} "
            f"| {_num(s['tpot_ms']['p50'])} | {_num(s['tpot_ms']['p99'])} | {hit} |")
    return "\n".join(rows) + "\n"
