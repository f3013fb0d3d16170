"""Start-up warm-up of the attention kernels: every Triton variant serving can launch is compiled (or
loaded from Triton's disk cache) before the worker reports ready, so that no step stalls on the JIT.

A variant is one entry of a kernel's in-memory cache: its constexprs, launch options (warps, stages,
register cap), argument dtypes and specialised arguments (an integer equal to 1 or divisible by 16, a
pointer aligned to 16 bytes). The kernels do not specialise what changes from step to step (their
``do_not_specialize``: index slices, page-table width, split counts, lse strides), so what is left is
fixed by the model and the cache (heads, head dim, dtype, page size, cache strides) plus these sets:

    kernel        varies with the step                          values (Llama-3-8B, bf16, H100)
    paged_decode  out dtype x launch options                    (bf16, alone), (fp32, alone), (fp32, beside),
                                                                (fp32, beside light)
    shared_node   tile config (folded rows; TMA) x out dtype    BLOCK_M 16, 32, 64 gathered, 128 by TMA
                                                                x {bf16 (one split), fp32 (parts)}
    merge         INDEXED x BLOCK_H (rows)                      {False, True} x {1, 2, 4, 8, 16, 32}
    prefill_merge merge's INTO_ROWS mode x BLOCK_H (rows)       {1, 2, 4, 8, 16, 32}
    extend        BLOCK_M (the step's longest extend)           16, 32, 64, 128

With a model given, also its FP8 layers' split-K products and its routed experts' grouped GEMMs (one
launch per block size and expert shape).

("alone": the own-KV decode with the GPU to itself; "beside": next to the shared node on the side stream,
``cascade_decode.OWN_BESIDE``, or ``OWN_BESIDE_LIGHT`` beside light nodes; the out dtype is the model's where one
split writes the result directly, fp32 where splits or cascade levels go to a parts buffer.) Each variant is launched once, on a few tokens of the
real KV cache (read only; outputs go to scratch tensors), through the same launch functions serving uses.

Bounded in time: the budget is checked between launches (one compilation, about a second, can overrun
it); variants not reached are named in the report. Counts come from ``radixrelay.kernels.jit_counter``
(installed here); under ``TRITON_INTERPRET=1`` the launches run in the interpreter and count nothing.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import torch

from radixrelay.attention.kv_cache import KVCache
from radixrelay.attention.triton_backend import TritonBackend
from radixrelay.kernels import cascade_decode, extend, host_copy, jit_counter, merge, paged_decode, shared_node
from radixrelay.kernels.jit_counter import JitCounts

logger = logging.getLogger(__name__)

DEFAULT_BUDGET_S = 300.0


@dataclass(frozen=True)
class AttentionDims:
    """The attention shape of the model this worker serves."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config) -> AttentionDims:
        """From an ``AttentionDims`` or a model config (``num_heads``, ``num_kv_heads``, ``head_dim``)."""
        if isinstance(config, AttentionDims):
            return config
        return cls(config.num_heads, config.num_kv_heads, config.head_dim)

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads


@dataclass(frozen=True)
class Variant:
    name: str                       # kernel and what selects the variant, e.g. "merge indexed BLOCK_H=8"
    launch: Callable[[], object]


@dataclass(frozen=True)
class WarmupReport:
    launches: int                   # variants launched
    jit: JitCounts                  # what entered the process meanwhile (compiled or loaded from disk)
    seconds: float
    skipped: tuple[str, ...] = ()   # not launched: the time budget ran out
    errors: tuple[str, ...] = ()    # launches that raised ("name: error")
    counted: bool = True            # the counter was installed (else ``jit`` is all zeros)

    @property
    def complete(self) -> bool:
        return not self.skipped and not self.errors

    def summary(self) -> str:
        text = (f"{self.launches} kernel variants launched in {self.seconds:.1f} s: {self.jit.variants} new "
                f"({self.jit.compilations} compiled, {self.jit.cache_loads} from the disk cache)")
        if not self.counted:
            text += " [no compilation counter in this triton]"
        if self.skipped:
            text += f"; {len(self.skipped)} skipped (time budget)"
        if self.errors:
            text += f"; {len(self.errors)} failed"
        return text


