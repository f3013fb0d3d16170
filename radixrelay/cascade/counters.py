"""Cascade counters the engine exposes (cumulative since the planner was made)."""

from __future__ import annotations

from dataclasses import dataclass

from radixrelay.protocol.cascade import CascadePlan


@dataclass
class CascadeCounters:
    decode_steps: int = 0         # steps with decode rows that the planner saw
    cascade_steps: int = 0        # of them, steps whose plan had at least one group
    groups: int = 0               # groups summed over steps
    levels: int = 0               # levels (deepest group + 1) summed over steps
    max_levels: int = 0           # deepest plan seen
    tokens_read_once: int = 0     # KV token reads saved: sum over steps and groups of (members - 1) * tokens

    def record(self, plan: CascadePlan | None) -> None:
        self.decode_steps += 1
        if plan is None:
            return
        self.cascade_steps += 1
        self.groups += len(plan.groups)
        self.levels += plan.num_levels
        self.max_levels = max(self.max_levels, plan.num_levels)
        self.tokens_read_once += plan.tokens_read_once()
