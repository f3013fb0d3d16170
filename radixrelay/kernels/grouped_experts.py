"""Routed experts' SwiGLU MLPs as two grouped GEMMs over tokens sorted by expert (Mixtral, Qwen3-MoE).

API::

    plan = plan_experts(ids, num_experts)               # ids: int [T, k], each token's chosen experts
    out = grouped_experts(x, ids, weights, gate_up, down)    # plan, both launches and the weighted sum

    x:       [T, hidden] fp16 / bf16 / fp32, rows contiguous
    ids:     int [T, k];  weights: float32 [T, k]
    gate_up: [E, 2 * I, hidden] (each expert's gate rows, then its up rows);  down: [E, hidden, I]
    out:     [T, hidden], dtype of x: sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = ids[t, j]

The plan (torch ops on the device, no host sync): the M = T * k (token, choice) pairs sorted by expert id
(stable), each expert's run padded to a multiple of ``BLOCK_M`` rows, laid out in ``P = padded_rows(M, E,
BLOCK_M)`` rows, the most any routing can need (``M + E * (BLOCK_M - 1)`` rounded up): ``rows[p]`` is the pair
at padded row p (M for a padding row), ``block_expert[b]`` the expert of block b (-1 past the last expert's
rows), ``dest[j]`` the padded row of pair j. P depends on M only, so a step's shapes, grids and buffers are
fixed by its token count: CUDA graphs capture it.

``_grouped_gemm_kernel``, grid (P / BLOCK_M, cdiv(N, BLOCK_N)): program (b, n) multiplies block b's rows by
expert ``block_expert[b]``'s weight rows [n * BLOCK_N, +BLOCK_N), over K in BLOCK_K steps, fp32
accumulation; a block past the experts' rows returns at once. Launched twice per layer, for all experts:

- gate/up (``SWIGLU``): the rows are gathered from x (pair // k; padding rows read as zero) and each program
  keeps two accumulators, the gate's rows n and the up's rows I + n, writing ``silu(gate) * up`` [P, I]
  with the roundings of the unfused ops (gate and up rounded to the dtype, silu in fp32 rounded, then the
  product);
- down: the rows are the padded layout's own, [P, I] -> [P, hidden].

Then each pair's row ``dest[j]`` is weighted and the k choices of a token summed in float32 (``combine``: a
fixed order, no atomics). fp32 products use IEEE fp32 (no TF32); under the interpreter (CPU tensors) the
bf16 / fp16 tiles are multiplied in fp32, which is exact per product as the tensor cores are.

``grouped_experts_reference`` computes the same in torch ops (float64-capable), expert by expert;
``warm_up_variants`` launches every variant a model's steps can need (one per block size).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from radixrelay.kernels._common import FLOAT_DTYPES, check
from radixrelay.kernels.silu_mul import _silu_times

BLOCK_N, BLOCK_K = 64, 32


def block_m(pairs: int, num_experts: int) -> int:
    """Rows per block: small where each expert gets few rows (decode), larger for long extends. A function of
    the step's pair count, so a captured shape keeps its block (not measured on a GPU yet)."""
    per_expert = pairs / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def padded_rows(pairs: int, num_experts: int, block: int) -> int:
    """The padded layout's rows: every expert's run rounded up to whole blocks, for any routing."""
    return triton.cdiv(pairs + num_experts * (block - 1), block) * block


@dataclass(frozen=True)
class ExpertPlan:
    rows: torch.Tensor          # int32 [P]: the (token, choice) pair at each padded row; M for padding
    block_expert: torch.Tensor  # int32 [P / block]: each block's expert, -1 past the last expert's rows
    dest: torch.Tensor          # int64 [M]: each pair's padded row
    block: int                  # rows per block (BLOCK_M)


