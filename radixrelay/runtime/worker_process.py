"""The worker process: owns the model, the KV memory and the ``ModelRunner``; runs one
``StepPlan`` per ``WorkerStep`` message and answers with its ``StepOutput``.

Start-up: load the model, size and allocate the KV cache, report ``WorkerReady`` (or
``RuntimeFailed``) to the scheduler. Then: receive a plan, step, send the output; nothing else.
"""

from __future__ import annotations

import logging
import time
import traceback

import torch
import zmq

from radixrelay.attention import KVCache
from radixrelay.attention.backend import make_backend
from radixrelay.cascade.cost import cost_model
from radixrelay.config import EngineConfig
from radixrelay.model.loader import load_model
from radixrelay.runtime.child import POLL_MS, bind_pull, connect_push, parent_gone, run_child
from radixrelay.runtime.messages import (
    ChildArgs, RuntimeFailed, WorkerCommand, WorkerReady, WorkerStep, WorkerStepDone, decoder,
    encoder,
)
from radixrelay.worker.model_runner import ModelRunner

logger = logging.getLogger("radixrelay.worker")
DEFAULT_CPU_KV_TOKENS = 32_768


def build_runner(cfg: EngineConfig) -> tuple[ModelRunner, WorkerReady]:
    device = torch.device(pick_device(cfg.device))
    dtype = None if cfg.dtype == "auto" else getattr(torch, cfg.dtype)
    model, mc = load_model(cfg.model, device=device, dtype=dtype, load_format=cfg.load_format,
                           seed=cfg.seed)
    kv_dtype = next(model.parameters()).dtype
    kv_tokens = cfg.kv_cache_tokens or _default_kv_tokens(cfg, device, mc, kv_dtype)
    num_pages = kv_tokens // cfg.page_size
    if num_pages < 1:
        raise ValueError(f"no memory left for the KV cache ({kv_tokens} tokens)")
    # One page beyond what the scheduler hands out: padded CUDA-graph rows write their K/V there.
    kv_cache = KVCache(num_layers=mc.num_layers, num_pages=num_pages + 1, page_size=cfg.page_size,
                       num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, dtype=kv_dtype,
                       device=device)
    backend_name = resolve_attention_backend(cfg.attention_backend, device)
    backend = make_backend(backend_name, device)
    graphs = None
    if device.type == "cuda" and backend_name == "triton" and not cfg.disable_cuda_graphs:
        from radixrelay.worker.cuda_graphs import DecodeGraphs   # imports the Triton kernels

        graphs = DecodeGraphs(model, kv_cache, backend, max_batch=cfg.max_running_requests,
                              max_pages=-(-mc.max_position_embeddings // cfg.page_size),
                              scratch_slot=num_pages * cfg.page_size)
    runner = ModelRunner(model, kv_cache, backend, seed=cfg.seed, prefill_cost=cost_model(cfg.cascade),
                         graphs=graphs)
    ready = WorkerReady(num_pages, mc.max_position_embeddings, mc.vocab_size, list(mc.eos_token_ids))
    return runner, ready


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """``auto``: the Triton kernels on CUDA, the torch reference on CPU (the kernels run there only
    under the slow Triton interpreter)."""
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return name


def pick_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return device


def _default_kv_tokens(cfg: EngineConfig, device: torch.device, mc: object, dtype: torch.dtype) -> int:
    if device.type != "cuda":
        return DEFAULT_CPU_KV_TOKENS
    free, _ = torch.cuda.mem_get_info(device)
    per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * dtype.itemsize
    return int(free * cfg.kv_memory_fraction) // per_token


def _serve(args: ChildArgs, ctx: zmq.Context) -> int:
    inbox = bind_pull(ctx, args.endpoints.scheduler_to_worker)
    outbox = connect_push(ctx, args.endpoints.worker_to_scheduler)
    encode = encoder().encode
    commands = decoder(WorkerCommand)
    try:
        runner, ready = build_runner(args.config)
    except Exception as exc:  # noqa: BLE001 - reported to the frontend, which raises it
        logger.error("worker start-up failed:\n%s", traceback.format_exc())
        outbox.send(encode(RuntimeFailed(f"worker start-up failed: {type(exc).__name__}: {exc}")))
        return 1
    outbox.send(encode(ready))
    logger.info("worker ready: %d KV pages of %d tokens", ready.num_pages, args.config.page_size)
    with torch.inference_mode():
        while True:
            if not inbox.poll(POLL_MS):
                if parent_gone(args):
                    return 1
                continue
            command = commands.decode(inbox.recv())
            if not isinstance(command, WorkerStep):
                return 0
            start = time.perf_counter()
            output = runner.step(command.plan)
            outbox.send(encode(WorkerStepDone(output, time.perf_counter() - start, runner.last_launch_s)))


if __name__ == "__main__":
    run_child("worker", _serve)
