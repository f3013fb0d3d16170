"""GGUF checkpoints (llama.cpp format) read with the ``gguf`` package.

Every tensor is dequantised to float32 on the host by ``gguf.quants.dequantize`` (F32, F16, BF16,
Q8_0, Q4_0/1, Q5_0/1, K-quants, ... whatever the installed ``gguf`` supports) and renamed to HF
names for ``LlamaForCausalLM.load_weights``.

RoPE permutation: for ``llama`` architecture files, llama.cpp's converter reorders the rows of
each Q/K head from HF's rotate-half layout (pairs ``i`` and ``i + D/2``) to the interleaved
layout llama.cpp's rope uses (pairs ``2i`` and ``2i + 1``). We undo it so the HF-style
rotate-half RoPE is correct. ``qwen2`` files use llama.cpp's NEOX rope and are not permuted.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from radixrelay.model.config import ModelConfig

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def _open(path: Path) -> Any:
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise RuntimeError("reading GGUF files needs the `gguf` package: pip install gguf") from e
    return GGUFReader(path)


def _scalar_metadata(reader: Any) -> dict[str, Any]:
    """Decoded metadata, skipping arrays (the tokenizer vocabulary is large and unused here)."""
    from gguf import GGUFValueType

    return {name: field.contents() for name, field in reader.fields.items()
            if field.types and field.types[0] != GGUFValueType.ARRAY}


def _torch_shape(tensor: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first


def open_gguf(path: Path) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    """Parse the file once: its ``ModelConfig`` and a lazy iterator of (HF name, float32 CPU
    tensor), dequantising one tensor at a time."""
    reader = _open(path)
    config = ModelConfig.from_gguf(_scalar_metadata(reader),
                                   {t.name: _torch_shape(t) for t in reader.tensors})
    return config, _iter_weights(reader, config, path.name)


def _iter_weights(reader: Any, config: ModelConfig, file_name: str) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf.quants import dequantize

    unpermute = config.architecture == "llama"
    for t in reader.tensors:
        name = _hf_name(t.name)
        try:
            array = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise RuntimeError(
                f"{file_name}: tensor {t.name} has type {t.tensor_type.name}, which the installed "
                "gguf package cannot dequantize"
            ) from e
        weight = torch.from_numpy(np.array(array, dtype=np.float32)).reshape(_torch_shape(t))
        if unpermute and name.endswith(("q_proj.weight", "q_proj.bias")):
            weight = _unpermute_rope(weight, config.num_heads)
        elif unpermute and name.endswith(("k_proj.weight", "k_proj.bias")):
            weight = _unpermute_rope(weight, config.num_kv_heads)
        yield name, weight


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise ValueError(f"GGUF: unsupported tensor {gguf_name!r}")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def _unpermute_rope(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows of each head go from llama.cpp's interleaved order back to HF's rotate-half order.
    w: [num_heads * D, ...]; GGUF row ``2i + h`` of a head is HF row ``h * D/2 + i``."""
    head_dim = w.shape[0] // num_heads
    rest = w.shape[1:]
    return w.reshape(num_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(w.shape).contiguous()
