"""A shared node's attention against the fastest attention kernels torch ships, and the device's GEMM rate.

Grid (a) of the live-cascade targets asks the cascade to reach 0.85 of the no-attention ceiling at 8K x
256 (32 layers), which leaves its attention ~1.5 ms a step: 34.4 GFLOP a layer (256 queries x 32 heads
over an 8K prefix, Q.K^T and P.V) at ~733 TFLOP/s. This measures, per layer, at Llama-3-8B attention
shapes (32 query heads, 8 KV heads, head dim 128, bf16): our shared-node kernel alone, gathering K/V
page by page and loading consecutive pages by TMA (what serving runs when a node's pages are consecutive,
as the allocator gives a prefix computed at once), and the whole cascade (node beside the suffix decode,
then the merge: what a step runs), against torch's cuDNN attention and FlashAttention-2 over the same
node (all queries of a KV head stacked as one sequence, K/V as strided views of the paged cache and as
contiguous copies) and, where the ``fa3_fwd`` wheel is importable, FlashAttention-3 (the requests as one
sequence of queries against the node's K/V viewed in the cache, GQA native, its split heuristic), each
captured in a CUDA graph and timed with the L2 flushed (``bench_attention.time_graph``); and the device's
dense bf16 GEMM rate (8192^3). Writes ``attention_rates_<device>.md``.

    python -m benchmarks.kernels.bench_node_attention [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import RESULTS
from benchmarks.kernels.bench_attention import D, GROUP, HKV, HQ, Case, measure_ceilings, time_graph
from radixrelay.bench.provenance import write_device_results

try:    # FlashAttention-3, forward only (``pip install fa3_fwd``, Hopper)
    from fa3_fwd_interface import flash_attn_func as FA3
except ImportError:
    FA3 = None
CUDNN = torch.ops.aten._scaled_dot_product_cudnn_attention
FLASH = torch.ops.aten._scaled_dot_product_flash_attention
SHAPES = ((256, 8192), (256, 16384), (128, 8192))
SUFFIX = 256


def measure(batch: int, prefix: int) -> dict[str, float]:
    """ms per layer of each method at ``batch`` requests over a ``prefix``-token node."""
    case = Case(batch, prefix, SUFFIX)
    q = case.q.view(batch, HKV, GROUP, D).transpose(0, 1).reshape(1, HKV, batch * GROUP, D)   # stacked rows
    k_view, v_view = [c[:prefix].unsqueeze(0).transpose(1, 2) for c in (case.k_cache, case.v_cache)]
    k_copy, v_copy = k_view.contiguous(), v_view.contiguous()
    k_rows, v_rows = (c[:prefix].unsqueeze(0) for c in (case.k_cache, case.v_cache))   # [1, P, Hkv, D] views
    q_rows = case.q.unsqueeze(0)                                                       # [1, B, Hq, D]
    methods = {
        "ours: shared node, K/V gathered by page": case.shared,
        "ours: shared node, consecutive pages by TMA": lambda: case.shared(kv_contiguous=True),
        f"ours: cascade (node + {SUFFIX}-token suffixes + merge)": case.cascade,
        "ours: node (TMA), then suffixes, then merge, one stream": lambda: case.cascade_separate_apis(True),
        "cuDNN, K/V views of the cache": lambda: CUDNN(q, k_view, v_view, None, True, 0.0, False, False),
        "cuDNN, contiguous K/V": lambda: CUDNN(q, k_copy, v_copy, None, True, 0.0, False, False),
        "FlashAttention-2, K/V views": lambda: FLASH(q, k_view, v_view),
        "FlashAttention-2, contiguous K/V": lambda: FLASH(q, k_copy, v_copy),
    }
    if FA3 is not None:
        methods["FlashAttention-3 (fa3_fwd), K/V views, split heuristic"] = \
            lambda: FA3(q_rows, k_rows, v_rows, num_splits=0, return_attn_probs=True)
        methods["ours: cascade, node through FA3 (varlen, --node-kernel fa3), beside the suffixes"] = case.cascade_fa3
        methods["ours: cascade, node through FA3, then suffixes, one stream"] = lambda: case.cascade_fa3(False)
    fp8 = Case(batch, prefix, SUFFIX, cache_dtype=torch.float8_e4m3fn)     # the same shapes over an FP8 KV cache
    methods["ours: shared node, K/V gathered by page, FP8 KV cache"] = fp8.shared
    methods["ours: shared node, consecutive pages by TMA, FP8 KV cache"] = lambda: fp8.shared(kv_contiguous=True)
    methods[f"ours: cascade (node + {SUFFIX}-token suffixes + merge), FP8 KV cache"] = fp8.cascade
    plan = case.plan
    print(f"{batch} x {prefix}: cascade plan: node by TMA {plan.kv_tma}, node splits {plan.shared_splits}, "
          f"own splits {plan.own_splits}", flush=True)
    out = {}
    for name, fn in methods.items():
        try:
            out[name] = time_graph(fn)
        except Exception as exc:                  # a backend this torch build lacks: reported, not fatal
            print(f"{name}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
            out[name] = float("nan")
    del case, fp8
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default=str(RESULTS / "kernels"))
    args = ap.parse_args()
    copy_gbs, gemm_tflops = measure_ceilings()
    name = torch.cuda.get_device_name()
    lines = [f"# A shared node's attention vs torch's attention kernels ({name})", "",
             f"torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Command: "
             f"`python -m benchmarks.kernels.bench_node_attention`. Per layer, Llama-3-8B attention shapes (bf16), "
             "CUDA graphs, L2 flushed before each replay. Dense bf16 GEMM on this device (8192^3): "
             f"**{gemm_tflops:.0f} TFLOP/s**; copy {copy_gbs:.0f} GB/s.", "",
             "| requests x node tokens | method | us per layer | node TFLOP/s |", "|---|---|---|---|"]
    for batch, prefix in SHAPES:
        flop = 4 * batch * HQ * prefix * D
        for method, ms in measure(batch, prefix).items():
            lines.append(f"| {batch} x {prefix} | {method} | {ms * 1e3:.1f} | {flop / ms / 1e9:.0f} |")
            print(lines[-1], flush=True)
    print(f"wrote {write_device_results(args.out_dir, 'attention_rates', name, lines)}")


if __name__ == "__main__":
    main()
