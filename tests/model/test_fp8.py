"""FP8 quantization arithmetic (``radixrelay.kernels.fp8``) against a float64 reference: the e4m3 grid and
its rounding, per-channel and per-token scales, clamping, all-zero and all-equal rows, the emulated
FP8 product."""

from __future__ import annotations

import pytest
import torch

from radixrelay.kernels.fp8 import (
    E4M3,
    E4M3_MAX,
    dequantize,
    emulated_linear,
    quantize,
    quantize_tokens,
    quantize_weight,
    round_e4m3_reference,
    row_scales,
)


def test_the_cast_rounds_to_the_nearest_e4m3_value_ties_to_even():
    grid = torch.arange(256, dtype=torch.uint8).view(E4M3).double()
    grid = grid[torch.isfinite(grid)].unique()                    # every e4m3fn value (no NaN)
    assert grid.max() == E4M3_MAX and grid.min() == -E4M3_MAX
    mids = (grid[1:] + grid[:-1]) / 2                              # exact ties
    gen = torch.Generator().manual_seed(0)
    values = torch.cat([grid, mids, (torch.rand(20000, generator=gen, dtype=torch.float64) * 2 - 1) * E4M3_MAX,
                        torch.randn(5000, generator=gen, dtype=torch.float64) * 2.0 ** -7])   # subnormals
    want = round_e4m3_reference(values)
    got = values.to(E4M3).double()
    assert torch.equal(got, want)
    assert set(want.tolist()) <= set(grid.tolist())


def test_each_channel_s_largest_value_lands_on_the_format_s_largest():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(8, 64, generator=gen, dtype=torch.float64) * torch.logspace(-3, 2, 8, dtype=torch.float64)[:, None]
    q, scale = quantize_weight(w)
    assert q.dtype == E4M3 and scale.dtype == torch.float32 and scale.shape == (8,)
    torch.testing.assert_close(scale.double(), w.abs().amax(1) / E4M3_MAX, rtol=1e-7, atol=0)
    assert torch.equal(q.double().abs().amax(1), torch.full((8,), E4M3_MAX, dtype=torch.float64))
    want = round_e4m3_reference((w / scale.double()[:, None]).clamp(-E4M3_MAX, E4M3_MAX))
    torch.testing.assert_close(q.double(), want, rtol=0, atol=0)        # float32 division: same grid point
    rel = (dequantize(q, scale).double() - w).abs() / w.abs().amax(1, keepdim=True)
    assert rel.max() <= 2.0 ** -4                                       # half a step of 3 mantissa bits


def test_zero_and_all_equal_rows_are_exact():
    w = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25], [-3.0, -3.0, -3.0, -3.0]])
    q, scale = quantize_weight(w)
    assert scale[0] == 1.0 and torch.equal(q[0].float(), torch.zeros(4))
    assert torch.equal(dequantize(q, scale), w)                         # +-448 * amax / 448, exactly
    assert torch.equal(q[1:].float().abs(), torch.full((2, 4), E4M3_MAX))


def test_values_past_the_scale_saturate_instead_of_becoming_nan():
    x = torch.tensor([[1.0, -1e6, 1e6, 3.0]])
    q = quantize(x, torch.tensor([0.01]))
    assert torch.isfinite(q.float()).all()
    assert q.float().tolist() == [[96.0, -E4M3_MAX, E4M3_MAX, 288.0]]


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="2-D"):
        row_scales(torch.zeros(3))
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_weight(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="scale must be"):
        quantize(torch.zeros(2, 3), torch.ones(3))


def test_the_emulated_product_is_the_dequantized_operands_product():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 96, generator=gen)
    w = torch.randn(32, 96, generator=gen) * 0.05
    q_w, s_w = quantize_weight(w)
    y = emulated_linear(x, q_w, s_w)
    q_x, s_x = quantize_tokens(x)
    want = dequantize(q_x, s_x).double() @ dequantize(q_w, s_w).double().t()
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-6)
    exact = x.double() @ w.double().t()
    assert ((y.double() - exact).norm() / exact.norm()) < 0.05          # FP8's error on a random product


