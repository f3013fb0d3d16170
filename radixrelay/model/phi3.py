"""Phi-3 (mini, small, medium; 4k and 128k contexts): the Llama block with q/k/v fused into one
``qkv_proj`` and gate/up into one ``gate_up_proj`` in the checkpoint, and LongRoPE scaling (``longrope``,
once ``su``) for the long-context models (``RopeScaling``, ``RotaryEmbedding``).

The fused tensors are split at load into the decoder's HF names (``q_proj``, ``k_proj``, ``v_proj``;
``gate_proj``, ``up_proj``), so tensor parallelism slices and FP8 quantizes them as it does Llama's.
Torch-free at import: the split only calls tensor methods.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from radixrelay.model.config_hooks import every_layer, layer_windows
from radixrelay.model.rope_scaling import RopeScaling

# fused checkpoint module -> the decoder's modules it holds, in row order
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# llama.cpp's phi3 keeps both fusions: q/k/v as attn_qkv, gate/up as ffn_up (split by checkpoint_tensors)
GGUF_NAMES = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}


def hf_options(cfg: Mapping[str, Any]) -> dict[str, Any]:
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"config.json: partial rotary embeddings (partial_rotary_factor {partial}) are not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act {cfg['hidden_act']!r} on a Phi-3 model is not supported")
    return layer_windows(cfg, every_layer)


def gguf_options(meta: Mapping[str, Any], _shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """llama.cpp's ``phi3``: NEOX RoPE (rows not permuted); a sliding window on every layer where the
    metadata gives one; LongRoPE as per-frequency factor tensors (``rope_factors_long`` / ``_short``, handed
    over with the metadata by ``config_files.gguf_config``) with the original context and the attention
    factor in the metadata."""
    options: dict[str, Any] = {}
    window = meta.get("phi3.attention.sliding_window")
    layers = int(meta.get("phi3.block_count", 0))
    if window and layers:
        options["layer_windows"] = (int(window),) * layers
    long, short = meta.get("rope_factors_long.weight"), meta.get("rope_factors_short.weight")
    if long is not None or short is not None:
        original = meta.get("phi3.rope.scaling.original_context_length")
        if long is None or short is None or original is None:
            raise ValueError("GGUF: phi3 LongRoPE needs rope_factors_long, rope_factors_short and "
                             "phi3.rope.scaling.original_context_length")
        params = {"rope_type": "longrope", "short_factor": list(short), "long_factor": list(long),
                  "original_max_position_embeddings": int(original)}
        if meta.get("phi3.rope.scaling.attn_factor") is not None:
            params["attention_factor"] = float(meta["phi3.rope.scaling.attn_factor"])
        options["rope_scaling"] = RopeScaling.from_hf(params, {"max_position_embeddings": meta.get("phi3.context_length")})
    return options


def checkpoint_tensors(weights: Iterable[tuple[str, Any]], config: Any) -> Iterator[tuple[str, Any]]:
    """Each fused tensor (weight, bias, or an FP8 per-channel ``weight_scale``) as its parts; a per-tensor
    scale is given to every part."""
    for name, tensor in weights:
        parts = name.rsplit(".", 2)
        if len(parts) < 3 or parts[1] not in _FUSED:
            yield name, tensor
            continue
        prefix, fused, kind = parts
        if fused == "qkv_proj":
            sizes = [config.q_size, config.kv_size, config.kv_size]
        else:
            sizes = [config.intermediate_size] * 2
        if kind == "weight_scale" and tensor.numel() == 1:
            pieces = [tensor] * len(sizes)
        elif tensor.shape[0] != sum(sizes):
            raise ValueError(f"load_weights: {name!r} has {tensor.shape[0]} rows, expected {sum(sizes)}")
        else:
            pieces = tensor.split(sizes)
        for part, piece in zip(_FUSED[fused], pieces):
            yield f"{prefix}.{part}.{kind}", piece
