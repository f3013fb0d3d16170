"""``ForwardBatch``: the ragged batch of one model step, as the model and attention backends see it.

A step computes new tokens of B requests, packed back to back without padding into T rows.
Request b's new tokens are rows ``[q_indptr[b], q_indptr[b+1])`` and its positions
``[prefix_lens[b], seq_lens[b])``: positions ``[0, prefix_lens[b])`` are already in the KV cache
(radix-cached prefix or earlier chunks), ``[prefix_lens[b], seq_lens[b])`` are computed now. A
decode is simply a request with one new token, so decodes and (chunked) extends share a batch.

Build one with ``build_forward_batch`` from per-request (pages, start, num_new) on the host; the
tensors go to the device once per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BatchRequest:
    """One request's share of a step (host side)."""

    pages: Sequence[int]     # the request's page list; must cover positions [0, start + num_new)
    start: int               # first position computed this step; [0, start) is cached
    num_new: int             # tokens computed this step (1 for a decode)
    need_logits: bool = True  # return logits for the last new token


@dataclass(frozen=True)
class ForwardBatch:
    page_size: int
    # Per request (B rows), int32 on the device.
    q_indptr: torch.Tensor     # [B + 1] offsets of each request's rows in the flat batch
    prefix_lens: torch.Tensor  # [B] tokens in the cache before this step
    seq_lens: torch.Tensor     # [B] prefix_lens + new tokens
    page_table: torch.Tensor   # [B, max_pages] page ids, rows padded with page 0
    # Per new token (T rows), int64 on the device.
    positions: torch.Tensor    # [T] absolute position of each token (RoPE + causal mask)
    out_slots: torch.Tensor    # [T] KV slot each token's K/V is written to
    # Rows of the flat batch whose logits the step returns, int64 [R] (in request order).
    logits_indices: torch.Tensor
    # Host-side maxima so backends need no device sync to size their work.
    max_q_len: int
    max_seq_len: int

    @property
    def num_requests(self) -> int:
        return self.prefix_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def is_decode(self) -> bool:
        """Every request computes exactly one token."""
        return self.max_q_len == 1


def build_forward_batch(
    requests: Sequence[BatchRequest], page_size: int, device: torch.device | str
) -> ForwardBatch:
    """Pack per-request work into a ``ForwardBatch`` on ``device`` (validated on the host)."""
    if not requests:
        raise ValueError("build_forward_batch: empty batch")
    if page_size < 1:
        raise ValueError(f"build_forward_batch: page_size must be >= 1, got {page_size}")
    q_indptr, prefix_lens, seq_lens, positions, out_slots, logits_rows = [0], [], [], [], [], []
    for i, r in enumerate(requests):
        end = r.start + r.num_new
        if r.start < 0 or r.num_new < 1:
            raise ValueError(f"request {i}: need start >= 0 and num_new >= 1, got {r.start}, {r.num_new}")
        if len(r.pages) * page_size < end:
            raise ValueError(
                f"request {i}: {len(r.pages)} pages of {page_size} cannot hold positions [0, {end})"
            )
        pos = range(r.start, end)
        positions.extend(pos)
        out_slots.extend(r.pages[t // page_size] * page_size + t % page_size for t in pos)
        q_indptr.append(q_indptr[-1] + r.num_new)
        prefix_lens.append(r.start)
        seq_lens.append(end)
        if r.need_logits:
            logits_rows.append(q_indptr[-1] - 1)
    max_pages = max(len(r.pages) for r in requests)
    page_table = [list(r.pages) + [0] * (max_pages - len(r.pages)) for r in requests]

    def on_device(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    return ForwardBatch(
        page_size=page_size,
        q_indptr=on_device(q_indptr, torch.int32),
        prefix_lens=on_device(prefix_lens, torch.int32),
        seq_lens=on_device(seq_lens, torch.int32),
        page_table=on_device(page_table, torch.int32),
        positions=on_device(positions, torch.int64),
        out_slots=on_device(out_slots, torch.int64),
        logits_indices=on_device(logits_rows, torch.int64),
        max_q_len=max(r.num_new for r in requests),
        max_seq_len=max(seq_lens),
    )
