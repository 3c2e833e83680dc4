"""The closed loop of DESIGN.md 4.3 in the operator, as a pure state machine over `status.tuning`.

`advance(isvc, plan, status, observation)` reads the InferenceService, its plan, its status as it is now and what the
operator just observed (the engine pods, a Prometheus window when one was due, the benchmark Job), and returns the
actions to take (a schedule to apply to every engine and the ConfigMap, a Job to create or delete, a replica count
to scale to, events) and the new status. It does no I/O and reads no clock: the autotune driver in `handlers.py`
gathers the observation, runs the actions and writes the status through the one status writer. The status holds
the whole state (the trial in progress, the history, the capacity probes), so an operator that restarts resumes
where it was, and the pure tuner (`tuner.next_step`) decides every trial from the history, as the simulator's
tests drive it.

One trial: the tuner's schedule goes to every engine (PUT /admin/schedule) and into the ConfigMap (a restarted pod
keeps it; the pod template's hash leaves hot fields out, so nothing rolls). The first quarter of `autotune.window`
settles and is dropped; the window after it is read from Prometheus. In benchmark mode a load-generator Job drives
one engine pod at the guide's client concurrency (maxBatchSize - 1) for that time and only that pod is measured.
A window that Prometheus could not answer, or that holds no finished request, is inconclusive: recorded once, and
measured again (after Prometheus is back). An engine pod that restarts or goes away during a trial, a failed Job,
or a trial the tuner judges failed (errors, KV exhausted, a preemption storm) rolls the engines back to the best
schedule known at once. After the verdict, the loop keeps `status.observed` current window by window and starts a
new round when the SLO is missed over several consecutive windows (at most once per window x maxTrials); with
`spec.capacity`, it first measures (benchmark) or derives (online) the concurrency one instance holds under the
SLO and scales the replicas to hold the target.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from npuserve.engine_contract import HOT_SCHEDULE_FIELDS

from .api import (
    CapacityProbe,
    CapacityStatus,
    InferenceService,
    Plan,
    PlanSchedule,
    ScheduleKnobs,
    TrialInProgress,
    TuningStatus,
    TuningTrial,
)
from .render import bench_job_name, render_bench_job
from .status import Status, serving_phase, set_condition
from .tuner import (
    NextTrial,
    Trial,
    TrialMetrics,
    TunedSchedule,
    TuningProblem,
    Verdict,
    failure_of,
    next_step,
    trial_from_status,
    trial_status,
)

SETTLE_FRACTION = 0.25  # of autotune.window: settles after a change and is not measured
MISSED_WINDOWS = 3  # consecutive windows missing the SLO after tuning that start a new round
CAPACITY_LIMIT_FACTOR = 2  # the capacity search goes at most this many times the tuned maxBatchSize
CAPACITY_TOLERANCE = 0.1  # the capacity search stops when the bracket is this narrow (relative)
JOB_SLACK_S = 5.0  # a benchmark Job runs this much past the window's end
INCONCLUSIVE = "inconclusive: "
MAX_STRETCH = 4  # a window measured again grows to at most this many times autotune.window
HISTORY_LIMIT = 100  # status.tuning.history's maxItems
IN_FLIGHT_KEY = "inFlightPerPod"  # history metric: mean requests in flight per pod (capacity, online)
# Condition reasons (docs/operator.md lists them).
REASON_NO_PROMETHEUS = "NoPrometheus"
REASON_WAITING = "WaitingForEngines"
REASON_MEASURING = "Measuring"
REASON_PROMETHEUS_DOWN = "PrometheusUnreachable"
REASON_NO_TRAFFIC = "WaitingForTraffic"
REASON_ROLLED_BACK = "RolledBack"
Event = tuple[Literal["Normal", "Warning"], str, str]


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
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


# --- what the driver observes --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PodState:
    name: str
    uid: str
    ip: str | None
    ready: bool
    restarts: int

    @property
    def signature(self) -> str:
        return f"{self.name}/{self.uid}/{self.restarts}"


JobPhase = Literal["active", "succeeded", "failed", "missing"]


@dataclass(frozen=True)
class Measurement:
    """One Prometheus window, as the driver read it: the tuner's metrics, or why there are none."""

    metrics: TrialMetrics | None = None
    inconclusive: str | None = None
    unreachable: bool = False  # Prometheus did not answer: wait for it before measuring again
    in_flight_per_pod: float | None = None


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
    apply: ScheduleKnobs | None = None  # to every engine (PUT /admin/schedule) and into the ConfigMap
    create_job: dict[str, Any] | None = None
    delete_job: str | None = None
    scale: int | None = None
    events: list[Event] = field(default_factory=list)


