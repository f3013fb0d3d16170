"""Cascade types: the decode batch as the planner sees it (``DecodeRow``, scheduler side) and the plan it
makes (``CascadePlan``, sent to the worker in ``StepPlan.cascade``).

A row's path lists the tree nodes of its locked cached prefix, root first; node ``node_id`` covers
token positions ``[start, start + num_tokens)`` of that row, i.e. its pages
``pages[start // page_size : (start + num_tokens) // page_size]`` (the same page ids in every row
that shares the node). Positions past the path are private to the row. The planner returns an
opaque plan that the scheduler puts into ``StepPlan.cascade``; node ids are stable while the rows
hold their locks, but a node may be split between steps (its upper part gets a new id).

``CascadePlan``: how one decode step's attention is split into shared levels and own suffixes. Every
group is a run of KV positions ``[start, start + num_tokens)`` that all its requests hold in the same pages (a chain of radix nodes
they share); the worker reads the page run from the page list of ``rids[0]``,
``pages[start // page_size : ceil((start + num_tokens) / page_size)]`` (``start`` is page aligned).
The groups of one request tile ``[0, own_start)`` of its KV without gaps or overlap, root first; the
request attends ``[own_start, seq_len)`` alone. A decode request missing from ``own_start`` is not
cascaded (``own_start = 0``, no groups).

Cascade is exact: each part carries its natural-log LSE and the parts merge by LSE (docs/kv_layout.md).
"""

from __future__ import annotations

import msgspec


class PathSegment(msgspec.Struct, frozen=True):
    node_id: int
    start: int                 # first token position of the node within the row
    num_tokens: int


class DecodeRow(msgspec.Struct, frozen=True):
    rid: int
    path: list[PathSegment]    # shared prefix, root first; covers [0, sum of num_tokens)
    seq_len: int               # positions this row attends this step (its KV incl. the new token)


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
