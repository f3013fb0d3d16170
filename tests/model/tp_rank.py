"""One rank of a tensor-parallel model test (run in its own process by test_tensor_parallel.py):
greedy decoding through a paged KV cache, with the prompt logits, for each of the test's model configs in
turn over one process group, saved for the test to compare."""

from __future__ import annotations

import datetime
from pathlib import Path

import torch
import torch.distributed as dist

from radixrelay.model import ModelConfig, load_model
from radixrelay.model.parallel import TensorParallel
from tests.model.paged import PagedSession

PROMPTS = {0: [3, 17, 42, 8, 9, 5], 1: [7, 7, 7, 1], 2: [60, 2, 33, 12, 11, 4, 19, 80, 1]}
TOKENS = 64


def greedy(config: ModelConfig, tp: TensorParallel, dtype: torch.dtype) -> dict:
    model, _ = load_model(config, load_format="dummy", dtype=dtype, seed=3, tp=tp)
    session = PagedSession(model, num_pages=64, page_size=4)
    prompt_logits = PagedSession(model, num_pages=16, page_size=4)
    prompt_logits.add(0, PROMPTS[2])
    logits = prompt_logits.step([(0, len(PROMPTS[2]))], all_logits=True)
    with torch.inference_mode():
        tokens = session.greedy(dict(PROMPTS), TOKENS)
    return {"tokens": tokens, "logits": logits}


def run(rank: int, size: int, init_file: str, out_dir: str, configs: dict[str, ModelConfig],
        dtype: torch.dtype) -> None:
    """Every config of ``configs`` in turn (one process start and one gloo group for all of them): a dict
    of their results by name, in ``rank{rank}.pt``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=120))
    try:
        results = {name: greedy(config, TensorParallel(rank, size), dtype) for name, config in configs.items()}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()      # both ranks done before either tears gloo down (a peer gone mid-teardown aborted one)
    finally:
        dist.destroy_process_group()
