"""Gemma 2 and Gemma 3 (text): the Llama block with

- embeddings scaled by ``sqrt(hidden_size)``; RMSNorm weights stored as offsets from 1 (``(1 + w)``:
  1 is added to every norm weight at load, after which the norm is the decoder's);
- norms around each half of the block (``sandwich_norms``: input, post-attention, pre-feedforward and
  post-feedforward norms), a GELU-tanh MLP;
- softmax scale ``query_pre_attn_scalar ** -0.5``; sliding-window layers beside global ones
  (``layer_types``, or the older configs' rule: Gemma 2 every other layer from the first, Gemma 3 all but
  every ``sliding_window_pattern``-th);
- Gemma 2: attention-logit and final-logit soft-capping;
- Gemma 3: per-head q/k norms, and two RoPE bases: the global layers' (``rope_theta``, with its
  scaling), the windowed layers' (``rope_local_base_freq``, unscaled). The multimodal checkpoints
  (``Gemma3ForConditionalGeneration``: 4B and up) are served as text: their ``text_config`` and
  language-model tensors, the vision tower skipped.

Config hooks and the norm offset (torch-free at import); the math is the decoder's switches.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from radixrelay.model.config_hooks import layer_windows
from radixrelay.model.rope_scaling import RopeScaling

_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")
# llama.cpp's names for the norms around each half (its ffn_norm is the MLP's own, before it)
GGUF_NAMES = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
              "post_ffw_norm": "post_feedforward_layernorm"}
# the 27B models (Gemma 2: 46 layers, Gemma 3: 62) scale queries by hidden / heads, the others by head_dim: a GGUF
# file does not store query_pre_attn_scalar, llama.cpp decides by the layer count
_LAYERS_27B = {"gemma2": 46, "gemma3": 62}


def gemma2_options(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {**_common(cfg), **layer_windows(cfg, lambda layer: layer % 2 == 0),
            "attn_logit_softcap": cfg.get("attn_logit_softcapping") or None,
            "final_logit_softcap": cfg.get("final_logit_softcapping") or None}


def gemma3_options(cfg: Mapping[str, Any]) -> dict[str, Any]:
    pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6))
    options = {**_common(cfg), **layer_windows(cfg, lambda layer: (layer + 1) % pattern != 0), "qk_norm": True,
               "attn_logit_softcap": cfg.get("attn_logit_softcapping") or None,
               "final_logit_softcap": cfg.get("final_logit_softcapping") or None}
    rope = cfg.get("rope_parameters") or {}
    if "full_attention" in rope or "sliding_attention" in rope:       # transformers 5: one set per layer type
        full, local = rope.get("full_attention", {}), rope.get("sliding_attention", {})
        if RopeScaling.from_hf(local) is not None:
            raise ValueError("config.json: RoPE scaling on Gemma 3's sliding-window layers is not supported")
        options.update(rope_theta=float(full.get("rope_theta", 1e6)), rope_scaling=RopeScaling.from_hf(full),
                       local_rope_theta=float(local.get("rope_theta", 1e4)))
    else:
        options["local_rope_theta"] = float(cfg.get("rope_local_base_freq", 1e4))
    return options


def _common(cfg: Mapping[str, Any]) -> dict[str, Any]:
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _GELU_TANH:
        raise ValueError(f"config.json: hidden_activation {act!r} on a Gemma model is not supported")
    if cfg.get("attention_bias") or cfg.get("use_bidirectional_attention"):
        raise ValueError("config.json: attention_bias / bidirectional attention on a Gemma model is not supported")
    return {"hidden_act": "gelu_tanh", "sandwich_norms": True, "embedding_scale": True,
            "attn_scale": float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
            "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True))}


def gemma2_gguf_options(meta: Mapping[str, Any], _shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """llama.cpp's ``gemma2``: norms stored with the 1 added, NEOX RoPE, windows on every other layer."""
    return {**_gguf_common(meta, "gemma2", pattern=2),
            "attn_logit_softcap": meta.get("gemma2.attn_logit_softcapping") or None,
            "final_logit_softcap": meta.get("gemma2.final_logit_softcapping") or None}


def gemma3_gguf_options(meta: Mapping[str, Any], _shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """llama.cpp's ``gemma3``: as Gemma 2's, with q/k norms, five windowed layers to each global one unless
    the file says otherwise, and the windowed layers' RoPE base fixed at 10000 (as llama.cpp has it)."""
    pattern = int(meta.get("gemma3.attention.sliding_window_pattern", 6))
    return {**_gguf_common(meta, "gemma3", pattern=pattern), "qk_norm": True, "local_rope_theta": 10000.0,
            "final_logit_softcap": meta.get("gemma3.final_logit_softcapping") or None}


def _gguf_common(meta: Mapping[str, Any], arch: str, *, pattern: int) -> dict[str, Any]:
    layers = int(meta[f"{arch}.block_count"])
    hidden, heads = int(meta[f"{arch}.embedding_length"]), int(meta[f"{arch}.attention.head_count"])
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    query_scalar = hidden // heads if layers == _LAYERS_27B[arch] else head_dim
    window = meta.get(f"{arch}.attention.sliding_window")
    windows = tuple(int(window) if layer % pattern < pattern - 1 else 0 for layer in range(layers)) if window else ()
    return {"hidden_act": "gelu_tanh", "sandwich_norms": True, "embedding_scale": True,
            "attn_scale": float(query_scalar) ** -0.5, "layer_windows": windows}


def checkpoint_tensors(weights: Iterable[tuple[str, Any]], _config: Any) -> Iterator[tuple[str, Any]]:
    """Gemma's RMSNorm scales by ``1 + w``: every norm weight plus one, in float32 (the decoder's norm then
    multiplies by it as HF multiplies by ``1.0 + w.float()``)."""
    for name, tensor in weights:
        if name.endswith("norm.weight"):
            tensor = tensor.float() + 1.0
        yield name, tensor


# a multimodal checkpoint's language model (both spellings transformers has saved) -> the decoder's names
_LANGUAGE_MODEL = (("language_model.model.", "model."), ("model.language_model.", "model."),
                   ("language_model.lm_head.", "lm_head."))
_VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def language_model_tensors(weights: Iterable[tuple[str, Any]], config: Any) -> Iterator[tuple[str, Any]]:
    """Gemma 3's multimodal checkpoints served as text: the language model's tensors renamed, the vision
    tower's and the projector's skipped, norms offset as ``checkpoint_tensors`` does."""
    def renamed() -> Iterator[tuple[str, Any]]:
        for name, tensor in weights:
            if name.startswith(_VISION):
                continue
            for prefix, ours in _LANGUAGE_MODEL:
                if name.startswith(prefix):
                    name = ours + name[len(prefix):]
                    break
            yield name, tensor

    return checkpoint_tensors(renamed(), config)
