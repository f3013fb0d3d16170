"""Merge partial attention states ``(o, lse)`` by log-sum-exp: any number of parts per row, one launch.

API::

    merge_attention_states(o_parts, lse_parts, indptr, part_ids, out=None) -> (o, lse)

    o_parts:   [P, H, D]  fp16 / bf16 / fp32, partial outputs (each normalised over its own KV)
    lse_parts: [P, H]     float32, natural-log LSE of each part; -inf marks an empty part
    indptr:    [N + 1]    int32, row n merges parts part_ids[indptr[n]:indptr[n + 1]]
    part_ids:  [nnz]      int32, indices into P (a part may be used by several rows)
    out:       optional preallocated (o [N, H, D] dtype of o_parts, lse [N, H] float32)
    returns    o [N, H, D] in the dtype of o_parts, lse [N, H] float32 (natural log)

Exact merge (docs/kv_layout.md): ``o = sum_i o_i e^(l_i - m) / sum_i e^(l_i - m)``, ``m = max_i l_i``,
``lse = m + log(sum_i e^(l_i - m))``. A row with no parts, or only empty parts, gets ``o = 0`` and
``lse = -inf``; an empty part never contributes, even if its ``o`` holds garbage, so no NaN appears.
Accumulation is in fp32. Used across cascade levels and to reduce the KV splits of the other kernels
(``merge_splits``: row n merges parts ``n * S .. n * S + S - 1``, no index tensors).

In place, one part per row (the prefill cascade: a shared run's result into its extend rows)::

    merge_into_rows(o, lse, rows, o_part, lse_part) -> None

    o:         [T, H, D]  fp16 / bf16 / fp32, merged in place (rows not in ``rows`` are left alone)
    lse:       [T, H]     float32, natural log, merged in place
    rows:      [R]        int32, distinct row indices into o (a repeated row is a race)
    o_part:    [R, H, D]  fp16 / bf16 / fp32, entry r merges into row rows[r]
    lse_part:  [R, H]     float32, natural log; -inf marks an empty part

The same math as ``merge_states`` of two sides (radixrelay.attention.reference): an empty side leaves the
other unchanged, both empty give ``o = 0, lse = -inf``, an empty side's ``o`` never reaches the result.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixrelay.kernels._common import FLOAT_DTYPES, KernelLaunch, check, check_index, check_out, num_sms


# Not specialised (radixrelay.worker.warmup): the index tensors and both lse tensors (slices at per-step
# offsets: their alignment varies) and the split count, so that no new value compiles a new variant mid-serving.
@triton.jit(do_not_specialize=["indptr", "part_ids", "rows", "lse_parts", "lse_out", "parts_per_row"])
def _merge_kernel(
    o_parts, lse_parts, indptr, part_ids, rows, o_out, lse_out,
    parts_per_row, num_heads, head_dim,
    stride_op_p, stride_op_h, stride_lp_p, stride_lp_h,
    stride_o_n, stride_o_h, stride_l_n, stride_l_h,
    INDEXED: tl.constexpr, INTO_ROWS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # grid: (rows, cdiv(num_heads, BLOCK_H)); one program merges a [BLOCK_H, D] tile of one row. INTO_ROWS:
    # program n's destination is row rows[n] of o_out, lse_out, whose own state is merged in as a first part.
    row = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < num_heads
    hd_ok = h_ok[:, None] & (offs_d[None, :] < head_dim)
    if INDEXED:
        start = tl.load(indptr + row)
        end = tl.load(indptr + row + 1)
    else:
        start = row * parts_per_row
        end = start + parts_per_row

    if INTO_ROWS:
        dest = tl.load(rows + row).to(tl.int64)
        o_ptrs = o_out + dest * stride_o_n + offs_h[:, None] * stride_o_h + offs_d[None, :]
        lse_ptrs = lse_out + dest * stride_l_n + offs_h * stride_l_h
        m_i = tl.load(lse_ptrs, mask=h_ok, other=float("-inf"))
        s_i = tl.where(m_i == float("-inf"), 0.0, 1.0)
        acc = tl.where(s_i[:, None] > 0.0, tl.load(o_ptrs, mask=hd_ok, other=0.0).to(tl.float32), 0.0)
    else:
        o_ptrs = o_out + row * stride_o_n + offs_h[:, None] * stride_o_h + offs_d[None, :]
        lse_ptrs = lse_out + row * stride_l_n + offs_h * stride_l_h
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)   # running max of lse (natural log)
        s_i = tl.zeros([BLOCK_H], tl.float32)                  # running sum of e^(lse - m)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for i in range(start, end):
        if INDEXED:
            part = tl.load(part_ids + i).to(tl.int64)
        else:
            part = tl.cast(i, tl.int64)
        lse = tl.load(lse_parts + part * stride_lp_p + offs_h * stride_lp_h, mask=h_ok, other=float("-inf"))
        o = tl.load(o_parts + part * stride_op_p + offs_h[:, None] * stride_op_h + offs_d[None, :],
                    mask=hd_ok, other=0.0).to(tl.float32)
        m_new = tl.maximum(m_i, lse)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_ref)
        beta = tl.exp(lse - m_ref)
        acc = acc * alpha[:, None] + tl.where(beta[:, None] > 0.0, o * beta[:, None], 0.0)
        s_i = s_i * alpha + beta
        m_i = m_new

    empty = s_i == 0.0
    o = acc / tl.where(empty, 1.0, s_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, s_i)))
    tl.store(o_ptrs, o.to(o_out.dtype.element_ty), mask=hd_ok)
    tl.store(lse_ptrs, lse, mask=h_ok)


def max_block_h(num_heads: int, head_dim: int) -> int:
    """The largest head tile: all heads, at most 4096 elements of [BLOCK_H, BLOCK_D]."""
    return max(1, min(triton.next_power_of_2(num_heads), 4096 // triton.next_power_of_2(head_dim)))


def pick_block_h(num_rows: int, num_heads: int, head_dim: int, device: torch.device) -> int:
    """BLOCK_H of a merge of ``num_rows`` rows: the largest head tile, halved while the programs are too few
    to hide the latency of the loop over parts. One of ``block_h_choices`` (powers of two)."""
    block_h = max_block_h(num_heads, head_dim)
    while block_h > 1 and num_rows * triton.cdiv(num_heads, block_h) < 4 * num_sms(device):
        block_h //= 2
    return block_h


def block_h_choices(num_heads: int, head_dim: int) -> list[int]:
    """Every BLOCK_H ``pick_block_h`` can return for these heads (the start-up warm-up compiles each)."""
    return [1 << i for i in range(max_block_h(num_heads, head_dim).bit_length())]


def bind_merge(o_parts, lse_parts, indptr, part_ids, o, lse, parts_per_row: int, block_h: int | None = None,
               num_warps: int = 4, rows: torch.Tensor | None = None) -> KernelLaunch | None:
    """The launch of ``launch_merge`` (None: no rows), to repeat with new ``o_parts``, ``lse_parts``,
    ``o_out``, ``lse_out`` of the same shapes and strides (``KernelLaunch``). ``rows``: int32 [N], merge row n
    into row rows[n] of (o, lse) in place, its own state the first part (``merge_into_rows``)."""
    num_heads, head_dim = o.shape[1:]
    num_rows = o.shape[0] if rows is None else rows.numel()
    if num_rows == 0:
        return None
    block_d = triton.next_power_of_2(head_dim)
    if block_h is None:
        block_h = pick_block_h(num_rows, num_heads, head_dim, o.device)
    indexed = indptr is not None
    return KernelLaunch(_merge_kernel, (num_rows, triton.cdiv(num_heads, block_h)), dict(
        o_parts=o_parts, lse_parts=lse_parts, indptr=indptr if indexed else lse_parts,
        part_ids=part_ids if indexed else lse_parts, rows=lse_parts if rows is None else rows, o_out=o, lse_out=lse,
        parts_per_row=parts_per_row, num_heads=num_heads, head_dim=head_dim,
        stride_op_p=o_parts.stride(0), stride_op_h=o_parts.stride(1),
        stride_lp_p=lse_parts.stride(0), stride_lp_h=lse_parts.stride(1),
        stride_o_n=o.stride(0), stride_o_h=o.stride(1), stride_l_n=lse.stride(0), stride_l_h=lse.stride(1),
        INDEXED=indexed, INTO_ROWS=rows is not None, BLOCK_H=block_h, BLOCK_D=block_d,
    ), dict(num_warps=num_warps))


def launch_merge(o_parts, lse_parts, indptr, part_ids, o, lse, parts_per_row: int, block_h: int | None = None,
                 num_warps: int = 4) -> None:
    """Merge into preallocated (o, lse) of any dtype; ``indptr=None``: row n merges parts n*S..n*S+S-1."""
    launch = bind_merge(o_parts, lse_parts, indptr, part_ids, o, lse, parts_per_row, block_h, num_warps)
    if launch is not None:
        launch()


def bind_merge_splits(o_parts: torch.Tensor, lse_parts: torch.Tensor, o: torch.Tensor,
                      lse: torch.Tensor) -> KernelLaunch | None:
    """The launch of ``merge_splits`` (None: no rows); repeat it with new tensors as ``bind_merge``'s."""
    n, splits, h, d = o_parts.shape
    return bind_merge(o_parts.view(n * splits, h, d), lse_parts.view(n * splits, h), None, None, o, lse, splits)


