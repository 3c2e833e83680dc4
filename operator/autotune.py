"""The closed loop in the operator (docs/operator.md, "Autotuning"), as a pure state machine over `status.tuning`.

`advance(isvc, plan, status, observation)` reads the InferenceService, its plan, its status as it is now and what the
operator just observed (the engine pods, a Prometheus window when one was due, the benchmark Job), and returns the
actions to take (a schedule to apply to every engine and the ConfigMap, a Job to create or delete, a replica count
to scale to, events) and the new status. It does no I/O and reads no clock: the autotune driver
(`autotune_loop.py`) gathers the observation, writes the status through the one status writer, then runs the actions.
What the status records of the schedule (its generation, the Job, the rollback) is `tuning_schedule.py`; when to look
again and which window to read is `look_timing.py`.
The status holds the whole state (the trial in progress, the typed history, the capacity probes), so an operator that
restarts resumes where it was, and the pure tuner (`tuner.decide`) decides every trial from the history, as the
simulator's tests drive it.

One trial: the tuner's schedule goes to every engine (PUT /admin/schedule) and into the ConfigMap (a restarted pod
keeps it; the pod template's hash leaves hot fields out, so nothing rolls). A settling time is dropped (a quarter of
`autotune.window`, or twice the last window's mean request latency when that is longer: requests admitted before the
change run on under the old schedule); the window after it is read from Prometheus. In benchmark mode a
load-generator Job drives one engine pod at the guide's client concurrency (maxBatchSize - 1) for that time and only
that pod is measured.
A window that Prometheus could not answer, or that holds no finished request, is inconclusive: recorded once, and
measured again (after Prometheus is back). An engine pod that restarts, goes away or stops being ready during a
trial, a failed Job, or a window the judge fails (errors, KV exhausted, a preemption storm) fails the trial and rolls
the engines back at once to the best schedule known. The verdict, `SLOMet`, `status.tuning.best` and the capacity all
come from the windows measured at the chosen schedule (`status.tuning.verdict` names them). After the verdict, the
loop keeps `status.observed` current window by window (judged by the same judge) and starts a new round when the SLO
is missed over several consecutive windows (at most once per window x maxTrials); with `spec.capacity`, it first
measures (benchmark) or derives (online) the concurrency one instance holds under the SLO (`capacity.py`) and scales
the replicas to hold the target.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from npuserve.planning.api import (
    EARLIER_WINDOWS,
    SCHEDULE_NOT_RUN,
    AppliedSchedule,
    FailureReasonName,
    InferenceService,
    Plan,
    ScheduleKnobs,
    TrialInProgress,
    TrialMetrics,
    TuningStatus,
    TuningTrial,
)
from npuserve.planning.problem import TunedSchedule
from npuserve.planning.tuner import NextTrial, Trial, Verdict, decide
from npuserve.planning.tuning_status import (
    conclusive,
    model_status,
    phase_of,
    trial_status,
    trials_of,
    verdict_status,
)

from . import capacity as capacity_part
from . import inner_loop
from .autotune_types import (
    Actions,
    Measurement,
    Observation,
    Status,
    format_duration,
    parse_rfc3339,
    rfc3339,
)
from .look_timing import grid_after, settle_s, window_s
from .render import bench_job_name
from .status import condition as condition_of
from .status import serving_phase, set_condition
from .tuning_schedule import best_known, next_generation, problem_for, problem_key, trial_job, tuning_of

# Settling also lasts this many times the last window's mean request latency: requests admitted under the schedule
# before keep running under it after a live change (online traffic waits for its answers), and a window that counts
# them measures the old schedule.
SETTLE_REQUEST_LATENCIES = 2.0
MISSED_WINDOWS = 3  # consecutive windows missing the SLO after tuning that start a new round
MAX_STRETCH = 4  # a window measured again grows to at most this many times autotune.window
HISTORY_LIMIT = 100  # status.tuning.history's maxItems
# Condition reasons (docs/operator.md lists them).
REASON_NO_PROMETHEUS = "NoPrometheus"
REASON_WAITING = "WaitingForEngines"
REASON_MEASURING = "Measuring"
REASON_PROMETHEUS_DOWN = "PrometheusUnreachable"
REASON_NO_TRAFFIC = "WaitingForTraffic"
REASON_ROLLED_BACK = "RolledBack"
REASON_SCHEDULE_NOT_RUN = SCHEDULE_NOT_RUN
WAITING_MESSAGE = "waiting for every engine pod to be ready before the next trial"


def readable_ms(ms: float) -> float:
    """Milliseconds as people read them: whole, with one decimal under 10 ms (a fast TPOT must not read 0)."""
    return round(ms) if ms >= 10 else round(ms, 1)



# --- one look -------------------------------------------------------------------------------------------------------


def advance(isvc: InferenceService, plan: Plan, status: Mapping[str, Any], obs: Observation) -> Actions:
    """One look of the loop (module docstring). `status` is the InferenceService's status now."""
    look = _Look(isvc, plan, status, obs)
    look.run()
    return look.actions


