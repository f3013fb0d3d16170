"""Qwen3-MoE: the Qwen3 block (per-head q/k norms, explicit ``head_dim``) with routed experts
(``radixrelay.model.moe``) as the MLP of the layers from ``decoder_sparse_step`` outside ``mlp_only_layers``
(the others keep a dense MLP of ``intermediate_size``): ``num_experts`` SwiGLU experts of width
``moe_intermediate_size``, each token sent to ``num_experts_per_tok`` of them with the router's softmax over
every expert as weights, divided by the chosen ones' sum where ``norm_topk_prob``. No shared expert.

Checkpoint names are the decoder's (``mlp.gate``, ``mlp.experts.<e>.gate_proj`` ...); experts stacked in one
tensor (transformers 5) are split per expert. GGUF (llama.cpp ``qwen3moe``): NEOX RoPE, the q/k norms as
Qwen3's, the experts as ``config_hooks.gguf_experts`` reads them (top-k weights always renormalized, as
llama.cpp computes them). Torch-free at import.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from radixrelay.model.config_hooks import (
    gguf_experts,
    per_expert_tensors,
    qwen_windows,
    routed_layers,
)


def hf_options(cfg: Mapping[str, Any]) -> dict[str, Any]:
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ValueError("config.json: attention_bias/mlp_bias on a Qwen3-MoE model is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act {cfg['hidden_act']!r} on a Qwen3-MoE model is not supported")
    if cfg.get("shared_expert_intermediate_size"):
        raise ValueError("config.json: a shared expert (Qwen2-MoE's) is not supported")
    options: dict[str, Any] = {"qk_norm": True, **qwen_windows(cfg)}
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    layers = routed_layers(cfg["num_hidden_layers"], cfg.get("mlp_only_layers") or (),
                           cfg.get("decoder_sparse_step", 1)) if experts else ()
    if layers:
        options.update(num_experts=experts, num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                       moe_intermediate_size=int(cfg["moe_intermediate_size"]), moe_layers=layers,
                       moe_renormalize=bool(cfg.get("norm_topk_prob", False)))
    return options


def checkpoint_tensors(weights: Iterable[tuple[str, Any]], _config: Any) -> Iterator[tuple[str, Any]]:
    for name, tensor in weights:
        yield from per_expert_tensors(name, tensor) or ((name, tensor),)


def gguf_options(meta: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    if "blk.0.attn_q_norm.weight" not in shapes:
        raise ValueError("GGUF: a qwen3moe file without blk.0.attn_q_norm.weight")
    return {"qk_norm": True, **gguf_experts(meta, shapes, "qwen3moe")}
