"""How the shared-node kernel and the own-KV decode share the GPU in the cascade, at 256 x 16K x 256.

The cascade runs the tensor-core-bound node kernel on a side stream beside the memory-bound suffix
decode; the decode can only use a multiprocessor that still has registers and shared memory left
next to the node's programs. This sweep times the whole cascade (node + decode + merge, one CUDA graph)
for node tile configs x decode launch configs x launch order, K/V of the node by TMA (consecutive pages)
and gathered, and prints each compiled kernel's registers and shared memory, so that the pairs which
fit on one multiprocessor can be read off. Also: each kernel alone, and node then decode in sequence.

    python benchmarks/sweep_cascade_overlap.py [--out FILE] [--batch 256 --prefix 16384 --suffix 256]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch
import triton

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

import bench_attention as ba  # noqa: E402
from radixrelay.kernels import paged_decode, plan_cascade  # noqa: E402
from radixrelay.kernels import shared_node as sn  # noqa: E402
from radixrelay.kernels.merge import launch_merge  # noqa: E402

# node: ((BLOCK_M, BLOCK_N, warps, stages), maxnreg)
NODE_TMA = [((128, 64, 8, 3), None), ((128, 64, 8, 3), 168), ((128, 64, 8, 3), 152), ((128, 64, 8, 3), 128),
            ((64, 64, 4, 3), None)]
NODE_GATHER = [((64, 64, 4, 3), None), ((64, 64, 4, 3), 168)]
# own-KV decode beside the node: (BLOCK_N, warps, stages, maxnreg)
DECODE = [(64, 4, 3, 128), (128, 4, 2, 128), (128, 4, 3, 128), (128, 4, 2, 96), (64, 4, 2, 96),
          (128, 8, 2, 64), (256, 4, 1, 128), (128, 4, 1, 128)]
ORDERS = ("node first",)   # decode first lost at every point in the first run (H200)
# merge: (BLOCK_H, warps)
MERGE = [(None, 4), (1, 1), (2, 1), (4, 2), (8, 4), (8, 2), (16, 4), (32, 4)]


class Runner:
    """One case's buffers and plan; ``fn(...)`` builds the cascade for a node / decode config."""

    def __init__(self, case: ba.Case, tma: bool, node, splits=None):
        node_cfg, self.maxnreg = node
        self.case = case
        self.plan = plan_cascade(case.q_indptr, case.q_rows, case.kv_indptr, case.prefix_pages, case.kv_lens,
                                 case.page_table, case.prefix_start, case.ends, num_q_heads=ba.HQ,
                                 num_kv_heads=ba.HKV, head_dim=ba.D, page_size=ba.PAGE, shared_config=node_cfg,
                                 shared_splits=splits, allow_tma=tma)
        p, b = self.plan, case.batch
        rows = p.q_rows.numel()
        self.shared_parts = rows * p.shared_splits
        self.o_parts = torch.empty((self.shared_parts + b * p.own_splits, ba.HQ, ba.D), dtype=torch.float32,
                                   device="cuda")
        self.lse_parts = torch.empty(self.o_parts.shape[:2], dtype=torch.float32, device="cuda")
        self.o = torch.empty_like(case.q)
        self.lse = torch.empty((b, ba.HQ), dtype=torch.float32, device="cuda")
        self.kernels = {}

    def node(self):
        p, c = self.plan, self.case
        rows = p.q_rows.numel()
        self.kernels["node"] = sn.launch_splits(
            c.q, c.k_cache, c.v_cache, p.page_size, p.q_indptr, p.q_rows, p.kv_indptr, p.kv_pages, p.kv_lens,
            ba.D ** -0.5, self.o_parts[:self.shared_parts].view(rows, p.shared_splits, ba.HQ, ba.D),
            self.lse_parts[:self.shared_parts].view(rows, p.shared_splits, ba.HQ), p.group, p.m_tiles,
            p.shared_chunk, p.shared_config, p.kv_tma, self.maxnreg)

    def decode(self, dec):
        p, c = self.plan, self.case
        block_n, warps, stages, maxnreg = dec
        self.kernels["decode"] = paged_decode.launch_splits(
            c.q, c.k_cache, c.v_cache, p.page_table, p.page_size, p.kv_start, p.kv_end, ba.D ** -0.5,
            self.o_parts[self.shared_parts:].view(c.batch, p.own_splits, ba.HQ, ba.D),
            self.lse_parts[self.shared_parts:].view(c.batch, p.own_splits, ba.HQ), p.group, p.own_chunk,
            block_n=block_n, num_warps=warps, num_stages=stages, maxnreg=maxnreg)

    def merge(self, block_h=None, warps=4):
        launch_merge(self.o_parts, self.lse_parts, self.plan.merge_indptr, self.plan.merge_part_ids, self.o,
                     self.lse, 0, block_h, warps)

    def cascade(self, dec, order="node first", overlap=True):
        def fn():
            main = torch.cuda.current_stream()
            if not overlap:
                self.node()
                self.decode(dec)
            else:
                self.case.side.wait_stream(main)
                if order == "decode first":
                    self.decode(dec)
                with torch.cuda.stream(self.case.side):
                    self.node()
                if order == "node first":
                    self.decode(dec)
                main.wait_stream(self.case.side)
            self.merge()
        return fn


