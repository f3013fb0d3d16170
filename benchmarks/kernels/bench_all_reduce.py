"""All-reduce of a decode step's activation across the GPUs of one host: NCCL, torch's one-shot over
symmetric memory and ours (``radixrelay.kernels.all_reduce``), checked and timed side by side.

Per tensor-parallel size (one process per GPU, NCCL group, NVLink multicast off) and per message
``[rows, hidden]`` bf16:
  check   every method's result against NCCL's (within bf16 rounding), ours bitwise the same on every
          rank, eagerly and after ``--stress`` replays of a CUDA graph of back-to-back calls (a hang
          or a lost signal shows here); the all-reduce joined to the residual add and RMSNorm
          (``PeerAllReduce.add``, one kernel) against the same three ops unfused (our all-reduce, then
          ``rms_norm`` with its residual), where the one-shot sizes allow it;
  time    a CUDA graph of 16 calls per method, replayed (3 untimed, then ``--replays`` timed with CUDA
          events): the median per call, the slowest rank's. Back-to-back calls: no compute between
          them, so ranks arrive together (in a model step they arrive as their GEMMs finish).
Writes ``all_reduce_<device>.md`` (rank 0).

    python -m benchmarks.kernels.bench_all_reduce [--tp 2,4] [--rows 1,64,256,512] [--hidden 4096,8192] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile

import torch

from benchmarks.common import RESULTS, ROOT
from radixrelay.kernels.graph_timing import graph_replay_seconds
from radixrelay.bench.provenance import source_commit, write_device_results

CALLS = 16                  # all-reduces per captured graph
MAX_BYTES = 8 << 20         # what serving gives the symmetric-memory methods (worker_process)
METHODS = ("nccl", "symm", "peer1", "peer2", "peer")


def _worker(rank: int, world: int, init: str, args: argparse.Namespace, results: dict) -> None:
    import torch.distributed as dist

    from radixrelay.model.parallel import PeerAllReduce, SymmetricAllReduce

    torch.cuda.set_device(rank)
    device = torch.device(f"cuda:{rank}")
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world, device_id=device)
    dtype = torch.bfloat16
    peer = PeerAllReduce(None, device, dtype, MAX_BYTES)
    symm = SymmetricAllReduce(None, device, dtype, MAX_BYTES)

    def nccl(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    methods = {"nccl": nccl, "symm": symm, "peer1": lambda x: peer(x, two_shot=False),
               "peer2": lambda x: peer(x, two_shot=True), "peer": peer}
    methods["peer1_push"] = lambda x: peer(x, two_shot=False, push=True)
    for block in getattr(args, "blocks", []):    # the one-shot kernel with other tile sizes (tuning)
        methods[f"peer1_b{block}"] = lambda x, b=block: peer(x, two_shot=False, block=b)
    rows_out = []
    for hidden in args.hidden:
        for rows in args.rows:
            gen = torch.Generator(device=device).manual_seed(1000 * rank + rows)
            src = torch.randn(rows, hidden, generator=gen, device=device).to(dtype)
            want = methods["nccl"](src.clone())
            row = {"hidden": hidden, "rows": rows, "bytes": src.numel() * 2}
            for name, op in methods.items():
                got = op(src.clone())
                err = (got.float() - want.float()).abs().max().item()
                row[f"{name}_err"] = err
                if name.startswith("peer"):
                    row["peer_same_on_ranks"] = row.get("peer_same_on_ranks", True) and _same_on_every_rank(got, world)
                # stress: a graph of CALLS (copy, all-reduce) pairs, replayed many times
                x = src.clone()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(CALLS):
                        x.copy_(src)
                        op(x)
                for _ in range(args.stress):
                    graph.replay()
                torch.cuda.synchronize()
                row[f"{name}_stress_err"] = (x.float() - want.float()).abs().max().item()
                del graph
                row[f"{name}_us"] = _time(op, src, args.replays)
            rows_out.append(row)
            if rank == 0:
                print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
            _fused_rows(row, peer, src, rows, hidden, device, world, args)
            if rank == 0:
                print({k: v for k, v in row.items() if k.startswith(("fused", "unfused"))}, flush=True)
    if rank == 0:
        results["rows"] = rows_out
    dist.destroy_process_group()


def _fused_rows(row: dict, peer, src: torch.Tensor, rows: int, hidden: int, device: torch.device, world: int,
                args: argparse.Namespace) -> None:
    """all-reduce + residual add + RMSNorm, fused and unfused: the difference, bitwise agreement across
    ranks, a stressed graph, and the time per call of each."""
    from radixrelay.kernels.rms_norm import rms_norm

    gen = torch.Generator(device=device).manual_seed(rows)          # the residual stream: the same on every rank
    residual = torch.randn(rows, hidden, generator=gen, device=device).to(src.dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen, device=device)).to(src.dtype)
    eps = 1e-5
    if peer.add(src.clone(), residual, (weight, eps)) is None:
        return                                                       # two-shot sizes: not fused
    unfused = lambda x: rms_norm(peer(x), weight, eps, residual)     # noqa: E731
    fused = lambda x: peer.add(x, residual, (weight, eps))           # noqa: E731
    other = lambda x: peer.add(x, residual, (weight, eps), push=not peer.PUSH)   # noqa: E731
    want, got = unfused(src.clone()), fused(src.clone())
    row["fused_err"] = max((g.float() - w.float()).abs().max().item() for g, w in zip(got, want))
    row["fused_same_on_ranks"] = all(_same_on_every_rank(t, world) for t in got)
    graph, out = torch.cuda.CUDAGraph(), []
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            out = fused(src)
    for _ in range(args.stress):
        graph.replay()
    torch.cuda.synchronize()
    row["fused_stress_err"] = max((g.float() - w.float()).abs().max().item() for g, w in zip(out, want))
    del graph
    row["unfused_us"] = _time(unfused, src, args.replays)
    row["fused_us"] = _time(fused, src, args.replays)
    row["fused_other_err"] = max((g.float() - w.float()).abs().max().item() for g, w in zip(other(src.clone()), want))
    row["fused_other_us"] = _time(other, src, args.replays)      # the other one-shot layout (push / pull)


def _same_on_every_rank(x: torch.Tensor, world: int) -> bool:
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x)
    return all(torch.equal(p, parts[0]) for p in parts)


def _time(op, src: torch.Tensor, replays: int) -> float:
    """Median microseconds per call over graph replays, the slowest rank's."""
    import torch.distributed as dist

    x = src.clone()

    def body() -> None:
        for _ in range(CALLS):
            op(x)

    mine = torch.tensor([statistics.median(graph_replay_seconds(body, replays)) * 1e6 / CALLS], device=src.device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return mine.item()


def _entry(rank: int, world: int, init: str, args: argparse.Namespace, path: str) -> None:
    results: dict = {}
    _worker(rank, world, init, args, results)
    if rank == 0:
        torch.save(results, path)


def run(world: int, args: argparse.Namespace) -> list[dict]:
    import torch.multiprocessing as mp

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")                  # no NVLink multicast
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.pt")
        mp.spawn(_entry, args=(world, f"file://{tmp}/rendezvous", args, path), nprocs=world, join=True)
        return torch.load(path)["rows"]


def report(results: dict[int, list[dict]], args: argparse.Namespace) -> list[str]:
    name = torch.cuda.get_device_name(0)
    lines = [f"# All-reduce of decode activations ({name})", "",
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; commit {source_commit(ROOT)}; torch "
             f"{torch.__version__}. Command: `python -m benchmarks.kernels.bench_all_reduce {' '.join(sys.argv[1:])}`", "",
             f"bf16 messages of [rows, hidden]; per call, microseconds: the median over {args.replays} replays of a "
             f"CUDA graph of {CALLS} back-to-back calls, the slowest rank's. nccl: the process group's all_reduce; "
             "symm: torch's one-shot over symmetric memory (staging copy + `one_shot_all_reduce_out`); ours "
             "(`radixrelay.kernels.all_reduce`, one launch each): peer1 one-shot, peer2 two-shot, peer what serving "
             "picks by size (`PeerAllReduce`). Checks: max abs difference from NCCL's result, eager "
             f"and after {args.stress} replays of a graph of {CALLS} calls; ours bitwise equal on every rank.",
             "Fused: all-reduce + residual add + RMSNorm in one kernel (`PeerAllReduce.add`) against our all-reduce "
             "then `rms_norm` with its residual (unfused), one-shot sizes only; max difference of (y, s) from the "
             "unfused ops.",
             "", "| tp | hidden | rows | MB | nccl us | symm us | peer1 us | peer2 us | peer us | peer / nccl | peer / symm "
             "| max diff (eager; stressed) | ours same on ranks "
             "| unfused us | fused us | fused / unfused | fused diff (eager; stressed) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for world, rows in results.items():
        for r in rows:
            diff = max(r[f"{m}_err"] for m in METHODS[1:])
            stressed = max(r[f"{m}_stress_err"] for m in METHODS)
            lines.append(f"| {world} | {r['hidden']} | {r['rows']} | {r['bytes'] / 2**20:.2f} | {r['nccl_us']:.1f} "
                         f"| {r['symm_us']:.1f} | {r['peer1_us']:.1f} | {r['peer2_us']:.1f} | {r['peer_us']:.1f} "
                         f"| {r['peer_us'] / r['nccl_us']:.2f} "
                         f"| {r['peer_us'] / r['symm_us']:.2f} | {diff:.3g}; {stressed:.3g} | {r['peer_same_on_ranks']} "
                         + (f"| {r['unfused_us']:.1f} | {r['fused_us']:.1f} | {r['fused_us'] / r['unfused_us']:.2f} "
                            f"| {r['fused_err']:.3g}; {r['fused_stress_err']:.3g} |" if "fused_us" in r
                            else "| - | - | - | - |"))
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda text: [int(v) for v in text.split(",") if v]  # noqa: E731
    p.add_argument("--tp", type=ints, default=None, help="sizes (default: 2 and every visible GPU)")
    p.add_argument("--rows", type=ints, default=[1, 64, 256, 512])
    p.add_argument("--hidden", type=ints, default=[4096, 8192])
    p.add_argument("--blocks", type=ints, default=[], help="also time the one-shot kernel with these tiles "
                   "(elements per program and iteration)")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--stress", type=int, default=200, help="graph replays of the stress check")
    p.add_argument("--out-dir", default=os.environ.get("OUT") or str(RESULTS / "kernels"))
    args = p.parse_args(argv)
    gpus = torch.cuda.device_count()
    sizes = args.tp or sorted({2, gpus})
    if gpus < 2 or max(sizes) > gpus:
        print(f"bench_all_reduce: needs {max(sizes)} GPUs, {gpus} visible", file=sys.stderr)
        return 2
    results = {world: run(world, args) for world in sizes}
    lines = report(results, args)
    print(f"wrote {write_device_results(args.out_dir, 'all_reduce', torch.cuda.get_device_name(0), lines)}")
    print("\n".join(lines))
    bad = [r for rows in results.values() for r in rows
           if not r["peer_same_on_ranks"] or max(r[f"{m}_stress_err"] for m in METHODS) > 0.5
           or not r.get("fused_same_on_ranks", True) or r.get("fused_stress_err", 0.0) > 0.05]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
