"""Own-KV decode tiles beside the shared node: the production cascade (``cascade_decode_attention`` with a
side stream) timed per shape for several own-KV launch options (``cascade.OWN_BESIDE`` patched per column).
Where the node is light (a 2K system prompt) the own-KV decode has the GPU most of the layer, and short own
ranges favour small tiles; beside a 16K node the larger tiles fit next to the node's programs better.

    python benchmarks/sweep_own_tiles.py [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

import torch  # noqa: E402

import bench_attention as ba  # noqa: E402
from radixrelay.kernels import cascade as cm  # noqa: E402

# name: paged_decode launch options (BLOCK_N / warps / stages / register cap)
CONFIGS = {"64/4/2/96": dict(block_n=64, num_stages=2, maxnreg=96),
           "32/4/2/96": dict(block_n=32, num_stages=2, maxnreg=96),
           "32/2/2": dict(block_n=32, num_warps=2, num_stages=2),
           "32/4/3": dict(block_n=32, num_stages=3),
           "16/2/2": dict(block_n=16, num_warps=2, num_stages=2)}
# (batch, shared prefix tokens, own tokens per request)
SHAPES = [(256, 2048, 64), (256, 2048, 160), (256, 2048, 256), (256, 2048, 512), (256, 2048, 1024),
          (256, 16384, 256), (64, 2048, 160), (128, 4096, 256), (16, 8192, 256)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    log = ba.file_logger(args.out)
    log(f"# Own-KV tiles beside the shared node, {torch.cuda.get_device_name()}: us per layer\n")
    log("| batch x prefix x suffix | " + " | ".join(CONFIGS) + " |")
    log("|" + "---|" * (len(CONFIGS) + 1))
    default = cm.OWN_BESIDE
    try:
        for b, p, s in SHAPES:
            case = ba.Case(b, p, s)
            row, ref = [], None
            for cfg in CONFIGS.values():
                cm.OWN_BESIDE = cfg
                plan = dataclasses.replace(case.plan, light_nodes=False)      # own KV in OWN_BESIDE, as patched
                fn = lambda: cm.cascade_decode_attention(case.q, case.k_cache, case.v_cache, plan,  # noqa: B023,E731
                                                         side_stream=case.side)
                o, _ = fn()
                ref = o.float() if ref is None else ref
                err = float((o.float() - ref).norm() / ref.norm())
                if err > 1e-2:
                    raise AssertionError(f"{cfg}: relative error {err:.1e} against the first config")
                row.append(ba.time_graph(fn))
            best = min(row)
            log(f"| {b} x {p} x {s} (own splits {case.plan.own_splits}) | " + " | ".join(
                f"{1e3 * t:.1f}{'*' if t == best else ''}" for t in row) + " |")
            del case
            torch.cuda.empty_cache()
    finally:
        cm.OWN_BESIDE = default


if __name__ == "__main__":
    main()
