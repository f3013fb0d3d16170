"""The worker's resident requests: one table, one entry (``Resident``) per request.

A request is resident from its admission (``StepPlan.admitted``) until its release (``StepPlan.released``);
its entry holds what the worker knows of it: the tokens it was sent (``[token_offset, ...)``, the cached
prefix before that never computed here), how many it has sampled since (their values on the device), its
page list and its sampling parameters. ``apply(plan)`` is the only writer of residency: it releases, then
admits, then appends pages, and tells every structure that keeps per-request state beside the entries
(the page lists on the device, the newest-token rows, the decode runs' checks, the grammars) in the same
order, so none of them holds a request the table does not.

A new per-request value the worker needs crosses as a field of ``AdmittedRequest`` and lands here, in
``Resident`` (filled by ``admit``); the step code reads it from the entries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from radixrelay.attention.metadata import DevicePageTable
from radixrelay.protocol.step import AdmittedRequest, StepPlan
from radixrelay.sampling_params import SamplingParams
from radixrelay.worker.step_state import ResidentTokens

if TYPE_CHECKING:
    from radixrelay.cascade.batch import DecodeRunsCache
    from radixrelay.worker.constraints import Constraints


@dataclass
class Resident:
    token_ids: list[int]       # tokens [token_offset, ...) known at admission (prompt, then outputs)
    token_offset: int          # leading tokens not sent (cached; never computed here)
    num_prompt_tokens: int
    num_tokens: int            # token_offset + len(token_ids) + tokens sampled since (on the device)
    pages: list[int]
    sampling: SamplingParams
    rope_runs: list[tuple[int, int]]    # RoPE position deltas (``AdmittedRequest.rope_runs``)
    # ids banned while the request has fewer than ``sampling.min_tokens`` outputs; emptied once it has them
    min_tokens_ban: list[int] = field(default_factory=list)

    @property
    def num_outputs(self) -> int:
        """Tokens sampled before the step being launched (a seeded stream's position)."""
        return self.num_tokens - self.num_prompt_tokens


class RequestTable:
    """Resident requests by rid, and the structures kept in step with them (see the module docstring)."""

    def __init__(self, page_table: DevicePageTable, tokens: ResidentTokens, decode_runs: DecodeRunsCache,
                 constraints: Constraints | None) -> None:
        self.page_table = page_table          # the page lists, on the device
        self.tokens = tokens                  # the newest token of each request, on the device
        self.decode_runs = decode_runs        # decode runs checked against page lists (told of every change)
        self.constraints = constraints        # grammars of structured outputs (None: refused at admission)
        self._entries: dict[int, Resident] = {}
        self._pages: dict[int, list[int]] = {}      # rid -> its entry's page list (the same object)
        self.pages_of = self._pages.__getitem__      # C-level: mapped over a cascade group's members
        self.num_rope = 0                             # entries with RoPE position deltas (modular prompts)
        self.banned: dict[int, Resident] = {}         # entries whose min_tokens still bans ids
        self.appends: list[tuple[int, int, list[int]]] = []   # the last plan's (rid, first column, pages)

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, rid: int) -> Resident:
        return self._entries[rid]

    def apply(self, plan: StepPlan) -> None:
        """The plan's residency diff: releases, then admissions, then page appends (``appends``)."""
        for rid in plan.released:
            self.release(rid)
        for req in plan.admitted:
            self.admit(req)
        self.appends = []
        for append in plan.page_appends:           # page lists only grow while resident (DecodeRunsCache)
            pages = self._entries[append.rid].pages
            self.appends.append((append.rid, len(pages), append.pages))
            pages.extend(append.pages)
            self.page_table.append(append.rid, append.pages)

    def release(self, rid: int) -> Resident | None:
        gone = self._entries.pop(rid, None)
        if gone is None:
            return None
        del self._pages[rid]
        self.num_rope -= bool(gone.rope_runs)
        self.banned.pop(rid, None)
        self.page_table.release(rid)
        self.tokens.release(rid)
        self.decode_runs.release(rid)
        if self.constraints is not None:
            self.constraints.release(rid)
        return gone

    def admit(self, req: AdmittedRequest) -> Resident:
        if req.sampling.structured is not None:
            self._check_constrained(req)
        self.decode_runs.release(req.rid)          # a new page list: nothing checked of the old one holds
        if (old := self._entries.get(req.rid)) is not None:      # admitted again without a release
            self.num_rope -= bool(old.rope_runs)
        self.num_rope += bool(req.rope_runs)
        res = self._entries[req.rid] = Resident(req.token_ids, req.token_offset, req.num_prompt_tokens,
                                                req.token_offset + len(req.token_ids),
                                                req.page_list(self._pages.__getitem__),
                                                req.sampling, req.rope_runs, req.min_tokens_ban)
        if req.min_tokens_ban:
            self.banned[req.rid] = res
        else:
            self.banned.pop(req.rid, None)
        self._pages[req.rid] = res.pages
        if req.pages_from < 0:
            self.page_table.admit(req.rid, req.pages)
        else:                                       # the shared pages copied from row to row on the device
            self.page_table.admit_shared(req.rid, req.pages_from, req.pages_shared, req.pages)
        self.tokens.admit(req.rid, req.token_ids, req.num_prompt_tokens, req.sampling)
        if req.sampling.structured is not None:
            assert self.constraints is not None
            self.constraints.admit(req.rid, req.sampling.structured,
                                   req.token_ids[req.num_prompt_tokens - req.token_offset:])
        return res

    def min_tokens_bans(self, residents: Sequence[Resident]) -> tuple[list[int], list[int]]:
        """(rows, ids) to set to -inf in the logits of ``residents`` (one row each): each row below its
        ``min_tokens`` bans its ids; a row past it has its ban dropped for good."""
        rows: list[int] = []
        ids: list[int] = []
        for row, res in enumerate(residents):
            if res.min_tokens_ban:
                if res.num_outputs < res.sampling.min_tokens:
                    rows.extend([row] * len(res.min_tokens_ban))
                    ids.extend(res.min_tokens_ban)
                else:
                    res.min_tokens_ban = []
        self.banned = {rid: res for rid, res in self.banned.items() if res.min_tokens_ban}
        return rows, ids

    def _check_constrained(self, req: AdmittedRequest) -> None:
        """Its grammar replays the outputs it has (a re-admission): they must have been sent."""
        if self.constraints is None:
            raise ValueError(f"request {req.rid}: structured outputs need a worker built with a grammar engine")
        if req.token_offset > req.num_prompt_tokens:
            raise ValueError(f"request {req.rid}: admitted without its output tokens (offset past the prompt)")
