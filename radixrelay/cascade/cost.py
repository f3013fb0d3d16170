"""When cascading pays: per shared run (a group) and per step (the plan).

A run of ``tokens`` KV positions shared by ``n`` decode requests is read once instead of ``n`` times:
``(n - 1) * tokens`` token reads saved. Costs come in two kinds:

- per step, fixed: the cascade's extra launches (the shared-node kernel beside the own-KV decode, one
  merge of all partial states) and its host work. A plan pays only if all its groups together save at
  least ``min_saved_tokens``;
- per group, small: its query tiles and partial states in launches that run anyway. A run becomes a
  group only if it saves at least ``min_group_saved`` tokens ("a node of 30 tokens shared by 2 requests
  is cheaper to read twice"). A run below it is not lost: its tokens fold into the next deeper group
  that pays, or into each request's own suffix.

Calibration: end to end with CUDA graphs, cascade forced on over a grid of one shared prefix x batch
(benchmarks/results/engine/throughput_h200.md): steps saving fewer than ``min_saved_tokens`` tie or
lose against flat decode, steps saving more always win; that threshold is stricter than the
kernel-only rule (``radixrelay.kernels.cascade_decode.worth_cascading``: attention alone, no per-step cost),
and the default model is never less strict than that rule per step (tests/cascade/test_planner.py).
``min_group_saved`` is set so that the serving benchmark's tree (problems x samples) gets its second
level while groups of short problems stay in the suffixes (benchmarks/results/HISTORY.md).
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_SAVED_TOKENS = 131072
MIN_GROUP_SAVED = 2048


@dataclass(frozen=True)
class CostModel:
    min_saved_tokens: int = MIN_SAVED_TOKENS    # per step, all groups together
    min_group_saved: int = MIN_GROUP_SAVED      # per group

    def worth_group(self, num_requests: int, tokens: int) -> bool:
        """Make ``tokens`` positions shared by ``num_requests`` requests a group of their own?"""
        return num_requests >= 2 and tokens > 0 and (num_requests - 1) * tokens >= self.min_group_saved

    def worth_plan(self, saved_tokens: int) -> bool:
        """Run a step cascaded whose groups save ``saved_tokens`` token reads in all?"""
        return saved_tokens >= self.min_saved_tokens


ALWAYS = CostModel(min_saved_tokens=1, min_group_saved=1)   # mode "on": every run shared by 2+ requests


def cost_model(mode: str) -> CostModel | None:
    """The cost model of a cascade mode: ``auto`` (calibrated), ``on`` (always), ``off`` (None: flat)."""
    models = {"auto": CostModel(), "on": ALWAYS, "off": None}
    if mode not in models:
        raise ValueError(f"cascade mode must be auto, on or off, got {mode!r}")
    return models[mode]
