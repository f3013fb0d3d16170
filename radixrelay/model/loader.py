"""``load_model``: a model name or path -> (``LlamaForCausalLM`` on the device, ``ModelConfig``).

Formats: ``safetensors`` (HF directory), ``gguf`` (a .gguf file, or a directory holding exactly
one), ``dummy`` (random weights for the config of an HF directory or a given ``ModelConfig``;
for benchmarks and tests), ``auto`` (picked from what the path holds). Nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import torch

from radixrelay.model.architectures import architecture
from radixrelay.model.model_config import ModelConfig
from radixrelay.model.config_files import detect_format, gguf_file, is_gguf, read_hf_config
from radixrelay.model.layers import uninitialised_parameters
from radixrelay.model.llama import LlamaForCausalLM
from radixrelay.model.parallel import TensorParallel
from radixrelay.model.quantization import Precision
from radixrelay.model.model_registry import resolve_model_path
from radixrelay.model.weights_gguf import open_gguf
from radixrelay.model.weights_hf import iter_safetensors_weights

LoadFormat = Literal["auto", "gguf", "safetensors", "dummy"]
DUMMY_STD = 0.02  # std of dummy weights: keeps activations O(1) through many layers


def default_dtype(device: torch.device | str) -> torch.dtype:
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def load_model(
    model: str | ModelConfig,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    load_format: LoadFormat = "auto",
    seed: int = 0,
    tp: TensorParallel | None = None,
    precision: Precision | None = None,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build and load a model in eval mode. ``dtype`` defaults to float32 on CPU, bfloat16 on
    CUDA; ``seed`` only matters for ``dummy`` weights. With ``tp``, this rank's slice of the model:
    checkpoints are read one tensor at a time and each is cut to the rank's part before it is kept;
    dummy weights equal the slices of the single-rank model with the same seed. ``precision``: FP8
    weights (``radixrelay.model.quantization``), quantized as they are loaded (dummy weights too)."""
    dtype = dtype or default_dtype(device)
    tp = tp or TensorParallel()
    precision = precision or Precision()
    precision.check_device(torch.device(device))
    if isinstance(model, ModelConfig):
        if load_format not in ("auto", "dummy"):
            raise ValueError(f"load_model: a ModelConfig can only be loaded with dummy weights, not {load_format!r}")
        return _dummy(model, device, dtype, seed, tp, precision), model

    path = resolve_model_path(model)
    fmt = detect_format(path) if load_format == "auto" else load_format
    if fmt == "dummy":
        config = open_gguf(gguf_file(path))[0] if is_gguf(path) else read_hf_config(path)
        return _dummy(config, device, dtype, seed, tp, precision), config
    if fmt == "safetensors":
        if not path.is_dir():
            raise ValueError(f"load_model: safetensors needs a model directory, got {path}")
        config = read_hf_config(path)
        weights = architecture(config.architecture).checkpoint_tensors(iter_safetensors_weights(path), config)
    elif fmt == "gguf":
        config, weights = open_gguf(gguf_file(path))
    else:
        raise ValueError(f"load_model: unknown load_format {load_format!r}")
    net = _uninitialised(config, device, dtype, tp, precision)
    net.load_weights(weights)
    return net.eval().requires_grad_(False), config


@torch.no_grad()
def _dummy(config: ModelConfig, device: torch.device | str, dtype: torch.dtype, seed: int,
           tp: TensorParallel, precision: Precision) -> LlamaForCausalLM:
    """Random weights created on the device: norms 1, biases 0, matrices N(0, DUMMY_STD)."""
    net = _uninitialised(config, device, dtype, tp, precision)
    if tp.enabled or precision.weights is not None:       # through the loader: sliced, or quantized
        net.load_weights(dummy_weights(config, device, dtype, seed))
        return net.eval().requires_grad_(False)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in net.named_parameters():
        _fill_dummy(name, param, gen)
    return net.eval().requires_grad_(False)


def _fill_dummy(name: str, param: torch.Tensor, gen: torch.Generator) -> None:
    if "norm" in name:
        param.fill_(1.0)
    elif name.endswith(".bias"):
        param.zero_()
    else:
        param.normal_(0.0, DUMMY_STD, generator=gen)


# fused parameter -> the checkpoint tensors it holds, in order along its rows
_UNFUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@torch.no_grad()
def dummy_weights(config: ModelConfig, device: torch.device | str, dtype: torch.dtype,
                  seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The single-rank model's dummy weights as checkpoint tensors (HF names), one parameter at a
    time: the same values on every rank, whatever the rank keeps of them."""
    shapes = [(name, p.shape) for name, p in LlamaForCausalLM(config, dtype=dtype, device="meta").named_parameters()]
    gen = torch.Generator(device=device).manual_seed(seed)
    split = {"qkv_proj": (config.q_size, config.kv_size, config.kv_size),
             "gate_up_proj": (config.intermediate_size, config.intermediate_size)}
    for name, shape in shapes:
        full = torch.empty(shape, dtype=dtype, device=device)
        _fill_dummy(name, full, gen)
        parts = name.rsplit(".", 2)
        if len(parts) == 3 and parts[1] == "experts":          # stacked [E, ...]: per-expert tensors
            yield from _per_expert(name, full)
            continue
        if len(parts) < 3 or parts[1] not in _UNFUSED:
            yield name, full
            continue
        prefix, leaf, kind = parts
        for part, piece in zip(_UNFUSED[leaf], full.split(split[leaf])):
            yield f"{prefix}.{part}.{kind}", piece


def _per_expert(name: str, stacked: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """``<layer>.mlp.experts.gate_up_proj`` [E, 2 * I, hidden] / ``down_proj`` [E, hidden, I] as the checkpoint's
    per-expert tensors (``mlp.experts.<e>.gate_proj.weight`` ...)."""
    prefix, param = name.rsplit(".", 1)
    for e, rows in enumerate(stacked):
        if param == "down_proj":
            yield f"{prefix}.{e}.down_proj.weight", rows
        else:
            gate, up = rows.chunk(2)
            yield f"{prefix}.{e}.gate_proj.weight", gate
            yield f"{prefix}.{e}.up_proj.weight", up


def _uninitialised(config: ModelConfig, device: torch.device | str, dtype: torch.dtype,
                   tp: TensorParallel, precision: Precision | None = None) -> LlamaForCausalLM:
    """The model (this rank's slice) with its parameters allocated on ``device`` but not filled (the
    callers write every one)."""
    with uninitialised_parameters():
        return LlamaForCausalLM(config, dtype=dtype, device=device, tp=tp, precision=precision)
