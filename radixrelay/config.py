"""Configuration: one frozen dataclass per layer, validated on construction (ValueError).

``EngineConfig`` configures the runtime processes (scheduler + worker) that the offline Engine and
the HTTP server share; ``ServerConfig`` adds what only the HTTP server needs.
"""

from __future__ import annotations

from dataclasses import dataclass

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULE_POLICIES = ("lpm", "dfs-weight", "fcfs")
LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")
ATTENTION_BACKENDS = ("auto", "triton", "torch")   # auto: triton on CUDA, torch on CPU
CASCADE_MODES = ("auto", "on", "off")
NODE_KERNELS = ("auto", "triton", "fa3")   # shared decode nodes' kernel (kernels/fa3_node.py)
KV_TIER_POLICIES = ("scheduler", "lru")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
QUANTIZATIONS = ("fp8",)             # weights (None: the model dtype); radixrelay.model.quantization
KV_CACHE_DTYPES = ("auto", "fp8")    # auto: the model dtype


def _bad(cls: str, field: str, why: str) -> ValueError:
    return ValueError(f"{cls}.{field}: {why}")


def keep_layers_problem(keep_layers, quantization: str | None) -> str | None:
    """What is wrong with ``fp8_keep_layers`` (None: nothing): a tuple of distinct layer indices, given only with
    quantization fp8. Whether each index is in the model is checked where the model is built."""
    if not isinstance(keep_layers, tuple) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                     for i in keep_layers):
        return f"must be a tuple of layer indices, got {keep_layers!r}"
    if len(set(keep_layers)) != len(keep_layers):
        return f"an index appears twice in {keep_layers!r}"
    if keep_layers and quantization != "fp8":
        return "only with quantization fp8 (the layers kept in the model dtype)"
    return None


