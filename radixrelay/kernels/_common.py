"""Pieces shared by the attention kernels: argument checks and the Triton inner steps.

Conventions (docs/kv_layout.md): ``k_cache``/``v_cache`` are ``[num_slots, num_kv_heads, head_dim]``;
token position ``t`` of a page list ``pages`` lives in slot
``pages[t // page_size] * page_size + t % page_size``. Inside the kernels scores are kept in base-2
units (``s2 = sm_scale * log2(e) * q.k``) so that ``exp2`` is used; the LSE handed out is natural-log.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.compiler import CompiledKernel
from triton.runtime import driver

LOG2E = math.log2(math.e)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TL_FLOAT_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}  # constexprs
FP8_CACHE = torch.float8_e4m3fn     # an FP8 KV cache (``--kv-cache-dtype fp8``): read as the query's dtype


class KernelLaunch:
    """One launch of a ``@triton.jit`` kernel, made again with some tensor arguments replaced (every layer
    of a step: new q, cache and outputs, the same indices, sizes and grid; or a per-step kernel bound to
    fixed buffers: a new count and grid each step).

    ``args``: every parameter of the kernel by name, in order, constexprs included; ``options``: launch options
    (num_warps, num_stages, maxnreg). The first call goes through ``kernel[grid](...)`` (argument binding,
    specialisation key, compiling or finding the variant: the bulk of a launch's host time) and keeps the
    ``CompiledKernel`` it returns; later calls hand the argument list straight to that kernel's launcher,
    as ``JITFunction.run`` does after its lookup (triton 3.x:
    ``CompiledKernel.run(grid, stream, function, packed_metadata, launch_metadata, hooks, *args)``).
    Exact while the variant applies: a replaced tensor keeps its dtype and whether its address is a
    multiple of 16 (both checked: otherwise the full path runs and binds again), and the bound integers
    (strides) must still describe it (the caller's promise); a replaced integer must be one the kernel
    does not specialise on (``do_not_specialize``), also the caller's promise. A kernel sees a tensor argument as its address
    and dtype only. Under the interpreter every call takes the full path.
    """

    def __init__(self, kernel, grid: tuple[int, ...], args: dict, options: dict) -> None:
        names = getattr(kernel, "arg_names", None)        # (absent from test doubles)
        if names is not None and list(args) != list(names):
            raise ValueError(f"KernelLaunch: arguments {list(args)} for parameters {list(names)}")
        self.kernel, self.options = kernel, options
        self.grid = (tuple(grid) + (1, 1))[:3]
        self.args = list(args.values())
        self._index = {name: i for i, name in enumerate(args)}
        self._compiled = None

    def __call__(self, grid: tuple[int, ...] | None = None, **tensors):
        """Launch with the named arguments replaced (tensors; integers the kernel does not specialise on),
        on ``grid`` if given (else the bound one); returns the compiled kernel (None: interpreter)."""
        if grid is not None:
            grid = (tuple(grid) + (1, 1))[:3]
        else:
            grid = self.grid
        args, compiled = self.args, self._compiled
        for name, value in tensors.items():
            i = self._index[name]
            old = args[i]
            if compiled is not None and (type(value) is not type(old) or _aligned(value) != _aligned(old)
                                         or getattr(value, "dtype", None) != getattr(old, "dtype", None)):
                compiled = None                          # another variant may apply: bind again
            args[i] = value
        if compiled is None:
            out = self.kernel[grid](*args, **self.options)
            self._compiled = out if isinstance(out, CompiledKernel) else None
            return out
        stream = driver.active.get_current_stream(driver.active.get_current_device())
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        if _no_hooks(enter) and _no_hooks(leave):       # (empty hook chains: the launcher skips None)
            meta = enter = leave = None
        else:                                          # a profiler's hooks get what JITFunction.run gives them
            meta = compiled.launch_metadata(grid, stream, *args)
        compiled.run(*grid, stream, compiled.function, compiled.packed_metadata, meta, enter, leave, *args)
        return compiled


def _no_hooks(hook) -> bool:
    """No launch hook: None, or an empty ``HookChain`` (triton >= 3.5)."""
    return not getattr(hook, "calls", hook)


def _aligned(value) -> bool | None:
    """What Triton specialises a tensor argument on besides its dtype: a 16-byte-aligned address."""
    return value.data_ptr() % 16 == 0 if isinstance(value, torch.Tensor) else None


def torch_fallback(t: torch.Tensor) -> bool:
    """Whether a small per-step kernel on ``t``'s device runs as torch ops instead: the CPU without the
    Triton interpreter (no Triton driver there)."""
    return t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def check_index(name: str, t: torch.Tensor, device: torch.device, numel: int | None = None) -> None:
    """An index tensor: 1-D, int32, contiguous, on ``device``, with ``numel`` entries if given."""
    check(isinstance(t, torch.Tensor), f"{name} must be a tensor, got {type(t).__name__}")
    check(t.dim() == 1, f"{name} must be 1-D, got shape {tuple(t.shape)}")
    check(t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}")
    check(t.device == device, f"{name} is on {t.device}, expected {device}")
    check(t.is_contiguous(), f"{name} must be contiguous")
    if numel is not None:
        check(t.numel() == numel, f"{name} must have {numel} entries, got {t.numel()}")


def check_qkv(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_size: int) -> int:
    """Check queries and the paged cache against each other; return the GQA group size."""
    check(q.dim() == 3, f"q must be [tokens, num_q_heads, head_dim], got shape {tuple(q.shape)}")
    check(k_cache.dim() == 3, f"k_cache must be [num_slots, num_kv_heads, head_dim], got {tuple(k_cache.shape)}")
    check(k_cache.shape == v_cache.shape, f"k_cache {tuple(k_cache.shape)} != v_cache {tuple(v_cache.shape)}")
    check(k_cache.stride() == v_cache.stride(), "k_cache and v_cache must have the same strides")
    check(q.dtype in FLOAT_DTYPES, f"q dtype {q.dtype} not supported (fp16, bf16, fp32)")
    check(k_cache.dtype == v_cache.dtype and k_cache.dtype in (q.dtype, FP8_CACHE),
          f"k_cache and v_cache must be q's dtype or float8_e4m3fn (an FP8 cache, scale 1), got {q.dtype}, "
          f"{k_cache.dtype}, {v_cache.dtype}")
    check(q.device == k_cache.device == v_cache.device, "q, k_cache and v_cache must be on one device")
    head_dim = q.shape[2]
    check(k_cache.shape[2] == head_dim, f"head_dim of q ({head_dim}) != of the cache ({k_cache.shape[2]})")
    check(16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0,
          f"head_dim must be a power of two in [16, 256], got {head_dim}")
    check(q.stride(2) == 1 and k_cache.stride(2) == 1, "the head_dim axis of q and the cache must be contiguous")
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    check(num_q_heads % num_kv_heads == 0,
          f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    check(isinstance(page_size, int) and page_size >= 1, f"page_size must be a positive int, got {page_size}")
    check(k_cache.shape[0] % page_size == 0,
          f"num_slots ({k_cache.shape[0]}) must be a multiple of page_size ({page_size})")
    return num_q_heads // num_kv_heads


def check_page_table(page_table: torch.Tensor, rows: int, device: torch.device) -> None:
    check(page_table.dim() == 2 and page_table.shape[0] == rows,
          f"page_table must be [{rows}, max_pages], got shape {tuple(page_table.shape)}")
    check(page_table.dtype == torch.int32, f"page_table must be int32, got {page_table.dtype}")
    check(page_table.device == device, f"page_table is on {page_table.device}, expected {device}")
    check(page_table.stride(1) == 1, "page_table rows must be contiguous")


def check_out(out, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
    """Validate an optional caller-provided ``(o, lse)`` pair, or allocate one."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device), torch.empty(shape[:-1], dtype=torch.float32,
                                                                           device=device)
    o, lse = out
    check(tuple(o.shape) == shape and o.dtype == dtype and o.device == device,
          f"out[0] must be {shape} {dtype} on {device}, got {tuple(o.shape)} {o.dtype} on {o.device}")
    check(tuple(lse.shape) == shape[:-1] and lse.dtype == torch.float32 and lse.device == device,
          f"out[1] must be {shape[:-1]} float32 on {device}, got {tuple(lse.shape)} {lse.dtype}")
    check(o.stride(-1) == 1, "out[0] must be contiguous along head_dim")
    return o, lse


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 products (tests); 16-bit inputs run on the tensor cores as they are."""
    return "ieee" if dtype == torch.float32 else "tf32"


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def pick_splits(work_items: int, kv_len: int, block_n: int, slots: int, overhead: int) -> tuple[int, int]:
    """Split a KV length over programs: ``work_items`` independent (query tile, KV head) items run on
    ``slots`` concurrent programs; each program costs its chunk plus ``overhead`` tokens' worth of time.

    Picks the split count with the fewest modelled token-steps, counting wave quantisation. Returns
    ``(splits, chunk)``; ``chunk`` is a multiple of ``block_n`` and ``splits * chunk >= kv_len``.
    """
    kv_len = max(kv_len, 1)
    work_items = max(work_items, 1)
    max_splits = triton.cdiv(kv_len, block_n)
    best = None
    for splits in range(1, min(max_splits, 4 * triton.cdiv(slots, work_items)) + 1):
        chunk = triton.cdiv(triton.cdiv(kv_len, splits), block_n) * block_n
        cost = triton.cdiv(work_items * splits, slots) * (chunk + overhead)
        if best is None or cost < best[0]:
            best = (cost, triton.cdiv(kv_len, chunk), chunk)
    return best[1], best[2]


@triton.jit
def load_kv_tile(k_cache, v_cache, pages, pos, valid, page_size, kv_head, stride_slot, stride_head, offs_d):
    """Gather K and V for token positions ``pos`` [BN] of a page list: two [BN, D] tiles (0 where invalid)."""
    page = tl.load(pages + pos // page_size, mask=valid, other=0)
    slot = page.to(tl.int64) * page_size + pos % page_size
    offs = slot[:, None] * stride_slot + kv_head * stride_head + offs_d[None, :]
    k = tl.load(k_cache + offs, mask=valid[:, None], other=0.0)
    v = tl.load(v_cache + offs, mask=valid[:, None], other=0.0)
    return k, v


@triton.jit
def softmax_step(q, k, v, m_i, l_i, acc, qk_scale, mask, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One online-softmax step of a [BM, D] query tile against a [BN, D] K/V tile.

    ``qk_scale`` = sm_scale * log2(e); ``m_i`` [BM] running max of the scaled scores (base-2 units),
    ``l_i`` [BM] running sum, ``acc`` [BM, D] fp32.
    With ``MASKED`` the scores outside ``mask`` [BM, BN] are dropped; rows with nothing seen yet keep
    ``m_i = -inf`` and contribute no NaN.
    """
    k = k.to(q.dtype)              # an FP8 cache (e4m3, scale 1): exact in the query's dtype; else no-op
    v = v.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)           # [BM, BN] raw scores q.k
    if MASKED:
        s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    if MASKED:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s * qk_scale - m_ref[:, None])                          # scale folded into one FMA
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def finish_rows(m_i, l_i, acc):
    """Normalise: returns ``o`` [BM, D] (0 for empty rows) and the natural-log ``lse`` [BM] (-inf if empty)."""
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    return o, lse


