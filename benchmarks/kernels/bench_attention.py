"""Decode attention benchmark: our Triton kernels (flat and cascade) against torch's FlashAttention.

Llama-3-8B attention for one layer (32 query heads, 8 KV heads, head dim 128, bf16), decode (one query
per request); every request shares one prefix and owns a suffix. Columns (ms per layer):

- flat:         our paged decode over each request's whole KV (prefix pages shared in the page table);
- cascade kernels: ours, cascade_decode_attention: shared node (prefix, all queries stacked; on a side
                stream) beside the paged decode of the suffixes, then one merge of all their KV splits;
                the prefix sits on consecutive pages here, so on Hopper with >= 128 folded rows the node
                loads K/V by TMA (v6; scattered pages take the gather path, ~0.05 ms slower at 256 x 16K);
- as planned:   what the engine runs: the cascade where worth_cascading(batch, prefix) says so, else flat;
- FA flat:      torch FlashAttention-2 per request over its own copied KV (GQA folded into the queries);
- FA cascade:   the Hydragen recipe: FA2 over the prefix with all queries stacked, FA2 over the
                suffixes, merge by LSE in torch (ANCHORS.md);
- bytes floor:  KV bytes of prefix once + every suffix at the copy bandwidth measured in this run;
- FLOP floor:   the prefix matmuls (4 * B * Hq * P * D) at the GEMM rate measured in this run.

Every method is captured in a CUDA graph and timed by triton.testing.do_bench (median, L2 flushed
before each replay). Also: paged decode bandwidth, 3-level merge latency, extend attention TFLOP/s.
Writes benchmarks/results/kernels/attention_<device>.md (or --out-dir).

    python -m benchmarks.kernels.bench_attention [--quick] [--sweep] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import triton
from triton.testing import do_bench

from benchmarks.common import RESULTS
from radixrelay.kernels import (cascade_decode_attention, extend_attention, merge_attention_states,
                                paged_decode_attention, plan_cascade, shared_node_attention, worth_cascading)
from radixrelay.bench.provenance import write_device_results
from radixrelay.kernels import extend as extend_mod
from radixrelay.kernels import shared_node as shared_mod
from radixrelay.kernels import paged_decode as decode_mod

HQ, HKV, D, PAGE = 32, 8, 128, 16
GROUP = HQ // HKV
DTYPE = torch.bfloat16
BYTES_PER_TOKEN = HKV * D * 2 * 2                  # K and V, bf16
FA_FLAT_MAX_BYTES = 30e9                           # skip FA flat where its copied KV would not fit
FA = torch.ops.aten._scaled_dot_product_flash_attention


def i32(x) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.int32, device="cuda")


def file_logger(path: str | None):
    """``log(line)`` for the sweep scripts: prints, and rewrites ``path`` (if given) with every line so
    far, so that a run cut short still leaves its table."""
    lines: list[str] = []

    def log(line: str) -> None:
        print(line, flush=True)
        lines.append(line)
        if path:
            with open(path, "w") as f:
                f.write("\n".join(lines) + "\n")
    return log


def time_graph(fn) -> float:
    """Median ms of one replay of ``fn`` captured in a CUDA graph, L2 flushed before each replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()                                        # compile / warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=10, rep=40, return_mode="median")


def measure_ceilings() -> tuple[float, float]:
    """(copy GB/s counting read + write, bf16 GEMM TFLOP/s) on this device."""
    src = torch.randn(2**30 // 2, device="cuda", dtype=DTYPE)                  # 1 GiB
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=10, rep=100, return_mode="median")
    copy_gbs = 2 * src.numel() * 2 / ms / 1e6
    a = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    b = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    ms = do_bench(lambda: a @ b, warmup=10, rep=100, return_mode="median")
    return copy_gbs, 2 * 8192**3 / ms / 1e9


