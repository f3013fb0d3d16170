"""Helpers the families' config hooks share (``radixrelay.model.architectures``); torch-free."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def window_cap(cfg: Mapping[str, Any], *, always: bool) -> dict[str, Any]:
    """Sliding-window attention is not implemented: within the window it equals full attention, so the
    usable context is capped at the window instead of silently diverging past it. ``always``: the
    family uses ``sliding_window`` whenever it is set (Mistral), else only with ``use_sliding_window``."""
    window = cfg.get("sliding_window")
    if window and (always or cfg.get("use_sliding_window")):
        return {"max_position_embeddings": min(cfg.get("max_position_embeddings", 4096), window)}
    return {}
