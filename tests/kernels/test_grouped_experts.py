"""The grouped-expert GEMMs (radixrelay.kernels.grouped_experts) under the interpreter against a float64
reference: the plan's padded layout exactly, then both launches and the weighted sum with experts chosen by
none, shapes that do not fill a tile, blocks of 16 and 32 rows; the model's MoE layer through the kernels
equals its CPU path."""

from __future__ import annotations

import pytest
import torch

from radixrelay.kernels.grouped_experts import (
    grouped_experts,
    grouped_experts_reference,
    padded_rows,
    plan_experts,
    warm_up_variants,
)
from tests.kernels.helpers import DEVICE, tolerance


def test_plan_lays_out_pairs_by_expert():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]], device=DEVICE)            # pairs 0..5: experts 2 0 2 3 0 2
    plan = plan_experts(ids, num_experts=5, block=4)
    assert plan.rows.shape[0] == padded_rows(6, 5, 4) == 24
    m = 6
    # expert 0: pairs 1, 4 in rows 0-3; expert 2: pairs 0, 2, 5 in rows 4-7; expert 3: pair 3 in rows 8-11
    assert plan.rows.tolist() == [1, 4, m, m, 0, 2, 5, m, 3, m, m, m] + [m] * 12
    assert plan.block_expert.tolist() == [0, 2, 3, -1, -1, -1]
    assert plan.dest.tolist() == [4, 0, 5, 8, 1, 6]


def _operands(tokens, k, experts, hidden, inter, dtype, seed, unused=()):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    down = torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5
    logits = torch.randn(tokens, experts, generator=gen)
    logits[:, list(unused)] -= 100
    weights, ids = torch.softmax(logits, -1).topk(k, dim=-1)
    return [t.to(DEVICE) for t in (x.to(dtype), ids, weights, gate_up.to(dtype), down.to(dtype))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, k, experts, hidden, inter, unused", [
    (5, 2, 4, 48, 40, (1,)),         # a 16-row block per expert, K and N not multiples of the tiles
    (40, 2, 4, 64, 24, ()),          # 20 pairs per expert: 32-row blocks
    (3, 3, 8, 32, 72, (5, 6, 7)),    # top-3, two column tiles of the gate/up
])
def test_grouped_experts_equal_float64(tokens, k, experts, hidden, inter, unused, dtype):
    x, ids, weights, gate_up, down = _operands(tokens, k, experts, hidden, inter, dtype, seed=tokens + k,
                                               unused=unused)
    got = grouped_experts(x, ids, weights, gate_up, down)
    want = grouped_experts_reference(x.double(), ids, weights.double(), gate_up.double(), down.double())
    assert got.shape == (tokens, hidden) and got.dtype == dtype
    tol = tolerance(dtype) * (4 if dtype == torch.bfloat16 else 1)     # bf16: rounded gate, up, silu, product
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


def test_no_tokens():
    x, ids, weights, gate_up, down = _operands(0, 2, 4, 32, 16, torch.float32, seed=0)
    assert grouped_experts(x, ids, weights, gate_up, down).shape == (0, 32)


def test_warm_up_launches_every_block_size():
    _, _, _, gate_up, down = _operands(1, 2, 4, 32, 16, torch.float32, seed=0)
    assert warm_up_variants(gate_up, down, top_k=2) == [16, 32, 64]


def test_refuses_mismatched_shapes():
    x, ids, weights, gate_up, down = _operands(3, 2, 4, 32, 16, torch.float32, seed=0)
    with pytest.raises(ValueError, match="gate_up"):
        grouped_experts(x, ids, weights, gate_up, down[:, :, :8])


@torch.no_grad()
def test_model_layer_through_the_kernels():
    """A MoE layer's ``partial`` with the fused kernels on (the CUDA path, here interpreted) equals its CPU path."""
    from radixrelay.model import ModelConfig, load_model
    from radixrelay.model.layers import set_fused_kernels

    config = ModelConfig(architecture="qwen3_moe", vocab_size=96, hidden_size=64, intermediate_size=96,
                         num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=48, moe_layers=(0,))
    model, _ = load_model(config, load_format="dummy", seed=1)
    moe = model.model.layers[0].mlp
    moe.gate.weight.normal_(0, 1, generator=torch.Generator().manual_seed(0))        # spread the routing
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(1))
    want = moe.partial(x)
    set_fused_kernels("on")
    try:
        got = moe.partial(x)
    finally:
        set_fused_kernels("auto")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
