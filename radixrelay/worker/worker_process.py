"""The worker process: owns the model, the KV memory and the ``ModelRunner``; runs one
``StepPlan`` per ``WorkerStep`` message and answers with its ``StepOutput``.

Start-up: load the model, size and allocate the KV cache, report ``WorkerReady`` (or
``RuntimeFailed``) to the scheduler. Then (``serve_steps``): launch each plan as it arrives and send
each step's output, in order, as soon as the device has produced it. A plan that arrives while
earlier steps are still on the device is launched first (overlap: the device never waits for the
host to read the previous step's tokens); with nothing new to launch, the worker waits for the
oldest step in flight. A frame that is not a ``WorkerCommand`` is logged and dropped.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
import traceback
from collections import deque
from collections.abc import Callable

import msgspec
import torch
import zmq

from radixrelay.attention import KVCache
from radixrelay.attention.factory import make_backend
from radixrelay.cascade.cost import cost_model
from radixrelay.config import EngineConfig
from radixrelay.env import (
    gc_mode, grammar_budget_ms, profile_dir, small_extend_rows, step_timeout_s, tp_all_reduce, trace_steps,
)
from radixrelay.kernels.fa3_node import resolve_node_kernel
from radixrelay.model.loader import default_dtype, load_model
from radixrelay.model.parallel import FAST_ALL_REDUCES, AllReduceClock, TensorParallel
from radixrelay.model.quantization import Precision
from radixrelay.model.model_registry import tokenizer_path
from radixrelay.protocol.messages import (
    ChildArgs, RuntimeFailed, WorkerCommand, WorkerReady, WorkerStep, WorkerStepDone, encoder,
)
from radixrelay.protocol.stats import WorkerCounters
from radixrelay.proc.child import POLL_MS, FrameDecoder, bind_pull, connect_push, parent_gone, run_child
from radixrelay.proc.gc_control import GcControl
from radixrelay.worker.rank_link import RankLink
from radixrelay.structured.grammar import GrammarEngine
from radixrelay.text.tokenizer import load_tokenizer
from radixrelay.worker.constraints import Constraints, MaskBudget
from radixrelay.worker.kv_tiers import build_tiers, page_bytes
from radixrelay.worker.model_runner import SMALL_EXTEND_ROWS, LaunchedStep, ModelRunner
from radixrelay.worker.step_trace import StepTrace
from radixrelay.worker.step_watchdog import StepWatchdog

logger = logging.getLogger("radixrelay.worker")
DEFAULT_CPU_KV_TOKENS = 32_768
# Largest all-reduce (bytes) on the symmetric-memory path: a decode step's activations at the largest
# batches; prefill chunks beyond it use NCCL.
SYMMETRIC_ALL_REDUCE_BYTES = 8 << 20
# A plan of tier transfers alone is answered once they complete, a new plan arrives, or this long has
# passed (with the transfers done so far; the scheduler then sends the next such plan: a longer wait means
# fewer of these round trips while a long save or disk write runs); completion is checked every
# TRANSFERS_POLL_S.
TRANSFERS_WAIT_S = 0.05
TRANSFERS_POLL_S = 0.0002


def build_runner(cfg: EngineConfig, tp: TensorParallel | None = None) -> tuple[ModelRunner, WorkerReady]:
    tp = tp or TensorParallel()
    device = torch.device(pick_device(cfg.device, tp))
    dtype = None if cfg.dtype == "auto" else getattr(torch, cfg.dtype)
    precision = Precision(cfg.quantization, cfg.kv_cache_dtype, cfg.fp8_emulation, cfg.fp8_keep_layers)
    model, mc = load_model(cfg.model, device=device, dtype=dtype, load_format=cfg.load_format,
                           seed=cfg.seed, tp=tp, precision=precision)
    local = model.local_config                     # this rank's KV heads
    model_dtype = model.model.embed_tokens.weight.dtype       # the model dtype (not an FP8 weight's)
    precision.check_kv_scales(model.kv_scales)
    kv_dtype = precision.cache_dtype(model_dtype)             # e4m3 for an FP8 KV cache
    parts = precision.describe(model_dtype)
    logger.info("precision: %s", "; ".join(f"{part} {what}" for part, what in parts.items()))
    if tp.enabled and device.type == "cuda":
        from radixrelay.worker.tp_calibration import calibrate_all_reduce

        calibrate_all_reduce(tp, mc.hidden_size, model_dtype, device,
                             cfg.chunked_prefill_tokens + cfg.max_running_requests)
    kv_tokens = cfg.kv_cache_tokens or _default_kv_tokens(cfg, device, local, kv_dtype, tp)
    num_pages = kv_tokens // cfg.page_size
    if num_pages < 1:
        raise ValueError(f"no memory left for the KV cache ({kv_tokens} tokens)")
    # One page beyond what the scheduler hands out: padded CUDA-graph rows write their K/V there.
    kv_cache = KVCache(num_layers=mc.num_layers, num_pages=num_pages + 1, page_size=cfg.page_size,
                       num_kv_heads=local.num_kv_heads, head_dim=mc.head_dim, dtype=kv_dtype,
                       device=device, model_dtype=model_dtype)
    if precision.kv == "fp8":                      # emulated (Precision.check_device refuses the rest)
        model.enable_kv_emulation(kv_cache)
    backend_name = resolve_attention_backend(cfg.attention_backend, device)
    if cfg.node_kernel == "fa3" and backend_name != "triton":
        raise ValueError(f"node kernel fa3 runs in the triton attention backend, not {backend_name!r}")
    node_kernel = resolve_node_kernel(cfg.node_kernel, device) if backend_name == "triton" else "triton"
    backend = make_backend(backend_name, device, node_kernel)
    # layers with windows, soft-capping or their own scale: refused here by a backend that cannot compute
    # them; the context it computes them exactly over (a uniform window on the Triton kernels), or None
    exact_context = backend.set_layers(model.attention_layers) if model.attention_layers else None
    if node_kernel == "fa3":
        logger.info("shared decode nodes of consecutive pages: FlashAttention-3 (16-bit caches), others Triton")
    if device.type == "cuda" and backend_name == "triton":
        from radixrelay.worker.warmup import warm_up_kernels   # imports the Triton kernels

        report = warm_up_kernels(local, kv_cache, backend, model=model)     # no kernel compiles after ready
        if not report.complete:
            logger.warning("kernel warm-up incomplete: skipped %s, errors %s", report.skipped, report.errors)
    extend_rows = small_extend_rows()
    extend_rows = SMALL_EXTEND_ROWS if extend_rows is None else extend_rows
    counters = WorkerCounters()           # the worker's: the runner and its graphs increment it in place
    graphs = None
    if device.type == "cuda" and backend_name == "triton" and not cfg.disable_cuda_graphs:
        from radixrelay.worker.cuda_graphs import DecodeGraphs   # imports the Triton kernels

        # rows: every running request's decode plus a step's small extends (``ModelRunner._extend_rows``)
        graphs = DecodeGraphs(model, kv_cache, backend, max_batch=cfg.max_running_requests + extend_rows,
                              max_pages=-(-mc.max_position_embeddings // cfg.page_size),
                              scratch_slot=num_pages * cfg.page_size, counters=counters)
    piecewise = None
    if graphs is not None:
        from radixrelay.worker.piecewise_graphs import PiecewiseGraphs, token_buckets

        # Steps with extend rows: everything but attention replays per token bucket (captured now).
        piecewise = PiecewiseGraphs(model, kv_cache, backend, scratch_slot=num_pages * cfg.page_size,
                                    token_buckets=token_buckets(cfg.chunked_prefill_tokens + cfg.max_running_requests),
                                    counters=counters)
        piecewise.capture_all()
        # Decode graphs covering flat decode and up to four shared groups at a few batch buckets: a fresh
        # server's first decode steps replay these instead of running piecewise until their class recurs.
        start = time.perf_counter()
        covers = graphs.capture_covers()
        logger.info("%d decode graphs covering flat and cascade steps captured in %.1f s", covers,
                    time.perf_counter() - start)
    vocab_size = mc.vocab_size

    def grammar_engine() -> GrammarEngine:       # built when the first constrained request arrives
        return GrammarEngine(load_tokenizer(tokenizer_path(cfg)), vocab_size)

    tiers, host_pages, disk_pages, namespace = build_tiers(cfg, mc, kv_cache, tp.rank)
    runner = ModelRunner(model, kv_cache, backend, seed=cfg.seed, prefill_cost=cost_model(cfg.cascade),
                         graphs=graphs, piecewise=piecewise, constraints=Constraints(grammar_engine, device, _mask_budget()),
                         tiers=tiers, counters=counters)
    runner.small_extend_rows = extend_rows
    if device.type == "cpu":
        from radixrelay.worker.warmup import warm_up_steps

        logger.info("start-up warm-up step ran in %.2f s", warm_up_steps(runner))
    max_context = mc.max_position_embeddings if exact_context is None else min(mc.max_position_embeddings,
                                                                                exact_context)
    if cfg.context_length is not None:
        if cfg.context_length > max_context:
            raise ValueError(f"context_length {cfg.context_length} exceeds the model's maximum positions "
                             f"({max_context})")
        max_context = cfg.context_length
    ready = WorkerReady(num_pages, max_context, mc.vocab_size, list(mc.eos_token_ids),
                        host_pages, disk_pages, namespace, page_bytes(kv_cache), precision=parts)
    return runner, ready


def _mask_budget() -> MaskBudget:
    per_token_ms = grammar_budget_ms()
    return MaskBudget() if per_token_ms is None else MaskBudget(per_token_s=per_token_ms / 1e3)


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """``auto``: the Triton kernels on CUDA, the torch reference on CPU (the kernels run there only
    under the slow Triton interpreter)."""
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return name


def pick_device(device: str, tp: TensorParallel | None = None) -> str:
    """The device of this rank (rank r of a tensor-parallel CUDA runtime: cuda:r)."""
    tp = tp or TensorParallel()
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    if device == "cuda" and tp.enabled:
        if tp.size > torch.cuda.device_count():
            raise ValueError(f"tp={tp.size} needs {tp.size} GPUs, {torch.cuda.device_count()} visible")
        return f"cuda:{tp.rank}"
    return device


def _default_kv_tokens(cfg: EngineConfig, device: torch.device, mc: object, dtype: torch.dtype,
                       tp: TensorParallel) -> int:
    """``mc``: this rank's shapes. Every rank gets the smallest rank's count (a page id means the
    same page on every rank)."""
    if device.type != "cuda":
        return DEFAULT_CPU_KV_TOKENS
    free, _ = torch.cuda.mem_get_info(device)
    per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * dtype.itemsize
    tokens = int(free * cfg.kv_memory_fraction) // per_token
    if tp.enabled:
        import torch.distributed as dist

        count = torch.tensor([tokens], dtype=torch.int64, device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MIN, group=tp.group)
        tokens = int(count.item())
    return tokens


def _serve(args: ChildArgs, ctx: zmq.Context) -> int:
    """Rank 0 talks to the scheduler and forwards every frame it receives to the other ranks, which
    run the same steps and report only to rank 0 (their transfers and device time: ``RankReport``;
    their tokens equal rank 0's)."""
    rank, endpoints = args.rank, args.endpoints
    inbox = bind_pull(ctx, endpoints.scheduler_to_worker if rank == 0 else endpoints.ranks[rank - 1])
    outbox = connect_push(ctx, endpoints.worker_to_scheduler) if rank == 0 else None
    followers = [connect_push(ctx, e) for e in endpoints.ranks] if rank == 0 else []
    link = None
    if args.config.tp > 1:
        link = RankLink(rank, args.config.tp, bind_pull(ctx, endpoints.rank_reports) if rank == 0
                        else connect_push(ctx, endpoints.rank_reports), args)
    encode = encoder().encode
    try:
        tp = join_tensor_parallel(args)
        runner, ready = build_runner(args.config, tp)
        tp.barrier()                   # every rank loaded: ready means ready on all of them
    except Exception as exc:  # noqa: BLE001 - reported to the frontend, which raises it
        logger.error("worker start-up failed:\n%s", traceback.format_exc())
        if outbox is not None:
            outbox.send(encode(RuntimeFailed(f"worker start-up failed: {type(exc).__name__}: {exc}")))
        return 1
    collector = GcControl("worker", gc_mode(), logger)
    collector.settle()                 # the model, KV cache and CUDA graphs: never scanned again
    if outbox is not None:
        outbox.send(encode(msgspec.structs.replace(ready, gc_frozen=collector.stats().frozen)))
    logger.info("worker rank %d ready: %d KV pages of %d tokens", rank, ready.num_pages, args.config.page_size)
    with torch.inference_mode():
        return serve_steps(runner, inbox, outbox, args, collector, followers, link)


def join_tensor_parallel(args: ChildArgs) -> TensorParallel:
    """Form the ranks' process group (NCCL on CUDA, gloo on the CPU); a single rank forms none.
    Collectives time out after the start-up timeout instead of hanging on a dead rank."""
    size = args.config.tp
    if size == 1:
        return TensorParallel()
    import torch.distributed as dist

    cuda = pick_device(args.config.device).startswith("cuda")
    if cuda:
        torch.cuda.set_device(args.rank)
    device = torch.device(f"cuda:{args.rank}") if cuda else None
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{args.endpoints.rendezvous}",
                            rank=args.rank, world_size=size, device_id=device,
                            timeout=datetime.timedelta(seconds=args.config.startup_timeout))
    fast, kind = None, tp_all_reduce()
    if cuda and kind != "nccl":
        dtype = default_dtype(device) if args.config.dtype == "auto" else getattr(torch, args.config.dtype)
        method = FAST_ALL_REDUCES["peer" if kind == "auto" else kind]
        fast = method.create(None, device, dtype, SYMMETRIC_ALL_REDUCE_BYTES)
    logger.info("rank %d of %d: all-reduce by %s", args.rank, size, type(fast).__name__ if fast else "the backend")
    return TensorParallel(args.rank, size, fast=fast, clock=AllReduceClock(timed=not cuda))


