"""The architecture registry: what a checkpoint names its architecture -> how its config is read.

Each entry is an ``Architecture``: the names a checkpoint may give (the ``architectures`` entries
and ``model_type`` of an HF ``config.json``, ``general.architecture`` of a GGUF file) and hooks that
turn the family's own config keys into ``ModelConfig`` fields (the feature switches of the decoder:
q/k norms, biases, RoPE variants). Keys every family shares (sizes, heads, RoPE base, eos) are read
once by ``ModelConfig.from_hf`` / ``from_gguf``; a hook returns only what differs.

Every family here runs on the one decoder in ``radixrelay.model.llama``, switched by those fields (routed
experts: its MLP swapped for ``radixrelay.model.moe.SparseMoE`` on the layers that have them);
checkpoint tensors a family stores differently (Phi-3's fused q/k/v) are renamed or split to the
decoder's HF names at load (``Architecture.checkpoint_tensors``). Torch-free: the scheduler and the
HTTP server read configs without importing torch.

Adding a family: a module ``radixrelay/model/<family>.py`` with its hooks, an entry in
``ARCHITECTURES``, a test in ``tests/model/test_families.py`` against transformers, and a line in
docs/models.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from radixrelay.model import gemma, mixtral, phi3, qwen3, qwen3_moe
from radixrelay.model.config_hooks import (
    every_layer,
    gguf_experts,
    layer_windows,
    qwen_windows,
)

# config.json (dict) -> ModelConfig fields that differ from the common reading
HfHook = Callable[[Mapping[str, Any]], dict[str, Any]]
# (GGUF scalar metadata, tensor shapes in torch order) -> ModelConfig fields
GgufHook = Callable[[Mapping[str, Any], Mapping[str, tuple[int, ...]]], dict[str, Any]]
# (HF-named checkpoint tensors, the ModelConfig) -> the tensors under the decoder's HF names
TensorHook = Callable[[Iterable[tuple[str, Any]], Any], Iterator[tuple[str, Any]]]


def _nothing(*_: Any) -> dict[str, Any]:
    return {}


def _as_is(weights: Iterable[tuple[str, Any]], _config: Any) -> Iterator[tuple[str, Any]]:
    return iter(weights)


@dataclass(frozen=True)
class Architecture:
    name: str                                  # ModelConfig.architecture
    hf_classes: tuple[str, ...]                # config.json "architectures" entries
    gguf_name: str | None = None               # GGUF general.architecture, where llama.cpp names it
    # llama.cpp's converter interleaved the rows of each q/k head (its non-NEOX RoPE): undone at load
    gguf_rope_permuted: bool = False
    hf_options: HfHook = field(default=_nothing)
    gguf_options: GgufHook = field(default=_nothing)
    # HF safetensors checkpoints: tensors renamed or split to the decoder's HF names
    checkpoint_tensors: TensorHook = field(default=_as_is)
    # GGUF: llama.cpp tensor kinds (``blk.N.<kind>``) whose module differs from Llama's, and a hook over the
    # renamed tensors (as ``checkpoint_tensors``)
    gguf_names: Mapping[str, str] = field(default_factory=dict)
    gguf_tensors: TensorHook = field(default=_as_is)
    # config.json keeps the decoder's keys under "text_config" (a multimodal checkpoint served as text)
    text_config: bool = False


def _llama_options(cfg: Mapping[str, Any]) -> dict[str, Any]:
    if cfg.get("mlp_bias") or cfg.get("attention_bias"):
        raise ValueError("config.json: attention_bias/mlp_bias on a Llama-style model is not supported")
    return {}


def _mistral_options(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {**_llama_options(cfg), **layer_windows(cfg, every_layer)}


def _qwen2_options(cfg: Mapping[str, Any]) -> dict[str, Any]:
    if cfg.get("mlp_bias"):
        raise ValueError("config.json: mlp_bias on a Qwen2 model is not supported")
    return {"attention_bias": True, **qwen_windows(cfg)}


def _bias_from_tensors(_meta: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    return {"attention_bias": "blk.0.attn_q.bias" in shapes}


def _llama_gguf_options(meta: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """llama.cpp writes Mixtral as ``llama`` with routed experts."""
    return {**_bias_from_tensors(meta, shapes), **gguf_experts(meta, shapes, "llama")}


ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("llama", ("LlamaForCausalLM",), gguf_name="llama", gguf_rope_permuted=True,
                 hf_options=_llama_options, gguf_options=_llama_gguf_options),
    Architecture("mistral", ("MistralForCausalLM",), hf_options=_mistral_options),
    Architecture("qwen2", ("Qwen2ForCausalLM",), gguf_name="qwen2", hf_options=_qwen2_options,
                 gguf_options=_bias_from_tensors),
    Architecture("qwen3", ("Qwen3ForCausalLM",), gguf_name="qwen3", hf_options=qwen3.hf_options,
                 gguf_options=qwen3.gguf_options),
    Architecture("mixtral", ("MixtralForCausalLM",), hf_options=mixtral.hf_options,
                 checkpoint_tensors=mixtral.checkpoint_tensors),
    Architecture("qwen3_moe", ("Qwen3MoeForCausalLM",), gguf_name="qwen3moe", hf_options=qwen3_moe.hf_options,
                 gguf_options=qwen3_moe.gguf_options, checkpoint_tensors=qwen3_moe.checkpoint_tensors),
    Architecture("phi3", ("Phi3ForCausalLM",), gguf_name="phi3", hf_options=phi3.hf_options,
                 gguf_options=phi3.gguf_options, checkpoint_tensors=phi3.checkpoint_tensors,
                 gguf_names=phi3.GGUF_NAMES, gguf_tensors=phi3.checkpoint_tensors),
    Architecture("gemma2", ("Gemma2ForCausalLM",), gguf_name="gemma2", hf_options=gemma.gemma2_options,
                 gguf_options=gemma.gemma2_gguf_options, checkpoint_tensors=gemma.checkpoint_tensors,
                 gguf_names=gemma.GGUF_NAMES),
    Architecture("gemma3_text", ("Gemma3ForCausalLM",), gguf_name="gemma3", hf_options=gemma.gemma3_options,
                 gguf_options=gemma.gemma3_gguf_options, checkpoint_tensors=gemma.checkpoint_tensors,
                 gguf_names=gemma.GGUF_NAMES),
    Architecture("gemma3", ("Gemma3ForConditionalGeneration",), hf_options=gemma.gemma3_options,
                 checkpoint_tensors=gemma.language_model_tensors, text_config=True),
)}


def architecture(name: str) -> Architecture:
    """The entry named ``name`` (``ModelConfig.architecture``); ``ValueError`` when none is."""
    if name not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {name!r}, expected one of {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[name]


def decoder_keys(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The keys of the decoder a ``config.json`` describes: a multimodal checkpoint's ``text_config`` over its
    top-level keys (the vision tower's are dropped), else the config as it is."""
    entry = from_hf_config(cfg)
    if not entry.text_config:
        return cfg
    text = cfg.get("text_config")
    if not text:
        raise ValueError(f"config.json: {entry.hf_classes[0]} without a text_config")
    top = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config", "model_type")}
    return {**top, **text}


def from_hf_config(cfg: Mapping[str, Any]) -> Architecture:
    """The entry of a ``config.json``: its first ``architectures`` entry we know, else its
    ``model_type``."""
    archs = cfg.get("architectures") or []
    for entry in ARCHITECTURES.values():
        if any(a in entry.hf_classes for a in archs):
            return entry
    if cfg.get("model_type") in ARCHITECTURES:
        return ARCHITECTURES[cfg["model_type"]]
    supported = sorted(c for a in ARCHITECTURES.values() for c in a.hf_classes)
    raise ValueError(f"config.json: unsupported architecture {archs or cfg.get('model_type')!r}; "
                     f"supported: {supported}")


def from_gguf_name(name: Any) -> Architecture:
    """The entry of GGUF ``general.architecture`` ``name``."""
    for entry in ARCHITECTURES.values():
        if entry.gguf_name is not None and entry.gguf_name == name:
            return entry
    names = sorted(a.gguf_name for a in ARCHITECTURES.values() if a.gguf_name)
    raise ValueError(f"GGUF: unsupported general.architecture {name!r}, expected one of {names}")