class Case:
    """One grid point: a paged cache holding the prefix (pages 0..P/16) then each request's suffix."""

    def __init__(self, batch: int, prefix: int, suffix: int, shared_splits: int | None = None,
                 cache_dtype: torch.dtype = DTYPE):
        """``cache_dtype``: bf16, or torch.float8_e4m3fn (an FP8 KV cache at scale 1)."""
        self.batch, self.prefix, self.suffix = batch, prefix, suffix
        tokens = prefix + batch * suffix
        self.k_cache = torch.randn((tokens, HKV, D), device="cuda", dtype=DTYPE).to(cache_dtype)
        self.v_cache = torch.randn((tokens, HKV, D), device="cuda", dtype=DTYPE).to(cache_dtype)
        self.q = torch.randn((batch, HQ, D), device="cuda", dtype=DTYPE)
        pp, sp = prefix // PAGE, suffix // PAGE
        own = pp + torch.arange(batch * sp, device="cuda", dtype=torch.int32).view(batch, sp)
        self.prefix_pages = torch.arange(pp, device="cuda", dtype=torch.int32)
        self.page_table = torch.cat([self.prefix_pages.expand(batch, pp), own], dim=1).contiguous()
        self.zeros = i32([0] * batch)
        self.prefix_start = i32([prefix] * batch)
        self.ends = i32([prefix + suffix] * batch)
        self.q_indptr, self.q_rows = i32([0, batch]), torch.arange(batch, dtype=torch.int32, device="cuda")
        self.kv_indptr, self.kv_lens = i32([0, pp]), i32([prefix])
        self.o_parts = torch.empty((batch, 2, HQ, D), device="cuda", dtype=DTYPE)  # level 0 prefix, 1 suffix
        self.lse_parts = torch.empty((batch, 2, HQ), device="cuda", dtype=torch.float32)
        self.merge_indptr = torch.arange(0, 2 * batch + 1, 2, dtype=torch.int32, device="cuda")
        self.part_ids = torch.arange(2 * batch, dtype=torch.int32, device="cuda")
        self.side = torch.cuda.Stream()
        self.plan = plan_cascade(self.q_indptr, self.q_rows, self.kv_indptr, self.prefix_pages, self.kv_lens,
                                 self.page_table, self.prefix_start, self.ends, num_q_heads=HQ, num_kv_heads=HKV,
                                 head_dim=D, page_size=PAGE, shared_splits=shared_splits)

    # ours ---------------------------------------------------------------------------------------
    def flat(self):
        return paged_decode_attention(self.q, self.k_cache, self.v_cache, self.page_table, PAGE, self.zeros,
                                      self.ends, max_kv_len=self.prefix + self.suffix)

    def shared(self, kv_contiguous: bool = False):
        return shared_node_attention(self.q, self.k_cache, self.v_cache, PAGE, self.q_indptr, self.q_rows,
                                     self.kv_indptr, self.prefix_pages, self.kv_lens, max_q_rows=self.batch,
                                     max_kv_len=self.prefix, out=(self.o_parts[:, 0], self.lse_parts[:, 0]),
                                     kv_contiguous=kv_contiguous)

    def suffix_decode(self):
        return paged_decode_attention(self.q, self.k_cache, self.v_cache, self.page_table, PAGE, self.prefix_start,
                                      self.ends, max_kv_len=self.suffix,
                                      out=(self.o_parts[:, 1], self.lse_parts[:, 1]))

    def merge(self):
        return merge_attention_states(self.o_parts.view(2 * self.batch, HQ, D),
                                      self.lse_parts.view(2 * self.batch, HQ), self.merge_indptr, self.part_ids)

    def cascade_separate_apis(self, kv_contiguous: bool = False):
        self.shared(kv_contiguous)
        self.suffix_decode()
        return self.merge()

    def cascade(self):
        return cascade_decode_attention(self.q, self.k_cache, self.v_cache, self.plan, side_stream=self.side)

    def cascade_fa3(self, beside: bool = True):
        """The cascade with the node through FlashAttention-3 (``node_kernel="fa3"``), on the side stream or not."""
        if getattr(self, "plan_fa3", None) is None:
            self.plan_fa3 = plan_cascade(self.q_indptr, self.q_rows, self.kv_indptr, self.prefix_pages, self.kv_lens,
                                         self.page_table, self.prefix_start, self.ends, num_q_heads=HQ,
                                         num_kv_heads=HKV, head_dim=D, page_size=PAGE, node_kernel="fa3")
            assert self.plan_fa3.fa3_splits, "FA3 was not planned"
        return cascade_decode_attention(self.q, self.k_cache, self.v_cache, self.plan_fa3,
                                        side_stream=self.side if beside else None)

    # torch FlashAttention -----------------------------------------------------------------------
    def fa_cascade_inputs(self):
        """Views of our cache in FA's layout: prefix K, V [1, Hkv, P, D]; suffix K, V [B, Hkv, S, D]."""
        p, b, s = self.prefix, self.batch, self.suffix
        pre = [c[:p].unsqueeze(0).transpose(1, 2) for c in (self.k_cache, self.v_cache)]
        suf = [c[p:].view(b, s, HKV, D).transpose(1, 2) for c in (self.k_cache, self.v_cache)]
        return pre, suf

    def fa_cascade(self, inputs):
        (kp, vp), (ks, vs) = inputs
        b = self.batch
        q_stacked = self.q.view(b, HKV, GROUP, D).transpose(0, 1).reshape(1, HKV, b * GROUP, D)
        o1, l1 = FA(q_stacked, kp, vp)[:2]                        # [1, Hkv, B*G, D], [1, Hkv, B*G]
        o2, l2 = FA(self.q.view(b, HKV, GROUP, D), ks, vs)[:2]    # [B, Hkv, G, D], [B, Hkv, G]
        o1 = o1.view(HKV, b, GROUP, D).transpose(0, 1)
        l1 = l1.view(HKV, b, GROUP).transpose(0, 1)
        m = torch.maximum(l1, l2)
        w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
        return (o1 * w1[..., None] + o2 * w2[..., None]) / (w1 + w2)[..., None]

    def fa_flat_bytes(self) -> float:
        return self.batch * (self.prefix + self.suffix) * BYTES_PER_TOKEN

    def fa_flat_inputs(self):
        shape = (self.batch, self.prefix + self.suffix, HKV, D)
        return [torch.randn(shape, device="cuda", dtype=DTYPE).transpose(1, 2) for _ in range(2)]

    def fa_flat(self, kv):
        return FA(self.q.view(self.batch, HKV, GROUP, D), kv[0], kv[1])[0]