# --- the problem ---------------------------------------------------------------------------------------------------


def problem_for(isvc: InferenceService, plan: Plan, start: int | None = None) -> TuningProblem:
    """The tuner's problem for this InferenceService; `start` (a new round's) replaces the plan's first batch."""
    a = isvc.spec.autotune
    problem = TuningProblem.from_plan(plan, isvc.spec.slo, max_trials=a.maxTrials, min_samples=a.minSamples)
    if start is not None:
        problem = problem.model_copy(update={"batch_start": min(max(start, problem.batch_min), problem.batch_max)})
    return problem


def problem_key(problem: TuningProblem) -> str:
    """What makes trials comparable: the range, SLO, pinned knobs and base schedule (not the start or the budget)."""
    text = problem.model_dump_json(exclude={"batch_start", "max_trials", "min_samples"})
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def tuning_of(status: Mapping[str, Any]) -> TuningStatus | None:
    data = status.get("tuning")
    return None if data is None else TuningStatus.model_validate(data)


def applied_schedule(isvc: InferenceService, plan: Plan, status: Mapping[str, Any]) -> PlanSchedule | None:
    """The schedule the ConfigMap must hold: the tuner's, while autotune is on and its trials are of this plan;
    None: the plan's."""
    tuning = tuning_of(status)
    if not isvc.spec.autotune.enabled or tuning is None or tuning.applied is None:
        return None
    if tuning.problem != problem_key(problem_for(isvc, plan)):
        return None
    return with_knobs(plan.schedule, tuning.applied)


def with_knobs(schedule: PlanSchedule, knobs: ScheduleKnobs) -> PlanSchedule:
    return schedule.model_copy(update=knobs.pinned())


def _knobs(problem: TuningProblem, tuned: TunedSchedule) -> ScheduleKnobs:
    """The knobs a tuned schedule sets on the engines (with maxPreemptCount held <= maxBatchSize)."""
    full = problem.full_schedule(tuned)
    return ScheduleKnobs(**tuned.model_dump(), maxPreemptCount=full.maxPreemptCount)


# --- the history ---------------------------------------------------------------------------------------------------


def conclusive(history: Sequence[TuningTrial]) -> list[TuningTrial]:
    return [e for e in history if not e.verdict.startswith(INCONCLUSIVE)]


def trials_of(history: Sequence[TuningTrial]) -> list[Trial]:
    return [trial_from_status(e) for e in conclusive(history)]


def best_known(problem: TuningProblem, history: Sequence[TuningTrial]) -> ScheduleKnobs:
    """The schedule to roll back to: the best trial so far that did not fail and met every bound as measured (most
    tokens/s for throughput, else the largest batch); without one, the plan's."""
    bounds = problem.bounds()
    good: list[tuple[Trial, TuningTrial]] = []
    for entry in conclusive(history):
        t = trial_from_status(entry)
        m = t.metrics
        if m is None or failure_of(problem, t) is not None:
            continue
        latency = {"ttft": m.ttft_ms.of(problem.statistic), "tpot": m.tpot_ms.of(problem.statistic)}
        if all(latency[k] <= b for k, b in bounds.items()):
            good.append((t, entry))
    if not good:  # nothing measured well yet: the plan's own schedule (its hot knobs: what /admin/schedule takes)
        return ScheduleKnobs(**{k: v for k, v in problem.base.model_dump().items()
                                if k in ScheduleKnobs.model_fields and k in HOT_SCHEDULE_FIELDS})
    if problem.objective == "throughput":
        _, entry = max(good, key=lambda g: g[0].metrics.output_tokens_per_s if g[0].metrics else 0.0)
    else:
        _, entry = max(good, key=lambda g: g[0].schedule.maxBatchSize)
    return entry.schedule


def meets_slo(problem: TuningProblem, metrics: TrialMetrics) -> bool:
    values = {"ttft": metrics.ttft_ms.of(problem.statistic), "tpot": metrics.tpot_ms.of(problem.statistic)}
    return failure_of(problem, Trial(schedule=problem.schedule_for(problem.batch_start), metrics=metrics)) is None \
        and all(values[k] <= b for k, b in problem.bounds().items())


# --- when to read Prometheus ---------------------------------------------------------------------------------------


