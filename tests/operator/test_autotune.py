"""The operator's closed-loop autotuning (operator/autotune.py, docs/operator.md#autotuning-specautotune), driven as its
driver (operator/autotune_loop.py) drives it: every tick ask `window_due`, read the window from a fake engine when one
is due, call `advance`, keep `actions.status`, move the virtual clock on by 2 s. No cluster, no Prometheus: the engine
is an analytic latency model, the pods are `PodState`s and the clock is `Observation.now`.

The InferenceService is `examples/tiny-cpu.yaml` with autotune on (window 20 s) and a workload that gives the plan a
wide maxBatchSize range (512 .. 4096, starting at 2048; the example's own workload gives 4096 .. 5000).
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from isvc_helpers import REPO, load_yaml

from npuserve.engine_contract import ENGINE_PORT, HOT_SCHEDULE_FIELDS, SCHEDULE_GENERATION_KEY
from npuserve.operator import autotune as at
from npuserve.operator import autotune_types as tt
from npuserve.operator import capacity
from npuserve.operator import look_timing as lt
from npuserve.operator import tuning_schedule as ts
from npuserve.operator.crd import PRINTER_COLUMNS
from npuserve.planning.api import (
    EARLIER_WINDOWS,
    CapacityStatus,
    InferenceService,
    LatencyStats,
    Plan,
    ScheduleKnobs,
    TrialMetrics,
    TuningStatus,
    TuningTrial,
)
from npuserve.planning.planner import plan as plan_spec

T0 = 1_700_000_000.0  # the virtual clock's start (unix seconds)
TICK_S = 2.0  # this test's virtual driver steps its clock by this much (the real loop looks when something is due)
WINDOW_S = 20.0
SETTLE_S = WINDOW_S * lt.SETTLE_FRACTION
GRID_S = 5.0  # window ends fall on multiples of 5 s (unix time)


def on_grid(t: float) -> float:
    """The first multiple of GRID_S at or after `t`: where a window that would end at `t` ends."""
    return math.ceil(t / GRID_S) * GRID_S
TOLERANCE = 0.03  # the tuner's default tolerance (TuningProblem.tolerance)
WORKLOAD = {"avgInputTokens": 256, "avgOutputTokens": 256, "maxOutputTokens": 1792, "maxInputTokens": 1024}
DECODE_SLO: dict[str, Any] = {"objective": "decodeLatency", "tpotMs": 25}
# TPOT binds nowhere in the range and TTFT only past the batch: tuning stops at the range maximum (4096), and the
# capacity search finds the users one instance holds beyond its batch as they queue (TTFT up 0.5 ms per user).
CAPACITY_SLO: dict[str, Any] = {"objective": "firstTokenAndDecode", "tpotMs": 40, "ttftMs": 1500}
TUNED_KNOBS = ("maxBatchSize", "maxPrefillBatchSize", "maxPrefillTokens", "supportSelectBatch", "maxPreemptCount")


# --- the fake engine -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FakeEngine:
    """One engine instance at `batch` (maxBatchSize) under `users` clients (None: live traffic that fills the batch).
    r = min(batch, users) requests run: TPOT = tpot0 + tpot_per_req r + tpot_quad r^2 ms, output tok/s = r / TPOT x
    1000 (rising, then falling past a peak when tpot_quad > 0); TTFT = ttft0 + ttft_per_req r, plus queue_ms for every
    user waiting beyond the batch."""

    tpot0: float = 10.0
    tpot_per_req: float = 0.005
    tpot_quad: float = 0.0
    ttft0: float = 50.0
    ttft_per_req: float = 0.1
    queue_ms: float = 0.5
    samples: int = 500
    busy: float = 0.9  # live traffic: requests in flight per pod, as a fraction of maxBatchSize

    def running(self, batch: int, users: int | None) -> int:
        return batch if users is None else min(batch, users)

    def tpot(self, batch: int, users: int | None = None) -> float:
        r = self.running(batch, users)
        return self.tpot0 + self.tpot_per_req * r + self.tpot_quad * r * r

    def ttft(self, batch: int, users: int | None = None) -> float:
        queued = 0 if users is None else max(0, users - batch)
        return self.ttft0 + self.ttft_per_req * self.running(batch, users) + self.queue_ms * queued

    def metrics(self, batch: int, users: int | None = None, error_rate: float = 0.0,
                in_flight: float | None = None) -> TrialMetrics:
        tpot, ttft = self.tpot(batch, users), self.ttft(batch, users)
        return TrialMetrics(outputTokensPerSecond=self.running(batch, users) / tpot * 1000,
                            ttftMs=LatencyStats(mean=ttft, p90=1.3 * ttft, p99=1.6 * ttft),
                            tpotMs=LatencyStats(mean=tpot, p90=1.2 * tpot, p99=1.5 * tpot),
                            errorRate=error_rate, samples=self.samples, inFlightPerPod=in_flight)

    def meets(self, slo: dict[str, Any], batch: int, users: int | None = None) -> bool:
        tpot_ms: float = slo.get("tpotMs", math.inf)
        ttft_ms: float = slo.get("ttftMs", math.inf)
        return self.tpot(batch, users) <= tpot_ms and self.ttft(batch, users) <= ttft_ms

    def in_flight(self, batch: int) -> float:
        return self.busy * batch


# --- the loop, as the driver runs it -------------------------------------------------------------------------------


def make_isvc(slo: dict[str, Any], *, mode: str = "online", max_trials: int = 8, replicas: int = 1,
              capacity: dict[str, Any] | None = None) -> InferenceService:
    data = load_yaml(REPO / "examples" / "tiny-cpu.yaml")
    spec = data["spec"]
    spec["workload"] = dict(WORKLOAD)
    spec["slo"] = dict(slo)
    spec["autotune"] = {"enabled": True, "window": "20s", "mode": mode, "maxTrials": max_trials}
    spec["replicas"] = replicas
    if capacity is not None:
        spec["capacity"] = dict(capacity)
    data["metadata"].update(namespace="default", uid="isvc-uid", generation=1)
    return InferenceService.model_validate(data)


def ready_status(plan: Plan) -> dict[str, Any]:
    def cond(type_: str) -> dict[str, Any]:
        return {"type": type_, "status": "True", "reason": type_, "message": "",
                "lastTransitionTime": at.rfc3339(T0 - 60), "observedGeneration": 1}

    return {"phase": "Ready", "plan": plan.model_dump(mode="json"), "conditions": [cond("Ready"), cond("Deployed")]}


def engine_pods(n: int) -> list[tt.PodState]:
    # Listed out of name order: the benchmark's target is the first ready pod by name, not by position.
    return [tt.PodState(f"tiny-{chr(ord('a') + i)}", f"uid-{i}", f"10.0.0.{i + 1}", True, 0)
            for i in reversed(range(n))]


@dataclass
class Tick:
    now: float
    due: tt.WindowRequest | None
    current: dict[str, Any] | None  # status.tuning.current before the step
    measurement: tt.Measurement | None
    actions: tt.Actions


@dataclass
class Loop:
    isvc: InferenceService
    plan: Plan
    engine: FakeEngine
    status: dict[str, Any]
    pods: list[tt.PodState]
    now: float = T0
    prometheus: bool = True
    job: tt.JobPhase = "active"  # the phase of the trial's Job, when it has one
    replica_limit: int | None = None
    error_rate: float = 0.0
    ticks: list[Tick] = field(default_factory=list)

    @classmethod
    def start(cls, slo: dict[str, Any] = DECODE_SLO, *, engine: FakeEngine | None = None, replicas: int = 1,
              **spec: Any) -> Loop:
        isvc = make_isvc(slo, replicas=replicas, **spec)
        plan = plan_spec(isvc.spec)
        return cls(isvc, plan, engine or FakeEngine(), ready_status(plan), engine_pods(replicas))

    # -- one tick --

    def tick(self, measurement: tt.Measurement | None = None) -> tt.Actions:
        """One step; `measurement`: this reading of the due window instead of what the driver would read."""
        due = lt.window_due(self.isvc, self.status, self.now)
        current = self.current()
        if measurement is None:
            measurement = self.read(due, current)
        obs = tt.Observation(now=self.now, pods=tuple(self.pods), measurement=measurement,
                             prometheus=self.prometheus,
                             job=self.job if current is not None and current.get("job") else None,
                             replica_limit=self.replica_limit)
        given = copy.deepcopy(self.status)
        actions = at.advance(self.isvc, self.plan, self.status, obs)
        assert self.status == given, "advance changed the status it was given"
        self.ticks.append(Tick(self.now, due, current, measurement, actions))
        self.status = actions.status
        self.now += TICK_S
        return actions

    def read(self, due: tt.WindowRequest | None, current: dict[str, Any] | None) -> tt.Measurement | None:
        """The driver's reading of a due window: Prometheus down, or the fake engine at the schedule measured."""
        if due is None:
            return None
        if not self.prometheus:
            return tt.Measurement(inconclusive="Prometheus unreachable: connection refused",
                                  reason="PrometheusUnreachable")
        if current is not None:
            batch, users = int(current["schedule"]["maxBatchSize"]), current.get("concurrency")
        else:
            batch, users = int(self.status["tuning"]["applied"]["maxBatchSize"]), None
        in_flight = self.engine.in_flight(batch) if self.isvc.spec.autotune.mode == "online" else None
        return tt.Measurement(metrics=self.engine.metrics(batch, users, self.error_rate, in_flight))

    def run_until(self, done: Callable[[Loop], bool], limit: int = 1500) -> None:
        for _ in range(limit):
            self.tick()
            if done(self):
                return
        raise AssertionError(f"not reached in {limit} ticks; tuning: {self.status.get('tuning')}")

    def tick_until_due(self, limit: int = 100) -> None:
        """Ticks until a window is due at the clock's time (that tick not taken)."""
        for _ in range(limit):
            if lt.window_due(self.isvc, self.status, self.now) is not None:
                return
            self.tick()
        raise AssertionError(f"no window due in {limit} ticks")

    # -- reading the state --

    def tuning(self) -> TuningStatus:
        tuning = ts.tuning_of(self.status)
        assert tuning is not None
        return tuning

    def current(self) -> dict[str, Any] | None:
        current: dict[str, Any] | None = (self.status.get("tuning") or {}).get("current")
        return current

    def capacity(self) -> CapacityStatus:
        return CapacityStatus.model_validate(self.status["capacity"])

    def condition(self, type_: str) -> dict[str, Any]:
        found: list[dict[str, Any]] = [c for c in self.status.get("conditions") or [] if c["type"] == type_]
        assert len(found) == 1, f"condition {type_}: {found}"
        return found[0]

    def applies(self, since: int = 0) -> list[ScheduleKnobs]:
        return [t.actions.apply.knobs() for t in self.ticks[since:] if t.actions.apply is not None]

    def generations(self, since: int = 0) -> list[int]:
        """The schedule generation of each apply."""
        return [t.actions.apply.scheduleGeneration for t in self.ticks[since:] if t.actions.apply is not None]

    def events(self, since: int = 0) -> list[tuple[str, str]]:
        return [(kind, reason) for t in self.ticks[since:] for kind, reason, _ in t.actions.events]

    def answer(self, slo: dict[str, Any]) -> int:
        """The analytic optimum of a latency SLO: the largest batch in the plan's range that meets it at the load a
        trial puts on it (live traffic, or maxBatchSize - 1 users in benchmark mode)."""
        benchmark = self.isvc.spec.autotune.mode == "benchmark"
        return max(b for b in range(self.plan.maxBatchSize.min, self.plan.maxBatchSize.max + 1)
                   if self.engine.meets(slo, b, b - 1 if benchmark else None))


