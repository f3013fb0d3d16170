"""``load_model``: a model name or path -> (``LlamaForCausalLM`` on the device, ``ModelConfig``).

Formats: ``safetensors`` (HF directory), ``gguf`` (a .gguf file, or a directory holding exactly
one), ``dummy`` (random weights for the config of an HF directory or a given ``ModelConfig``;
for benchmarks and tests), ``auto`` (picked from what the path holds). Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

from radixrelay.model.config import ModelConfig
from radixrelay.model.layers import uninitialised_parameters
from radixrelay.model.llama import LlamaForCausalLM
from radixrelay.model.registry import resolve_model_path
from radixrelay.model.weights_gguf import open_gguf
from radixrelay.model.weights_hf import iter_safetensors_weights, read_hf_config

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
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build and load a model in eval mode. ``dtype`` defaults to float32 on CPU, bfloat16 on
    CUDA; ``seed`` only matters for ``dummy`` weights."""
    dtype = dtype or default_dtype(device)
    if isinstance(model, ModelConfig):
        if load_format not in ("auto", "dummy"):
            raise ValueError(f"load_model: a ModelConfig can only be loaded with dummy weights, not {load_format!r}")
        return _dummy(model, device, dtype, seed), model

    path = resolve_model_path(model)
    fmt = _detect_format(path) if load_format == "auto" else load_format
    if fmt == "dummy":
        config = open_gguf(_gguf_file(path))[0] if _is_gguf(path) else read_hf_config(path)
        return _dummy(config, device, dtype, seed), config
    if fmt == "safetensors":
        if not path.is_dir():
            raise ValueError(f"load_model: safetensors needs a model directory, got {path}")
        config = read_hf_config(path)
        weights = iter_safetensors_weights(path)
    elif fmt == "gguf":
        config, weights = open_gguf(_gguf_file(path))
    else:
        raise ValueError(f"load_model: unknown load_format {load_format!r}")
    net = _uninitialised(config, device, dtype)
    net.load_weights(weights)
    return net.eval().requires_grad_(False), config


def _is_gguf(path: Path) -> bool:
    return path.suffix == ".gguf" or (path.is_dir() and any(path.glob("*.gguf"))
                                      and not any(path.glob("*.safetensors")))


def _detect_format(path: Path) -> LoadFormat:
    if _is_gguf(path):
        return "gguf"
    if path.is_dir() and any(path.glob("*.safetensors")):
        return "safetensors"
    raise ValueError(f"load_model: {path} holds neither *.safetensors nor a .gguf file")


def _gguf_file(path: Path) -> Path:
    if path.is_file():
        return path
    files = sorted(path.glob("*.gguf"))
    if len(files) != 1:
        raise ValueError(f"load_model: {path} must hold exactly one .gguf file, found {[f.name for f in files]}")
    return files[0]


@torch.no_grad()
def _dummy(config: ModelConfig, device: torch.device | str, dtype: torch.dtype, seed: int) -> LlamaForCausalLM:
    """Random weights created on the device: norms 1, biases 0, matrices N(0, DUMMY_STD)."""
    net = _uninitialised(config, device, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in net.named_parameters():
        if "norm" in name:
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.normal_(0.0, DUMMY_STD, generator=gen)
    return net.eval().requires_grad_(False)


def _uninitialised(config: ModelConfig, device: torch.device | str, dtype: torch.dtype) -> LlamaForCausalLM:
    """The model with its parameters allocated on ``device`` but not filled (the callers write every
    one)."""
    with uninitialised_parameters():
        return LlamaForCausalLM(config, dtype=dtype, device=device)
