"""Continuous-batching scheduler with MindIE semantics (docs/engine.md#the-scheduler-mindie-semantics); see
`scheduler.py` for the rules."""

from .output import SchedulerOutput, StepKind
from .queues import POLICIES, Policy, WaitingQueue
from .scheduler import Scheduler
from .stage import StageSelector

__all__ = ["POLICIES", "Policy", "Scheduler", "SchedulerOutput", "StageSelector", "StepKind", "WaitingQueue"]
