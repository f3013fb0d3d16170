"""FP8 products against bf16 on the GPU: Llama-3-8B's four decoder projections per row count.

Per projection and row count (bf16 activations [rows, in], weights [out, in]):
  bf16       ``F.linear`` (cuBLAS), the model dtype's product;
  scaled_mm  ``torch._scaled_mm`` alone: inputs already e4m3 with their per-token scales, weights e4m3 per
             output channel (cuBLAS FP8, fp32 accumulation, bf16 out);
  split_k    ``kernels.fp8_gemm.fp8_split_k`` alone, inputs already e4m3 (where the device runs it: Hopper;
             ``-`` where K is not in whole splits);
  Fp8Linear  what ``--quantization fp8`` runs: the input's per-token quantization, then the product (split-K
             where its rule admits the rows and the shape, else ``torch._scaled_mm``).
Each is timed from CUDA-graph replays (a graph of ``CALLS`` calls cycling over ``COPIES`` weight copies, so
the weights come from memory, not L2: 3 untimed replays, then the median of ``--replays``), microseconds
per call. The last rows sum the four projections per layer and multiply by 32 layers: the products of one
decode step. Also checked: Fp8Linear's output against bf16's (relative Frobenius error).

    python -m benchmarks.kernels.bench_fp8_gemm [--rows 1,16,32,64,128,256,512] [--replays 20] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys

import torch
import torch.nn.functional as F

from benchmarks.common import RESULTS, ROOT
from radixrelay.kernels.graph_timing import graph_replay_seconds
from radixrelay.bench.provenance import source_commit, write_device_results
from radixrelay.kernels.fp8_gemm import BLOCK_K, SPLIT, fp8_split_k, split_k_capable
from radixrelay.model.quantization import Fp8Linear, token_scales

PROJECTIONS = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
LAYERS = 32
CALLS = 16
COPIES = 4


def _time(ops, replays: int) -> float:
    """Median microseconds per call of ``ops`` (a list of callables, called in turn) from graph replays."""
    def body() -> None:
        for i in range(CALLS):
            ops[i % len(ops)]()

    return statistics.median(graph_replay_seconds(body, replays)) * 1e6 / CALLS


def measure(rows: int, k: int, n: int, replays: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(rows + n)
    x = torch.randn(rows, k, generator=gen, device="cuda").bfloat16()
    weights = [(torch.randn(n, k, generator=gen, device="cuda") * 0.02).bfloat16() for _ in range(COPIES)]
    layers = []
    for w in weights:
        layer = Fp8Linear(k, n, dtype=torch.bfloat16, device="cuda")
        layer.load_rows(0, w)
        layers.append(layer)
    s_x = token_scales(x)
    q_x = (x.float() / s_x).clamp(-448, 448).to(torch.float8_e4m3fn)
    want = F.linear(x, weights[0]).float()
    got = layers[0](x).float()
    err = ((got - want).norm() / want.norm()).item()
    bf16 = [lambda w=w: F.linear(x, w) for w in weights]
    scaled = [lambda m=m: torch._scaled_mm(q_x, m.weight.t(), scale_a=s_x, scale_b=m.weight_scale[None, :],
                                             out_dtype=torch.bfloat16) for m in layers]
    fp8 = [lambda m=m: m(x) for m in layers]
    split = float("nan")
    if split_k_capable(x.device) and k % (SPLIT * BLOCK_K) == 0:
        split = _time([lambda m=m: fp8_split_k(q_x, s_x, m.weight, m.weight_scale, torch.bfloat16) for m in layers],
                      replays)
    return {"bf16": _time(bf16, replays), "scaled_mm": _time(scaled, replays), "split_k": split,
            "fp8": _time(fp8, replays), "err": err, "takes_split_k": layers[0].split_k(rows)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=lambda s: [int(v) for v in s.split(",")], default=[1, 16, 32, 64, 128, 256, 512])
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--out-dir", default=os.environ.get("OUT") or str(RESULTS / "kernels"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fp8_gemm: needs a CUDA device", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(0)
    lines = [f"# FP8 products against bf16, Llama-3-8B projections ({name})", "",
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; commit {source_commit(ROOT)}; torch "
             f"{torch.__version__}. Command: `python -m benchmarks.kernels.bench_fp8_gemm {' '.join(sys.argv[1:])}`", "",
             "Microseconds per call, the median of CUDA-graph replays (weights cycled over "
             f"{COPIES} copies: read from memory). scaled_mm: the FP8 product alone (inputs already e4m3); split_k: "
             "the split-K product alone (kernels/fp8_gemm.py; * where Fp8Linear takes it); Fp8Linear: the per-token "
             "quantization of the input included. Error: Fp8Linear against bf16 (relative, Frobenius).",
             "", "| rows | projection | in -> out | bf16 us | scaled_mm us | split_k us | Fp8Linear us | "
             "Fp8Linear / bf16 | scaled_mm / bf16 | error |", "|---|---|---|---|---|---|---|---|---|---|"]
    for rows in args.rows:
        total = {"bf16": 0.0, "scaled_mm": 0.0, "fp8": 0.0}
        split_total = 0.0
        for proj, (k, n) in PROJECTIONS.items():
            r = measure(rows, k, n, args.replays)
            for key in total:
                total[key] += r[key]
            ran = not math.isnan(r["split_k"])                     # the shape's K is in whole splits
            split_total += min(r["split_k"], r["scaled_mm"]) if ran else r["scaled_mm"]
            split = f"{r['split_k']:.1f}{'*' if r['takes_split_k'] else ''}" if ran else "-"
            lines.append(f"| {rows} | {proj} | {k} -> {n} | {r['bf16']:.1f} | {r['scaled_mm']:.1f} | {split} | "
                         f"{r['fp8']:.1f} | {r['fp8'] / r['bf16']:.2f} | {r['scaled_mm'] / r['bf16']:.2f} | "
                         f"{r['err']:.4f} |")
            print(lines[-1], flush=True)
        lines.append(f"| {rows} | **32 layers** | | {total['bf16'] * LAYERS / 1e3:.2f} ms | "
                     f"{total['scaled_mm'] * LAYERS / 1e3:.2f} ms | {split_total * LAYERS / 1e3:.2f} ms (the faster "
                     f"of the two each) | {total['fp8'] * LAYERS / 1e3:.2f} ms | {total['fp8'] / total['bf16']:.2f} | "
                     f"{total['scaled_mm'] / total['bf16']:.2f} | |")
    print(f"wrote {write_device_results(args.out_dir, 'fp8_gemm', name, lines)}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
