"""``ForwardBatch``: the ragged batch of one model step, as the model and attention backends see it.

A step computes new tokens of B requests, packed back to back without padding into T rows.
Request b's new tokens are rows ``[q_indptr[b], q_indptr[b+1])`` and its positions
``[prefix_lens[b], seq_lens[b])``: positions ``[0, prefix_lens[b])`` are already in the KV cache
(radix-cached prefix or earlier chunks), ``[prefix_lens[b], seq_lens[b])`` are computed now. A
decode is simply a request with one new token, so decodes and (chunked) extends share a batch.

Build one with ``build_forward_batch`` from per-request (pages, start, num_new) on the host; the
tensors go to the device once per step.

Cascade (``CascadeBatch``, optional): some runs of KV are attended once for a group of query rows
(``SharedRuns``: the rows of every request sharing that run of pages), request b attends only
``[kv_start[b], seq_lens[b])`` itself, and the parts merge by LSE. Decode groups come from the
scheduler's ``CascadePlan``, prefill groups from the extend rows' common cached pages
(``radixrelay.cascade.batch``). Without it, every request attends ``[0, seq_lens[b])``.
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
    num_logits: int = 1      # return logits for the last num_logits new tokens (0: none)


@dataclass(frozen=True)
class SharedRun:
    """Host side: query ``rows`` that all attend the first ``num_tokens`` positions of ``pages``."""

    rows: Sequence[int]
    pages: Sequence[int]
    num_tokens: int


@dataclass(frozen=True)
class SharedRuns:
    """G runs of shared KV, each attended once by its group of query rows (non-causal: every run lies
    before all of its rows). int32 on the device, in the layout of ``radixrelay.kernels.shared_node``."""

    q_indptr: torch.Tensor    # [G + 1] group g's rows are q_rows[q_indptr[g]:q_indptr[g + 1]]
    q_rows: torch.Tensor      # [R] query rows (see CascadeBatch for what they index)
    kv_indptr: torch.Tensor   # [G + 1] group g's page run is kv_pages[kv_indptr[g]:kv_indptr[g + 1]]
    kv_pages: torch.Tensor    # [sum pages]
    kv_lens: torch.Tensor     # [G] tokens of each run
    max_rows: int             # host maxima: rows of a group, tokens of a run
    max_kv_len: int
    max_pages: int
    contiguous: bool = False  # host: every run's pages are consecutive ids (the node kernel's TMA path)
    # Host copies of q_rows, q_indptr and kv_lens: planning reads them without a device sync.
    host_rows: tuple[int, ...] = ()
    host_indptr: tuple[int, ...] = (0,)
    host_kv_lens: tuple[int, ...] = ()


@dataclass(frozen=True)
class CascadeBatch:
    kv_start: torch.Tensor          # [B] int32: request b attends [kv_start[b], seq_lens[b]) on its own
    decode: SharedRuns | None       # q_rows index the decode requests (0 = request B - num_decodes)
    prefill: SharedRuns | None      # q_rows index flat token rows of extend requests
    max_own_len: int                # host: max over requests of seq_lens - kv_start


@dataclass(frozen=True)
class ForwardBatch:
    page_size: int
    # Per request (B rows), int32 on the device.
    q_indptr: torch.Tensor     # [B + 1] offsets of each request's rows in the flat batch
    prefix_lens: torch.Tensor  # [B] tokens in the cache before this step
    seq_lens: torch.Tensor     # [B] prefix_lens + new tokens
    page_table: torch.Tensor   # [B, max_pages] page ids, rows padded with any valid page id
    # Per new token (T rows), int64 on the device.
    positions: torch.Tensor    # [T] absolute position of each token (RoPE + causal mask)
    out_slots: torch.Tensor    # [T] KV slot each token's K/V is written to
    # Rows of the flat batch whose logits the step returns, int64 [R] (in request order; each
    # request's are the last ``num_logits`` of its rows: one, or a prompt-logprobs run).
    logits_indices: torch.Tensor
    # Host-side maxima so backends need no device sync to size their work.
    max_q_len: int
    max_seq_len: int
    # The last num_decodes requests are decodes (one token each, after every extend row).
    num_decodes: int = 0
    cascade: CascadeBatch | None = None

    @property
    def num_requests(self) -> int:
        return self.prefix_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def num_extends(self) -> int:
        return self.num_requests - self.num_decodes

    @property
    def is_decode(self) -> bool:
        """Every request computes exactly one token."""
        return self.max_q_len == 1


def _on_device(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def build_shared_runs(runs: Sequence[SharedRun], device: torch.device | str) -> SharedRuns | None:
    """Pack host ``SharedRun``s (None when there are none)."""
    if not runs:
        return None
    q_indptr, q_rows, kv_indptr, kv_pages = [0], [], [0], []
    for run in runs:
        if len(run.rows) < 1 or run.num_tokens < 1:
            raise ValueError(f"shared run: needs rows and tokens, got {len(run.rows)} rows, {run.num_tokens} tokens")
        q_rows.extend(run.rows)
        q_indptr.append(len(q_rows))
        kv_pages.extend(run.pages)
        kv_indptr.append(len(kv_pages))
    return SharedRuns(
        q_indptr=_on_device(q_indptr, torch.int32, device),
        q_rows=_on_device(q_rows, torch.int32, device),
        kv_indptr=_on_device(kv_indptr, torch.int32, device),
        kv_pages=_on_device(kv_pages, torch.int32, device),
        kv_lens=_on_device([r.num_tokens for r in runs], torch.int32, device),
        max_rows=max(len(r.rows) for r in runs),
        max_kv_len=max(r.num_tokens for r in runs),
        max_pages=max(len(r.pages) for r in runs),
        contiguous=all(consecutive(r.pages) for r in runs),
        host_rows=tuple(q_rows), host_indptr=tuple(q_indptr), host_kv_lens=tuple(r.num_tokens for r in runs),
    )


def consecutive(pages: Sequence[int]) -> bool:
    """Whether ``pages`` are consecutive page ids (one strided block of the KV cache)."""
    return all(b == a + 1 for a, b in zip(pages, pages[1:]))


class DevicePageTable:
    """Resident requests' page lists mirrored on the device, one row each, kept up to date by diffs, so
    that a step gathers its page table on the device instead of packing O(pages) host lists."""

    def __init__(self, device: torch.device | str, rows: int = 16, cols: int = 64) -> None:
        self.device = torch.device(device)
        self.table = torch.zeros(rows, cols, dtype=torch.int32, device=self.device)   # [rows, cols]
        self._row: dict[int, int] = {}       # key -> row
        self._len: dict[int, int] = {}       # key -> pages held
        self._free = list(range(rows - 1, -1, -1))

    def admit(self, key: int, pages: Sequence[int]) -> None:
        if not self._free:
            self._grow(2 * self.table.shape[0], self.table.shape[1])
        self._row[key], self._len[key] = self._free.pop(), 0
        self.append(key, pages)

    def append(self, key: int, pages: Sequence[int]) -> None:
        row, start = self._row[key], self._len[key]
        end = start + len(pages)
        if end > self.table.shape[1]:
            self._grow(self.table.shape[0], max(end, 2 * self.table.shape[1]))
        if pages:
            self.table[row, start:end] = _on_device(list(pages), torch.int32, self.device)
        self._len[key] = end

    def release(self, key: int) -> None:
        self._free.append(self._row.pop(key))
        del self._len[key]

    def gather(self, keys: Sequence[int]) -> torch.Tensor:
        """int32 [len(keys), max pages among them] (rows padded with stale or 0 page ids)."""
        width = max(1, max(self._len[k] for k in keys))
        rows = _on_device([self._row[k] for k in keys], torch.int64, self.device)
        return self.table[:, :width].index_select(0, rows)

    def _grow(self, rows: int, cols: int) -> None:
        old = self.table
        self.table = torch.zeros(rows, cols, dtype=torch.int32, device=self.device)
        self.table[:old.shape[0], :old.shape[1]] = old
        self._free[:0] = range(rows - 1, old.shape[0] - 1, -1)


def build_forward_batch(
    requests: Sequence[BatchRequest], page_size: int, device: torch.device | str, *,
    page_table: torch.Tensor | None = None,
    num_decodes: int = 0, kv_start: Sequence[int] | None = None,
    decode_runs: SharedRuns | None = None, prefill_runs: SharedRuns | None = None,
) -> ForwardBatch:
    """Pack per-request work into a ``ForwardBatch`` on ``device`` (validated on the host). The last
    ``num_decodes`` requests must be decodes. With ``kv_start`` (per request) the batch carries a
    ``CascadeBatch`` with the given shared runs. ``page_table`` (int32 [B, >= max pages], on ``device``,
    e.g. from ``DevicePageTable.gather``) replaces packing the page lists on the host."""
    if not requests:
        raise ValueError("build_forward_batch: empty batch")
    if page_size < 1:
        raise ValueError(f"build_forward_batch: page_size must be >= 1, got {page_size}")
    if not 0 <= num_decodes <= len(requests):
        raise ValueError(f"build_forward_batch: num_decodes {num_decodes} outside [0, {len(requests)}]")
    first = len(requests) - num_decodes
    q_indptr, prefix_lens, seq_lens, positions, out_slots, logits_rows = [0], [], [], [], [], []
    for i, r in enumerate(requests[:first]):
        end = r.start + r.num_new
        if r.start < 0 or r.num_new < 1:
            raise ValueError(f"request {i}: need start >= 0 and num_new >= 1, got {r.start}, {r.num_new}")
        if not 0 <= r.num_logits <= r.num_new:
            raise ValueError(f"request {i}: num_logits must be in [0, {r.num_new}], got {r.num_logits}")
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
        logits_rows.extend(range(q_indptr[-1] - r.num_logits, q_indptr[-1]))
    # Decodes (one token each, one logits row each): flat lists, no per-position work.
    decodes = requests[first:]
    if any(r.num_new != 1 or r.num_logits != 1 or r.start < 0 or len(r.pages) * page_size <= r.start
           for r in decodes):
        raise ValueError(f"build_forward_batch: the last {num_decodes} requests must be one-token decodes "
                         f"(one logits row, start >= 0, pages covering it)")
    dec_pos = [r.start for r in decodes]
    base = q_indptr[-1]
    positions.extend(dec_pos)
    out_slots.extend(r.pages[p // page_size] * page_size + p % page_size for r, p in zip(decodes, dec_pos))
    q_indptr.extend(range(base + 1, base + num_decodes + 1))
    prefix_lens.extend(dec_pos)
    seq_lens.extend(p + 1 for p in dec_pos)
    logits_rows.extend(range(base, base + num_decodes))
    cascade = None
    if kv_start is not None:
        if len(kv_start) != len(requests) or any(not 0 <= s <= r.start for s, r in zip(kv_start, requests)):
            raise ValueError("build_forward_batch: kv_start must hold, per request, 0 <= kv_start <= start")
        cascade = CascadeBatch(_on_device(list(kv_start), torch.int32, device), decode_runs, prefill_runs,
                               max(r.start + r.num_new - s for s, r in zip(kv_start, requests)))
    if page_table is None:
        max_pages = max(len(r.pages) for r in requests)
        page_table = _on_device([list(r.pages) + [0] * (max_pages - len(r.pages)) for r in requests],
                                torch.int32, device)

    def on_device(values: list, dtype: torch.dtype) -> torch.Tensor:
        return _on_device(values, dtype, device)

    return ForwardBatch(
        page_size=page_size,
        q_indptr=on_device(q_indptr, torch.int32),
        prefix_lens=on_device(prefix_lens, torch.int32),
        seq_lens=on_device(seq_lens, torch.int32),
        page_table=page_table,
        positions=on_device(positions, torch.int64),
        out_slots=on_device(out_slots, torch.int64),
        logits_indices=on_device(logits_rows, torch.int64),
        max_q_len=max(r.num_new for r in requests),
        max_seq_len=max(seq_lens),
        num_decodes=num_decodes,
        cascade=cascade,
    )