def settled(loop: Loop) -> bool:
    """Tuning over: a verdict, and no trial or capacity probe open."""
    return loop.tuning().phase != "Running" and loop.current() is None


def trial_open(number: int) -> Callable[[Loop], bool]:
    def done(loop: Loop) -> bool:
        current = loop.current()
        return current is not None and current["kind"] == "trial" and current["trial"] == number

    return done


def conclusive(history: list[TuningTrial]) -> list[TuningTrial]:
    return [e for e in history if e.outcome != "inconclusive"]


def hot(knobs: ScheduleKnobs) -> dict[str, Any]:
    return {k: getattr(knobs, k) for k in TUNED_KNOBS}


def plan_knobs(plan: Plan) -> dict[str, Any]:
    return {k: getattr(plan.schedule, k) for k in TUNED_KNOBS}


@pytest.fixture(scope="module")
def baseline() -> Loop:
    """An undisturbed decodeLatency run, to compare the disturbed ones with."""
    loop = Loop.start()
    loop.run_until(settled)
    return loop


# --- 1. a decodeLatency SLO converges ------------------------------------------------------------------------------


def test_decode_latency_converges_to_the_largest_batch_under_the_bound(baseline: Loop) -> None:
    loop = baseline
    t = loop.tuning()
    max_trials = loop.isvc.spec.autotune.maxTrials
    answer = loop.answer(DECODE_SLO)
    assert answer == 3000  # TPOT = 10 + 0.005 b <= 25
    assert t.phase == "Converged" and t.round == 1 and t.current is None
    assert 2 <= len(t.history) <= max_trials and t.trial == len(t.history)
    assert t.best is not None
    best = t.best.schedule.maxBatchSize
    assert best is not None and abs(best - answer) <= TOLERANCE * answer
    assert t.best.metrics is not None and t.best.metrics.tpotMs.mean <= DECODE_SLO["tpotMs"]
    assert t.verdict is not None and t.verdict.sloMet and t.verdict.maxBatchSize == best
    assert t.verdict.pooled is not None and t.verdict.pooled.tpotMs.mean <= DECODE_SLO["tpotMs"]
    assert t.verdict.trials and all(t.history[i].schedule == t.best.schedule for i in t.verdict.trials)
    assert t.best in t.history
    for entry in t.history:  # every trial measured and judged
        assert entry.metrics is not None and entry.outcome == "measured"
        assert entry.metrics.samples == loop.engine.samples and entry.verdict and entry.window
        assert entry.schedule.maxBatchSize is not None
        assert entry.metrics.tpotMs.mean == pytest.approx(loop.engine.tpot(entry.schedule.maxBatchSize))
        assert ("<= 25" in entry.verdict) == (entry.metrics.tpotMs.mean <= 25) == entry.sloMet
    # Conditions and phase.
    tuning, slo = loop.condition("Tuning"), loop.condition("SLOMet")
    assert (tuning["status"], tuning["reason"]) == ("False", "Converged")
    assert (slo["status"], slo["reason"]) == ("True", "SLOMet")
    assert loop.status["phase"] == "Ready"
    assert loop.status["schedule"]["maxBatchSize"] == best
    assert loop.status["schedule"] == t.best.schedule.model_dump(exclude_none=True)
    assert t.applied is not None and t.applied.knobs() == t.best.schedule
    assert ts.applied_schedule(loop.isvc, loop.plan, loop.status) == ts.with_knobs(loop.plan.schedule, t.best.schedule)
    assert loop.status["observed"]["samples"] == loop.engine.samples
    for tick in loop.ticks:  # Tuning while a trial is open, Ready after the verdict
        tuning_now = tick.actions.status["tuning"]
        running = tuning_now["phase"] == "Running" or tuning_now.get("current") is not None
        assert tick.actions.status["phase"] == ("Tuning" if running else "Ready")
    # Each trial's knobs were applied once, when it opened; then the best, unless the last trial was it.
    # A repeat of the trial before it applies nothing new.
    expected = [e.schedule for i, e in enumerate(t.history) if i == 0 or t.history[i - 1].schedule != e.schedule]
    if t.history[-1].schedule != t.best.schedule:
        expected.append(t.best.schedule)
    assert loop.applies() == expected
    assert loop.events().count(("Normal", "TrialStarted")) == len(t.history)
    assert loop.events().count(("Normal", "TrialMeasured")) == len(t.history)
    assert loop.events()[-1] == ("Normal", "TuningFinished")


def test_each_window_starts_a_quarter_window_after_the_apply_and_lasts_the_window(baseline: Loop) -> None:
    loop = baseline
    def opens(t: Tick) -> bool:  # a trial's window opens (a repeat of the trial before applies nothing new)
        now = t.actions.status["tuning"].get("current")
        return now is not None and (t.current is None or t.current["trial"] != now["trial"])

    opened = [(i, t) for i, t in enumerate(loop.ticks) if opens(t)]
    measured = [t for t in loop.ticks if t.due is not None]
    history = loop.tuning().history
    assert len(opened) == len(measured) == len(history)
    for (i, applied), reading, entry in zip(opened, measured, history, strict=True):
        current = applied.actions.status["tuning"]["current"]
        assert current["appliedAt"] == at.rfc3339(applied.now)
        assert reading.due is not None
        # It ends on the grid: the settling time grows by less than the grid's step.
        end = on_grid(applied.now + SETTLE_S + WINDOW_S)
        assert (reading.due.start, reading.due.end) == (end - WINDOW_S, end)
        assert SETTLE_S <= reading.due.start - applied.now < SETTLE_S + GRID_S
        assert reading.due.pods is None  # online: every engine pod
        assert entry.window == f"{at.rfc3339(reading.due.start)}/{at.rfc3339(reading.due.end)}"
        # Read at the first tick after the window closed; nothing was due before it.
        assert 0 <= reading.now - reading.due.end < TICK_S
        assert all(t.due is None for t in loop.ticks[i + 1:loop.ticks.index(reading)])


