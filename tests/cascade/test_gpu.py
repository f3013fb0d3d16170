"""Cascade on the GPU (run with ``-m gpu`` on a CUDA machine; benchmarks/engine/gpu_all.sh does).

- bf16 at Llama-3-8B attention shapes: cascade (both phases) is within the error of flat attention,
  both measured against a float64 reference of the flat batch;
- CUDA graphs: decode steps replayed from graphs (flat and cascaded, padded batches) give the logits of
  the same steps run eagerly, and the same greedy tokens (fp32, so that the graphs' different KV split
  choices stay far below any argmax margin).
"""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest
import torch

from radixrelay.attention.backend import TorchBackend
from radixrelay.attention.factory import make_backend
from radixrelay.model import load_model
from tests.cascade.harness import run_workload
from tests.cascade.test_exactness import CFG, prompt_tree
from tests.cascade.trees import batch_on, random_scenario

pytestmark = pytest.mark.gpu


def _to(cache, dtype, device):
    out = copy.copy(cache)
    out.k = [t.to(device=device, dtype=dtype) for t in cache.k]
    out.v = [t.to(device=device, dtype=dtype) for t in cache.v]
    return out


@pytest.mark.parametrize("seed", range(4))
def test_bf16_cascade_within_flat_error(seed):
    rng = random.Random(seed)
    sc = random_scenario(rng, page_size=16, num_extends=3, num_decodes=48, heads=(32, 8), head_dim=128,
                         dtype=torch.float64)
    assert sc.num_groups > 0
    q64 = torch.randn(sc.flat.num_tokens, 32, 128, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    ref, _ = TorchBackend().forward_with_lse(q64, 0, sc.cache, sc.flat)
    cache = _to(sc.cache, torch.bfloat16, "cuda")
    q = q64.to("cuda", torch.bfloat16)
    backend = make_backend("triton", "cuda")
    errors = {}
    for name, batch in (("flat", sc.flat), ("cascade", sc.cascaded)):
        o = backend.forward(q, 0, cache, batch_on(batch, "cuda"))
        errors[name] = ((o.double().cpu() - ref).norm() / ref.norm()).item()
    assert errors["flat"] < 1e-2
    assert errors["cascade"] <= 1.5 * errors["flat"] + 1e-3, errors


@pytest.fixture(scope="module")
def llama_fp32():
    net, _ = load_model(CFG, device="cuda", dtype=torch.float32, seed=11)
    with torch.no_grad():
        for p in net.parameters():
            p.mul_(6.0 if p.dim() == 2 else 1.0)
    return net


@pytest.mark.parametrize("mode", ["off", "on"])
def test_cuda_graphs_equal_eager(llama_fp32, mode):
    waves = prompt_tree(random.Random(3), system_len=40, problems=3, samples=5)
    eager = run_workload(llama_fp32, waves, mode=mode, max_tokens=6, page_size=16,
                         backend=make_backend("triton", "cuda"))
    graphed = run_workload(llama_fp32, waves, mode=mode, max_tokens=6, page_size=16,
                           backend=make_backend("triton", "cuda"), graph_max_batch=32)
    assert graphed.graphs.captures >= 1
    assert graphed.tokens == eager.tokens
    for a, b in zip(eager.logits, graphed.logits):
        for rid in a:
            torch.testing.assert_close(b[rid], a[rid], rtol=1e-4, atol=1e-4)
    if mode == "on":
        assert graphed.planner.counters.cascade_steps > 0


def test_small_extends_beside_cascade_decodes_on_cuda_graphs(llama_fp32):
    """Steps that admit a few prompt tokens beside cascade decodes replay one decode graph (extend tokens
    as rows, the decodes' runs shifted past them): tokens and logits as the eager path's."""
    waves = prompt_tree(random.Random(17), system_len=40, problems=2, samples=4)
    opts = dict(mode="on", max_tokens=6, page_size=16, chunked_prefill_tokens=6)
    eager = run_workload(llama_fp32, waves, backend=make_backend("triton", "cuda"), **opts)
    graphed = run_workload(llama_fp32, waves, backend=make_backend("triton", "cuda"), graph_max_batch=32,
                           long_prefix_tokens=16, **opts)
    assert graphed.runner.counters.extend_row_steps == sum(1 for p in graphed.plans if p.extends) >= 4
    assert any(p.extends and p.decodes and p.cascade is not None for p in graphed.plans)
    assert graphed.tokens == eager.tokens
    for a, b in zip(eager.logits, graphed.logits):
        for rid in a:
            torch.testing.assert_close(b[rid], a[rid], rtol=1e-4, atol=1e-4)


CFG128 = dataclasses.replace(CFG, hidden_size=256, num_heads=8, num_kv_heads=2, head_dim=128)


@pytest.fixture(scope="module")
def llama_bf16_d128():
    net, _ = load_model(CFG128, device="cuda", dtype=torch.bfloat16, seed=11)
    return net


def test_tma_node_path_in_serving_eager_and_graphs(llama_bf16_d128, monkeypatch):
    """A 700-token prompt, then 40 samples under it: the allocator gives the prompt consecutive pages,
    the 40 x 4 folded rows take the shared-node kernel's TMA path (Hopper), eagerly and in CUDA graphs,
    and the logits stay within bf16 error of flat attention."""
    from radixrelay.kernels import cascade_decode as cascade_mod
    from radixrelay.kernels import shared_node

    if not shared_node.tma_capable(torch.device("cuda")):
        pytest.skip("needs Hopper (TMA)")
    launches = []                  # one per bound shared-node launch (a step's, reused by its layers)
    real = shared_node.BoundSplits.__init__

    def spy(self, *args, **kwargs):
        real(self, *args, **kwargs)
        launches.append((self.kv_tma, tuple(args[0].shape), tuple(args[10].shape)))   # o_dst [rows, splits, Hq, D]

    monkeypatch.setattr(cascade_mod.shared_node.BoundSplits, "__init__", spy)
    rng = random.Random(7)
    prompt = [rng.randrange(CFG128.vocab_size) for _ in range(700)]
    samples = [prompt + [rng.randrange(CFG128.vocab_size)] * rng.randint(1, 5) for _ in range(40)]
    waves = [[(1000, prompt)], list(enumerate(samples))]
    runs = {}
    for name, mode, graphs in (("flat", "off", 0), ("eager", "on", 0), ("graphs", "on", 64)):
        launches.clear()
        runs[name] = run_workload(llama_bf16_d128, waves, mode=mode, max_tokens=4, page_size=16,
                                  backend=make_backend("triton", "cuda"), graph_max_batch=graphs)
        if mode == "on":    # every launch for the 40 samples' group used TMA (a graph also launches on
            big = [x for x in launches if x[2][0] >= 40]           # an empty padded group when no rows share)
            missed = [(i, x) for i, x in enumerate(launches) if x[2][0] >= 40 and not x[0]]
            assert big and not missed, f"{name}: {len(big)} launches, without TMA: {missed[:6]}"
    assert runs["graphs"].graphs.captures >= 1
    flat = runs["flat"]
    for name in ("eager", "graphs"):
        seen: dict[int, int] = {}
        compared = 0
        for a, b in zip(flat.logits, runs[name].logits, strict=True):
            for rid in a:
                n = seen.get(rid, 0)
                seen[rid] = n + 1
                if flat.tokens[rid][:n] != runs[name].tokens[rid][:n]:
                    continue          # a bf16 near-tie sampled differently earlier: other inputs now
                err = ((b[rid].float() - a[rid].float()).norm() / a[rid].float().norm()).item()
                assert err < 2e-2, (name, rid, n, err)
                compared += 1
        assert compared >= 80, (name, compared)
