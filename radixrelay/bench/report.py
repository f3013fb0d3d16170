"""Reports: the end-of-run summary table, the results JSON, and markdown tables of several runs.

Results JSON: ``{"config": {...}, "runs": [{"request_rate", "summary", "requests"}, ...]}``, one run
per request rate (one for a plain run, several for ``--sweep-rates``). A rate of ``inf`` is written
as the string ``"inf"`` (JSON has no infinity). A summary of a run with later turns (multi-turn)
also holds ``"multi_turn"`` (``metrics.turn_summary``); the tables show it where present.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from radixrelay.bench.summary import RequestRecord

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
    if s.get("multi_turn"):
        lines.extend(_multi_turn_lines(s["multi_turn"], width))
    for message, count in s["errors"].items():
        lines.append(f"error x{count}: {message}")
    lines.append("=" * width)
    return "\n".join(lines)


def _multi_turn_lines(m: dict[str, Any], width: int) -> list[str]:
    """The multi-turn section of ``summary_table``: later turns are those of index >= 1; a later
    turn's history is the previous turn's prompt and reply."""
    hit = ("-" if m["history_hit_rate"] is None else
           f"{100 * m['history_hit_rate']:.1f}% ({m['history_cached_tokens']} / "
           f"{m['history_tokens']} tok)")
    long = f"history>={m['history_threshold']}"
    lines = [" multi-turn (later turns: index >= 1) ".center(width, "-"),
             f"{'History hit rate (later turns):':<36}{hit}",
             f"{'Uncached prompt tok / TTFT second:':<36}"
             f"{_num(m['uncached_prompt_tokens_per_ttft_s'], 1)}",
             f"{'Prompt tok / TTFT second:':<36}{_num(m['prompt_tokens_per_ttft_s'], 1)}",
             f"{'TTFT (ms)':<16}{'n':>8}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}"]
    for name, count, key in (("first turns", "first_turns", "ttft_first_ms"),
                             ("later turns", "later_turns", "ttft_later_ms"),
                             (long, "long_history_turns", "ttft_long_history_ms")):
        cells = "".join(f"{_num(m[key][k]):>10}" for k in ("mean", "p50", "p90", "p99"))
        lines.append(f"{name:<16}{m[count]:>8}{cells}")
    return lines


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def markdown_table(labelled_runs: list[tuple[str, Run]]) -> str:
    """One row per (label, run): throughput, TTFT and TPOT p50/p99, cache hit ratio; where some
    run has multi-turn figures, also TTFT p50/p99 of first turns, later turns and long-history
    later turns, the history hit rate and uncached prompt tokens per TTFT second (later turns)."""
    header = ("| run | rate (req/s) | completed | failed | req/s | output tok/s | TTFT p50 (ms) "
              "| TTFT p99 (ms) | TPOT p50 (ms) | TPOT p99 (ms) | cache hit |")
    multi = [run["summary"].get("multi_turn") for _, run in labelled_runs]
    if any(multi):
        thresholds = {m["history_threshold"] for m in multi if m}
        long = f"history>={thresholds.pop()}" if len(thresholds) == 1 else "long-history"
        header += "".join(f" {turns} TTFT {p} (ms) |" for turns in ("first", "later", long)
                          for p in ("p50", "p99"))
        header += " history hit | uncached prompt tok / TTFT s |"
    rows = [header, "|" + "---|" * (header.count("|") - 1)]
    for (label, run), m in zip(labelled_runs, multi):
        s = run["summary"]
        row = (f"| {label} | {run['request_rate']} | {s['completed']} | {s['failed']} "
               f"| {s['request_throughput']:.2f} | {s['output_token_throughput']:.1f} "
               f"| {_num(s['ttft_ms']['p50'])} | {_num(s['ttft_ms']['p99'])} "
               f"| {_num(s['tpot_ms']['p50'])} | {_num(s['tpot_ms']['p99'])} "
               f"| {_percent(s['cache_hit_ratio'])} |")
        if any(multi):
            if m:
                row += "".join(f" {_num(m[key][p])} |"
                               for key in ("ttft_first_ms", "ttft_later_ms", "ttft_long_history_ms")
                               for p in ("p50", "p99"))
                row += (f" {_percent(m['history_hit_rate'])} "
                        f"| {_num(m['uncached_prompt_tokens_per_ttft_s'], 1)} |")
            else:
                row += " - |" * 8
        rows.append(row)
    return "\n".join(rows) + "\n"
