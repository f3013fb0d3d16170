"""Where a streamed burst's time to first token goes, from the scheduler's step log (``RADIXRELAY_STEP_LOG``)
and ``bench_long_doc``'s JSON (the burst's send time and its TTFTs, on the same monotonic clock).

    RADIXRELAY_STEP_LOG=/tmp/steps.tsv python -m benchmarks.serving.bench_long_doc ...
    python -m benchmarks.serving.step_timeline /tmp/steps.tsv long_doc_h200.json --tokens 112004 --form ids

Prints, relative to the burst's send time: when its requests reached the scheduler (quantiles), every step
from then until the last first token (rows, extends, queue, device time, the gap since the previous
step's output), and per request the wait from arrival to the step that sampled its first token.
"""

from __future__ import annotations

import argparse
import json
import statistics


def _quantiles(values: list[float]) -> str:
    if not values:
        return "-"
    v = sorted(values)
    pick = lambda q: v[min(len(v) - 1, int(q * len(v)))]          # noqa: E731
    return " / ".join(f"{1e3 * pick(q):.0f}" for q in (0.0, 0.1, 0.5, 0.9)) + f" / {1e3 * v[-1]:.0f} ms"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log")
    ap.add_argument("bench_json")
    ap.add_argument("--tokens", type=int, required=True, help="the row's prompt tokens")
    ap.add_argument("--form", default="ids")
    args = ap.parse_args(argv)
    rows = json.load(open(args.bench_json))["rows"]
    row = next(r for r in rows if r["prompt_tokens"] == args.tokens and r["form"] == args.form)
    stream = row["stream"]
    t0, ttfts = stream["sent_monotonic_s"], stream["ttfts_s"]
    end = t0 + max(ttfts) + 0.05
    arrive, steps, done = {}, [], {}
    for line in open(args.log):
        f = line.rstrip("\n").split("\t")
        t = float(f[1])
        if not t0 <= t <= end:
            continue
        if f[0] == "arrive":
            arrive[int(f[2])] = t
        elif f[0] == "step":
            rids = [int(x) for x in f[7].split(",")] if len(f) > 7 and f[7] else []
            pages = int(f[8]) if len(f) > 8 else -1
            steps.append((t, int(f[2]), int(f[3]), int(f[4]), int(f[5]), int(f[6]), rids, pages))
        elif f[0] == "done":
            done[int(f[2])] = (t, float(f[3]), float(f[4]))
    print(f"burst of {stream['size']} x {stream['out']} at {args.tokens} tokens ({args.form}): "
          f"TTFT min / p10 / p50 / p90 / max {_quantiles(ttfts)}")
    print(f"arrivals at the scheduler (after send): {_quantiles([t - t0 for t in arrive.values()])}")
    first_step = {}
    print(f"{'t ms':>8} {'step':>6} {'decode':>6} {'ext req':>7} {'ext tok':>7} {'waiting':>7} "
          f"{'pages':>7} {'done ms':>8} {'dev ms':>7} {'busy ms':>7}")
    for t, sid, dec, ereq, etok, waiting, rids, pages in steps:
        out = done.get(sid)
        print(f"{1e3 * (t - t0):8.1f} {sid:6d} {dec:6d} {ereq:7d} {etok:7d} {waiting:7d} {pages:7d} "
              + (f"{1e3 * (out[0] - t0):8.1f} {1e3 * out[2]:7.2f} {1e3 * out[1]:7.2f}" if out else ""))
        for rid in rids:
            first_step.setdefault(rid, (t, out[0] if out else None))
    waits = [first_step[r][0] - arrive[r] for r in arrive if r in first_step]
    outs = [first_step[r][1] - t0 for r in arrive if r in first_step and first_step[r][1] is not None]
    print(f"arrival -> step that samples its first token: {_quantiles(waits)}")
    print(f"send -> that step's output at the scheduler: {_quantiles(outs)}")
    if steps:
        dev = [done[s[1]][2] for s in steps if s[1] in done]
        print(f"steps {len(steps)}, device time sum {sum(dev):.3f} s, median {1e3 * statistics.median(dev):.2f} ms")


if __name__ == "__main__":
    main()
