"""Per-row FP8 quantization of activations in one launch: each row's scale and its e4m3 values.

API::

    quantize_rows(x) -> (q, scale)
    x:      [T, C] fp16 / bf16 / fp32, rows contiguous
    q:      [T, C] float8_e4m3fn: x / scale, clamped to +-448, rounded to nearest (ties to even)
    scale:  [T, 1] float32: the row's largest magnitude over 448; 1 for an all-zero row

    new_quantized(rows, cols, device) -> (q, scale)     empty outputs in that layout
    quantize_row(v, ok, q_ptrs, scale_ptr)              the math of one row, as a ``@triton.jit`` epilogue

The numbers of ``radixrelay.model.quantization``'s torch path (``token_scales`` and the cast after the
division), in one kernel instead of five (abs, amax, where, divide + clamp, cast): the input of every FP8
linear layer goes through it. The division rounds to nearest (``div_rn``), as torch's does.
``quantize_row`` is the same math for kernels that produce the activations (RMSNorm, SiLU-and-mul): they
hand their rows to it in registers instead of writing them out for a separate launch, with the same results
(bit for bit but for RMSNorm's reduction order, see ``rms_norm``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixrelay.kernels._common import FLOAT_DTYPES, check

E4M3_MAX = 448.0
_MAX = tl.constexpr(E4M3_MAX)
MAX_COLS = 32768         # a row is one tile


@triton.jit
def quantize_row(v, ok, q_ptrs, scale_ptr):
    """One row ``v`` [BLOCK] float32 (lanes outside ``ok`` ignored) -> its e4m3 values at ``q_ptrs`` [BLOCK]
    (stored where ``ok``) and its float32 scale at ``scale_ptr``: amax / 448, 1 for an all-zero row."""
    amax = tl.max(tl.where(ok, tl.abs(v), 0.0), axis=0)
    scale = tl.where(amax > 0, tl.div_rn(amax, tl.full([], _MAX, tl.float32)), 1.0)
    scaled = tl.minimum(tl.maximum(tl.div_rn(v, tl.zeros_like(v) + scale), -_MAX), _MAX)
    tl.store(q_ptrs, scaled.to(q_ptrs.dtype.element_ty), mask=ok)
    tl.store(scale_ptr, scale)


# rows vary per step: not specialised (no compiles after ready)
@triton.jit(do_not_specialize=["rows"])
def _quantize_rows_kernel(x, q, scales, rows, stride_x, stride_q, COLS: tl.constexpr, BLOCK: tl.constexpr):
    # grid: (rows,); one program per row of COLS values
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < COLS
    v = tl.load(x + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    quantize_row(v, ok, q + row * stride_q + offs, scales + row)


def new_quantized(rows: int, cols: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised outputs in ``quantize_rows``' layout: q [rows, cols] e4m3 (row stride ``cols``), scale
    [rows, 1] float32 (row stride 1)."""
    check(0 < cols <= MAX_COLS, f"fp8 rows: {cols} columns (1 to {MAX_COLS})")
    return (torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=device),
            torch.empty((rows, 1), dtype=torch.float32, device=device))


def launch_options(cols: int) -> tuple[int, int]:
    """(BLOCK, num_warps) of a kernel that quantizes rows of ``cols`` values, one program per row."""
    block = triton.next_power_of_2(cols)
    return block, min(16, max(1, block // 1024))


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring."""
    check(x.dim() == 2 and x.dtype in FLOAT_DTYPES, f"quantize_rows: x must be [rows, cols] fp16/bf16/fp32, got "
          f"{tuple(x.shape)} {x.dtype}")
    rows, cols = x.shape
    check(0 < cols <= MAX_COLS and x.stride(1) == 1, f"quantize_rows: {cols} columns (1 to {MAX_COLS}, contiguous)")
    q, scale = new_quantized(rows, cols, x.device)
    if rows:
        block, warps = launch_options(cols)
        _quantize_rows_kernel[(rows,)](x, q, scale, rows, x.stride(0), q.stride(0), COLS=cols, BLOCK=block,
                                       num_warps=warps)
    return q, scale


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch ops it replaces (``radixrelay.model.quantization``'s: ``token_scales``, then the cast), same
    contract."""
    amax = x.abs().amax(dim=1, keepdim=True).float()
    scale = torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))  # true division on CUDA too
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale
