"""What a decode-graph step needs from the host (``radixrelay.worker.cuda_graphs``), importable without
Triton: the model runner builds it for every step it runs on the decode graphs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixrelay.attention.metadata import SharedRuns


@dataclass
class GraphStep:
    """Host side of one decode-graph step: one row per token computed (a decode, or one token of a small
    extend), each writing its K/V at ``slots[i]`` and attending [kv_start[i], positions[i]] of its own
    pages plus, for rows of a shared run, that run."""

    ids: torch.Tensor | None           # int64 [num] token ids on the device, or (None) gathered:
    positions: Sequence[int]           # [num] position each row computes
    slots: Sequence[int]               # [num] KV slot its token is written to
    table: torch.Tensor                # int32 [R, C] page lists of resident requests (``DevicePageTable``)
    page_rows: Sequence[int]           # [num] row of ``table`` holding each row's page list
    width: int                         # columns of ``table`` the rows need (<= C)
    kv_start: Sequence[int] | None = None      # [num] with ``runs``: first position attended on its own
    runs: SharedRuns | None = None             # shared runs over these rows (cascade)
    rope_delta: Sequence[int] | None = None    # [num] RoPE position - KV index (modular rows); None: 0
    round_runs: bool = False           # plan the launch for run lengths rounded up (``round_length``)
    tokens: torch.Tensor | None = None         # ... ids[i] = tokens[token_rows[i]] (``ResidentTokens.rows``)
    token_rows: Sequence[int] | None = None

    @property
    def num(self) -> int:
        return len(self.positions)


@dataclass
class RowPatch:
    """Rows of a decode-graph step that hold another request than in the step before (``DecodeGraphs.
    arrange``), with their values as in ``GraphStep``; every other row is the same request one token
    further (advanced on the device)."""

    rows: Sequence[int]                # [c] graph rows, each < the step's row count
    positions: Sequence[int]           # [c]
    slots: Sequence[int]               # [c]
    table: torch.Tensor                # int32 [R, C] (``DevicePageTable``)
    page_rows: Sequence[int]           # [c] row of ``table`` holding each row's page list
    width: int                         # columns of ``table`` the rows need (<= C)
    token_rows: Sequence[int]          # [c] row of the newest-token table (``ResidentTokens``)
    kv_start: Sequence[int] | None = None      # [c] with shared runs: first position attended on its own


def round_length(n: int) -> int:
    """``n`` rounded up to 4 significant bits (8 classes per power of two): a launch shape planned for
    the rounded length leaves less than 1/8 of its splits past the real end idle."""
    shift = max(n.bit_length() - 4, 0)
    return -(-n >> shift) << shift