def test_advance_is_deterministic(baseline: Loop) -> None:
    """The same status and observation give the same actions: the whole state is in the status."""
    for tick in baseline.ticks[::7]:
        before = tick.actions.status  # the status after the tick: step once more from a copy, twice
        obs = tt.Observation(now=tick.now + TICK_S, pods=tuple(baseline.pods))
        first = at.advance(baseline.isvc, baseline.plan, copy.deepcopy(before), obs)
        second = at.advance(baseline.isvc, baseline.plan, copy.deepcopy(before), obs)
        assert first == second


# --- 2. Prometheus down mid-trial ----------------------------------------------------------------------------------


def test_prometheus_down_mid_trial_is_inconclusive_then_measured_again(baseline: Loop) -> None:
    loop = Loop.start()
    loop.run_until(trial_open(1))
    current = loop.current()
    assert current is not None
    schedule = ScheduleKnobs.model_validate(current["schedule"])
    loop.tick()
    loop.prometheus = False  # goes down while the trial settles
    loop.run_until(lambda lp: lp.ticks[-1].due is not None)
    tick = loop.ticks[-1]
    assert tick.measurement is not None and tick.measurement.unreachable
    t = loop.tuning()
    assert [e.outcome for e in t.history] == ["measured", "inconclusive"]
    assert t.history[1].reason == "PrometheusUnreachable"
    assert t.history[1].schedule == schedule and not t.history[1].metrics
    assert "Prometheus unreachable" in t.history[1].verdict
    assert t.trial == 1  # the inconclusive window is no trial
    assert t.current is not None and t.current.schedule == schedule
    tuning = loop.condition("Tuning")
    assert (tuning["status"], tuning["reason"]) == ("True", at.REASON_PROMETHEUS_DOWN)
    assert tick.actions.apply is None
    assert ("Warning", at.REASON_PROMETHEUS_DOWN) in loop.events(len(loop.ticks) - 1)
    assert loop.status["phase"] == "Tuning"
    # While Prometheus stays down: nothing is due, nothing applied or recorded, whatever the clock says.
    down = len(loop.ticks)
    for _ in range(30):
        loop.tick()
    assert all(t.due is None and t.actions.apply is None and not t.actions.events for t in loop.ticks[down:])
    assert loop.tuning().history == t.history
    # Back: the same schedule is measured in a new window that opens after now.
    loop.prometheus = True
    back = loop.now
    loop.tick()
    current = loop.current()
    assert current is not None and ScheduleKnobs.model_validate(current["schedule"]) == schedule
    # measured again: the window (and its settling) twice as long, as requests may outlast one window
    again = on_grid(back + 2 * (SETTLE_S + WINDOW_S))
    assert at.parse_rfc3339(current["measureFrom"]) == again - 2 * WINDOW_S
    assert at.parse_rfc3339(current["measureUntil"]) == again
    assert current.get("inconclusive") is None and current["attempts"] == 1
    assert loop.condition("Tuning")["reason"] == at.REASON_MEASURING
    assert loop.ticks[-1].actions.apply is None  # the engines already run it
    loop.run_until(lambda lp: lp.ticks[-1].due is not None)
    assert loop.ticks[-1].due == tt.WindowRequest(again - 2 * WINDOW_S, again, None)
    assert loop.tuning().history[2].schedule == schedule and loop.tuning().history[2].metrics
    # And the search goes on to the same answer, the inconclusive window left out of the trials.
    loop.run_until(settled)
    t, base = loop.tuning(), baseline.tuning()
    assert [e.schedule for e in conclusive(t.history)] == [e.schedule for e in base.history]
    assert t.best is not None and base.best is not None and t.best.schedule == base.best.schedule
    assert t.phase == "Converged" and t.trial == len(t.history) - 1 == len(base.history)
    assert loop.condition("Tuning")["reason"] == "Converged"


@pytest.mark.parametrize("mode", ["online", "benchmark"])
def test_a_window_without_requests_is_measured_again_at_once(mode: str) -> None:
    loop = Loop.start(mode=mode)
    loop.tick()
    first = loop.current()
    assert first is not None
    for attempt in (1, 2):  # twice in a row: recorded once
        loop.tick_until_due()
        loop.tick(tt.Measurement(inconclusive="no request finished in the window", reason="NoRequestFinished"))
        t = loop.tuning()
        assert [(e.outcome, e.reason, e.verdict) for e in t.history] == [
            ("inconclusive", "NoRequestFinished", "no request finished in the window")]
        assert t.current is not None and t.current.attempts == attempt and t.trial == 0
        assert t.current.schedule.maxBatchSize == first["schedule"]["maxBatchSize"]
        stretch = 1 + attempt  # each window measured again is longer: x2, x3, ...
        until = on_grid(loop.ticks[-1].now + stretch * (SETTLE_S + WINDOW_S))
        assert at.parse_rfc3339(t.current.measureFrom) == until - stretch * WINDOW_S
        assert at.parse_rfc3339(t.current.measureUntil) == until
        assert loop.condition("Tuning")["reason"] == at.REASON_NO_TRAFFIC
        actions = loop.ticks[-1].actions
        assert actions.apply is None
        if mode == "benchmark":  # a new Job for the new window, the last one deleted
            assert actions.create_job is not None and actions.delete_job is not None and t.current.job is not None
            assert actions.create_job["metadata"]["name"] == t.current.job != actions.delete_job
            assert t.current.attempts == attempt  # a new name for each window (the start time's last digits)
    loop.run_until(settled)
    assert len(conclusive(loop.tuning().history)) == len(loop.tuning().history) - 1


# --- 3 and 4. a pod restarting, or a failing trial, rolls back -----------------------------------------------------


def expected_rollback(loop: Loop, trial: int) -> dict[str, Any]:
    """The best known schedule when `trial` fails: the plan's with nothing measured, else the largest batch
    measured meeting the SLO."""
    if trial == 0:
        return plan_knobs(loop.plan)
    meeting = [e for e in loop.tuning().history if e.metrics and e.metrics.tpotMs.mean <= DECODE_SLO["tpotMs"]]
    return hot(max(meeting, key=lambda e: e.schedule.maxBatchSize or 0).schedule)


def check_rolled_back(loop: Loop, failed_batch: int, rollback: dict[str, Any], why: str) -> None:
    t = loop.tuning()
    tick = loop.ticks[-1]
    last = t.history[-1]
    assert last.outcome == "failed" and why in last.verdict, last.verdict
    assert last.schedule.maxBatchSize == failed_batch
    assert t.current is None
    assert tick.actions.apply is not None and hot(tick.actions.apply) == rollback
    assert t.applied == tick.actions.apply
    assert ("Warning", at.REASON_ROLLED_BACK) in loop.events(len(loop.ticks) - 1)
    tuning = loop.condition("Tuning")
    assert (tuning["status"], tuning["reason"]) == ("True", at.REASON_ROLLED_BACK)
    # The search goes on below the failed batch, and the verdict too.
    n = len(t.history)
    loop.run_until(settled)
    t = loop.tuning()
    assert len(t.history) > n
    assert all((e.schedule.maxBatchSize or 0) < failed_batch for e in t.history[n:])
    # Converged, or out of trials (the failure spent one): either way the best lies below it and meets the SLO.
    assert t.phase in ("Converged", "Stopped") and t.best is not None
    assert (t.best.schedule.maxBatchSize or 0) < failed_batch
    assert loop.condition("SLOMet")["status"] == "True" and loop.condition("Tuning")["status"] == "False"
    assert hot(loop.applies()[-1]) == hot(t.best.schedule) == hot(t.applied or ScheduleKnobs())


# Trial 0 (the plan's 2048) fails with nothing measured; trial 3 after 2048 and 2965 met the SLO and 3473 missed it.
@pytest.mark.parametrize("trial", [0, 3])
@pytest.mark.parametrize("how", ["restarts", "uid", "unready"])
def test_an_engine_pod_restarting_mid_trial_fails_it_and_rolls_back(trial: int, how: str) -> None:
    loop = Loop.start(replicas=2)
    loop.run_until(trial_open(trial))
    for _ in range(5):  # into the measured window
        loop.tick()
    current = loop.current()
    assert current is not None and current["trial"] == trial
    rollback = expected_rollback(loop, trial)
    pod = loop.pods[0]
    loop.pods[0] = (replace(pod, restarts=pod.restarts + 1) if how == "restarts" else
                    replace(pod, uid="uid-new") if how == "uid" else replace(pod, ready=False))
    loop.tick()
    assert loop.ticks[-1].due is None  # before its window closed
    if how == "unready":
        loop.pods[0] = pod
    check_rolled_back(loop, current["schedule"]["maxBatchSize"],
                      rollback, "stopped being ready" if how == "unready" else "restarted")
    entry = loop.tuning().history[trial]
    assert entry.metrics is None
    assert entry.reason == {"restarts": "EngineRestarted", "uid": "EngineRestarted", "unready": "EngineNotReady"}[how]