def warm_up_kernels(dims, kv_cache: KVCache, backend=None, *, model: torch.nn.Module | None = None,
                    time_budget_s: float = DEFAULT_BUDGET_S) -> WarmupReport:
    """Launch every kernel variant serving can hit for ``dims`` (an ``AttentionDims`` or the model config)
    over ``kv_cache`` (page size, dtype, device and strides come from it). ``backend``: the worker's
    attention backend; a non-Triton one needs nothing (empty report), a Triton one without ``overlap``
    never runs the own-KV decode beside the shared node. ``model``: its FP8 layers' split-K products too
    (``fp8_product_variants``). Returns what it launched and caused."""
    start = time.perf_counter()
    if backend is not None and not isinstance(backend, TritonBackend):
        return WarmupReport(0, JitCounts(), 0.0)
    counted = jit_counter.install()
    overlap = getattr(backend, "overlap", True)
    device = kv_cache.device
    before = jit_counter.counts()
    launched, skipped, errors = 0, [], []
    with torch.inference_mode(), torch.cuda.device(device) if device.type == "cuda" else nullcontext():
        variants = serving_variants(AttentionDims.of(dims), kv_cache, overlap=overlap)
        if model is not None:
            variants += fp8_product_variants(model, kv_cache.model_dtype)
            if device.type == "cuda":
                variants += expert_variants(model)
        for i, variant in enumerate(variants):
            if time.perf_counter() - start > time_budget_s:
                skipped = [v.name for v in variants[i:]]
                logger.warning("kernel warm-up: time budget of %.0f s spent; not launched: %s", time_budget_s,
                               ", ".join(skipped))
                break
            at = jit_counter.counts()
            try:
                variant.launch()
                launched += 1
            except Exception as exc:  # noqa: BLE001 - reported; serving may never need this variant
                errors.append(f"{variant.name}: {type(exc).__name__}: {exc}")
                logger.error("kernel warm-up: %s failed: %s: %s", variant.name, type(exc).__name__, exc)
            new = jit_counter.counts() - at
            logger.debug("kernel warm-up: %s: %d new variant(s), %.2f s compiling", variant.name, new.variants,
                         new.compile_s)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    report = WarmupReport(launched, jit_counter.counts() - before, time.perf_counter() - start, tuple(skipped),
                          tuple(errors), counted)
    logger.info("kernel warm-up: %s", report.summary())
    return report


def fp8_product_variants(model: torch.nn.Module, dtype: torch.dtype) -> list[Variant]:
    """The split-K FP8 product (``radixrelay.kernels.fp8_gemm``) once per distinct shape of the model's FP8
    layers that take it (decode batches of few rows), on one zero row: rows are not specialised, so one
    launch covers every batch size."""
    from radixrelay.kernels.fp8_gemm import fp8_split_k
    from radixrelay.model.quantization import Fp8Linear

    def launch(layer: Fp8Linear) -> torch.Tensor:
        q = torch.zeros((1, layer.in_features), dtype=torch.float8_e4m3fn, device=layer.weight.device)
        scale = torch.ones((1, 1), dtype=torch.float32, device=layer.weight.device)
        return fp8_split_k(q, scale, layer.weight, layer.weight_scale, dtype)

    variants, shapes = [], set()
    for layer in model.modules():
        if not isinstance(layer, Fp8Linear):
            continue
        shape = (layer.in_features, layer.out_features)
        if layer.bias is None and layer.split_k(1) and shape not in shapes:
            shapes.add(shape)
            variants.append(Variant(f"fp8_split_k {shape[0]} -> {shape[1]} out={_name(dtype)}",
                                    lambda layer=layer: launch(layer)))
    return variants


def expert_variants(model: torch.nn.Module) -> list[Variant]:
    """The grouped-expert kernels (``radixrelay.kernels.grouped_experts``) once per distinct expert shape of the
    model's routed-experts layers: each block size a step's token count can pick (``warm_up_variants``)."""
    from radixrelay.kernels.grouped_experts import warm_up_variants
    from radixrelay.model.moe import SparseMoE

    variants, shapes = [], set()
    for layer in model.modules():
        if not isinstance(layer, SparseMoE):
            continue
        gate_up, down = layer.experts.gate_up_proj, layer.experts.down_proj
        shape = (tuple(gate_up.shape), tuple(down.shape), gate_up.dtype, layer.top_k)
        if shape not in shapes:
            shapes.add(shape)
            variants.append(Variant(f"grouped_experts {tuple(gate_up.shape)} top-{layer.top_k}",
                                    lambda w=gate_up, d=down, k=layer.top_k: warm_up_variants(w, d, k)))
    return variants


