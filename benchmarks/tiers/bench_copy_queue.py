"""Does a step's small copy wait behind a KV tier copy on another stream? (CUDA)

A KV tier save (device -> host) or load (host -> device) moves hundreds of MB to GB on its own stream while
the steps go on; a step moves a few KB each way (its inputs up, its sampled tokens down). If the copy engine
serves copies of one direction in the order they were queued, whatever their streams, the step's few KB wait
for the tier's copy. This measures, for each pair (large copy on a side stream, small copy on the compute
stream), how long the small one takes from its launch to its completion, alone and behind the large one, and
the same small transfer done by a kernel through pinned host memory (unified addressing: no copy engine):

    large D2H | small D2H   (a save | sampled tokens: why ``kernels/host_copy.py`` exists)
    large H2D | small H2D   (a load | the next step's inputs, ``kernels/host_staging.py``)
    large D2H | small H2D, large H2D | small D2H   (the other direction: separate engines?)

    source benchmarks/gpu_env.sh && python -m benchmarks.tiers.bench_copy_queue [--large-mib 1536]

Writes copy_queue_<device>.md into --out-dir (default benchmarks/results/tiers).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from benchmarks.common import RESULTS, cuda_result_file

SMALL = 4096            # int64 elements (32 KB): a step's inputs or outputs


@triton.jit
def _move(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=ok), mask=ok)


def _kernel_move(src: torch.Tensor, dst: torch.Tensor) -> None:
    n = src.numel()
    _move[(triton.cdiv(n, 1024),)](src, dst, n, BLOCK=1024)


class Bench:
    def __init__(self, large_mib: int) -> None:
        self.dev = torch.device("cuda")
        nbytes = large_mib << 20
        self.large_dev = torch.empty(nbytes, dtype=torch.uint8, device=self.dev)
        self.large_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.small_dev = torch.arange(SMALL, dtype=torch.int64, device=self.dev)
        self.small_host = torch.empty(SMALL, dtype=torch.int64, pin_memory=True)
        self.side = torch.cuda.Stream(self.dev)
        self.main = torch.cuda.current_stream(self.dev)

    def _large(self, direction: str) -> torch.cuda.Event:
        with torch.cuda.stream(self.side):
            if direction == "D2H":
                self.large_host.copy_(self.large_dev, non_blocking=True)
            else:
                self.large_dev.copy_(self.large_host, non_blocking=True)
        done = torch.cuda.Event()
        done.record(self.side)
        return done

    def _small(self, direction: str, by: str) -> None:
        if direction == "D2H":
            if by == "copy":
                self.small_host.copy_(self.small_dev, non_blocking=True)
            else:
                _kernel_move(self.small_dev, self.small_host)
        elif by == "copy":
            self.small_dev.copy_(self.small_host, non_blocking=True)
        else:
            _kernel_move(self.small_host, self.small_dev)

    def trial(self, large: str | None, small: str, by: str) -> tuple[float, float | None]:
        """(ms from the small transfer's launch to its completion, ms until the large one completed)."""
        torch.cuda.synchronize(self.dev)
        done = self._large(large) if large is not None else None
        if done is not None:
            time.sleep(0.002)                 # the large copy is under way
        start = time.perf_counter()
        self._small(small, by)
        event = torch.cuda.Event()
        event.record(self.main)
        event.synchronize()
        small_ms = (time.perf_counter() - start) * 1e3
        large_ms = None
        if done is not None:
            done.synchronize()
            large_ms = (time.perf_counter() - start) * 1e3
        return small_ms, large_ms


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--large-mib", type=int, default=1536, help="the tier copy (1.5 GiB: a 12K-token prompt at 8B)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out-dir", type=Path, default=Path(os.environ.get("OUT") or RESULTS / "tiers"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_copy_queue: needs a CUDA device")
    bench = Bench(args.large_mib)
    for direction in ("D2H", "H2D"):         # warm-up: the kernel compiles, the copies' paths are set up
        for by in ("copy", "kernel"):
            bench.trial(direction, direction, by)
    rows = []
    for large in (None, "D2H", "H2D"):
        for small in ("D2H", "H2D"):
            for by in ("copy", "kernel"):
                runs = [bench.trial(large, small, by) for _ in range(args.repeats)]
                small_ms = statistics.median(r[0] for r in runs)
                large_ms = statistics.median(r[1] for r in runs) if large is not None else None
                rows.append((large or "none", small, by, small_ms, large_ms))
                print(f"large {large or 'none':4} | small {small} by {by:6}: {small_ms:7.2f} ms"
                      + (f" (large done after {large_ms:.1f} ms)" if large_ms is not None else ""), flush=True)
    out, lines = cuda_result_file(args.out_dir, "copy_queue", "A step's small copy beside a KV tier copy",
                                  f"python -m benchmarks.tiers.bench_copy_queue --large-mib {args.large_mib}")
    lines += [f"A large copy ({args.large_mib} MiB, pinned host memory) on a side stream, launched 2 ms before a small "
              f"transfer ({SMALL * 8 // 1024} KB) on the compute stream, done by a copy or by a kernel through pinned "
              f"memory; medians of {args.repeats}: milliseconds from the small transfer's launch to its completion.", "",
              "| large copy | small transfer | by | small done after (ms) | large done after (ms) |",
              "|---|---|---|---|---|"]
    for large, small, by, small_ms, large_ms in rows:
        lines.append(f"| {large} | {small} | {by} | {small_ms:.2f} | {'-' if large_ms is None else f'{large_ms:.1f}'} |")
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
