"""``tp=2`` on two GPUs (NCCL): the greedy tokens of ``tp=1`` in float32, bf16 logprobs within the
flat path's tolerance, every serving step a CUDA graph replay (all-reduces captured), no kernel
compiled after ready. Needs two CUDA devices."""

from __future__ import annotations

import pytest
import torch

from radixrelay import Engine, SamplingParams
from tests.engine.test_engine_gpu import _prompts, greedy_close, host_tier_sessions, make_tiny_model_dir

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


def _run(model_dir, tp: int, dtype: str, cascade: str = "auto"):
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, logprobs=2)
    with Engine(model=str(model_dir), load_format="dummy", device="cuda", dtype=dtype, cascade=cascade,
                kv_cache_tokens=65536, tp=tp) as engine:
        engine.generate(_prompts()[:1], params)          # cache the shared prefix first
        before = engine.stats()
        outs = engine.generate(_prompts(), params)
        return outs, engine.stats(), before


@pytest.mark.parametrize("cascade", ["off", "on"])
def test_fp32_two_ranks_give_the_tokens_of_one(model_dir, cascade):
    one, _, _ = _run(model_dir, 1, "float32", cascade)
    two, stats, before = _run(model_dir, 2, "float32", cascade)
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
    assert stats["eager_steps"] == before["eager_steps"]           # serving steps all replayed graphs
    assert stats["graph_replays"] > before["graph_replays"]
    assert stats["jit_after_ready"] == 0
    if cascade == "on":
        assert stats["cascade_steps"] > 0


def test_bf16_two_ranks_within_tolerance_of_one(model_dir):
    one, _, _ = _run(model_dir, 1, "bfloat16")
    two, stats, before = _run(model_dir, 2, "bfloat16")
    assert greedy_close(one, two, "tp=2") >= 4 * len(one)
    assert stats["eager_steps"] == before["eager_steps"]


def test_host_tier_at_two_ranks_gives_the_tokens_of_one(model_dir):
    """Sessions pushed off a small device pool come back from each rank's pinned host tier (copy streams,
    acknowledged once both ranks finished), fp32: the greedy tokens of tp=1 without tiers. The per-rank
    device seconds and the calibrated all-reduce time are counted."""
    reference, first, again, stats = host_tier_sessions(model_dir, tp=2)
    assert [o.token_ids for o in first] == [o.token_ids for o in again] == reference
    assert stats["tier_host_hit_tokens"] > 0 and all(o.cached_tokens > 0 for o in again)
    assert stats["rank0_device_s"] > 0 and stats["rank1_device_s"] > 0
    assert stats["tp_all_reduces"] > 0 and stats["tp_all_reduce_s"] > 0


def test_peer_all_reduce_matches_nccl_and_survives_graph_replays():
    """Our one-shot kernel against NCCL at decode sizes: the same sums (bf16 rounding), bitwise equal on
    both ranks, eagerly and after 100 replays of a graph of back-to-back calls (no lost signal, no hang)."""
    import argparse

    from benchmarks.kernels.bench_all_reduce import METHODS, run

    args = argparse.Namespace(rows=[1, 3, 256], hidden=[4096], replays=2, stress=100)
    for row in run(2, args):
        assert row["peer_same_on_ranks"], row
        assert max(row[f"{m}_err"] for m in METHODS[1:]) < 0.1, row
        assert max(row[f"{m}_stress_err"] for m in METHODS) < 0.1, row
        # the all-reduce fused with the residual add and RMSNorm: the unfused ops' numbers, on both ranks
        assert row["fused_same_on_ranks"] and row["fused_err"] < 0.05 and row["fused_stress_err"] < 0.05, row