def serving_variants(dims: AttentionDims, kv_cache: KVCache, *, overlap: bool = True) -> list[Variant]:
    """One launch per kernel variant serving can hit (see the module docstring), on dummy inputs over the
    first layer's cache. Cascaded and flat decode first, then extend and the prefill cascade."""
    s = _Scratch(dims, kv_cache)
    alone = [("alone", cascade_decode.OWN_ALONE)]
    beside = [("beside", cascade_decode.OWN_BESIDE), ("beside light", cascade_decode.OWN_BESIDE_LIGHT)] if overlap else []
    out = []
    # own KV of a cascade (fp32 parts), flat decode with splits (fp32), flat decode in one split (model dtype)
    for (how, options), dtype in [*((o, torch.float32) for o in alone + beside), (alone[0], s.dtype)]:
        out.append(Variant(f"paged_decode {how} out={_name(dtype)}", lambda o=options, d=dtype: s.decode(o, d)))
    for indexed in (True, False):        # cascade's merge of all levels; the KV splits of one kernel
        for block_h in merge.block_h_choices(dims.num_q_heads, dims.head_dim):
            out.append(Variant(f"merge {'indexed' if indexed else 'splits'} BLOCK_H={block_h}",
                               lambda i=indexed, b=block_h: s.merge(i, b)))
    for block_h in merge.block_h_choices(dims.num_q_heads, dims.head_dim):   # prefill runs into extend rows
        out.append(Variant(f"prefill_merge BLOCK_H={block_h}", lambda b=block_h: s.merge_into_rows(b)))
    configs = shared_node.tile_configs(dims.group, dims.head_dim, kv_cache.device)
    for dtype in (torch.float32, s.dtype):   # cascade levels and split nodes (parts); one split (prefill)
        for config, kv_tma in configs:
            out.append(Variant(f"shared_node {config}{' tma' if kv_tma else ''} out={_name(dtype)}",
                               lambda c=config, t=kv_tma, d=dtype: s.shared(c, t, d)))
    for block_m in extend.tile_rows_choices():
        out.append(Variant(f"extend BLOCK_M={block_m}", lambda m=block_m: s.extend(m)))
    # a step's tokens and logprobs to the host, its inputs up (in words or bytes): one kernel either way
    for dtype in dict.fromkeys(host_copy.DTYPES + host_copy.WORDS):
        out.append(Variant(f"host_copy {_name(dtype)}", lambda d=dtype: s.host_copy(d)))
    return out


