"""Continuous-batching scheduler over the radix prefix cache (CPU only)."""

from radixrelay.scheduler.audit import KVAudit
from radixrelay.scheduler.cascade_hook import CascadePlanner, DecodeRow, PathSegment
from radixrelay.scheduler.config import SchedulerConfig
from radixrelay.scheduler.request import FinishReason, RequestUpdate, SchedulerStats
from radixrelay.scheduler.scheduler import Scheduler

__all__ = ["CascadePlanner", "DecodeRow", "FinishReason", "KVAudit", "PathSegment", "RequestUpdate",
           "Scheduler", "SchedulerConfig", "SchedulerStats"]