def resources(kernel) -> str:
    try:
        return f"{kernel.n_regs} regs, {kernel.metadata.shared // 1024} KB smem, {kernel.metadata.num_warps} warps"
    except Exception as exc:  # noqa: BLE001
        return f"? ({type(exc).__name__})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prefix", type=int, default=16384)
    parser.add_argument("--suffix", type=int, default=256)
    args = parser.parse_args()
    log = ba.file_logger(args.out)

    t0 = time.time()
    log(f"# Cascade overlap sweep on {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
        f"{triton.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")
    case = ba.Case(args.batch, args.prefix, args.suffix)
    ref = None

    log(f"## Kernels alone, {args.batch} x {args.prefix} x {args.suffix}\n\n| kernel | config | ms | resources |\n"
        "|---|---|---|---|")
    for tma, configs in ((True, NODE_TMA), (False, NODE_GATHER)):
        for cfg in configs:
            r = Runner(case, tma, cfg)
            ms = ba.time_graph(r.node)
            log(f"| node {'TMA' if r.plan.kv_tma else 'gather'} S={r.plan.shared_splits} | {cfg} | {ms:.4f} | "
                f"{resources(r.kernels['node'])} |")
    r = Runner(case, True, (None, None))
    for dec in DECODE:
        ms = ba.time_graph(lambda: r.decode(dec))  # noqa: B023
        log(f"| decode S={r.plan.own_splits} | {dec} | {ms:.4f} | {resources(r.kernels['decode'])} |")
    for block_h, warps in MERGE:
        ms = ba.time_graph(lambda: r.merge(block_h, warps))  # noqa: B023
        log(f"| merge {r.o_parts.shape[0]} parts -> {case.batch} rows | BLOCK_H {block_h}, {warps} warps | "
            f"{ms:.4f} | |")
    log(f"\n({time.time() - t0:.0f} s)\n")

    log("## Cascade\n\n| node loads | node (config, maxnreg) | S | decode (BLOCK_N, warps, stages, maxnreg) | "
        "order | ms | "
        "rel err |\n|---|---|---|---|---|---|---|")
    results = []
    for tma, configs in ((True, NODE_TMA), (False, NODE_GATHER)):
        for cfg in configs:
            r = Runner(case, tma, cfg)
            for dec, order in itertools.product(DECODE, ORDERS):
                try:
                    fn = r.cascade(dec, order)
                    fn()
                    out = r.o.float()
                    ref = out.clone() if ref is None else ref
                    err = float((out - ref).norm() / ref.norm())
                    ms = ba.time_graph(fn)
                except Exception as exc:  # noqa: BLE001
                    log(f"| {tma} | {cfg} | | {dec} | {order} | failed {type(exc).__name__}: {str(exc)[:120]} | |")
                    continue
                results.append((ms, tma, cfg, dec, order))
                log(f"| {'TMA' if r.plan.kv_tma else 'gather'} | {cfg} | {r.plan.shared_splits} | {dec} | {order} | "
                    f"{ms:.4f} | {err:.1e} |")
            ms = ba.time_graph(r.cascade(DECODE[0], overlap=False))
            log(f"| {'TMA' if r.plan.kv_tma else 'gather'} | {cfg} | {r.plan.shared_splits} | {DECODE[0]} | "
                f"sequence | {ms:.4f} | |")
    log(f"\n({time.time() - t0:.0f} s)\n")

    log("## Best per node loads, then other split counts\n\n| node loads | node config | S | decode | order | ms |\n"
        "|---|---|---|---|---|---|")
    for tma in (True, False):
        cands = sorted((x for x in results if x[1] == tma), key=lambda x: x[0])[:3]
        for ms, _, cfg, dec, order in cands:
            log(f"| {'TMA' if tma else 'gather'} | {cfg} | auto | {dec} | {order} | {ms:.4f} |")
        if cands:
            _, _, cfg, dec, order = cands[0]
            for splits in (1, 2, 3, 4, 6):
                r = Runner(case, tma, cfg, splits)
                log(f"| {'TMA' if tma else 'gather'} | {cfg} | {r.plan.shared_splits} | {dec} | {order} | "
                    f"{ba.time_graph(r.cascade(dec, order)):.4f} |")
    log(f"\n(wall time {time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