def serve_steps(runner: ModelRunner, inbox: zmq.Socket, outbox: zmq.Socket | None, args: ChildArgs,
                collector: GcControl, followers: list[zmq.Socket] | None = None,
                link: RankLink | None = None) -> int:
    """``outbox`` None: a tensor-parallel rank other than 0 (runs every step, reports to rank 0 over
    ``link``); ``followers``: rank 0's sockets to the other ranks, which get every frame before it is run."""
    encode = encoder().encode
    commands = FrameDecoder(WorkerCommand, "scheduler -> worker", logger)
    in_flight: deque[tuple[LaunchedStep, float, bool]] = deque()  # (step, host seconds, has rows)
    jit_after_ready = _jit_variants_since_now(runner)
    jit_seen = 0
    window = trace_steps()
    trace = None if window is None else StepTrace(*window, profile_dir() or os.getcwd(), args.rank)
    timeout = step_timeout_s()
    watchdog = StepWatchdog(timeout, _hung(args.rank)) if timeout > 0 else None

    def send_oldest() -> None:
        nonlocal jit_seen
        step, host_s, has_rows = in_flight.popleft()
        start = time.perf_counter()
        output = step.finish()
        if watchdog is not None:
            watchdog.finished(output.step_id)
        acks = interrupted = None
        if not has_rows:          # a plan of transfers alone: give them a moment, unless a new plan comes
            deadline = time.perf_counter() + TRANSFERS_WAIT_S
            interrupted = lambda: inbox.poll(0) or time.perf_counter() >= deadline  # noqa: E731
        if runner.tiers is not None:
            if interrupted is not None:
                _wait_for_transfers(runner.tiers, interrupted)
            acks = runner.tiers.acks(wait=False)
        busy = host_s + time.perf_counter() - start
        device_s = step.device_s or busy
        if link is not None:
            acks = link.finished(output.step_id, acks, device_s, until=interrupted)
            if outbox is not None:
                runner.counters.rank_device_s = list(link.device_s)
        if acks is not None:
            output = msgspec.structs.replace(output, kv_acks=acks)
        jit = jit_after_ready()
        if jit > jit_seen:
            logger.warning("%d Triton kernel variant(s) compiled while serving (%d since ready)",
                           jit - jit_seen, jit)
            jit_seen = jit
        counters = runner.counters        # the runner's own; the values it does not count are set here
        counters.jit_after_ready = jit
        counters.malformed_frames = commands.dropped
        counters.gc = collector.stats()
        clock = runner.model.tp.clock
        counters.tp_all_reduce_s, counters.tp_all_reduces = clock.seconds, clock.calls
        if runner.tiers is not None and runner.tiers.disk is not None:
            disk = runner.tiers.stats()
            counters.disk_read_s, counters.disk_write_s = disk.read_s, disk.write_s
            counters.disk_full_writes, counters.disk_jobs_given_up = disk.full_writes, disk.given_up
        if outbox is not None:
            outbox.send(encode(WorkerStepDone(output, busy, step.launch_s, device_s, step.capture_s, counters)))
        if trace is not None:
            trace.finished(step.step_id)

    while True:
        while in_flight and in_flight[0][0].ready():
            send_oldest()
        # Launch what arrived first; with steps on the device, only peek (the oldest may be done soon).
        if not inbox.poll(0 if in_flight else POLL_MS):
            if in_flight:
                _wait_for_either(in_flight[0][0], inbox)
            elif parent_gone(args):
                return 1
            else:
                collector.poll(idle=True)     # nothing on the device: a due full collection runs here
            continue
        frame = inbox.recv()
        for follower in followers or ():
            follower.send(frame)          # the other ranks decode and run it (or drop it) as this one does
        command = commands(frame)
        if command is None:
            continue                  # malformed frame: logged and dropped
        if not isinstance(command, WorkerStep):
            while in_flight:
                send_oldest()
            return 0
        start = time.perf_counter()
        if watchdog is not None:              # before the launch: a launch may block in a collective
            watchdog.started(command.plan.step_id)
        captured = runner.graph_capture_s
        if trace is None:
            launched = runner.launch(command.plan)
        else:
            with trace.launch(command.plan.step_id):
                launched = runner.launch(command.plan)
        plan = command.plan
        if launched.deferred:                 # its masks need the older steps' tokens: send those first
            sent = time.perf_counter()
            while in_flight:
                send_oldest()
            start += time.perf_counter() - sent          # the older steps' time, counted as theirs
            launched.complete()
        launched.capture_s = runner.graph_capture_s - captured     # graphs captured by this launch
        in_flight.append((launched, time.perf_counter() - start, bool(plan.extends or plan.decodes)))
        collector.poll(idle=False)            # a full collection only once FULL_EVERY_S has passed


