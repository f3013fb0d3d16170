"""The decoder of every family in ``radixrelay.model.architectures`` (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3,
Gemma 2/3, SmolLM2; Mixtral and Qwen3-MoE with ``radixrelay.model.moe``'s routed experts as the MLP of their
sparse layers), switched by ``ModelConfig`` fields, over a flat ragged batch.

HOT FILE: only the per-token math of the model belongs here. Batch layout lives in
``radixrelay.attention.metadata``, attention math in the backends, checkpoint formats in
``radixrelay.model.weights_*``.

One step: ``logits = model(input_ids, batch, kv_cache, backend)`` where ``input_ids: [T]`` are the
new tokens of every request packed back to back (no padding) and ``batch`` says where they sit
(positions, KV slots, which rows need logits). Each layer writes its new K/V into ``kv_cache`` at
``batch.out_slots`` before attending. Parameter names follow HF checkpoints, except that q/k/v
and gate/up are fused (``qkv_proj``, ``gate_up_proj``); ``load_weights`` takes HF names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from radixrelay.attention import AttentionBackend, ForwardBatch, KVCache
from radixrelay.attention.backend import LayerAttention
from radixrelay.kernels.fp8 import E4M3, QuantizedRows
from radixrelay.model.model_config import ModelConfig
from radixrelay.model.cpu_gemm import linear, uses_onednn
from radixrelay.model.layers import Embedding, Linear, RMSNorm, RotaryEmbedding, apply_rope, fused
from radixrelay.model.moe import Experts, SparseMoE, expert_shard
from radixrelay.model.parallel import TensorParallel
from radixrelay.model.quantization import Fp8Linear, Precision, dequantize_checkpoint, per_channel_scale

# HF projection name -> (our fused parameter, shard index within it).
_FUSED_SHARDS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def _linear(in_features: int, out_features: int, bias: bool, precision: Precision, **factory) -> nn.Module:
    """A decoder projection: FP8 where ``precision.weights`` says so (``Fp8Linear``), else the model dtype."""
    if precision.weights == "fp8":
        return Fp8Linear(in_features, out_features, bias, emulate=precision.emulate, **factory)
    return Linear(in_features, out_features, bias=bias, **factory)


def _takes_quantized(projection: nn.Module) -> bool:
    """Whether ``projection`` takes its input as ``QuantizedRows`` from the kernel before it (FP8 on
    ``torch._scaled_mm``; not the emulation, not the model dtype's ``Linear``)."""
    return isinstance(projection, Fp8Linear) and projection.takes_quantized


class Attention(nn.Module):
    """``config``: one rank's shapes (its query and KV heads; ``TensorParallel.local_config``)."""

    def __init__(self, config: ModelConfig, layer_id: int, tp: TensorParallel, precision: Precision,
                 **factory) -> None:
        super().__init__()
        self.tp = tp
        self.layer_id = layer_id
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = _linear(config.hidden_size, self.q_size + 2 * self.kv_size, config.attention_bias,
                                precision, **factory)
        self.o_proj = _linear(self.q_size, config.hidden_size, False, precision, **factory)
        # Qwen3, Gemma 3: RMSNorm over each head of q and of k (one [D] weight each), before RoPE
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, **factory) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, **factory) if config.qk_norm else None

    # The layer runs in two halves around attention (``DecoderLayer``): ``before_attention`` (q, and the
    # new K/V written), then ``partial_output`` (whose sum over the ranks ``DecoderLayer`` takes).

    def partial_output(self, o: torch.Tensor) -> torch.Tensor:
        """o: attention output [T, Hq, D] -> this rank's share of the output [T, hidden] (the ranks' shares
        sum to it)."""
        return self.o_proj(o.reshape(-1, self.q_size))

    def before_attention(self, x: torch.Tensor | QuantizedRows, cos: torch.Tensor, sin: torch.Tensor,
                         out_slots: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
        """x: [T, hidden] (or quantized rows for an FP8 q/k/v) -> q: [T, Hq, D], with the new K/V written at
        ``out_slots`` (int64 [T])."""
        qkv = self.qkv_proj(x)                                                  # [T, (Hq + 2 Hkv) * D]
        if self.q_norm is not None:
            return self._norm_rope_store(qkv, cos, sin, out_slots, kv_cache)
        if fused(qkv) and kv_cache.fp8_emulation is None:
            from radixrelay.kernels.rope_store import rope_and_store

            return rope_and_store(qkv, cos, sin, out_slots, kv_cache.k[self.layer_id], kv_cache.v[self.layer_id],
                                  self.num_heads, self.num_kv_heads)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(-1, self.num_heads, self.head_dim), cos, sin)     # [T, Hq, D]
        k = apply_rope(k.view(-1, self.num_kv_heads, self.head_dim), cos, sin)  # [T, Hkv, D]
        kv_cache.store(self.layer_id, out_slots, k, v.view(-1, self.num_kv_heads, self.head_dim))
        return q

    def _norm_rope_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out_slots: torch.Tensor,
                         kv_cache: KVCache) -> torch.Tensor:
        """``before_attention`` with the per-head q/k norms: unfused torch ops on every device (the fused
        RoPE-and-store kernel takes the projection's output as it is)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm.heads(q.reshape(-1, self.num_heads, self.head_dim))     # [T, Hq, D]
        k = self.k_norm.heads(k.reshape(-1, self.num_kv_heads, self.head_dim))  # [T, Hkv, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        kv_cache.store(self.layer_id, out_slots, k, v.reshape(-1, self.num_kv_heads, self.head_dim))
        return q


class MLP(nn.Module):
    """``config``: one rank's shapes (its slice of the MLP width)."""

    def __init__(self, config: ModelConfig, tp: TensorParallel, precision: Precision, **factory) -> None:
        super().__init__()
        self.tp = tp
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = _linear(config.hidden_size, 2 * config.intermediate_size, False, precision, **factory)
        self.down_proj = _linear(config.intermediate_size, config.hidden_size, False, precision, **factory)
        self.quantized_down = False      # the fused SiLU-and-mul quantizes down's input (set by DecoderLayer)
        self.silu = config.hidden_act == "silu"      # else GELU-tanh (Gemma): the torch ops on every device

    def partial(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        """x: [T, hidden] (quantized by the fused norm where gate/up takes it so) -> this rank's share of the
        MLP's output [T, hidden] (the ranks' shares sum to it)."""
        if not self.silu:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)                   # [T, inter] each
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        if isinstance(x, QuantizedRows) or fused(x):              # (quantized rows: fused kernels only)
            from radixrelay.kernels.silu_mul import silu_mul

            return self.down_proj(silu_mul(self.gate_up_proj(x), quantize=self.quantized_down))
        if x.device.type == "cpu" and isinstance(self.gate_up_proj, Linear) and not uses_onednn(x):
            # BLAS: two GEMMs over the fused weight's halves (views), the same numbers as one, and
            # faster for a few rows (benchmarks/results/HISTORY.md, 2026-11-24).
            w = self.gate_up_proj.weight
            gate, up = F.linear(x, w[:self.intermediate_size]), F.linear(x, w[self.intermediate_size:])
        else:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)                   # [T, inter] each
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, tp: TensorParallel, precision: Precision,
                 **factory) -> None:
        super().__init__()
        precision = precision.for_layer(layer_id, config.num_layers)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.self_attn = Attention(config, layer_id, tp, precision, **factory)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        # routed experts (Mixtral, Qwen3-MoE) on the layers that have them: the same ``partial`` contract
        self.mlp = (SparseMoE if config.routed(layer_id) else MLP)(config, tp, precision, **factory)
        # Gemma: attention's output normed before the residual add (post_attention_layernorm), and the MLP
        # between a norm of its own and another on its output
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.quantize_into_products()

    def quantize_into_products(self, on: bool = True) -> None:
        """Where the fused kernels run, the kernels before the FP8 products that take quantized input
        (``Fp8Linear.takes_quantized``) quantize their output per token: the input norm for q/k/v, the
        post-attention norm for gate/up, SiLU-and-mul for down. o's input (attention's output) is then the
        layer's one quantize launch of its own, instead of four. A norm joined to a tensor-parallel
        all-reduce (``TensorParallel.all_reduce_add``'s fused kernel) hands back the model dtype and its
        product quantizes that. ``on=False``: every product quantizes its own input (comparisons)."""
        attn, mlp = self.self_attn, self.mlp
        self.input_layernorm.quantize_output = on and _takes_quantized(attn.qkv_proj)
        mlp_norm = self.pre_feedforward_layernorm if self.sandwich else self.post_attention_layernorm
        if isinstance(mlp, MLP):                           # (routed experts: no FP8)
            mlp_norm.quantize_output = on and _takes_quantized(mlp.gate_up_proj)
            mlp.quantized_down = on and mlp.silu and _takes_quantized(mlp.down_proj)  # (GELU: down quantizes)

    # A layer is two halves around attention (piecewise CUDA graphs capture the halves and launch
    # attention between them): the layer's output is after_attention(x, attention(before_attention(x))).
    # A model runs the halves of consecutive layers back to back and passes the next layer's input norm to
    # ``after_attention``, which joins it to its last op; ``before_attention`` then takes that as ``normed``.

    def before_attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out_slots: torch.Tensor,
                         kv_cache: KVCache, normed: torch.Tensor | QuantizedRows | None = None) -> torch.Tensor:
        """x: [T, hidden] (the layer's input) -> q: [T, Hq, D]; writes the new K/V. ``normed``: this layer's
        input norm of ``x`` where the previous layer computed it (``after_attention``'s ``next_norm``; quantized
        where q/k/v takes it so)."""
        h = self.input_layernorm(x) if normed is None else normed
        return self.self_attn.before_attention(h, cos, sin, out_slots, kv_cache)

    def after_attention(self, x: torch.Tensor, o: torch.Tensor, next_norm: RMSNorm | None = None):
        """x: the layer's input [T, hidden]; o: attention output [T, Hq, D] -> the layer's output; with
        ``next_norm`` (the next layer's input norm): (next_norm(output), output)."""
        # Each row-parallel output joins the residual stream in one op: its all-reduce, the residual add
        # and the norm that follows are one kernel where they can be (TensorParallel.all_reduce_add); at
        # one rank, the add and the norm.
        if self.sandwich:
            return self._sandwich_after_attention(x, o, next_norm)
        h, x = self.self_attn.tp.all_reduce_add(self.self_attn.partial_output(o), x, self.post_attention_layernorm)
        return self.mlp.tp.all_reduce_add(self.mlp.partial(h), x, next_norm)

    def _sandwich_after_attention(self, x: torch.Tensor, o: torch.Tensor, next_norm: RMSNorm | None):
        """Gemma's second half: x + post_attn_norm(attention), then + post_ff_norm(MLP(pre_ff_norm(x)))."""
        tp = self.self_attn.tp
        x = x + self.post_attention_layernorm(tp.all_reduce(self.self_attn.partial_output(o)))
        h = self.pre_feedforward_layernorm(x)
        x = x + self.post_feedforward_layernorm(tp.all_reduce(self.mlp.partial(h)))
        return x if next_norm is None else (next_norm(x), x)


