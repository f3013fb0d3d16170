"""The per-token FP8 quantization fused into the kernels before the products (``DecoderLayer.
quantize_into_products``): on the CPU, a tiny model with real FP8 products (``torch._scaled_mm`` runs e4m3 on
the CPU too) and the fused kernels under the Triton interpreter gives the same logits with the quantization
fused or not, with one quantize launch of the layers' own per layer instead of four; the flags stay off for
the emulation and the model dtype."""

from __future__ import annotations

import pytest
import torch

from radixrelay.attention import BatchRequest, KVCache, TorchBackend, build_forward_batch
from radixrelay.kernels import fp8_quant
from radixrelay.kernels.fp8 import QuantizedRows
from radixrelay.model import LlamaForCausalLM, ModelConfig, load_model
from radixrelay.model.layers import set_fused_kernels
from radixrelay.model.loader import dummy_weights
from radixrelay.model.parallel import TensorParallel
from radixrelay.model.quantization import Fp8Linear, Precision

TINY = ModelConfig(architecture="llama", vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16)
FP8 = Precision(weights="fp8")                   # the tensor-core path (load_model refuses it off CUDA)


def _scaled_mm_runs_on_cpu() -> bool:
    one = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(one, one.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16),
                         out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return True


needs_cpu_scaled_mm = pytest.mark.skipif(not _scaled_mm_runs_on_cpu(), reason="torch._scaled_mm has no CPU e4m3 path")


@pytest.fixture
def fused_everywhere():
    set_fused_kernels("on")
    yield
    set_fused_kernels("auto")


def _fp8_model(dtype: torch.dtype = torch.bfloat16) -> LlamaForCausalLM:
    """TINY with real ``Fp8Linear`` products on the CPU (weights quantized at load, as ``load_model`` does)."""
    net = LlamaForCausalLM(TINY, dtype=dtype, device="cpu", precision=FP8)
    net.load_weights(dummy_weights(TINY, "cpu", dtype, seed=3))
    return net.eval()


class _QuantizeCalls:
    """Counts ``quantize_rows`` launches (the products quantizing their own input)."""

    def __init__(self, monkeypatch) -> None:
        self.calls, real = 0, fp8_quant.quantize_rows

        def spy(x):
            self.calls += 1
            return real(x)

        monkeypatch.setattr(fp8_quant, "quantize_rows", spy)


def _prefill_and_decode(model: LlamaForCausalLM, quantize_calls: _QuantizeCalls) -> tuple[list, list[int]]:
    """Logits of a prefill of 10 tokens and a decode of 1, and the quantize launches of each."""
    ids = torch.arange(11) * 7 % TINY.vocab_size
    cache = KVCache(num_layers=2, num_pages=4, page_size=4, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16,
                    device="cpu")
    logits, calls = [], []
    for start, n in ((0, 10), (10, 1)):
        before = quantize_calls.calls
        batch = build_forward_batch([BatchRequest([2, 0, 3], start, n)], 4, "cpu")
        logits.append(model(ids[start:start + n], batch, cache, TorchBackend()))
        calls.append(quantize_calls.calls - before)
    return logits, calls


@needs_cpu_scaled_mm
def test_fused_quantization_gives_the_same_logits_with_one_quantize_launch_per_layer(fused_everywhere, monkeypatch):
    model, spy = _fp8_model(), _QuantizeCalls(monkeypatch)
    layers = model.model.layers
    assert all(layer.input_layernorm.quantize_output and layer.post_attention_layernorm.quantize_output
               and layer.mlp.quantized_down for layer in layers)
    assert not model.model.norm.quantize_output                         # the LM head stays in the model dtype
    fused, fused_calls = _prefill_and_decode(model, spy)
    for layer in layers:
        layer.quantize_into_products(False)
    unfused, unfused_calls = _prefill_and_decode(model, spy)
    assert fused_calls == [TINY.num_layers] * 2                         # o's input only
    assert unfused_calls == [4 * TINY.num_layers] * 2                   # q/k/v, o, gate/up, down
    for got, want in zip(fused, unfused):
        assert torch.isfinite(want).all() and torch.equal(got, want)


@needs_cpu_scaled_mm
def test_a_norm_that_hands_back_the_model_dtype_is_quantized_by_its_product(fused_everywhere, monkeypatch):
    """Tensor parallel: where the all-reduce, the residual add and the norm are one kernel, the norm comes back
    in the model dtype (no quantized variant there); the product takes it and quantizes it itself."""
    from radixrelay.kernels.rms_norm import rms_norm

    def all_reduce_add(tp, x, residual, norm=None):         # the fused all-reduce's output, at one rank
        return residual + x if norm is None else rms_norm(x, norm.weight, norm.eps, residual)

    model, spy = _fp8_model(), _QuantizeCalls(monkeypatch)
    fused, _ = _prefill_and_decode(model, spy)
    monkeypatch.setattr(TensorParallel, "all_reduce_add", all_reduce_add)
    joined, calls = _prefill_and_decode(model, spy)
    # per layer o and gate/up quantize their own input; q/k/v of every layer after the first too
    assert calls == [3 * TINY.num_layers - 1] * 2
    for got, want in zip(joined, fused):
        assert torch.equal(got, want)


@needs_cpu_scaled_mm
def test_fp8_linear_takes_quantized_rows_as_its_own_quantization(fused_everywhere):
    layer = Fp8Linear(64, 48, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    layer.load_rows(0, torch.randn(48, 64, generator=gen) * 0.05)
    x = torch.randn(5, 64, generator=gen).bfloat16()
    assert layer.takes_quantized
    rows = layer.quantize_input(x)
    assert isinstance(rows, QuantizedRows) and rows.dtype == torch.bfloat16
    out = layer(rows)
    assert out.dtype == torch.bfloat16 and torch.equal(out, layer(x))
    with pytest.raises(ValueError, match="32 columns"):
        layer(layer.quantize_input(x[:, :32]))


@pytest.mark.parametrize("precision", [Precision(weights="fp8", emulate=True), Precision()],
                         ids=["fp8-emulated", "model-dtype"])
def test_the_flags_stay_off_for_the_emulation_and_the_model_dtype(precision):
    model, _ = load_model(TINY, load_format="dummy", seed=3, precision=precision)
    for layer in model.model.layers:
        assert not layer.input_layernorm.quantize_output and not layer.post_attention_layernorm.quantize_output
        assert not layer.mlp.quantized_down
    assert not Fp8Linear(8, 8, emulate=True).takes_quantized
