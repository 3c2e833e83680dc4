"""Continuous-batching scheduler with MindIE semantics (DESIGN.md 3.1); see `scheduler.py` for the rules."""

from .output import SchedulerOutput, StepKind
from .queues import POLICIES, Policy, WaitingQueue
from .scheduler import Scheduler
from .stage import StageSelector

__all__ = ["POLICIES", "Policy", "Scheduler", "SchedulerOutput", "StageSelector", "StepKind", "WaitingQueue"]