class _Scratch:
    """Dummy inputs over the first layer's cache: a few tokens on the first pages, outputs in scratch."""

    def __init__(self, dims: AttentionDims, kv_cache: KVCache) -> None:
        if dims.num_kv_heads != kv_cache.k[0].shape[1] or dims.head_dim != kv_cache.k[0].shape[2]:
            raise ValueError(f"warm-up: dims {dims} do not match the KV cache {tuple(kv_cache.k[0].shape)}")
        self.dims, self.k, self.v = dims, kv_cache.k[0], kv_cache.v[0]
        self.page_size, self.num_pages = kv_cache.page_size, kv_cache.num_pages
        self.device, self.dtype = kv_cache.device, kv_cache.model_dtype     # the queries' and outputs' dtype
        self.sm_scale = dims.head_dim ** -0.5

    def _q(self, tokens: int) -> torch.Tensor:
        return torch.zeros((tokens, self.dims.num_q_heads, self.dims.head_dim), dtype=self.dtype,
                           device=self.device)                                     # [T, Hq, D]

    def _i32(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=self.device)

    def _pages(self, tokens: int) -> torch.Tensor:
        """Consecutive page ids from 0 covering ``tokens`` (wrapping in a tiny cache)."""
        count = -(-max(tokens, 1) // self.page_size)
        return self._i32([p % self.num_pages for p in range(count)])

    def _parts(self, rows: int, splits: int, dtype: torch.dtype):
        """o [rows, splits, Hq, D], lse [rows, splits, Hq] as serving passes them: one split in the result's
        own [rows, Hq, D] (unsqueezed), several in a fresh buffer."""
        heads, dim = self.dims.num_q_heads, self.dims.head_dim
        if splits == 1:
            o = torch.zeros((rows, heads, dim), dtype=dtype, device=self.device)
            return o.unsqueeze(1), torch.zeros((rows, heads), dtype=torch.float32, device=self.device).unsqueeze(1)
        return (torch.zeros((rows, splits, heads, dim), dtype=dtype, device=self.device),
                torch.zeros((rows, splits, heads), dtype=torch.float32, device=self.device))

    def decode(self, options: dict, out_dtype: torch.dtype) -> None:
        tokens = self.page_size + 1
        o, lse = self._parts(1, 1 if out_dtype == self.dtype else 2, out_dtype)
        paged_decode.launch_splits(self._q(1), self.k, self.v, self._pages(tokens)[None, :], self.page_size,
                                   self._i32([0]), self._i32([tokens]), self.sm_scale, o, lse, self.dims.group,
                                   cascade_decode.OWN_ALIGN, **options)

    def shared(self, config: tuple[int, int, int, int], kv_tma: bool, out_dtype: torch.dtype) -> None:
        block_n = config[1]
        tokens = min(2 * block_n, self.num_pages * self.page_size) + 1     # full tiles and a partial one
        pages = self._pages(tokens)
        o, lse = self._parts(1, 1 if out_dtype == self.dtype else 2, out_dtype)
        shared_node.launch_splits(self._q(1), self.k, self.v, self.page_size, self._i32([0, 1]), self._i32([0]),
                                  self._i32([0, pages.numel()]), pages, self._i32([tokens]), self.sm_scale, o, lse,
                                  self.dims.group, -(-self.dims.group // config[0]), config, kv_tma)

    def merge(self, indexed: bool, block_h: int) -> None:
        heads, dim = self.dims.num_q_heads, self.dims.head_dim
        o_parts = torch.zeros((2, heads, dim), dtype=torch.float32, device=self.device)   # [P, Hq, D]
        lse_parts = torch.zeros((2, heads), dtype=torch.float32, device=self.device)      # [P, Hq]
        o = torch.empty((1, heads, dim), dtype=self.dtype, device=self.device)
        lse = torch.empty((1, heads), dtype=torch.float32, device=self.device)
        if indexed:
            merge.launch_merge(o_parts, lse_parts, self._i32([0, 2]), self._i32([0, 1]), o, lse, 0, block_h=block_h)
        else:
            merge.launch_merge(o_parts, lse_parts, None, None, o, lse, 2, block_h=block_h)

    def merge_into_rows(self, block_h: int) -> None:
        heads, dim = self.dims.num_q_heads, self.dims.head_dim
        o = torch.zeros((2, heads, dim), dtype=self.dtype, device=self.device)          # [T, Hq, D]
        lse = torch.zeros((2, heads), dtype=torch.float32, device=self.device)          # [T, Hq]
        merge.merge_into_rows(o, lse, self._i32([1]), torch.zeros_like(o[:1]), torch.zeros_like(lse[:1]),
                              block_h=block_h)

    def host_copy(self, dtype: torch.dtype) -> None:
        src = torch.zeros(3, dtype=dtype, device=self.device)
        dst = torch.empty(3, dtype=dtype, pin_memory=self.device.type == "cuda")
        host_copy.launch(src, dst)

    def extend(self, block_m: int) -> None:
        tokens = block_m                                      # extend picks BLOCK_M = block_m for it
        q = self._q(tokens)
        o, lse = torch.empty_like(q), torch.empty(q.shape[:2], dtype=torch.float32, device=self.device)
        extend._launch(q, self.k, self.v, self._pages(tokens)[None, :], self.page_size, self._i32([0, tokens]),
                       self._i32([0]), self._i32([0]), self.sm_scale, o, lse, self.dims.group, tokens)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def warm_up_steps(runner, *, prompt_tokens: int = 40, decode_steps: int = 4) -> float:
    """Run one short request through ``runner`` before the worker reports ready: an extend of
    ``prompt_tokens`` and ``decode_steps`` decodes, greedy, on pages ``[0, n)``. A fresh process pays
    its first-use costs here (lazy imports, the matrix-product library's kernel selection and buffers,
    first touches of the KV memory) instead of in the first request it serves.

    Invariant: nothing of it is left behind. The request is released, no page is held (the scheduler
    has handed out none yet; whatever the warm-up wrote there is overwritten before it is read), the
    runner's counters are restored, and greedy sampling draws nothing from the shared generator.
    Returns the seconds it took."""
    from radixrelay.protocol.step import AdmittedRequest, ExtendItem, StepPlan
    from radixrelay.sampling_params import SamplingParams

    start = time.perf_counter()
    counters = msgspec.structs.replace(runner.counters)    # a copy, put back in place below
    rid = -1                                          # never a scheduler rid (those count from 0)
    capacity = runner.kv_cache.num_pages * runner.page_size
    prompt_tokens = max(1, min(prompt_tokens, capacity - decode_steps))
    decode_steps = min(decode_steps, capacity - prompt_tokens)
    pages = list(range(-(-(prompt_tokens + decode_steps) // runner.page_size)))
    tokens = [i % runner.vocab_size for i in range(1, prompt_tokens + 1)]
    params = SamplingParams(max_tokens=decode_steps + 1, temperature=0.0, ignore_eos=True)
    plans = [StepPlan(-1, admitted=[AdmittedRequest(rid, tokens, prompt_tokens, pages, params)],
                      extends=[ExtendItem(rid, 0, prompt_tokens, True)])]
    plans += [StepPlan(-1, decodes=[rid])] * decode_steps + [StepPlan(-1, released=[rid])]
    for plan in plans:
        out = runner.step(plan)
        if out.error is not None:
            raise RuntimeError(f"start-up warm-up step failed: {out.error}")
    for name in counters.__struct_fields__:
        setattr(runner.counters, name, getattr(counters, name))
    return time.perf_counter() - start