@pytest.mark.parametrize("trial", [0, 3])
def test_a_trial_with_errors_rolls_back_at_once(trial: int) -> None:
    loop = Loop.start()
    loop.run_until(trial_open(trial))
    current = loop.current()
    assert current is not None
    rollback = expected_rollback(loop, trial)
    loop.error_rate = 0.5
    loop.run_until(lambda lp: lp.ticks[-1].due is not None)
    loop.error_rate = 0.0
    last = loop.tuning().history[-1]
    assert "error rate 50.0%" in last.verdict and (last.outcome, last.reason) == ("failed", "ErrorRate")
    assert last.failing == ["errorRate"] and last.metrics is not None and last.metrics.errorRate == 0.5
    assert ("Warning", "TrialMeasured") in loop.events(len(loop.ticks) - 1)
    check_rolled_back(loop, current["schedule"]["maxBatchSize"], rollback, "error rate")


def test_every_applied_schedule_is_one_put_admin_schedule_accepts() -> None:
    loop = Loop.start()
    loop.run_until(trial_open(0))
    loop.error_rate = 0.5  # the plan's own batch fails: back to the plan's schedule
    loop.run_until(lambda lp: lp.ticks[-1].due is not None)
    loop.error_rate = 0.0
    loop.run_until(settled)
    for tick in loop.ticks:
        if tick.actions.apply is not None:  # the PUT body: hot fields and the generation
            assert set(tick.actions.apply.model_dump(exclude_none=True)) <= HOT_SCHEDULE_FIELDS | {
                SCHEDULE_GENERATION_KEY}


def test_a_window_whose_pods_did_not_run_the_trials_generation_throughout_is_discarded() -> None:
    """The engines' generation gauge over the window: a pod that ran another schedule generation at some sample
    (or none reported one) makes the window inconclusive (ScheduleNotRun); the trial is put on the engines again at a
    new generation and measured again, and a window run at that generation throughout is measured."""
    loop = Loop.start(replicas=2)
    loop.tick()
    t = loop.tuning()
    assert t.applied is not None and t.current is not None
    # metadata.generation 1: the plan's own schedule is at generation 0 + 1, the tuner's first at 2.
    assert t.applied.scheduleGeneration == 2 and loop.generations() == [2]
    metrics = loop.engine.metrics(t.current.schedule.maxBatchSize or 0, None, 0.0, 10.0)
    stale = tt.GenerationsRun(lowest=1, highest=2, pods=2)  # one pod ran generation 1 during the window
    for attempt, ran in enumerate((stale, tt.GenerationsRun(lowest=None, highest=None, pods=0)), start=1):
        loop.tick_until_due()
        loop.tick(tt.Measurement(metrics=metrics, generations=ran))
        t = loop.tuning()
        assert [(e.outcome, e.reason) for e in t.history][-1] == ("inconclusive", "ScheduleNotRun")
        assert t.current is not None and t.current.attempts == attempt and t.trial == 0
        assert loop.condition("Tuning")["reason"] == at.REASON_SCHEDULE_NOT_RUN == "ScheduleNotRun"
        apply = loop.ticks[-1].actions.apply  # the same knobs again, at a newer generation
        assert apply is not None and apply.knobs() == t.current.schedule
    assert loop.generations() == [2, 4, 6]
    t = loop.tuning()  # one entry for the cause while the trial stays open; the message says the last window's
    assert [e.verdict for e in t.history] == [
        "the measured engines ran schedule generations 1 to 2 in the window, not the trial's 2 throughout"]
    assert t.message == ("trial 1: no engine reported its schedule generation in the window (the trial's is 4); "
                         "measuring again (attempt 3)")
    loop.tick_until_due()
    loop.tick(tt.Measurement(metrics=metrics, generations=tt.GenerationsRun(lowest=6, highest=6, pods=2)))
    t = loop.tuning()
    assert [(e.outcome, e.reason) for e in t.history][-1] == ("measured", None)
    assert loop.generations() == [2, 4, 6]  # the next trial measures the same knobs again: nothing new applied


def test_a_newer_generation_than_the_trials_is_not_the_trial_either() -> None:
    loop = Loop.start()
    loop.tick()
    t = loop.tuning()
    assert t.current is not None and t.applied is not None and t.applied.scheduleGeneration == 2
    metrics = loop.engine.metrics(t.current.schedule.maxBatchSize or 0, None, 0.0, 10.0)
    loop.tick_until_due()
    loop.tick(tt.Measurement(metrics=metrics, generations=tt.GenerationsRun(lowest=2, highest=3, pods=1)))
    assert [(e.outcome, e.reason) for e in loop.tuning().history] == [("inconclusive", "ScheduleNotRun")]


# --- 5. benchmark mode ---------------------------------------------------------------------------------------------


