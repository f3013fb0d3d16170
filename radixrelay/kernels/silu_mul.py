"""SwiGLU's activation, ``silu(gate) * up``, over the fused gate/up projection, in one launch.

API::

    silu_mul(gate_up) -> out
    silu_mul(gate_up, quantize=True) -> QuantizedRows(q, scale, dtype of gate_up)

    gate_up: [T, 2 * I] fp16 / bf16 / fp32 (gate | up), rows contiguous
    out:     [T, I] new tensor, dtype of gate_up
    q:       [T, I] e4m3, scale: [T, 1] float32: bit for bit ``fp8_quant.quantize_rows(out)``

The roundings of the unfused ``F.silu(gate) * up``: silu computed in fp32 and rounded to the dtype, then
the product rounded (``exp`` may differ from torch's in the last fp32 bit). Saves a launch and a
``[T, I]`` round trip through memory per layer. With ``quantize`` one program takes a whole row (the
scale needs its largest magnitude) and hands it, rounded to the dtype, to ``fp8_quant.quantize_row``: the
input of an FP8 down projection, without a launch of its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from radixrelay.kernels._common import FLOAT_DTYPES, check
from radixrelay.kernels.fp8 import QuantizedRows
from radixrelay.kernels.fp8_quant import MAX_COLS, launch_options, new_quantized, quantize_row

BLOCK = 1024


@triton.jit
def _silu_times(g, u):
    """silu(g) * u for tiles of the gate and up halves: each op in fp32, rounded to their dtype."""
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    return (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype)


# num_rows varies per step; not specialised (radixrelay.worker.warmup: no compiles after ready).
@triton.jit(do_not_specialize=["num_rows"])
def _silu_mul_kernel(gate_up, out, num_rows, inter, stride_in, stride_out, BLOCK: tl.constexpr):
    # grid: (num_rows, cdiv(inter, BLOCK))
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = col < inter
    src = gate_up + row * stride_in
    g = tl.load(src + col, mask=ok, other=0.0)
    u = tl.load(src + inter + col, mask=ok, other=0.0)
    tl.store(out + row * stride_out + col, _silu_times(g, u), mask=ok)


@triton.jit(do_not_specialize=["num_rows"])
def _silu_mul_quantize_kernel(gate_up, q, scales, num_rows, inter, stride_in, stride_q, BLOCK: tl.constexpr):
    # grid: (num_rows,); one program per row of ``inter`` products (BLOCK >= inter)
    row = tl.program_id(0).to(tl.int64)
    col = tl.arange(0, BLOCK)
    ok = col < inter
    src = gate_up + row * stride_in
    g = tl.load(src + col, mask=ok, other=0.0)
    u = tl.load(src + inter + col, mask=ok, other=0.0)
    quantize_row(_silu_times(g, u).to(tl.float32), ok, q + row * stride_q + col, scales + row)


def silu_mul(gate_up: torch.Tensor, quantize: bool = False):
    """See the module docstring."""
    check(gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0,
          f"silu_mul: gate_up must be [tokens, 2 * intermediate], got shape {tuple(gate_up.shape)}")
    check(gate_up.dtype in FLOAT_DTYPES, f"silu_mul: dtype {gate_up.dtype} not supported (fp16, bf16, fp32)")
    check(gate_up.stride(1) == 1, "silu_mul: rows must be contiguous")
    num_rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    if quantize:
        check(0 < inter <= MAX_COLS, f"silu_mul: quantize takes 1 to {MAX_COLS} columns, got {inter}")
        q, scale = new_quantized(num_rows, inter, gate_up.device)
        if num_rows:
            block, warps = launch_options(inter)
            _silu_mul_quantize_kernel[(num_rows,)](gate_up, q, scale, num_rows, inter, gate_up.stride(0),
                                                   q.stride(0), BLOCK=block, num_warps=warps)
        return QuantizedRows(q, scale, gate_up.dtype)
    out = torch.empty(num_rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    if num_rows:
        _silu_mul_kernel[(num_rows, triton.cdiv(inter, BLOCK))](
            gate_up, out, num_rows, inter, gate_up.stride(0), out.stride(0), BLOCK=BLOCK, num_warps=4)
    return out


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
