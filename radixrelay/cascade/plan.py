"""``CascadePlan``: how one decode step's attention is split into shared levels and own suffixes.

Sent from the scheduler to the worker in ``StepPlan.cascade``. Every group is a run of KV positions
``[start, start + num_tokens)`` that all its requests hold in the same pages (a chain of radix nodes
they share); the worker reads the page run from the page list of ``rids[0]``,
``pages[start // page_size : ceil((start + num_tokens) / page_size)]`` (``start`` is page aligned).
The groups of one request tile ``[0, own_start)`` of its KV without gaps or overlap, root first; the
request attends ``[own_start, seq_len)`` alone. A decode request missing from ``own_start`` is not
cascaded (``own_start = 0``, no groups).

Cascade is exact: each part carries its natural-log LSE and the parts merge by LSE (docs/kv_layout.md).
"""

from __future__ import annotations

import msgspec


class CascadeGroup(msgspec.Struct, frozen=True):
    rids: list[int]      # decode requests attending this run; >= 2 of them
    start: int           # first KV position, a multiple of page_size
    num_tokens: int      # > 0
    level: int           # 0 for the root-most group of its requests, then 1, 2, ...


class CascadePlan(msgspec.Struct, frozen=True):
    groups: list[CascadeGroup]
    own_start: dict[int, int]   # rid -> first position of its own suffix (end of its deepest group)

    @property
    def num_levels(self) -> int:
        return 1 + max((g.level for g in self.groups), default=-1)

    def tokens_read_once(self) -> int:
        """KV tokens read once for a group instead of once per member: sum of (members - 1) * tokens."""
        return sum((len(g.rids) - 1) * g.num_tokens for g in self.groups)
