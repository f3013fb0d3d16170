"""Building blocks of the Llama family: RMSNorm and rotate-half RoPE (HF convention), and the switch
between the unfused torch ops and the fused Triton kernels (``radixrelay.kernels``: RMSNorm with its
residual add, RoPE with the K/V store, SiLU-and-mul).

Fused kernels: by default on CUDA, where each op of the unfused forms is a kernel launch (small
elementwise kernels were a large share of a decode step's launches and device time); the
torch ops elsewhere (the CPU matches HF transformers bit for bit). ``set_fused_kernels`` overrides it
(tests run the kernels under the Triton interpreter; "off" on a GPU for comparisons).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

from radixrelay.attention.kv_cache import write_slots
from radixrelay.model.model_config import ModelConfig, RopeScaling
from radixrelay.model.cpu_gemm import linear

_fused_mode = "auto"


def set_fused_kernels(mode: str) -> None:
    """"auto" (fused on CUDA), "on" (everywhere: the Triton interpreter on the CPU) or "off"."""
    global _fused_mode
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"set_fused_kernels: mode must be auto, on or off, got {mode!r}")
    _fused_mode = mode


def fused(x: torch.Tensor) -> bool:
    """Whether ops on ``x`` run as the fused Triton kernels."""
    return _fused_mode == "on" or (_fused_mode == "auto" and x.is_cuda)


_skip_init: ContextVar[bool] = ContextVar("skip_init", default=False)


@contextmanager
def uninitialised_parameters() -> Iterator[None]:
    """``Linear`` and ``Embedding`` made inside allocate their parameters without the default random
    fill, for loaders that write every parameter next (the fill is most of building a model on the
    host)."""
    token = _skip_init.set(True)
    try:
        yield
    finally:
        _skip_init.reset(token)


class Linear(nn.Linear):
    """``nn.Linear`` whose float32 CPU products run through ``radixrelay.model.cpu_gemm.linear``."""

    def reset_parameters(self) -> None:
        if not _skip_init.get():
            super().reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        if not _skip_init.get():
            super().reset_parameters()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        # The output feeds an FP8 product that takes it quantized (set by the decoder layer): the fused
        # kernel writes e4m3 rows and scales instead of norm(x).
        self.quantize_output = False

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x: [T, dim] -> norm(x); with ``residual``: (norm(x + residual), x + residual). With
        ``quantize_output``, where the fused kernel runs, norm(x) comes as ``QuantizedRows``
        (``radixrelay.kernels.fp8``); the torch ops return it unquantized (the product quantizes it)."""
        if fused(x):
            from radixrelay.kernels.rms_norm import rms_norm

            return rms_norm(x, self.weight, self.eps, residual, quantize=self.quantize_output)
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H, dim] -> each head normed (the torch ops on every device; q/k norms)."""
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and x.dtype == self.weight.dtype == torch.float32:
            # One op instead of six; on the CPU it computes the formula below bit for bit.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in fp32, scale in the model dtype (matches HF LlamaRMSNorm).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], float32, with the config's scaling applied (longrope: those
    of the positions below its original context, ``short_factor``'s)."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    scaling = config.rope_scaling
    if scaling is not None and scaling.rope_type == "longrope":
        return _longrope_inv_freq(config, scaling.short_factor)
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    return _llama3_inv_freq(inv_freq, scaling)


def _longrope_inv_freq(config: ModelConfig, factors: tuple[float, ...]) -> torch.Tensor:
    """LongRoPE: frequency i divided by ``factors[i]`` (HF's ``1 / (factor * base ** (2i / D))``)."""
    exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64).float() / config.head_dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * config.rope_theta ** exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by ``factor``, short ones kept, and a linear
    blend (in ``context / wavelength``) between the two bands."""
    old_ctx = s.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_ctx / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    out = torch.where(wavelen > old_ctx / s.low_freq_factor, inv_freq / s.factor, inv_freq)
    mid = (wavelen <= old_ctx / s.low_freq_factor) & (wavelen >= old_ctx / s.high_freq_factor)
    return torch.where(mid, blended, out)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE computed from positions on the fly (no position-length cache), once per step
    in the layout ``apply_rope`` consumes. LongRoPE (Phi-3): a position below the original context
    takes the short factors' frequencies and any later one the long factors', and cos and sin are scaled
    by the attention factor. The choice is per position, not per sequence: a token's K/V depends only on
    its position, as the prefix cache needs (HF switches a whole forward to the long factors once its
    last position passes the original context: the same for decodes, not for a prompt longer than it)."""

    def __init__(self, config: ModelConfig, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(config).to(device), persistent=False)
        scaling = config.rope_scaling
        longrope = scaling is not None and scaling.rope_type == "longrope"
        # longrope: the frequencies from position ``long_from`` on; cos and sin scaled by ``magnitude``
        self.long_from = scaling.original_max_position_embeddings if longrope else None
        long = _longrope_inv_freq(config, scaling.long_factor).to(device) if longrope else None
        self.register_buffer("long_inv_freq", long, persistent=False)
        self.magnitude = float(scaling.attention_factor) if longrope else 1.0
        self.single = True        # every layer rotates by this one (not Gemma 3's two bases)

    @property
    def shifts_exactly(self) -> bool:
        """Whether RoPE at position p + d is RoPE at p rotated by ``self(d)`` (what shifted KV loads do):
        not where the frequencies depend on the position (longrope), cos and sin are scaled, or some layers
        rotate by another RoPE."""
        return self.long_inv_freq is None and self.magnitude == 1.0 and self.single

    def set_freq_factors(self, factors: torch.Tensor) -> None:
        """Divide the frequencies by per-frequency factors (GGUF ``rope_freqs``, llama3 models)."""
        if factors.shape != self.inv_freq.shape:
            raise ValueError(f"rope_freqs: shape {tuple(factors.shape)} != {tuple(self.inv_freq.shape)}")
        self.inv_freq = self.inv_freq / factors.to(self.inv_freq)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: int [T] -> (cos, sin), each float32 [T, head_dim]: ``cos`` repeated for both halves,
        ``sin`` negated on the first half (``[-sin, sin]``), as ``apply_rope`` takes them."""
        inv_freq = self.inv_freq[None, :]                                      # [1 or T, D / 2]
        if self.long_inv_freq is not None:
            inv_freq = torch.where((positions >= self.long_from)[:, None], self.long_inv_freq, inv_freq)
        freqs = positions.float()[:, None] * inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        if self.magnitude != 1.0:
            cos, sin = cos * self.magnitude, sin * self.magnitude
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin: [T, D] from ``RotaryEmbedding`` -> rotated x (rotate-half, pairing i
    with i + D/2): ``[x1 * cos - x2 * sin, x2 * cos + x1 * sin]``, the same roundings as HF's
    ``x * cos + rotate_half(x) * sin`` (negating a product is exact)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((x2, x1), dim=-1)
    out = x * cos[:, None, :].to(x.dtype)
    return out.add_(rotated * sin[:, None, :].to(x.dtype))


def rope_and_store_reference(qkv, cos, sin, slots, k_cache, v_cache, num_q_heads: int, num_kv_heads: int):
    """The unfused model's ops (``apply_rope`` twice, ``KVCache.store``), same contract."""
    head_dim = k_cache.shape[2]
    q, k, v = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = apply_rope(q.reshape(-1, num_q_heads, head_dim), cos, sin)
    k = apply_rope(k.reshape(-1, num_kv_heads, head_dim), cos, sin)
    write_slots(k_cache, slots, k)
    write_slots(v_cache, slots, v.reshape(-1, num_kv_heads, head_dim))
    return q
