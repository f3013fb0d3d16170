"""RMSNorm and SiLU-and-mul with the per-token FP8 quantization of their output fused in
(``quantize=True``): bit for bit the unfused kernel followed by ``quantize_rows`` (the same e4m3 bytes and
scales), all-zero rows included; under the interpreter on the CPU, compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from radixrelay.kernels.fp8 import QuantizedRows
from radixrelay.kernels.fp8_quant import quantize_rows
from radixrelay.kernels.rms_norm import rms_norm
from radixrelay.kernels.silu_mul import silu_mul
from tests.kernels.helpers import DEVICE

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _rand(shape, dtype, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(shape, generator=gen)).to(dtype).to(DEVICE)


def _assert_same_quantization(got: QuantizedRows, y: torch.Tensor) -> None:
    q, scale = quantize_rows(y)
    assert isinstance(got, QuantizedRows) and got.dtype == y.dtype
    assert got.q.dtype == torch.float8_e4m3fn and got.q.shape == y.shape and got.scale.shape == (y.shape[0], 1)
    assert torch.equal(got.q.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(got.scale, scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])      # 96: a masked tail (BLOCK 128)
def test_rms_norm_quantized_equals_quantize_rows_of_rms_norm(dtype, hidden):
    x, r = _rand((6, hidden), dtype, 0, 3.0), _rand((6, hidden), dtype, 1)
    w = _rand((hidden,), dtype, 2)
    x[4], r[4] = 0, 0                                  # an all-zero row (with the residual too): scale 1
    got = rms_norm(x, w, 1e-5, quantize=True)
    _assert_same_quantization(got, rms_norm(x, w, 1e-5))
    assert got.scale[4].item() == 1.0 and not got.q[4].float().any()
    got, s = rms_norm(x, w, 1e-5, residual=r, quantize=True)
    y_ref, s_ref = rms_norm(x, w, 1e-5, residual=r)
    _assert_same_quantization(got, y_ref)
    assert torch.equal(s, s_ref)                       # the new residual stream, written as without quantize
    assert got.scale[4].item() == 1.0


def test_rms_norm_quantized_output_takes_the_promoted_dtype():
    x, w = _rand((3, 64), torch.bfloat16, 3), _rand((64,), torch.float32, 4)
    got = rms_norm(x, w, 1e-6, quantize=True)
    _assert_same_quantization(got, rms_norm(x, w, 1e-6))       # y in float32 (promoted), quantized from it
    assert got.dtype == torch.float32


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [48, 1100])        # 1100: a row over several of the unfused kernel's blocks
def test_silu_mul_quantized_equals_quantize_rows_of_silu_mul(dtype, inter):
    x = _rand((4, 2 * inter), dtype, 5, 2.0)
    x[2] = 0                                           # an all-zero row: scale 1
    got = silu_mul(x, quantize=True)
    _assert_same_quantization(got, silu_mul(x))
    assert got.scale[2].item() == 1.0 and not got.q[2].float().any()


def test_quantized_variants_take_empty_batches_and_refuse_wide_rows():
    w = _rand((64,), torch.float32, 0)
    empty = rms_norm(torch.empty(0, 64, device=DEVICE), w, 1e-6, quantize=True)
    assert empty.q.shape == (0, 64) and empty.scale.shape == (0, 1)
    empty = silu_mul(torch.empty(0, 96, device=DEVICE), quantize=True)
    assert empty.q.shape == (0, 48) and empty.scale.shape == (0, 1)
    with pytest.raises(ValueError, match="columns"):
        silu_mul(torch.empty(1, 2 * 32769, device=DEVICE), quantize=True)


def test_quantized_rows_checks_its_layout():
    q = torch.zeros(3, 8, dtype=torch.float8_e4m3fn)
    QuantizedRows(q, torch.ones(3, 1), torch.bfloat16)
    with pytest.raises(ValueError, match="scale"):
        QuantizedRows(q, torch.ones(3), torch.bfloat16)
    with pytest.raises(ValueError, match="e4m3"):
        QuantizedRows(q.float(), torch.ones(3, 1), torch.bfloat16)
