"""Automatic cascaded attention: plans grouping each decode step's requests by the radix nodes they
share. ``radixrelay.cascade.planner`` (scheduler side: ``make_cascade_planner``) makes them; the worker
turns a plan into ``radixrelay.attention.metadata.CascadeBatch``. This package root imports only the
plan structs so that ``radixrelay.worker.protocol`` can use them without importing the scheduler."""

from radixrelay.cascade.cost import CostModel, cost_model
from radixrelay.cascade.counters import CascadeCounters
from radixrelay.cascade.plan import CascadeGroup, CascadePlan

__all__ = ["CascadeCounters", "CascadeGroup", "CascadePlan", "CostModel", "cost_model"]