def _window_s(isvc: InferenceService) -> float:
    return parse_duration(isvc.spec.autotune.window)


def _settle_s(isvc: InferenceService) -> float:
    return _window_s(isvc) * SETTLE_FRACTION


def window_due(isvc: InferenceService, status: Mapping[str, Any], now: float) -> WindowRequest | None:
    """The window the driver must read from Prometheus now, if any: the open trial's once it has closed (and its
    reading is not waiting for Prometheus to come back), or, after tuning, the last window each `window`."""
    tuning = tuning_of(status)
    if not isvc.spec.autotune.enabled or tuning is None:
        return None
    current = tuning.current
    if current is not None:
        if _waiting_for_prometheus(current):
            return None
        end = parse_rfc3339(current.measureUntil)
        if now < end:
            return None
        return WindowRequest(parse_rfc3339(current.measureFrom), end,
                             (current.target,) if current.target else None)
    if tuning.phase in ("Converged", "Stopped", "Failed"):
        window = _window_s(isvc)
        last = parse_rfc3339(tuning.lastCheckAt) if tuning.lastCheckAt else 0.0
        if now - last >= window:
            return WindowRequest(now - window, now, None)
    return None


def waits_for_prometheus(status: Mapping[str, Any]) -> bool:
    """Whether the open trial waits for Prometheus to answer again (only then does the driver ask it)."""
    tuning = tuning_of(status)
    return tuning is not None and tuning.current is not None and _waiting_for_prometheus(tuning.current)


def needs_replica_limit(isvc: InferenceService, plan: Plan, status: Mapping[str, Any]) -> bool:
    """Whether this step may scale: capacity is asked for and not yet measured for this tuning problem (only then
    does the driver list the nodes)."""
    if isvc.spec.capacity is None:
        return False
    cap = status.get("capacity") or {}
    return not (cap.get("problem") == problem_key(problem_for(isvc, plan)) and cap.get("phase") in ("Measured",
                                                                                                  "Failed"))


def _cause(why: str) -> str:
    """What kind of inconclusive window: the text before the first colon ("Prometheus unreachable", ...)."""
    return why.split(":", 1)[0]


def _waiting_for_prometheus(current: TrialInProgress) -> bool:
    return (current.inconclusive or "").startswith("Prometheus unreachable")


# --- the step ------------------------------------------------------------------------------------------------------


def advance(isvc: InferenceService, plan: Plan, status: Mapping[str, Any], obs: Observation) -> Actions:
    """One step of the loop (module docstring). `status` is the InferenceService's status now."""
    step = _Step(isvc, plan, status, obs)
    step.run()
    return step.actions


