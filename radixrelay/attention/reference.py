"""Pure-torch paged attention: the reference every kernel is tested against (CPU and CUDA).

Conventions (docs/kv_layout.md): ``q: [T, Hq, D]``, caches ``[num_slots, Hkv, D]``, query head h
reads KV head ``h // (Hq // Hkv)``, ``lse`` is the natural-log log-sum-exp of the scaled scores,
float32 ``[T, Hq]`` (float64 when q is float64); a row that attends nothing has ``lse = -inf`` and
output 0.

Masking: query row i of request b sits at position ``p = prefix_lens[b] + i`` and attends KV
positions ``j`` with ``kv_start[b] <= j < kv_end[b]`` and ``j <= p`` (causal); with a sliding
``window`` also ``j > p - window`` (the last ``window`` positions, p included). Defaults
``kv_start = 0`` and ``kv_end = prefix_lens + q_len`` give ordinary extend/decode; other windows
give the partial results that cascaded attention merges with ``merge_states``.

The work is padded to ``[B, max_q_len, pages * page_size]`` and done in one batched attention; the
gather plan (``AttentionPlan``) depends only on the batch, so a backend builds it once per step and
reuses it for every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class AttentionPlan:
    """Padded work of one batch: request b's queries are rows ``[b, :q_len]`` of a ``[B, Lq]`` grid and
    its KV is gathered page by page into ``S = P * page_size`` positions starting at its first page."""

    q_rows: torch.Tensor    # int64 [B, Lq] flat row of each padded query (clamped where invalid)
    q_valid: torch.Tensor   # bool [B, Lq]
    pages: torch.Tensor     # int64 [B, P] cache page of each padded page (clamped)
    # bool [B, Lq, S] True where the query attends the KV position; None where every valid query attends
    # every gathered position (windows of whole pages wholly before their queries: shared runs, a long
    # cached prefix read on its own), so the attention needs no mask at all
    mask: torch.Tensor | None
    num_tokens: int         # T
    page_size: int
    dense: bool             # host: every grid cell is a row, in row order (B * Lq == T): no gather/scatter
    rows: torch.Tensor      # int64 [T] flat row of each valid grid cell, in grid order
    cells: torch.Tensor     # int64 [T] grid cell (b * Lq + i) of each of them
    empty: torch.Tensor     # bool [B * Lq] the cell attends nothing (lse = -inf, o = 0)
    # host (CPU plans): the first of one request's pages when they are consecutive, so that K/V are read as
    # a view of the cache instead of gathered (a long cached prefix read as a run of its own); else None
    consecutive_from: int | None = None
    # Additive masks (0 / -inf) with the GQA group folded into the query rows, per (group, dtype);
    # built on first use, shared by every layer of the step.
    _bias: dict = field(default_factory=dict, compare=False, repr=False)

    def bias(self, group: int, dtype: torch.dtype) -> torch.Tensor | None:
        """[B, 1, group * Lq, S]: row ``g * Lq + i`` is query i's mask (for each head of the group); None
        without a mask."""
        if self.mask is None:
            return None
        key = (group, dtype)
        if key not in self._bias:
            batch, max_q, seq = self.mask.shape
            zero = torch.zeros((), dtype=dtype, device=self.mask.device)
            bias = torch.where(self.mask, zero, float("-inf"))
            self._bias[key] = bias[:, None].expand(batch, group, max_q, seq).reshape(batch, 1, group * max_q, seq)
        return self._bias[key]


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
    window: int | None = None,
) -> AttentionPlan:
    """Gather indices and mask for a ragged batch. Pass the host sizes (maxima may over-estimate)
    to avoid device syncs; page_table: int32 [B, max_pages]; the rest int [B] / [B + 1]. ``window``:
    each query attends only the last ``window`` positions (itself included)."""
    device = page_table.device
    q_indptr = q_indptr.long()
    q_lens = q_indptr[1:] - q_indptr[:-1]                              # [B]
    prefix_lens = prefix_lens.long()
    aligned = kv_start is None                                         # every window starts at page 0
    kv_start = torch.zeros_like(prefix_lens) if kv_start is None else kv_start.long()
    kv_end = prefix_lens + q_lens if kv_end is None else kv_end.long()
    if max_q_len is None:
        max_q_len = int(q_lens.max())
    if max_kv_len is None:
        max_kv_len = int((kv_end - kv_start).max())
    max_kv_len = max(max_kv_len, 1)
    if num_tokens is None:
        num_tokens = int(q_indptr[-1])
    max_q_len = max(max_q_len, 1)
    batch = q_lens.shape[0]

    i = torch.arange(max_q_len, device=device)
    q_valid = i[None, :] < q_lens[:, None]                             # [B, Lq]
    q_rows = torch.where(q_valid, q_indptr[:-1, None] + i[None, :], 0)
    q_pos = prefix_lens[:, None] + i[None, :]                          # [B, Lq]

    # Whole pages from the one holding kv_start: a window of n tokens spans at most
    # ceil((page_size - 1 + n) / page_size) pages (ceil(n / page_size) when it starts at 0).
    num_pages = -(-(max_kv_len + (0 if aligned else page_size - 1)) // page_size)
    first_page = kv_start // page_size                                 # [B]
    page_idx = (first_page[:, None] + torch.arange(num_pages, device=device)).clamp(max=page_table.shape[1] - 1)
    pages = page_table.long().gather(1, page_idx)                      # [B, P]
    kv_pos = first_page[:, None] * page_size + torch.arange(num_pages * page_size, device=device)   # [B, S]
    dense = batch * max_q_len == num_tokens
    cells = q_valid.flatten().nonzero().flatten()                      # [T]
    span = num_pages * page_size
    # [B]-sized test: each window is exactly its gathered pages and ends at or before its first query
    if window is None and bool(((kv_start == first_page * page_size) & (kv_end == kv_start + span) & (kv_end <= prefix_lens)).all()):
        return AttentionPlan(q_rows, q_valid, pages, None, num_tokens, page_size, dense,
                             rows=q_rows.flatten()[cells], cells=cells, empty=~q_valid.flatten(),
                             consecutive_from=_consecutive_from(pages))
    kv_valid = (kv_pos >= kv_start[:, None]) & (kv_pos < kv_end[:, None])
    mask = (q_valid[:, :, None] & kv_valid[:, None, :]
            & (kv_pos[:, None, :] <= q_pos[:, :, None]))               # [B, Lq, S]
    if window is not None:
        mask &= kv_pos[:, None, :] > q_pos[:, :, None] - window
    return AttentionPlan(q_rows, q_valid, pages, mask, num_tokens, page_size, dense,
                         rows=q_rows.flatten()[cells], cells=cells, empty=~mask.any(-1).flatten())


def attend_planned(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    sm_scale: float | None = None,
    *,
    with_lse: bool = True,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run attention for a plan. Returns ``o: [T, Hq, D]`` in q's dtype and ``lse: [T, Hq]``
    (natural log, float32; float64 for float64 q), or None for the lse without ``with_lse``.
    ``softcap``: scaled scores s become ``softcap * tanh(s / softcap)`` before the mask (Gemma 2).

    One batched attention over the padded grid: the G query heads that share a KV head are folded
    into the query rows (``[B, Hkv, G * Lq, D]``), so each KV head is read once for its group; K/V
    are gathered a page at a time and read through a transposed view (no copy). On the CPU this is
    torch's flash-attention kernel (which returns the LSE too), elsewhere plain matmuls."""
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
    qp = q if plan.dense else q.index_select(0, plan.q_rows.flatten())        # [B * Lq, Hq, D]
    qp = qp.to(compute).view(batch, max_q, num_kv_heads, group, head_dim)
    if max_q == 1:
        qf = qp.view(batch, num_kv_heads, group, head_dim)                    # a view: heads fold as they lie
    else:
        qf = qp.permute(0, 2, 3, 1, 4).reshape(batch, num_kv_heads, group * max_q, head_dim)
    k = _gather_pages(k_cache, plan).to(compute).transpose(1, 2)              # [B, Hkv, S, D]
    v = _gather_pages(v_cache, plan).to(compute).transpose(1, 2)
    bias = plan.bias(group, compute)                                          # [B, 1, G * Lq, S] or None
    o, lse = _attend_folded(qf, k, v, bias, scale) if softcap is None else _attend_matmul(qf, k, v, bias, scale, softcap)
    # [B, Hkv, G * Lq, D] -> [B * Lq, Hq, D]: (b, i) rows, heads (kv head, group) as in q.
    o = o.view(batch, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4).reshape(-1, num_heads, head_dim)
    o = o.to(q.dtype) if plan.dense else o.index_select(0, plan.cells).to(q.dtype)
    if not plan.dense:
        o = q.new_empty(q.shape).index_copy_(0, plan.rows, o)
    if not with_lse:
        return o, None
    lse = lse.view(batch, num_kv_heads, group, max_q).permute(0, 3, 1, 2).reshape(-1, num_heads)
    lse = lse.masked_fill(plan.empty[:, None], float("-inf"))                # the kernel leaves 0 there
    if not plan.dense:
        lse = lse.new_empty(num_tokens, num_heads).index_copy_(0, plan.rows, lse.index_select(0, plan.cells))
    return o, lse


