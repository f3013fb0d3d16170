"""``ForwardBatch``: the ragged batch of one model step, as the model and attention backends see it.

A step computes new tokens of B requests, packed back to back without padding into T rows.
Request b's new tokens are rows ``[q_indptr[b], q_indptr[b+1])`` and its positions
``[prefix_lens[b], seq_lens[b])``: positions ``[0, prefix_lens[b])`` are already in the KV cache
(radix-cached prefix or earlier chunks), ``[prefix_lens[b], seq_lens[b])`` are computed now. A
decode is simply a request with one new token, so decodes and (chunked) extends share a batch.

Build one with ``build_forward_batch`` from per-request (pages, start, num_new) on the host (decodes
may come as flat lists, ``DecodeRows``); the per-request and per-token tensors go to the device in two
packed copies per step (``pack_on_device``: views of one int32 and one int64 tensor, each 16-byte
aligned), through pinned memory on CUDA; the page table comes from ``DevicePageTable``.

Cascade (``CascadeBatch``, optional): some runs of KV are attended once for a group of query rows
(``SharedRuns``: the rows of every request sharing that run of pages), request b attends only
``[kv_start[b], seq_lens[b])`` itself, and the parts merge by LSE. Decode groups come from the
scheduler's ``CascadePlan``, prefill groups from the extend rows' common cached pages
(``radixrelay.cascade.batch``). Without it, every request attends ``[0, seq_lens[b])``.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from operator import sub

import numpy as np
import torch

from radixrelay.kernels.host_staging import tensor_to_device, upload


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
    # Host copies of q_rows, q_indptr and kv_lens: planning reads them without a device sync; of
    # kv_indptr and kv_pages: CUDA graphs copy all of them into their buffers in one upload.
    host_rows: tuple[int, ...] = ()
    host_indptr: tuple[int, ...] = (0,)
    host_kv_lens: tuple[int, ...] = ()
    host_kv_indptr: tuple[int, ...] = (0,)
    host_pages: tuple[int, ...] = ()


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
    positions: torch.Tensor    # [T] KV index of each token (causal mask; RoPE unless rope_delta)
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
    # [T] int64: RoPE position - KV index per token (modular prompts, ``radixrelay.modules.compose``);
    # None: every token's RoPE position is its KV index.
    rope_delta: torch.Tensor | None = None

    @property
    def rope_positions(self) -> torch.Tensor:
        """[T] the RoPE position of each token."""
        return self.positions if self.rope_delta is None else self.positions + self.rope_delta

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


_ARRAY_CODES = {torch.int64: "q", torch.int32: "i", torch.float32: "f", torch.bool: "b"}


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A flat host list (or ``array``) on ``device`` without waiting for it. Through an ``array`` (a few
    times faster than ``torch.tensor`` on a list of ints) and, on CUDA, a reused ring of pinned memory
    (``host_staging``): the copy is queued behind the step in flight instead of staged (and possibly
    waited for) from pageable memory, and no pinned buffer is allocated per copy."""
    code = _ARRAY_CODES.get(dtype)
    device = torch.device(device)
    if code is None or not len(values):
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=device.type == "cuda")
    host = values if isinstance(values, array) and values.typecode == code else array(code, values)
    if device.type == "cuda":
        return upload(np.frombuffer(host, dtype=_NUMPY[dtype]), dtype, device)
    return torch.frombuffer(host, dtype=dtype).to(device)


_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.bool: np.bool_}


_ALIGN_BYTES = 16     # Triton specialises pointer arguments on a 16-byte-aligned address: keep every view so


