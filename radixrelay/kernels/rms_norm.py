"""RMSNorm, optionally fused with the residual add before it, in one launch (one program per row).

API::

    rms_norm(x, weight, eps) -> y
    rms_norm(x, weight, eps, residual=r) -> (y, s)      s = x + r (the new residual stream), y = norm(s)
    rms_norm(..., quantize=True)                        y as ``QuantizedRows`` (e4m3 rows, per-row scales)

    x, r:    [T, hidden] fp16 / bf16 / fp32, rows contiguous along hidden
    weight:  [hidden], the model's dtype
    y, s:    [T, hidden] new tensors, dtype of x

With ``quantize`` the kernel hands y's rows, rounded to their dtype, to ``fp8_quant.quantize_row`` instead of
writing them: ``QuantizedRows(q [T, hidden] e4m3, scale [T, 1] float32, y's dtype)``, ``quantize_rows(y)``
bit for bit under the interpreter, for the FP8 product that takes y (one launch and a [T, hidden] round
trip fewer). Compiled, the two variants may sum a row's squares in different orders: then a rare value of y
moves by a bf16 step and its e4m3 code by one (the row scales stay the same; ``tests/model/test_fp8_cuda.py``
bounds the share of codes that move).

The roundings are the unfused model's (HF ``LlamaRMSNorm``): ``s`` is ``x + r`` rounded to the dtype;
``y = weight * (s_f32 * rsqrt(mean(s_f32^2) + eps)).to(dtype)``, the product rounded to the dtype. Only
the order of the fp32 sum of squares differs from torch's reduction (last-bit differences in fp32,
invisible after a 16-bit rounding almost always). Replaces the ~9 small kernels of the unfused
add + norm on the GPU (a decode step of Llama-3-8B launches 65 of them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixrelay.kernels._common import FLOAT_DTYPES, TL_FLOAT_DTYPES, check
from radixrelay.kernels.fp8 import QuantizedRows
from radixrelay.kernels.fp8_quant import MAX_COLS, new_quantized, quantize_row


# num_rows varies per step; not specialised (radixrelay.worker.warmup: no compiles after ready).
@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(
    x, residual, weight, y, s, q, scales, num_rows, hidden, eps,
    stride_x, stride_r, stride_y, stride_s, stride_q,
    HAS_RESIDUAL: tl.constexpr, QUANTIZE: tl.constexpr, OUT_DTYPE: tl.constexpr, BLOCK: tl.constexpr,
):
    # grid: (num_rows,); one program normalises one row of ``hidden`` values. QUANTIZE: y's row goes to
    # ``q`` [num_rows, hidden] e4m3 and ``scales`` [num_rows, 1] float32 instead of ``y``.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < hidden
    xv = tl.load(x + row * stride_x + offs, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        rv = tl.load(residual + row * stride_r + offs, mask=ok, other=0.0)
        xv = (xv.to(tl.float32) + rv.to(tl.float32)).to(xv.dtype)           # x + r, rounded as torch does
        tl.store(s + row * stride_s + offs, xv, mask=ok)
    xf = xv.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = (xf * inv).to(xv.dtype)
    w = tl.load(weight + offs, mask=ok, other=0.0)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(OUT_DTYPE)       # y, rounded to its dtype
    if QUANTIZE:
        quantize_row(out.to(tl.float32), ok, q + row * stride_q + offs, scales + row)
    else:
        tl.store(y + row * stride_y + offs, out, mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             quantize: bool = False):
    """See the module docstring."""
    check(x.dim() == 2, f"rms_norm: x must be [tokens, hidden], got shape {tuple(x.shape)}")
    num_rows, hidden = x.shape
    check(x.dtype in FLOAT_DTYPES, f"rms_norm: dtype {x.dtype} not supported (fp16, bf16, fp32)")
    check(weight.shape == (hidden,) and weight.device == x.device,
          f"rms_norm: weight must be [{hidden}] on {x.device}, got {tuple(weight.shape)} on {weight.device}")
    check(x.stride(1) == 1 and weight.stride(0) == 1, "rms_norm: rows must be contiguous")
    if residual is not None:
        check(residual.shape == x.shape and residual.dtype == x.dtype and residual.device == x.device,
              f"rms_norm: residual must match x {tuple(x.shape)} {x.dtype}, got {tuple(residual.shape)} "
              f"{residual.dtype}")
        check(residual.stride(1) == 1, "rms_norm: residual rows must be contiguous")
    check(not quantize or hidden <= MAX_COLS, f"rms_norm: quantize takes up to {MAX_COLS} columns, got {hidden}")
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    if quantize:
        q, scale = new_quantized(num_rows, hidden, x.device)
        y = q                                                   # (not written: the kernel writes q, scale)
    else:
        y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
        q, scale = y, y                                         # (not written)
    s = torch.empty_like(x) if residual is not None else x     # (x: not written without a residual)
    if num_rows:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(num_rows,)](
            x, residual if residual is not None else x, weight, y, s, q, scale, num_rows, hidden, eps,
            x.stride(0), residual.stride(0) if residual is not None else 0, y.stride(0), s.stride(0), q.stride(0),
            HAS_RESIDUAL=residual is not None, QUANTIZE=quantize, OUT_DTYPE=TL_FLOAT_DTYPES[out_dtype], BLOCK=block,
            num_warps=min(16, max(1, block // 512)))
    normed = QuantizedRows(q, scale, out_dtype) if quantize else y
    return normed if residual is None else (normed, s)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """The unfused model's ops (``radixrelay.model.layers.RMSNorm`` on the GPU), same return shape."""
    s = x if residual is None else x + residual
    sf = s.float()
    y = weight * (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)).to(s.dtype)
    return y if residual is None else (y, s)