def _hung(rank: int):
    """The watchdog's action: say which step hung, then end the process at once (its thread is stuck;
    the launcher stops the other processes and fails the requests)."""
    def on_hang(step_id: int, elapsed: float) -> None:
        logger.error("worker rank %d: step %d has not finished after %.0f s (RADIXRELAY_STEP_TIMEOUT_S): a rank "
                     "or the device hangs; exiting so that the runtime fails instead of hanging", rank,
                     step_id, elapsed)
        logging.shutdown()
        os._exit(3)
    return on_hang


def _jit_variants_since_now(runner: ModelRunner):
    """A function giving the Triton kernel variants that entered the process since this call (always
    0 on the CPU, where the torch backend runs)."""
    if runner.device.type != "cuda":
        return lambda: 0
    from radixrelay.kernels import jit_counter     # imports the Triton kernels

    jit_counter.install()
    at = jit_counter.counts()
    return lambda: (jit_counter.counts() - at).variants


def _wait_for_transfers(tiers, interrupted: Callable[[], bool]) -> None:
    """For a plan of KV tier transfers alone (the scheduler sends one while copies are to be sent or
    acknowledged): until they complete or ``interrupted()`` (a new plan arrived, ``TRANSFERS_WAIT_S``
    passed); the plan is then answered with the transfers done so far, and the scheduler asks again while
    any are left. Never longer: a request arriving while a large save runs (a prompt just computed) must not
    wait for the save to finish before its step is launched."""
    while not tiers.settled() and not interrupted():
        time.sleep(TRANSFERS_POLL_S)


def _wait_for_either(step: LaunchedStep, inbox: zmq.Socket) -> None:
    """Until the step's results are in or a new plan arrives (whichever is first): the next plan
    usually arrives while the device works, and launching it at once keeps the device fed. Spins
    (both checks are cheap and the wait is at most one step of device time)."""
    while not step.ready() and not inbox.poll(0):
        pass


if __name__ == "__main__":
    run_child("worker", _serve)