def _consecutive_from(pages: torch.Tensor) -> int | None:
    """The first page of ``pages`` [1, P] when they are P consecutive cache pages (CPU plans only: on a GPU
    this would read the device); else None."""
    if pages.device.type != "cpu" or pages.shape[0] != 1:
        return None
    first, num = int(pages[0, 0]), pages.shape[1]
    return first if torch.equal(pages[0], torch.arange(first, first + num, dtype=pages.dtype)) else None


def _gather_pages(cache: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
    """cache [num_slots, H, D] -> [B, P * page_size, H, D]: each request's pages, whole (a view where the plan's
    pages are consecutive)."""
    batch, num_pages = plan.pages.shape
    size = plan.page_size
    _, heads, dim = cache.shape
    if cache.shape[0] % size == 0 and cache.is_contiguous():
        by_page = cache.view(-1, size, heads, dim)
        if plan.consecutive_from is not None:
            first = plan.consecutive_from
            return by_page[first:first + num_pages].view(batch, num_pages * size, heads, dim)
        return by_page.index_select(0, plan.pages.flatten()).view(batch, num_pages * size, heads, dim)
    slots = plan.pages[:, :, None] * size + torch.arange(size, device=cache.device)
    return cache.index_select(0, slots.flatten()).view(batch, num_pages * size, heads, dim)


def _attend_folded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The folded grid's attention (``_attend_matmul``'s shapes): on the CPU torch's flash-attention kernel,
    elsewhere ``_attend_matmul``. Looked up at every call, so that an emulation can stand in for it
    (``benchmarks.model.bench_fp8_sensitivity --attention``: FP8 queries and probabilities)."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=bias, scale=scale)
    return _attend_matmul(q, k, v, bias, scale)


def _attend_matmul(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                   scale: float, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, L, D], k/v [B, H, S, D], bias [B, 1, L, S] or None (no mask) -> (o [B, H, L, D], lse [B, H, L]);
    rows that attend nothing get o = 0 (their lse is fixed up by the caller)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale                # [B, H, L, S]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(lse.isinf(), 0.0, lse)[..., None])
    return torch.matmul(probs, v), lse


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
