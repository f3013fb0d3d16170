"""Host -> device load rate of the KV tiers by run length (CUDA): what a promotion of a 4K-token history costs.

Drives the worker's ``TierStore`` over a Llama-3-8B-shaped KV cache (32 layers, 8 KV heads of 128, bf16,
pages of 16 tokens: 2 MiB a page over every layer): 256 pages (4,096 tokens, 512 MiB) from consecutive host
slots into device pages that come in runs of 1 to 256 consecutive pages (a fragmented pool hands out short
runs). Each load starts at once (``loads_start_now``), idle or beside a busy compute stream. Reported per
run length, medians: the load's device time (its first copy's start to its last copy's end, CUDA events),
its rate, and the worker's host time to launch it; then one plain copy of the same bytes, the bus's rate.

    source benchmarks/gpu_env.sh && python -m benchmarks.tiers.bench_tier_loads

Writes tier_loads_<device>.md into --out-dir (default benchmarks/results/tiers).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import RESULTS, cuda_8b_kv_cache, cuda_result_file
from radixrelay.protocol.kv import KVTransfers
from radixrelay.worker.kv_tiers import TierStore

PAGES = 256
RUNS = (1, 2, 4, 16, 64, 256)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out-dir", type=Path, default=Path(os.environ.get("OUT") or RESULTS / "tiers"))
    args = ap.parse_args()
    kv = cuda_8b_kv_cache("bench_tier_loads")
    dev = kv.device
    store = TierStore(kv, 2 * PAGES)
    busy_work = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    nbytes = PAGES * store.page_bytes

    def load(run: int, busy: bool) -> tuple[float, float]:
        # host slots 0..255 in order; device pages in runs of ``run``, a gap of ``run`` pages between runs
        pairs = [(i, 4096 + 2 * (i - i % run) + i % run) for i in range(PAGES)]
        torch.cuda.synchronize()
        if busy:
            for _ in range(6):                  # ~10 ms of GEMMs queued on the compute stream
                busy_work @ busy_work
        start = time.perf_counter()
        store.apply(0, KVTransfers(loads=pairs, loads_start_now=True))
        host_s = time.perf_counter() - start
        store.after_forward()
        torch.cuda.synchronize()
        return store.acks(wait=True).load_s, host_s

    for run in RUNS:                            # warm-up
        load(run, False)
    rows = []
    for busy in (False, True):
        for run in RUNS:
            trials = [load(run, busy) for _ in range(args.repeats)]
            device_s = statistics.median(t[0] for t in trials)
            host_s = statistics.median(t[1] for t in trials)
            rows.append((busy, run, device_s, host_s))
            print(f"{'busy' if busy else 'idle'} runs of {run:3d} pages: load {device_s * 1e3:6.2f} ms, "
                  f"{nbytes / device_s / 1e9:5.1f} GB/s, launch {host_s * 1e3:6.2f} ms", flush=True)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(host, device=dev)
    plain = []
    for _ in range(args.repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        dst.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        plain.append(begin.elapsed_time(end) / 1e3)
    plain_s = statistics.median(plain)
    print(f"one copy of the same bytes: {plain_s * 1e3:.2f} ms, {nbytes / plain_s / 1e9:.1f} GB/s")
    out, lines = cuda_result_file(args.out_dir, "tier_loads", "KV tier loads by run length",
                                  "python -m benchmarks.tiers.bench_tier_loads")
    lines += [f"{PAGES} pages ({nbytes >> 20} MiB, Llama-3-8B shapes) from consecutive host slots into device pages in "
              f"runs of the given length; medians of {args.repeats}. Busy: ~10 ms of GEMMs queued on the compute "
              f"stream first. One plain copy of the same bytes: {plain_s * 1e3:.2f} ms "
              f"({nbytes / plain_s / 1e9:.1f} GB/s).", "",
              "| compute stream | run (pages) | load (ms) | GB/s | launch, host (ms) |", "|---|---|---|---|---|"]
    for busy, run, device_s, host_s in rows:
        lines.append(f"| {'busy' if busy else 'idle'} | {run} | {device_s * 1e3:.2f} | "
                     f"{nbytes / device_s / 1e9:.1f} | {host_s * 1e3:.2f} |")
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
