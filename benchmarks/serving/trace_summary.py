"""Summarise a worker step trace (``RADIXRELAY_TRACE_STEPS``: ``worker_trace.json``, a Chrome trace).

Per step (``record_function("step <id>")`` ranges of the worker): the worker's wait before it (time
since the previous launch ended: waiting for this step's plan, or reading outputs), its host launch
span, CUDA API calls and their time, the kernels the step launched (by correlation id: graph replays
count as their kernels), their summed device time, the device span from the first to the last, the
time inside that span with no kernel running (the device waiting for launches), and the idle gap
before the step's first kernel. Then the CUDA API calls and kernels of the whole window, by total
time.

    python -m benchmarks.serving.trace_summary worker_trace.json [--top 25]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
API_CATS = {"cuda_runtime", "cuda_driver"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    with open(args.trace) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    steps = sorted((e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("step ")),
                   key=lambda e: e["ts"])
    api = [e for e in events if e.get("cat") in API_CATS]
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    by_corr = defaultdict(list)
    for e in gpu:
        by_corr[e.get("args", {}).get("correlation")].append(e)

    print(f"{'step':>8} {'wait ms':>8} {'host ms':>8} {'api ms':>7} {'calls':>6} {'kernels':>7} {'dev ms':>7} "
          f"{'span ms':>8} {'idle ms':>7} {'gap ms':>7}  longest API call")
    prev_end = prev_host_end = None
    rows = []
    for s in steps:
        lo, hi = s["ts"], s["ts"] + s["dur"]
        calls = [e for e in api if lo <= e["ts"] <= hi and e.get("tid") == s.get("tid")]
        kernels = [k for c in calls for k in by_corr.get(c.get("args", {}).get("correlation"), [])]
        dev = sum(k["dur"] for k in kernels) / 1e3
        first = min((k["ts"] for k in kernels), default=None)
        last = max((k["ts"] + k["dur"] for k in kernels), default=None)
        span = (last - first) / 1e3 if kernels else 0.0
        idle = span - _union(kernels) / 1e3          # inside the span, no kernel running (waiting for launches)
        gap = (first - prev_end) / 1e3 if kernels and prev_end is not None else float("nan")
        longest = max(calls, key=lambda e: e["dur"], default=None)
        api_ms = sum(e["dur"] for e in calls) / 1e3
        wait = (lo - prev_host_end) / 1e3 if prev_host_end is not None else float("nan")
        prev_host_end = hi
        rows.append((wait, s["dur"] / 1e3, api_ms, dev, span, idle, gap))
        print(f"{s['name'][5:]:>8} {wait:>8.2f} {s['dur'] / 1e3:>8.2f} {api_ms:>7.2f} {len(calls):>6} {len(kernels):>7} "
              f"{dev:>7.2f} {span:>8.2f} {idle:>7.2f} {gap:>7.2f}  "
              + (f"{longest['name']} {longest['dur'] / 1e3:.2f} ms" if longest else ""))
        if last is not None:
            prev_end = last
    if rows:
        cols = list(zip(*rows))
        print("median", *(f"{statistics.median([v for v in c if v == v] or [float('nan')]):.2f}" for c in cols))

    for title, group, key in (("CUDA API calls", api, "name"), ("device ops", gpu, "name")):
        total, count, worst = defaultdict(float), defaultdict(int), defaultdict(float)
        for e in group:
            total[e[key]] += e["dur"]
            count[e[key]] += 1
            worst[e[key]] = max(worst[e[key]], e["dur"])
        print(f"\n{title} over the window (ms total, count, max ms)")
        for name, t in sorted(total.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"{t / 1e3:>9.2f} {count[name]:>7} {worst[name] / 1e3:>8.2f}  {name[:110]}")


def _union(kernels) -> float:
    """Microseconds covered by at least one of the kernels' [ts, ts + dur) intervals."""
    total, end = 0.0, float("-inf")
    for k in sorted(kernels, key=lambda k: k["ts"]):
        lo, hi = k["ts"], k["ts"] + k["dur"]
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


if __name__ == "__main__":
    main()
