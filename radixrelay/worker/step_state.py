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

from radixrelay.sampling_params import SamplingParams
from radixrelay.worker.sampling import PenaltyTensors


def _index(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)


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

    def admit(self, key: int, token_ids: Sequence[int], num_prompt: int, sampling: SamplingParams) -> None:
        row, grew = self._rows.take(key)
        if grew:
            self.last = _grown(self.last, self._rows.capacity)
        # Through an index copy: assigning a Python int to a CUDA tensor element would wait for the
        # device (a blocking copy), stalling the launch behind the step in flight.
        self.last.index_copy_(0, _index([row], self.device), _index([token_ids[-1]], self.device))
        if not sampling.has_penalties:
            return
        prow, grew = self._pen_rows.take(key)
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
        self._rows.give_back(key)
        self._pen_rows.give_back(key)

    def newest(self, keys: Sequence[int]) -> torch.Tensor:
        """int64 [len(keys)]: each request's newest token, on the device."""
        return self.last.index_select(0, _index([self._rows.row[k] for k in keys], self.device))

    def record(self, keys: Sequence[int], tokens: torch.Tensor) -> None:
        """``tokens``: int64 [len(keys)] just sampled for ``keys`` (device)."""
        self.last.index_copy_(0, _index([self._rows.row[k] for k in keys], self.device), tokens)
        pen = [(i, self._pen_rows.row[k]) for i, k in enumerate(keys) if k in self._pen_rows.row]
        if pen:
            which = _index([i for i, _ in pen], self.device)
            rows = _index([r for _, r in pen], self.device)
            toks = tokens.index_select(0, which)
            self.counts.index_put_((rows, toks), torch.ones_like(toks, dtype=torch.float32), accumulate=True)
            self.seen.index_put_((rows, toks), torch.ones_like(toks, dtype=torch.bool))

    def penalties(self, keys: Sequence[int], params: Sequence[SamplingParams]) -> PenaltyTensors | None:
        """The batch's penalty tensors (rows in ``keys`` order), None when no row has penalties."""
        if not self._pen_rows.row or not any(p.has_penalties for p in params):
            return None
        rows = _index([self._pen_rows.row.get(k, 0) for k in keys], self.device)

        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32).to(self.device, non_blocking=True).unsqueeze(1)

        return PenaltyTensors(
            repetition=column([p.repetition_penalty for p in params]),
            frequency=column([p.frequency_penalty for p in params]),
            presence=column([p.presence_penalty for p in params]),
            seen=self.seen.index_select(0, rows),
            output_counts=self.counts.index_select(0, rows),
        )
