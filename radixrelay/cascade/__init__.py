"""Automatic cascaded attention: plans grouping each decode step's requests by the radix nodes they
share. ``radixrelay.cascade.planner`` (scheduler side: ``make_cascade_planner``) makes them; the worker
turns a plan into ``radixrelay.attention.metadata.CascadeBatch``. The plan structs travel between the
processes, so they are defined in ``radixrelay.protocol.cascade``; the planner's counters in
``radixrelay.protocol.stats.CascadeCounters``."""

from radixrelay.cascade.cost import CostModel, cost_model

__all__ = ["CostModel", "cost_model"]
