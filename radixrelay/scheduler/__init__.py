"""Continuous-batching scheduler over the radix prefix cache (CPU only). What it sends and receives
(``StepPlan``, ``StepOutput``, ``RequestUpdate``, ``SchedulerStats``, ``KVAudit``, ``DecodeRow``) is defined in
``radixrelay.protocol``."""

from radixrelay.scheduler.cascade_hook import CascadePlanner
from radixrelay.scheduler.scheduler_config import SchedulerConfig
from radixrelay.scheduler.scheduler import Scheduler

__all__ = ["CascadePlanner", "Scheduler", "SchedulerConfig"]