def bench_command(job: dict[str, Any]) -> list[str]:
    assert (job["apiVersion"], job["kind"]) == ("batch/v1", "Job")
    containers = job["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    command: list[str] = containers[0]["command"]
    return command


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_benchmark_mode_loads_one_pod_with_a_job_per_trial() -> None:
    loop = Loop.start(mode="benchmark", replicas=2)
    target = min(loop.pods, key=lambda p: p.name)
    assert loop.pods[0] != target  # listed second
    loop.run_until(settled)
    t = loop.tuning()
    created = [(i, tick) for i, tick in enumerate(loop.ticks) if tick.actions.create_job is not None]
    measured = [tick for tick in loop.ticks if tick.due is not None]
    assert len(created) == len(measured) == len(t.history) >= 2
    previous: str | None = None
    for (_, opened), reading, entry in zip(created, measured, t.history, strict=True):
        job = opened.actions.create_job
        assert job is not None
        current = opened.actions.status["tuning"]["current"]
        name = job["metadata"]["name"]
        assert current["job"] == name and current["target"] == target.name
        assert re.fullmatch(rf"tiny-b1t{entry.trial}-\d{{5}}", name), name
        command = bench_command(job)
        assert command[:2] == ["npuserve", "bench"]
        batch = entry.schedule.maxBatchSize
        assert batch is not None and current["concurrency"] == batch - 1
        assert flag(command, "--max-concurrency") == str(batch - 1)
        # the Job runs until the window's end (on the grid) and a little more
        until = at.parse_rfc3339(current["measureUntil"])
        assert flag(command, "--duration") == f"{until - opened.now + ts.JOB_SLACK_S:g}"
        assert SETTLE_S + WINDOW_S <= until - opened.now < SETTLE_S + WINDOW_S + GRID_S
        assert flag(command, "--base-url") == f"http://{target.ip}:{ENGINE_PORT}"
        assert opened.actions.delete_job == previous  # the last trial's Job goes when the next opens
        assert reading.due is not None and reading.due.pods == (target.name,)
        # Measured at the guide's client concurrency: TPOT with maxBatchSize - 1 requests running.
        assert entry.metrics is not None
        assert entry.metrics.tpotMs.mean == pytest.approx(loop.engine.tpot(batch, batch - 1))
        if reading is measured[-1]:
            assert reading.actions.delete_job == name  # the last one goes with the verdict
        previous = name
    assert all(tick.actions.create_job is None for tick in loop.ticks[created[-1][0] + 1:])
    best = t.best
    assert best is not None and best.schedule.maxBatchSize is not None
    answer = loop.answer(DECODE_SLO)
    assert answer == 3001  # TPOT at 3000 users
    assert abs(best.schedule.maxBatchSize - answer) <= TOLERANCE * answer


def test_benchmark_a_failed_job_fails_the_trial() -> None:
    loop = Loop.start(mode="benchmark")
    loop.run_until(trial_open(3))
    current = loop.current()
    assert current is not None
    rollback = expected_rollback(loop, 3)
    loop.tick()
    loop.job = "failed"
    loop.tick()
    loop.job = "active"
    assert loop.ticks[-1].actions.delete_job == current["job"]
    check_rolled_back(loop, current["schedule"]["maxBatchSize"], rollback, f"Job {current['job']} failed")


# --- 6. capacity ---------------------------------------------------------------------------------------------------


def capacity_loop(*, replica_limit: int | None = None, mode: str = "benchmark", replicas: int = 1,
                  **capacity: Any) -> Loop:
    loop = Loop.start(CAPACITY_SLO, mode=mode, replicas=replicas,
                      capacity={"targetConcurrentUsers": 20000, **capacity})
    loop.replica_limit = replica_limit
    loop.run_until(lambda lp: bool(lp.status.get("capacity")) and lp.capacity().phase in ("Measured", "Failed")
                   and lp.current() is None)
    return loop


@pytest.fixture(scope="module")
def measured_capacity() -> Loop:
    return capacity_loop()


def test_capacity_probes_double_then_bisect_to_what_one_instance_holds(measured_capacity: Loop) -> None:
    loop = measured_capacity
    t, cap = loop.tuning(), loop.capacity()
    assert t.phase == "Converged" and t.best is not None
    batch = t.best.schedule.maxBatchSize
    assert batch == loop.plan.maxBatchSize.max == 4096  # both bounds met at the range maximum
    holds = max(c for c in range(1, 3 * batch) if loop.engine.meets(CAPACITY_SLO, batch, c))
    assert holds == 6176  # 4096 + (1500 - 459.6) / 0.5
    assert cap.phase == "Measured" and cap.measuredConcurrencyPerReplica is not None
    assert holds * (1 - capacity.CAPACITY_TOLERANCE) <= cap.measuredConcurrencyPerReplica <= holds
    # beside it, the model's figure: none on the host CPU (no datasheet figures; its profile is fitted on a machine),
    # and the status says why instead of failing the measurement
    assert cap.modelConcurrencyPerReplica is None and "accelerator 'cpu' has no datasheet" in cap.modelSource
    # The probes: the best trial's load (a known pass), then doubling, then bisection, as next_capacity_probe says.
    probes = [(p.concurrency, p.passed) for p in cap.probes]
    assert probes[0] == (batch - 1, True)
    assert probes[1][0] == 2 * (batch - 1)
    for i in range(1, len(probes)):
        assert probes[i][0] == capacity.next_capacity_probe(dict(probes[:i]), capacity.CAPACITY_LIMIT_FACTOR * batch)
        assert probes[i][1] == loop.engine.meets(CAPACITY_SLO, batch, probes[i][0])
    assert capacity.next_capacity_probe(dict(probes), capacity.CAPACITY_LIMIT_FACTOR * batch) is None
    assert cap.measuredConcurrencyPerReplica == max(c for c, ok in probes if ok)
    # Each probe was a window of kind 'capacity' with its own Job at its concurrency, against the one pod.
    windows = [tick for tick in loop.ticks
               if tick.due is not None and tick.current is not None and tick.current["kind"] == "capacity"]
    assert [w.current["concurrency"] for w in windows if w.current] == [c for c, _ in probes[1:]]
    jobs = [tick.actions.create_job for tick in loop.ticks if tick.actions.create_job is not None]
    probe_jobs = [j for j in jobs if re.fullmatch(r"tiny-b\d+c\d+-\d{5}", j["metadata"]["name"])]
    assert [int(flag(bench_command(j), "--max-concurrency")) for j in probe_jobs] == [c for c, _ in probes[1:]]
    assert all(w.due is not None and w.due.pods == (loop.pods[0].name,) for w in windows)
    # Probes neither retune nor reapply: the tuned schedule stays.
    assert all(tick.actions.apply is None for tick in windows)
    # Scaled to hold the target, beside the plan's static estimate.
    want = math.ceil(20000 / cap.measuredConcurrencyPerReplica)
    assert cap.replicas == want and cap.bound is None
    assert [tick.actions.scale for tick in loop.ticks if tick.actions.scale is not None] == [want]
    assert cap.staticConcurrencyPerReplica == loop.plan.concurrencyPerReplica
    assert cap.staticReplicas == math.ceil(20000 / loop.plan.concurrencyPerReplica)
    assert cap.targetConcurrentUsers == 20000
    assert str(cap.staticReplicas) in cap.message and str(want) in cap.message
    assert ("Normal", "Scaled") in loop.events()
    assert loop.status["phase"] == "Ready"


@pytest.mark.parametrize(("replicas", "bounds", "replica_limit", "expected", "bound"), [
    (1, {"maxReplicas": 3}, None, 3, "spec.capacity.maxReplicas (3)"),
    (1, {}, 2, 2, "accelerators hold 2"),
    (1, {"maxReplicas": 3}, 2, 2, "accelerators hold 2"),
    (1, {"maxReplicas": 5}, 9, 4, None),
    (7, {"minReplicas": 6, "maxReplicas": 9}, None, 6, "spec.capacity.minReplicas (6)"),
    (4, {}, None, 4, None),  # as it is: nothing to scale
])
def test_capacity_scaling_is_bounded(replicas: int, bounds: dict[str, Any], replica_limit: int | None,
                                     expected: int, bound: str | None) -> None:
    loop = capacity_loop(replica_limit=replica_limit, replicas=replicas, **bounds)
    cap = loop.capacity()
    assert cap.phase == "Measured" and cap.measuredConcurrencyPerReplica is not None
    assert math.ceil(20000 / cap.measuredConcurrencyPerReplica) == 4
    scaled = [tick.actions.scale for tick in loop.ticks if tick.actions.scale is not None]
    assert scaled == ([] if expected == replicas else [expected])
    assert cap.replicas == expected
    assert cap.bound == bound if bound is None else cap.bound is not None and bound in cap.bound


def test_capacity_online_derives_from_the_best_trials_requests_in_flight() -> None:
    loop = capacity_loop(mode="online")
    t, cap = loop.tuning(), loop.capacity()
    assert t.best is not None and t.best.schedule.maxBatchSize is not None
    per_pod = loop.engine.in_flight(t.best.schedule.maxBatchSize)
    assert t.best.metrics is not None and t.best.metrics.inFlightPerPod == per_pod
    assert cap.phase == "Measured" and cap.measuredConcurrencyPerReplica == math.floor(per_pod)
    assert cap.method.startswith("online") and not cap.probes
    assert all(tick.current is None or tick.current["kind"] == "trial" for tick in loop.ticks)
    assert [tick.actions.scale for tick in loop.ticks if tick.actions.scale is not None] == [
        math.ceil(20000 / math.floor(per_pod))]


def test_capacity_without_a_ttft_bound_probes_no_further_than_the_batch() -> None:
    """Users beyond maxBatchSize only queue, which TPOT does not see: without a TTFT bound the search stops at the
    batch."""
    loop = Loop.start(DECODE_SLO, mode="benchmark", capacity={"targetConcurrentUsers": 20000})
    loop.run_until(lambda lp: bool(lp.status.get("capacity")) and lp.capacity().phase == "Measured")
    t, cap = loop.tuning(), loop.capacity()
    assert t.best is not None and t.best.schedule.maxBatchSize is not None
    batch = t.best.schedule.maxBatchSize
    assert [p.concurrency for p in cap.probes] == [batch - 1, batch]
    assert cap.measuredConcurrencyPerReplica == (batch if loop.engine.meets(DECODE_SLO, batch, batch) else batch - 1)


def test_the_model_figure_prices_the_verdicts_own_schedule() -> None:
    """firstTokenAndDecode chooses supportSelectBatch too: the model's figure beside the measured capacity runs the
    verdict's knobs (here decode first, which the plan's rule would turn off), not the plan's rule at its batch."""
    from types import SimpleNamespace

    from npuserve.planning.api import SLOSpec, TuningVerdict
    from npuserve.planning.problem import TuningProblem
    from npuserve.sim.capacity import model_concurrency, preset_spec

    slo = SLOSpec(objective="firstTokenAndDecode", ttftMs=8000, tpotMs=50)
    spec = preset_spec("llama3-8b", 186, 346).model_copy(update={"slo": slo})
    planned = plan_spec(spec)
    problem = TuningProblem.from_plan(planned, slo)
    rule = problem.schedule_for(140)
    assert rule.supportSelectBatch is False
    chosen = rule.model_copy(update={"supportSelectBatch": True})
    window = TrialMetrics(outputTokensPerSecond=2500.0, ttftMs=LatencyStats(mean=1300, p90=1500, p99=1700),
                          tpotMs=LatencyStats(mean=49.0, p90=55, p99=60), samples=500)
    tuning = TuningStatus(history=[TuningTrial(trial=0, schedule=ScheduleKnobs(**chosen.model_dump()),
                                               outcome="measured", metrics=window)],
                          verdict=TuningVerdict(reason="converged", sloMet=True, maxBatchSize=140, trials=[0]))
    host = SimpleNamespace(isvc=SimpleNamespace(spec=spec), plan=planned, tuning=tuning, problem=problem)
    figure = capacity.model_figure(host, 140)  # type: ignore[arg-type]
    assert figure == model_concurrency(spec, planned, slo, problem.full_schedule(chosen))
    # and the plan's rule at that batch is another figure: the test would see the knob dropped
    assert figure[0] != model_concurrency(spec, planned, slo, problem.full_schedule(rule))[0]


def test_a_pod_restarting_during_a_capacity_probe_discards_it_and_probes_again() -> None:
    loop = Loop.start(CAPACITY_SLO, mode="benchmark", capacity={"targetConcurrentUsers": 20000})
    loop.run_until(lambda lp: (lp.current() or {}).get("kind") == "capacity")
    probe = loop.current()
    assert probe is not None
    applied = loop.tuning().applied
    trials = len(loop.tuning().history)
    pod = loop.pods[0]
    loop.pods[0] = replace(pod, restarts=1)
    loop.tick()
    actions = loop.ticks[-1].actions
    assert actions.apply is None and actions.delete_job == probe["job"]  # the tuned schedule stays: no rollback
    assert ("Warning", "CapacityProbeDiscarded") in loop.events(len(loop.ticks) - 1)
    assert loop.current() is None and len(loop.capacity().probes) == 1 and loop.tuning().phase == "Converged"
    assert len(loop.tuning().history) == trials  # no trial recorded
    loop.tick()
    again = loop.current()
    assert again is not None and again["kind"] == "capacity" and again["concurrency"] == probe["concurrency"]
    loop.run_until(lambda lp: lp.capacity().phase == "Measured")
    assert loop.tuning().applied == applied


def test_capacity_probes_leave_the_tuning_verdict_alone(measured_capacity: Loop) -> None:
    loop = measured_capacity
    history = loop.tuning().history
    probing = [t for t in loop.ticks if t.actions.status["tuning"].get("current", {}).get("kind") == "capacity"]
    assert probing
    for tick in probing:  # while the probes run, and after: the tuning's verdict stays on its condition
        assert [(c["status"], c["reason"]) for c in tick.actions.status["conditions"] if c["type"] == "Tuning"] == [
            ("False", "Converged")]
        assert tick.actions.status["phase"] == "Tuning"
    tuning = loop.condition("Tuning")
    assert (tuning["status"], tuning["reason"]) == ("False", "Converged")
    assert loop.tuning().message.startswith("converged")
    assert loop.events().count(("Normal", "TrialStarted")) == len(history)
    assert loop.events().count(("Normal", "CapacityProbe")) == len(loop.capacity().probes) - 1


# --- 7. a new round when the SLO is missed -------------------------------------------------------------------------


def test_missed_windows_start_a_new_round_only_after_the_cool_down() -> None:
    loop = Loop.start(max_trials=20)  # cool-down 20 x 20 s = 400 s, longer than the first round
    loop.run_until(settled)
    first = loop.tuning()
    assert first.best is not None and first.roundStartedAt is not None
    best = first.best.schedule
    started = at.parse_rfc3339(first.roundStartedAt)
    cool_down = WINDOW_S * 20
    assert loop.now - started < cool_down - 4 * WINDOW_S
    # The SLO holds in the windows after the verdict...
    mark = len(loop.ticks)
    loop.run_until(lambda lp: sum(t.due is not None for t in lp.ticks[mark:]) == 2)
    assert loop.tuning().missedWindows == 0 and loop.condition("SLOMet")["status"] == "True"
    assert [t.due.end - t.due.start for t in loop.ticks[mark:] if t.due is not None] == [WINDOW_S, WINDOW_S]
    # ...then traffic changes: every window misses it.
    loop.engine = replace(loop.engine, tpot0=20.0)
    mark = len(loop.ticks)
    loop.run_until(lambda lp: lp.tuning().missedWindows == at.MISSED_WINDOWS)
    assert loop.now - started < cool_down
    t = loop.tuning()
    assert (t.round, t.phase) == (1, "Converged") and loop.current() is None
    assert (loop.condition("SLOMet")["status"], loop.condition("SLOMet")["reason"]) == ("False", "SLOMissed")
    assert ("Normal", "TuningRestarted") not in loop.events(mark)
    assert loop.applies(mark) == [] and loop.status["phase"] == "Ready"
    # The next window past the cool-down starts round 2, from the best batch. That window measured the new traffic
    # at the best schedule, which is what round 2's first trial would measure again: it is round 2's trial 0 (online
    # mode), and the first window round 2 opens is already the tuner's next move below it.
    loop.run_until(lambda lp: lp.tuning().round == 2)
    restart = loop.ticks[-1]
    assert restart.now - started >= cool_down
    assert all(t.now - started < cool_down for t in loop.ticks[mark:-1] if t.due is not None)
    t = loop.tuning()
    assert t.phase == "Running" and t.roundStartedAt == at.rfc3339(restart.now) and t.missedWindows == 0
    assert restart.due is not None and restart.measurement is not None
    [seed] = t.history
    assert (seed.trial, seed.schedule, seed.outcome, seed.sloMet) == (0, best, "measured", False)
    # Round 1's last measured windows go with it, for round 2's engine model to read.
    assert t.earlier == [e for e in first.history if e.outcome == "measured"][-EARLIER_WINDOWS:]
    assert t.earlier and len(t.earlier) <= EARLIER_WINDOWS
    assert seed.metrics == restart.measurement.metrics and seed.failing == ["tpotMs.mean"]
    assert seed.window == f"{at.rfc3339(restart.due.start)}/{at.rfc3339(restart.due.end)}"
    assert t.current is not None and t.current.trial == 1
    assert t.current.schedule.maxBatchSize is not None and best.maxBatchSize is not None
    assert t.current.schedule.maxBatchSize < best.maxBatchSize
    assert ("Normal", "TuningRestarted") in loop.events(len(loop.ticks) - 1)
    assert loop.status["phase"] == "Tuning"
    # Round 2 settles lower: TPOT is 10 ms higher now, so 25 ms holds 1000 requests.
    loop.run_until(settled)
    t = loop.tuning()
    assert t.round == 2 and t.best is not None and t.best.schedule.maxBatchSize is not None
    assert abs(t.best.schedule.maxBatchSize - 1000) <= TOLERANCE * 1000 + 1
    assert len(t.history) <= 20 and t.history[0].schedule == best


def test_in_benchmark_mode_a_new_round_measures_the_best_batch_again() -> None:
    # The windows after tuning measure live traffic; benchmark mode's trials measure its Job's load. The window that
    # starts the round is not one of them: round 2 opens with the best batch, under the Job.
    loop = Loop.start(max_trials=8, mode="benchmark")
    loop.run_until(settled)
    first = loop.tuning()
    assert first.best is not None
    best = first.best.schedule
    loop.engine = replace(loop.engine, tpot0=20.0)
    loop.run_until(lambda lp: lp.tuning().round == 2)
    t = loop.tuning()
    assert t.history == [] and t.current is not None and t.current.trial == 0 and t.current.schedule == best


def test_it_takes_missed_windows_in_a_row_to_start_a_new_round() -> None:
    loop = Loop.start()  # maxTrials 8: the cool-down (160 s) is over when the first round ends
    loop.run_until(settled)
    started = at.parse_rfc3339(loop.tuning().roundStartedAt or "")
    assert loop.now - started >= WINDOW_S * 8
    loop.engine = replace(loop.engine, tpot0=20.0)
    for missed in range(1, at.MISSED_WINDOWS):
        loop.run_until(lambda lp: lp.ticks[-1].due is not None)
        assert (loop.tuning().round, loop.tuning().missedWindows) == (1, missed)
    loop.run_until(lambda lp: lp.ticks[-1].due is not None)
    assert loop.tuning().round == 2 and loop.current() is not None


def test_a_window_meeting_the_slo_resets_the_missed_count() -> None:
    loop = Loop.start(max_trials=20)
    loop.run_until(settled)
    fast = loop.engine
    loop.engine = replace(fast, tpot0=20.0)
    loop.run_until(lambda lp: lp.tuning().missedWindows == at.MISSED_WINDOWS - 1)
    loop.engine = fast
    loop.run_until(lambda lp: lp.ticks[-1].due is not None)
    assert loop.tuning().missedWindows == 0 and loop.condition("SLOMet")["status"] == "True"


def test_a_window_meeting_the_slo_after_a_verdict_that_could_not_show_it_leaves_slo_met_false() -> None:
    """SLOMet=True says the schedule meets the SLO beyond the noise: one live window that meets it after a round
    that did not show it (out of trials above an SLO no batch meets; in the e2e, on a noisy machine) is not that
    proof."""
    loop = Loop.start({"objective": "decodeLatency", "tpotMs": 9.0})  # batch 1 runs at 10.005 ms
    loop.run_until(settled)
    verdict = loop.tuning().verdict
    assert verdict is not None and verdict.sloMet is False, verdict
    assert (loop.condition("SLOMet")["status"], loop.condition("SLOMet")["reason"]) == ("False", "SLOMissed")
    loop.engine = replace(loop.engine, tpot0=5.0)  # the live windows now meet it
    loop.run_until(lambda lp: lp.ticks[-1].due is not None)
    assert loop.status["observed"]["sloMet"] is True
    found = loop.condition("SLOMet")
    assert (found["status"], found["reason"]) == ("False", "SLOMissed"), found
    assert "the last window met the SLO as measured" in found["message"]


# --- the printer columns -------------------------------------------------------------------------------------------


def column(status: dict[str, Any], name: str) -> Any:
    """What `kubectl get` shows in the printer column `name` (a plain .status path) for this status."""
    path = next(c["jsonPath"] for c in PRINTER_COLUMNS if c["name"] == name)
    assert re.fullmatch(r"\.status(\.\w+)+", path), path
    value: Any = {"status": status}
    for part in path.strip(".").split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def test_the_printer_columns_show_one_windows_figures_beside_its_own_max_batch_size() -> None:
    """While tuning, the schedule applied now is the next trial's, with no figures yet: the columns show the last
    window measured, its own maxBatchSize with its TTFT, TPOT and tok/s, rounded as people read them."""
    loop = Loop.start()

    def another_batch_open(lp: Loop) -> bool:  # a trial at a new batch applied, its window not measured yet
        current, history = lp.current(), conclusive(lp.tuning().history)
        return current is not None and bool(history) and \
            current["schedule"]["maxBatchSize"] != history[-1].schedule.maxBatchSize

    loop.run_until(another_batch_open)
    t, stat = loop.tuning(), loop.isvc.spec.slo.statistic
    measured = conclusive(t.history)[-1]
    assert t.current is not None and measured.metrics is not None
    assert column(loop.status, "Applied") == t.current.schedule.maxBatchSize

    def shows(batch: int | None, metrics: TrialMetrics) -> None:
        figures = {name: column(loop.status, name) for name in ("MaxBatchSize", "TTFT", "TPOT", "Tok/s")}
        assert figures == {"MaxBatchSize": batch, "TTFT": round(metrics.ttftMs.of(stat)),
                           "TPOT": round(metrics.tpotMs.of(stat)), "Tok/s": round(metrics.outputTokensPerSecond)}
        assert all(isinstance(v, int) for v in figures.values()), figures  # whole ms (>= 10 ms here) and tok/s

    shows(measured.schedule.maxBatchSize, measured.metrics)
    loop.run_until(settled)  # after tuning: each window at the applied schedule
    loop.tick_until_due()
    loop.tick()
    window = loop.ticks[-1].measurement
    applied = loop.tuning().applied
    assert window is not None and window.metrics is not None and applied is not None
    shows(applied.maxBatchSize, window.metrics)


def test_milliseconds_are_shown_whole_and_with_one_decimal_under_ten() -> None:
    assert (at.readable_ms(61.4), at.readable_ms(1234.5678), at.readable_ms(9.96), at.readable_ms(2.64)) == (
        61, 1235, 10.0, 2.6)


# --- 8. a spec change that changes the problem ---------------------------------------------------------------------


def test_a_new_slo_resets_the_tuning_and_the_configmap_schedule(baseline: Loop) -> None:
    old = baseline
    before = copy.deepcopy(old.status)
    tuned = old.tuning().best
    assert tuned is not None
    isvc = make_isvc({"objective": "decodeLatency", "tpotMs": 30})
    plan = plan_spec(isvc.spec)
    # The ConfigMap: the tuned schedule belongs to the old problem only.
    assert ts.applied_schedule(old.isvc, old.plan, before) == ts.with_knobs(old.plan.schedule, tuned.schedule)
    assert ts.applied_schedule(isvc, plan, before) is None
    loop = Loop(isvc, plan, old.engine, before, list(old.pods), now=old.now)
    loop.tick()
    t = loop.tuning()
    assert t.round == 2 and t.phase == "Running" and t.best is None and t.history == []
    assert t.problem != old.tuning().problem
    assert t.roundStartedAt == at.rfc3339(loop.ticks[-1].now)
    assert t.current is not None and t.current.schedule.maxBatchSize == plan.schedule.maxBatchSize
    apply = loop.ticks[-1].actions.apply
    assert apply is not None and apply.knobs() == t.current.schedule  # the new round's first trial, the plan's batch
    assert loop.condition("Tuning")["reason"] == at.REASON_MEASURING and loop.status["phase"] == "Tuning"
    assert ts.applied_schedule(old.isvc, old.plan, loop.status) is None  # and the old problem's no longer
    loop.run_until(settled)
    best = loop.tuning().best
    assert best is not None and best.schedule.maxBatchSize is not None
    assert abs(best.schedule.maxBatchSize - 4000) <= TOLERANCE * 4000  # TPOT = 10 + 0.005 b <= 30


def test_a_new_problem_with_the_same_knobs_is_a_new_schedule_generation_past_the_plans() -> None:
    """A spec change that moves the SLO makes reconcile put the plan's schedule into the ConfigMap at a generation
    past the tuner's (`plan_generation`), and the engines may take it. The new problem's first trial has the knobs
    already applied, and still goes to the engines at a new generation past that one: at the old generation the
    engines would refuse it (409, they run a newer one) and its first window would be discarded as ScheduleNotRun."""
    loop = Loop.start()
    loop.tick()  # the first problem's first trial: the plan's batch, at generation 2
    first = loop.tuning().applied
    assert first is not None and first.scheduleGeneration == 2
    loop.isvc = make_isvc({"objective": "decodeLatency", "tpotMs": 30})
    loop.isvc.metadata.generation = 2  # the spec change
    assert plan_spec(loop.isvc.spec) == loop.plan  # the same plan: the same first trial
    held, held_generation = ts.configmap_schedule(loop.isvc, loop.plan, loop.status)  # reconcile, before the look
    assert held is None and held_generation == 2 + 2  # the plan's schedule, past the tuner's generation 2
    loop.tick()
    t = loop.tuning()
    assert t.round == 2 and t.current is not None and t.current.schedule == first.knobs()  # unchanged knobs
    apply = loop.ticks[-1].actions.apply
    assert apply is not None and apply.knobs() == first.knobs()
    assert t.applied is not None and apply.scheduleGeneration == t.applied.scheduleGeneration == held_generation + 1
    assert ts.configmap_schedule(loop.isvc, loop.plan, loop.status)[1] == apply.scheduleGeneration
    # Engines that ran the ConfigMap's generation and then took the PUT measure the trial at its generation.
    loop.tick_until_due()
    metrics = loop.engine.metrics(t.current.schedule.maxBatchSize or 0, None, 0.0, 10.0)
    ran = tt.GenerationsRun(lowest=apply.scheduleGeneration, highest=apply.scheduleGeneration, pods=1)
    loop.tick(tt.Measurement(metrics=metrics, generations=ran))
    assert [(e.outcome, e.reason) for e in loop.tuning().history] == [("measured", None)]


def test_a_spec_change_drops_the_capacity_and_the_open_job() -> None:
    loop = Loop.start(CAPACITY_SLO, mode="benchmark", capacity={"targetConcurrentUsers": 20000})
    loop.run_until(lambda lp: (lp.current() or {}).get("kind") == "capacity")
    job = (loop.current() or {}).get("job")
    assert job is not None and loop.status.get("capacity")
    loop.isvc = make_isvc({**CAPACITY_SLO, "ttftMs": 1200}, mode="benchmark",
                          capacity={"targetConcurrentUsers": 20000})
    loop.tick()
    assert loop.ticks[-1].actions.delete_job == job
    assert "capacity" not in loop.status
    assert loop.tuning().round == 2 and loop.tuning().history == []


def test_autotune_off_or_no_tuning_yet_leaves_the_plans_schedule() -> None:
    loop = Loop.start()
    assert lt.window_due(loop.isvc, loop.status, loop.now) is None
    assert ts.applied_schedule(loop.isvc, loop.plan, loop.status) is None
    loop.tick()
    off = loop.isvc.model_copy(update={"spec": loop.isvc.spec.model_copy(
        update={"autotune": loop.isvc.spec.autotune.model_copy(update={"enabled": False})})})
    assert ts.applied_schedule(loop.isvc, loop.plan, loop.status) is not None
    assert ts.applied_schedule(off, loop.plan, loop.status) is None
    assert lt.window_due(off, loop.status, loop.now + 100) is None


def without_prometheus() -> Loop:
    loop = Loop.start()
    obs = tt.Observation(now=T0, pods=tuple(loop.pods), prometheus=False, prometheus_configured=False)
    actions = at.advance(loop.isvc, loop.plan, loop.status, obs)
    assert actions.apply is None and actions.create_job is None and actions.scale is None
    loop.status = actions.status
    return loop


def test_without_prometheus_nothing_is_tuned() -> None:
    loop = without_prometheus()
    tuning = loop.condition("Tuning")
    assert (tuning["status"], tuning["reason"]) == ("False", at.REASON_NO_PROMETHEUS)
    assert loop.tuning().current is None and loop.tuning().history == []
    assert lt.window_due(loop.isvc, loop.status, T0 + 3600) is None


def test_without_prometheus_the_phase_stays_ready() -> None:
    loop = without_prometheus()
    assert loop.status["phase"] == "Ready"


def test_waits_for_every_engine_pod_before_a_trial() -> None:
    loop = Loop.start(replicas=2)
    ready = loop.pods[0]
    loop.pods[0] = replace(ready, ready=False)
    loop.tick()
    assert loop.ticks[-1].actions.apply is None and loop.current() is None
    assert loop.condition("Tuning")["reason"] == at.REASON_WAITING
    loop.pods[0] = ready
    loop.tick()
    assert loop.ticks[-1].actions.apply is not None and loop.current() is not None


def test_a_trial_waits_for_every_pod_of_every_group() -> None:
    """Two replicas of two pods (the e2e test's CPU groups): a trial opens only once all four pods are ready, not
    when the pods that exist are (a group whose worker is not created yet is no replica)."""
    isvc = make_isvc(DECODE_SLO, replicas=2)
    isvc.spec.accelerator = isvc.spec.accelerator.model_copy(update={"cards": 2, "cardsPerNode": 1})
    plan = plan_spec(isvc.spec)
    assert (plan.replicas, plan.nodes) == (2, 2)
    group = [tt.PodState("tiny-0", "u0", "10.0.0.1", True, 0), tt.PodState("tiny-0-1", "u1", "10.0.0.2", True, 0,
                                                                            leader=False),
             tt.PodState("tiny-1", "u2", "10.0.0.3", True, 0)]  # group 1's worker: not created yet
    loop = Loop(isvc, plan, FakeEngine(), ready_status(plan), group)
    loop.tick()
    assert loop.current() is None and loop.condition("Tuning")["reason"] == at.REASON_WAITING
    loop.pods.append(tt.PodState("tiny-1-1", "u3", "10.0.0.4", True, 0, leader=False))
    loop.tick()
    assert loop.current() is not None


def test_a_rollback_stays_the_word_while_the_restarted_engine_comes_back() -> None:
    loop = Loop.start()
    loop.run_until(trial_open(1))
    pod = loop.pods[0]
    loop.pods[0] = replace(pod, restarts=pod.restarts + 1, ready=False)  # killed: restarted, not ready yet
    loop.tick()
    rolled = loop.condition("Tuning")
    assert rolled["reason"] == at.REASON_ROLLED_BACK and "rolled back to maxBatchSize" in rolled["message"]
    wait = "waiting for every engine pod to be ready before the next trial"
    for _ in range(3):  # looks while the engine loads again: the rollback and its cause stay, the wait said once
        loop.tick()
        waiting = loop.condition("Tuning")
        assert (waiting["status"], waiting["reason"]) == ("True", at.REASON_ROLLED_BACK)
        assert waiting["message"] == f"{rolled['message']}; {wait}"
        assert loop.current() is None and loop.ticks[-1].actions.apply is None
    loop.pods[0] = replace(loop.pods[0], ready=True)
    loop.tick()
    assert loop.current() is not None and loop.condition("Tuning")["reason"] == at.REASON_MEASURING


# --- 9. units ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("passes", "limit", "expected"), [
    ({}, 100, None),
    ({10: False}, 100, None),  # no pass to start from
    ({10: True}, 100, 20),  # doubling
    ({10: True, 20: True}, 100, 40),
    ({10: True, 80: True}, 100, 100),  # doubling stops at the limit
    ({100: True}, 100, None),  # at the limit: done
    ({10: True, 20: False}, 100, 15),  # bisection
    ({10: True, 15: True, 20: False}, 100, 17),
    ({10: True, 11: False}, 100, None),  # within one
    ({100: True, 110: False}, 400, None),  # within 10%
    ({100: True, 111: False}, 400, 105),
    ({10: False, 20: True}, 100, 40),  # a failure below the largest pass says nothing
    ({20: True, 40: False, 30: False, 25: True}, 100, 27),
])
def test_next_capacity_probe(passes: dict[int, bool], limit: int, expected: int | None) -> None:
    assert capacity.next_capacity_probe(passes, limit) == expected