class LlamaModel(nn.Module):
    """``local``: one rank's shapes (``TensorParallel.local_config``; the whole model's at tp=1)."""

    def __init__(self, local: ModelConfig, tp: TensorParallel, precision: Precision, **factory) -> None:
        super().__init__()
        self.embed_tokens = Embedding(tp.vocab_rows(local.vocab_size)[1], local.hidden_size, **factory)
        self.layers = nn.ModuleList(DecoderLayer(local, i, tp, precision, **factory)
                                    for i in range(local.num_layers))
        self.norm = RMSNorm(local.hidden_size, local.rms_norm_eps, **factory)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, tp: TensorParallel | None = None,
                 precision: Precision | None = None) -> None:
        super().__init__()
        self.config = config                       # the whole model's shapes
        self.tp = tp or TensorParallel()
        self.precision = precision or Precision()
        self.local_config = self.tp.local_config(config)     # this rank's heads and MLP width
        factory = {"dtype": dtype, "device": device}
        self.model = LlamaModel(self.local_config, self.tp, self.precision, **factory)
        # per layer: (K scale, V scale) of an FP8 KV cache, from the checkpoint where it has them
        self.kv_scales: dict[int, tuple[float, float]] = {}
        self.rotary = RotaryEmbedding(config, device=device)
        # Gemma 3: the windowed layers' RoPE (their own base, unscaled); None where every layer shares one
        self.local_rotary = None
        if config.local_rope_theta is not None and config.layer_windows:
            local = dataclasses.replace(config, rope_theta=config.local_rope_theta, rope_scaling=None)
            self.local_rotary = RotaryEmbedding(local, device=device)
            self.rotary.single = False          # shifted KV loads would rotate the windowed layers' keys wrongly
        # how each layer attends where it differs from plain causal attention (empty: none does)
        layers = tuple(LayerAttention(window=config.window(i), logit_softcap=config.attn_logit_softcap,
                                      sm_scale=config.attn_scale) for i in range(config.num_layers))
        self.attention_layers = () if all(layer.plain for layer in layers) else layers
        vocab_rows = self.tp.vocab_rows(config.vocab_size)[1]
        self.lm_head = (None if config.tie_word_embeddings
                        else Linear(config.hidden_size, vocab_rows, bias=False, **factory))
        self._head_t_cache: tuple[tuple, torch.Tensor] | None = None     # ``_cpu_head_t``
        # all-reduces of one forward: the embedding's, then attention's and the MLP's per layer
        self.all_reduces_per_forward = 2 * config.num_layers + 1 if self.tp.enabled else 0

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, kv_cache: KVCache,
                backend: AttentionBackend) -> torch.Tensor:
        """input_ids: int [T] -> logits [R, vocab] for rows ``batch.logits_indices``, float32
        (float64 for a float64 model)."""
        if input_ids.shape[0] != batch.num_tokens:
            raise ValueError(f"forward: {input_ids.shape[0]} input ids for a batch of {batch.num_tokens} tokens")
        if self.attention_layers and backend.layers != self.attention_layers:
            backend.set_layers(self.attention_layers)         # (the worker sets them at load: refusals come there)
        rope = self.rotary(batch.rope_positions)                                # (cos, sin): [T, D] each
        local = rope if self.local_rotary is None else self.local_rotary(batch.rope_positions)
        x = self.embed(input_ids)                                               # [T, hidden]
        layers, h = self.model.layers, None
        for i, layer in enumerate(layers):
            kv_cache.wait_for_layer(layer.self_attn.layer_id)     # KV tier loads: before the layer's K/V store
            cos, sin = local if self.config.window(layer.self_attn.layer_id) else rope
            q = layer.before_attention(x, cos, sin, batch.out_slots, kv_cache, normed=h)
            o = backend.forward(q, layer.self_attn.layer_id, kv_cache, batch)
            h, x = self.next_layer_input(i, x, o)
        return self.logits(x[batch.logits_indices])

    def next_layer_input(self, i: int, x: torch.Tensor, o: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Layer ``i``'s second half: x its input [T, hidden], o its attention output -> (the next layer's
        input norm of the output, or None after the last layer (``logits`` norms its rows), the output)."""
        layers = self.model.layers
        if i + 1 == len(layers):
            return None, layers[i].after_attention(x, o)
        return layers[i].after_attention(x, o, layers[i + 1].input_layernorm)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x: [R, hidden] (last layer's output rows) -> logits [R, vocab], float32 (float64 for a
        float64 model)."""
        x = self.model.norm(x)
        head = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if x.device.type == "cpu" and not uses_onednn(x):
            logits = torch.mm(x, self._cpu_head_t(head))
        else:
            logits = linear(x, head)                                            # [R, vocab rows of this rank]
        if self.tp.enabled:
            logits = self.tp.gather_last_dim(logits)[:, :self.config.vocab_size]
        logits = logits.to(torch.promote_types(x.dtype, torch.float32))
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap          # (Gemma 2)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: int [T] -> [T, hidden]. Tensor parallel: each rank looks up the tokens in its
        vocabulary rows (zeros for the others) and the ranks' rows are summed."""
        if not self.tp.enabled:
            x = self.model.embed_tokens(input_ids)
        else:
            start, rows, _ = self.tp.vocab_rows(self.config.vocab_size)
            local = input_ids - start
            outside = (local < 0) | (local >= rows)
            x = self.tp.all_reduce(self.model.embed_tokens(local.clamp(0, rows - 1)).masked_fill_(outside[:, None], 0))
        if self.config.embedding_scale:        # Gemma: times sqrt(hidden), rounded to the model dtype first
            x = x * float(torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype))
        return x

    def _cpu_head_t(self, head: torch.Tensor) -> torch.Tensor:
        """BLAS on the CPU (``cpu_gemm`` mode blas, or activations oneDNN does not take):
        ``head`` [V, hidden] as a contiguous [hidden, V] copy, made once per weight version (one more
        copy of the head in memory: V x hidden floats). On the CPU the LM head is the largest matrix of
        a small model and BLAS streams it faster in this layout, most for few rows
        (``benchmarks/results/HISTORY.md``, 2026-11-24); the tied embedding keeps its row layout for lookups. The sums' order differs from ``F.linear``'s: logits agree to float rounding,
        not bit for bit."""
        key = (head.data_ptr(), head._version, tuple(head.shape))
        cached = self._head_t_cache
        if cached is None or cached[0] != key:
            cached = (key, head.detach().t().contiguous())
            self._head_t_cache = cached
        return cached[1]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the (fused) parameters, converting dtype/device. Raises
        ``ValueError`` on an unknown name, a shape mismatch, or a parameter left unloaded. The
        extra name ``rope_freqs`` (GGUF llama3 models) divides the RoPE frequencies.

        FP8: a full-precision weight of an ``Fp8Linear`` is quantized per output channel as it is
        loaded; an e4m3 checkpoint weight (with its ``weight_scale``, per tensor or per channel) is
        loaded as it is into an ``Fp8Linear``, and dequantized into a model that does not run in FP8.
        ``input_scale`` (static activation scales) is not used: inputs are scaled per token at run time;
        ``self_attn.k_scale`` / ``v_scale`` become the layer's FP8 KV cache scales."""
        params = dict(self.named_parameters())
        expected = {(name, shard) for name in params for shard in self._shards_of(name)}
        loaded: set[tuple[str, int]] = set()
        fp8_parts: dict[str, dict[str, torch.Tensor]] = {}     # e4m3 weight name -> its weight and scale
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.lm_head is None):
                continue  # recomputed / tied to the embedding
            if name == "rope_freqs":
                self.rotary.set_freq_factors(tensor)
                continue
            if name.endswith(".input_scale"):
                continue  # dynamic per-token activation scales instead
            if name.endswith((".self_attn.k_scale", ".self_attn.v_scale")):
                self._load_kv_scale(name, tensor)
                continue
            if tensor.dtype == E4M3 or name.endswith(".weight_scale"):
                weight_name = name.removesuffix("_scale")
                parts = fp8_parts.setdefault(weight_name, {})
                parts["scale" if name.endswith("_scale") else "weight"] = tensor
                if len(parts) == 2:
                    del fp8_parts[weight_name]
                    self._load_fp8_weight(weight_name, parts["weight"], parts["scale"], params, loaded)
                continue
            self._load_tensor(name, tensor, params, loaded)
        if fp8_parts:
            raise ValueError(f"load_weights: FP8 weights without their scale, or scales without their weight: "
                             f"{sorted(fp8_parts)[:8]}")
        missing = sorted(f"{n}[{s}]" if s >= 0 else n for n, s in expected - loaded)
        if missing:
            raise ValueError(f"load_weights: {len(missing)} parameters not in the checkpoint: {missing[:8]}")

    def _target(self, name: str, params: dict) -> tuple[str, int]:
        """(our parameter, shard index or -1) of the HF tensor ``name``."""
        target, shard = name, -1
        parts = name.split(".")
        expert = expert_shard(name)                # an expert's projection: a shard of the stacked [E, ...] weight
        if expert is not None:
            target, shard = expert
        elif len(parts) >= 2 and parts[-2] in _FUSED_SHARDS:
            fused, shard = _FUSED_SHARDS[parts[-2]]
            target = ".".join(parts[:-2] + [fused, parts[-1]])
        if target not in params:
            raise ValueError(f"load_weights: unexpected tensor {name!r}")
        return target, shard

    def _load_tensor(self, name: str, tensor: torch.Tensor, params: dict, loaded: set) -> None:
        target, shard = self._target(name, params)
        tensor = self.tp.weight_slice(name, tensor, self.config)           # this rank's part
        module_name, leaf = target.rsplit(".", 1)
        module = self.get_submodule(module_name)
        if shard >= 0 and isinstance(module, Experts):
            dst = module.shard(leaf, shard)
            if dst.shape != tensor.shape:
                raise ValueError(f"load_weights: {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add((target, shard))
            return
        start, size = self._shard_range(target, shard) if shard >= 0 else (0, params[target].shape[0])
        if isinstance(module, Fp8Linear) and target.endswith(".weight"):
            if tensor.shape != (size, module.in_features):
                raise ValueError(f"load_weights: {name!r} has shape {tuple(tensor.shape)}, expected "
                                 f"{(size, module.in_features)}")
            module.load_rows(start, tensor)                                   # quantized per output channel
            loaded.update({(target, shard), (target + "_scale", shard)})
            return
        dst = params[target].data
        if shard >= 0:
            dst = dst.narrow(0, start, size)
        if dst.shape != tensor.shape:
            raise ValueError(f"load_weights: {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(tensor)
        loaded.add((target, shard))

    def _load_fp8_weight(self, name: str, weight: torch.Tensor, scale: torch.Tensor, params: dict,
                         loaded: set) -> None:
        """An e4m3 checkpoint weight (HF name ``name``) and its scale."""
        if weight.dtype != E4M3:
            raise ValueError(f"load_weights: {name!r} has a weight_scale but dtype {weight.dtype}, not float8 e4m3")
        target, shard = self._target(name, params)
        module = self.get_submodule(target.rsplit(".", 1)[0])
        if not isinstance(module, Fp8Linear):             # this model runs in its dtype: dequantize
            self._load_tensor(name, dequantize_checkpoint(weight, scale, name, params[target].dtype), params, loaded)
            return
        scale = per_channel_scale(scale, weight.shape[0], name + "_scale")
        weight = self.tp.weight_slice(name, weight, self.config)
        if name.split(".")[-2] not in ("o_proj", "down_proj"):    # row-parallel layers keep every output channel
            scale = self.tp.weight_slice(name, scale, self.config)
        start, size = self._shard_range(target, shard) if shard >= 0 else (0, module.out_features)
        if weight.shape != (size, module.in_features) or scale.shape != (size,):
            raise ValueError(f"load_weights: {name!r} has shape {tuple(weight.shape)} with {scale.shape[0]} scales, "
                             f"expected {(size, module.in_features)}")
        module.load_rows(start, weight)
        module.load_scale_rows(start, scale)
        loaded.update({(target, shard), (target + "_scale", shard)})

    def _load_kv_scale(self, name: str, tensor: torch.Tensor) -> None:
        parts = name.split(".")
        layer = int(parts[parts.index("layers") + 1]) if "layers" in parts else -1
        if not 0 <= layer < self.config.num_layers or tensor.numel() != 1:
            raise ValueError(f"load_weights: {name!r}: expected one scale of a layer below {self.config.num_layers}")
        value = float(tensor.reshape(()).float())
        if not value > 0 or value == float("inf"):
            raise ValueError(f"load_weights: {name!r} = {value}: a KV scale must be positive and finite")
        k, v = self.kv_scales.get(layer, (1.0, 1.0))
        self.kv_scales[layer] = (value, v) if name.endswith("k_scale") else (k, value)

    def enable_kv_emulation(self, kv_cache: KVCache) -> None:
        """An FP8 KV cache emulated (``precision.kv`` "fp8" with ``emulate``): ``kv_cache`` stores what e4m3
        with this model's per-layer scales keeps (1.0 where the checkpoint gave none)."""
        kv_cache.fp8_emulation = [self.kv_scales.get(i, (1.0, 1.0)) for i in range(self.config.num_layers)]

    def _shards_of(self, param_name: str) -> tuple[int, ...]:
        leaf = param_name.split(".")[-2] if "." in param_name else param_name
        if leaf == "experts":
            module_name, param = param_name.rsplit(".", 1)
            return self.get_submodule(module_name).shards(param)
        if leaf == "qkv_proj":
            return (0, 1, 2)
        if leaf == "gate_up_proj":
            return (0, 1)
        return (-1,)

    def _shard_range(self, param_name: str, shard: int) -> tuple[int, int]:
        """(start row, rows) of a shard inside a fused parameter (this rank's shapes)."""
        c = self.local_config
        if ".qkv_proj." in param_name:
            return ((0, c.q_size), (c.q_size, c.kv_size), (c.q_size + c.kv_size, c.kv_size))[shard]
        return (shard * c.intermediate_size, c.intermediate_size)
