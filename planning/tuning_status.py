"""The tuner's trials and verdict as `status.tuning` holds them, and back: typed both ways, nothing parsed from text.

`trial_status` writes one trial as a `TuningTrial` (its outcome, the failure reason and failing figures, the metrics,
the judge's word on the window, a one-line verdict for people); `trial_from_status` reads it back into exactly the
trial it was, so an operator that restarts resumes the search where it was.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from npuserve.planning.api import FAILURE_REASONS, ModelParameter, OnlineModelStatus, TuningTrial, TuningVerdict

from .problem import TunedSchedule, TuningProblem
from .tuner import Trial, Verdict, online_model


def trial_status(problem: TuningProblem, index: int, trial: Trial) -> TuningTrial:
    """One trial as `status.tuning.history` holds it (`trial_from_status` reads it back)."""
    m = trial.metrics
    if m is None:
        assert trial.failure is not None
        return TuningTrial(trial=index, schedule=trial.schedule.knobs(), outcome="failed", reason=trial.failure,
                           verdict=trial.detail or trial.failure)
    judgement = problem.judge(m)
    parts = [f"{m.outputTokensPerSecond:.0f} tok/s"]
    for key, bound in problem.bounds().items():
        value = problem.latency(m, key)
        parts.append(f"{key.upper()} {problem.statistic} {value:.1f} ms {'<=' if value <= bound else '>'} {bound:g}")
    if m.samples < problem.min_samples:
        parts.append(f"only {m.samples} requests")
    if judgement.failure is not None:
        return TuningTrial(trial=index, schedule=trial.schedule.knobs(), outcome="failed", reason=judgement.failure,
                           failing=list(judgement.failing), metrics=m, sloMet=False,
                           verdict=f"failed: {judgement.why}; " + "; ".join(parts))
    return TuningTrial(trial=index, schedule=trial.schedule.knobs(), outcome="measured", metrics=m,
                       failing=list(judgement.failing), sloMet=judgement.meets, verdict="; ".join(parts))


def trial_from_status(entry: TuningTrial) -> Trial | None:
    """A trial back from `status.tuning.history`; None for an inconclusive window (the tuner never sees those)."""
    if entry.outcome == "inconclusive":
        return None
    schedule = TunedSchedule.from_knobs(entry.schedule, f"tuning trial {entry.trial}")
    if entry.metrics is not None:
        return Trial(schedule=schedule, metrics=entry.metrics)
    assert entry.reason in FAILURE_REASONS
    return Trial(schedule=schedule, failure=entry.reason, detail=entry.verdict)


def trials_of(history: Sequence[TuningTrial]) -> list[Trial]:
    """The trials the tuner reads: every entry but the inconclusive windows, in order."""
    return [t for t in (trial_from_status(e) for e in history) if t is not None]


def conclusive(history: Sequence[TuningTrial]) -> list[TuningTrial]:
    return [e for e in history if e.outcome != "inconclusive"]


_PHASE: dict[str, Literal["Converged", "Stopped", "Failed"]] = {
    "converged": "Converged", "maxTrials": "Stopped", "pinned": "Stopped", "sloUnreachable": "Stopped",
    "allFailed": "Failed"}


def phase_of(verdict: Verdict) -> Literal["Converged", "Stopped", "Failed"]:
    return _PHASE[verdict.reason]


def verdict_status(verdict: Verdict, history: Sequence[TuningTrial]) -> TuningVerdict:
    """The verdict as status.tuning.verdict: its evidence named by the history's trial numbers."""
    entries = conclusive(history)
    return TuningVerdict(reason=verdict.reason, sloMet=verdict.slo_met,
                         maxBatchSize=verdict.schedule.maxBatchSize if verdict.schedule else None,
                         limit=verdict.limit, trials=[entries[i].trial for i in verdict.evidence],
                         claimBasis=verdict.basis, proofTrials=[entries[i].trial for i in verdict.proof],
                         pooled=verdict.pooled, noise=verdict.noise, message=verdict.message)


def model_status(problem: TuningProblem, trials: Sequence[Trial],
                 earlier: Sequence[Trial] = ()) -> OnlineModelStatus | None:
    """status.tuning.model: the engine model as the tuner calibrates it on these trials, in physical units."""
    model = online_model(problem, trials, earlier)
    if model is None:
        return None
    cal = model.calibration
    value, sd = cal.params.model_dump(), cal.params_sd.model_dump()

    def finite(x: float) -> float | None:
        return x if math.isfinite(x) else None

    return OnlineModelStatus(
        windows=len(cal.errors), earlierWindows=model.earlier, noise=cal.noise, adequate=model.adequacy.ok,
        adequacy=model.adequacy.why,
        parameters=[ModelParameter(name=name, value=finite(value[name]), sd=finite(sd[name])) for name in value],
        lastErrors=[e.relative for e in cal.errors[-8:]])
