"""Helpers the families' config hooks share (``radixrelay.model.architectures``); torch-free."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


def layer_windows(cfg: Mapping[str, Any], sliding: Callable[[int], bool]) -> dict[str, Any]:
    """``{"layer_windows": ...}``: each layer's sliding window (0: full attention) from ``sliding_window``
    and, per layer, ``layer_types`` ("sliding_attention" / "full_attention", transformers 5) where the
    config has it, else the family's rule ``sliding(layer)``. No window: ``{}``."""
    window = cfg.get("sliding_window")
    if not window:
        return {}
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != layers or any(t not in ("sliding_attention", "full_attention") for t in types):
            raise ValueError(f"config.json: layer_types must be {layers} of sliding_attention / full_attention, "
                             f"got {types}")
        flags = [t == "sliding_attention" for t in types]
    else:
        flags = [sliding(i) for i in range(layers)]
    return {"layer_windows": tuple(int(window) if f else 0 for f in flags)} if any(flags) else {}


def every_layer(_layer: int) -> bool:
    return True


def qwen_windows(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen2/3: windows only with ``use_sliding_window``, on the layers from ``max_window_layers`` on."""
    if not cfg.get("use_sliding_window"):
        return {}
    first = cfg.get("max_window_layers", 0)
    return layer_windows(cfg, lambda layer: layer >= first)
