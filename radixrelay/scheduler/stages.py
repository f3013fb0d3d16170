"""Host time of a request's scheduler stages (``SchedulerStats.stage_seconds`` / ``stage_counts``; the
server renders them as ``radixrelay_request_stage_seconds_sum{stage=...}`` / ``_count``):

- ``queue``: from the request's arrival at the scheduler (``Scheduler.add_request``) to its first
  admission into a step; counted once per request;
- ``match``: matching a queued request against the radix tree and the lower tiers when it is tried for
  admission (the tree walk and lock, the host-memory lookup and promotion); counted once per try,
  admitted or not.

Written by the prefill manager alone (where both happen); the scheduler's stats copy it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

STAGES = ("match", "queue")


@dataclass
class StageTimes:
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STAGES, 0))

    def add(self, stage: str, seconds: float) -> None:
        self.seconds[stage] += seconds
        self.counts[stage] += 1
