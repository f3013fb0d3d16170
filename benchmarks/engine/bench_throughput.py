"""Offline decode throughput with shared prefixes, end to end through the worker (Hydragen's setup).

Llama-3-8B shapes (32 query heads, 8 KV heads, head dim 128, hidden 4096, MLP 14336, vocab 128256), dummy
bf16 weights, ``--layers`` decoder layers (default 4: the attention share per layer is what matters; the
LM head and host work weigh a little more than in the 32-layer model). Every request decodes
``--output`` tokens (EOS ignored) through ``ModelRunner.step``: StepPlan -> cascade plan -> batch ->
model (CUDA graph per batch bucket) -> greedy sampling -> token ids back to the host, as the serving
loop runs it. The prompts' KV is taken as already computed (random values in the pages a radix cache
would hold), so the numbers are decode throughput, not prefill.

Workloads:
  (a) one shared prefix {1K, 2K, 8K, 16K} x batch {32, 64, 128, 256, 512}, each request 16 own prompt tokens;
  (b) two levels: 2K few-shot prefix -> 32 problems of 512 tokens -> 16 samples each (512 requests);
  (c) a 20K-token document -> 256 questions of 32 tokens;
  (t) the serving benchmark's tree: 2K prefix -> 16 problems of 256 tokens -> 16 samples each (256 requests).
Modes:
  no-cache   every request holds its own copy of the prefix KV, flat attention;
  flat       radix cache: prefix pages shared, flat attention (each request reads them);
  cascade    radix cache, cascade planned by the engine's planner (--cascade auto: the cost model
             decides, the default; on: every shared node);
  no-attn    the radix layout with attention skipped: the ceiling.
Columns: tokens/s over the timed steps (after --warmup steps), ms per step, the share of step time in
attention (1 - no-attn time / mode time), throughput over the ceiling (Hydragen's "fraction of the
no-attention throughput"), cascade over flat, groups per step / levels, CUDA graphs captured.

With ``--tp N`` (N GPUs of one host, one process per GPU, NCCL, NVLink multicast off): every rank runs the
same steps on its slice of the model (``TensorParallel``, all-reduces by ``PeerAllReduce`` as serving
picks them); rank 0 times them and writes ``throughput_tp<N>_<device>.md``.

    python -m benchmarks.engine.bench_throughput [--layers 4] [--output 128] [--quick] [--only abc] [--cascade auto|on]
                                          [--modes no-cache,flat,cascade,no-attn] [--tp N] [--quantization fp8]
                                          [--kv-cache-dtype fp8] [--out-dir DIR]

Mode ``cascade-fa3`` (beside ``cascade``) runs the shared nodes through FlashAttention-3 (``--node-kernel fa3``;
needs the ``fa3_fwd`` wheel on Hopper).
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
import time
from dataclasses import dataclass

import torch

from benchmarks.common import LLAMA3_SHAPES, RESULTS
from radixrelay.attention import AttentionBackend, KVCache
from radixrelay.attention.triton_backend import TritonBackend
from radixrelay.cascade.planner import make_cascade_planner
from radixrelay.kernels.fa3_node import resolve_node_kernel
from radixrelay.model import ModelConfig, load_model
from radixrelay.model.quantization import Precision
from radixrelay.protocol.cascade import DecodeRow, PathSegment
from radixrelay.protocol.step import AdmittedRequest, StepPlan
from radixrelay.sampling_params import SamplingParams
from radixrelay.worker.cuda_graphs import DecodeGraphs
from radixrelay.worker.model_runner import ModelRunner

PAGE = 16
MODES = ("no-cache", "flat", "cascade", "no-attn")   # also cascade-fa3: shared nodes through FlashAttention-3


def llama3(shape: str, layers: int) -> ModelConfig:
    """Llama-3 ``shape`` ("8b" or "70b") with ``layers`` decoder layers."""
    hidden, mlp, heads, kv_heads, _ = LLAMA3_SHAPES[shape]
    return ModelConfig(architecture="llama", vocab_size=128256, hidden_size=hidden, intermediate_size=mlp,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=128, rope_theta=500000.0,
                       max_position_embeddings=32768)


@dataclass(frozen=True)
class Workload:
    name: str
    levels: tuple[tuple[int, int], ...]   # (node tokens, children per node) root first; leaves = requests
    own_prompt: int                       # private prompt tokens of each request

    @property
    def num_requests(self) -> int:
        return math.prod(fan for _, fan in self.levels)

    @property
    def shared_tokens(self) -> int:
        return sum(tokens for tokens, _ in self.levels)


def workloads(quick: bool, smoke: bool = False) -> list[Workload]:
    if smoke:
        return [Workload("(a) 64 x 4", ((64, 4),), 4), Workload("(b) 32 -> 2 x 16 -> 2", ((32, 2), (16, 2)), 4)]
    prefixes = (1024, 8192) if quick else (1024, 2048, 8192, 16384)
    batches = (64, 256) if quick else (32, 64, 128, 256, 512)
    return [Workload("(b) 2K -> 32 x 512 -> 16", ((2048, 32), (512, 16)), 16),
            Workload("(t) 2K -> 16 x 256 -> 16", ((2048, 16), (256, 16)), 16),
            Workload("(c) 20K doc x 256 q", ((20480, 256),), 32),
            *(Workload(f"(a) {p // 1024}K x {b}", ((p, b),), 16) for p in prefixes for b in batches)]


class NoAttention(AttentionBackend):
    """The ceiling: attention skipped (o = q), everything else as in a real step."""

    def forward(self, q, layer_id, kv_cache, batch):
        return q

    def bind(self, batch, kv_start, decode_plan) -> None:   # DecodeGraphs' hook; nothing to plan
        pass


@dataclass
class Layout:
    pages: list[list[int]]            # per request
    paths: list[list[PathSegment]]    # per request: shared nodes, root first (radix modes)
    num_pages: int


def layout(w: Workload, output: int, shared: bool) -> Layout:
    """Pages of every request: each radix node's pages once (``shared``), or every request its own copy
    of everything (no prefix cache)."""
    next_page = 0
    ids = itertools.count(1)
    pages: list[list[int]] = []
    paths: list[list[PathSegment]] = []

    def alloc(tokens: int) -> list[int]:
        nonlocal next_page
        next_page += math.ceil(tokens / PAGE)
        return list(range(next_page - math.ceil(tokens / PAGE), next_page))

    def node(level: int, prefix_pages: list[int], path: list[PathSegment], start: int) -> None:
        tokens, fan = w.levels[level]
        mine = prefix_pages + alloc(tokens) if shared else []
        path = path + [PathSegment(next(ids), start, tokens)]
        for _ in range(fan):
            if level + 1 < len(w.levels):
                node(level + 1, mine, path, start + tokens)
            elif shared:
                pages.append(mine + alloc(w.own_prompt + output))
                paths.append(path)
            else:
                pages.append(alloc(w.shared_tokens + w.own_prompt + output))
                paths.append([])

    node(0, [], [], 0)
    return Layout(pages, paths, next_page)


@dataclass
class Result:
    tokens_per_s: float
    ms_per_step: float
    groups: int = 0
    levels: int = 0
    captures: int = 0
    launch_ms: float = 0.0      # host time of ModelRunner.launch per step (plan diff, batch, replay, sampling)


def _finished(launched) -> None:
    out = launched.finish()
    if out.error:
        raise RuntimeError(out.error)


def _everywhere(ok: bool, model) -> bool:
    """``ok`` on every rank (each rank checks its own memory; they must agree or a rank waits forever)."""
    if not model.tp.enabled:
        return ok
    import torch.distributed as dist

    flag = torch.tensor([int(ok)], device=next(model.parameters()).device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def kv_bytes(cfg: ModelConfig, num_pages: int, itemsize: int = 2) -> int:
    return 2 * cfg.num_layers * num_pages * PAGE * cfg.num_kv_heads * cfg.head_dim * itemsize


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(model, w: Workload, mode: str, output: int, warmup: int, graphs: bool,
        cascade_mode: str = "auto") -> Result | None:
    cfg = model.local_config                 # this rank's KV heads (the whole model's at tp=1)
    param = next(model.parameters())
    device = param.device
    lay = layout(w, output, shared=mode != "no-cache")
    itemsize = 1 if model.precision.kv == "fp8" else 2
    if not _everywhere(device.type != "cuda"
                       or kv_bytes(cfg, lay.num_pages + 1, itemsize) <= 0.85 * torch.cuda.mem_get_info()[0], model):
        return None
    dtype = model.model.embed_tokens.weight.dtype              # the model's (its FP8 weights are not)
    kv = KVCache(num_layers=cfg.num_layers, num_pages=lay.num_pages + 1, page_size=PAGE,
                 num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=model.precision.cache_dtype(dtype),
                 device=device, model_dtype=dtype)
    for t in kv.k + kv.v:
        t.copy_(torch.randn(t.shape, device=device, dtype=dtype))
    backend = (NoAttention() if mode == "no-attn"
               else TritonBackend(node_kernel=resolve_node_kernel("fa3", device) if mode == "cascade-fa3" else "triton"))
    planner = make_cascade_planner(cascade_mode if mode.startswith("cascade") else "off", PAGE)
    max_pages = max(len(p) for p in lay.pages)
    decode_graphs = (DecodeGraphs(model, kv, backend, max_batch=w.num_requests, max_pages=max_pages,
                                  scratch_slot=lay.num_pages * PAGE) if graphs else None)
    runner = ModelRunner(model, kv, backend, graphs=decode_graphs)
    prompt_len = w.shared_tokens + w.own_prompt
    params = SamplingParams(max_tokens=output, temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    admitted = [AdmittedRequest(rid, torch.randint(0, cfg.vocab_size, (prompt_len,), generator=gen).tolist(),
                                prompt_len, pages, params) for rid, pages in enumerate(lay.pages)]
    rids = list(range(w.num_requests))
    t0 = None
    launch_s = 0.0
    previous = None     # overlap, as the worker serves: step N+1 is launched before N's tokens are read
    for step in range(output):
        if step == warmup:
            if previous is not None:
                _finished(previous)
                previous = None
            sync(device)
            t0 = time.perf_counter()
        cascade = None
        if planner is not None:
            cascade = planner([DecodeRow(rid, lay.paths[rid], prompt_len + step) for rid in rids])
        start = time.perf_counter()
        launched = runner.launch(StepPlan(step, admitted=admitted if step == 0 else [], decodes=rids,
                                          cascade=cascade))
        if step >= warmup:
            launch_s += time.perf_counter() - start
        if previous is not None:
            _finished(previous)
        previous = launched
    _finished(previous)
    sync(device)
    elapsed = time.perf_counter() - t0
    steps = output - warmup
    counters = planner.counters if planner is not None else None
    result = Result(w.num_requests * steps / elapsed, 1e3 * elapsed / steps,
                    captures=decode_graphs.captures if decode_graphs else 0, launch_ms=1e3 * launch_s / steps)
    if counters is not None and counters.cascade_steps:
        result.groups = counters.groups // counters.cascade_steps
        result.levels = counters.max_levels
    del runner, decode_graphs, kv
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(LLAMA3_SHAPES), default="8b", help="Llama-3 shapes")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--output", type=int, default=128, help="decode steps (tokens per request)")
    ap.add_argument("--warmup", type=int, default=8, help="untimed first steps (graph capture, compilation)")
    ap.add_argument("--quick", action="store_true", help="a 2 x 2 corner of grid (a) plus (b) and (c)")
    ap.add_argument("--no-graphs", action="store_true", help="eager decode steps")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--cascade", default="auto", choices=("auto", "on"), help="planner mode of the cascade rows")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of every mode, interleaved (mode order rotates); the median run is reported")
    ap.add_argument("--only", default="", help="workload letters to run, e.g. 'bc' (default: all)")
    ap.add_argument("--smoke", action="store_true", help="tiny model and workloads on the CPU (TRITON_INTERPRET=1)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (GPUs of this host)")
    ap.add_argument("--quantization", default=None, choices=("fp8",), help="FP8 linear layers (--quantization fp8)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"), help="an FP8 KV cache")
    ap.add_argument("--out-dir", default=str(RESULTS / "engine"))
    args = ap.parse_args()
    if args.tp > 1:
        _spawn_ranks(args)
        return
    _bench(args, None)


def _spawn_ranks(args: argparse.Namespace) -> None:
    import tempfile

    import torch.multiprocessing as mp

    if torch.cuda.device_count() < args.tp:
        raise SystemExit(f"bench_throughput: --tp {args.tp} needs {args.tp} GPUs, {torch.cuda.device_count()} visible")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")                  # no NVLink multicast
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_main, args=(args, f"file://{tmp}/rendezvous"), nprocs=args.tp, join=True)


def _rank_main(rank: int, args: argparse.Namespace, init: str) -> None:
    import torch.distributed as dist

    from radixrelay.model.parallel import PeerAllReduce, TensorParallel
    from radixrelay.worker.worker_process import SYMMETRIC_ALL_REDUCE_BYTES

    torch.cuda.set_device(rank)
    device = torch.device(f"cuda:{rank}")
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=args.tp, device_id=device)
    fast = PeerAllReduce.create(None, device, torch.bfloat16, SYMMETRIC_ALL_REDUCE_BYTES)
    _bench(args, TensorParallel(rank, args.tp, fast=fast))
    dist.destroy_process_group()


def _bench(args: argparse.Namespace, tp) -> None:
    rank = tp.rank if tp is not None else 0
    if args.smoke:
        device, cfg = "cpu (smoke)", ModelConfig(architecture="llama", vocab_size=256, hidden_size=64,
                                                intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2,
                                                head_dim=16)
        model, _ = load_model(cfg, device="cpu", dtype=torch.float32)
    else:
        device, cfg = torch.cuda.get_device_name(), llama3(args.shape, args.layers)
        model, _ = load_model(cfg, device=f"cuda:{rank}", dtype=torch.bfloat16, tp=tp,
                              precision=Precision(args.quantization, args.kv_cache_dtype))
    modes = args.modes.split(",")
    if rank:                                        # the other ranks run the same steps; rank 0 reports
        for w in workloads(args.quick, args.smoke):
            if not args.only or w.name[1] in args.only:
                run_interleaved(model, w, modes, args)
        return
    tp_size = tp.size if tp is not None else 1
    header = (f"# Decode throughput, shared prefixes ({device})\n\n"
              f"{'tiny fp32 model' if args.smoke else f'Llama-3-{args.shape.upper()} shapes, {args.layers} layers, dummy bf16 weights'}, "
              f"{f'tensor parallel over {tp_size} GPUs, ' if tp_size > 1 else ''}"
              f"{'FP8 linear layers, ' if args.quantization else ''}{'FP8 KV cache, ' if args.kv_cache_dtype == 'fp8' else ''}"
              f"cascade planner {args.cascade}, {args.output} output tokens per "
              f"request ({args.warmup} untimed), median of {args.repeats} interleaved runs per mode, page {PAGE}, CUDA graphs {'off' if args.no_graphs else 'on'}; "
              f"torch {torch.__version__}. Command: `python -m benchmarks.engine.bench_throughput "
              f"{' '.join(sys.argv[1:])}`.\n\n"
              "| workload | requests | mode | tok/s | ms/step | attention share | vs ceiling | cascade vs flat |"
              " groups/levels | graphs | launch ms/step |\n|---|---|---|---|---|---|---|---|---|---|---|\n")
    os.makedirs(args.out_dir, exist_ok=True)
    slug = device.lower().replace("nvidia ", "").replace(" ", "_").replace("(", "").replace(")", "")
    variant = ((f"{args.shape}_" if args.shape != "8b" else "") + (f"tp{tp_size}_" if tp_size > 1 else "")
               + ("fp8_" if args.quantization else "") + ("fp8kv_" if args.kv_cache_dtype == "fp8" else ""))
    path = os.path.join(args.out_dir, f"throughput_{variant}{slug}.md")
    with open(path, "w") as f:                      # written row by row: a cut-off run keeps its rows
        emit(f, header)
        for w in workloads(args.quick, args.smoke):
            if args.only and w.name[1] not in args.only:
                continue
            res = run_interleaved(model, w, modes, args)
            for m in modes:
                emit(f, row(w, m, res) + "\n")
    print(f"wrote {path}")


def run_interleaved(model, w: Workload, modes: list[str], args: argparse.Namespace) -> dict[str, Result | None]:
    """Every mode ``args.repeats`` times, rounds interleaved and rotated so that drifting clocks or a
    noisy host weigh on all modes alike; per mode the run with the median throughput."""
    runs: dict[str, list[Result | None]] = {m: [] for m in modes}
    for r in range(args.repeats):
        order = modes[r % len(modes):] + modes[:r % len(modes)]
        for m in order:
            runs[m].append(run(model, w, m, args.output, args.warmup, not args.no_graphs, args.cascade))

    def median(results: list[Result | None]) -> Result | None:
        done = sorted((x for x in results if x is not None), key=lambda x: x.tokens_per_s)
        return done[len(done) // 2] if done else None

    return {m: median(rs) for m, rs in runs.items()}


def emit(f, text: str) -> None:
    print(text, end="", flush=True)
    f.write(text)
    f.flush()


def row(w: Workload, mode: str, res: dict[str, Result | None]) -> str:
    r, ceiling, flat = res[mode], res.get("no-attn"), res.get("flat")
    if r is None:
        return f"| {w.name} | {w.num_requests} | {mode} | KV does not fit | | | | | | | |"
    share = f"{100 * (1 - ceiling.ms_per_step / r.ms_per_step):.0f}%" if ceiling and mode != "no-attn" else ""
    frac = f"{r.tokens_per_s / ceiling.tokens_per_s:.2f}" if ceiling else ""
    vs_flat = f"{r.tokens_per_s / flat.tokens_per_s:.2f}x" if mode.startswith("cascade") and flat else ""
    levels = f"{r.groups}/{r.levels}" if r.levels else ""
    return (f"| {w.name} | {w.num_requests} | {mode} | {r.tokens_per_s:,.0f} | {r.ms_per_step:.2f} | {share} | "
            f"{frac} | {vs_flat} | {levels} | {r.captures} | {r.launch_ms:.2f} |")


if __name__ == "__main__":
    main()
