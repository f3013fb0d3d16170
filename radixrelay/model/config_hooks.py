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


def per_expert_tensors(name: str, tensor: Any) -> list[tuple[str, Any]] | None:
    """A checkpoint's experts stacked in one tensor (transformers 5's layout: ``mlp.experts.gate_up_proj``
    [E, 2 * I, hidden], gate rows first, and ``mlp.experts.down_proj`` [E, hidden, I]) as the per-expert tensors
    the decoder loads (``mlp.experts.<e>.gate_proj.weight`` ...; views, no copies); None for any other tensor."""
    prefix, dot, leaf = name.rpartition(".")
    if not dot or not prefix.endswith(".experts") or leaf not in ("gate_up_proj", "down_proj") or tensor.dim() != 3:
        return None
    if leaf == "down_proj":
        return [(f"{prefix}.{e}.down_proj.weight", tensor[e]) for e in range(tensor.shape[0])]
    gate, up = tensor.chunk(2, dim=1)
    return [(f"{prefix}.{e}.{proj}.weight", part[e]) for e in range(tensor.shape[0])
            for proj, part in (("gate_proj", gate), ("up_proj", up))]


def routed_layers(num_layers: int, dense: Any = (), step: int = 1) -> tuple[int, ...]:
    """The layers whose MLP is routed experts: every ``step``-th (1-based, as Qwen-MoE's ``decoder_sparse_step``)
    outside ``dense`` (``mlp_only_layers``)."""
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"config.json: decoder_sparse_step must be an integer >= 1, got {step!r}")
    return tuple(i for i in range(num_layers) if i not in set(dense) and (i + 1) % step == 0)


def gguf_experts(meta: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], arch: str) -> dict[str, Any]:
    """Routed experts of a GGUF file as llama.cpp writes them (``<arch>.expert_count`` / ``expert_used_count``,
    ``expert_feed_forward_length`` where it differs from ``feed_forward_length``; per layer ``ffn_gate_inp`` and
    the stacked ``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps``): the sparse layers are those with a
    router. llama.cpp renormalizes the top-k weights of Mixtral and Qwen3-MoE alike. No experts: ``{}``."""
    experts = int(meta.get(f"{arch}.expert_count") or 0)
    if not experts:
        return {}
    layers = tuple(i for i in range(int(meta[f"{arch}.block_count"])) if f"blk.{i}.ffn_gate_inp.weight" in shapes)
    if not layers:
        raise ValueError(f"GGUF: {arch}.expert_count is {experts} but no layer has an ffn_gate_inp tensor")
    if f"blk.{layers[0]}.ffn_gate_exps.weight" not in shapes:
        raise ValueError("GGUF: experts stored one tensor each (blk.N.ffn_gate.E, an older llama.cpp layout) are "
                         "not supported; convert the model again")
    if any(name.startswith(f"blk.{layers[0]}.ffn_") and "shexp" in name for name in shapes):
        raise ValueError("GGUF: a shared expert (ffn_*_shexp) is not supported")
    width = meta.get(f"{arch}.expert_feed_forward_length") or meta[f"{arch}.feed_forward_length"]
    return {"num_experts": experts, "num_experts_per_tok": int(meta[f"{arch}.expert_used_count"]),
            "moe_intermediate_size": int(width), "moe_layers": layers, "moe_renormalize": True}
