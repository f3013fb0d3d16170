"""Mixtral: the Mistral block with every MLP replaced by routed experts (``radixrelay.model.moe``):
``num_local_experts`` SwiGLU experts of width ``intermediate_size``, each token sent to
``num_experts_per_tok`` of them by a router (``block_sparse_moe.gate``) whose softmax over the chosen experts'
logits weights their outputs (softmax over every expert, top-k, divided by the top-k's sum: the same numbers).

Checkpoint names: ``block_sparse_moe.`` becomes the decoder's ``mlp.``, an expert's ``w1`` / ``w3`` / ``w2`` its
``gate_proj`` / ``up_proj`` / ``down_proj``; experts stacked in one tensor (transformers 5) are split per
expert. The decoder stacks them again at load into ``[E, ...]`` parameters. Torch-free at import.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from radixrelay.model.config_hooks import every_layer, layer_windows, per_expert_tensors

_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def hf_options(cfg: Mapping[str, Any]) -> dict[str, Any]:
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act {cfg['hidden_act']!r} on a Mixtral model is not supported")
    layers = cfg["num_hidden_layers"]
    return {"num_experts": int(cfg["num_local_experts"]), "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
            "moe_intermediate_size": int(cfg["intermediate_size"]), "moe_layers": tuple(range(layers)),
            "moe_renormalize": True, **layer_windows(cfg, every_layer)}


def checkpoint_tensors(weights: Iterable[tuple[str, Any]], _config: Any) -> Iterator[tuple[str, Any]]:
    for name, tensor in weights:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        parts = name.split(".")
        if len(parts) >= 3 and parts[-3].isdigit() and parts[-4:-3] == ["experts"] and parts[-2] in _EXPERT_NAMES:
            parts[-2] = _EXPERT_NAMES[parts[-2]]
            name = ".".join(parts)
        yield from per_expert_tensors(name, tensor) or ((name, tensor),)
