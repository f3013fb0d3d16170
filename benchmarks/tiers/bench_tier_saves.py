"""Host cost of KV tier saves beside a busy device (CUDA): what a worker pays per step to save pages.

Drives the real pair: ``KVTiers`` (the scheduler's slot allocation and eviction, acknowledged as the
worker reports) and ``TierStore`` (the worker's copies) over a Llama-3-8B-shaped KV cache (32 layers,
8 KV heads of 128, bf16, pages of 16 tokens). Each step ``--requests`` requests leave, each saving a
shared 128-page prefix (host memory has it after the first) and 12 pages of its own on scattered
device pages (decode pages); then the "forward" runs: 8 bf16 GEMMs of 8192^3 on the compute stream
(~12 ms on an H100), and a small result copy. Over several passes of the host pool (``--host-pages``)
it reports, per window of steps: the host time of ``TierStore.apply`` + ``after_forward`` (the launch
of the saves), the forward's device time, how long the result copy waited behind the saves, and the
most saves pending on the copy stream.

    source benchmarks/gpu_env.sh && python -m benchmarks.tiers.bench_tier_saves

Results: benchmarks/results/HISTORY.md (KV tier saves at saturation, 2026-11-24).
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np
import torch

from benchmarks.common import cuda_8b_kv_cache
from radixrelay.radix.tiers import KVTiers
from radixrelay.worker.kv_tiers import TierStore


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--host-pages", type=int, default=4096, help="host slots (2 MiB each)")
    ap.add_argument("--requests", type=int, default=4, help="requests leaving per step")
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    kv = cuda_8b_kv_cache("bench_tier_saves.py")
    dev = kv.device
    store = TierStore(kv, args.host_pages)
    tiers = KVTiers(args.host_pages, policy="scheduler")
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    res_dev = torch.zeros(512, dtype=torch.int64, device=dev)
    res_host = torch.empty(512, dtype=torch.int64, pin_memory=True)
    prefix = [b"p%d" % i for i in range(128)]
    rng = random.Random(0)
    rid, rows, pending = 0, [], None
    for step in range(args.steps):
        for _ in range(args.requests):
            rid += 1
            keys = prefix + [b"r%d.%d" % (rid, j) for j in range(12)]
            tiers.save(keys, list(range(128)) + rng.sample(range(200, 8192), 12))
        transfers = tiers.take(step)
        h0 = time.perf_counter()
        if transfers is not None:
            store.apply(step, transfers)
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(8):
            a @ a
        store.after_forward()
        h1 = time.perf_counter()
        fwd_done = torch.cuda.Event(enable_timing=True)
        fwd_done.record()
        res_host.copy_(res_dev, non_blocking=True)
        res_done = torch.cuda.Event(enable_timing=True)
        res_done.record()
        if pending is not None:
            host_s, p_start, p_fwd, p_res = pending
            p_res.synchronize()
            rows.append((host_s, p_start.elapsed_time(p_fwd), p_fwd.elapsed_time(p_res), len(store._saves)))
        pending = (h1 - h0, start, fwd_done, res_done)
        acks = store.acks(wait=False)
        if acks is not None:
            tiers.on_acks(acks)
    window = max(1, len(rows) // 8)
    print(f"{torch.cuda.get_device_name()}: {args.requests} requests x 12 pages saved per step, host pool "
          f"{args.host_pages} pages (one pass ~{args.host_pages // (12 * args.requests)} steps)")
    for i in range(0, len(rows), window):
        r = np.array(rows[i:i + window])
        print(f"steps {i:4d}-{i + len(r) - 1:4d}: save launch ms p50 {1e3 * np.median(r[:, 0]):6.2f} "
              f"p90 {1e3 * np.percentile(r[:, 0], 90):6.2f} | forward ms {np.median(r[:, 1]):5.2f} | "
              f"result copy wait ms max {r[:, 2].max():.3f} | saves pending max {r[:, 3].max():.0f}")
    store.close()


if __name__ == "__main__":
    main()
