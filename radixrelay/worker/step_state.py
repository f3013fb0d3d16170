"""Per-request step state that lives on the device and changes by diff.

Overlap scheduling launches step N+1 before the host has seen step N's sampled tokens, so what a
decode feeds comes from the device: every resident request has a row holding its newest token
(known or sampled by a step still in flight), written by the sampler of the step that produced it.
Requests with repetition / frequency / presence penalties also keep their token counts on the device,
updated the same way, so a step never rebuilds them from host token lists.

Rows are recycled on release; the tables grow by doubling. Nothing here synchronises with the
device: host-to-device copies are non-blocking, updates are scatters on the current stream.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixrelay.attention.metadata import to_device
from radixrelay.sampling_params import SamplingParams
from radixrelay.worker.sampling import PenaltyTensors


def _index(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return to_device(list(values), torch.int64, device)


class _Rows:
    """Row allocator: key -> row of a growable table (``capacity`` rows)."""

    def __init__(self, capacity: int, first: int = 0) -> None:
        self.capacity = capacity
        self.row: dict[int, int] = {}
        self._free = list(range(capacity - 1, first - 1, -1))

    def take(self, key: int) -> tuple[int, bool]:
        """(row, whether the table must grow to ``self.capacity`` first)."""
        grew = not self._free
        if grew:
            old, self.capacity = self.capacity, 2 * self.capacity
            self._free = list(range(self.capacity - 1, old - 1, -1))
        self.row[key] = self._free.pop()
        return self.row[key], grew

    def give_back(self, key: int) -> int | None:
        row = self.row.pop(key, None)
        if row is not None:
            self._free.append(row)
        return row


def _grown(table: torch.Tensor, rows: int) -> torch.Tensor:
    new = torch.zeros((rows, *table.shape[1:]), dtype=table.dtype, device=table.device)
    new[:table.shape[0]] = table
    return new


class ResidentTokens:
    """Newest token per resident request, and output counts for requests with penalties."""

    def __init__(self, device: torch.device | str, vocab_size: int, rows: int = 64) -> None:
        self.device = torch.device(device)
        self.vocab_size = vocab_size
        self._rows = _Rows(rows)
        self.last = torch.zeros(rows, dtype=torch.int64, device=self.device)          # [rows]
        # Penalty rows: row 0 stays all zero for requests without penalties.
        self._pen_rows = _Rows(4, first=1)
        self.counts = torch.zeros(4, vocab_size, dtype=torch.float32, device=self.device)  # [P, V] outputs
        self.seen = torch.zeros(4, vocab_size, dtype=torch.bool, device=self.device)       # [P, V] prompt + outputs
        self._pen_params: dict[int, SamplingParams] = {}      # key -> its params (keys with penalties)
        # Device index tensors of recent key lists (a decode batch repeats its rows step after step);
        # dropped whenever a key is released (its row may go to another key; admissions move no row).
        self._indices: dict[tuple[int, ...], torch.Tensor] = {}
        self._penalty_columns: dict[tuple[int, ...], tuple[torch.Tensor, ...]] = {}
        self._pending_last: list[tuple[int, int]] = []         # (row, token) admitted, not yet on the device

    def admit(self, key: int, token_ids: Sequence[int], num_prompt: int, sampling: SamplingParams) -> None:
        row, grew = self._rows.take(key)
        if grew:
            self.last = _grown(self.last, self._rows.capacity)
        # Queued, then written with the step's other admissions by one index copy (``_flush``): assigning
        # a Python int to a CUDA tensor element would wait for the device (a blocking copy).
        self._pending_last.append((row, token_ids[-1]))
        if not sampling.has_penalties:
            return
        prow, grew = self._pen_rows.take(key)
        self._pen_params[key] = sampling
        if grew:
            self.counts = _grown(self.counts, self._pen_rows.capacity)
            self.seen = _grown(self.seen, self._pen_rows.capacity)
        ids = _index(list(token_ids), self.device)
        self.seen[prow].zero_()
        self.seen[prow].index_fill_(0, ids, True)
        self.counts[prow].zero_()
        outputs = ids[num_prompt:]
        self.counts[prow].index_add_(0, outputs, torch.ones_like(outputs, dtype=torch.float32))

    def release(self, key: int) -> None:
        self._forget_indices()
        row = self._rows.give_back(key)
        if self._pending_last:              # a write not yet made must not land on the row's next owner
            self._pending_last = [w for w in self._pending_last if w[0] != row]
        self._pen_rows.give_back(key)
        self._pen_params.pop(key, None)

    def _forget_indices(self) -> None:
        if self._indices:
            self._indices.clear()
        if self._penalty_columns:
            self._penalty_columns.clear()

    def _rows_of(self, keys: Sequence[int]) -> torch.Tensor:
        """int64 [len(keys)]: the keys' rows, on the device (kept for the next steps with these keys)."""
        k = tuple(keys)
        index = self._indices.get(k)
        if index is None:
            if len(self._indices) >= 4:
                self._indices.clear()
            index = self._indices[k] = _index([self._rows.row[key] for key in k], self.device)
        return index

    def _flush(self) -> None:
        if self._pending_last:
            pending, self._pending_last = self._pending_last, []
            rows, tokens = _index([r for r, _ in pending] + [t for _, t in pending], self.device).view(2, -1)
            self.last.index_copy_(0, rows, tokens)

    def rows(self, keys: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
        """(int64 [rows] newest token per row, every queued write made; each key's row): for a caller that
        gathers them itself (CUDA graphs: into their own buffer, with their other per-row inputs)."""
        self._flush()
        row = self._rows.row
        return self.last, [row[k] for k in keys]

    def table(self) -> torch.Tensor:
        """int64 [rows] newest token per row, every queued write made (rows of ``rows``)."""
        self._flush()
        return self.last

    def newest(self, keys: Sequence[int]) -> torch.Tensor:
        """int64 [len(keys)]: each request's newest token, on the device."""
        self._flush()
        return self.last.index_select(0, self._rows_of(keys))

    def record(self, keys: Sequence[int], tokens: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """``tokens``: int64 [len(keys)] just sampled for ``keys`` (device); ``rows``: the keys' rows on the
        device if the caller has them (int64 [len(keys)]), else looked up."""
        self._flush()
        self.last.index_copy_(0, self._rows_of(keys) if rows is None else rows, tokens)
        if not self._pen_rows.row:
            return
        pen = [(i, self._pen_rows.row[k]) for i, k in enumerate(keys) if k in self._pen_rows.row]
        if pen:
            which = _index([i for i, _ in pen], self.device)
            rows = _index([r for _, r in pen], self.device)
            toks = tokens.index_select(0, which)
            self.counts.index_put_((rows, toks), torch.ones_like(toks, dtype=torch.float32), accumulate=True)
            self.seen.index_put_((rows, toks), torch.ones_like(toks, dtype=torch.bool))

    def penalties(self, keys: Sequence[int]) -> PenaltyTensors | None:
        """The batch's penalty tensors (rows in ``keys`` order), None when no row has penalties. The
        parameter columns and row index are kept while ``keys`` repeat; the counts are read every step."""
        if not self._pen_rows.row:
            return None
        k = tuple(keys)
        cached = self._penalty_columns.get(k)
        if cached is None:
            if not any(key in self._pen_params for key in k):
                return None
            if len(self._penalty_columns) >= 4:
                self._penalty_columns.clear()
            plain = SamplingParams()                # no penalty: repetition 1, frequency and presence 0
            params = [self._pen_params.get(key, plain) for key in k]
            rows = _index([self._pen_rows.row.get(key, 0) for key in k], self.device)

            def column(values: list[float]) -> torch.Tensor:
                return to_device(values, torch.float32, self.device).unsqueeze(1)

            cached = self._penalty_columns[k] = (
                rows, column([p.repetition_penalty for p in params]), column([p.frequency_penalty for p in params]),
                column([p.presence_penalty for p in params]))
        rows, repetition, frequency, presence = cached
        return PenaltyTensors(
            repetition=repetition,
            frequency=frequency,
            presence=presence,
            seen=self.seen.index_select(0, rows),
            output_counts=self.counts.index_select(0, rows),
        )
