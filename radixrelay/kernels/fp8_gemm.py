"""FP8 products of a decode batch's few rows, split along K: where cuBLAS's FP8 product leaves most of the
GPU idle (few rows, few output columns), every multiprocessor streams a slice of the weight.

API::

    split_k_applies(rows, in_features, out_features, device) -> bool     the measured rule (below)
    split_k_max_rows(in_features, out_features, device) -> int           its row limit for one weight (0: never)
    fp8_split_k(q_x, s_x, w, s_w, out_dtype) -> y [M, N]

    q_x: [M, K] e4m3, rows contiguous          s_x: [M, 1] float32, each row's scale
    w:   [N, K] e4m3, K contiguous              s_w: [N] float32, each output channel's scale
    y = (q_x @ w^T) * s_x * s_w^T in ``out_dtype``, fp32 accumulation: ``torch._scaled_mm``'s contract

Two launches. ``_split_k_kernel``, grid (N / BLOCK_N, M / BLOCK_M, SPLIT): program (n, m, s) multiplies rows
[m * BLOCK_M, +BLOCK_M) by weight rows [n * BLOCK_N, +BLOCK_N) over K columns [s * K / SPLIT, +K / SPLIT),
both as TMA tiles (rows past M read as zero), and writes its fp32 partial [BLOCK_M, BLOCK_N]. Then
``_reduce_kernel`` sums the SPLIT partials of each output and applies both scales.

The rule, measured on an H100 (benchmarks/results/model/fp8_gemm_h100_80gb_hbm3.md): at decode batches of up to
64 rows this is faster than cuBLAS's FP8 product for the 8B model's ``down`` (14336 -> 4096) and ``o``
(4096 -> 4096) projections; the wide ``gate_up`` and ``qkv`` gain nothing, and from 128 rows cuBLAS is ahead.
So: at most ``MAX_ROWS`` rows, at most ``MAX_OUT`` output columns, K a multiple of SPLIT x BLOCK_K, Hopper.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixrelay.kernels._common import check

try:  # host-side TMA descriptors (triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton: cuBLAS only
    TensorDescriptor = None

BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, STAGES, WARPS = 64, 64, 128, 4, 4, 4
MAX_ROWS = 64
MAX_OUT = 4096
REDUCE_BLOCK = 1024


# rows vary per step (decode batch sizes): not specialised, so that no batch size compiles a new variant
@triton.jit(do_not_specialize=["M"])
def _split_k_kernel(a_desc, b_desc, part, M, N, k_chunk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    # grid: (N / BLOCK_N, M / BLOCK_M, SPLIT); part: [SPLIT, M, N] fp32
    off_n = tl.program_id(0) * BLOCK_N
    off_m = tl.program_id(1) * BLOCK_M
    split = tl.program_id(2)
    k0 = split * k_chunk
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in tl.range(k0, k0 + k_chunk, BLOCK_K, num_stages=STAGES):
        a = a_desc.load([off_m, k])                                     # [BM, BK] e4m3
        b = b_desc.load([off_n, k])                                     # [BN, BK] e4m3
        acc = tl.dot(a, b.T, acc)
    rows = off_m + tl.arange(0, BLOCK_M)
    cols = off_n + tl.arange(0, BLOCK_N)
    ok = (rows < M)[:, None] & (cols < N)[None, :]
    tl.store(part + split.to(tl.int64) * M * N + rows[:, None] * N + cols[None, :], acc, mask=ok)


@triton.jit(do_not_specialize=["M"])
def _reduce_kernel(part, s_x, s_w, y, M, N, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    # grid: (M * N / BLOCK,); y [M, N] = (sum of the SPLIT partials) * s_x[row] * s_w[col]
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(part + s * M * N + offs, mask=ok, other=0.0)
    row = offs // N
    scale = tl.load(s_x + row, mask=ok, other=0.0) * tl.load(s_w + offs % N, mask=ok, other=0.0)
    tl.store(y + offs, (acc * scale).to(y.dtype.element_ty), mask=ok)


def split_k_capable(device: torch.device) -> bool:
    """Hopper (TMA and FP8 tensor cores) and a triton with tensor descriptors."""
    device = torch.device(device)
    return (TensorDescriptor is not None and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] == 9)


def split_k_max_rows(in_features: int, out_features: int, device: torch.device) -> int:
    """The most rows a product through an [out, in] FP8 weight on ``device`` takes ``fp8_split_k`` for (module
    docstring: the measured rule); 0 where it never does."""
    fits = out_features <= MAX_OUT and in_features % (SPLIT * BLOCK_K) == 0 and split_k_capable(device)
    return MAX_ROWS if fits else 0


def split_k_applies(rows: int, in_features: int, out_features: int, device: torch.device) -> bool:
    """Whether a product of ``rows`` rows through an [out, in] FP8 weight takes ``fp8_split_k``."""
    return 0 < rows <= split_k_max_rows(in_features, out_features, device)


def fp8_split_k(q_x: torch.Tensor, s_x: torch.Tensor, w: torch.Tensor, s_w: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    """See the module docstring."""
    rows, k = q_x.shape
    n = w.shape[0]
    check(q_x.dtype == w.dtype == torch.float8_e4m3fn and w.shape[1] == k and q_x.stride(1) == 1
          and w.stride(1) == 1, f"fp8_split_k: e4m3 q_x [M, K] and w [N, K] with contiguous K, got "
          f"{tuple(q_x.shape)} {q_x.dtype}, {tuple(w.shape)} {w.dtype}")
    check(k % (SPLIT * BLOCK_K) == 0, f"fp8_split_k: K = {k} must be a multiple of {SPLIT * BLOCK_K}")
    y = torch.empty((rows, n), dtype=out_dtype, device=q_x.device)
    if rows == 0:
        return y
    part = torch.empty((SPLIT, rows, n), dtype=torch.float32, device=q_x.device)
    a_desc = TensorDescriptor(q_x, [rows, k], [q_x.stride(0), 1], [BLOCK_M, BLOCK_K])
    b_desc = TensorDescriptor(w, [n, k], [w.stride(0), 1], [BLOCK_N, BLOCK_K])
    _split_k_kernel[(triton.cdiv(n, BLOCK_N), triton.cdiv(rows, BLOCK_M), SPLIT)](
        a_desc, b_desc, part, rows, n, k // SPLIT, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        STAGES=STAGES, num_warps=WARPS)
    _reduce_kernel[(triton.cdiv(rows * n, REDUCE_BLOCK),)](part, s_x.reshape(-1), s_w, y, rows, n, SPLIT=SPLIT,
                                                            BLOCK=REDUCE_BLOCK, num_warps=4)
    return y


def fp8_split_k_reference(q_x, s_x, w, s_w, out_dtype):
    """The same product in float32 torch ops (the CPU emulation's arithmetic)."""
    return ((q_x.float() @ w.float().t()) * s_x.float() * s_w.float()[None, :]).to(out_dtype)
