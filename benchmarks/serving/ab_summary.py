"""Medians of a side-by-side serving run (``bench_serving_ab.sh``): per (config, workload, rate), the output
token throughput of every base and head run, their medians and the head / base ratio.

    python benchmarks/serving/ab_summary.py <dir holding 1-base/, 1-head/, 2-base/, ...>
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def collect(root: Path) -> dict[tuple, dict[str, list[float]]]:
    """(config, workload, rate) -> side -> output tok/s of each run, in pair order."""
    table: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: {"base": [], "head": []})
    runs = sorted(root.glob("*-*/serving_*.json"), key=lambda p: int(p.parent.name.split("-")[0]))
    for path in runs:
        side = path.parent.name.split("-", 1)[1]
        for run in json.loads(path.read_text())["runs"]:
            key = (run["config"], run["workload"], run["rate"])
            table[key][side].append(run["summary"]["output_token_throughput"])
    return table


def main() -> None:
    root = Path(sys.argv[1])
    print("| config | workload | rate | base out tok/s (runs) | head out tok/s (runs) | head / base (medians) |")
    print("|---|---|---|---|---|---|")
    for (config, workload, rate), sides in sorted(collect(root).items(), key=str):
        base, head = sides["base"], sides["head"]
        med = {k: statistics.median(v) if v else None for k, v in sides.items()}
        ratio = f"{med['head'] / med['base']:.3f}" if med["base"] and med["head"] else "n/a"
        runs = {k: " / ".join(f"{x:,.0f}" for x in v) for k, v in (("base", base), ("head", head))}
        fmt = {k: "n/a" if v is None else f"{v:,.0f}" for k, v in med.items()}
        print(f"| {config} | {workload} | {rate} | {fmt['base']} ({runs['base']}) | {fmt['head']} ({runs['head']}) "
              f"| {ratio} |")


if __name__ == "__main__":
    main()