def merge_splits(o_parts: torch.Tensor, lse_parts: torch.Tensor, o: torch.Tensor, lse: torch.Tensor) -> None:
    """Reduce KV splits in place into ``(o, lse)``: o_parts [N, S, H, D] fp32, lse_parts [N, S, H]."""
    launch = bind_merge_splits(o_parts, lse_parts, o, lse)
    if launch is not None:
        launch()


def bind_merge_into_rows(o: torch.Tensor, lse: torch.Tensor, rows: torch.Tensor, o_part: torch.Tensor,
                         lse_part: torch.Tensor, block_h: int | None = None,
                         num_warps: int = 4) -> KernelLaunch | None:
    """Check the arguments of ``merge_into_rows`` and bind its launch (None: no rows), to repeat with new
    ``o``, ``lse``, ``o_part``, ``lse_part`` of the same shapes and strides (``KernelLaunch``)."""
    check(o.dim() == 3, f"o must be [rows, heads, head_dim], got shape {tuple(o.shape)}")
    check(o.dtype in FLOAT_DTYPES, f"o dtype {o.dtype} not supported (fp16, bf16, fp32)")
    check(o.stride(2) == 1, "o must be contiguous along head_dim")
    num_heads, head_dim = o.shape[1:]
    check(tuple(lse.shape) == tuple(o.shape[:2]) and lse.dtype == torch.float32,
          f"lse must be {tuple(o.shape[:2])} float32, got {tuple(lse.shape)} {lse.dtype}")
    check_index("rows", rows, o.device)
    num_rows = rows.numel()
    check(tuple(o_part.shape) == (num_rows, num_heads, head_dim),
          f"o_part must be {(num_rows, num_heads, head_dim)}, got {tuple(o_part.shape)}")
    check(o_part.dtype in FLOAT_DTYPES, f"o_part dtype {o_part.dtype} not supported (fp16, bf16, fp32)")
    check(o_part.stride(2) == 1, "o_part must be contiguous along head_dim")
    check(tuple(lse_part.shape) == (num_rows, num_heads) and lse_part.dtype == torch.float32,
          f"lse_part must be {(num_rows, num_heads)} float32, got {tuple(lse_part.shape)} {lse_part.dtype}")
    check(lse.device == o_part.device == lse_part.device == o.device, "o, lse, o_part, lse_part must be on one device")
    return bind_merge(o_part, lse_part, None, None, o, lse, 1, block_h, num_warps, rows=rows)


