"""RoPE scaling of a model (``RopeScaling``), as HF configs and GGUF metadata give it; torch-free (the
frequencies themselves: ``radixrelay.model.layers.rope_inv_freq``)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ROPE_TYPES = ("default", "linear", "llama3", "longrope")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``linear`` divides every frequency by ``factor``; ``llama3``
    divides only the low frequencies (wavelength above ``original_max_position_embeddings /
    low_freq_factor``) and interpolates smoothly up to the high-frequency band. ``longrope`` (Phi-3;
    HF's ``su`` too) divides frequency i by ``short_factor[i]`` at positions below
    ``original_max_position_embeddings`` and by ``long_factor[i]`` from there on, and scales cos and sin
    by ``attention_factor`` (default: ``sqrt(1 + ln(factor) / ln(original))``, ``factor`` the model's
    context over the original one; 1 when that is <= 1)."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()        # longrope: one per frequency (head_dim / 2)
    long_factor: tuple[float, ...] = ()
    attention_factor: float | None = None       # longrope: None until ``from_hf`` derives it

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(
                f"RopeScaling.rope_type: unsupported {self.rope_type!r}, expected one of {ROPE_TYPES}"
            )
        if self.factor <= 0:
            raise ValueError(f"RopeScaling.factor: must be > 0, got {self.factor}")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
            raise ValueError(
                "RopeScaling: llama3 needs high_freq_factor > low_freq_factor > 0, got "
                f"{self.high_freq_factor} and {self.low_freq_factor}"
            )
        if self.rope_type == "longrope":
            if not self.short_factor or len(self.short_factor) != len(self.long_factor):
                raise ValueError("RopeScaling: longrope needs short_factor and long_factor of one length, got "
                                 f"{len(self.short_factor)} and {len(self.long_factor)}")
            if self.attention_factor is None or self.attention_factor <= 0:
                raise ValueError(f"RopeScaling.attention_factor: must be > 0, got {self.attention_factor}")

    @classmethod
    def from_hf(cls, params: Mapping[str, Any] | None, cfg: Mapping[str, Any] | None = None) -> RopeScaling | None:
        """Parse HF ``rope_scaling`` (transformers 4) or ``rope_parameters`` (transformers 5); ``cfg``: the
        whole ``config.json``, where longrope's ``original_max_position_embeddings`` and the context
        that sets its default attention factor may sit."""
        if not params:
            return None
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "default":
            return None
        fields = {f.name for f in dataclasses.fields(cls)} - {"rope_type"}
        values = {k: v for k, v in params.items() if k in fields}
        if rope_type in ("longrope", "su"):
            values.update(_longrope_values(params, cfg or {}))
            rope_type = "longrope"
        return cls(rope_type=rope_type, **values)


def _longrope_values(params: Mapping[str, Any], cfg: Mapping[str, Any]) -> dict[str, Any]:
    """LongRoPE's fields the way HF reads them: factors as tuples, the original context from the RoPE
    parameters or the config, and the attention factor derived from the contexts' ratio where not given."""
    original = params.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    if original is None:
        raise ValueError("config.json: longrope RoPE scaling needs original_max_position_embeddings")
    factor = params.get("factor") or cfg.get("max_position_embeddings", original) / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {"original_max_position_embeddings": int(original), "factor": float(factor),
            "attention_factor": float(attention),
            "short_factor": tuple(float(f) for f in params.get("short_factor") or ()),
            "long_factor": tuple(float(f) for f in params.get("long_factor") or ())}
