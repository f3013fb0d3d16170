"""Shared decode nodes through FlashAttention-3 (``kernels/fa3_node.py``).

On the CPU (interpreter) the FA3 call is ``varlen_reference`` (its contract in float64): this checks what
radixrelay does around the call (queries gathered per group, node start slots from the page runs, FA3's
output written into the merge's parts, an empty group, padding) against the float64 cascade reference.
On the GPU (``-m gpu``, Hopper with the ``fa3_fwd`` wheel) the real FA3: a real-size cascade, and one captured
in a CUDA graph replayed over other nodes (lengths, places and rows changed in the bound tensors)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from radixrelay.config import EngineConfig
from radixrelay.kernels import cascade_decode_attention, cascade_decode_attention_reference, fa3_node, plan_cascade
from radixrelay.kernels.cascade_decode import merge_index
from radixrelay.kernels.fa3_node import resolve_node_kernel, varlen_reference
from tests.kernels.helpers import DEVICE, assert_close_attention, int32
from tests.kernels.test_cascade import contiguous_real_size, run_case

FA3_GPU = pytest.mark.skipif(not (DEVICE == "cuda" and fa3_node.fa3_capable(torch.device("cuda"))),
                             reason="needs the fa3_fwd wheel on a Hopper GPU")


def test_fa3_node_wiring_against_the_reference(monkeypatch):
    """Two nodes on consecutive pages, an empty group at the end (a graph's padding), a request in two groups,
    one with no own tokens: FA3's parts merged with the own KV equal the float64 cascade."""
    if DEVICE == "cpu":
        monkeypatch.setattr(fa3_node, "_fa3_varlen", varlen_reference)
    calls = []
    real = fa3_node._fa3_varlen

    def counted(*args, **kwargs):
        calls.append(kwargs["num_splits"])
        return real(*args, **kwargs)

    monkeypatch.setattr(fa3_node, "_fa3_varlen", counted)
    use_fa3 = lambda plan: dataclasses.replace(plan, fa3_splits=3, kv_tma=True)  # noqa: E731  (CPU: no TMA)
    plan = run_case([[0, 1, 2, 3], [1, 3], []], [70, 33, 0], [(0, 9), (0, 3), (0, 0), (2, 40)], 8, 2, 64, 16,
                    torch.float16, seed=5, contiguous=True, adjust=use_fa3, shared_splits=1)
    assert plan.fa3_splits == 3 and calls == [3]


def test_node_kernel_choice():
    assert resolve_node_kernel("triton", torch.device("cpu")) == "triton"
    assert resolve_node_kernel("auto", torch.device("cpu")) == "triton"     # FA3 runs on Hopper GPUs only
    with pytest.raises(ValueError, match="node kernel fa3"):
        resolve_node_kernel("fa3", torch.device("cpu"))
    with pytest.raises(ValueError, match="node kernel must be one of"):
        resolve_node_kernel("flash", torch.device("cpu"))
    with pytest.raises(ValueError, match="node_kernel"):
        EngineConfig(node_kernel="flash")


def test_an_engine_asked_for_fa3_where_it_cannot_run_fails_at_start():
    from radixrelay import Engine

    with pytest.raises(RuntimeError, match="node kernel fa3"):
        Engine(node_kernel="fa3", device="cpu", kv_cache_tokens=2048)


def test_fa3_node_refuses_caches_it_cannot_read():
    q = torch.zeros(2, 8, 64, dtype=torch.float32)
    cache = torch.zeros(32, 2, 64, dtype=torch.float32)
    with pytest.raises(ValueError, match="16-bit caches"):
        fa3_node.Fa3Node(q, cache, cache, 16, int32([0, 2], "cpu"), int32([0, 1], "cpu"), int32([0, 1], "cpu"),
                         int32([0], "cpu"), int32([10], "cpu"), 0.1, torch.zeros(2, 8, 64), torch.zeros(2, 8),
                         max_rows=2, splits=1, varlen=varlen_reference)


@pytest.mark.gpu
@FA3_GPU
@pytest.mark.parametrize("overlap", [False, True])
def test_cascade_fa3_real_size_gpu(overlap):
    plan = contiguous_real_size(overlap, node_kernel="fa3")
    assert plan.fa3_splits > 0 and plan.shared_splits == 1


@pytest.mark.gpu
@FA3_GPU
def test_cascade_fa3_graph_replays_other_nodes():
    """Capture one step's cascade (FA3 node) in a CUDA graph, then rewrite the bound index tensors in place
    (other node places, lengths and rows, as the decode graphs refill them) and replay: the reference of the
    new step."""
    gen = torch.Generator("cuda").manual_seed(3)
    batch, page, hq, hkv, d = 128, 16, 32, 8, 128
    k = torch.randn(4096 * page, hkv, d, device="cuda", generator=gen).bfloat16()
    v = torch.randn(k.shape, device="cuda", generator=gen).bfloat16()
    q = torch.randn(batch, hq, d, device="cuda", generator=gen).bfloat16()

    def index(first_pages, node_pages, lens, rows):
        pages = torch.cat([torch.arange(f, f + n, dtype=torch.int32) for f, n in zip(first_pages, node_pages)])
        own = 3000 + torch.arange(batch * 4, dtype=torch.int32).view(batch, 4)
        return [int32([0, len(rows[0]), len(rows[0]) + len(rows[1])]), int32(rows[0] + rows[1]),
                int32([0, node_pages[0], node_pages[0] + node_pages[1]]), pages.cuda(), int32(lens), own.cuda(),
                int32([0] * batch), int32([50] * batch)]

    first = index([0, 1000], [512, 64], [8192, 1000], [list(range(batch)), list(range(0, batch, 2))])
    plan = plan_cascade(*first, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page, node_kernel="fa3")
    assert plan.fa3_splits > 0
    o, lse = torch.empty_like(q), torch.empty(batch, hq, device="cuda")
    side = torch.cuda.Stream()
    cascade_decode_attention(q, k, v, plan, side_stream=side, out=(o, lse))      # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cascade_decode_attention(q, k, v, plan, side_stream=side, out=(o, lse))
    rows = [list(range(0, batch, 2)), list(range(batch))]
    second = index([600, 100], [512, 64], [6400 - 5, 1017], rows)
    merge_indptr, merge_ids = merge_index(rows[0] + rows[1], batch, plan.shared_splits, plan.own_splits)
    for bound, new in zip((plan.q_indptr, plan.q_rows, plan.kv_indptr, plan.kv_pages, plan.kv_lens,
                           plan.merge_indptr, plan.merge_part_ids),
                          (*second[:5], torch.from_numpy(merge_indptr), torch.from_numpy(merge_ids))):
        assert bound.shape == new.shape
        bound.copy_(new)
    graph.replay()
    o_ref, lse_ref = cascade_decode_attention_reference(q, k, v, page, *second)
    assert_close_attention(o, lse, o_ref, lse_ref, torch.bfloat16)