class _Step:
    def __init__(self, isvc: InferenceService, plan: Plan, status: Mapping[str, Any], obs: Observation) -> None:
        self.isvc, self.plan, self.obs = isvc, plan, obs
        self.now = rfc3339(obs.now)
        self.generation = isvc.metadata.generation
        self.status: Status = {k: v for k, v in status.items()}
        self.actions = Actions(status=self.status)
        self.capacity_message = ""
        old = tuning_of(status)
        base = problem_for(isvc, plan)
        self.key = problem_key(base)
        if old is None or old.problem != self.key:
            # A new problem (first tuning, or a spec change that moved the range, the SLO or a pinned knob).
            self.tuning = TuningStatus(phase="Running", round=(old.round if old else 0) + 1, problem=self.key,
                                       roundStartedAt=self.now)
            if old is not None and old.current is not None and old.current.job:
                self.actions.delete_job = old.current.job
            self.status.pop("capacity", None)
        else:
            self.tuning = old.model_copy(deep=True)
        start = self.tuning.best.schedule.maxBatchSize if self.tuning.best and self.tuning.round > 1 else None
        self.problem = problem_for(isvc, plan, start) if start is not None else base

    # -- conditions and events --

    def condition(self, type_: str, value: bool, reason: str, message: str) -> None:
        self.status["conditions"] = set_condition(self.status.get("conditions") or [], type_, value, reason,
                                                  message, self.now, self.generation)

    def event(self, kind: Literal["Normal", "Warning"], reason: str, message: str) -> None:
        self.actions.events.append((kind, reason, message[:1024]))

    def finish(self) -> None:
        while len(self.tuning.history) > HISTORY_LIMIT:  # the status keeps 100: inconclusive entries go first
            drop = next((i for i, e in enumerate(self.tuning.history) if e.verdict.startswith(INCONCLUSIVE)), 0)
            del self.tuning.history[drop]
        self.tuning.trial = len(conclusive(self.tuning.history))
        self.status["tuning"] = self.tuning.model_dump(mode="json", exclude_none=True)
        if self.tuning.applied is not None:
            self.status["schedule"] = {**(self.status.get("schedule") or {}),
                                       **self.tuning.applied.model_dump(exclude_none=True)}
        ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                    for c in self.status.get("conditions") or [])
        if ready and self.status.get("phase") in ("Ready", "Tuning"):
            self.status["phase"] = serving_phase(self.status["tuning"])

    def apply(self, knobs: ScheduleKnobs) -> None:
        if self.tuning.applied != knobs:
            self.actions.apply = knobs
        self.tuning.applied = knobs

    # -- the loop --

    def run(self) -> None:
        if not self.obs.prometheus_configured:
            self.tuning.message = ("the operator has no Prometheus to read TTFT/TPOT from: run it with "
                                   "--prometheus-url (Helm value prometheus.url)")
            self.condition("Tuning", False, REASON_NO_PROMETHEUS, self.tuning.message)
            if self.tuning.phase == "Running" and self.tuning.current is None and not self.tuning.history:
                self.tuning.phase = "Idle"  # nothing runs: the phase must not say Tuning
            self.finish()
            return
        current = self.tuning.current
        if current is not None:
            self.tend(current)
        elif self.tuning.phase == "Running":
            self.next_trial()
        else:
            self.after_tuning()
        self.finish()

    def pods_ready(self) -> bool:
        desired = self.plan.replicas * self.plan.nodes
        ready = [p for p in self.obs.pods if p.ready and p.ip]
        return desired > 0 and len(ready) >= desired and len(ready) == len(self.obs.pods)

    def next_trial(self) -> None:
        if not self.pods_ready():
            self.tuning.message = "waiting for every engine pod to be ready before the next trial"
            self.condition("Tuning", True, REASON_WAITING, self.tuning.message)
            return
        step = next_step(self.problem, trials_of(self.tuning.history))
        if isinstance(step, NextTrial):
            number = len(self.tuning.history)
            self.open_window("trial", number, _knobs(self.problem, step.schedule), step.reason)
        else:
            self.conclude(step)

    def open_window(self, kind: Literal["trial", "capacity"], number: int, knobs: ScheduleKnobs, reason: str,
                    concurrency: int | None = None, attempts: int = 0) -> None:
        """Apply `knobs`, start the Job in benchmark mode, and open the window."""
        now = self.obs.now
        # A window measured again is longer (x2, x3, x4): requests longer than the window never finish inside it, and a
        # new benchmark Job starts its load over.
        stretch = 1 + min(attempts, MAX_STRETCH - 1)
        settle, window = _settle_s(self.isvc) * stretch, _window_s(self.isvc) * stretch
        ready = sorted((p for p in self.obs.pods if p.ready and p.ip), key=lambda p: p.name)
        benchmark = self.isvc.spec.autotune.mode == "benchmark"
        target = ready[0] if benchmark else None
        job = None
        if benchmark:
            assert target is not None and target.ip is not None
            users = concurrency or max(1, knobs.maxBatchSize - 1 if knobs.maxBatchSize else 1)
            concurrency = users
            job = bench_job_name(self.isvc, kind, self.tuning.round, number, now)
            self.actions.create_job = render_bench_job(self.isvc, name=job, target_ip=target.ip, concurrency=users,
                                                       duration_s=settle + window + JOB_SLACK_S)
        self.apply(knobs)
        self.tuning.current = TrialInProgress(
            kind=kind, trial=number, schedule=knobs, concurrency=concurrency, appliedAt=rfc3339(now),
            measureFrom=rfc3339(now + settle), measureUntil=rfc3339(now + settle + window),
            pods=sorted(p.signature for p in self.obs.pods), target=target.name if target else None, job=job,
            attempts=attempts)
        what = (f"trial {number}: maxBatchSize {knobs.maxBatchSize}" if kind == "trial"
                else f"capacity probe {number}: {concurrency} users at maxBatchSize {knobs.maxBatchSize}")
        load = f"; load: Job {job}, {concurrency} users on {target.name}" if target else "; load: live traffic"
        message = (f"{what} ({reason}); settling until {rfc3339(now + settle)}, measuring until "
                   f"{rfc3339(now + settle + window)}{load}")
        if kind == "capacity":  # tuning is over: its verdict stays on the Tuning condition and in its message
            self.capacity_message = message
            return
        self.tuning.message = message
        self.condition("Tuning", True, REASON_MEASURING, message)
        self.event("Normal", "TrialStarted", message)

    def tend(self, current: TrialInProgress) -> None:
        now = self.obs.now
        changed = self.pods_changed(current)
        if changed is not None:
            self.close_failed(current, changed)
            return
        if current.job and self.obs.job == "failed":
            self.close_failed(current, f"the load-generator Job {current.job} failed")
            return
        if _waiting_for_prometheus(current):
            if not self.obs.prometheus:
                return  # still down: the trial stays open, nothing is decided
            self.reopen(current, "Prometheus answers again")
            return
        if now < parse_rfc3339(current.measureUntil):
            return
        m = self.obs.measurement
        if m is None:
            return  # the driver did not read (it will next time)
        if m.unreachable or m.metrics is None:
            self.inconclusive(current, m)
            return
        if current.kind == "capacity":
            self.close_probe(current, m.metrics)
        else:
            self.close_trial(current, m)

    def pods_changed(self, current: TrialInProgress) -> str | None:
        now = {p.name: p for p in self.obs.pods}
        for sig in current.pods:
            name, _, _ = sig.split("/")
            pod = now.get(name)
            if pod is None:
                return f"engine pod {name} went away during the trial"
            if pod.signature != sig:
                return f"engine pod {name} restarted during the trial"
            if not pod.ready:
                return f"engine pod {name} stopped being ready during the trial"
        return None

    def inconclusive(self, current: TrialInProgress, m: Measurement) -> None:
        why = m.inconclusive or "no measurement"
        if m.unreachable:
            why = f"Prometheus unreachable: {why}" if not why.startswith("Prometheus unreachable") else why
        # Recorded once per cause while the trial stays open (a window with no traffic, then Prometheus down, are two
        # entries; ten empty windows are one).
        last = self.tuning.history[-1].verdict if self.tuning.history and current.attempts else ""
        first = _cause(last.removeprefix(INCONCLUSIVE)) != _cause(why) or not last.startswith(INCONCLUSIVE)
        current.inconclusive, current.attempts = why, current.attempts + 1
        if current.kind == "trial" and first:
            self.tuning.history.append(TuningTrial(
                trial=len(self.tuning.history), schedule=current.schedule, verdict=f"{INCONCLUSIVE}{why}",
                window=f"{current.measureFrom}/{current.measureUntil}"))
            current.trial = len(self.tuning.history)
        what = f"trial {current.trial}" if current.kind == "trial" else f"capacity probe {current.trial}"
        if m.unreachable:
            message = f"{what}: {why}; inconclusive, measured again once Prometheus answers"
            if first:
                self.event("Warning", REASON_PROMETHEUS_DOWN, message)
        else:
            self.reopen(current, why)
            message = f"{what}: {why}; measuring again (attempt {current.attempts + 1})"
        if current.kind == "trial":
            self.tuning.message = message
            self.condition("Tuning", True, REASON_PROMETHEUS_DOWN if m.unreachable else REASON_NO_TRAFFIC, message)

    def reopen(self, current: TrialInProgress, why: str) -> None:
        """Measure the open trial again from now: the schedule stays, a new window (and Job) starts."""
        self.tuning.current = None
        number = current.trial
        self.open_window(current.kind, number, current.schedule, f"again: {why}", current.concurrency,
                         attempts=current.attempts)
        assert self.tuning.current is not None
        self.tuning.current.inconclusive = None
        if current.job:
            self.actions.delete_job = current.job

    def close_failed(self, current: TrialInProgress, why: str) -> None:
        self.tuning.current = None
        if current.job:
            self.actions.delete_job = current.job
        if current.kind == "capacity":
            self.event("Warning", "CapacityProbeDiscarded",
                       f"capacity probe at {current.concurrency} users discarded: {why}")
            return
        self.tuning.history.append(TuningTrial(
            trial=len(self.tuning.history), schedule=current.schedule, verdict=f"failed: {why}",
            window=f"{current.measureFrom}/{current.measureUntil}"))
        self.rollback(f"trial {current.trial} (maxBatchSize {current.schedule.maxBatchSize}) failed: {why}")

    def rollback(self, why: str) -> None:
        best = best_known(self.problem, self.tuning.history)
        self.apply(best)
        self.tuning.message = f"{why}; rolled back to maxBatchSize {best.maxBatchSize}"
        self.condition("Tuning", True, REASON_ROLLED_BACK, self.tuning.message)
        self.event("Warning", REASON_ROLLED_BACK, self.tuning.message)

    def close_trial(self, current: TrialInProgress, m: Measurement) -> None:
        assert m.metrics is not None
        self.tuning.current = None
        if current.job:
            self.actions.delete_job = current.job
        trial = Trial(schedule=TunedSchedule.from_knobs(current.schedule, f"trial {current.trial}"), metrics=m.metrics)
        entry = trial_status(self.problem, len(self.tuning.history), trial)
        metrics = dict(entry.metrics)
        if m.in_flight_per_pod is not None:
            metrics[IN_FLIGHT_KEY] = m.in_flight_per_pod
        entry = entry.model_copy(update={"schedule": current.schedule, "metrics": metrics,
                                         "window": f"{current.measureFrom}/{current.measureUntil}"})
        self.tuning.history.append(entry)
        self.observe(m.metrics, current.measureFrom, current.measureUntil)
        failed = failure_of(self.problem, trial)
        self.event("Warning" if failed else "Normal", "TrialMeasured",
                   f"trial {entry.trial}: maxBatchSize {current.schedule.maxBatchSize}: {entry.verdict}")
        if failed is not None:
            self.rollback(f"trial {entry.trial} (maxBatchSize {current.schedule.maxBatchSize}) failed: {failed}")
            return
        self.tuning.message = f"trial {entry.trial}: {entry.verdict}"
        self.next_trial()

    def observe(self, metrics: TrialMetrics, start: str, end: str) -> None:
        stat = self.isvc.spec.slo.statistic
        window = parse_rfc3339(end) - parse_rfc3339(start)
        self.status["observed"] = {
            **(self.status.get("observed") or {}),
            "ttftMs": round(metrics.ttft_ms.of(stat), 3), "tpotMs": round(metrics.tpot_ms.of(stat), 3),
            "outputTokensPerSecond": round(metrics.output_tokens_per_s, 3), "errorRate": metrics.error_rate,
            "window": format_duration(window), "samples": metrics.samples, "measuredAt": end,
        }

    # -- the verdict, and after it --

    def conclude(self, verdict: Verdict) -> None:
        history = conclusive(self.tuning.history)
        best = history[verdict.best] if verdict.best is not None else None
        self.tuning.best = best
        self.tuning.phase = ("Converged" if verdict.reason == "converged" else
                             "Failed" if verdict.reason == "allFailed" else "Stopped")
        self.tuning.lastCheckAt = self.now
        self.tuning.missedWindows = 0
        self.apply(best.schedule if best is not None else best_known(self.problem, self.tuning.history))
        said = f"{verdict.reason} after {len(history)} trials: {verdict.message}"
        self.tuning.message = said
        self.condition("Tuning", False, verdict.reason[0].upper() + verdict.reason[1:], said)
        if verdict.slo_met:
            self.condition("SLOMet", True, "SLOMet", f"the tuned schedule meets the SLO: {verdict.message}")
        else:
            self.condition("SLOMet", False, "SLOUnreachable" if verdict.reason == "sloUnreachable" else "SLOMissed",
                           f"{verdict.message}. No schedule in maxBatchSize {self.problem.batch_min}.."
                           f"{self.problem.batch_max} met it: relax spec.slo, add cards (spec.accelerator.cards) or "
                           "replicas, or shorten spec.workload")
        self.event("Normal" if verdict.slo_met else "Warning", "TuningFinished", said)
        self.capacity()

    def after_tuning(self) -> None:
        if self.capacity():
            return
        m = self.obs.measurement
        if m is None:
            return
        self.tuning.lastCheckAt = self.now
        if m.metrics is None:
            return  # no traffic or no Prometheus: nothing said about the SLO
        self.observe(m.metrics, rfc3339(self.obs.now - _window_s(self.isvc)), self.now)
        if meets_slo(self.problem, m.metrics):
            self.tuning.missedWindows = 0
            self.condition("SLOMet", True, "SLOMet", "the last window met the SLO")
            return
        if self.tuning.phase != "Converged":
            # The last round found no schedule that meets the SLO (or stopped short): another round on the same
            # problem would find the same; say it, and leave the search to a spec change.
            self.condition("SLOMet", False, "SLOMissed", "the last window missed the SLO, as the tuning's verdict said")
            return
        self.tuning.missedWindows += 1
        self.condition("SLOMet", False, "SLOMissed",
                       f"{self.tuning.missedWindows} consecutive window(s) missed the SLO (traffic changed?); "
                       f"{MISSED_WINDOWS} start a new tuning round")
        started = parse_rfc3339(self.tuning.roundStartedAt) if self.tuning.roundStartedAt else 0.0
        cool_down = _window_s(self.isvc) * self.isvc.spec.autotune.maxTrials
        if self.tuning.missedWindows >= MISSED_WINDOWS and self.obs.now - started >= cool_down:
            best = self.tuning.best
            self.tuning = TuningStatus(phase="Running", round=self.tuning.round + 1, problem=self.key,
                                       roundStartedAt=self.now, applied=self.tuning.applied, best=best)
            self.status.pop("capacity", None)  # measured again for the new round's best
            self.problem = problem_for(self.isvc, self.plan, best.schedule.maxBatchSize if best else None)
            self.event("Normal", "TuningRestarted", f"the SLO was missed in {MISSED_WINDOWS} consecutive windows: "
                       f"round {self.tuning.round} starts")
            self.next_trial()

    # -- capacity --

    def capacity(self) -> bool:
        """Measure or derive the per-instance concurrency and scale to the target; True while a probe runs."""
        cap_spec = self.isvc.spec.capacity
        if cap_spec is None or self.tuning.phase == "Running":
            return False
        cap = CapacityStatus.model_validate(self.status["capacity"]) if self.status.get("capacity") else None
        if cap is not None and cap.problem == self.key and cap.phase in ("Measured", "Failed"):
            return False
        static = self.plan.concurrencyPerReplica
        if cap is None or cap.problem != self.key:
            cap = CapacityStatus(problem=self.key, targetConcurrentUsers=cap_spec.targetConcurrentUsers,
                                 staticConcurrencyPerReplica=static,
                                 staticReplicas=math.ceil(cap_spec.targetConcurrentUsers / static))
        best = self.tuning.best
        best_metrics = trial_from_status(best).metrics if best is not None and best.metrics else None
        # The verdict's judgement (the SLOMet condition it set), not the best trial's raw window: with noise the
        # tuner judges by its smoothed fit, and the two must not disagree.
        slo_met = any(c.get("type") == "SLOMet" and c.get("status") == "True"
                      for c in self.status.get("conditions") or [])
        if best is None or best_metrics is None or not slo_met:
            cap.phase, cap.message = "Failed", ("no tuned schedule met the SLO, so nothing was measured; replicas "
                                                "stay as planned (status.plan.replicas)")
            self.status["capacity"] = cap.model_dump(mode="json", exclude_none=True)
            return False
        batch = best.schedule.maxBatchSize or 1
        measured: int | None = None
        if self.isvc.spec.autotune.mode == "online":
            per_pod = best.metrics.get(IN_FLIGHT_KEY)
            if per_pod is None or per_pod < 1:
                cap.phase, cap.message = "Failed", ("the best trial's window had under one request in flight per "
                                                    "pod: too little traffic to derive a capacity from")
            else:
                measured = max(1, math.floor(per_pod))
                cap.method = (f"online: {per_pod:.1f} requests in flight per pod on average (Little's law) over the "
                              f"best trial's window, maxBatchSize {batch}, which met the SLO; a lower bound when "
                              "live traffic was below what one instance holds")
        elif not self.problem.bounds():
            measured = max(1, batch - 1)
            cap.method = (f"benchmark: the best trial held {measured} users (maxBatchSize {batch} - 1, the guide's "
                          "client concurrency); no TTFT/TPOT bound to search further against")
        else:
            measured = self.capacity_search(cap, batch)
            if measured is None:
                self.status["capacity"] = cap.model_dump(mode="json", exclude_none=True)
                return True
        if measured is not None:
            cap.phase, cap.measuredConcurrencyPerReplica, cap.measuredAt = "Measured", measured, self.now
            self.tuning.lastCheckAt = self.now  # the next SLO window must not cover a probe's load
            self.scale(cap, cap_spec.targetConcurrentUsers, cap_spec.minReplicas, cap_spec.maxReplicas, measured)
        self.status["capacity"] = cap.model_dump(mode="json", exclude_none=True)
        return False

    def capacity_search(self, cap: CapacityStatus, batch: int) -> int | None:
        """Benchmark probes from the best trial's load (a known pass) up to CAPACITY_LIMIT_FACTOR x its batch;
        the answer, or None while a probe runs (it opens the next one)."""
        low = max(1, batch - 1)
        # Users beyond maxBatchSize only wait: TPOT never sees them, TTFT does. Without a TTFT bound one instance
        # holds at most its batch; with one, the search goes past it until the queueing shows in TTFT.
        limit = max(low, CAPACITY_LIMIT_FACTOR * batch if "ttft" in self.problem.bounds() else batch)
        if not cap.probes:
            cap.probes.append(CapacityProbe(concurrency=low, passed=True,
                                            verdict="the best trial's load (maxBatchSize - 1): met the SLO"))
        nxt = next_capacity_probe({p.concurrency: p.passed for p in cap.probes}, limit)
        if nxt is None:
            answer = max(p.concurrency for p in cap.probes if p.passed)
            top = ""
            if answer >= limit:
                top = (" (the search's limit, 2 x maxBatchSize: it may hold more)" if "ttft" in self.problem.bounds()
                       else " (at most maxBatchSize: without a TTFT bound, users beyond it only wait in the queue)")
            cap.method = (f"benchmark: the largest client concurrency whose TTFT/TPOT met the SLO against one "
                          f"instance at maxBatchSize {batch}, by doubling and bisection over {len(cap.probes)} "
                          f"probes{top}")
            return answer
        if not self.pods_ready():
            cap.message = "waiting for every engine pod to be ready before the next capacity probe"
            return None
        cap.phase = "Measuring"
        assert self.tuning.applied is not None
        self.open_window("capacity", len(cap.probes), self.tuning.applied, "capacity search", concurrency=nxt)
        cap.message = self.capacity_message
        return None

    def close_probe(self, current: TrialInProgress, metrics: TrialMetrics) -> None:
        self.tuning.current = None
        if current.job:
            self.actions.delete_job = current.job
        cap = CapacityStatus.model_validate(self.status["capacity"])
        passed = meets_slo(self.problem, metrics)
        stat = self.problem.statistic
        verdict = (f"TTFT {stat} {metrics.ttft_ms.of(stat):.1f} ms, TPOT {stat} {metrics.tpot_ms.of(stat):.1f} ms, "
                   f"{metrics.output_tokens_per_s:.0f} tok/s: {'met' if passed else 'missed'} the SLO")
        assert current.concurrency is not None
        cap.probes.append(CapacityProbe(concurrency=current.concurrency, passed=passed, verdict=verdict))
        self.status["capacity"] = cap.model_dump(mode="json", exclude_none=True)
        self.event("Normal", "CapacityProbe", f"{current.concurrency} users: {verdict}")
        self.capacity()

    def scale(self, cap: CapacityStatus, target: int, low: int, high: int | None, per_replica: int) -> None:
        want = math.ceil(target / per_replica)
        replicas, bound = want, None
        if replicas < low:
            replicas, bound = low, f"spec.capacity.minReplicas ({low})"
        if high is not None and replicas > high:
            replicas, bound = high, f"spec.capacity.maxReplicas ({high})"
        if self.obs.replica_limit is not None and replicas > self.obs.replica_limit:
            replicas, bound = self.obs.replica_limit, (f"the nodes' allocatable accelerators hold "
                                                       f"{self.obs.replica_limit} replicas")
        cap.replicas, cap.bound = replicas, bound
        cap.message = (f"{target} users / {per_replica} per replica (measured) -> {want} replicas"
                       + (f", bounded by {bound}: {replicas}" if bound else "")
                       + f"; the plan's static estimate: {cap.staticConcurrencyPerReplica} per replica -> "
                       f"{cap.staticReplicas}")
        if self.isvc.spec.replicas != replicas:
            self.actions.scale = replicas
            self.event("Normal", "Scaled", cap.message)


def next_capacity_probe(passes: Mapping[int, bool], limit: int) -> int | None:
    """The next client concurrency to probe, or None when the search is done: doubling from the largest pass until a
    failure or `limit`, then bisection until the bracket is within CAPACITY_TOLERANCE."""
    ok = [c for c, p in passes.items() if p]
    if not ok:
        return None
    low = max(ok)
    fails = [c for c, p in passes.items() if not p and c > low]
    if not fails:
        return None if low >= limit else min(limit, low * 2)
    high = min(fails)
    if high - low <= max(1, math.ceil(CAPACITY_TOLERANCE * low)):
        return None
    return (low + high) // 2
