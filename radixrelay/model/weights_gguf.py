"""GGUF checkpoints (llama.cpp format): the file is opened by ``radixrelay.gguf_file``.

Tensor names: Llama's (``_LAYER_NAMES``, with the routed experts' stacked tensors split per expert) unless the architecture names a kind otherwise
(``Architecture.gguf_names``: Gemma's norms around each half, Phi-3's fused q/k/v and gate/up), then
the architecture's ``gguf_tensors`` hook (Phi-3: the fused tensors split).

Every tensor is dequantised to float32 on the host: F32, F16, BF16, Q8_0, Q4_0 and Q4_1 here (in torch,
bit-identical to the ``gguf`` package's numpy code and a few times faster), every other type by
``gguf.quants.dequantize`` (F32, F16, BF16,
Q8_0, Q4_0/1, Q5_0/1, K-quants, ... whatever the installed ``gguf`` supports) and renamed to HF
names for ``LlamaForCausalLM.load_weights``.

RoPE permutation: for ``llama`` architecture files (``Architecture.gguf_rope_permuted``), llama.cpp's
converter reorders the rows of each Q/K head from HF's rotate-half layout (pairs ``i`` and ``i + D/2``)
to the interleaved layout llama.cpp's rope uses (pairs ``2i`` and ``2i + 1``). We undo it so the
HF-style rotate-half RoPE is correct. ``qwen2`` files use llama.cpp's NEOX rope and are not permuted.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from pathlib import Path
import numpy as np
import torch

from radixrelay.gguf_file import GGUFFile
from radixrelay.model.architectures import architecture
from radixrelay.model.model_config import ModelConfig
from radixrelay.model.config_files import CONFIG_TENSORS, gguf_config, tensor_shape

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # routed experts (Mixtral as ``llama``, ``qwen3moe``): the router, and each projection of every expert
    # stacked in one tensor, split per expert at load (``_per_expert``)
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def open_gguf(path: Path) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    """Parse the file once: its ``ModelConfig`` and a lazy iterator of (HF name, float32 CPU
    tensor), dequantising one tensor at a time."""
    file = GGUFFile(path)
    config = gguf_config(file)
    return config, _iter_weights(file, config)


def _iter_weights(file: GGUFFile, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    entry = architecture(config.architecture)
    return entry.gguf_tensors(_renamed_weights(file, config, {**_LAYER_NAMES, **entry.gguf_names}), config)


def _renamed_weights(file: GGUFFile, config: ModelConfig, layer_names: dict[str, str]):
    unpermute = architecture(config.architecture).gguf_rope_permuted
    for t in file.tensors:
        if t.name in CONFIG_TENSORS:                 # read into the config already
            continue
        name = _hf_name(t.name, layer_names)
        weight = dequantize(file.tensor_bytes(t), t.ggml_type, f"{file.path.name}: tensor {t.name}")
        weight = weight.reshape(tensor_shape(t))
        if unpermute and name.endswith(("q_proj.weight", "q_proj.bias")):
            weight = _unpermute_rope(weight, config.num_heads)
        elif unpermute and name.endswith(("k_proj.weight", "k_proj.bias")):
            weight = _unpermute_rope(weight, config.num_kv_heads)
        if ".mlp.experts." in name:
            yield from _per_expert(name, weight)
        else:
            yield name, weight


def _per_expert(name: str, stacked: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """``<layer>.mlp.experts.<proj>.weight`` [E, rows, cols] -> ``<layer>.mlp.experts.<e>.<proj>.weight`` each."""
    if stacked.dim() != 3:
        raise ValueError(f"GGUF: {name!r} has shape {tuple(stacked.shape)}, expected [experts, rows, columns]")
    prefix, proj, kind = name.rsplit(".", 2)
    for e, rows in enumerate(stacked):
        yield f"{prefix}.{e}.{proj}.{kind}", rows


# ggml type -> bytes per block of 32 values (the block-quantised types done here)
_Q8_0, _Q4_0, _Q4_1 = 8, 2, 3
_F32, _F16, _BF16 = 0, 1, 30
_BLOCK_BYTES = {_Q8_0: 34, _Q4_0: 18, _Q4_1: 20}


def dequantize(raw: np.ndarray, ggml_type: int, what: str = "tensor") -> torch.Tensor:
    """raw: a tensor's bytes (uint8) -> its values as a flat float32 CPU tensor."""
    with warnings.catch_warnings():      # read-only (memory-mapped) bytes: only read, every result is a copy
        warnings.simplefilter("ignore", UserWarning)
        data = torch.frombuffer(memoryview(raw), dtype=torch.uint8) if raw.size else torch.empty(0, dtype=torch.uint8)
    if ggml_type == _F32:
        return data.view(torch.float32).clone()
    if ggml_type in (_F16, _BF16):
        return data.view(torch.float16 if ggml_type == _F16 else torch.bfloat16).float()
    if ggml_type in _BLOCK_BYTES:
        blocks = data.view(-1, _BLOCK_BYTES[ggml_type])
        scale = blocks[:, 0:2].contiguous().view(torch.float16).float()              # [blocks, 1]
        if ggml_type == _Q8_0:                                                        # x = d * q (int8)
            return (blocks[:, 2:].contiguous().view(torch.int8).float() * scale).reshape(-1)
        nibbles = blocks[:, 4:] if ggml_type == _Q4_1 else blocks[:, 2:]
        q = torch.cat((nibbles & 15, nibbles >> 4), dim=1).float()                  # low halves first
        if ggml_type == _Q4_0:                                                        # x = d * (q - 8)
            return ((q - 8) * scale).reshape(-1)
        minimum = blocks[:, 2:4].contiguous().view(torch.float16).float()              # x = d * q + m
        return (q * scale + minimum).reshape(-1)
    return _dequantize_with_gguf(raw, ggml_type, what)


def _dequantize_with_gguf(raw: np.ndarray, ggml_type: int, what: str) -> torch.Tensor:
    try:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize as gguf_dequantize
    except ImportError as e:
        raise RuntimeError("dequantising GGUF tensors needs the `gguf` package: pip install gguf") from e
    qtype = GGMLQuantizationType(ggml_type)
    try:
        array = gguf_dequantize(raw, qtype)
    except NotImplementedError as e:
        raise RuntimeError(f"{what} has type {qtype.name}, which the installed gguf package cannot "
                           "dequantize") from e
    return torch.from_numpy(np.array(array, dtype=np.float32)).reshape(-1)


def _hf_name(gguf_name: str, layer_names: dict[str, str]) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK.fullmatch(gguf_name)
    if m is None or m.group(2) not in layer_names:
        raise ValueError(f"GGUF: unsupported tensor {gguf_name!r}")
    return f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}.{m.group(3)}"


def _unpermute_rope(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows of each head go from llama.cpp's interleaved order back to HF's rotate-half order.
    w: [num_heads * D, ...]; GGUF row ``2i + h`` of a head is HF row ``h * D/2 + i``."""
    head_dim = w.shape[0] // num_heads
    rest = w.shape[1:]
    return w.reshape(num_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(w.shape).contiguous()
