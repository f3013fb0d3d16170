"""Engine configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULE_POLICIES = ("lpm", "dfs-weight", "fcfs")
LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")


@dataclass(frozen=True)
class EngineConfig:
    model: str = "default"            # "default", an HF model directory, or a .gguf file
    device: str = "auto"              # auto: cuda when available, else cpu
    dtype: str = "auto"               # auto: float32 on cpu, bfloat16 on cuda
    load_format: str = "auto"
    kv_cache_tokens: int | None = None  # KV capacity in tokens; None: a default per device
    page_size: int = 16
    max_running_requests: int = 256
    chunked_prefill_tokens: int = 2048  # per-step budget of prefill tokens
    schedule_policy: str = "lpm"
    disable_radix_cache: bool = False
    seed: int = 0                     # seeds the worker's generator for unseeded sampled requests

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> ValueError:
            return ValueError(f"EngineConfig.{field}: {why}")

        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise bad("device", f"must be one of {DEVICES} or 'cuda:N', got {self.device!r}")
        if self.dtype not in DTYPES:
            raise bad("dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        if self.load_format not in LOAD_FORMATS:
            raise bad("load_format", f"must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise bad("schedule_policy", f"must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise bad("page_size", f"must be a power of two >= 1, got {self.page_size}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.page_size:
            raise bad("kv_cache_tokens", f"must hold at least one page ({self.page_size}), got {self.kv_cache_tokens}")
        if self.max_running_requests < 1:
            raise bad("max_running_requests", f"must be >= 1, got {self.max_running_requests}")
        if self.chunked_prefill_tokens < self.page_size:
            raise bad("chunked_prefill_tokens", f"must be >= page_size, got {self.chunked_prefill_tokens}")
