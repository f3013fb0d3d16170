"""Host time to launch one pure-decode step of ``ModelRunner``, at batch B over a shared document.

What it drives: a real ``ModelRunner`` (a tiny Llama, a ``KVCache``, the torch attention backend on the
CPU or the Triton one on CUDA) fed ``StepPlan``s the way the scheduler sends them. B requests are
admitted whose page lists begin with the same ``--shared-pages`` pages (a cached document of
``shared_pages * page_size`` tokens) followed by 1-2 pages of their own, with a ``CascadePlan`` of one
group over the shared run; then ``--steps`` consecutive decode steps run, every step decoding all B
rids in the same order and appending a page to each request whose next position crosses a page
boundary (own lengths are staggered, so about B / page_size requests append per step). With
``--ipc`` each plan is round-tripped through msgpack first, as the worker process receives it (a
fresh, equal ``CascadePlan`` every step instead of the planner's reused object). With ``--churn N``
every step releases the N oldest requests and admits N new ones (serving at saturation): the plan,
the decode order and the batch's rows change every step.

What it measures, per step: the wall time of ``ModelRunner.launch(plan)`` (apply the plan's diff,
build the ``ForwardBatch``, run or replay the forward, queue sampling, start the copies back), the
median over the timed steps after ``--warmup`` steps, and per function (wrapped with timers) the
median milliseconds per step spent in it. ``finish()`` (waiting for the device) is outside the time:
by default each step is finished before the next is launched (the device is idle at launch: host time
alone); with ``--overlap`` one step stays in flight as in the worker's loop, so that on CUDA a launch
that waits for the device (a synchronising copy) shows up. Then, over ``--count-ops`` more steps, the
torch ops each launch dispatches (on CUDA each is a kernel launch or a copy; host-to-device copies of
CPU tensors do not count on the CPU, where they are no-ops).

``--forward stub`` (the default on the CPU) replaces the model with a stub that returns logits of
the right shape without computing them, so the step time is host work only (what the H100 spends
around a CUDA graph replay). ``--forward model`` runs the tiny model (CPU: the torch reference
backend, slow at large shared lengths). On CUDA ``--graphs`` (default there) replays decode steps
as ``DecodeGraphs`` with the real model and the Triton backend, as the server does; on the CPU
``--graphs`` runs the same buffer filling around the stub (no capture). ``--profile`` adds a
cProfile table of the timed steps (functions by own time, per step). On the CPU run it with
``OMP_NUM_THREADS=1``: with other jobs on the machine, torch's intra-op threads turn microsecond ops
into milliseconds of waiting. On CUDA the tiny model keeps the device step short; more ``--layers``
lengthen it (for ``--overlap``).

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.engine.bench_launch_host --graphs --ipc   # CPU, B=256, 1024 shared pages
    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.engine.bench_launch_host --graphs --ipc --churn 1 --profile
    .venv/bin/python -m benchmarks.engine.bench_launch_host --device cuda --ipc --overlap   # H100: graphs, real model
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import pstats
import statistics
import time
from collections import Counter, defaultdict

import msgspec
import torch

from radixrelay.attention import KVCache
from radixrelay.attention.factory import make_backend
from radixrelay.model import ModelConfig, load_model
from radixrelay.protocol.cascade import CascadeGroup, CascadePlan
from radixrelay.protocol.step import AdmittedRequest, PageAppend, StepPlan
from radixrelay.sampling_params import SamplingParams
from radixrelay.worker.model_runner import ModelRunner


class StubModel:
    """Stands in for the model: logits of the right shape, no compute (host time only)."""

    def __init__(self, model) -> None:
        self.config = model.config
        self._logits = torch.zeros(1, model.config.vocab_size, device=next(model.parameters()).device)

    def __call__(self, input_ids, batch, kv_cache, backend) -> torch.Tensor:
        rows = batch.logits_indices.shape[0]
        if self._logits.shape[0] < rows:
            self._logits = torch.zeros(rows, self._logits.shape[1], device=self._logits.device)
        return self._logits[:rows]


class Workload:
    """The scheduler's side: page lists, token counts and the plans of the decode steps."""

    def __init__(self, batch: int, shared_pages: int, page_size: int, sampling: SamplingParams, ipc: bool,
                 churn: int = 0) -> None:
        self.batch, self.page_size, self.ipc, self.churn = batch, page_size, ipc, churn
        self.sampling = sampling
        self.shared = list(range(shared_pages))            # one allocation: consecutive ids
        self.next_page = shared_pages
        self.free: list[int] = []
        self.rids: list[int] = []
        self.pages: dict[int, list[int]] = {}
        self.num_tokens: dict[int, int] = {}
        self.next_rid = 1000
        self._admitted = [self._admit() for _ in range(batch)]
        self._plan_cascade()
        self.step_id = 0

    def _admit(self) -> AdmittedRequest:
        rid, self.next_rid = self.next_rid, self.next_rid + 1
        own = 1 + (7 * rid) % self.page_size               # staggered own lengths: appends spread over steps
        n = len(self.shared) * self.page_size + own
        self.pages[rid] = self.shared + self._take(-(-own // self.page_size))
        self.num_tokens[rid] = n
        self.rids.append(rid)
        # Positions [0, n - 1) are cached; the first decode computes position n - 1.
        return AdmittedRequest(rid, [rid % 50 + 1], n, list(self.pages[rid]), self.sampling, token_offset=n - 1)

    def _plan_cascade(self) -> None:
        tokens = len(self.shared) * self.page_size
        self.cascade = CascadePlan([CascadeGroup(list(self.rids), 0, tokens, 0)], dict.fromkeys(self.rids, tokens))

    def _take(self, n: int) -> list[int]:
        if len(self.free) >= n:
            out, self.free = self.free[:n], self.free[n:]
            return out
        out = list(range(self.next_page, self.next_page + n))
        self.next_page += n
        return out

    def plan(self) -> StepPlan:
        """The next step's plan (the first one admits everyone; with ``churn``, later ones release the
        ``churn`` oldest requests and admit as many new ones, which changes the cascade plan)."""
        released = []
        if self.churn and self.step_id:
            released, self.rids = self.rids[:self.churn], self.rids[self.churn:]
            for rid in released:
                self.free.extend(self.pages.pop(rid)[len(self.shared):])
                del self.num_tokens[rid]
            self._admitted = [self._admit() for _ in released]
            self._plan_cascade()
        appends = []
        for rid in self.rids:
            if (self.num_tokens[rid] - 1) // self.page_size >= len(self.pages[rid]):
                new = self._take(1)
                self.pages[rid].extend(new)
                appends.append(PageAppend(rid, new))
        plan = StepPlan(self.step_id, released=released, admitted=self._admitted, page_appends=appends,
                        decodes=list(self.rids),
                        cascade=self.cascade)
        self._admitted = []
        self.step_id += 1
        for rid in self.rids:
            self.num_tokens[rid] += 1
        if self.ipc:
            plan = msgspec.msgpack.decode(msgspec.msgpack.encode(plan), type=StepPlan)
        return plan


class Timers:
    """Wraps functions with wall-clock accumulators; ``per_step`` gives median ms per step."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []
        self.labels: list[str] = []

    def wrap(self, owner, name: str, label: str) -> None:
        fn = getattr(owner, name)
        acc = self.current
        self.labels.append(label)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[label] += time.perf_counter() - start

        setattr(owner, name, timed)

    def end_step(self) -> None:
        self.steps.append(dict(self.current))
        self.current.clear()

    def per_step(self) -> dict[str, float]:
        return {k: statistics.median(s.get(k, 0.0) for s in self.steps) * 1e3 for k in self.labels}


def instrument(timers: Timers, graphs: bool) -> None:
    from radixrelay.attention import metadata
    from radixrelay.cascade import batch as cascade_batch
    from radixrelay.worker import model_runner, sampling, step_state

    timers.wrap(ModelRunner, "_apply_diff", "ModelRunner._apply_diff")
    if hasattr(ModelRunner, "_advance"):
        timers.wrap(ModelRunner, "_advance", "ModelRunner._advance")
    timers.wrap(ModelRunner, "_batch", "ModelRunner._batch")
    decode_graph = next((name for name in ("_decode_graph", "_forward_decode_graph") if hasattr(ModelRunner, name)),
                        None)
    if decode_graph is not None:                             # a changed batch onto a decode graph
        timers.wrap(ModelRunner, decode_graph, f"ModelRunner.{decode_graph}")
        timers.wrap(ModelRunner, "_decode_rows", "  ModelRunner._decode_rows")
        timers.wrap(metadata.DevicePageTable, "rows", "  DevicePageTable.rows")
        timers.wrap(step_state.ResidentTokens, "rows", "  ResidentTokens.rows")
    timers.wrap(model_runner, "build_forward_batch", "  build_forward_batch")
    timers.wrap(metadata.DevicePageTable, "gather", "  DevicePageTable.gather")
    timers.wrap(cascade_batch.DecodeRunsCache, "get", "  DecodeRunsCache.get")
    timers.wrap(step_state.ResidentTokens, "newest", "ResidentTokens.newest")
    timers.wrap(step_state.ResidentTokens, "record", "ResidentTokens.record")
    timers.wrap(step_state.ResidentTokens, "penalties", "ResidentTokens.penalties")
    timers.wrap(sampling.SamplingTensors, "from_rows", "SamplingTensors.from_rows")
    if hasattr(sampling, "SamplingTensorsCache"):
        timers.wrap(sampling.SamplingTensorsCache, "get", "SamplingTensorsCache.get")
    timers.wrap(sampling.Sampler, "__call__", "Sampler.__call__")
    if graphs:
        from radixrelay.worker import cuda_graphs

        if hasattr(cuda_graphs.DecodeGraphs, "advance"):
            timers.wrap(cuda_graphs.DecodeGraphs, "advance", "  DecodeGraphs.advance")
        timers.wrap(cuda_graphs.DecodeGraphs, "_replay", "    DecodeGraphs._replay (graph launch)")
        if hasattr(cuda_graphs.DecodeGraphs, "_page_writes"):
            timers.wrap(cuda_graphs.DecodeGraphs, "_page_writes", "    DecodeGraphs._page_writes")
        else:                                                  # the persistent batch's page writes
            from radixrelay.worker import device_batch

            timers.wrap(device_batch.DeviceBatch, "page_writes", "    DeviceBatch.page_writes")
        timers.wrap(cuda_graphs, "to_device", "    to_device (page writes, patched rows)")
        for name in ("RowAdvance", "PageScatter", "RowPatcher"):      # the per-step kernels' launches
            if hasattr(cuda_graphs, name):
                timers.wrap(getattr(cuda_graphs, name), "__call__", f"    {name}")
        timers.wrap(cuda_graphs.DecodeGraphs, "run", "DecodeGraphs.run")
        timers.wrap(cuda_graphs.DecodeGraphs, "_fill_rows", "  DecodeGraphs._fill_rows")
        timers.wrap(cuda_graphs.DecodeGraphs, "_fill_groups", "  DecodeGraphs._fill_groups")


def count_ops(runner: ModelRunner, plans: list[StepPlan]) -> Counter:
    """Torch ops dispatched per ``launch`` (mean over ``plans``): each is a kernel launch or a copy on CUDA."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts: Counter = Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts[func.__name__.split(".")[0]] += 1
            return func(*args, **(kwargs or {}))

    for plan in plans:
        with Count():
            step = runner.launch(plan)
        out = step.finish()
        if out.error is not None:
            raise SystemExit(f"step {plan.step_id}: {out.error}")
    return Counter({k: v / len(plans) for k, v in counts.items()})


def build_runner(args, device: torch.device, num_pages: int) -> ModelRunner:
    """``num_pages``: the pages the workload hands out; one more is the scratch page of padded graph rows."""
    dims = (dict(hidden_size=4096, intermediate_size=14336, num_heads=32, num_kv_heads=8, head_dim=128)
            if args.shape == "8b" else dict(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16))
    cfg = ModelConfig(architecture="llama", vocab_size=args.vocab, num_layers=args.layers, **dims,
                      max_position_embeddings=max(2 * args.shared_pages * args.page_size, 4096))
    model, _ = load_model(cfg, device=device, dtype=torch.float32 if device.type == "cpu" else torch.bfloat16)
    num_pages += 1
    dtype = next(model.parameters()).dtype
    kv = KVCache(num_layers=cfg.num_layers, num_pages=num_pages, page_size=args.page_size,
                 num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=dtype, device=device)
    backend = make_backend("triton" if args.graphs or device.type == "cuda" else "torch", device)
    stub = StubModel(model) if args.forward == "stub" else None
    graphs = None
    if args.graphs:
        from radixrelay.worker.cuda_graphs import DecodeGraphs

        graphs = DecodeGraphs(stub or model, kv, backend, max_batch=args.batch, max_pages=num_pages,
                              scratch_slot=(num_pages - 1) * args.page_size)
    runner = ModelRunner(model, kv, backend, graphs=graphs)
    if stub is not None:
        runner.model = stub
    return runner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--shared-pages", type=int, default=1024)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=300, help="timed decode steps")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--shape", choices=("tiny", "8b"), default="tiny",
                    help="model dimensions: tiny (hidden 64: a short device step) or Llama-3-8B's (random weights: "
                         "the device step of serving, so that launches queue behind a busy device as they do there)")
    ap.add_argument("--forward", choices=("stub", "model"), default=None,
                    help="default: stub on the CPU, model on CUDA")
    ap.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=None,
                    help="decode through DecodeGraphs (default: on CUDA)")
    ap.add_argument("--ipc", action="store_true", help="round-trip each plan through msgpack")
    ap.add_argument("--overlap", action="store_true",
                    help="launch each step before finishing the previous one (CUDA: launches that wait for the "
                         "device show up in the time)")
    ap.add_argument("--churn", type=int, default=0,
                    help="per step, release this many requests and admit as many (a new cascade plan each step)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--profile", action="store_true", help="cProfile the timed steps")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--count-ops", type=int, default=10, metavar="N",
                    help="then N more steps counting the torch ops each launch dispatches (0: skip)")
    args = ap.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if args.forward is None:
        args.forward = "model" if cuda else "stub"
    if args.graphs is None:
        args.graphs = cuda

    sampling = SamplingParams(max_tokens=1 << 20, temperature=args.temperature, ignore_eos=True)
    work = Workload(args.batch, args.shared_pages, args.page_size, sampling, args.ipc, args.churn)
    plans = [work.plan() for _ in range(args.warmup + args.steps + 1 + args.count_ops)]   # built up front: scheduler time is not ours
    runner = build_runner(args, device, work.next_page)

    timers = Timers()
    instrument(timers, args.graphs)
    profiler = cProfile.Profile() if args.profile else None
    launch_ms, launch_s_ms = [], []
    in_flight = None
    for i, plan in enumerate(plans[:len(plans) - args.count_ops]):
        timed = i > args.warmup
        if timed and profiler is not None:
            profiler.enable()
        start = time.perf_counter()
        step = runner.launch(plan)
        elapsed = time.perf_counter() - start
        if timed and profiler is not None:
            profiler.disable()
        if args.overlap:                 # finish the previous step while this one is queued (the worker's loop)
            step, in_flight = in_flight, step
        out = step.finish() if step is not None else None
        if out is not None and out.error is not None:
            raise SystemExit(f"step {out.step_id}: {out.error}")
        if timed:
            launch_ms.append(elapsed * 1e3)
            launch_s_ms.append((in_flight if args.overlap else step).launch_s * 1e3)
            timers.end_step()
        else:
            timers.current.clear()

    if in_flight is not None:
        in_flight.finish()
    print(f"device {device} ({torch.get_num_threads()} threads), batch {args.batch}, "
          f"{args.shared_pages} shared pages x {args.page_size} tokens, shape {args.shape}, forward {args.forward}, "
          f"graphs {args.graphs}, ipc {args.ipc}, churn {args.churn}, overlap {args.overlap}, {args.steps} steps")
    print(f"launch(): median {statistics.median(launch_ms):.3f} ms/step  (p10 {sorted(launch_ms)[len(launch_ms) // 10]:.3f}, "
          f"p90 {sorted(launch_ms)[9 * len(launch_ms) // 10]:.3f}); until the forward was queued "
          f"(LaunchedStep.launch_s): {statistics.median(launch_s_ms):.3f} ms")
    print(f"graph replays {runner.counters.graph_replays}, eager steps {runner.counters.eager_steps}")
    if args.count_ops:
        ops = count_ops(runner, plans[len(plans) - args.count_ops:])
        top = ", ".join(f"{name} {n:g}" for name, n in ops.most_common(8))
        print(f"torch ops per launch: {sum(ops.values()):g} ({top})")
    print("per function, median ms per step (indented: inside the line above):")
    for label, ms in timers.per_step().items():
        print(f"  {label:<34} {ms:8.3f}")
    if profiler is not None:
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(args.top)
        print(f"cProfile of {args.steps} launches (divide by steps for per-step time):")
        print(text.getvalue())


if __name__ == "__main__":
    main()
