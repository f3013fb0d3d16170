"""PNG plots of benchmark runs (matplotlib, headless).

``plot_rates``: TTFT and TPOT (p50 solid, p99 dashed) against request rate, one line per label
(a sweep, or sweeps to compare). ``plot_bars``: single runs side by side, p50/p99 of each latency
and the output token throughput.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from radixrelay.bench.report import Run, rate_of


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("plots need matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_rates(series: dict[str, list[Run]], path: Path, title: str) -> None:
    """Latency percentiles against request rate; runs at rate ``inf`` are left out."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, (name, key) in zip(axes, (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"))):
        for index, (label, runs) in enumerate(series.items()):
            points = sorted((rate_of(r), r["summary"][key]) for r in runs if math.isfinite(rate_of(r)))
            rates = [rate for rate, _ in points]
            color = f"C{index}"
            for pct, style in (("p50", "-"), ("p99", "--")):
                values = [st[pct] if st[pct] is not None else math.nan for _, st in points]
                ax.plot(rates, values, style, marker="o", color=color, label=f"{label} {pct}")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_bars(runs: dict[str, Run], path: Path, title: str) -> None:
    """Single runs side by side: latency percentiles (left) and output token throughput (right)."""
    plt = _pyplot()
    metrics = [(f"{name} {pct}", key, pct) for name, key in
               (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms"))
               for pct in ("p50", "p99")]
    fig, (lat, thr) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [4, 1]})
    width = 0.8 / len(runs)
    for index, (label, run) in enumerate(runs.items()):
        s = run["summary"]
        values = [s[key][pct] if s[key][pct] is not None else math.nan for _, key, pct in metrics]
        lat.bar([i + index * width for i in range(len(metrics))], values, width, label=label)
        thr.bar([index], [s["output_token_throughput"]], 0.6, color=f"C{index}")
    lat.set_xticks([i + width * (len(runs) - 1) / 2 for i in range(len(metrics))],
                   [name for name, _, _ in metrics], rotation=30)
    lat.set_ylabel("ms")
    lat.set_yscale("log")
    lat.grid(axis="y", alpha=0.3)
    lat.legend()
    thr.set_xticks(range(len(runs)), list(runs), rotation=30)
    thr.set_ylabel("output tokens / s")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
