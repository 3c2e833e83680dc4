"""What the operator observes and what the state machine asks of it: plain facts and requests, no decisions.

The I/O modules (`kube.py`, `prometheus.py`, `autotune_loop.py`) build and read these; the pure modules decide from
them: the autotune state machine (`autotune.py`) and its capacity part (`capacity.py`), the status logic
(`status.py`, which also reads the engines' reports).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from npuserve.planning.api import AppliedSchedule, InconclusiveReasonName, TrialMetrics

Status = dict[str, Any]  # an InferenceService's status as the API server holds it

Event = tuple[Literal["Normal", "Warning"], str, str]
JobPhase = Literal["active", "succeeded", "failed", "missing"]


@dataclass(frozen=True)
class Termination:
    """How an engine container last ended, as its pod's status says (the current or last terminated state)."""

    exit_code: int
    reason: str | None = None  # the kubelet's: Error, OOMKilled, Completed...
    message: str | None = None  # the termination message: the engine's fatal message, else its last log lines


@dataclass(frozen=True)
class EngineReport:
    """One engine pod as the operator sees it (its readiness and `/info`, read by `engine_http.read_engines`), and
    how its engine container last ended and how often it restarted (from the pod's status)."""

    pod: str
    ready: bool
    kv_blocks: int | None = None  # from the engine's /info
    error: str | None = None
    restarts: int = 0
    terminated: Termination | None = None
    group: str | None = None  # a LeaderWorkerSet pod's group index (its replica); None: a Deployment's pod


# --- time ----------------------------------------------------------------------------------------------------------

_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """Seconds of a Go duration as the CRD accepts it (`2m`, `1m30s`, `500ms`)."""
    parts = re.findall(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a duration: {text!r}")
    return sum(float(n) * _DURATION_UNITS[u] for n, u in parts)


def format_duration(seconds: float) -> str:
    return f"{seconds:g}s" if seconds < 120 else f"{seconds / 60:g}m"


def rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_rfc3339(text: str) -> float:
    """Unix seconds of an RFC 3339 time ('Z' or an offset, fractions of a second allowed); one without a zone is
    taken as UTC, never as the host's local time."""
    parsed = datetime.fromisoformat(text)
    return (parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)).timestamp()


# --- what the driver observes --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PodState:
    name: str
    uid: str
    ip: str | None
    ready: bool
    restarts: int
    # Whether it serves HTTP (the engine's API, /metrics, PUT /admin/schedule): a Deployment's pod or a
    # LeaderWorkerSet's leader; a worker pod (node rank > 0) serves /health and /ready only.
    leader: bool = True

    @property
    def signature(self) -> str:
        return f"{self.name}/{self.uid}/{self.restarts}"


@dataclass(frozen=True)
class GenerationsRun:
    """The schedule generations the measured engines ran over a window (their gauge's lowest and highest sample;
    None: no sample), and how many pods reported one."""

    lowest: int | None
    highest: int | None
    pods: int


@dataclass(frozen=True)
class Measurement:
    """One Prometheus window, as the driver read it: the window's figures, or why there are none."""

    metrics: TrialMetrics | None = None
    inconclusive: str | None = None
    reason: InconclusiveReasonName | None = None  # with `inconclusive`: PrometheusUnreachable waits for Prometheus
    generations: GenerationsRun | None = None  # None: not read (the simulator's windows), nothing to check
    start: float | None = None  # the window read (unix seconds); None: the `window` before `Observation.now`
    end: float | None = None

    @property
    def unreachable(self) -> bool:
        return self.reason == "PrometheusUnreachable"


@dataclass(frozen=True)
class Observation:
    now: float
    pods: Sequence[PodState]
    measurement: Measurement | None = None  # given when `window_due` asked for it
    prometheus: bool = True  # a Prometheus URL is configured and answers
    prometheus_configured: bool = True
    job: JobPhase | None = None  # the Job of the trial in progress
    replica_limit: int | None = None  # the replicas the nodes' cards (or CPUs) hold


@dataclass(frozen=True)
class WindowRequest:
    """A Prometheus window the driver must read before calling `advance`."""

    start: float
    end: float
    pods: tuple[str, ...] | None  # None: every engine pod of the InferenceService


@dataclass
class Actions:
    status: Status
    # To every engine (PUT /admin/schedule, with its generation); reconcile writes the ConfigMap from the status.
    apply: AppliedSchedule | None = None
    create_job: dict[str, Any] | None = None
    delete_job: str | None = None
    scale: int | None = None
    events: list[Event] = field(default_factory=list)


@dataclass(frozen=True)
class Intent:
    """What a written status says the engines and the load Job must be (`tuning_schedule.recorded_intent`): the driver
    carries it out after the write, and again when it has not yet (a new leader, an act that raised)."""

    apply: AppliedSchedule | None = None  # the tuner's schedule, to PUT on every engine
    job: dict[str, Any] | None = None  # the open trial's load Job, to create if absent

    @property
    def key(self) -> tuple[int | None, str | None]:
        """What tells two intents apart: the schedule generation and the Job's name."""
        return (self.apply.scheduleGeneration if self.apply is not None else None,
                self.job["metadata"]["name"] if self.job is not None else None)
