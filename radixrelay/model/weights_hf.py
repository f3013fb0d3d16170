"""Hugging Face checkpoint directories: ``config.json``, ``generation_config.json`` and
``*.safetensors`` (single file or sharded with ``model.safetensors.index.json``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch


INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's shards: those named by the index if there is one, else every file."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not weight_map:
            raise ValueError(f"{index}: no weight_map")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{model_dir}: shards named by {INDEX_FILE} are missing: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors files")
    return files


def iter_safetensors_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, CPU tensor) for every tensor of every shard, one tensor in memory at a time."""
    from safetensors import safe_open

    for file in safetensors_files(model_dir):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