def pack_on_device(lists: Sequence[Sequence[int]], dtype: torch.dtype,
                   device: torch.device | str) -> list[torch.Tensor]:
    """Several host lists as 1-D views of one device tensor: one host-to-device copy instead of one per
    list. Each view starts 16-byte aligned (the lists are padded apart)."""
    align = max(1, _ALIGN_BYTES // dtype.itemsize)
    flat: list[int] = []
    offsets = []
    for values in lists:
        offsets.append(len(flat))
        flat.extend(values)
        flat.extend([0] * (-len(flat) % align))
    buf = to_device(flat, dtype, device)
    return [buf[o:o + len(values)] for o, values in zip(offsets, lists)]


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
    kv_lens = [r.num_tokens for r in runs]
    q_indptr_t, q_rows_t, kv_indptr_t, kv_pages_t, kv_lens_t = pack_on_device(
        [q_indptr, q_rows, kv_indptr, kv_pages, kv_lens], torch.int32, device)
    return SharedRuns(
        q_indptr=q_indptr_t,
        q_rows=q_rows_t,
        kv_indptr=kv_indptr_t,
        kv_pages=kv_pages_t,
        kv_lens=kv_lens_t,
        max_rows=max(len(r.rows) for r in runs),
        max_kv_len=max(r.num_tokens for r in runs),
        max_pages=max(len(r.pages) for r in runs),
        contiguous=all(consecutive(r.pages) for r in runs),
        host_rows=tuple(q_rows), host_indptr=tuple(q_indptr), host_kv_lens=tuple(kv_lens),
        host_kv_indptr=tuple(kv_indptr), host_pages=tuple(kv_pages),
    )


def consecutive(pages: Sequence[int]) -> bool:
    """Whether ``pages`` are consecutive page ids (one strided block of the KV cache)."""
    if len(pages) < 2:
        return True
    first = pages[0]
    return list(pages) == list(range(first, first + len(pages)))       # one C-level compare, not a loop


class DevicePageTable:
    """Resident requests' page lists mirrored on the device, one row each, kept up to date by diffs, so
    that a step gathers its page table on the device instead of packing O(pages) host lists.

    Writes (``admit``, ``append``) are queued on the host and reach the device together at the next
    ``gather`` (or ``flush``, or a read of ``table``): one scatter per step, whatever the number of
    requests that crossed a page boundary. The row index of a gather is kept while its keys repeat."""

    def __init__(self, device: torch.device | str, rows: int = 16, cols: int = 64) -> None:
        self.device = torch.device(device)
        self._table = torch.zeros(rows, cols, dtype=torch.int32, device=self.device)   # [rows, cols]
        self._row: dict[int, int] = {}       # key -> row
        self._len: dict[int, int] = {}       # key -> pages held
        self._free = list(range(rows - 1, -1, -1))
        self._pending: list[tuple[int, int, list[int]]] = []     # (row, first column, pages) not yet written
        # (row, source row, pages): a row's leading pages copied from another's, after the pending writes
        self._copies: list[tuple[int, int, int]] = []
        self._gathered: tuple[list[int], torch.Tensor] | None = None   # the last gather's keys, their rows
        self._scatter = None                 # CUDA: ``PageScatter`` bound to ``_table`` (made on first flush)

    @property
    def table(self) -> torch.Tensor:
        """int32 [rows, cols], every queued write applied."""
        self.flush()
        return self._table

    def admit(self, key: int, pages: Sequence[int]) -> None:
        if not self._free:
            self._grow(2 * self._table.shape[0], self._table.shape[1])
        self._row[key], self._len[key] = self._free.pop(), 0
        self.append(key, pages)

    def admit_shared(self, key: int, source: int, shared: int, pages: Sequence[int]) -> None:
        """``key``'s row: the first ``shared`` pages of ``source``'s row (a resident key), then ``pages``.
        The shared pages are copied on the device, not sent from the host."""
        if shared > self._len[source]:
            raise ValueError(f"key {source} holds {self._len[source]} pages, fewer than the {shared} shared")
        self.admit(key, [])
        if shared > self._table.shape[1]:
            self._grow(self._table.shape[0], max(shared, 2 * self._table.shape[1]))
        self._copies.append((self._row[key], self._row[source], shared))
        self._len[key] = shared
        self.append(key, pages)

    def append(self, key: int, pages: Sequence[int]) -> None:
        row, start = self._row[key], self._len[key]
        end = start + len(pages)
        if end > self._table.shape[1]:
            self._grow(self._table.shape[0], max(end, 2 * self._table.shape[1]))
        if pages:
            self._pending.append((row, start, list(pages)))
        self._len[key] = end

    def release(self, key: int) -> None:
        row = self._row[key]
        if any(src == row for _, src, _ in self._copies):
            self.flush()                     # a copy from this row is made before the row changes hands
        del self._row[key], self._len[key]
        self._free.append(row)
        if self._pending:                    # a write not yet made must not land on the row's next owner
            self._pending = [w for w in self._pending if w[0] != row]
        if self._copies:
            self._copies = [c for c in self._copies if c[0] != row]
        self._gathered = None                # the key may come back in another row

    def flush(self) -> None:
        """Write the queued pages: one slice copy for one write, else one scatter (values, rows and
        columns in one int64 host-to-device copy); then the queued row-to-row copies, one device copy per
        source row and length (a burst over one cached prefix: one)."""
        self._write_pending()
        if not self._copies:
            return
        copies, self._copies = self._copies, []
        i = 0
        while i < len(copies):               # in order (a source may be an earlier copy's row), runs of one source
            _, source, shared = copies[i]
            j = i
            while j < len(copies) and copies[j][1:] == (source, shared):
                j += 1
            rows = [row for row, _, _ in copies[i:j]]
            self._table[rows, :shared] = self._table[source, :shared]
            i = j

    def _write_pending(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        if len(pending) == 1:
            row, start, pages = pending[0]
            self._table[row, start:start + len(pages)] = to_device(pages, torch.int32, self.device)
            return
        # [3, n] int64: rows, columns, values; the page lists are appended at C speed (``array.extend``),
        # rows and columns made by numpy: admitting 256 requests of 1,025 pages is ~262K entries.
        values = array("q")
        for _, _, pages in pending:
            values.extend(pages)
        n = len(values)
        counts = np.fromiter((len(w[2]) for w in pending), dtype=np.int64, count=len(pending))
        starts = np.fromiter((w[1] for w in pending), dtype=np.int64, count=len(pending))
        rows = np.fromiter((w[0] for w in pending), dtype=np.int64, count=len(pending))
        firsts = np.cumsum(counts) - counts                  # each write's first index into ``values``
        host = np.empty(3 * n, dtype=np.int64)
        host[:n] = np.repeat(rows, counts)
        host[n:2 * n] = np.arange(n, dtype=np.int64) + np.repeat(starts - firsts, counts)
        host[2 * n:] = np.frombuffer(values, dtype=np.int64)
        if self.device.type == "cuda":                       # one copy, one launch
            if self._scatter is None:
                from radixrelay.kernels.row_patch import PageScatter  # Triton: loaded by CUDA workers only

                self._scatter = PageScatter(self._table)
            self._scatter(upload(host, torch.int64, self.device).view(3, n))
            return
        packed = torch.from_numpy(host).view(3, n)
        self._table.index_put_((packed[0], packed[1]), packed[2].to(torch.int32))

    def rows(self, keys: Sequence[int]) -> tuple[torch.Tensor, list[int], int]:
        """(the table with every queued write applied, each key's row, the most pages among them): for a
        caller that gathers the rows itself (CUDA graphs, into their own buffer)."""
        self.flush()
        row, length = self._row, self._len
        return self._table, [row[k] for k in keys], max(1, max(map(length.__getitem__, keys)))

    def gather(self, keys: Sequence[int]) -> torch.Tensor:
        """int32 [len(keys), max pages among them] (rows padded with stale or 0 page ids)."""
        self.flush()
        width = max(1, max(map(self._len.__getitem__, keys)))
        keys = list(keys)
        if self._gathered is None or self._gathered[0] != keys:
            self._gathered = keys, to_device([self._row[k] for k in keys], torch.int64, self.device)
        return self._table[:, :width].index_select(0, self._gathered[1])

    def _grow(self, rows: int, cols: int) -> None:
        old = self._table              # queued writes keep their (row, column): they land in the new table
        self._table = torch.zeros(rows, cols, dtype=torch.int32, device=self.device)
        self._scatter = None
        self._table[:old.shape[0], :old.shape[1]] = old
        self._free[:0] = range(rows - 1, old.shape[0] - 1, -1)


@dataclass(frozen=True)
class DecodeRows:
    """Host side: a step's decode requests as flat lists (one new token and one logits row each), what
    ``build_forward_batch`` takes instead of one ``BatchRequest`` per decode."""

    positions: Sequence[int]   # [D] the position each computes; [0, position) is cached
    slots: Sequence[int]       # [D] the KV slot its token is written to

    def __post_init__(self) -> None:
        if len(self.positions) != len(self.slots):
            raise ValueError(f"DecodeRows: {len(self.positions)} positions, {len(self.slots)} slots")


def build_forward_batch(
    requests: Sequence[BatchRequest], page_size: int, device: torch.device | str, *,
    page_table: torch.Tensor | None = None,
    num_decodes: int = 0, kv_start: Sequence[int] | None = None,
    decode_runs: SharedRuns | None = None, prefill_runs: SharedRuns | None = None,
    decodes: DecodeRows | None = None,
) -> ForwardBatch:
    """Pack per-request work into a ``ForwardBatch`` on ``device`` (validated on the host). The last
    ``num_decodes`` requests must be decodes; or ``decodes`` gives the decode requests, after all of
    ``requests`` (``num_decodes`` then 0, and ``page_table`` is required). With ``kv_start`` (per
    request) the batch carries a ``CascadeBatch`` with the given shared runs. ``page_table`` (int32
    [B, >= max pages], on ``device``, e.g. from ``DevicePageTable.gather``) replaces packing the page
    lists on the host. The per-request and per-token tensors reach the device in two copies (int32,
    int64) as views of one tensor each."""
    if page_size < 1:
        raise ValueError(f"build_forward_batch: page_size must be >= 1, got {page_size}")
    if not 0 <= num_decodes <= len(requests):
        raise ValueError(f"build_forward_batch: num_decodes {num_decodes} outside [0, {len(requests)}]")
    if decodes is not None and (num_decodes or page_table is None):
        raise ValueError("build_forward_batch: with decodes, num_decodes must be 0 and page_table given")
    if not requests and (decodes is None or not decodes.positions):
        raise ValueError("build_forward_batch: empty batch")
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
    max_q_len = max((r.num_new for r in requests[:first]), default=1)
    # Decodes (one token each, one logits row each): flat lists, no per-position work.
    if decodes is None:
        rows = requests[first:]
        if any(r.num_new != 1 or r.num_logits != 1 or r.start < 0 or len(r.pages) * page_size <= r.start
               for r in rows):
            raise ValueError(f"build_forward_batch: the last {num_decodes} requests must be one-token decodes "
                             f"(one logits row, start >= 0, pages covering it)")
        dec_pos = [r.start for r in rows]
        dec_slots = [r.pages[p // page_size] * page_size + p % page_size for r, p in zip(rows, dec_pos)]
    else:
        dec_pos, dec_slots = decodes.positions, decodes.slots
        if dec_pos and min(dec_pos) < 0:
            raise ValueError("build_forward_batch: decode positions must be >= 0")
    num_dec = len(dec_pos)
    base = q_indptr[-1]
    positions.extend(dec_pos)
    out_slots.extend(dec_slots)
    q_indptr.extend(range(base + 1, base + num_dec + 1))
    prefix_lens.extend(dec_pos)
    seq_lens.extend([p + 1 for p in dec_pos])
    logits_rows.extend(range(base, base + num_dec))
    num_requests = first + num_dec
    int32_lists = [q_indptr, prefix_lens, seq_lens]
    max_own_len = 0
    if kv_start is not None:
        if len(kv_start) != num_requests or min(kv_start) < 0 or min(map(sub, prefix_lens, kv_start)) < 0:
            raise ValueError("build_forward_batch: kv_start must hold, per request, 0 <= kv_start <= start")
        max_own_len = max(map(sub, seq_lens, kv_start))
        int32_lists.append(kv_start)
    if page_table is None:
        max_pages = max(len(r.pages) for r in requests)
        page_table = tensor_to_device(torch.tensor([list(r.pages) + [0] * (max_pages - len(r.pages))
                                                    for r in requests], dtype=torch.int32), device)
    q_indptr_t, prefix_lens_t, seq_lens_t, *kv_start_t = pack_on_device(int32_lists, torch.int32, device)
    positions_t, out_slots_t, logits_t = pack_on_device([positions, out_slots, logits_rows], torch.int64, device)
    cascade = None
    if kv_start is not None:
        cascade = CascadeBatch(kv_start_t[0], decode_runs, prefill_runs, max_own_len)
    return ForwardBatch(
        page_size=page_size,
        q_indptr=q_indptr_t,
        prefix_lens=prefix_lens_t,
        seq_lens=seq_lens_t,
        page_table=page_table,
        positions=positions_t,
        out_slots=out_slots_t,
        logits_indices=logits_t,
        max_q_len=max_q_len,
        max_seq_len=max(seq_lens),
        num_decodes=num_dec,
        cascade=cascade,
    )
