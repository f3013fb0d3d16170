"""No Triton compilation after the start-up warm-up: warm the attention kernels for Llama-3-8B shapes, then
drive ~200 random serving-like steps through the TritonBackend and count the kernel variants that still
entered the process (must be 0).

    python -m benchmarks.kernels.gpu_jit_check [--calls 200] [--seed 0] [--budget 300]
    python -m benchmarks.kernels.gpu_jit_check --cpu-smoke        # tiny shapes, TRITON_INTERPRET=1, on the CPU

Steps (one attention layer, bf16, page size 16; 32 query heads, 8 KV heads, head dim 128): flat decode
batches of 1-256 requests up to 20K tokens, extend chunks (1-2048 new tokens after a cached prefix) mixed
with decodes, decode cascades of 1-3 shared nodes (consecutive pages: TMA on Hopper, or scattered), prefill
cascades (extends sharing a cached run), page tables of every width. Plain text lines; the last one says
PASS or FAIL. Exit status 1 on FAIL.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

if "--cpu-smoke" in sys.argv:        # before triton is imported anywhere
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from radixrelay.attention.factory import make_backend  # noqa: E402
from radixrelay.attention.kv_cache import KVCache  # noqa: E402
from radixrelay.attention.metadata import (BatchRequest, SharedRun, build_forward_batch,  # noqa: E402
                                           build_shared_runs)
from radixrelay.kernels import jit_counter  # noqa: E402
from radixrelay.worker.warmup import AttentionDims, warm_up_kernels  # noqa: E402


class Shape:
    def __init__(self, smoke: bool) -> None:
        if smoke:
            self.dims, self.page_size, self.dtype = AttentionDims(4, 2, 16), 4, torch.float16
            self.max_batch, self.max_seq, self.max_chunk, self.max_node = 6, 96, 40, 48
        else:
            self.dims, self.page_size, self.dtype = AttentionDims(32, 8, 128), 16, torch.bfloat16
            self.max_batch, self.max_seq, self.max_chunk, self.max_node = 256, 20_000, 2048, 16_384
        self.max_pages = -(-(self.max_seq + self.max_chunk) // self.page_size)
        self.num_pages = 4 * self.max_pages


def log_int(rng: random.Random, lo: int, hi: int) -> int:
    """An int in [lo, hi], log-uniform (small and large values alike)."""
    return min(hi, max(lo, int(round(2 ** rng.uniform(lo.bit_length() - 1, hi.bit_length())))))


class Steps:
    """Random serving-like steps; page ids are arbitrary (the check is about launches, not values)."""

    def __init__(self, shape: Shape, device: torch.device, seed: int) -> None:
        self.s, self.device, self.rng = shape, device, random.Random(seed)

    def pages(self, tokens: int, contiguous: bool = True):
        count = -(-max(tokens, 1) // self.s.page_size)
        if contiguous:
            base = self.rng.randrange(0, self.s.num_pages - count + 1)
            return range(base, base + count)
        return [self.rng.randrange(self.s.num_pages) for _ in range(count)]

    def make(self, kind: str):
        """(ForwardBatch, q) for one step of ``kind``."""
        rng, s = self.rng, self.s
        num_ext = rng.randint(1, 4) if "extend" in kind else 0
        num_dec = log_int(rng, 1, s.max_batch) if "decode" in kind else 0
        prefill_run = None
        if "prefill-cascade" in kind:
            num_ext = max(num_ext, 2)
            prefill_run = log_int(rng, 1, s.max_node)
        requests, kv_start = [], []
        for _ in range(num_ext):
            chunk = log_int(rng, 1, s.max_chunk)
            prefix = rng.randint(prefill_run or 0, s.max_seq)
            requests.append(BatchRequest(self.pages(prefix + chunk), prefix, chunk))
            kv_start.append(prefill_run or 0)
        groups = self.decode_groups(num_dec) if "decode-cascade" in kind else []
        shared = [0] * num_dec
        for rows, tokens, _ in groups:
            for b in rows:
                shared[b] += tokens
        for b in range(num_dec):
            seq = shared[b] + log_int(rng, 1, s.max_seq)
            requests.append(BatchRequest(self.pages(seq), seq - 1, 1))
            kv_start.append(shared[b])
        decode_runs = build_shared_runs([SharedRun(rows, pages, tokens) for rows, tokens, pages in groups],
                                        self.device)
        prefill_runs = None
        if prefill_run is not None:
            members = rng.sample(range(num_ext), rng.randint(2, num_ext))
            starts = [0]
            for r in requests[:num_ext]:
                starts.append(starts[-1] + r.num_new)
            rows = [t for i in sorted(members) for t in range(starts[i], starts[i + 1])]
            for i in range(num_ext):
                if i not in members:
                    kv_start[i] = 0
            prefill_runs = build_shared_runs([SharedRun(rows, self.pages(prefill_run, rng.random() < 0.5),
                                                        prefill_run)], self.device)
        cascade = decode_runs is not None or prefill_runs is not None
        batch = build_forward_batch(requests, s.page_size, self.device, num_decodes=num_dec,
                                    kv_start=kv_start if cascade else None, decode_runs=decode_runs,
                                    prefill_runs=prefill_runs)
        q = torch.zeros((batch.num_tokens, s.dims.num_q_heads, s.dims.head_dim), dtype=s.dtype, device=self.device)
        return batch, q

    def decode_groups(self, num_dec: int):
        """1-3 shared nodes: a root over most requests, children over subsets; (rows, tokens, pages)."""
        rng = self.rng
        groups = []
        for g in range(rng.randint(1, 3)):
            size = num_dec if g == 0 and rng.random() < 0.7 else rng.randint(1, num_dec)
            rows = sorted(rng.sample(range(num_dec), size))
            tokens = log_int(rng, 1, self.s.max_node)
            groups.append((rows, tokens, self.pages(tokens, contiguous=rng.random() < 0.6)))
        return groups


KINDS = ("decode", "decode-cascade", "extend", "extend+decode", "extend+decode-cascade",
         "extend-prefill-cascade", "extend-prefill-cascade+decode-cascade")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    parser.add_argument("--calls", type=int, default=None, help="random steps after the warm-up (200; smoke: 20)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget", type=float, default=300.0, help="warm-up time budget, seconds")
    args = parser.parse_args()
    smoke = args.cpu_smoke
    calls = args.calls if args.calls is not None else (20 if smoke else 200)
    device = torch.device("cpu" if smoke else "cuda")
    if not smoke and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU machine, or with --cpu-smoke")
        return 2
    import triton

    shape = Shape(smoke)
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu (interpreter)'}; "
          f"torch {torch.__version__}, triton {triton.__version__}")
    print(f"shape: {shape.dims}, {str(shape.dtype).removeprefix('torch.')}, page size {shape.page_size}, "
          f"{shape.num_pages} pages")
    print(f"counter installed: {jit_counter.install()}; variants before warm-up: {jit_counter.variants()}")
    kv_cache = KVCache(num_layers=1, num_pages=shape.num_pages, page_size=shape.page_size,
                       num_kv_heads=shape.dims.num_kv_heads, head_dim=shape.dims.head_dim, dtype=shape.dtype,
                       device=device)
    backend = make_backend("triton", device)

    report = warm_up_kernels(shape.dims, kv_cache, backend, time_budget_s=args.budget)
    print(f"warm-up: {report.summary()}")
    for error in report.errors:
        print(f"warm-up error: {error}")
    again = warm_up_kernels(shape.dims, kv_cache, backend, time_budget_s=args.budget)
    print(f"warm-up again: {again.summary()}")

    ready = jit_counter.counts()
    steps = Steps(shape, device, args.seed)
    per_kind = dict.fromkeys(KINDS, 0)
    start = time.perf_counter()
    failures = []
    with torch.inference_mode():
        for i in range(calls):
            kind = steps.rng.choice(KINDS)
            batch, q = steps.make(kind)
            at = jit_counter.counts()
            try:
                backend.forward_with_lse(q, 0, kv_cache, batch)
            except Exception as exc:  # noqa: BLE001 - reported, the check goes on
                failures.append(f"call {i} ({kind}): {type(exc).__name__}: {exc}")
            per_kind[kind] += 1
            new = jit_counter.counts() - at
            if new.variants:
                print(f"call {i} ({kind}, {batch.num_requests} requests, {batch.num_tokens} tokens, max seq "
                      f"{batch.max_seq_len}): {new.variants} new variant(s): "
                      + " | ".join(jit_counter.recent()[-new.variants:]))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    after = jit_counter.counts() - ready
    print(f"serving calls: {calls} in {time.perf_counter() - start:.1f} s ("
          + ", ".join(f"{k} {n}" for k, n in per_kind.items()) + ")")
    for failure in failures:
        print(f"error: {failure}")
    print(f"warm-up time: {report.seconds:.1f} s, {report.jit.variants} variants "
          f"({report.jit.compilations} compiled, {report.jit.cache_loads} from the disk cache, "
          f"{report.jit.compile_s:.1f} s in triton.compile)")
    print(f"compilations after warm-up: {after.compilations} (new variants {after.variants}, "
          f"disk-cache loads {after.cache_loads})")
    ok = after.variants == 0 and report.complete and not failures and again.jit.variants == 0
    print("RESULT: " + ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