def floors(batch: int, prefix: int, suffix: int, copy_gbs: float, tflops: float) -> tuple[float, float]:
    bytes_ms = (prefix + batch * suffix) * BYTES_PER_TOKEN / copy_gbs / 1e6
    flop_ms = 4 * batch * HQ * prefix * D / tflops / 1e9
    return bytes_ms, flop_ms


def run_grid(batches, prefixes, suffixes, copy_gbs, tflops, log) -> list[dict]:
    rows = []
    for batch in batches:
        for prefix in prefixes:
            for suffix in suffixes:
                case = Case(batch, prefix, suffix)
                row = dict(batch=batch, prefix=prefix, suffix=suffix)
                row["flat"] = time_graph(case.flat)
                row["cascade"] = time_graph(case.cascade)
                row["planned"] = row["cascade"] if worth_cascading(batch, prefix) else row["flat"]
                inputs = case.fa_cascade_inputs()
                row["fa_cascade"] = time_graph(lambda: case.fa_cascade(inputs))
                row["fa_flat"] = float("nan")
                if case.fa_flat_bytes() <= FA_FLAT_MAX_BYTES:
                    kv = case.fa_flat_inputs()
                    row["fa_flat"] = time_graph(lambda: case.fa_flat(kv))
                    del kv
                row["bytes_floor"], row["flop_floor"] = floors(batch, prefix, suffix, copy_gbs, tflops)
                rows.append(row)
                log(fmt_row(row))
                del case, inputs
                torch.cuda.empty_cache()
    return rows


GRID_HEADER = ("| batch | prefix | suffix | flat (ms) | cascade kernels (ms) | cascade as planned (ms) | "
               "FA flat (ms) | FA cascade (ms) | bytes floor (ms) | FLOP floor (ms) | planned / FA cascade | "
               "planned / flat |\n|---|---|---|---|---|---|---|---|---|---|---|---|")


