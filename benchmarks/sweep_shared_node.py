"""Sweep of shared-node kernel variants at the headline point, in one device call (H100 / H200).

1. The shared-node kernel alone (256 requests x 4 heads = 1,024 folded rows per KV head, node 16K):
   tile configs (BLOCK_M, BLOCK_N, warps, stages) x KV split counts, TFLOP/s on the node's matmuls,
   K/V gathered through the page list and (the node's pages being consecutive ids, as in
   bench_attention) by TMA (``kv_contiguous``, Hopper).
2. The whole cascade (node on a side stream + suffix decode + merge) at 256 x 16K x 256: the gather
   default against the TMA path with several configs and split counts.
3. The gather default against the TMA path (default config and the best other one) at other grid points.

Version 1 of this script (git history / attention.md v6) also timed 9 gather configs and a stand-alone
TMA kernel with and without ``tl.range(..., warp_specialize=True)`` (no effect on sm_90, triton 3.6).

Every figure: CUDA-graph replay, ``triton.testing.do_bench`` median, L2 flushed (bench_attention.time_graph).

    python benchmarks/sweep_shared_node.py [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import triton

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

import bench_attention as ba  # noqa: E402
from radixrelay.kernels import cascade_decode_attention, plan_cascade  # noqa: E402
from radixrelay.kernels import shared_node as sn  # noqa: E402
from radixrelay.kernels.merge import merge_splits  # noqa: E402

GATHER = [(64, 64, 4, 3), (128, 128, 8, 3)]
TMA = [(64, 64, 4, 3), (64, 64, 4, 4), (128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 4), (64, 128, 4, 2)]


def node_fn(case, config, splits, contiguous):
    """The node kernel alone into a [B, S, Hq, D] fp32 buffer (no merge)."""
    b, p = case.batch, case.prefix
    o_dst = torch.empty((b, splits, ba.HQ, ba.D), device="cuda", dtype=torch.float32)
    lse_dst = torch.empty((b, splits, ba.HQ), device="cuda", dtype=torch.float32)
    chunk = triton.cdiv(triton.cdiv(p, splits), config[1]) * config[1]
    m_tiles = triton.cdiv(b * ba.GROUP, config[0])
    fn = lambda: sn.launch_splits(case.q, case.k_cache, case.v_cache, ba.PAGE, case.q_indptr, case.q_rows,  # noqa
                                  case.kv_indptr, case.prefix_pages, case.kv_lens, ba.D ** -0.5, o_dst, lse_dst,
                                  ba.GROUP, m_tiles, chunk, config, contiguous)
    return fn, o_dst, lse_dst


def merged(o_dst, lse_dst):
    o = torch.empty(o_dst.shape[0], ba.HQ, ba.D, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(o_dst.shape[0], ba.HQ, device="cuda")
    merge_splits(o_dst, lse_dst, o, lse)
    return o.float(), lse


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def cascade_ms(case, config=None, splits=None, tma=True) -> tuple[float, int, bool]:
    plan = plan_cascade(case.q_indptr, case.q_rows, case.kv_indptr, case.prefix_pages, case.kv_lens,
                        case.page_table, case.prefix_start, case.ends, num_q_heads=ba.HQ, num_kv_heads=ba.HKV,
                        head_dim=ba.D, page_size=ba.PAGE, shared_splits=splits, shared_config=config, allow_tma=tma)
    ms = ba.time_graph(lambda: cascade_decode_attention(case.q, case.k_cache, case.v_cache, plan,
                                                        side_stream=case.side))
    return ms, plan.shared_splits, plan.kv_tma


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    log = ba.file_logger(args.out)

    t0 = time.time()
    log(f"# Shared-node sweep on {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"triton {triton.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")
    case = ba.Case(256, 16384, 256)
    flop = 4 * 256 * ba.HQ * 16384 * ba.D
    ref = None
    log("## Node kernel alone, 256 x 16K (no merge)\n\n| loads | config | S | ms | TFLOP/s | rel err vs first |\n"
        "|---|---|---|---|---|---|")
    for contiguous, configs in ((False, GATHER), (True, TMA)):
        for config in configs:
            for splits in (2, 4):
                try:
                    fn, o_dst, lse_dst = node_fn(case, config, splits, contiguous)
                    fn()
                    out = merged(o_dst, lse_dst)
                    ref = out if ref is None else ref
                    err = rel(out[0], ref[0])
                    ms = ba.time_graph(fn)
                except Exception as exc:  # noqa: BLE001
                    log(f"| {'TMA' if contiguous else 'gather'} | {config} | {splits} | failed: "
                        f"{type(exc).__name__}: {str(exc)[:150]} | | |")
                    continue
                log(f"| {'TMA' if contiguous else 'gather'} | {config} | {splits} | {ms:.4f} | "
                    f"{flop / ms / 1e9:.0f} | {err:.1e} |")
    try:
        for r in sn._shared_node_kernel.device_caches[torch.cuda.current_device()][0].values():
            log(f"- node kernel: {r.n_regs} regs, {r.n_spills} spills, {r.metadata.shared} B shared, "
                f"{r.metadata.num_warps} warps")
    except Exception as exc:  # noqa: BLE001
        log(f"- no resource report: {exc}")
    log(f"\n(node sweep done at {time.time() - t0:.0f} s)\n")

    log("## Cascade 256 x 16K x 256 (node on side stream)\n\n| loads | config | S | ms |\n|---|---|---|---|")
    base_ms, base_s, _ = cascade_ms(case, tma=False)
    log(f"| gather | default | {base_s} (auto) | {base_ms:.4f} |")
    casc = {}
    for config in TMA:
        for splits in (None, 2, 4):
            try:
                ms, s, used = cascade_ms(case, config, splits)
            except Exception as exc:  # noqa: BLE001
                log(f"| TMA | {config} | {splits} | failed: {type(exc).__name__}: {str(exc)[:150]} |")
                continue
            if splits is not None and s in [k[1] for k in casc if k[0] == config]:
                continue
            casc[(config, s)] = ms
            log(f"| {'TMA' if used else 'gather?!'} | {config} | {s}{' (auto)' if splits is None else ''} | "
                f"{ms:.4f} |")
    ms, s, used = cascade_ms(case)
    log(f"| {'TMA' if used else 'gather'} | default | {s} (auto) | {ms:.4f} |")
    ms, s, _ = cascade_ms(case, tma=False)
    log(f"| gather | default again (noise) | {s} (auto) | {ms:.4f} |")
    del case
    torch.cuda.empty_cache()
    log(f"\n(cascade sweep done at {time.time() - t0:.0f} s)\n")

    best = min(casc, key=casc.get)[0] if casc else None
    cands = [None] + ([best] if best and best != sn.tile_config(1024, True) else [])
    log(f"## Other grid points: gather default vs TMA (default config, best config {best}), auto splits\n")
    log("| batch | prefix | suffix | gather ms (S) | TMA default ms (S) | " +
        " | ".join(f"TMA {c} ms (S)" for c in cands[1:]) + " |")
    log("|---|---|---|---|---|" + "---|" * (len(cands) - 1))
    for batch, prefix, suffix in [(256, 16384, 256), (256, 16384, 128), (256, 8192, 256), (512, 8192, 128),
                                  (64, 8192, 256), (16, 32768, 128), (64, 16384, 256), (256, 32768, 256),
                                  (16, 1024, 128), (256, 2048, 1024), (64, 2048, 256)]:
        case = ba.Case(batch, prefix, suffix)
        cells = []
        for tma, c in [(False, None)] + [(True, c) for c in cands]:
            try:
                ms, s, _ = cascade_ms(case, c, tma=tma)
                cells.append(f"{ms:.4f} ({s})")
            except Exception as exc:  # noqa: BLE001
                cells.append(f"failed {type(exc).__name__}")
        log(f"| {batch} | {prefix} | {suffix} | " + " | ".join(cells) + " |")
        del case
        torch.cuda.empty_cache()
    log(f"\n(sweep wall time {time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
