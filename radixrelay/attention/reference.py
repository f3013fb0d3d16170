"""Pure-torch paged attention: the reference every kernel is tested against (CPU and CUDA).

Conventions (docs/kv_layout.md): ``q: [T, Hq, D]``, caches ``[num_slots, Hkv, D]``, query head h
reads KV head ``h // (Hq // Hkv)``, ``lse`` is the natural-log log-sum-exp of the scaled scores,
float32 ``[T, Hq]`` (float64 when q is float64); a row that attends nothing has ``lse = -inf`` and
output 0.

Masking: query row i of request b sits at position ``p = prefix_lens[b] + i`` and attends KV
positions ``j`` with ``kv_start[b] <= j < kv_end[b]`` and ``j <= p`` (causal). Defaults
``kv_start = 0`` and ``kv_end = prefix_lens + q_len`` give ordinary extend/decode; other windows
give the partial results that cascaded attention merges with ``merge_states``.

The work is padded to ``[B, max_q_len, max_kv_len]`` and done in a few batched ops; the gather
plan (``AttentionPlan``) depends only on the batch, so a backend builds it once per step and
reuses it for every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionPlan:
    q_rows: torch.Tensor    # int64 [B, Lq] flat row of each padded query (clamped where invalid)
    q_valid: torch.Tensor   # bool [B, Lq]
    kv_slots: torch.Tensor  # int64 [B, S] cache slot of each padded KV position (clamped)
    mask: torch.Tensor      # bool [B, Lq, S] True where the query attends the KV position
    num_tokens: int         # T


def plan_attention(
    page_table: torch.Tensor,
    page_size: int,
    q_indptr: torch.Tensor,
    prefix_lens: torch.Tensor,
    kv_start: torch.Tensor | None = None,
    kv_end: torch.Tensor | None = None,
    *,
    max_q_len: int | None = None,
    max_kv_len: int | None = None,
    num_tokens: int | None = None,
) -> AttentionPlan:
    """Gather indices and mask for a ragged batch. Pass the host sizes (maxima may over-estimate)
    to avoid device syncs; page_table: int32 [B, max_pages]; the rest int [B] / [B + 1]."""
    device = page_table.device
    q_indptr = q_indptr.long()
    q_lens = q_indptr[1:] - q_indptr[:-1]                              # [B]
    prefix_lens = prefix_lens.long()
    kv_start = torch.zeros_like(prefix_lens) if kv_start is None else kv_start.long()
    kv_end = prefix_lens + q_lens if kv_end is None else kv_end.long()
    if max_q_len is None:
        max_q_len = int(q_lens.max())
    if max_kv_len is None:
        max_kv_len = int((kv_end - kv_start).max())
    max_kv_len = max(max_kv_len, 1)
    if num_tokens is None:
        num_tokens = int(q_indptr[-1])

    i = torch.arange(max(max_q_len, 1), device=device)
    q_valid = i[None, :] < q_lens[:, None]                             # [B, Lq]
    q_rows = torch.where(q_valid, q_indptr[:-1, None] + i[None, :], 0)
    q_pos = prefix_lens[:, None] + i[None, :]                          # [B, Lq]

    kv_pos = kv_start[:, None] + torch.arange(max_kv_len, device=device)[None, :]   # [B, S]
    kv_valid = kv_pos < kv_end[:, None]
    page_idx = (kv_pos // page_size).clamp(max=page_table.shape[1] - 1)
    kv_slots = page_table.long().gather(1, page_idx) * page_size + kv_pos % page_size

    mask = (q_valid[:, :, None] & kv_valid[:, None, :]
            & (kv_pos[:, None, :] <= q_pos[:, :, None]))               # [B, Lq, S]
    return AttentionPlan(q_rows, q_valid, kv_slots, mask, num_tokens)


def attend_planned(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    sm_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run attention for a plan. Returns ``o: [T, Hq, D]`` in q's dtype and ``lse: [T, Hq]``
    (natural log, float32; float64 for float64 q)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"attention: {num_heads} query heads not a multiple of {num_kv_heads} KV heads")
    if q.shape[0] != plan.num_tokens:
        raise ValueError(f"attention: q has {q.shape[0]} rows, plan expects {plan.num_tokens}")
    group = num_heads // num_kv_heads
    scale = head_dim ** -0.5 if sm_scale is None else sm_scale
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32

    batch, max_q = plan.q_rows.shape
    qp = q[plan.q_rows].to(compute).view(batch, max_q, num_kv_heads, group, head_dim)
    k = k_cache[plan.kv_slots].to(compute)                             # [B, S, Hkv, D]
    v = v_cache[plan.kv_slots].to(compute)
    scores = torch.einsum("bqhgd,bshd->bhgqs", qp, k) * scale          # [B, Hkv, G, Lq, S]
    scores = scores.masked_fill(~plan.mask[:, None, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                              # [B, Hkv, G, Lq]
    # Rows that attend nothing: lse = -inf; subtract 0 instead so that p = exp(-inf) = 0, not NaN.
    probs = torch.exp(scores - torch.where(lse.isinf(), 0.0, lse)[..., None])
    o = torch.einsum("bhgqs,bshd->bqhgd", probs, v)                    # [B, Lq, Hkv, G, D]

    rows = plan.q_rows[plan.q_valid]                                   # [T]
    out = q.new_empty(q.shape)
    out[rows] = o.reshape(batch, max_q, num_heads, head_dim)[plan.q_valid].to(q.dtype)
    lse_out = torch.empty(num_tokens, num_heads, dtype=compute, device=q.device)
    lse_out[rows] = lse.permute(0, 3, 1, 2).reshape(batch, max_q, num_heads)[plan.q_valid]
    return out, lse_out


def extend_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    q_indptr: torch.Tensor,
    prefix_lens: torch.Tensor,
    kv_start: torch.Tensor | None = None,
    kv_end: torch.Tensor | None = None,
    sm_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged paged attention: request b's rows ``[q_indptr[b], q_indptr[b+1])`` sit at positions
    ``prefix_lens[b] + i`` and attend the cached KV window ``[kv_start, kv_end)`` causally (the
    new tokens' K/V must already be in the cache). Returns ``(o [T, Hq, D], lse [T, Hq])``."""
    plan = plan_attention(page_table, page_size, q_indptr, prefix_lens, kv_start, kv_end)
    return attend_planned(q, k_cache, v_cache, plan, sm_scale)


def decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    seq_lens: torch.Tensor,
    kv_start: torch.Tensor | None = None,
    kv_end: torch.Tensor | None = None,
    sm_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per request (``q: [B, Hq, D]``) at position ``seq_lens[b] - 1``, attending KV
    positions ``[kv_start, kv_end)`` (default ``[0, seq_lens)``). Returns ``(o, lse)``."""
    q_indptr = torch.arange(q.shape[0] + 1, device=q.device, dtype=torch.int32)
    return extend_reference(q, k_cache, v_cache, page_table, page_size, q_indptr,
                            seq_lens - 1, kv_start, kv_end, sm_scale)


def merge_states(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention results over disjoint KV sets: o: [T, H, D], lse: [T, H]
    (natural log). An empty side (lse = -inf) returns the other side; both empty gives (0, -inf)."""
    m = torch.maximum(lse1, lse2)
    m_safe = torch.where(m.isinf(), 0.0, m)
    w1 = torch.exp(lse1 - m_safe)                                      # [T, H]
    w2 = torch.exp(lse2 - m_safe)
    total = w1 + w2
    denom = torch.where(total == 0, 1.0, total)
    o = (o1.to(w1.dtype) * w1[..., None] + o2.to(w1.dtype) * w2[..., None]) / denom[..., None]
    return o.to(o1.dtype), m_safe + torch.log(total)
