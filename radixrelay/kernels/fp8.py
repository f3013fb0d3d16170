"""FP8 (float8 e4m3) quantization arithmetic: weights per output channel, activations per token.

API::

    quantize_weight(w) -> (q, scale)          w: [out, in] float -> q: [out, in] e4m3, scale: [out] float32
    quantize_tokens(x) -> (q, scale)          x: [T, in] float   -> q: [T, in] e4m3,   scale: [T] float32
    quantize(x, scale) -> q                   x / scale[:, None], clamped to +-E4M3_MAX, rounded to e4m3
    dequantize(q, scale) -> float32           q * scale[:, None]
    emulated_linear(x, q_w, s_w) -> float32   x: [T, in]: x quantized per token, times w^T, both dequantized
    QuantizedRows(q, scale, dtype)            activations quantized per token, handed to an FP8 product

A row's scale is its largest magnitude over ``E4M3_MAX`` (448), so its largest value lands on +-448
exactly; an all-zero row gets scale 1 (its values stay 0). Values are divided by the scale in float32,
clamped to +-448 (e4m3fn has no infinity, and a value past 448 would otherwise round to NaN or
saturate depending on the implementation) and rounded to the nearest e4m3 value, ties to even (torch's
cast). ``emulated_linear`` is the CPU emulation of an FP8 product (``torch._scaled_mm`` on Hopper): the
same quantization, the product of the dequantized operands in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


@dataclass(frozen=True)
class QuantizedRows:
    """Activations quantized per token by the kernel that produced them (``radixrelay.kernels``: RMSNorm,
    SiLU-and-mul), for the FP8 product that takes them as they are (``Fp8Linear``).

    ``q``: [T, K] e4m3, rows contiguous; ``scale``: [T, 1] float32, the layout of
    ``kernels.fp8_quant.quantize_rows``; ``dtype``: what the activations were before quantization, and so
    what the product returns."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.q.dtype != E4M3 or self.q.dim() != 2 or self.scale.shape != (self.q.shape[0], 1):
            raise ValueError(f"QuantizedRows: q must be [T, K] e4m3 and scale [T, 1], got q {tuple(self.q.shape)} "
                             f"{self.q.dtype}, scale {tuple(self.scale.shape)}")


def row_scales(x: torch.Tensor) -> torch.Tensor:
    """[R, C] -> [R] float32: each row's largest magnitude over E4M3_MAX; 1 for an all-zero row."""
    if x.dim() != 2:
        raise ValueError(f"fp8: expected a 2-D tensor, got shape {tuple(x.shape)}")
    amax = x.detach().abs().amax(dim=1).float()
    if not torch.isfinite(amax).all():
        raise ValueError("fp8: the tensor holds inf or NaN; it cannot be scaled")
    return torch.where(amax > 0, over_e4m3_max(amax), torch.ones_like(amax))


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[R, C] by a per-row ``scale`` [R] -> [R, C] e4m3."""
    if scale.shape != (x.shape[0],):
        raise ValueError(f"fp8: scale must be [{x.shape[0]}], got {tuple(scale.shape)}")
    return (x.float() / scale.float()[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def over_e4m3_max(amax: torch.Tensor) -> torch.Tensor:
    """``amax / E4M3_MAX`` rounded to nearest on every device: divided by a tensor, since CUDA torch
    multiplies by the reciprocal of a Python-number divisor (one ulp off the CPU's quotient)."""
    return amax / torch.full_like(amax, E4M3_MAX)


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear layer's weight [out, in], per output channel."""
    scale = row_scales(w)
    return quantize(w, scale), scale


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [T, in], per token (dynamic: scales from this batch's values)."""
    scale = row_scales(x)
    return quantize(x, scale), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float()[:, None]


def emulated_linear(x: torch.Tensor, q_w: torch.Tensor, s_w: torch.Tensor) -> torch.Tensor:
    """x: [T, in] -> [T, out] float32, as an FP8 product computes it: x quantized per token, then
    (q_x q_w^T) scaled by the token's and the channel's scales."""
    q_x, s_x = quantize_tokens(x)
    return (q_x.float() @ q_w.float().t()) * s_x[:, None] * s_w.float()[None, :]


def round_e4m3_reference(v: torch.Tensor) -> torch.Tensor:
    """float64 values within +-E4M3_MAX -> the nearest e4m3fn value (ties to even), in float64: 4 exponent
    bits (bias 7), 3 mantissa bits, subnormals below 2^-6 in steps of 2^-9. For tests."""
    v = v.double()
    mag = v.abs()
    exp = torch.floor(torch.log2(torch.where(mag > 0, mag, torch.ones_like(mag)))).clamp(min=-6)
    step = torch.exp2(exp - 3)
    rounded = torch.round(mag / step) * step           # torch.round: half to even
    return torch.copysign(torch.where(mag > 0, rounded, torch.zeros_like(mag)), v)


def fake_quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """K or V [T, H, D] -> the values an e4m3 cache with ``scale`` gives back, in x's dtype (the emulation)."""
    return ((x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).float() * scale).to(x.dtype)
