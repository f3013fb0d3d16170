"""The cascade planner: each decode step's rows, grouped by the radix nodes they share.

``CascadePlanner`` is the callable the scheduler holds (``Scheduler.set_cascade_planner``): it gets
the step's ``DecodeRow``s (each with its path of radix nodes, root first) and returns a
``CascadePlan`` or None (flat attention).

Planning walks the rows' paths as a trie, level by level. At each branch point the rows that continue
through the same node form a set ``S``; the chain of nodes that all of ``S`` (and no other row) goes
through is one candidate run ``[covered, chain_end)``, where ``covered`` is where the rows' last
accepted level ended (the same for all of ``S``: they share every ancestor). The cost model accepts or
rejects the run; a rejected run stays uncovered and folds into the next deeper accepted run, or into the
rows' own suffixes. The plan is kept only if its groups together save enough (``CostModel.worth_plan``).
Work is O(rows x path depth), never O(tokens).

Incremental: a row's path is identified by (its last node id, its depth) - nodes are only ever split,
which deepens the path, and locked nodes are not evicted - so when every row keeps its signature the
previous plan is returned as it is; in steady decode the tree does not change and planning is one
signature comparison per row.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from radixrelay.cascade.cost import CostModel, cost_model
from radixrelay.protocol.cascade import CascadeGroup, CascadePlan, DecodeRow
from radixrelay.protocol.stats import CascadeCounters

_Signature = tuple[tuple[int, int, int], ...]    # (rid, last node id or -1, depth) per row
logger = logging.getLogger("radixrelay.cascade")


@dataclass
class LevelDecisions:
    """What the cost model said about one level's candidate runs (for the debug log)."""

    accepted: int = 0
    accepted_saved: int = 0          # token reads saved by the accepted runs
    rejected: int = 0
    rejected_best: int = 0           # the largest saving among the rejected runs
    rows: list[int] = field(default_factory=list)   # members per accepted run

    def describe(self, level: int, cost: CostModel) -> str:
        text = f"level {level}: "
        if self.accepted:
            text += (f"{self.accepted} run(s) of {min(self.rows)}-{max(self.rows)} rows accepted, "
                     f"saving {self.accepted_saved} token reads")
        if self.rejected:
            text += ("; " if self.accepted else "") + (
                f"{self.rejected} run(s) rejected (best saves {self.rejected_best} < {cost.min_group_saved} "
                f"per group: folded into deeper runs or own suffixes)")
        return text


class CascadePlanner:
    def __init__(self, cost: CostModel, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"CascadePlanner: page_size must be >= 1, got {page_size}")
        self.cost = cost
        self.page_size = page_size
        self.counters = CascadeCounters()
        self._signature: _Signature | None = None
        self._plan: CascadePlan | None = None

    def __call__(self, rows: list[DecodeRow]) -> CascadePlan | None:
        signature = tuple((r.rid, r.path[-1].node_id if r.path else -1, len(r.path)) for r in rows)
        if signature != self._signature:
            self._signature = signature
            decisions: dict[int, LevelDecisions] | None = {} if logger.isEnabledFor(logging.DEBUG) else None
            self._plan = plan_groups(rows, self.cost, self.page_size, decisions)
            if decisions is not None:
                saved = sum(d.accepted_saved for d in decisions.values())
                verdict = ("cascaded" if self._plan is not None else
                           f"flat (plan saves {saved} < {self.cost.min_saved_tokens} per step)" if decisions
                           else "flat (no shared runs)")
                logger.debug("cascade plan for %d decode rows: %s%s", len(rows), verdict, "".join(
                    f"; {d.describe(level, self.cost)}" for level, d in sorted(decisions.items())))
        self.counters.record(self._plan)
        return self._plan


def plan_groups(rows: Sequence[DecodeRow], cost: CostModel, page_size: int,
                decisions: dict[int, LevelDecisions] | None = None) -> CascadePlan | None:
    """Group ``rows`` by shared path chains under ``cost``; None when the plan does not pay. Radix nodes begin
    at page boundaries, so every group does (checked). ``decisions``: filled per level with what the cost
    model accepted and rejected."""
    groups: list[CascadeGroup] = []
    own_start: dict[int, int] = {}
    # Work list of (rows that share path[:depth], depth, covered, level of their next group).
    stack: list[tuple[list[DecodeRow], int, int, int]] = [(list(rows), 0, 0, 0)]
    while stack:
        members, depth, covered, level = stack.pop()
        by_node: dict[int, list[DecodeRow]] = {}
        for row in members:
            if len(row.path) > depth:
                by_node.setdefault(row.path[depth].node_id, []).append(row)
            else:
                own_start[row.rid] = covered            # path ends here
        for sharing in by_node.values():
            if len(sharing) == 1:
                own_start[sharing[0].rid] = covered
                continue
            end = _chain_end(sharing, depth)
            seg = sharing[0].path[end - 1]
            chain_end = seg.start + seg.num_tokens
            accept = cost.worth_group(len(sharing), chain_end - covered)
            if decisions is not None:
                d = decisions.setdefault(level, LevelDecisions())
                saved = (len(sharing) - 1) * (chain_end - covered)
                if accept:
                    d.accepted, d.accepted_saved = d.accepted + 1, d.accepted_saved + saved
                    d.rows.append(len(sharing))
                else:
                    d.rejected, d.rejected_best = d.rejected + 1, max(d.rejected_best, saved)
            if accept:
                if covered % page_size:
                    raise ValueError(f"cascade: shared run starts at {covered}, not a page boundary")
                groups.append(CascadeGroup([r.rid for r in sharing], covered, chain_end - covered, level))
                stack.append((sharing, end, chain_end, level + 1))
            else:
                stack.append((sharing, end, covered, level))
    plan = CascadePlan(groups, {rid: own_start[rid] for rid in (r.rid for r in rows) if own_start[rid] > 0})
    return plan if groups and cost.worth_plan(plan.tokens_read_once()) else None


def _chain_end(sharing: list[DecodeRow], depth: int) -> int:
    """Deepest path index + 1 such that every row in ``sharing`` has the same nodes in [depth, end)."""
    end = depth + 1
    first = sharing[0].path
    while end < len(first) and all(len(r.path) > end and r.path[end].node_id == first[end].node_id
                                   for r in sharing):
        end += 1
    return end


def make_cascade_planner(mode: str, page_size: int) -> CascadePlanner | None:
    """``mode``: ``auto`` (cost model), ``on`` (every shared run), ``off`` (None: flat attention). The
    worker's prefill cascade takes the same mode's ``cost_model(mode)`` (``ModelRunner(prefill_cost=...)``)."""
    cost = cost_model(mode)
    return None if cost is None else CascadePlanner(cost, page_size)