def fmt_row(r: dict) -> str:
    fa_flat = "n/a (memory)" if math.isnan(r["fa_flat"]) else f"{r['fa_flat']:.3f}"
    return (f"| {r['batch']} | {r['prefix']:,} | {r['suffix']} | {r['flat']:.3f} | {r['cascade']:.3f} | "
            f"{r['planned']:.3f} | {fa_flat} | {r['fa_cascade']:.3f} | {r['bytes_floor']:.3f} | "
            f"{r['flop_floor']:.3f} | {r['planned'] / r['fa_cascade']:.2f} | {r['planned'] / r['flat']:.2f} |")


def bench_decode_bandwidth(copy_gbs: float, batch: int = 256, tokens: int = 4096, **launch) -> tuple[float, float]:
    """(ms, fraction of copy bandwidth) of paged decode over ``tokens`` unique tokens per request."""
    k = torch.randn((batch * tokens, HKV, D), device="cuda", dtype=DTYPE)
    v = torch.randn_like(k)
    q = torch.randn((batch, HQ, D), device="cuda", dtype=DTYPE)
    pages = torch.randperm(batch * tokens // PAGE, device="cuda").to(torch.int32).view(batch, -1)
    start, end = i32([0] * batch), i32([tokens] * batch)
    if launch:
        o, lse = torch.empty_like(q), torch.empty((batch, HQ), device="cuda")
        fn = lambda: decode_mod._launch(q, k, v, pages, PAGE, start, end, D**-0.5, o, lse, GROUP, tokens,  # noqa
                                        **launch)
    else:
        fn = lambda: paged_decode_attention(q, k, v, pages, PAGE, start, end, max_kv_len=tokens)  # noqa: E731
    ms = time_graph(fn)
    return ms, batch * tokens * BYTES_PER_TOKEN / ms / 1e6 / copy_gbs


def bench_merge(rows: int = 256, levels: int = 3) -> float:
    """us per 3-level merge of rows x 32 heads (parts freshly written, so warm in L2 as in a decode step)."""
    o_parts = torch.randn((levels * rows, HQ, D), device="cuda", dtype=DTYPE)
    lse_parts = torch.randn((levels * rows, HQ), device="cuda")
    indptr = torch.arange(0, levels * rows + 1, levels, dtype=torch.int32, device="cuda")
    ids = torch.arange(levels * rows, dtype=torch.int32, device="cuda")
    reps = 50

    def many():
        for _ in range(reps):
            merge_attention_states(o_parts, lse_parts, indptr, ids)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        many()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        many()
    ms = do_bench(graph.replay, warmup=10, rep=50, return_mode="median")
    return ms / reps * 1e3


def bench_extend(batch: int = 8, new: int = 4096, prefix: int = 4096, **launch) -> tuple[float, float]:
    """(ms, TFLOP/s on the causal work done) of extend attention, batch x new tokens over a cached prefix."""
    total = prefix + new
    k = torch.randn((batch * total, HKV, D), device="cuda", dtype=DTYPE)
    v = torch.randn_like(k)
    q = torch.randn((batch * new, HQ, D), device="cuda", dtype=DTYPE)
    table = torch.randperm(batch * total // PAGE, device="cuda").to(torch.int32).view(batch, -1)
    q_indptr = torch.arange(0, batch * new + 1, new, dtype=torch.int32, device="cuda")
    kv_start, prefix_lens = i32([0] * batch), i32([prefix] * batch)
    if launch:
        o, lse = torch.empty_like(q), torch.empty((batch * new, HQ), device="cuda")
        fn = lambda: extend_mod._launch(q, k, v, table, PAGE, q_indptr, kv_start, prefix_lens, D**-0.5, o,  # noqa
                                        lse, GROUP, new, **launch)
    else:
        fn = lambda: extend_attention(q, k, v, table, PAGE, q_indptr, kv_start, prefix_lens,  # noqa: E731
                                      max_new_tokens=new)
    ms = time_graph(fn)
    keys = batch * (new * prefix + new * (new + 1) // 2)           # (query, key) pairs attended
    return ms, 4 * HQ * D * keys / ms / 1e9


def resource_report(jit_fn) -> list[str]:
    """One line per compiled specialisation of a Triton kernel (best effort: Triton's cache layout)."""
    try:
        compiled = jit_fn.device_caches[torch.cuda.current_device()][0].values()
        return [f"- {jit_fn.__name__}: {k.n_regs} registers, {k.n_spills} spills, {k.metadata.shared} B shared, "
                f"{k.metadata.num_warps} warps" for k in compiled]
    except Exception as exc:  # noqa: BLE001 - diagnostics only
        return [f"- {jit_fn.__name__}: no report ({type(exc).__name__}: {exc})"]


def bench_page_layouts(log, batch: int = 256, prefix: int = 16384, suffix: int = 256, pieces: int = 4) -> None:
    """The cascade at one point with the shared prefix's pages laid out several ways (the same KV set,
    so the same output): one run of consecutive ids (TMA on Hopper), ``pieces`` runs in one group
    (gathered), the same runs split into one group each (``cascade.batch.split_at_page_breaks``; TMA
    per piece), a random permutation (gathered)."""
    case = Case(batch, prefix, suffix)
    pp = prefix // PAGE
    run = pp // pieces
    dev = dict(dtype=torch.int32, device="cuda")
    in_runs = torch.cat([torch.arange(i * run, (i + 1) * run, **dev) for i in reversed(range(pieces))])
    scattered = torch.randperm(pp, generator=torch.Generator().manual_seed(0)).to(**dev)
    rows = torch.arange(batch, **dev)
    layouts = [
        ("one run of consecutive pages", case.q_indptr, rows, case.kv_indptr, case.prefix_pages, case.kv_lens, True),
        (f"{pieces} runs, one group (gathered)", case.q_indptr, rows, case.kv_indptr, in_runs, case.kv_lens, False),
        (f"{pieces} runs, split into {pieces} groups", i32([g * batch for g in range(pieces + 1)]),
         rows.repeat(pieces), i32([g * run for g in range(pieces + 1)]), in_runs, i32([run * PAGE] * pieces), True),
        ("random page order (gathered)", case.q_indptr, rows, case.kv_indptr, scattered, case.kv_lens, False),
    ]
    log(f"\n## Page layout of the shared prefix, {batch} x {prefix} x {suffix}\n")
    log("| layout | node loads | ms | rel diff vs one run |\n|---|---|---|---|")
    ref = None
    for name, q_indptr, q_rows, kv_indptr, kv_pages, kv_lens, contiguous in layouts:
        plan = plan_cascade(q_indptr, q_rows, kv_indptr, kv_pages, kv_lens, case.page_table, case.prefix_start,
                            case.ends, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=PAGE,
                            kv_contiguous=contiguous)
        def fn(plan=plan):
            return cascade_decode_attention(case.q, case.k_cache, case.v_cache, plan, side_stream=case.side)
        out = fn()[0].float()
        ref = out if ref is None else ref
        diff = float((out - ref).norm() / ref.norm())
        log(f"| {name} | {'TMA' if plan.kv_tma else 'gather'} | {time_graph(fn):.4f} | {diff:.1e} |")


def sweep(log, copy_gbs: float) -> None:
    """Tile configurations of each kernel at the points that matter (for choosing the defaults)."""
    log("\n## Sweep: cascade, shared-node split count (ms; auto count in parentheses)\n")
    log("| batch | prefix | suffix | auto | S=1 | S=2 | S=4 | S=8 | separate APIs, 5 launches |\n"
        "|---|---|---|---|---|---|---|---|---|")
    for batch, prefix, suffix in [(256, 16384, 256), (64, 8192, 256), (16, 1024, 128), (16, 2048, 1024),
                                  (512, 8192, 128), (256, 2048, 1024)]:
        cells = []
        for splits in (None, 1, 2, 4, 8):
            case = Case(batch, prefix, suffix, shared_splits=splits)
            auto = f" ({case.plan.shared_splits})" if splits is None else ""
            cells.append(f"{time_graph(case.cascade):.3f}{auto}")
        cells.append(f"{time_graph(case.cascade_separate_apis):.3f}")
        del case
        log(f"| {batch} | {prefix} | {suffix} | " + " | ".join(cells) + " |")
    log("\n## Compiled kernels: registers, spills, shared memory\n")
    for fn in (shared_mod._shared_node_kernel, decode_mod._paged_decode_kernel, extend_mod._extend_kernel):
        for line in resource_report(fn):
            log(line)
    log("\n## Sweep: paged decode, 256 x 4K unique tokens\n")
    log("| BLOCK_N | warps | stages | ms | of copy bw |\n|---|---|---|---|---|")
    for block_n in (32, 64, 128):
        for warps in (4, 8):
            for stages in (2, 3, 4):
                try:
                    ms, frac = bench_decode_bandwidth(copy_gbs, block_n=block_n, num_warps=warps,
                                                      num_stages=stages)
                except Exception as exc:  # noqa: BLE001
                    log(f"| {block_n} | {warps} | {stages} | failed: {type(exc).__name__} | |")
                    continue
                log(f"| {block_n} | {warps} | {stages} | {ms:.3f} | {frac:.0%} |")
    log("\n## Sweep: extend, 8 x 4K new over 4K prefix\n")
    log("| BLOCK_M, BLOCK_N, warps, stages | ms | TFLOP/s |\n|---|---|---|")
    for bm, bn, warps, stages in [(128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3),
                                  (128, 32, 4, 4), (64, 128, 4, 2)]:
        try:
            ms, tf = bench_extend(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
        except Exception as exc:  # noqa: BLE001
            log(f"| {(bm, bn, warps, stages)} | failed: {type(exc).__name__} | |")
            continue
        log(f"| {(bm, bn, warps, stages)} | {ms:.3f} | {tf:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few grid points only")
    parser.add_argument("--sweep", action="store_true", help="also sweep tile configurations")
    parser.add_argument("--no-grid", action="store_true", help="skip the decode grid")
    parser.add_argument("--out-dir", default=str(RESULTS / "kernels"))
    args = parser.parse_args()

    name = torch.cuda.get_device_name()
    lines: list[str] = []

    def log(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    t0 = time.time()
    copy_gbs, tflops = measure_ceilings()
    log(f"# Attention benchmark on {name}\n")
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    log(f"torch {torch.__version__}, triton {triton.__version__}, {stamp}. "
        f"Llama-3-8B layer: {HQ} query heads, {HKV} KV heads, head dim {D}, bf16, page size {PAGE}.")
    log(f"Measured ceilings: copy {copy_gbs:,.0f} GB/s (read + write), bf16 8192^3 GEMM {tflops:.0f} TFLOP/s.\n")

    ms, frac = bench_decode_bandwidth(copy_gbs)
    log(f"- paged decode, 256 x 4K unique tokens: {ms:.3f} ms, {frac:.0%} of copy bandwidth (target >= 80%)")
    log(f"- merge, 3 levels, 256 rows x 32 heads x 128: {bench_merge():.1f} us (target < 10 us)")
    ms, tf = bench_extend()
    log(f"- extend, 8 x 4K new over 4K cached prefix: {ms:.3f} ms, {tf:.0f} TFLOP/s on the causal work "
        "(target >= 250)")
    bench_page_layouts(log)
    if args.sweep:
        sweep(log, copy_gbs)
    if not args.no_grid:
        log("\n## Decode grid (ms per layer)\n")
        log(GRID_HEADER)
        if args.quick:
            run_grid([64, 256], [2048, 16384], [256], copy_gbs, tflops, log)
            run_grid([16, 512], [8192], [128], copy_gbs, tflops, log)
        else:
            run_grid([16, 64, 256, 512], [1024, 2048, 8192, 16384, 32768], [128, 256, 1024], copy_gbs, tflops,
                     log)
    log(f"\n(bench wall time {time.time() - t0:.0f} s)")
    print(f"wrote {write_device_results(args.out_dir, 'attention', name, lines)}")


if __name__ == "__main__":
    main()