def unproven_reason(reason: str) -> str:
    """The SLOMet=False reason after a verdict that did not prove the SLO met."""
    return "SLOUnreachable" if reason == "sloUnreachable" else "SLOMissed"


class _Look:
    def __init__(self, isvc: InferenceService, plan: Plan, status: Mapping[str, Any], obs: Observation) -> None:
        self.isvc, self.plan, self.obs = isvc, plan, obs
        self.now = rfc3339(obs.now)
        self.generation = isvc.metadata.generation
        self.status: Status = {k: v for k, v in status.items()}
        self.actions = Actions(status=self.status)
        old = tuning_of(status)
        base = problem_for(isvc, plan)
        self.key = problem_key(base)
        if old is None or old.problem != self.key:
            # A new problem (first tuning, or a spec change that moved the range, the SLO or a pinned knob).
            # What the engines run stays (its generation keeps rising across problems).
            self.tuning = TuningStatus(phase="Running", round=(old.round if old else 0) + 1, problem=self.key,
                                       roundStartedAt=self.now, applied=old.applied if old else None)
            if old is not None and old.current is not None and old.current.job:
                self.actions.delete_job = old.current.job
            self.status.pop("capacity", None)
        else:
            self.tuning = old.model_copy(deep=True)
        self.new_problem = old is None or old.problem != self.key
        self.reapply = False  # a window found an engine not running the applied schedule: apply it again
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
            drop = next((i for i, e in enumerate(self.tuning.history) if e.outcome == "inconclusive"), 0)
            del self.tuning.history[drop]
        self.tuning.trial = len(conclusive(self.tuning.history))
        self.tuning.model = model_status(self.problem, trials_of(self.tuning.history), trials_of(self.tuning.earlier))
        self.status["tuning"] = self.tuning.model_dump(mode="json", exclude_none=True)
        if self.tuning.applied is not None:
            self.status["schedule"] = {**(self.status.get("schedule") or {}),
                                       **self.tuning.applied.knobs().model_dump(exclude_none=True)}
        ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                    for c in self.status.get("conditions") or [])
        if ready and self.status.get("phase") in ("Ready", "Tuning"):
            self.status["phase"] = serving_phase(self.status["tuning"])

    def apply(self, knobs: ScheduleKnobs, inner: dict[str, int | bool] | None = None) -> None:
        """`knobs` on the engines, with the TPOT controller's fields `inner` (None: the controller off, as every
        trial and probe measures one fixed schedule): a new schedule generation when they differ from the applied
        ones (or the applied ones are of another problem, which the ConfigMap no longer holds)."""
        applied = self.tuning.applied
        if inner is None:
            inner = inner_loop.off(self.isvc, applied)
        if applied is not None and applied.knobs() == knobs and applied.inner_loop() == inner \
                and not (self.new_problem or self.reapply):
            return
        generation = next_generation(applied, self.generation)
        self.tuning.applied = AppliedSchedule(**knobs.model_dump(exclude_none=True), **inner,
                                              scheduleGeneration=generation)
        self.actions.apply = self.tuning.applied

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
            # After a rollback, the rollback stays the word until the next trial opens: the engine waited for is most
            # often the one whose failure rolled it back, and the wait alone would hide why (the event may be gone).
            rolled_back = (condition_of(self.status, "Tuning") or {}).get("reason") == REASON_ROLLED_BACK
            if not rolled_back:
                self.tuning.message = WAITING_MESSAGE
            elif not self.tuning.message.endswith(WAITING_MESSAGE):
                self.tuning.message += f"; {WAITING_MESSAGE}"
            self.condition("Tuning", True, REASON_ROLLED_BACK if rolled_back else REASON_WAITING, self.tuning.message)
            return
        decision = decide(self.problem, trials_of(self.tuning.history), trials_of(self.tuning.earlier))
        if isinstance(decision, NextTrial):
            number = len(self.tuning.history)
            self.open_window("trial", number, self.problem.knobs(decision.schedule), decision.reason)
        else:
            self.conclude(decision)

    def open_window(self, kind: Literal["trial", "capacity"], number: int, knobs: ScheduleKnobs, reason: str,
                    concurrency: int | None = None, attempts: int = 0) -> str:
        """Apply `knobs`, start the Job in benchmark mode, and open the window; what it says of itself."""
        now = self.obs.now
        # A window measured again is longer (x2, x3, x4): requests longer than the window never finish inside it, and
        # a new benchmark Job starts its load over.
        stretch = 1 + min(attempts, MAX_STRETCH - 1)
        settle, window = max(settle_s(self.isvc) * stretch, self.draining_s()), window_s(self.isvc) * stretch
        until = grid_after(now + settle + window)
        start = until - window
        # A group's leader is its one endpoint: the load goes there, whatever the names sort as.
        ready = sorted((p for p in self.obs.pods if p.ready and p.ip and p.leader), key=lambda p: p.name)
        benchmark = self.isvc.spec.autotune.mode == "benchmark"
        target = ready[0] if benchmark else None
        job = None
        if benchmark:
            assert target is not None and target.ip is not None
            users = concurrency or max(1, knobs.maxBatchSize - 1 if knobs.maxBatchSize else 1)
            concurrency = users
            job = bench_job_name(self.isvc, kind, self.tuning.round, number, now)
        self.apply(knobs)
        self.tuning.current = TrialInProgress(
            kind=kind, trial=number, schedule=knobs, concurrency=concurrency, appliedAt=rfc3339(now),
            measureFrom=rfc3339(start), measureUntil=rfc3339(until),
            pods=sorted(p.signature for p in self.obs.pods), target=target.name if target else None, job=job,
            attempts=attempts)
        if target is not None and target.ip is not None:
            self.actions.create_job = trial_job(self.isvc, self.tuning.current, target.ip, now)
        what = (f"trial {number}: maxBatchSize {knobs.maxBatchSize}" if kind == "trial"
                else f"capacity probe {number}: {concurrency} users at maxBatchSize {knobs.maxBatchSize}")
        load = f"; load: Job {job}, {concurrency} users on {target.name}" if target else "; load: live traffic"
        message = f"{what} ({reason}); settling until {rfc3339(start)}, measuring until {rfc3339(until)}{load}"
        if kind == "trial":  # a capacity probe comes after tuning: its verdict stays on the Tuning condition
            self.tuning.message = message
            self.condition("Tuning", True, REASON_MEASURING, message)
            self.event("Normal", "TrialStarted", message)
        return message

    def draining_s(self) -> float:
        """How long the requests in flight at a change may take to finish: SETTLE_REQUEST_LATENCIES times the mean
        request latency of the last window measured (0 before any), at most the window itself."""
        last = next((e.metrics for e in reversed(self.tuning.history) if e.metrics is not None), None)
        if last is None or last.e2eMeanMs is None:
            return 0.0
        return min(SETTLE_REQUEST_LATENCIES * last.e2eMeanMs / 1000, window_s(self.isvc))

    def open_probe(self, number: int, concurrency: int) -> str:
        assert self.tuning.applied is not None
        return self.open_window("capacity", number, self.tuning.applied.knobs(), "capacity search",
                                concurrency=concurrency)

    def tend(self, current: TrialInProgress) -> None:
        now = self.obs.now
        changed = self.pods_changed(current)
        if changed is not None:
            self.close_failed(current, *changed)
            return
        if current.job and self.obs.job == "failed":
            self.close_failed(current, "LoadJobFailed", f"the load-generator Job {current.job} failed")
            return
        if current.inconclusiveReason == "PrometheusUnreachable":
            if not self.obs.prometheus:
                return  # still down: the trial stays open, nothing is decided
            self.reopen(current, "Prometheus answers again")
            return
        if now < parse_rfc3339(current.measureUntil):
            return
        m = self.obs.measurement
        if m is None:
            return  # the driver did not read (it will next time)
        if m.metrics is None:
            self.inconclusive(current, m)
            return
        not_run = self.schedule_not_run(m)
        if not_run is not None:
            self.inconclusive(current, Measurement(inconclusive=not_run, reason=SCHEDULE_NOT_RUN))
            return
        self.tuning.current = None
        if current.job:
            self.actions.delete_job = current.job
        if current.kind == "capacity":
            capacity_part.close_probe(self, current, m.metrics)
        else:
            self.close_trial(current, m.metrics)

    def schedule_not_run(self, m: Measurement) -> str | None:
        """Why the window did not measure the trial's schedule on every measured pod throughout, or None when it
        did: every pod's schedule-generation gauge was the trial's at every sample of the window."""
        if m.generations is None:
            return None  # a measurement without the gauge (the simulator's): nothing to check
        assert self.tuning.applied is not None
        want, ran = self.tuning.applied.scheduleGeneration, m.generations
        if ran.pods == 0 or ran.lowest is None or ran.highest is None:
            return f"no engine reported its schedule generation in the window (the trial's is {want})"
        if ran.lowest != want or ran.highest != want:
            return (f"the measured engines ran schedule generations {ran.lowest} to {ran.highest} in the window, "
                    f"not the trial's {want} throughout")
        return None

    def pods_changed(self, current: TrialInProgress) -> tuple[FailureReasonName, str] | None:
        now = {p.name: p for p in self.obs.pods}
        for sig in current.pods:
            name, _, _ = sig.split("/")
            pod = now.get(name)
            if pod is None:
                return "EngineGone", f"engine pod {name} went away during the trial"
            if pod.signature != sig:
                return "EngineRestarted", f"engine pod {name} restarted during the trial"
            if not pod.ready:
                return "EngineNotReady", f"engine pod {name} stopped being ready during the trial"
        return None

    def inconclusive(self, current: TrialInProgress, m: Measurement) -> None:
        why = m.inconclusive or "no measurement"
        reason = m.reason or "NoRequestFinished"
        # Recorded once per cause while the trial stays open (a window with no traffic, then Prometheus down, are two
        # entries; ten empty windows are one).
        last = self.tuning.history[-1] if self.tuning.history and current.attempts else None
        first = last is None or last.outcome != "inconclusive" or last.reason != reason
        current.inconclusive, current.inconclusiveReason = why, reason
        current.attempts += 1
        if current.kind == "trial" and first:
            self.tuning.history.append(TuningTrial(
                trial=len(self.tuning.history), schedule=current.schedule, outcome="inconclusive", reason=reason,
                verdict=why, window=f"{current.measureFrom}/{current.measureUntil}"))
            current.trial = len(self.tuning.history)
        what = f"trial {current.trial}" if current.kind == "trial" else f"capacity probe {current.trial}"
        if m.unreachable:
            message = f"{what}: {why}; inconclusive, measured again once Prometheus answers"
            if first:
                self.event("Warning", REASON_PROMETHEUS_DOWN, message)
        else:
            self.reopen(current, why, reapply=reason == SCHEDULE_NOT_RUN)
            message = f"{what}: {why}; measuring again (attempt {current.attempts + 1})"
        if current.kind == "trial":
            self.tuning.message = message
            said = REASON_PROMETHEUS_DOWN if m.unreachable else (
                REASON_SCHEDULE_NOT_RUN if reason == SCHEDULE_NOT_RUN else REASON_NO_TRAFFIC)
            self.condition("Tuning", True, said, message)

    def reopen(self, current: TrialInProgress, why: str, reapply: bool = False) -> None:
        """Measure the open trial again from now: the schedule stays, a new window (and Job) starts; `reapply`:
        put the schedule on the engines again (one did not run it), at a new generation."""
        self.tuning.current = None
        self.reapply = reapply
        self.open_window(current.kind, current.trial, current.schedule, f"again: {why}", current.concurrency,
                         attempts=current.attempts)
        if current.job:
            self.actions.delete_job = current.job

    def close_failed(self, current: TrialInProgress, reason: FailureReasonName, why: str) -> None:
        self.tuning.current = None
        if current.job:
            self.actions.delete_job = current.job
        if current.kind == "capacity":
            self.event("Warning", "CapacityProbeDiscarded",
                       f"capacity probe at {current.concurrency} users discarded: {why}")
            return
        self.tuning.history.append(TuningTrial(
            trial=len(self.tuning.history), schedule=current.schedule, outcome="failed", reason=reason, verdict=why,
            window=f"{current.measureFrom}/{current.measureUntil}"))
        self.rollback(f"trial {current.trial} (maxBatchSize {current.schedule.maxBatchSize}) failed: {why}")

    def rollback(self, why: str) -> None:
        best = best_known(self.problem, self.tuning.history, self.tuning.earlier)
        self.apply(best)
        self.tuning.message = f"{why}; rolled back to maxBatchSize {best.maxBatchSize}"
        self.condition("Tuning", True, REASON_ROLLED_BACK, self.tuning.message)
        self.event("Warning", REASON_ROLLED_BACK, self.tuning.message)

    def close_trial(self, current: TrialInProgress, metrics: TrialMetrics) -> None:
        trial = Trial(schedule=TunedSchedule.from_knobs(current.schedule, f"trial {current.trial}"), metrics=metrics)
        entry = trial_status(self.problem, len(self.tuning.history), trial).model_copy(
            update={"schedule": current.schedule, "window": f"{current.measureFrom}/{current.measureUntil}"})
        self.tuning.history.append(entry)
        self.observe(metrics, current.measureFrom, current.measureUntil, current.schedule.maxBatchSize)
        self.event("Warning" if entry.outcome == "failed" else "Normal", "TrialMeasured",
                   f"trial {entry.trial}: maxBatchSize {current.schedule.maxBatchSize}: {entry.verdict}")
        if entry.outcome == "failed":
            self.rollback(f"trial {entry.trial} (maxBatchSize {current.schedule.maxBatchSize}) {entry.verdict}")
            return
        self.tuning.message = f"trial {entry.trial}: {entry.verdict}"
        self.next_trial()

    def observe(self, metrics: TrialMetrics, start: str, end: str, max_batch_size: int | None) -> None:
        """status.observed: the last window measured, for people (`kubectl get` shows it): the maxBatchSize it ran
        beside its figures at the SLO's statistic, rounded as people read them, and the judge's word on them (judged
        on the unrounded figures, which the history keeps)."""
        stat = self.isvc.spec.slo.statistic
        window = parse_rfc3339(end) - parse_rfc3339(start)
        judgement = self.problem.judge(metrics)
        self.status["observed"] = {
            **(self.status.get("observed") or {}),
            "maxBatchSize": max_batch_size,
            "ttftMs": readable_ms(metrics.ttftMs.of(stat)), "tpotMs": readable_ms(metrics.tpotMs.of(stat)),
            "outputTokensPerSecond": round(metrics.outputTokensPerSecond), "errorRate": metrics.errorRate,
            "window": format_duration(window), "samples": metrics.samples, "measuredAt": end,
            "sloMet": judgement.meets, "failing": list(judgement.failing),
        }

    # -- the verdict, and after it --

    def conclude(self, verdict: Verdict) -> None:
        history = conclusive(self.tuning.history)
        best = history[verdict.best] if verdict.best is not None else None
        self.tuning.best = best
        self.tuning.verdict = verdict_status(verdict, self.tuning.history)
        self.tuning.phase = phase_of(verdict)
        self.tuning.lastCheckAt = self.now
        self.tuning.missedWindows = 0
        knobs = best.schedule if best is not None else best_known(self.problem, self.tuning.history,
                                                                  self.tuning.earlier)
        self.apply(knobs, inner_loop.wanted(self.isvc, self.tuning.verdict, self.tuning.applied))
        said = f"{verdict.reason} after {len(history)} trials: {verdict.message}"
        said += self.inner_loop_said()
        self.tuning.message = said
        self.condition("Tuning", False, verdict.reason[0].upper() + verdict.reason[1:], said)
        if verdict.slo_met:
            proof = {"windows": "its own windows", "monotone": "a larger batch's windows",
                     "model": "the engine model"}.get(verdict.basis or "windows", "its own windows")
            self.condition("SLOMet", True, "SLOMet", f"the tuned schedule is proven to meet the SLO by {proof}: "
                                                     f"{verdict.message}")
        else:
            self.condition("SLOMet", False, unproven_reason(verdict.reason),
                           f"{verdict.message}. No maxBatchSize from {self.problem.floor} to the memory bound "
                           f"{self.problem.batch_max} was shown to meet it: relax spec.slo, add cards "
                           "(spec.accelerator.cards) or replicas, or shorten spec.workload")
        self.event("Normal" if verdict.slo_met else "Warning", "TuningFinished", said)
        capacity_part.advance(self)

    def inner_loop_said(self) -> str:
        """What the verdict's message adds of the inner loop: its target when it runs, why not when it is asked for
        and does not."""
        applied = self.tuning.applied
        if applied is not None and applied.dynamicBatchSizeEnable:
            return (f"; the engines' TPOT controller holds the mean TPOT at {applied.decodeExpectedTime} ms "
                    f"(decodeExpectedTime) under maxBatchSize {applied.maxBatchSize}")
        why = inner_loop.why_not(self.isvc, self.tuning.verdict)
        return f"; {why}" if why else ""

    def hold_inner_loop(self) -> None:
        """After the round (and its capacity probes, which measure the fixed schedule): the controller as the spec
        and the verdict want it; a spec change that turns spec.autotune.innerLoop on or off takes effect here."""
        applied = self.tuning.applied
        if applied is None:
            return
        inner = inner_loop.wanted(self.isvc, self.tuning.verdict, applied)
        if applied.inner_loop() != inner:
            self.apply(applied.knobs(), inner)
            state = (f"on at decodeExpectedTime {inner[inner_loop.TARGET]} ms" if inner.get(inner_loop.ENABLE)
                     else "off")
            self.event("Normal", "InnerLoop", f"the engines' TPOT controller is {state} under maxBatchSize "
                                              f"{applied.maxBatchSize}")

    def seed_trial(self, m: Measurement, start: str, end: str) -> TuningTrial | None:
        """In online mode, the window that starts a new round is the new round's first trial: it measured the live
        traffic at the applied schedule, which is what the round's first trial would measure again (one window
        saved after a traffic change). Not in benchmark mode, whose trials measure the Job's load, not the live one;
        nor under the inner loop, whose controller moved the running batch inside the window; nor a window that did
        not run the applied schedule throughout."""
        applied = self.tuning.applied
        if (self.isvc.spec.autotune.mode != "online" or applied is None or m.metrics is None
                or applied.inner_loop().get(inner_loop.ENABLE) or self.schedule_not_run(m) is not None):
            return None
        knobs = applied.knobs()
        trial = Trial(schedule=TunedSchedule.from_knobs(knobs, "the window that started the round"), metrics=m.metrics)
        return trial_status(self.problem, 0, trial).model_copy(update={"schedule": knobs, "window": f"{start}/{end}"})

    def after_tuning(self) -> None:
        if capacity_part.advance(self):
            return
        self.hold_inner_loop()
        m = self.obs.measurement
        if m is None:
            return
        end = m.end if m.end is not None else self.obs.now
        self.tuning.lastCheckAt = rfc3339(end)
        if m.metrics is None:
            return  # no traffic or no Prometheus: nothing said about the SLO
        start = m.start if m.start is not None else end - window_s(self.isvc)
        applied = self.tuning.applied  # what the window ran: the verdict's schedule, applied when tuning concluded
        self.observe(m.metrics, rfc3339(start), rfc3339(end), applied.maxBatchSize if applied is not None else None)
        judgement = self.problem.judge(m.metrics)
        if judgement.meets:
            self.tuning.missedWindows = 0
            verdict = self.tuning.verdict
            if verdict is None or verdict.sloMet is not False:  # proven, or nothing searched (a pinned batch)
                self.condition("SLOMet", True, "SLOMet", "the last window met the SLO")
            else:
                # One window is no proof: SLOMet=True says the schedule meets the SLO beyond the noise, which the
                # round could not show (a noisy machine, the trials spent); its own windows said more than this one.
                self.condition("SLOMet", False, unproven_reason(verdict.reason),
                               f"the last window met the SLO as measured, but the tuning's verdict ({verdict.reason}) "
                               "did not show that the schedule meets it beyond the noise; a new spec.slo tunes again")
            return
        missed = ", ".join(judgement.failing)
        if self.tuning.phase != "Converged":
            # The last round found no schedule that meets the SLO (or stopped short): another round on the same
            # problem would find the same; say it, and leave the search to a spec change.
            self.condition("SLOMet", False, "SLOMissed",
                           f"the last window missed the SLO ({missed}), as the tuning's verdict said")
            return
        self.tuning.missedWindows += 1
        self.condition("SLOMet", False, "SLOMissed",
                       f"{self.tuning.missedWindows} consecutive window(s) missed the SLO ({missed}; traffic "
                       f"changed?); {MISSED_WINDOWS} start a new tuning round")
        started = parse_rfc3339(self.tuning.roundStartedAt) if self.tuning.roundStartedAt else 0.0
        cool_down = window_s(self.isvc) * self.isvc.spec.autotune.maxTrials
        if self.tuning.missedWindows >= MISSED_WINDOWS and self.obs.now - started >= cool_down:
            best = self.tuning.best
            seed = self.seed_trial(m, rfc3339(start), rfc3339(end))
            # The engine model of the new round reads the last round's windows too (tuner._model says when).
            measured = [e for e in self.tuning.history if e.outcome == "measured"]
            earlier = (self.tuning.earlier + measured)[-EARLIER_WINDOWS:]
            self.tuning = TuningStatus(phase="Running", round=self.tuning.round + 1, problem=self.key,
                                       roundStartedAt=self.now, applied=self.tuning.applied, best=best,
                                       history=[seed] if seed is not None else [], earlier=earlier)
            self.status.pop("capacity", None)  # measured again for the new round's best
            self.problem = problem_for(self.isvc, self.plan, best.schedule.maxBatchSize if best else None)
            self.event("Normal", "TuningRestarted", f"the SLO was missed in {MISSED_WINDOWS} consecutive windows: "
                       f"round {self.tuning.round} starts")
            self.next_trial()