@pytest.mark.parametrize(("text", "seconds"), [
    ("20s", 20.0), ("2m", 120.0), ("1m30s", 90.0), ("500ms", 0.5), ("1h", 3600.0), ("1.5s", 1.5),
    ("1h2m3s4ms", 3723.004),
])
def test_parse_duration(text: str, seconds: float) -> None:
    assert tt.parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "20", "s", "2x", "1m 30s", "-1s", " 2m", "2m ", "1d", "2M"])
def test_parse_duration_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="not a duration"):
        tt.parse_duration(text)


@pytest.mark.parametrize(("text", "seconds"), [
    ("2024-05-01T12:00:00Z", 1714564800.0),  # as the loop writes it (`rfc3339`)
    ("2024-05-01T12:00:00.250Z", 1714564800.25),  # as kubectl and client-go write a MicroTime
    ("2024-05-01T14:00:00+02:00", 1714564800.0),
    ("2024-05-01T12:00:00", 1714564800.0),  # no zone: UTC, not the host's local time
])
def test_parse_rfc3339(text: str, seconds: float) -> None:
    assert at.parse_rfc3339(text) == seconds
    assert at.parse_rfc3339(at.rfc3339(seconds)) == math.floor(seconds)  # whole seconds both ways


def test_no_traffic_then_prometheus_down_are_two_inconclusive_entries() -> None:
    """Each cause of an inconclusive window is recorded once while the trial stays open: an empty window, then
    Prometheus down (the e2e order that once lost the second: it was not recorded, nor its event posted)."""
    loop = Loop.start()
    loop.tick()
    loop.tick_until_due()
    loop.tick(tt.Measurement(inconclusive="no request finished in the window", reason="NoRequestFinished"))
    loop.tick_until_due()
    loop.prometheus = False
    loop.tick(tt.Measurement(inconclusive="Prometheus unreachable: ConnectError", reason="PrometheusUnreachable"))
    verdicts = [(e.outcome, e.reason, e.verdict) for e in loop.tuning().history]
    assert verdicts == [("inconclusive", "NoRequestFinished", "no request finished in the window"),
                        ("inconclusive", "PrometheusUnreachable", "Prometheus unreachable: ConnectError")]
    assert ("Warning", at.REASON_PROMETHEUS_DOWN) in [(e[0], e[1]) for e in loop.ticks[-1].actions.events]
    assert loop.condition("Tuning")["reason"] == at.REASON_PROMETHEUS_DOWN


