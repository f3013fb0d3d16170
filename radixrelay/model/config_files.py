"""A model's ``ModelConfig`` from its files, without reading its weights or importing torch.

The loaders use it (``loader``, ``weights_gguf``, ``weights_hf``), and so do the checks that run
before any runtime process starts (``radixrelay.runtime.preflight``: the tensor-parallel split), in
the frontend process, which never imports torch. Formats as ``load_model`` names them: ``gguf`` (a
.gguf file, or a directory holding exactly one), ``safetensors`` and ``dummy`` (an HF directory's
``config.json``), ``auto`` (picked from what the path holds).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from radixrelay.gguf_file import GGUFFile, TensorInfo
from radixrelay.model.model_config import ModelConfig
from radixrelay.model.model_registry import resolve_model_path


def read_model_config(model: str, load_format: str = "auto") -> ModelConfig:
    """The ``ModelConfig`` of ``model`` (a name ``resolve_model_path`` takes) as ``load_model`` reads
    it for ``load_format``; ``ValueError`` when the files do not give one."""
    path = resolve_model_path(model)
    fmt = detect_format(path) if load_format == "auto" else load_format
    if fmt == "gguf" or (fmt == "dummy" and is_gguf(path)):
        return gguf_config(GGUFFile(gguf_file(path)))
    if fmt in ("safetensors", "dummy"):
        if not path.is_dir():
            raise ValueError(f"load_model: {fmt} needs a model directory, got {path}")
        return read_hf_config(path)
    raise ValueError(f"load_model: unknown load_format {load_format!r}")


def read_hf_config(model_dir: Path) -> ModelConfig:
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{model_dir}: no config.json")
    cfg = json.loads(config_file.read_text())
    gen_file = model_dir / "generation_config.json"
    generation = json.loads(gen_file.read_text()) if gen_file.is_file() else None
    return ModelConfig.from_hf(cfg, generation)


# tensors a config is made of (Phi-3's LongRoPE factors): passed with the metadata, under their tensor names
CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
_F32 = 0


def gguf_config(file: GGUFFile) -> ModelConfig:
    scalars = {k: v for k, v in file.metadata.items() if not isinstance(v, list)}  # not the vocabulary
    for t in file.tensors:
        if t.name in CONFIG_TENSORS:
            if t.ggml_type != _F32:
                raise ValueError(f"GGUF: {t.name} must be F32, got ggml type {t.ggml_type}")
            scalars[t.name] = tuple(float(f) for f in file.tensor_bytes(t).view(np.float32))
    return ModelConfig.from_gguf(scalars, {t.name: tensor_shape(t) for t in file.tensors})


def tensor_shape(tensor: TensorInfo) -> tuple[int, ...]:
    return tuple(reversed(tensor.dims))  # GGUF lists dims innermost first


def is_gguf(path: Path) -> bool:
    return path.suffix == ".gguf" or (path.is_dir() and any(path.glob("*.gguf"))
                                      and not any(path.glob("*.safetensors")))


def detect_format(path: Path) -> str:
    if is_gguf(path):
        return "gguf"
    if path.is_dir() and any(path.glob("*.safetensors")):
        return "safetensors"
    raise ValueError(f"load_model: {path} holds neither *.safetensors nor a .gguf file")


def gguf_file(path: Path) -> Path:
    if path.is_file():
        return path
    files = sorted(path.glob("*.gguf"))
    if len(files) != 1:
        raise ValueError(f"load_model: {path} must hold exactly one .gguf file, found {[f.name for f in files]}")
    return files[0]
