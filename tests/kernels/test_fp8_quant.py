"""Per-row FP8 quantization in one kernel (``radixrelay.kernels.fp8_quant``) against the torch ops it replaces,
under the interpreter. The values here divide onto the e4m3 grid exactly (each row's largest magnitude is
448 times a power of two, the others grid values times the same power), because the interpreter's own
fp32 -> e4m3 rounding is wrong just under a power of two; general values are checked on the GPU
(tests/model/test_fp8_cuda.py)."""

from __future__ import annotations

import pytest
import torch

from radixrelay.kernels.fp8_quant import quantize_rows, quantize_rows_reference
from tests.kernels.helpers import DEVICE


def _grid_rows(rows: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    grid = (torch.randn(rows, cols, generator=gen) * 60).to(torch.float8_e4m3fn).float()
    grid[:, 0] = 448.0 * torch.sign(torch.randn(rows, generator=gen))         # the row's largest magnitude
    powers = 2.0 ** torch.randint(-6, 6, (rows, 1), generator=gen).float()
    return grid * powers


@pytest.mark.parametrize("dtype,cols", [(torch.float32, 96), (torch.bfloat16, 64)])
def test_quantize_rows_equals_the_torch_ops(dtype, cols):
    x = _grid_rows(5, cols, cols).to(dtype).to(DEVICE)
    x[3] = 0                                                                   # an all-zero row: scale 1
    q, scale = quantize_rows(x)
    q_ref, scale_ref = quantize_rows_reference(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (5, 1) and scale.dtype == torch.float32
    assert torch.equal(scale, scale_ref) and scale[3].item() == 1.0
    assert torch.equal(q.float(), q_ref.float())
    assert q.float()[:, 0].abs().tolist() == [448.0, 448.0, 448.0, 0.0, 448.0]


def test_quantize_rows_refuses_bad_input():
    with pytest.raises(ValueError, match="rows, cols"):
        quantize_rows(torch.zeros(2, 3, 4, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        quantize_rows(torch.zeros(8, 4, device=DEVICE).t())
    q, scale = quantize_rows(torch.zeros(0, 16, device=DEVICE))
    assert q.shape == (0, 16) and scale.shape == (0, 1)
