"""Building blocks of the Llama family: RMSNorm and rotate-half RoPE (HF convention)."""

from __future__ import annotations

import math

import torch
from torch import nn

from radixrelay.model.config import ModelConfig, RopeScaling


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32, scale in the model dtype (matches HF LlamaRMSNorm).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], float32, with the config's scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    return _llama3_inv_freq(inv_freq, scaling)


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
    """Rotate-half RoPE computed from positions on the fly (no position-length cache)."""

    def __init__(self, config: ModelConfig, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(config).to(device), persistent=False)

    def set_freq_factors(self, factors: torch.Tensor) -> None:
        """Divide the frequencies by per-frequency factors (GGUF ``rope_freqs``, llama3 models)."""
        if factors.shape != self.inv_freq.shape:
            raise ValueError(f"rope_freqs: shape {tuple(factors.shape)} != {tuple(self.inv_freq.shape)}")
        self.inv_freq = self.inv_freq / factors.to(self.inv_freq)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: int [T] -> (cos, sin), each float32 [T, head_dim / 2]."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin: [T, D / 2] -> rotated x (rotate-half pairing i with i + D/2)."""
    cos = cos[:, None, :].to(x.dtype)
    sin = sin[:, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