def merge_into_rows(o: torch.Tensor, lse: torch.Tensor, rows: torch.Tensor, o_part: torch.Tensor,
                    lse_part: torch.Tensor, block_h: int | None = None) -> None:
    """Merge ``(o_part[r], lse_part[r])`` into ``(o[rows[r]], lse[rows[r]])`` in place, one launch; ``rows``
    distinct (see the module docstring). ``block_h``: the head tile (default ``pick_block_h``)."""
    launch = bind_merge_into_rows(o, lse, rows, o_part, lse_part, block_h)
    if launch is not None:
        launch()


def merge_into_rows_reference(o: torch.Tensor, lse: torch.Tensor, rows: torch.Tensor, o_part: torch.Tensor,
                              lse_part: torch.Tensor, dtype: torch.dtype = torch.float64):
    """Pure torch, out of place, in ``dtype``: returns the merged (o [T, H, D], lse [T, H]); entries that
    share a row are merged into it one after another."""
    o, lse = o.to(dtype), lse.to(dtype)
    for r, row in enumerate(rows.tolist()):
        m = torch.maximum(lse[row], lse_part[r].to(dtype))
        m_ref = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        w_a, w_b = torch.exp(lse[row] - m_ref), torch.exp(lse_part[r].to(dtype) - m_ref)   # [H]
        total = w_a + w_b
        acc = (torch.where(w_a[:, None] > 0, o[row] * w_a[:, None], 0)
               + torch.where(w_b[:, None] > 0, o_part[r].to(dtype) * w_b[:, None], 0))
        o[row] = acc / torch.where(total == 0, 1, total)[:, None]
        lse[row] = m_ref + torch.log(total)
    return o, lse


