"""Host time of a step's eager attention: ``TritonBackend`` over every layer of one mixed batch.

Piecewise CUDA graphs run everything but attention from graphs; attention is launched eagerly, once per
layer. This times those L calls alone, as PiecewiseGraphs makes them (one q buffer for every layer, the
output copied into the graph's o buffer; with ``--out``-capable backends also ``forward(out=o)``), for
Llama-3-8B attention shapes (32 q heads, 8 KV heads, head dim 128, bf16, page size 16, 32 layers).

Batch: extends of --extends new tokens over --prefix cached tokens each (read as shared runs of their own,
as the worker does on CUDA: ``long_prefix_runs``) and --decodes decodes over --context tokens; with and
without a one-group decode cascade plan (every decode sharing the first --shared tokens of its context).
Every step is a new ``ForwardBatch`` object (per-step planning included, on the first layer).

Reported per case, medians over --repeats steps after --warmup (each step timed alone: the device is
drained before it, outside the timed region): host ms per step, of its first layer, and per later layer,
and the device's time for the step. Keep the device time well under the host's (shorter --context /
--prefix, fewer --decodes): when the device is the slower, launches wait for room in the launch queue and
the host figures measure the device instead.

    python -m benchmarks.engine.bench_attention_launch                   # a CUDA GPU
    PYTHONPATH=path/to/other/tree:. python -P -m benchmarks.engine.bench_attention_launch --label before
    python -m benchmarks.engine.bench_attention_launch --cpu-smoke       # tiny shapes, TRITON_INTERPRET=1
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import statistics
import sys
import time

if "--cpu-smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")    # before triton is imported
import torch  # noqa: E402

import radixrelay  # noqa: E402
from radixrelay.attention import BatchRequest, KVCache, build_forward_batch  # noqa: E402
from radixrelay.attention.metadata import SharedRun, build_shared_runs  # noqa: E402
from radixrelay.attention.triton_backend import TritonBackend  # noqa: E402
from radixrelay.cascade.batch import long_prefix_runs  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Shapes:
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype
    device: str


LLAMA3_8B = Shapes(32, 32, 8, 128, 16, torch.bfloat16, "cuda")
TINY = Shapes(2, 4, 2, 16, 4, torch.float32, "cpu")


def make_batch(s: Shapes, extends: list[int], prefix: int, decodes: int, context: int, shared: int,
               cascade: bool, num_pages: int):
    """Page ids come from one pool of ``num_pages`` (requests may share physical pages: only the host
    work is measured; positions and page lists are as serving builds them)."""
    ps = s.page_size
    next_page = 0

    def pages(tokens: int) -> list[int]:
        nonlocal next_page
        count = -(-tokens // ps)
        out = [(next_page + i) % num_pages for i in range(count)]
        next_page += count
        return out

    work = [BatchRequest(pages(prefix + n), prefix, n) for n in extends]
    node = pages(shared)                                            # the decodes' common prefix (a radix node)
    for _ in range(decodes):
        own = [(next_page + i) % num_pages for i in range(-(-(context + 1) // ps) - len(node))]
        next_page += len(own)
        work.append(BatchRequest(node + own, context, 1))
    kv_start = [0] * len(work)
    ext_runs = long_prefix_runs(work[:len(extends)], kv_start, ps)
    dec_runs = None
    if cascade:
        dec_runs = build_shared_runs([SharedRun(list(range(decodes)), node, shared)], s.device)
        kv_start[len(extends):] = [shared] * decodes
    return build_forward_batch(work, ps, s.device, num_decodes=decodes, kv_start=kv_start,
                               decode_runs=dec_runs, prefill_runs=build_shared_runs(ext_runs, s.device))


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_steps(s: Shapes, batch, kv: KVCache, mode: str, warmup: int, repeats: int):
    """(step ms, first layer ms, later layer ms, device ms) medians; ``mode``: ``copy``
    (o_buf.copy_(forward(q))) or ``out`` (forward(q, out=o_buf)). Device ms: from the step's first launch
    to its last kernel's end (CUDA events; 0 on the CPU). Where it is close to the host's step ms, the
    host was held back by the device (a full launch queue): the host figure is then an upper bound."""
    backend = TritonBackend(overlap=s.device == "cuda")
    gen = torch.Generator(s.device).manual_seed(0)
    q = torch.randn((batch.num_tokens, s.q_heads, s.head_dim), generator=gen, device=s.device).to(s.dtype)
    o_buf = torch.empty_like(q)
    steps, firsts, laters, devices = [], [], [], []
    cuda = s.device == "cuda"
    for i in range(warmup + repeats):
        step = dataclasses.replace(batch)                           # a new step: planned again
        sync(s.device)
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        t0 = time.perf_counter()
        for layer in range(s.layers):
            if mode == "out":
                backend.forward(q, layer, kv, step, out=o_buf)
            else:
                o_buf.copy_(backend.forward(q, layer, kv, step))
            if layer == 0:
                t1 = time.perf_counter()
        t2 = time.perf_counter()
        if cuda:
            end.record()
        sync(s.device)
        if i >= warmup:
            steps.append(t2 - t0)
            firsts.append(t1 - t0)
            laters.append((t2 - t1) / max(s.layers - 1, 1))
            devices.append(begin.elapsed_time(end) / 1e3 if cuda else 0.0)
    return tuple(1e3 * statistics.median(x) for x in (steps, firsts, laters, devices))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1)")
    ap.add_argument("--label", default="", help="printed with each row (e.g. before / after)")
    ap.add_argument("--extends", default="64,256", help="new tokens of each extend")
    ap.add_argument("--prefix", type=int, default=2048, help="cached tokens before each extend")
    ap.add_argument("--decodes", type=int, default=128)
    ap.add_argument("--context", type=int, default=2048, help="tokens before each decode's new one")
    ap.add_argument("--shared", type=int, default=1920, help="tokens of the cascade's shared node")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--profile", action="store_true", help="then cProfile one cascaded step's later layers")
    args = ap.parse_args()
    if args.cpu_smoke:
        s = TINY
        extends, args.prefix, args.decodes, args.context, args.shared = [3, 5], 16, 4, 16, 12
        args.warmup, args.repeats, num_pages = 1, 2, 64
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_attention_launch: needs a CUDA GPU (or --cpu-smoke)")
        s, extends, num_pages = LLAMA3_8B, [int(x) for x in args.extends.split(",")], 1024
    kv = KVCache(num_layers=s.layers, num_pages=num_pages, page_size=s.page_size, num_kv_heads=s.kv_heads,
                 head_dim=s.head_dim, dtype=s.dtype, device=s.device)
    for t in kv.k + kv.v:
        t.normal_()
    has_out = "out" in inspect.signature(TritonBackend.forward).parameters
    print(f"radixrelay from {os.path.dirname(radixrelay.__file__)}")
    if s.device == "cuda":
        print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{s.layers} layers, {s.q_heads}/{s.kv_heads} heads x {s.head_dim}, {s.dtype}, page {s.page_size}; "
          f"extends {extends} over {args.prefix} cached, {args.decodes} decodes over {args.context}; "
          f"median of {args.repeats} steps after {args.warmup}")
    print(f"{'label':8} {'case':22} {'call':12} {'step ms':>9} {'layer 1 ms':>11} {'layer 2..L ms':>14} "
          f"{'device ms':>10}")
    for cascade in (False, True):
        batch = make_batch(s, extends, args.prefix, args.decodes, args.context, args.shared, cascade, num_pages)
        case = "mixed + cascade 1 grp" if cascade else "mixed, flat decode"
        for mode in ("copy", "out") if has_out else ("copy",):
            step, first, later, device = time_steps(s, batch, kv, mode, args.warmup, args.repeats)
            call = "forward+copy" if mode == "copy" else "out=o"
            print(f"{args.label:8} {case:22} {call:12} {step:9.3f} {first:11.3f} {later:14.4f} {device:10.3f}")
    if args.profile:
        profile_later_layers(s, batch, kv)


def profile_later_layers(s: Shapes, batch, kv: KVCache) -> None:
    """Host functions of layers 2..L of one step (cProfile, by own time)."""
    import cProfile
    import pstats

    backend = TritonBackend(overlap=s.device == "cuda")
    q = torch.zeros((batch.num_tokens, s.q_heads, s.head_dim), dtype=s.dtype, device=s.device)
    for _ in range(2):
        step = dataclasses.replace(batch)
        sync(s.device)
        backend.forward(q, 0, kv, step)
        with cProfile.Profile() as prof:
            for layer in range(1, s.layers):
                backend.forward(q, layer, kv, step)
        sync(s.device)
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
