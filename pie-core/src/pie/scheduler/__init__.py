"""Batch scheduler: iteration-level batching of every live sequence, with preemption to the host pool."""

from pie.scheduler.core import (
    BatchScheduler,
    PastContext,
    RequestTooLarge,
    SchedulerConfig,
    SchedulerError,
    SchedulerStats,
    Sequence,
    SequenceDropped,
)
from pie.scheduler.driver import Scheduler
from pie.scheduler.offload import HostPagePool
from pie.scheduler.requests import generate

__all__ = [
    "BatchScheduler",
    "HostPagePool",
    "PastContext",
    "RequestTooLarge",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerError",
    "SchedulerStats",
    "Sequence",
    "SequenceDropped",
    "generate",
]