def merge_attention_states(o_parts: torch.Tensor, lse_parts: torch.Tensor, indptr: torch.Tensor,
                           part_ids: torch.Tensor, out=None) -> tuple[torch.Tensor, torch.Tensor]:
    check(o_parts.dim() == 3, f"o_parts must be [parts, heads, head_dim], got shape {tuple(o_parts.shape)}")
    check(o_parts.dtype in FLOAT_DTYPES, f"o_parts dtype {o_parts.dtype} not supported")
    check(o_parts.stride(2) == 1, "o_parts must be contiguous along head_dim")
    check(tuple(lse_parts.shape) == tuple(o_parts.shape[:2]),
          f"lse_parts must be {tuple(o_parts.shape[:2])}, got {tuple(lse_parts.shape)}")
    check(lse_parts.dtype == torch.float32, f"lse_parts must be float32, got {lse_parts.dtype}")
    check(lse_parts.device == o_parts.device, "lse_parts and o_parts must be on one device")
    check_index("indptr", indptr, o_parts.device)
    check(indptr.numel() >= 1, "indptr needs at least one entry")
    check_index("part_ids", part_ids, o_parts.device)
    num_rows = indptr.numel() - 1
    o, lse = check_out(out, (num_rows, o_parts.shape[1], o_parts.shape[2]), o_parts.dtype, o_parts.device)
    launch_merge(o_parts, lse_parts, indptr, part_ids, o, lse, 0)
    return o, lse


def merge_attention_states_reference(o_parts: torch.Tensor, lse_parts: torch.Tensor, indptr: torch.Tensor,
                                     part_ids: torch.Tensor, dtype: torch.dtype | None = None):
    """Pure-torch merge in ``dtype`` (default: float64); same contract as ``merge_attention_states``."""
    dtype = dtype or torch.float64
    num_rows = indptr.numel() - 1
    counts = (indptr[1:] - indptr[:-1]).long()
    row_of = torch.repeat_interleave(torch.arange(num_rows, device=indptr.device), counts)  # [nnz]
    ids = part_ids[: int(indptr[-1])].long()
    lse = lse_parts[ids].to(dtype)                                   # [nnz, H]
    o = o_parts[ids].to(dtype)                                       # [nnz, H, D]
    h, d = o_parts.shape[1:]
    m = torch.full((num_rows, h), float("-inf"), dtype=dtype, device=o.device)
    m = m.scatter_reduce(0, row_of[:, None].expand(-1, h), lse, reduce="amax")
    m_ref = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lse - m_ref[row_of])                               # [nnz, H], 0 for empty parts
    s = torch.zeros((num_rows, h), dtype=dtype, device=o.device).index_add_(0, row_of, w)
    wo = torch.where(w[..., None] > 0, o * w[..., None], torch.zeros_like(o))
    acc = torch.zeros((num_rows, h, d), dtype=dtype, device=o.device).index_add_(0, row_of, wo)
    empty = s == 0
    out = acc / torch.where(empty, torch.ones_like(s), s)[..., None]
    out_lse = torch.where(empty, torch.full_like(s, float("-inf")), m_ref + torch.log(torch.where(empty, 1, s)))
    return out, out_lse
