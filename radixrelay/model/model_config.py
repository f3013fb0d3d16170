"""Model hyper-parameters, read from a Hugging Face ``config.json`` or from GGUF metadata.

One frozen ``ModelConfig`` describes every supported architecture: the keys every family shares are
read here, each family's own keys by its hooks in the architecture registry
(``radixrelay.model.architectures``). Values are validated on construction and errors are
``ValueError`` naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from radixrelay.model.architectures import (
    ARCHITECTURES,
    decoder_keys,
    from_gguf_name,
    from_hf_config,
)
from radixrelay.model.rope_scaling import ROPE_TYPES, RopeScaling

__all__ = ["ROPE_TYPES", "ModelConfig", "RopeScaling"]


@dataclass(frozen=True)
class ModelConfig:
    architecture: str                   # a name in radixrelay.model.architectures.ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int                      # query heads
    num_kv_heads: int                   # key/value heads (GQA: divides num_heads)
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False        # bias on the q/k/v projections (Qwen2); o_proj never
    qk_norm: bool = False               # RMSNorm over each head of q and of k before RoPE (Qwen3, Gemma 3)
    # each layer's sliding window in tokens (0: full attention; empty: every layer full): Mistral, Gemma
    layer_windows: tuple[int, ...] = ()
    local_rope_theta: float | None = None   # RoPE base of the windowed layers, unscaled (Gemma 3); None: rope_theta
    hidden_act: str = "silu"            # the MLP's gate activation: "silu" | "gelu_tanh" (Gemma)
    sandwich_norms: bool = False        # norms after attention and around the MLP too (Gemma 2/3)
    embedding_scale: bool = False       # embeddings times sqrt(hidden_size) (Gemma)
    attn_logit_softcap: float | None = None    # attention scores s -> cap * tanh(s / cap) (Gemma 2)
    final_logit_softcap: float | None = None   # logits likewise (Gemma 2)
    attn_scale: float | None = None     # softmax scale; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    # routed experts (Mixtral, Qwen3-MoE; radixrelay.model.moe): the MLP of each layer in ``moe_layers`` is
    # ``num_experts`` SwiGLU experts of width ``moe_intermediate_size``, each token sent to ``num_experts_per_tok``
    # of them; the other layers keep the dense MLP of ``intermediate_size``. 0 experts: every MLP dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0        # top-k
    moe_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = ()    # ascending layer indices
    moe_renormalize: bool = True        # the top-k weights divided by their sum (Mixtral; Qwen3-MoE's norm_topk_prob)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> ValueError:
            return ValueError(f"ModelConfig.{field}: {why}")

        if self.architecture not in ARCHITECTURES:
            raise bad("architecture", f"unsupported {self.architecture!r}, expected one of {sorted(ARCHITECTURES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad(name, f"must be an integer >= 1, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise bad("num_kv_heads", f"{self.num_kv_heads} does not divide num_heads={self.num_heads}")
        if self.head_dim % 2:
            raise bad("head_dim", f"RoPE needs an even head_dim, got {self.head_dim}")
        if self.layer_windows and (len(self.layer_windows) != self.num_layers or min(self.layer_windows) < 0):
            raise bad("layer_windows", f"one window >= 0 per layer ({self.num_layers}), got {self.layer_windows}")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise bad("hidden_act", f"must be silu or gelu_tanh, got {self.hidden_act!r}")
        for name in ("local_rope_theta", "attn_logit_softcap", "final_logit_softcap", "attn_scale"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise bad(name, f"must be > 0 or None, got {value}")
        self._check_experts(bad)
        scaling = self.rope_scaling
        if scaling is not None and scaling.rope_type == "longrope" and len(scaling.short_factor) != self.head_dim // 2:
            raise bad("rope_scaling", f"longrope needs head_dim / 2 = {self.head_dim // 2} factors, got "
                                      f"{len(scaling.short_factor)}")
        if self.rms_norm_eps <= 0:
            raise bad("rms_norm_eps", f"must be > 0, got {self.rms_norm_eps}")
        if self.rope_theta <= 0:
            raise bad("rope_theta", f"must be > 0, got {self.rope_theta}")
        if any(not 0 <= t < self.vocab_size for t in self.eos_token_ids):
            raise bad("eos_token_ids", f"{self.eos_token_ids} outside [0, {self.vocab_size})")

    def _check_experts(self, bad) -> None:
        if not self.num_experts:
            if self.moe_layers or self.num_experts_per_tok or self.moe_intermediate_size:
                raise bad("num_experts", "0 (dense), but moe_layers / num_experts_per_tok / moe_intermediate_size set")
            return
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad(name, f"must be an integer >= 1 with routed experts, got {value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise bad("num_experts_per_tok", f"{self.num_experts_per_tok} > num_experts={self.num_experts}")
        layers = self.moe_layers
        if not layers or list(layers) != sorted(set(layers)) or not 0 <= layers[0] <= layers[-1] < self.num_layers:
            raise bad("moe_layers", f"ascending distinct layers in [0, {self.num_layers}), got {layers}")

    def routed(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is routed experts."""
        return layer in self.moe_layers

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window in tokens, None for full attention."""
        return (self.layer_windows[layer] or None) if self.layer_windows else None

    # Derived sizes.
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    def tensor_parallel_problem(self, tp: int) -> str | None:
        """What ``tp`` ranks cannot split (``radixrelay.model.parallel``: query heads, the MLP width and each
        expert's width split evenly, KV heads split or replicated), or None. The vocabulary is padded to a multiple
        of ``tp``, so it always splits."""
        problems = []
        if self.num_heads % tp:
            problems.append(f"{self.num_heads} query heads")
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            problems.append(f"{self.num_kv_heads} KV heads (neither divides the other)")
        if self.intermediate_size % tp:
            problems.append(f"an MLP width of {self.intermediate_size}")
        if self.num_experts and self.moe_intermediate_size % tp:
            problems.append(f"an expert width of {self.moe_intermediate_size}")
        return f"tensor parallel size {tp} does not split {' and '.join(problems)}" if problems else None

    def tensor_parallel_sizes(self, at_most: int = 64) -> list[int]:
        """The sizes up to ``at_most`` that split this model."""
        return [tp for tp in range(1, at_most + 1) if self.tensor_parallel_problem(tp) is None]

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any], generation: Mapping[str, Any] | None = None) -> ModelConfig:
        """Build from a ``config.json`` dict; ``generation`` is ``generation_config.json`` whose
        ``eos_token_id`` (int or list) takes precedence over the model config's."""
        arch = from_hf_config(cfg)
        cfg = decoder_keys(cfg)
        rope = cfg.get("rope_parameters") or {}
        rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        num_heads = _require(cfg, "num_attention_heads")
        hidden = _require(cfg, "hidden_size")
        eos = (generation or {}).get("eos_token_id", cfg.get("eos_token_id"))
        fields = {
            "architecture": arch.name,
            "vocab_size": _require(cfg, "vocab_size"),
            "hidden_size": hidden,
            "intermediate_size": _require(cfg, "intermediate_size"),
            "num_layers": _require(cfg, "num_hidden_layers"),
            "num_heads": num_heads,
            "num_kv_heads": cfg.get("num_key_value_heads") or num_heads,
            "head_dim": cfg.get("head_dim") or hidden // num_heads,
            "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
            "rope_theta": float(rope_theta),
            "rope_scaling": RopeScaling.from_hf(rope or cfg.get("rope_scaling"), cfg),
            "max_position_embeddings": cfg.get("max_position_embeddings", 4096),
            "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
            "bos_token_id": cfg.get("bos_token_id"),
            "eos_token_ids": _as_id_tuple(eos),
        }
        return cls(**{**fields, **arch.hf_options(cfg)})

    @classmethod
    def from_gguf(
        cls, metadata: Mapping[str, Any], tensor_shapes: Mapping[str, tuple[int, ...]]
    ) -> ModelConfig:
        """Build from GGUF scalar metadata (decoded to Python values) and the tensor shapes in
        torch order (vocab = rows of ``token_embd.weight``; tied embeddings = no ``output.weight``;
        the rest by the architecture's ``gguf_options``, e.g. Qwen2's qkv bias = ``blk.0.attn_q.bias``)."""
        entry = from_gguf_name(metadata.get("general.architecture"))
        arch = entry.gguf_name

        def get(key: str, default: Any = None) -> Any:
            value = metadata.get(f"{arch}.{key}", default)
            if value is None:
                raise ValueError(f"GGUF: missing metadata key {arch}.{key}")
            return value

        hidden = int(get("embedding_length"))
        num_heads = int(get("attention.head_count"))
        head_dim = int(get("attention.key_length", hidden // num_heads))
        if int(get("rope.dimension_count", head_dim)) != head_dim:
            raise ValueError(f"GGUF: partial rotary ({arch}.rope.dimension_count != head_dim) is not supported")
        if "token_embd.weight" not in tensor_shapes:
            raise ValueError("GGUF: no token_embd.weight tensor")
        scaling = None
        scaling_type = metadata.get(f"{arch}.rope.scaling.type", "none")
        if scaling_type == "linear":
            scaling = RopeScaling("linear", factor=float(get("rope.scaling.factor")))
        elif scaling_type not in ("none", None) and not (scaling_type in ("longrope", "su") and arch == "phi3"):
            raise ValueError(f"GGUF: unsupported {arch}.rope.scaling.type {scaling_type!r}")
        eos = metadata.get("tokenizer.ggml.eos_token_id")
        fields = {
            "architecture": entry.name,
            "vocab_size": int(tensor_shapes["token_embd.weight"][0]),
            "hidden_size": hidden,
            "intermediate_size": int(get("feed_forward_length")),
            "num_layers": int(get("block_count")),
            "num_heads": num_heads,
            "num_kv_heads": int(get("attention.head_count_kv", num_heads)),
            "head_dim": head_dim,
            "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
            "rope_theta": float(get("rope.freq_base", 10000.0)),
            "rope_scaling": scaling,
            "max_position_embeddings": int(get("context_length")),
            "tie_word_embeddings": "output.weight" not in tensor_shapes,
            "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
            "eos_token_ids": _as_id_tuple(eos),
        }
        return cls(**{**fields, **entry.gguf_options(metadata, tensor_shapes)})


def _require(cfg: Mapping[str, Any], key: str) -> Any:
    if key not in cfg:
        raise ValueError(f"config.json: missing required key {key!r}")
    return cfg[key]


def _as_id_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