@dataclass(frozen=True)
class EngineConfig:
    model: str = "default"            # "default", an HF model directory, or a .gguf file
    # Tokenizer to use instead of the model's own: "default", an HF directory or a .gguf file, as
    # for ``model`` (e.g. dummy weights for a config.json-only directory). None: the model's own.
    tokenizer: str | None = None
    device: str = "auto"              # auto: cuda when available, else cpu
    dtype: str = "auto"               # auto: float32 on cpu, bfloat16 on cuda
    load_format: str = "auto"
    kv_cache_tokens: int | None = None  # KV capacity in tokens; None: derived from the device
    kv_memory_fraction: float = 0.85  # CUDA, kv_cache_tokens unset: share of free memory after load
    page_size: int = 16
    max_running_requests: int = 256
    max_queued_requests: int = 1024   # waiting requests beyond this are refused (HTTP 429)
    chunked_prefill_tokens: int = 2048  # per-step budget of prefill tokens
    schedule_policy: str = "lpm"
    disable_radix_cache: bool = False
    attention_backend: str = "auto"
    # Shared decode nodes (cascade) on the triton backend: "auto" (the Triton kernel: faster in the cascade
    # where measured), "triton", or "fa3" (FlashAttention-3, required: radixrelay[fa3], Hopper, 16-bit KV).
    node_kernel: str = "auto"
    # Cascaded attention over shared radix nodes: "auto" (cost model), "on" (every shared node),
    # "off" (flat). Decode plans come from the scheduler's planner, prefill sharing from the worker.
    cascade: str = "auto"
    disable_cuda_graphs: bool = False  # CUDA + triton: decode steps run as captured graphs
    # Run the scheduler and worker in lock step (one step in flight) instead of overlapping the
    # next step's planning and launch with the device's work; for debugging and comparison.
    disable_overlap: bool = False
    # KV tiers below the device (AttentionStore): host memory in GiB (None: on CUDA 40% of available RAM,
    # at most 64 GiB; on the CPU 0, or 1 GiB to stage a disk tier's pages), disk in GiB under
    # ``disk_kv_path`` (None: no disk tier; ``disk_kv_gib`` None: 64, or 90% of the space available there
    # if less, ``radix.disk_store.disk_tier_gib``).
    host_kv_gib: float | None = None
    disk_kv_gib: float | None = None
    disk_kv_path: str | None = None
    kv_tier_policy: str = "scheduler"   # host eviction: "scheduler" (spares queued requests) | "lru"
    # Context window in tokens (None: the model's); at most the model's maximum positions.
    context_length: int | None = None
    # Context overflow (``radixrelay.radix.truncation``): a prompt that does not fit loses its oldest
    # tokens in chunks of this share of the context, instead of being refused. None: refused.
    truncation: float | None = None
    seed: int = 0                     # seeds the worker's generator for unseeded sampled requests
    startup_timeout: float = 600.0    # seconds to wait for the runtime processes to be ready
    # Tensor parallelism: the model split over this many worker processes, one per device (rank r on
    # cuda:r; gloo on the CPU), that run every step together (``radixrelay.model.parallel``).
    tp: int = 1
    # KV events (``radixrelay.kv_events``): a redis://HOST:PORT/DB store the scheduler publishes its
    # radix tree's page keys and its load to, under the name routers know this server by.
    kv_events: str | None = None
    kv_events_name: str | None = None
    # files (never the secrets themselves: a config is passed to processes): the key the events are signed
    # with (``radixrelay.kv_auth``) and the store's password (``radixrelay.kv_store``)
    kv_events_key_file: str | None = None
    kv_events_password_file: str | None = None
    # FP8 (``radixrelay.model.quantization``): "fp8" runs the decoder's linear layers in float8 e4m3 (None: the
    # model dtype); kv_cache_dtype "fp8" stores K/V in e4m3 ("auto": the model dtype). They need FP8 tensor
    # cores (CUDA, compute capability 8.9+) unless fp8_emulation runs them as quantize-then-dequantize in
    # float32 (the numbers of FP8 without its speed: tests and accuracy runs).
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    fp8_emulation: bool = False
    # decoder layers whose projections stay in the model dtype under quantization fp8 (-1: the last)
    fp8_keep_layers: tuple[int, ...] = ()
    # Pinned prefixes (``radixrelay.scheduler.pins``): most KV tokens pins may hold (None: a quarter of the
    # KV cache; 0: pins are refused), and a factor on their time-to-live (tests shorten them).
    pinned_kv_tokens: int | None = None
    pin_ttl_scale: float = 1.0
    # Per-request priority (smaller first): refused unless enabled; a queued request gains one level per
    # ``priority_ageing_s`` seconds waited.
    enable_priority: bool = False
    priority_ageing_s: float = 5.0

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> ValueError:
            return _bad("EngineConfig", field, why)

        if self.tokenizer is not None and not self.tokenizer:
            raise bad("tokenizer", "must be non-empty when set (None: the model's own)")
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise bad("device", f"must be one of {DEVICES} or 'cuda:N', got {self.device!r}")
        if self.dtype not in DTYPES:
            raise bad("dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        if self.load_format not in LOAD_FORMATS:
            raise bad("load_format", f"must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise bad("schedule_policy", f"must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise bad("attention_backend", f"must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.node_kernel not in NODE_KERNELS:
            raise bad("node_kernel", f"must be one of {NODE_KERNELS}, got {self.node_kernel!r}")
        if self.cascade not in CASCADE_MODES:
            raise bad("cascade", f"must be one of {CASCADE_MODES}, got {self.cascade!r}")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise bad("page_size", f"must be a power of two >= 1, got {self.page_size}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.page_size:
            raise bad("kv_cache_tokens", f"must hold at least one page ({self.page_size}), got {self.kv_cache_tokens}")
        if not 0 < self.kv_memory_fraction < 1:
            raise bad("kv_memory_fraction", f"must be in (0, 1), got {self.kv_memory_fraction}")
        if self.max_running_requests < 1:
            raise bad("max_running_requests", f"must be >= 1, got {self.max_running_requests}")
        if self.max_queued_requests < 0:
            raise bad("max_queued_requests", f"must be >= 0, got {self.max_queued_requests}")
        if self.chunked_prefill_tokens < self.page_size:
            raise bad("chunked_prefill_tokens", f"must be >= page_size, got {self.chunked_prefill_tokens}")
        if self.host_kv_gib is not None and not 0 <= self.host_kv_gib < 1 << 20:
            raise bad("host_kv_gib", f"must be >= 0 (0: no host tier), got {self.host_kv_gib}")
        if self.disk_kv_gib is not None and not 0 <= self.disk_kv_gib < 1 << 30:
            raise bad("disk_kv_gib", f"must be >= 0, got {self.disk_kv_gib}")
        if self.kv_events is not None:
            from radixrelay.kv_events import check_store_url

            try:
                check_store_url(self.kv_events)
            except ValueError as exc:
                raise bad("kv_events", str(exc)) from None
        elif self.kv_events_key_file is not None or self.kv_events_password_file is not None:
            raise bad("kv_events", "a key or password file is for the KV events' store: give --kv-events "
                                   "redis://HOST:PORT/DB too")
        if self.disk_kv_path is not None and not self.disk_kv_path:
            raise bad("disk_kv_path", "must be non-empty when set (None: no disk tier)")
        if self.disk_kv_path is not None and self.host_kv_gib == 0:
            raise bad("disk_kv_path", "the disk tier stages pages through host memory: host_kv_gib must be > 0")
        if self.disable_radix_cache and (self.disk_kv_path is not None or self.host_kv_gib):
            raise bad("disable_radix_cache", "the KV tiers keep pages of the radix cache: with it disabled, "
                                             "host_kv_gib and disk_kv_path would keep nothing; drop one or the other")
        if self.disk_kv_path is not None:
            from radixrelay.radix.disk_store import unsafe_directory

            why = unsafe_directory(self.disk_kv_path)   # an existing directory must be ours and private
            if why is not None:
                raise bad("disk_kv_path", why)
        if self.kv_tier_policy not in KV_TIER_POLICIES:
            raise bad("kv_tier_policy", f"must be one of {KV_TIER_POLICIES}, got {self.kv_tier_policy!r}")
        if self.context_length is not None and self.context_length < 2:
            raise bad("context_length", f"must be >= 2 tokens, got {self.context_length}")
        if self.truncation is not None and not 0 < self.truncation < 1:
            raise bad("truncation", f"must be in (0, 1) (the share of the context dropped per overflow), "
                                    f"got {self.truncation}")
        if self.startup_timeout <= 0:
            raise bad("startup_timeout", f"must be > 0, got {self.startup_timeout}")
        if not isinstance(self.tp, int) or isinstance(self.tp, bool) or self.tp < 1:
            raise bad("tp", f"must be an integer >= 1, got {self.tp!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise bad("quantization", f"must be one of {QUANTIZATIONS} or None, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise bad("kv_cache_dtype", f"must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        why = keep_layers_problem(self.fp8_keep_layers, self.quantization)
        if why:
            raise bad("fp8_keep_layers", why)
        if self.device == "cpu" and not self.fp8_emulation and (self.quantization or self.kv_cache_dtype == "fp8"):
            field = "quantization" if self.quantization else "kv_cache_dtype"
            raise bad(field, "FP8 needs a CUDA device with FP8 tensor cores (compute capability 8.9+); on the CPU "
                             "only its emulation runs (fp8_emulation=True: quantize-then-dequantize in float32)")
        if self.pinned_kv_tokens is not None and self.pinned_kv_tokens < 0:
            raise bad("pinned_kv_tokens", f"must be >= 0 (0: no pins), got {self.pinned_kv_tokens}")
        if not self.pin_ttl_scale > 0:
            raise bad("pin_ttl_scale", f"must be > 0, got {self.pin_ttl_scale}")
        if not self.priority_ageing_s > 0:
            raise bad("priority_ageing_s", f"must be > 0, got {self.priority_ageing_s}")
        if self.tp > 1 and self.device.startswith("cuda:"):
            raise bad("tp", f"with tp > 1, rank r runs on cuda:r: use device 'cuda' or 'auto', not {self.device!r}")

    def pinned_kv_budget(self, kv_cache_tokens: int) -> int:
        """Tokens pins may hold in a KV cache of ``kv_cache_tokens``: ``pinned_kv_tokens`` (at most the cache),
        by default a quarter of it."""
        if self.pinned_kv_tokens is None:
            return kv_cache_tokens // 4
        return min(self.pinned_kv_tokens, kv_cache_tokens)


MAX_API_SERVERS = 64
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral", "mistral_args")    # radixrelay.text.tool_calls.FORMATS
REASONING_PARSERS = ("auto", "think", "none")                       # radixrelay.text.reasoning


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None        # when set, /v1/* and /flush_cache need "Authorization: Bearer <key>"
    served_model_name: str | None = None  # None: the --model value
    chat_template: str | None = None  # Jinja template text overriding the model's
    tool_call_parser: str = "auto"    # the format of tool calls in outputs (auto: from the chat template)
    reasoning_parser: str = "auto"    # "think", "none" or auto (think when the template writes </think>)
    max_n: int = 16                   # most choices one request may ask for
    max_body_bytes: int = 4 * 1024 * 1024
    drain_timeout: float = 30.0       # SIGTERM: seconds in-flight requests get to finish
    log_level: str = "info"
    # Connection limits (radixrelay.net.connections): seconds a request's headers and body get to arrive
    # (not its response), and the most open connections (None: derived from the descriptor limit).
    request_read_timeout: float = 30.0
    max_connections: int | None = None
    # HTTP server processes sharing the port and the runtime (radixrelay.server.api_servers)
    api_servers: int = 1

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> ValueError:
            return _bad("ServerConfig", field, why)

        if not 1 <= self.api_servers <= MAX_API_SERVERS:
            raise bad("api_servers", f"must be in [1, {MAX_API_SERVERS}], got {self.api_servers}")

        if not 0 <= self.port < 65536:
            raise bad("port", f"must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key:
            raise bad("api_key", "must be non-empty when set")
        if self.max_n < 1:
            raise bad("max_n", f"must be >= 1, got {self.max_n}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise bad("tool_call_parser", f"must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise bad("reasoning_parser", f"must be one of {REASONING_PARSERS}, got {self.reasoning_parser!r}")
        if self.max_body_bytes < 1024:
            raise bad("max_body_bytes", f"must be >= 1024, got {self.max_body_bytes}")
        if self.drain_timeout < 0:
            raise bad("drain_timeout", f"must be >= 0, got {self.drain_timeout}")
        if self.log_level not in LOG_LEVELS:
            raise bad("log_level", f"must be one of {LOG_LEVELS}, got {self.log_level!r}")
        if not 0 < self.request_read_timeout <= 3600:
            raise bad("request_read_timeout", f"must be in (0, 3600] seconds, got {self.request_read_timeout}")
        if self.max_connections is not None and self.max_connections < 1:
            raise bad("max_connections", f"must be >= 1 when set, got {self.max_connections}")
