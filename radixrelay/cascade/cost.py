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

Calibration (benchmarks/results/engine/throughput_h200.md, end to end, Llama-3-8B shapes, CUDA graphs, cascade
forced on over the grid of one shared prefix x batch, one group per step): saving 32K-130K tokens gave
0.91x-1.05x flat (2K x 64 lost 9%), 254K and more always won (1.15x-3.69x): ``min_saved_tokens`` = 2^17,
four times the kernel-only rule
(``radixrelay.kernels.cascade.worth_cascading``: attention alone, no per-step cost); the default
model is never less strict than that rule per step (tests/cascade/test_planner.py). Two levels (2K
prefix -> 32 problems of 512 tokens -> 16 samples): the 32 problem groups, 7,680 saved tokens each,
took the step from 1.38x to 1.44x flat. The serving benchmark's tree (256-token problems x 16 samples,
3,840 saved tokens a group) gets its second level with ``min_group_saved`` = 2,048
(benchmarks/results/HISTORY.md); 16 samples under 128-token problems (1,920) stay in the suffixes.
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