def plan_experts(ids: torch.Tensor, num_experts: int, block: int | None = None) -> ExpertPlan:
    """ids: int [T, k] -> the padded layout of the pairs sorted by expert (module docstring); device ops only."""
    flat = ids.reshape(-1).long()                                        # [M], (token, choice) order
    pairs = flat.numel()
    block = block or block_m(pairs, num_experts)
    total = padded_rows(pairs, num_experts, block)
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block - 1) // block * block
    pad_end = torch.cumsum(padded, 0)                                    # [E]: each expert's padded run ends here
    pad_start = pad_end - padded
    count_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)                             # [M]: pairs sorted by expert
    expert = flat[order]
    dest_sorted = pad_start[expert] + torch.arange(pairs, device=device) - count_start[expert]
    rows = torch.full((total,), pairs, dtype=torch.int32, device=device)
    rows[dest_sorted] = order.to(torch.int32)
    dest = torch.empty_like(dest_sorted)
    dest[order] = dest_sorted
    starts = torch.arange(0, total, block, device=device)
    block_expert = torch.searchsorted(pad_end, starts, right=True)      # the first expert ending past the start
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return ExpertPlan(rows, block_expert, dest, block)


@triton.jit
def _dot(x, b, acc, IEEE: tl.constexpr):
    """acc + x @ b, fp32 accumulation. IEEE: in fp32 arithmetic (fp32 operands without TF32; bf16 operands under
    the interpreter, whose bf16 product is wrong, taken exactly: a bf16 product is exact in fp32)."""
    if IEEE:
        return acc + tl.dot(x.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return acc + tl.dot(x, b)


# the pair count varies per step: not specialised, so that no batch size compiles a new variant
@triton.jit(do_not_specialize=["pairs"])
def _grouped_gemm_kernel(a, rows, w, block_expert, out, pairs, top_k, N, K, stride_a, stride_we, stride_wn,
                         stride_out, GATHER: tl.constexpr, SWIGLU: tl.constexpr, IEEE: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # grid: (P / BLOCK_M, cdiv(N, BLOCK_N)); out [P, N]; SWIGLU: N = I, w [E, 2I, K]; else w [E, N, K]
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert + pid_m)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if GATHER:                                      # rows of x: each pair's token; padding rows read as zero
        pair = tl.load(rows + offs_m)
        valid = pair < pairs
        a_row = (pair // top_k).to(tl.int64)
    else:                                           # the padded layout's own rows
        valid = offs_m >= 0
        a_row = offs_m.to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_base = w + expert.to(tl.int64) * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(a + a_row[:, None] * stride_a + offs_k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        b_ok = k_ok[:, None] & n_ok[None, :]
        b = tl.load(w_base + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None], mask=b_ok, other=0.0)
        acc = _dot(x, b, acc, IEEE)
        if SWIGLU:                                  # the up rows, I below the gate's
            b = tl.load(w_base + (offs_n + N)[None, :].to(tl.int64) * stride_wn + offs_k[:, None], mask=b_ok,
                        other=0.0)
            acc_up = _dot(x, b, acc_up, IEEE)
    dtype = out.dtype.element_ty
    if SWIGLU:
        res = _silu_times(acc.to(dtype), acc_up.to(dtype))
    else:
        res = acc.to(dtype)
    dst = out + offs_m[:, None].to(tl.int64) * stride_out + offs_n[None, :]
    tl.store(dst, res, mask=n_ok[None, :])


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, plan: ExpertPlan, top_k: int, *, gather: bool,
                 swiglu: bool) -> torch.Tensor:
    """One launch over all experts. gather: ``a`` is x [T, K], rows gathered by the plan; else ``a`` is [P, K] in
    the padded layout. swiglu: ``w`` [E, 2N, K] -> silu(gate) * up [P, N]; else ``w`` [E, N, K] -> [P, N]."""
    total = plan.rows.shape[0]
    pairs = plan.dest.shape[0]
    rows_w, k = w.shape[1:]
    n = rows_w // 2 if swiglu else rows_w
    check(a.dim() == 2 and a.shape[1] == k and a.stride(1) == 1,
          f"grouped_gemm: a must be [rows, {k}] with contiguous rows, got {tuple(a.shape)}")
    check(gather or a.shape[0] == total, f"grouped_gemm: a must hold the plan's {total} padded rows, got {a.shape[0]}")
    check(w.stride(2) == 1 and a.dtype == w.dtype and a.dtype in FLOAT_DTYPES and a.device == w.device,
          f"grouped_gemm: a and w of one float dtype and device with contiguous rows, got {a.dtype} {w.dtype}")
    check(not swiglu or rows_w % 2 == 0, f"grouped_gemm: swiglu needs an even number of weight rows, got {rows_w}")
    out = torch.empty(total, n, dtype=a.dtype, device=a.device)
    if pairs == 0:
        return out
    grid = (total // plan.block, triton.cdiv(n, BLOCK_N))
    _grouped_gemm_kernel[grid](a, plan.rows, w, plan.block_expert, out, pairs, top_k, n, k, a.stride(0),
                               w.stride(0), w.stride(1), out.stride(0), GATHER=gather, SWIGLU=swiglu,
                               IEEE=a.dtype == torch.float32 or a.device.type == "cpu", BLOCK_M=plan.block, BLOCK_N=BLOCK_N,
                               BLOCK_K=BLOCK_K, num_warps=4)
    return out


def combine(expert_out: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """expert_out: [T * k, hidden] in (token, choice) order; weights: float32 [T, k] -> [T, hidden] in ``dtype``:
    each token's choices weighted and summed in float32."""
    tokens, k = weights.shape
    out = expert_out.view(tokens, k, expert_out.shape[-1]).float() * weights[:, :, None]
    return out.sum(dim=1).to(dtype)


def _check_experts(x, ids, weights, gate_up, down) -> None:
    check(x.dim() == 2 and ids.dim() == 2 and ids.shape[0] == x.shape[0] and weights.shape == ids.shape,
          f"grouped_experts: x [T, hidden], ids and weights [T, k], got {tuple(x.shape)}, {tuple(ids.shape)}, "
          f"{tuple(weights.shape)}")
    e, two_i, hidden = gate_up.shape
    check(hidden == x.shape[1] and down.shape == (e, hidden, two_i // 2),
          f"grouped_experts: gate_up [E, 2I, {x.shape[1]}] and down [E, {x.shape[1]}, I], got "
          f"{tuple(gate_up.shape)}, {tuple(down.shape)}")


def grouped_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor) -> torch.Tensor:
    """See the module docstring."""
    _check_experts(x, ids, weights, gate_up, down)
    plan = plan_experts(ids, gate_up.shape[0])
    top_k = ids.shape[1]
    act = grouped_gemm(x, gate_up, plan, top_k, gather=True, swiglu=True)           # [P, I]
    out = grouped_gemm(act, down, plan, top_k, gather=False, swiglu=False)          # [P, hidden]
    return combine(out[plan.dest], weights, x.dtype)


def warm_up_variants(gate_up: torch.Tensor, down: torch.Tensor, top_k: int) -> list[int]:
    """Launch both kernels once per block size (the variants a model's steps can need: the rest of a variant's key
    is fixed by the weights' shapes and dtype), on enough rows to pick each; returns the block sizes launched.
    For start-up warm-up, so that no step waits on the JIT."""
    experts, hidden = gate_up.shape[0], gate_up.shape[2]
    blocks = []
    for per_expert in (1, 32, 128):                   # pairs per expert that pick 16, 32 and 64 rows
        tokens = triton.cdiv(per_expert * experts, top_k)
        x = torch.zeros(tokens, hidden, dtype=gate_up.dtype, device=gate_up.device)
        ids = torch.arange(tokens * top_k, device=gate_up.device).remainder(experts).view(tokens, top_k)
        weights = torch.full((tokens, top_k), 1.0 / top_k, device=gate_up.device)
        grouped_experts(x, ids, weights, gate_up, down)
        blocks.append(block_m(tokens * top_k, experts))
    return blocks


def grouped_experts_reference(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                              down: torch.Tensor) -> torch.Tensor:
    """The same in torch ops, expert by expert over its pairs (any float dtype; float64 for tests)."""
    _check_experts(x, ids, weights, gate_up, down)
    k, inter = ids.shape[1], down.shape[2]
    flat = ids.reshape(-1)
    out = torch.zeros(flat.numel(), x.shape[1], dtype=x.dtype, device=x.device)
    for e in range(gate_up.shape[0]):
        pairs = torch.nonzero(flat == e).reshape(-1)
        h = x[pairs // k] @ gate_up[e].t()
        out[pairs] = (F.silu(h[:, :inter]) * h[:, inter:]) @ down[e].t()
    return combine(out, weights, x.dtype)
