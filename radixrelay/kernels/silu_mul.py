"""SwiGLU's activation, ``silu(gate) * up``, over the fused gate/up projection, in one launch.

API::

    silu_mul(gate_up) -> out

    gate_up: [T, 2 * I] fp16 / bf16 / fp32 (gate | up), rows contiguous
    out:     [T, I] new tensor, dtype of gate_up

The roundings of the unfused ``F.silu(gate) * up``: silu computed in fp32 and rounded to the dtype, then
the product rounded (``exp`` may differ from torch's in the last fp32 bit). Saves a launch and a
``[T, I]`` round trip through memory per layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from radixrelay.kernels._common import FLOAT_DTYPES, check

BLOCK = 1024


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
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(out + row * stride_out + col, (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """See the module docstring."""
    check(gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0,
          f"silu_mul: gate_up must be [tokens, 2 * intermediate], got shape {tuple(gate_up.shape)}")
    check(gate_up.dtype in FLOAT_DTYPES, f"silu_mul: dtype {gate_up.dtype} not supported (fp16, bf16, fp32)")
    check(gate_up.stride(1) == 1, "silu_mul: rows must be contiguous")
    num_rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(num_rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    if num_rows:
        _silu_mul_kernel[(num_rows, triton.cdiv(inter, BLOCK))](
            gate_up, out, num_rows, inter, gate_up.stride(0), out.stride(0), BLOCK=BLOCK, num_warps=4)
    return out


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
