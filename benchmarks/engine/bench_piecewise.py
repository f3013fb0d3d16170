"""Mixed steps (extends + decodes): the eager model against piecewise CUDA graphs, per step.

Llama-3-8B shapes (32 layers, hidden 4096, intermediate 14336, 32 / 8 heads of 128, vocab 49152), dummy
bf16 weights, Triton attention, a paged KV cache. Each step shape ``E1+E2/D`` is a batch of extends of
E1, E2 ... new tokens over one cached prefix of --prefix tokens (shared pages, as after a radix hit) and
D decodes of --context-token contexts (--distinct-contexts page lists, each decode with its own last
page). Per shape and mode (eager ``model(...)``, ``PiecewiseGraphs.run``), over --repeats steps
after --warmup:

- host: time until the call returns (kernels launched; the device may still run);
- device: the step's kernel time (device busy), from the profiler's kernel durations (CUPTI; graph
  replays' kernels included), mean over --repeats; launch gaps do not count;
- wall: launch to device done, from an idle device (what a lock-step loop pays per step).

With overlap scheduling a step costs about max(host, device). Also: ``attn host``, the host time of the
step's L eager attention calls alone (what remains of the piecewise host time besides the replays);
``logit err``, max |piecewise - eager| / max |eager| over the step's logits (0: bit-identical); the
graphs' capture time and memory.

    python -m benchmarks.engine.bench_piecewise                  # a CUDA GPU (H100: ~2 minutes)
    python -m benchmarks.engine.bench_piecewise --cpu-smoke      # tiny shapes on the CPU: pieces run eagerly
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from radixrelay.attention import BatchRequest, KVCache, build_forward_batch
from radixrelay.attention.factory import make_backend
from radixrelay.model import ModelConfig, load_model
from radixrelay.worker.piecewise_graphs import PiecewiseGraphs, token_buckets

LLAMA3_8B = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=4096, intermediate_size=14336,
                        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                        rope_theta=500000.0, max_position_embeddings=32768)
TINY = ModelConfig(architecture="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16)


def parse_shape(spec: str) -> tuple[list[int], int]:
    """``256+1024/64`` -> ([256, 1024], 64)."""
    extends, _, decodes = spec.partition("/")
    sizes = [int(n) for n in extends.split("+") if n]
    if not sizes or any(n < 1 for n in sizes) or int(decodes or 0) < 0:
        raise ValueError(f"step shape {spec!r}: want E1+E2.../D with E >= 1, D >= 0")
    return sizes, int(decodes or 0)


class Pages:
    """Page ids handed out in order; page ``num_pages`` is the scratch page (padded rows)."""

    def __init__(self, args, shapes: list[tuple[list[int], int]]) -> None:
        p = args.page_size
        self.page_size = p
        self.next = 0
        self.prefix = self.take(args.prefix // p)
        distinct = min(args.distinct_contexts, max(d for _, d in shapes))
        self.contexts = [self.take((args.context - 1) // p) for _ in range(distinct)]
        own = sum(sum(-(-n // p) for n in ext) + d * (-(-args.context // p) - (args.context - 1) // p)
                  for ext, d in shapes)
        self.num_pages = self.next + own

    def take(self, n: int) -> list[int]:
        self.next += n
        return list(range(self.next - n, self.next))


def build_step(args, pages: Pages, extends: list[int], decodes: int, device):
    p, gen = pages.page_size, torch.Generator().manual_seed(len(extends) * 1000 + decodes)
    work = []
    for n in extends:                       # cached prefix, then n new tokens on the request's own pages
        work.append(BatchRequest(pages.prefix + pages.take(-(-n // p)), args.prefix, n))
    for i in range(decodes):                # position context - 1 of a context set, on its own last page
        shared = pages.contexts[i % len(pages.contexts)]
        own = pages.take(-(-args.context // p) - len(shared))
        work.append(BatchRequest(shared + own, args.context - 1, 1))
    batch = build_forward_batch(work, p, device, num_decodes=decodes)
    ids = torch.randint(0, args.vocab, (batch.num_tokens,), generator=gen).to(device)
    return ids, batch


def time_mode(fn, repeats: int, warmup: int, cuda: bool) -> dict[str, float]:
    """Milliseconds per ``fn()`` call: host and wall medians, device-busy mean (module docstring)."""
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    host, wall = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
        if cuda:
            torch.cuda.synchronize()
        wall.append(time.perf_counter() - t0)
    device = float("nan")
    if cuda:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(repeats):
                fn()
            torch.cuda.synchronize()
        busy_us = sum(e.time_range.elapsed_us() for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA)
        device = busy_us / 1e3 / repeats
    return {"host": 1e3 * statistics.median(host), "device": device, "wall": 1e3 * statistics.median(wall)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="256+1024/64,256+1024/256,128/64,32/128,16+64/32",
                    help="comma-separated step shapes E1+E2.../D (extend sizes / decodes)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--prefix", type=int, default=2048, help="cached tokens before each extend")
    ap.add_argument("--context", type=int, default=2048, help="tokens of each decode's context")
    ap.add_argument("--distinct-contexts", type=int, default=64, help="decode page lists (KV memory)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=2048 + 256,
                    help="largest bucket: the worker's chunked prefill tokens + max running requests")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU, torch attention, no graphs")
    args = ap.parse_args()

    cuda = not args.cpu_smoke
    if cuda and not torch.cuda.is_available():
        sys.exit("bench_piecewise: no CUDA device (use --cpu-smoke for a CPU run)")
    if args.cpu_smoke:
        torch.set_num_threads(1)
        cfg = TINY
        args.prefix, args.context, args.distinct_contexts, args.page_size = 32, 48, 4, 4
        args.max_tokens, args.repeats, args.warmup = 256, 3, 1
        if args.shapes == ap.get_default("shapes"):
            args.shapes = "24+40/8,16/4,100/120"
        device, dtype, backend_name = "cpu", torch.float32, "torch"
    else:
        from dataclasses import replace

        cfg = replace(LLAMA3_8B, num_layers=args.layers)
        device, dtype, backend_name = "cuda", torch.bfloat16, "triton"
    args.vocab = cfg.vocab_size
    if args.prefix % args.page_size:
        sys.exit("bench_piecewise: --prefix must be a multiple of --page-size")
    shapes = [parse_shape(s) for s in args.shapes.split(",")]

    model, _ = load_model(cfg, device=device, dtype=dtype, load_format="dummy")
    pages = Pages(args, shapes)
    kv = KVCache(num_layers=cfg.num_layers, num_pages=pages.num_pages + 1, page_size=args.page_size,
                 num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=dtype, device=device)
    buckets = token_buckets(args.max_tokens)
    pw = PiecewiseGraphs(model, kv, make_backend(backend_name, device), token_buckets=buckets,
                         scratch_slot=pages.num_pages * args.page_size)
    name = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"# Piecewise graphs vs eager, mixed steps ({name}; torch {torch.__version__})")
    print(f"model: {cfg.num_layers} layers, hidden {cfg.hidden_size}, intermediate {cfg.intermediate_size}, "
          f"heads {cfg.num_heads}/{cfg.num_kv_heads} x {cfg.head_dim}, vocab {cfg.vocab_size}, {dtype}, "
          f"{backend_name} attention; KV cache {kv.nbytes() / 2**30:.2f} GiB ({pages.num_pages} pages of "
          f"{args.page_size}); prefix {args.prefix}, decode context {args.context}")
    print(f"buckets ({len(buckets)}): {buckets}")
    report = pw.capture_all()
    if cuda:
        print(f"capture: {len(report.buckets)} buckets, {report.graphs} graphs in {report.seconds:.2f} s, "
              f"{report.memory_bytes / 2**20:.0f} MiB graph memory + {pw.buffer_bytes() / 2**20:.0f} MiB buffers"
              + (f"; skipped {list(report.skipped)}" if report.skipped else ""))
    else:
        print(f"capture: none on the CPU (pieces run eagerly over {pw.buffer_bytes() / 2**10:.0f} KiB of buffers)")

    eager_backend = make_backend(backend_name, device)
    head = (f"{'step':<16} {'tokens':>6} {'bucket':>6} | {'eager host':>10} {'device':>7} {'wall':>7} | "
            f"{'piecewise host':>14} {'device':>7} {'wall':>7} | {'attn host':>9} | {'host x':>6} {'logit err':>9}")
    print(f"\nms per step over {args.repeats} steps (host, wall: median; device: mean)")
    print(head)
    print("-" * len(head))
    for spec, (extends, decodes) in zip(args.shapes.split(","), shapes):
        ids, batch = build_step(args, pages, extends, decodes, device)
        with torch.inference_mode():
            want = model(ids, batch, kv, eager_backend)
            eager = time_mode(lambda: model(ids, batch, kv, eager_backend), args.repeats, args.warmup, cuda)
            if not pw.fits(batch):
                print(f"{spec:<16} {batch.num_tokens:>6} {'-':>6} | {eager['host']:>10.2f} {eager['device']:>7.2f} "
                      f"{eager['wall']:>7.2f} | {'(larger than the largest bucket: eager)':>30}")
                continue
            got = pw.run(ids, batch)
            piece = time_mode(lambda: pw.run(ids, batch), args.repeats, args.warmup, cuda)
            q = torch.randn(batch.num_tokens, cfg.num_heads, cfg.head_dim, dtype=dtype, device=device)
            attn = time_mode(lambda: [eager_backend.forward(q, i, kv, batch) for i in range(cfg.num_layers)],
                             args.repeats, args.warmup, cuda)
        bucket = next(b for b in buckets if b >= batch.num_tokens)
        diff = (got.float() - want.float()).abs().max().item() / want.float().abs().max().item()
        print(f"{spec:<16} {batch.num_tokens:>6} {bucket:>6} | {eager['host']:>10.2f} {eager['device']:>7.2f} "
              f"{eager['wall']:>7.2f} | {piece['host']:>14.2f} {piece['device']:>7.2f} {piece['wall']:>7.2f} | "
              f"{attn['host']:>9.2f} | {eager['host'] / piece['host']:>6.1f} {diff:>9.2g}")
    print(f"\nreplays {pw.replays}, captures {pw.captures}"
          + (f", peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if cuda else ""))


if __name__ == "__main__":
    main()