def test_engines_losing_readiness_at_the_smallest_batch_tried_send_the_search_lower_not_to_all_failed() -> None:
    # A burst the engines cannot take makes them blip (readiness lost mid-trial) at each batch tried: the search halves
    # the batch, below the plan's minimum (512) if it must, instead of ending `allFailed` at the range's end.
    loop = Loop.start(mode="benchmark")
    assert loop.plan.maxBatchSize.min == 512
    failed: list[int] = []
    for trial in range(3):
        loop.run_until(trial_open(trial))
        for _ in range(3):
            loop.tick()
        current = loop.current()
        assert current is not None
        failed.append(current["schedule"]["maxBatchSize"])
        pod = loop.pods[0]
        loop.pods[0] = replace(pod, ready=False)
        loop.tick()
        loop.pods[0] = pod
        entry = loop.tuning().history[-1]
        assert (entry.outcome, entry.reason) == ("failed", "EngineNotReady")
    assert failed == [2048, 1024, 512]
    loop.run_until(trial_open(3))
    current = loop.current()
    assert current is not None and current["schedule"]["maxBatchSize"] == 256 < loop.plan.maxBatchSize.min
    assert loop.tuning().phase == "Running"


def test_a_window_settles_until_the_requests_in_flight_at_the_change_have_finished() -> None:
    # Online traffic waits for its answers: requests admitted under the last schedule run on under it. After a window
    # whose requests took 8 s on average, the next trial settles 16 s (twice that), not a quarter window (5 s); at most
    # a whole window.
    slow = FakeEngine()
    loop = Loop.start(engine=slow)
    loop.run_until(trial_open(0))
    loop.tick_until_due()
    reading = loop.read(lt.window_due(loop.isvc, loop.status, loop.now), loop.current())
    assert reading is not None and reading.metrics is not None
    loop.tick(tt.Measurement(metrics=reading.metrics.model_copy(update={"e2eMeanMs": 8000.0})))
    current = loop.current()
    assert current is not None and current["trial"] == 1
    opened = loop.ticks[-1].now
    assert at.parse_rfc3339(current["measureUntil"]) == on_grid(opened + 2 * 8 + WINDOW_S)
    assert at.parse_rfc3339(current["measureFrom"]) == on_grid(opened + 2 * 8 + WINDOW_S) - WINDOW_S
