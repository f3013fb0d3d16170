"""The grouped-expert kernel on a CUDA device: Mixtral-like shapes in bf16 against the torch reference in
float32, and the same step captured in a CUDA graph (routing changed in place between replays) equal to
eager. Run with ``-m gpu``."""

from __future__ import annotations

import pytest
import torch

from radixrelay.kernels.grouped_experts import grouped_experts, grouped_experts_reference

pytestmark = pytest.mark.gpu

E, TOP_K, HIDDEN, INTER = 8, 2, 1024, 1792


def _weights(seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    gate_up = torch.randn(E, 2 * INTER, HIDDEN, device="cuda", generator=g).mul_(HIDDEN ** -0.5)
    down = torch.randn(E, HIDDEN, INTER, device="cuda", generator=g).mul_(INTER ** -0.5)
    return gate_up.bfloat16(), down.bfloat16()


def _routing(tokens: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(tokens, E, device="cuda", generator=g)
    weights, ids = logits.softmax(-1).topk(TOP_K, dim=-1)
    return ids, (weights / weights.sum(-1, keepdim=True)).float()


@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
def test_bf16_against_the_float32_reference(tokens):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    gate_up, down = _weights()
    x = torch.randn(tokens, HIDDEN, device="cuda").bfloat16()
    ids, weights = _routing(tokens, seed=tokens)
    out = grouped_experts(x, ids, weights, gate_up, down)
    ref = grouped_experts_reference(x.float(), ids, weights, gate_up.float(), down.float())
    assert out.dtype == torch.bfloat16 and out.shape == (tokens, HIDDEN)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


def test_a_captured_step_replays_new_routing():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    gate_up, down = _weights(1)
    tokens = 32
    x = torch.randn(tokens, HIDDEN, device="cuda").bfloat16()
    ids, weights = _routing(tokens, seed=1)
    grouped_experts(x, ids, weights, gate_up, down)              # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = grouped_experts(x, ids, weights, gate_up, down)
    for seed in (2, 3):
        new_ids, new_weights = _routing(tokens, seed)
        ids.copy_(new_ids)
        weights.copy_(new_weights)
        x.copy_(torch.randn(tokens, HIDDEN, device="cuda").bfloat16())
        graph.replay()
        torch.testing.assert_close(out, grouped_experts(x, ids, weights, gate_up, down), rtol=0, atol=0)
