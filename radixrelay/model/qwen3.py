"""Qwen3 (dense): the Llama block with an RMSNorm over each head of q and of k, before RoPE
(``q_norm``, ``k_norm``: one weight of ``head_dim`` each, shared by the heads), an explicit
``head_dim`` (often not ``hidden_size / num_attention_heads``), and no bias anywhere.

GGUF (llama.cpp ``qwen3``): NEOX RoPE (rows not permuted), the norms as ``attn_q_norm`` /
``attn_k_norm``. Config hooks only (torch-free); the math is the decoder's ``qk_norm`` switch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from radixrelay.model.config_hooks import qwen_windows


def hf_options(cfg: Mapping[str, Any]) -> dict[str, Any]:
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ValueError("config.json: attention_bias/mlp_bias on a Qwen3 model is not supported")
    return {"qk_norm": True, **qwen_windows(cfg)}


def gguf_options(_meta: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    if "blk.0.attn_q_norm.weight" not in shapes:
        raise ValueError("GGUF: a qwen3 file without blk.0.attn_q_norm.weight")
    return {"qk_norm": True}
