"""The default model (SmolLM2-135M, fp32 on CPU): greedy outputs identical with cascade on and off."""

from __future__ import annotations

import random

import pytest
import torch

from radixrelay.model import load_model, resolve_model_path
from tests.cascade.harness import run_workload


@pytest.fixture(scope="module")
def default_model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)      # small CPU matmuls: a second thread only contends (tests/model/conftest.py)
    model, _ = load_model(str(resolve_model_path("default")), device="cpu", dtype=torch.float32)
    yield model
    torch.set_num_threads(threads)


def test_default_model_greedy_identical(default_model):
    rng = random.Random(0)
    tok = lambda n: [rng.randrange(200, 20000) for _ in range(n)]  # noqa: E731
    system = tok(40)
    stems = [system + tok(20) for _ in range(2)]
    waves = [[(900, system)], [(800 + i, s) for i, s in enumerate(stems)],
             [(10 * i + j, s + tok(3 + j)) for i, s in enumerate(stems) for j in range(3)]]
    off = run_workload(default_model, waves, mode="off", max_tokens=8, page_size=16)
    on = run_workload(default_model, waves, mode="on", max_tokens=8, page_size=16)
    assert on.tokens == off.tokens
    assert on.planner.counters.cascade_steps > 0 and on.planner.counters.max_levels == 2