def gather_kv_reference(cache: torch.Tensor, pages: torch.Tensor, positions: torch.Tensor, page_size: int):
    """Torch gather of token ``positions`` [L] of a page list: returns ``cache`` rows [L, num_kv_heads, D]."""
    pos = positions.long()
    slots = pages.long()[pos // page_size] * page_size + pos % page_size
    return cache[slots]


def attend_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float,
                     allowed: torch.Tensor | None = None, dtype: torch.dtype = torch.float64):
    """Dense attention in ``dtype``: q [n, Hq, D], k/v [L, Hkv, D], allowed [n, L] bool (None = all).

    Returns o [n, Hq, D] and natural-log lse [n, Hq]; rows that attend nothing get o = 0, lse = -inf.
    """
    group = q.shape[1] // k.shape[1]
    k = k.to(dtype).repeat_interleave(group, dim=1)
    v = v.to(dtype).repeat_interleave(group, dim=1)
    s = torch.einsum("nhd,lhd->nhl", q.to(dtype), k) * sm_scale                   # [n, Hq, L]
    if allowed is not None:
        s = s.masked_fill(~allowed[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1) if s.shape[-1] else s.new_full(s.shape[:2], float("-inf"))
    lse_ref = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - lse_ref[..., None])
    return torch.einsum("nhl,lhd->nhd", p, v), lse