def test_the_sensitivity_benchmark_rounds_like_e4m3_and_to_more_bits():
    """``bench_fp8_sensitivity.round_rows``: 3 mantissa bits is the quantize / dequantize of the emulation; more
    bits keep at most that many (an integer number of steps of the value's binade) and the nearest one."""
    from benchmarks.model.bench_fp8_sensitivity import round_rows

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 200, generator=gen) * torch.logspace(-4, 2, 6)[:, None]
    x[2] = 0
    assert torch.equal(round_rows(x, 3), dequantize(*quantize_tokens(x)))
    scale = torch.where(x.abs().amax(1) > 0, x.abs().amax(1) / E4M3_MAX, torch.ones(6))[:, None]
    for bits in (4, 5, 6):
        v, r = (x / scale).double(), (round_rows(x, bits) / scale).double()
        step = torch.exp2(torch.floor(torch.log2(v.abs().clamp(min=1e-30))).clamp(min=-6) - bits)
        assert torch.allclose(r / step, torch.round(r / step), atol=1e-3)      # on the grid of ``bits`` bits
        assert ((r - v).abs() <= step / 2 * (1 + 1e-4)).all()                 # the nearest point of it
    assert torch.equal(round_rows(x, 6)[2], torch.zeros(200))


def test_the_attention_benchmark_rounds_queries_and_probabilities_like_an_fp8_kernel():
    """``bench_fp8_sensitivity.fp8_attention``: with nothing rounded ``reference._attend_matmul``'s result; queries:
    the attention of each (token, head) row's e4m3 quantize / dequantize; probabilities: exp(s - row max) on e4m3's
    grid against V over the unrounded sum; a row that attends nothing: o = 0, lse = -inf. Within
    ``fp8_attention_arithmetic`` ``attend_planned`` runs it, after it the CPU kernel again."""
    from benchmarks.model.bench_fp8_sensitivity import fp8_attention, fp8_attention_arithmetic, round_rows
    from radixrelay.attention import extend_reference, reference

    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 6, 16, generator=gen) * 3 for _ in range(3))
    mask = torch.ones(6, 6, dtype=torch.bool).tril()
    mask[0] = False                                                 # row 0 attends nothing
    bias = torch.where(mask, 0.0, float("-inf"))[None, None]
    plain = fp8_attention(q, k, v, bias, 0.25, queries=False, probs=False)
    for got, want in zip(plain, reference._attend_matmul(q, k, v, bias, 0.25)):
        assert torch.allclose(got, want, atol=1e-6)
    assert torch.equal(plain[0][:, :, 0], torch.zeros(1, 2, 16)) and plain[1][:, :, 0].isneginf().all()

    by_rows = round_rows(q.reshape(-1, 16), 3).reshape(q.shape)
    rounded_q = fp8_attention(q, k, v, bias, 0.25, queries=True, probs=False)
    for got, want in zip(rounded_q, reference._attend_matmul(by_rows, k, v, bias, 0.25)):
        assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(rounded_q[0], plain[0], atol=1e-3)

    s = q @ k.transpose(-1, -2) * 0.25 + bias
    p = torch.exp(s[:, :, 1:] - s[:, :, 1:].amax(-1, keepdim=True))
    rounded_p = fp8_attention(q, k, v, bias, 0.25, queries=False, probs=True)
    want = p.to(E4M3).float() @ v / p.sum(-1, keepdim=True)
    assert torch.allclose(rounded_p[0][:, :, 1:], want, atol=1e-5) and torch.equal(rounded_p[1], plain[1])
    ones = fp8_attention(q, k, torch.ones_like(v), bias, 0.25, queries=False, probs=True)[0][:, :, 1:, 0]
    assert not torch.allclose(ones, torch.ones_like(ones), atol=1e-4)          # not renormalised after rounding

    kernel = reference._attend_folded
    cache_k, cache_v = k[0].transpose(0, 1).contiguous(), v[0].transpose(0, 1).contiguous()     # [6, 2, 16]
    args = (q[0].transpose(0, 1).contiguous(), cache_k, cache_v, torch.tensor([[0, 1]], dtype=torch.int32), 3,
            torch.tensor([0, 6]), torch.tensor([0]))
    with fp8_attention_arithmetic(False, False):
        emulated = extend_reference(*args)
    with fp8_attention_arithmetic(True, True):
        both = extend_reference(*args)
    assert reference._attend_folded is kernel
    kernel_o, kernel_lse = extend_reference(*args)
    assert torch.allclose(emulated[0], kernel_o, atol=1e-5) and torch.allclose(emulated[1], kernel_lse, atol=1e-5)
    assert not torch.allclose(both[0], kernel_o, atol=1e-3)
