"""The split-K FP8 product (``radixrelay.kernels.fp8_gemm``) under the interpreter against float32 torch ops,
its rule, and the warm-up variants it adds. On the GPU (FP8 tensor cores) it is checked against
``torch._scaled_mm`` in tests/model/test_fp8_cuda.py."""

from __future__ import annotations

import pytest
import torch

from radixrelay.kernels import fp8_gemm
from radixrelay.kernels.fp8_gemm import fp8_split_k, fp8_split_k_reference, split_k_applies
from radixrelay.model.quantization import Fp8Linear
from radixrelay.worker.warmup import fp8_product_variants
from tests.kernels.helpers import DEVICE

E4M3 = torch.float8_e4m3fn


def _operands(rows: int, k: int, n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q_x = (torch.randn(rows, k, generator=gen) * 40).clamp(-448, 448).to(E4M3)
    w = (torch.randn(n, k, generator=gen) * 40).clamp(-448, 448).to(E4M3)
    s_x = torch.rand(rows, 1, generator=gen) * 0.01 + 1e-3
    s_w = torch.rand(n, generator=gen) * 0.01 + 1e-3
    return [t.to(DEVICE) for t in (q_x, s_x, w, s_w)]


@pytest.mark.parametrize("rows, n", [(1, 64), (5, 96), (64, 128), (70, 64)])
def test_split_k_product_equals_float32(rows, n):
    """Rows past a 64-row tile, output columns past a 64-column tile, K in four splits of 128."""
    q_x, s_x, w, s_w = _operands(rows, 512, n, seed=rows + n)
    got = fp8_split_k(q_x, s_x, w, s_w, torch.float32)
    want = fp8_split_k_reference(q_x, s_x, w, s_w, torch.float32)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    bf16 = fp8_split_k(q_x, s_x, w, s_w, torch.bfloat16)
    torch.testing.assert_close(bf16, want.to(torch.bfloat16), rtol=1e-2, atol=1e-3)


def test_split_k_refuses_what_it_does_not_take():
    q_x, s_x, w, s_w = _operands(3, 512, 64, seed=1)
    with pytest.raises(ValueError, match="multiple of 512"):
        fp8_split_k(q_x[:, :384], s_x, w[:, :384], s_w, torch.float32)
    with pytest.raises(ValueError, match="e4m3"):
        fp8_split_k(q_x.float(), s_x, w, s_w, torch.float32)
    assert fp8_split_k(q_x[:0], s_x[:0], w, s_w, torch.float32).shape == (0, 64)


def test_split_k_rule(monkeypatch):
    """Few rows, few output columns, K in whole splits, Hopper; on this machine (no Hopper) never."""
    assert not split_k_applies(64, 14336, 4096, torch.device("cpu"))
    monkeypatch.setattr(fp8_gemm, "split_k_capable", lambda device: True)
    assert split_k_applies(64, 14336, 4096, torch.device("cuda")) and split_k_applies(1, 4096, 4096, "cuda")
    assert not split_k_applies(65, 4096, 4096, "cuda")                  # cuBLAS from 65 rows on
    assert not split_k_applies(8, 4096, 28672, "cuda")                  # wide outputs: cuBLAS
    assert not split_k_applies(8, 4000, 4096, "cuda")                   # K not in whole splits
    assert not split_k_applies(0, 4096, 4096, "cuda")


def test_fp8_layers_take_split_k_by_rule_and_warm_it_up(monkeypatch):
    """An emulated layer never takes it; a layer the rule admits does at <= MAX_ROWS rows, and the warm-up
    lists one variant per distinct admitted shape."""
    model = torch.nn.Sequential(Fp8Linear(1024, 512, emulate=True), Fp8Linear(1024, 512, emulate=True),
                                Fp8Linear(512, 8192, emulate=True))
    assert not model[0].split_k(1) and fp8_product_variants(model, torch.bfloat16) == []
    monkeypatch.setattr(fp8_gemm, "split_k_capable", lambda device: True)
    for layer in model:
        layer.emulate, layer._split_k_rows = False, None
    assert model[0].split_k(1) and model[0].split_k(fp8_gemm.MAX_ROWS) and not model[0].split_k(65)
    assert not model[2].split_k(1)                                      # 8192 outputs: cuBLAS
    names = [v.name for v in fp8_product_variants(model, torch.bfloat16)]
    assert names == ["fp8_split_k 1024 -> 512 out=bfloat16"]
