"""The CPU products' two paths (``radixrelay.model.cpu_gemm``): oneDNN and BLAS agree to float32
rounding, each mode does what it says, and bad settings are errors."""

import pytest
import torch
import torch.nn.functional as F

from radixrelay.model import cpu_gemm
from radixrelay.model.cpu_gemm import cpu_gemm_mode, linear, set_cpu_gemm, uses_onednn
from tests.model.paged import PagedSession


@pytest.fixture
def mode():
    """Restore the mode after a test changes it."""
    saved = cpu_gemm._mode
    yield set_cpu_gemm
    cpu_gemm._mode = saved


def _float64_error(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> float:
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("rows", [1, 3, 8, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_and_blas_agree_to_float32_rounding(mode, rows, bias):
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 576, generator=gen), torch.randn(960, 576, generator=gen)
    b = torch.randn(960, generator=gen) if bias else None
    mode("blas")
    assert not uses_onednn(x)
    blas = linear(x, w, b)
    assert torch.equal(blas, F.linear(x, w, b))
    mode("auto")
    auto = linear(x, w, b)
    assert auto.shape == (rows, 960) and auto.dtype == torch.float32
    # both are float32 sums of 576 products: within ~1e-6 of the float64 result's scale
    assert _float64_error(blas, x, w, b) < 1e-5
    assert _float64_error(auto, x, w, b) < 1e-5


def test_onednn_runs_here_and_takes_the_shapes_the_model_gives(mode):
    """torch's CPU wheel has oneDNN: auto uses it for float32 (so the Engine's default path is tested
    here), for 3-d, empty and strided activations too; float64 stays on F.linear."""
    mode("onednn")
    x = torch.randn(4, 64)
    assert uses_onednn(x)
    assert not uses_onednn(x.double())
    w = torch.randn(32, 64)
    x3 = torch.randn(2, 5, 64)
    torch.testing.assert_close(linear(x3, w), F.linear(x3, w), atol=1e-5, rtol=1e-5)
    assert linear(torch.randn(0, 64), w).shape == (0, 32)
    strided = torch.randn(6, 128)[:, ::2]
    torch.testing.assert_close(linear(strided, w), F.linear(strided, w), atol=1e-5, rtol=1e-5)
    assert torch.equal(linear(x.double(), w.double()), F.linear(x.double(), w.double()))


def test_bad_mode_is_an_error(mode, monkeypatch):
    with pytest.raises(ValueError, match="mode must be one of auto, onednn, blas"):
        set_cpu_gemm("mkl")
    monkeypatch.setattr(cpu_gemm, "_mode", "fast")           # as a bad RADIXRELAY_CPU_GEMM leaves it
    with pytest.raises(ValueError, match="RADIXRELAY_CPU_GEMM must be one of"):
        cpu_gemm_mode()
    with pytest.raises(ValueError, match="RADIXRELAY_CPU_GEMM"):
        linear(torch.randn(2, 4), torch.randn(3, 4))


def test_failed_check_falls_back_to_blas_in_auto_and_raises_in_onednn(mode, monkeypatch):
    monkeypatch.setattr(cpu_gemm, "_onednn_ok", None)
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    mode("auto")
    x, w = torch.randn(3, 16), torch.randn(8, 16)
    assert not uses_onednn(x)
    assert torch.equal(linear(x, w), F.linear(x, w))
    mode("onednn")
    with pytest.raises(RuntimeError, match="not usable"):
        linear(x, w)


def test_model_logits_agree_between_modes(mode, ours, prompts):
    """The default model (fused q/k/v, fused gate/up, the LM head) on a ragged batch in both modes:
    logits agree to float32 rounding and greedy picks are the same."""
    model, _ = ours

    def logits() -> torch.Tensor:
        session = PagedSession(model, num_pages=64, page_size=16, seed=1)
        for rid, p in enumerate(prompts):
            session.add(rid, p)
        return session.step([(rid, len(p)) for rid, p in enumerate(prompts)], all_logits=True)

    mode("blas")
    blas = logits()
    mode("auto")
    auto = logits()
    assert (auto - blas).abs().max().item() < 1e-3
    assert torch.equal(auto.argmax(-1), blas.argmax(-1))
