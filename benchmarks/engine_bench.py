"""What the Engine benchmarks (bench_modules.py, bench_truncation.py) share: the Llama-3-8B-shaped dummy
model on CUDA, the tokenizer an Engine with given options will use, and the JSON report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def gpu_8b_options(work: Path) -> dict[str, Any]:
    """Engine options for Llama-3-8B shapes (32 layers, the default model's vocabulary), dummy weights,
    with the default model's tokenizer; the config is written under ``work``."""
    from bench_serving_gpu import default_tokenizer, llama3_8b_dir

    return dict(model=str(llama3_8b_dir(work / "llama3-8b", 32, 49152)), load_format="dummy",
                tokenizer=default_tokenizer())


def engine_tokenizer(options: dict[str, Any]):
    """The tokenizer an Engine built with ``options`` loads (to build prompts before starting it)."""
    import radixrelay.server.tokenizer as tk
    from radixrelay.config import EngineConfig
    from radixrelay.model.registry import tokenizer_path

    keys = ("model", "tokenizer", "load_format")
    return tk.load_tokenizer(tokenizer_path(EngineConfig(**{k: v for k, v in options.items() if k in keys})))


def write_report(report: dict[str, Any], out: Path | None, quiet: tuple[str, ...] = ("ttft_ms",)) -> None:
    """Print ``report`` without its per-request lists (``quiet``); write it whole to ``out``."""
    print(json.dumps({k: v for k, v in report.items() if k not in quiet}, indent=1))
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
