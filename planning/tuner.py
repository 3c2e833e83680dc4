"""The closed-loop tuner of the ScheduleConfig (docs/operator.md, "Autotuning"): the MindIE tuning guide's three best
practices, in fewer benchmark runs than the guide's manual +-100 steps.

Pure: `decide(problem, trials, earlier)` reads the whole history of trials (and the previous round's last windows,
which only the engine model reads) and returns the next schedule to measure or a verdict. It keeps no state, so
the operator resumes from `status.tuning.history` (`tuning_status.trial_from_status`), and the simulator drives the
very same function. No I/O, no clock, no randomness.

The tuner owns four knobs: it searches maxBatchSize, and derives maxPrefillBatchSize and maxPrefillTokens from it
by the plan's rules. supportSelectBatch is the plan's for throughput and decodeLatency (on); firstTokenAndDecode
searches it (`select_batch_arm`): prefill first (off) alone when MindIE's throughput policy would hold prompts past
the TTFT bound even at the TPOT bound (`decode_first_ttft_ms`); else decode first (on) until a batch misses the
TTFT bound while meeting TPOT, or the search ends with one missing it, then prefill first with the trials left, and
the verdict is the better proven claim. A knob pinned in `spec.engine.schedule` keeps its value.

Measurements decide, fits only propose. The fits (`fits.py`) choose the next batch to measure; every judgement of a
batch is the judge's (`TuningProblem.claim`) on the windows measured at that very batch, pooled, against the noise
estimated from the data (repeats, the isotonic fit's residuals) and the bias the windows at one batch share (the
batches' scatter around a smooth curve beyond that noise). A batch never measured is never best or converged.

- `decodeLatency` / `firstTokenAndDecode`: the most pooled output tokens/s among the batches whose windows meet every
  bound with no more than `tolerance` of doubt left by the noise ("certain"), as the MindIE guide defines its
  practices: the highest throughput under the latency constraint. That is the largest certain batch while throughput
  rises with the batch, so the search first climbs to it, as the guide does. It keeps a bracket: the largest certain
  batch, and the smallest batch above it that missed (or failed, or stays uncertain after its repeats). It proposes
  where the smoothed latency reaches the level a batch must measure to be certain after PLANNED_WINDOWS windows, never
  outside the bracket, at most MAX_JUMP above the certain end or MAX_DROP below the missing one; a batch that meets
  but is not yet certain is measured again (at most MAX_REPEATS windows). Once the bracket closes, when a batch below
  the boundary measured more tok/s than the boundary beyond the noise and `tolerance` (a KV-starved cache, a CPU
  engine), the throughput search runs within [floor, boundary]. The plan's minimum is no floor: the search goes down
  to 1.
- `throughput`: the most output tokens/s, which rises then falls past a peak; under noise the verdict is the batch
  where a parabola in log batch through every batch's pooled tok/s peaks, among those not behind the most measured
  beyond the noise and `tolerance` (through fewer than four batches: the smallest within `tolerance` of the most
  measured). The tuner moves out until the peak is bracketed, then jumps to the vertex of the parabola through the
  best point and its neighbours, and stops when that vertex promises less than a third of `tolerance` more
  throughput, or lies within `tolerance` of the best batch; under noise, not before four batches are measured.
  Any TTFT/TPOT bounds cap the batch; under them, only a batch certain to meet them can be the verdict.
- Failures (errors, KV exhaustion, a preemption storm, engines restarting or losing readiness, a failed load Job) cap
  the search below the failed batch; a failure at the smallest batch tried sends it lower, halving, down to 1.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from npuserve.planning.api import BatchLimit, ClaimBasis, FailureReasonName, StopReason, TrialMetrics

from . import fits
from .engine_model import Adequacy, Calibration, Window, adequate, calibrate, predict
from .problem import (
    LATENCY_OBJECTIVES,
    OWNED_KNOBS,
    Claim,
    LatencyName,
    Noise,
    TunedSchedule,
    TuningProblem,
    pooled,
    t_quantile,
    with_findings,
)

# Factors of maxBatchSize where no fit can say yet: the outward move from one point (the guide's +100 from 200),
# the longest jump up from a batch that meets, the longest drop below one that misses, the back-off below a failure.
OUTWARD = 1.5
MAX_JUMP = 2.0
MAX_DROP = 2.0
BACKOFF = 0.5
MAX_REPEATS = 4  # windows at one batch at most, when the noise leaves its verdict open
PLANNED_WINDOWS = 3  # a noisy search aims where a batch would be certain after this many windows
# A claim from the engine model: its one-sided CLAIM_CONFIDENCE interval on the true TPOT under the bound itself (no
# `tolerance`, which a claim on windows has); and, as the model's interval leaves out its own bias (the sum for the
# cost model's max, a knee too small for the adequacy test), corroborated by the batch's own windows: their interval
# within CORROBORATION x `tolerance` of the bound. (Within `tolerance`, the model claimed a false SLOMet on the 32B
# setup and on the misspecified engine at 20% noise, 5.3% and 5.8% over the bound.)
CORROBORATION = 2.0


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Trial(_Model):
    """One trial: the schedule applied, and the window it measured, or why none came (the engines or the load
    failed during it)."""

    schedule: TunedSchedule
    metrics: TrialMetrics | None = None
    failure: FailureReasonName | None = None
    detail: str = Field(default="", description="the failure without metrics, for people")

    @field_validator("metrics")
    @classmethod
    def _judge_findings(cls, metrics: TrialMetrics | None) -> TrialMetrics | None:
        # A measurement brings facts; kvExhausted is the judge's, so a trial's window always shows the judge's word.
        return None if metrics is None else with_findings(metrics)

    @model_validator(mode="after")
    def _check(self) -> Trial:
        if self.metrics is None and self.failure is None:
            raise ValueError("a trial has metrics, a failure, or both")
        if self.metrics is not None and self.failure is not None:
            raise ValueError("a trial with metrics is judged from them: no failure besides")
        return self


class NextTrial(_Model):
    kind: Literal["trial"] = "trial"
    schedule: TunedSchedule
    reason: str
    repeat_of: int | None = Field(default=None, description="index of the trial this one measures again")


class Verdict(_Model):
    kind: Literal["verdict"] = "verdict"
    reason: StopReason
    best: int | None = Field(description="index of the best trial (the closest when no batch met the SLO)")
    schedule: TunedSchedule | None = Field(description="the best trial's schedule; for `pinned`, the pinned one")
    slo_met: bool | None = Field(description="the best schedule is proven to meet every bound (`basis`); None when "
                                             "none was measured")
    evidence: tuple[int, ...] = Field(default=(), description="the trials measured at the best schedule")
    basis: ClaimBasis | None = Field(default=None, description="what proves slo_met=True: the best schedule's own "
                                                               "windows, or a larger batch's (`proof`)")
    proof: tuple[int, ...] = Field(default=(), description="the trials whose windows prove it")
    pooled: TrialMetrics | None = Field(default=None, description="their windows pooled")
    limit: BatchLimit = "none"
    noise: float | None = Field(default=None, description="the binding figure's relative noise, as estimated")
    message: str


Decision = NextTrial | Verdict


def failure_of(problem: TuningProblem, trial: Trial) -> str | None:
    """Why a trial counts as failed (the search stays below its batch), or None."""
    if trial.metrics is None:
        return trial.detail or str(trial.failure)
    judgement = problem.judge(trial.metrics)
    return judgement.why if judgement.failure is not None else None


# --- the history, digested -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Proof:
    """What makes a batch certain to meet every bound: its own windows (`windows`), or a larger batch's that are
    (`monotone`: latency never falls as the batch grows, so a batch proven to meet the bounds proves every smaller
    one; never the other way)."""

    basis: ClaimBasis
    batch: int  # the batch whose windows prove it: itself for `windows`


@dataclass(frozen=True)
class Point:
    """The usable windows at one batch (oldest first), the judge's claim on them, and what proves the batch certain
    to meet every bound (None: nothing does yet)."""

    batch: int
    trials: tuple[int, ...]
    windows: tuple[TrialMetrics, ...]
    claim: Claim
    proof: Proof | None = None

    @property
    def samples(self) -> int:
        return sum(m.samples for m in self.windows)

    @property
    def throughput(self) -> float:
        return pooled(self.windows).outputTokensPerSecond

    @property
    def ratio(self) -> float:
        return self.claim.judgement.worst


@dataclass(frozen=True)
class OnlineModel:
    """The engine model calibrated on every usable window (docs/operator.md, "The online model"), and its adequacy
    test: only an adequate model proposes trials or proves claims."""

    calibration: Calibration
    adequacy: Adequacy
    earlier: int = 0  # windows of the previous round among those it is fitted to

    @property
    def usable(self) -> bool:
        return self.adequacy.ok


@dataclass(frozen=True)
class History:
    trials: Sequence[Trial]
    relevant: tuple[int, ...]  # the trials of this problem: the schedule it would set at their batch
    points: tuple[Point, ...]  # usable, by batch, below the lowest failure
    failed: dict[int, str]  # batch -> why
    thin: dict[int, int]  # batch -> pooled requests, short of min_samples
    counts: dict[int, int]  # batch -> trials measured there
    cap: int  # the highest batch worth trying: below the lowest failure
    noise: Noise
    model: OnlineModel | None = None  # the calibrated engine model (problem.engine), None without one

    def measured(self, batch: int) -> bool:
        return batch in self.counts

    def last_trial_at(self, batch: int) -> int:
        return max(i for i in self.relevant if self.trials[i].schedule.maxBatchSize == batch)

    def point(self, batch: int) -> Point | None:
        return next((p for p in self.points if p.batch == batch), None)


def _of(problem: TuningProblem, trial: Trial) -> bool:
    """Whether a trial is one of this problem's: in its range, at the schedule it would set at that batch."""
    b = trial.schedule.maxBatchSize
    return problem.floor <= b <= problem.batch_max and trial.schedule == problem.schedule_for(b)


def _digest(problem: TuningProblem, trials: Sequence[Trial], earlier: Sequence[Trial] = ()) -> History:
    # Trials of another problem (another objective, pinned value or range) say nothing about this one.
    relevant = tuple(i for i, t in enumerate(trials) if _of(problem, t))
    failed: dict[int, str] = {}
    usable: dict[int, list[int]] = {}
    counts: dict[int, int] = {}
    for i in relevant:
        t = trials[i]
        b = t.schedule.maxBatchSize
        counts[b] = counts.get(b, 0) + 1
        why = failure_of(problem, t)
        if why is not None:
            failed.setdefault(b, why)
        else:
            usable.setdefault(b, []).append(i)
    cap = min(failed, default=problem.batch_max + 1) - 1
    kept: dict[int, list[int]] = {}
    thin: dict[int, int] = {}
    for b, indices in sorted(usable.items()):
        if b > cap:
            continue  # a lower batch failed since: the failure wins
        samples = sum(_metrics(trials[i]).samples for i in indices)
        if samples < problem.min_samples and counts[b] < MAX_REPEATS:
            thin[b] = samples
            continue
        # A window of fewer than min_samples requests measured a part of the load (traffic starting, requests longer
        # than the window): once the batch has full windows they speak for it alone. Pooled, its tok/s (2 requests
        # where the next window had 69) once set the noise estimate to +-106% and nothing could be claimed.
        full = [i for i in indices if _metrics(trials[i]).samples >= problem.min_samples]
        kept[b] = full or indices
    windows = {b: [_metrics(trials[i]) for i in ix] for b, ix in kept.items()}
    noise = _noise(problem, windows)
    model = _model(problem, trials, kept, windows, noise, earlier)
    noise = _with_model_noise(problem, noise, model)
    noise = replace(noise, batch_bias=_batch_bias(problem, windows, noise))
    points = tuple(Point(b, tuple(ix), tuple(windows[b]), problem.claim(windows[b], noise)) for b, ix in kept.items())
    return History(trials, relevant, _proven(problem, points, model, noise), failed, thin, counts, cap, noise, model)


def _model(problem: TuningProblem, trials: Sequence[Trial], kept: dict[int, list[int]],
           by_batch: dict[int, list[TrialMetrics]], noise: Noise, earlier: Sequence[Trial]) -> OnlineModel | None:
    """The engine model fitted to every usable window's TPOT at the SLO's statistic, oldest first (the newest weigh
    most). Its adequacy test holds its residuals against the noise the repeats at one batch show (TPOT's or, when
    larger, tok/s's: the machine's noise; pooled with the prior), not against the scatter around a smooth curve: a
    knee the model cannot follow would inflate that figure and hide itself in it.

    The previous round's last windows (`earlier`, same problem: same engine, same traffic shape) come first, the
    oldest, while the model passes its adequacy test with them: a round started by a change of load then knows the
    engine's TPOT at the old running batch and at the new one from its first window, and the model puts the crossing
    between them. When the test fails with them (the lengths changed, the engine changed), the round's own windows
    alone are fitted, as without them."""
    if problem.engine is None:
        return None
    this_round = [trials[i] for i in sorted(i for ix in kept.values() for i in ix)]
    carried = [t for t in earlier if _of(problem, t) and t.metrics is not None and failure_of(problem, t) is None
               and t.metrics.samples >= problem.min_samples]
    if noise.exact:
        reference = 0.0
    else:
        series = _log_series(by_batch,
                             lambda m: problem.latency(m, "tpot"))
        reference, _ = fits.noise_estimate(problem.noise / math.sqrt(3), [fits.scatter(series, rising=False)])
        reference = max(reference, noise.throughput)  # the machine's noise, as the tok/s repeats measure it
    if carried:
        calibration = calibrate(problem.engine, _windows(problem, carried + this_round), reference)
        adequacy = adequate(calibration)
        if adequacy.ok:
            return OnlineModel(calibration, adequacy, earlier=len(carried))
    calibration = calibrate(problem.engine, _windows(problem, this_round), reference)
    return OnlineModel(calibration, adequate(calibration))


def _windows(problem: TuningProblem, trials: Sequence[Trial]) -> list[Window]:
    """The engine model's windows of these trials (oldest first): TPOT at the SLO's statistic, at the running batch."""
    return [Window(running_batch(t), problem.latency(_metrics(t), "tpot"), len(trials) - 1 - n)
            for n, t in enumerate(trials)]


def _with_model_noise(problem: TuningProblem, noise: Noise, model: OnlineModel | None) -> Noise:
    """The TPOT noise the claims use: the model-free estimate, or, while the model passes its adequacy test, its
    residuals' when they scatter more (a few windows at one batch that happen to agree must not make a claim certain
    that the windows at the batches around it contradict). A model that fails the test says nothing of the noise:
    its residuals are its misfit."""
    if model is None or not model.usable or noise.exact or "tpot" not in noise.latency:
        return noise
    cal = model.calibration
    if cal.noise <= noise.latency["tpot"]:
        return noise
    return Noise(latency={**noise.latency, "tpot": cal.noise}, throughput=noise.throughput,
                 df=min(noise.df, cal.noise_df))


def _proven(problem: TuningProblem, points: Sequence[Point], model: OnlineModel | None,
            noise: Noise) -> tuple[Point, ...]:
    """Each point with its proof. Below the lowest batch whose windows miss a bound (a miss below a meet breaks the
    monotone shape, and the miss wins): a batch whose own windows are certain proves itself; so does one that meets
    as measured whose TPOT the adequate model puts certainly under the bound (any TTFT bound still by its windows);
    and a proven batch proves every smaller batch measured. Above that miss, nothing is proven."""
    ceiling = min((p.batch for p in points if not p.claim.meets), default=math.inf)
    proofs: dict[int, Proof] = {p.batch: Proof("windows", p.batch) for p in points
                                if p.claim.certain and p.batch < ceiling}
    for p in points:
        if p.batch not in proofs and p.batch < ceiling and _model_proves(problem, p, model, noise):
            proofs[p.batch] = Proof("model", p.batch)
    proven = sorted(proofs)
    out: list[Point] = []
    for p in points:
        above = next((b for b in proven if b > p.batch), None)
        proof = proofs.get(p.batch) or (Proof("monotone", above) if above is not None else None)
        out.append(replace(p, proof=proof))
    return tuple(out)


def _model_proves(problem: TuningProblem, p: Point, model: OnlineModel | None, noise: Noise) -> bool:
    """Whether the calibrated model proves that `p`'s true TPOT meets its bound: the model passes its adequacy test,
    `p`'s own windows meet every bound as measured and their TPOT interval lies within CORROBORATION x `tolerance`
    of the bound, the upper end of the model's one-sided interval on TPOT at `p` (the parameters' uncertainty,
    Student-t at the model's degrees of freedom) is under the bound, and any TTFT bound is certain on the windows."""
    bound = problem.tpot_ms
    if model is None or not model.usable or noise.exact or bound is None or not p.claim.meets:
        return False
    if any(u > 1 + problem.tolerance for k, u in p.claim.upper.items() if k != "tpot"):
        return False
    if p.claim.upper.get("tpot", 0.0) > 1 + CORROBORATION * problem.tolerance:
        return False
    return _model_upper(model, p.batch) <= bound


def _model_upper(model: OnlineModel, batch: float) -> float:
    """The upper end of the model's one-sided CLAIM_CONFIDENCE interval on the true TPOT at `batch` (ms)."""
    tpot, sd = predict(model.calibration, batch)
    return tpot + t_quantile(model.calibration.noise_df) * sd


def _metrics(trial: Trial) -> TrialMetrics:
    assert trial.metrics is not None
    return trial.metrics


def running_batch(trial: Trial) -> float:
    """The batch a window's decode steps ran at, as the engine model means it: maxBatchSize under a load that fills
    it, else the requests in flight per pod the window measured (Little's law; at least 1). A closed loop of 24 users
    runs 24 sequences at maxBatchSize 64 as at 32: told 64 and 32, the model would fit a TPOT curve that is flat there
    and put the SLO's crossing far off. The simulator's windows fill their batch (no in-flight figure)."""
    return _running(trial.schedule.maxBatchSize, _metrics(trial))


def _running(batch: int, metrics: TrialMetrics) -> float:
    in_flight = metrics.inFlightPerPod
    return batch if in_flight is None else max(1.0, min(float(batch), in_flight))


def _ran_at(p: Point) -> float:
    """The running batch of a point's windows, pooled (the mean): its maxBatchSize when the load fills it."""
    return sum(_running(p.batch, m) for m in p.windows) / len(p.windows)


def _noise(problem: TuningProblem, windows: dict[int, list[TrialMetrics]]) -> Noise:
    """The noise of one window: none for a deterministic engine (problem.noise 0), else estimated per figure from
    the repeats (and, for a latency, a smooth curve's residuals), pooled with the prior. Once repeats have measured
    it, a latency's is never taken below the throughput's: one window's noise is the machine's, and a latency that
    looks steadier than the throughput of the same windows is luck (one run of 480 claimed a batch 10% over its TPOT
    bound from three +-20% windows within 1.5% of each other, their tok/s scattering 11%)."""
    if problem.noise == 0:
        return Noise(latency={k: 0.0 for k in problem.bounds()}, throughput=0.0)
    prior = problem.noise / math.sqrt(3)  # the standard deviation of a uniform +-noise
    tps = _log_series(windows, lambda m: m.outputTokensPerSecond)
    tps_scatter = fits.scatter(tps, rising=False)
    throughput, tps_df = fits.noise_estimate(prior, [tps_scatter])
    floor = throughput if tps_scatter[1] > 0 else 0.0  # only once repeats have measured the machine's noise
    latency: dict[LatencyName, float] = {}
    dfs: list[float] = []
    for key in problem.bounds():
        series = _log_series(windows, functools.partial(problem.latency, key=key))
        estimate, df = fits.noise_estimate(prior, [fits.scatter(series, rising=True)])
        latency[key] = max(estimate, floor)
        dfs.append(df)
    return Noise(latency=latency, throughput=throughput, df=min(dfs, default=tps_df))


def _batch_bias(problem: TuningProblem, windows: dict[int, list[TrialMetrics]],
                noise: Noise) -> dict[LatencyName, float]:
    """Each bound's latency bias shared by the windows at one batch (`fits.batch_bias`), against the noise the claims
    use: none for a deterministic engine."""
    if noise.exact:
        return {}
    return {k: fits.batch_bias(_log_series(windows, functools.partial(problem.latency, key=k)), noise.latency[k])
            for k in problem.bounds()}


def _log_series(windows: dict[int, list[TrialMetrics]], figure: Callable[[TrialMetrics], float]) -> fits.Series:
    """One figure of the windows, in logs (the noise is multiplicative), by batch."""
    batches = tuple(sorted(windows))
    return fits.Series(batches, tuple(tuple(math.log(max(figure(m), 1e-9)) for m in windows[b]) for b in batches))


# A window whose requests in flight per pod reach this share of its maxBatchSize filled it: turnover keeps the mean a
# little under a batch the load fills (the operator tests' engine: 0.9). Under it, the load ran what it sent.
FILLED = 0.75


def _placed_at(p: Point) -> float:
    """Where a latency fit places a point: its maxBatchSize, or the sequences it ran when its load left the batch
    well short (`FILLED`)."""
    ran = _ran_at(p)
    return ran if ran < FILLED * p.batch else float(p.batch)


def _latency_series(problem: TuningProblem, points: Sequence[Point], key: LatencyName,
                    place: Callable[[Point], float]) -> fits.Series:
    """A latency over its bound, in logs, by where `place` puts each point."""
    bound = problem.bounds()[key]
    ordered = sorted(points, key=place)
    return fits.Series(tuple(place(p) for p in ordered),
                       tuple(tuple(math.log(max(problem.latency(m, key), 1e-9) / bound) for m in p.windows)
                             for p in ordered))


def _latency_crossing(problem: TuningProblem, points: Sequence[Point], key: LatencyName, level: float) -> float:
    """The maxBatchSize where a latency's fit reaches `level`. A load that does not fill a batch runs its sequences
    at any batch above, so such a point is placed at what it ran (`_placed_at`): the online e2e's round 2 (24 users a
    pod) placed 64, which ran 18.75 sequences, at 64, and the crossing between 11 (53.6 ms) and it at 17, which
    missed at 84 ms; at 18.75 the crossing is at 12. Below the sequences such a load sends, a batch fills, so that
    crossing is a maxBatchSize. Past them, no batch runs more under this load, and the sequences say nothing of
    where a batch would cross: the fit by maxBatchSize decides (round 1's 2 users a pod, where every batch ran 1.3-1.9
    sequences, crept up one batch a trial on a crossing at 38 sequences)."""
    crossing = fits.level_crossing(_latency_series(problem, points, key, _placed_at), level, key)
    short = [x for p in points if (x := _placed_at(p)) < p.batch]  # the sequences of the points left short
    if short and crossing > max(short):
        return fits.level_crossing(_latency_series(problem, points, key, lambda p: float(p.batch)), level, key)
    return crossing


# --- the search ----------------------------------------------------------------------------------------------------


def decide(problem: TuningProblem, trials: Sequence[Trial], earlier: Sequence[Trial] = ()) -> Decision:
    """The next trial to measure, or the verdict, from the problem and every trial so far (oldest first).

    Only the trials of this problem count (the schedule it would set at their batch): after a change of objective
    or of a pinned knob, the earlier ones are left out, of the fits and of `max_trials` alike. `earlier`: the
    previous round's last windows of this problem, which only the engine model reads (`_model`).

    firstTokenAndDecode searches supportSelectBatch too, unless it is pinned (`_arms`): decode first (on) until
    TTFT stops it (`_ttft_bound`), then prefill first (off) with the trials left, the verdict the better of the two
    searches' claims; or prefill first alone where decode first cannot meet TTFT (`decode_first_ttft_ms`)."""
    if "maxBatchSize" in problem.pinned:
        which = "every knob the tuner owns is" if set(OWNED_KNOBS) <= set(problem.pinned) else "maxBatchSize is"
        return Verdict(reason="pinned", best=None, schedule=problem.schedule_for(problem.batch_start),
                       slo_met=None, limit="pinned", message=f"{which} pinned in spec.engine.schedule: nothing to tune")
    start, turn = _arms(problem)
    h, first = _decide(start, trials, earlier)
    if turn is None or not _ttft_bound(h, first):
        return first
    _, second = _decide(turn.model_copy(update={"max_trials": problem.max_trials - len(h.relevant)}), trials,
                        earlier)
    if isinstance(second, NextTrial):
        return second
    if isinstance(first, NextTrial):  # decode first left open: its claims as they stand
        first = _verdict(start, h, second.reason, "supportSelectBatch on (decode first) until a batch missed the "
                         "TTFT bound")
    return _better(second, first)


def _decide(problem: TuningProblem, trials: Sequence[Trial], earlier: Sequence[Trial]) -> tuple[History, Decision]:
    h = _digest(problem, trials, earlier)
    decision = _repeat(problem, h) or _search(problem, h)
    if isinstance(decision, NextTrial) and len(h.relevant) >= problem.max_trials:
        return h, _verdict(problem, h, "maxTrials", f"{problem.max_trials} trials spent (next: {decision.reason})")
    return h, decision


def _arms(problem: TuningProblem) -> tuple[TuningProblem, TuningProblem | None]:
    """The search's first problem, and the one it turns to when TTFT stops the first (None: it never turns).
    firstTokenAndDecode without supportSelectBatch pinned: decode first, then prefill first; or prefill first alone
    when decode first would hold prompts past the TTFT bound even at the TPOT bound (`decode_first_ttft_ms`)."""
    if problem.objective != "firstTokenAndDecode" or "supportSelectBatch" in problem.pinned:
        return problem, None
    on, off = _pin_select(problem, True), _pin_select(problem, False)
    assert problem.ttft_ms is not None
    wait = decode_first_ttft_ms(problem)
    return (off, None) if wait is not None and wait > problem.ttft_ms else (on, off)


def decode_first_ttft_ms(problem: TuningProblem) -> float | None:
    """The mean wait before a prompt's prefill under MindIE's throughput policy (supportSelectBatch on,
    docs/engine.md) with TPOT at its bound, in a saturated engine (None without the engine's shape or a TPOT bound).

    The policy prefills once the accumulated decodeTimeMsPerReq x (maxBatchSize - running) over the decode steps
    since the last prefill reaches prefillTimeMsPerReq x running. Of b running sequences, b / mean output finish per
    step, so after s steps the empty slots have summed to b s^2 / (2 x mean output): a prefill every
    s = sqrt(2 x mean output x prefillTimeMsPerReq / decodeTimeMsPerReq) steps, whatever b, and a prompt arriving
    in between waits s / 2 steps of TPOT on average. The guide's workload (346 tokens out, 150 / 50 ms): every 46
    steps, 1.1 s at 50 ms, which the simulator shows (1.26 s mean TTFT at maxBatchSize 145, prefills included)."""
    if problem.engine is None or problem.tpot_ms is None:
        return None
    base = problem.base
    if base.decodeTimeMsPerReq <= 0:
        return math.inf  # the empty slots never add up: the policy never prefills while anything runs
    steps = math.sqrt(2 * problem.engine.mean_output_tokens * base.prefillTimeMsPerReq / base.decodeTimeMsPerReq)
    return steps / 2 * problem.tpot_ms


def _ttft_bound(h: History, decision: Decision) -> bool:
    """Whether TTFT stops the decode-first search, so that prefill first (TTFT lower, TPOT higher at each batch) may
    serve more: a batch measured in it misses the TTFT bound while meeting TPOT, as pooled (TTFT binds below where
    TPOT does), or the search ended before max_trials with a batch missing TTFT. When TPOT alone stops it, prefill
    first cannot serve more: its TPOT is higher at every batch. `h`: the decode-first search's digest, whose points
    are judged by the judge on their pooled windows."""
    if isinstance(decision, Verdict) and decision.reason == "maxTrials":
        return False
    ended = isinstance(decision, Verdict)
    return any(r["ttft"] > 1 and (ended or r["tpot"] <= 1) for r in (p.claim.judgement.ratios for p in h.points))


def select_batch_arm(problem: TuningProblem, trials: Sequence[Trial],
                     earlier: Sequence[Trial] = ()) -> TuningProblem:
    """The problem the search is in now. firstTokenAndDecode without supportSelectBatch pinned searches with it on
    first (decode first: a lower TPOT at each batch, so a larger batch under the TPOT bound, for a higher TTFT; on
    the guide's setup maxBatchSize 145 against 122 and 11% more tok/s under TTFT 8 s and TPOT 50 ms), and with it
    off once TTFT stops that search (`_ttft_bound`), or from the start where decode first cannot meet TTFT
    (`_arms`). Each arm is the problem with the knob pinned, so each keeps its own trials, fits and claims."""
    start, turn = _arms(problem)
    return turn if turn is not None and _ttft_bound(*_decide(start, trials, earlier)) else start


def _pin_select(problem: TuningProblem, select: bool) -> TuningProblem:
    return problem.model_copy(update={"pinned": {**problem.pinned, "supportSelectBatch": select}})


def _better(first: Verdict, second: Verdict) -> Verdict:
    """Of two searches' verdicts, the one whose schedule is proven to meet the SLO with the most pooled tok/s (the
    first when neither is better), under the reason the search ended with; its message names the one it beat."""
    def key(v: Verdict) -> tuple[bool, float]:
        return v.slo_met is True, v.pooled.outputTokensPerSecond if v.pooled is not None else -math.inf

    if first.schedule is None or (second.schedule is not None and key(second) > key(first)):
        chosen, beaten = second.model_copy(update={"reason": first.reason}), first
    else:
        chosen, beaten = first, second
    if beaten.schedule is None:
        return chosen
    said = (f"maxBatchSize {beaten.schedule.maxBatchSize} with supportSelectBatch "
            f"{'on' if beaten.schedule.supportSelectBatch else 'off'}"
            + (f", {beaten.pooled.outputTokensPerSecond:.0f} tok/s" if beaten.pooled is not None else "")
            + (", proven to meet the SLO" if beaten.slo_met else ", not proven to meet the SLO"))
    return chosen.model_copy(update={"message": f"{chosen.message}; chosen over {said}"})


def _propose(problem: TuningProblem, batch: int, reason: str) -> NextTrial:
    return NextTrial(schedule=problem.schedule_for(batch), reason=reason)


def _again(problem: TuningProblem, h: History, batch: int, reason: str) -> NextTrial:
    return NextTrial(schedule=problem.schedule_for(batch), reason=reason, repeat_of=h.last_trial_at(batch))


def _repeat(problem: TuningProblem, h: History) -> NextTrial | None:
    """A repeat of a measurement that cannot be used yet: too few requests, or (throughput) a break of the shape it
    must have."""
    if h.thin:
        thin = min(h.thin)
        return _again(problem, h, thin, f"only {h.thin[thin]} requests measured at maxBatchSize {thin}, fewer "
                                        f"than {problem.min_samples}; measuring it again")
    if h.noise.exact or problem.objective != "throughput":
        return None  # the latency search repeats what its bracket needs (_boundary)
    slack = 2 * math.sqrt(2) * h.noise.throughput
    pts = h.points
    for a, mid, c in zip(pts, pts[1:], pts[2:], strict=False):
        if mid.throughput < min(a.throughput, c.throughput) * math.exp(-slack):
            once = [p for p in (a, mid, c) if len(p.windows) == 1]
            if once:
                p = max(once, key=lambda p: h.last_trial_at(p.batch))  # the newest disagrees with what was there
                return _again(problem, h, p.batch, f"throughput dips to {mid.throughput:.0f} tok/s at {mid.batch} "
                                                   f"between {a.batch} and {c.batch}; measuring {p.batch} again")
    return None


def _search(problem: TuningProblem, h: History) -> Decision:
    lo = problem.floor
    if h.cap < lo:
        return _verdict(problem, h, "allFailed", f"maxBatchSize {lo}, the smallest there is, failed ({h.failed[lo]})")
    if lo == problem.batch_max:
        if not h.measured(lo):
            return _propose(problem, lo, f"the range holds the one value {lo}")
        return _verdict(problem, h, "converged", f"the range holds the one value {lo}")
    if problem.objective == "throughput":
        decision = _peak(problem, h)
        return (_undecided_peak(problem, h) if isinstance(decision, Verdict) else None) or decision
    decision = _boundary(problem, h, h.cap)
    if isinstance(decision, Verdict) and decision.reason == "converged":
        return _below_the_boundary(problem, h) or decision
    return decision


def _below_the_boundary(problem: TuningProblem, h: History) -> Decision | None:
    """A latency objective maximises throughput under its bounds too: once the boundary is found, when a batch below
    it measured more tok/s than the boundary itself (throughput falls before latency binds: a KV-starved cache, a CPU
    engine), the peak search runs below the boundary, as the throughput objective's does below a missed bound. Only a
    fall beyond the noise and the tolerance starts it: its trials below, noisy too, could otherwise only cost windows
    (and a noisy miss there lowers the boundary)."""
    edge = _bracket(problem, h, h.cap).certain
    if edge is None or _throughput_below(problem, h, edge) is edge:
        return None
    decision = _peak(problem, h, edge.batch)
    return (_undecided_peak(problem, h, edge.batch) if isinstance(decision, Verdict) else None) or decision


def _throughput_below(problem: TuningProblem, h: History, edge: Point) -> Point:
    """The latency objectives' answer among the batches certain to meet the bounds: the boundary `edge`, unless a
    smaller one measured more tok/s beyond the noise and the tolerance. Where throughput does not depend on the batch
    (traffic-bound, online), the windows differ by noise alone, and noise must not move the verdict down."""
    below = max(_certain_up_to(h, edge.batch), key=lambda p: (p.throughput, p.batch))
    if below is edge:
        return edge
    return below if _lead(below, edge) > max(_lead_doubt(h, below, edge), problem.tolerance) else edge


def _most_throughput(problem: TuningProblem, h: History, shape: Sequence[Point], meeting: Sequence[Point],
                     most: Point) -> tuple[Point, Literal["most", "alike", "parabola"]]:
    """The throughput objective's answer, and the rule that chose it. Exact measurements (a deterministic engine):
    the most measured. Under noise, pooled over batches: of the batches that meet any bounds and whose own windows
    are not behind the most measured beyond the noise and `tolerance`, the one where the parabola in log batch
    through every batch's pooled tok/s (`shape`: those below any miss or failure) peaks. The most measured is
    often a batch past the peak or below it by luck: past the peak a curve falls slowly, less than one window's noise
    (the 32B setup's 384 gives 1720 tok/s and 576 gives 1596; 576 out-measured 384 in 6 of 20 runs at +-10%), and a
    batch's fixed bias (some batches run faster kernels than their neighbours) no repeat averages away; the parabola
    pools every batch's windows. Through fewer than four batches, or a parabola that does not bend down: the
    smallest batch whose tok/s lies within `tolerance` of the most, which also serves each request at a lower
    latency."""
    if h.noise.exact:
        return most, "most"
    series = _log_series({p.batch: list(p.windows) for p in shape}, lambda m: m.outputTokensPerSecond)
    smoothed = fits.parabola(series)
    if smoothed is None:
        alike = min((p for p in meeting if _lead(most, p) <= math.log(1 + problem.tolerance)), key=lambda p: p.batch)
        return alike, "alike"
    fitted = dict(zip(series.batches, smoothed, strict=True))
    level = [p for p in meeting if _lead(most, p) <= math.log(1 + problem.tolerance) + _lead_doubt(h, most, p)]
    return max(level, key=lambda p: fitted[p.batch]), "parabola"


def _lead(a: Point, b: Point) -> float:
    """How much more tok/s `a` measured than `b`, as a log ratio."""
    return math.log(a.throughput / max(b.throughput, 1e-9))


def _lead_doubt(h: History, a: Point, b: Point) -> float:
    """How large a lead of `a` over `b` the noise alone may make: the t-quantile of the log ratio of two pooled
    means, each over its own windows."""
    return t_quantile(h.noise.df) * h.noise.throughput * math.sqrt(1 / len(a.windows) + 1 / len(b.windows))


def _certain_up_to(h: History, top: int) -> list[Point]:
    """The points at or below `top` proven to meet every bound: the verdict's candidates."""
    return [p for p in h.points if p.batch <= top and p.proof is not None]


def _undecided_peak(problem: TuningProblem, h: History, top: int | None = None) -> NextTrial | None:
    """Before a throughput verdict: when the runner-up may, within the noise, be better than the best batch by more
    than `tolerance`, measure the one with fewer windows again (one lucky window must not choose the schedule)."""
    if h.noise.exact:
        return None
    top = h.cap if top is None else min(top, h.cap)
    missing = [p.batch for p in h.points if not p.claim.meets]
    if missing:
        top = min(top, min(missing) - 1)
    pts = sorted((p for p in h.points if p.batch <= top), key=lambda p: -p.throughput)
    if len(pts) < 2:
        return None
    best, second = pts[0], pts[1]
    # The runner-up cannot be better by more than the tolerance.
    if _lead(best, second) + problem.tolerance >= _lead_doubt(h, best, second):
        return None
    for p in sorted((best, second), key=lambda p: len(p.windows)):
        if len(p.windows) < MAX_REPEATS:
            return _again(problem, h, p.batch, f"{best.batch} ({best.throughput:.0f} tok/s) and {second.batch} "
                                               f"({second.throughput:.0f} tok/s) lie within the noise "
                                               f"({_noise_text(h)}); measuring {p.batch} again")
    return None


def _first(problem: TuningProblem, h: History, top: int) -> Decision:
    """The first usable trial: the plan's start, or well below the lowest failure (down to 1)."""
    lo = problem.floor
    if not h.failed:
        return _propose(problem, min(problem.batch_start, top), "the plan's starting point")
    f = min(h.failed)
    b = _unmeasured(h, max(lo, min(problem.batch_start, math.floor(f * BACKOFF))), lo, top)
    if b is None:
        return _verdict(problem, h, "allFailed", f"every batch below {f} was tried")
    return _propose(problem, b, f"backing off below maxBatchSize {f} ({h.failed[f]})")


def _unmeasured(h: History, target: int, lo: int, hi: int) -> int | None:
    """The unmeasured batch in [lo, hi] nearest `target`, or None."""
    target = min(max(target, lo), hi)
    for d in range(hi - lo + 1):
        for b in (target - d, target + d):
            if lo <= b <= hi and not h.measured(b):
                return b
    return None


@dataclass(frozen=True)
class _Bracket:
    """Where the answer of a latency search lies: above `certain` (the largest batch certain to meet every bound),
    below `upper` (the smallest batch above it that misses, fails, or stays uncertain after its repeats)."""

    certain: Point | None
    upper: int | None  # None: nothing above `certain` stops the search short of the range maximum
    upper_why: BatchLimit
    open: tuple[Point, ...]  # between them: points that meet as measured but are not certain yet


def _bracket(problem: TuningProblem, h: History, top: int) -> _Bracket:
    pts = [p for p in h.points if p.batch <= top]
    misses = [p for p in pts if not p.claim.meets]
    # A miss below a certain batch contradicts the monotone shape; the miss wins (a verdict must never be too high).
    ceiling = min((p.batch for p in misses), default=top + 1)
    certain = max((p for p in pts if p.proof is not None and p.batch < ceiling), key=lambda p: p.batch, default=None)
    floor = certain.batch if certain is not None else 0
    stops = [(p.batch, "slo") for p in misses if p.batch > floor]
    stops += [(p.batch, "slo") for p in pts if p.batch > floor and p.claim.meets and p.proof is None
              and len(p.windows) >= MAX_REPEATS]
    if top < problem.batch_max:
        stops.append((top + 1, "failure" if top == h.cap else "slo"))
    upper, why = min(stops, default=(None, "none"))
    opened = tuple(p for p in pts if floor < p.batch < (upper or top + 1) and p.claim.meets and p.proof is None)
    return _Bracket(certain, upper, why if upper is not None else "memory", opened)  # type: ignore[arg-type]


def _aim(problem: TuningProblem, h: History, first_below_a_miss: bool) -> dict[LatencyName, float]:
    """The log ratio a batch must measure to be certain after PLANNED_WINDOWS windows: 0 (the bound) when exact.
    `first_below_a_miss`: the drop from a miss while no batch is certain. Before any repeat has measured the noise,
    its quantile is at the degrees of freedom the estimate will have after the point's PLANNED_WINDOWS windows, which
    measure it: at the prior's one, t(1) = 12.7 aimed 17% under the bound, at half the answer (the 32B setup's 256
    to 128-133, where 219 meets it), and the climb back spent the budget. Only there: a climb from a certain batch
    aimed so near the bound proposes points that stay uncertain after their repeats (the guide's decodeLatency row
    fell from 17 to 13 of 20 within 5%), and so does a drop after repeats at the miss (two MoE runs of 20 ended
    without a claim)."""
    if h.noise.exact:
        return {k: 0.0 for k in problem.bounds()}
    unmeasured = first_below_a_miss and h.noise.df <= fits.PRIOR_DF  # no repeat has measured the noise yet
    df = h.noise.df + (PLANNED_WINDOWS - 1 if unmeasured else 0)
    spread = t_quantile(df) / math.sqrt(PLANNED_WINDOWS)
    return {k: min(0.0, math.log(1 + problem.tolerance) - spread * h.noise.latency[k]) for k in problem.bounds()}


def _target(problem: TuningProblem, h: History, pts: Sequence[Point], first_below_a_miss: bool) -> float:
    """The batch the smoothed latencies put at the aimed level: the lowest over the bounds. For TPOT, while the
    engine model is adequate, the largest batch the model would prove (the model proposes; the windows confirm)."""
    aim = _aim(problem, h, first_below_a_miss)
    crossings = {k: _latency_crossing(problem, pts, k, aim[k]) for k in problem.bounds()}
    if "tpot" in crossings and h.model is not None and h.model.usable and not h.noise.exact:
        crossings["tpot"] = _model_crossing(problem, h.model, aim["tpot"])
    return min(crossings.values())


def _model_crossing(problem: TuningProblem, model: OnlineModel, aim: float) -> float:
    """The largest batch in [1, batch_max] whose TPOT the model puts at the aimed level (a log ratio to the bound:
    where a batch would be certain after PLANNED_WINDOWS windows), 0 when none is. The model's mean, not its
    proof: while its doubt is wide, the batch it could prove now lies far below the answer."""
    assert problem.tpot_ms is not None
    limit = problem.tpot_ms * math.exp(aim)
    lo, hi = 0, problem.batch_max
    while lo < hi:  # the model's TPOT grows with the batch
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if predict(model.calibration, mid)[0] <= limit else (lo, mid - 1)
    return float(lo)


def _boundary(problem: TuningProblem, h: History, top: int) -> Decision:
    """The largest batch in [floor, top] that meets every bound, certainly."""
    lo, tol = problem.floor, problem.tolerance
    pts = [p for p in h.points if p.batch <= top]
    if not pts:
        return _first(problem, h, top)
    br = _bracket(problem, h, top)
    b_lo = br.certain.batch if br.certain is not None else None
    # Meets as measured, not yet certain: measure the highest such batch again, if it would improve the answer.
    for p in sorted(br.open, key=lambda p: -p.batch):
        if len(p.windows) < MAX_REPEATS and (b_lo is None or p.batch > b_lo * (1 + tol)):
            c = p.claim
            return _again(problem, h, p.batch, f"maxBatchSize {p.batch} meets the SLO as measured ({c.windows} "
                                               f"window(s), {p.ratio:.2f}x the bound) but the noise "
                                               f"({_noise_text(h)}) leaves it uncertain; measuring it again")
    retry = _uncertain_miss(problem, h, br)
    if retry is not None:
        return retry
    inversion = _inversion(problem, h, pts)
    if inversion is not None:
        return inversion
    if b_lo is not None and b_lo >= top:
        return _verdict(problem, h, "converged", f"maxBatchSize {top}, the largest worth trying, meets the SLO")
    if br.upper is not None and b_lo is not None and br.upper - 1 - b_lo <= _within(tol, b_lo):
        return _verdict(problem, h, "converged", f"{b_lo} meets the SLO and {br.upper} does not: within {tol:.0%}")
    if b_lo is None and br.upper is not None and br.upper <= lo:
        return _verdict(problem, h, "sloUnreachable", f"even maxBatchSize {lo}, the smallest there is, misses the SLO")
    guess = _target(problem, h, pts, first_below_a_miss=b_lo is None and br.upper is not None)
    gap = max(1, math.floor(tol * (b_lo or br.upper or lo)))  # the least move from a measured batch
    if b_lo is not None and br.upper is not None:
        low, high = b_lo + 1, br.upper - 1
        if guess <= b_lo and not h.noise.exact:
            # The fit sees nothing provable above b_lo yet: halve the bracket (geometrically), which either proves a
            # higher batch or closes the bracket. Its upper end is what the miss ran: a load that did not fill its
            # maxBatchSize runs the same sequences at any batch above (the online e2e's round 2, 24 users a pod,
            # halved between 11 and 64, whose windows ran 20.5 sequences, to 27, which ran them again). Only here:
            # the fit's own target may lie above it, where a load that nearly fills (turnover keeps the mean in
            # flight under the batch) runs more sequences than it.
            upper = _ran_upper(h, br.upper)
            target = round(math.sqrt(b_lo * upper))
            why = f"between {b_lo} (meets) and {_upper_text(br.upper, upper)} (does not), the fit proposes nothing: " \
                  "halving"
        else:
            target = min(max(round(guess), b_lo + gap), br.upper - gap)
            # A batch that closes the bracket whichever way it falls, when there is one: from it to the upper end,
            # or from the lower end to it, lies within tolerance.
            closes_if_met = next((t for t in range(b_lo + 1, br.upper) if br.upper - 1 - t <= _within(tol, t)), None)
            closes_if_missed = b_lo + 1 + _within(tol, b_lo)
            if closes_if_met is not None and closes_if_met <= closes_if_missed:
                target = min(max(round(guess), closes_if_met), closes_if_missed)
            why = f"the fit puts the SLO crossing at {guess:.0f}, between {b_lo} (meets) and {br.upper} (does not)"
        if br.upper > top:  # a failure above: never onto it, at most halfway (geometric)
            target = min(target, math.floor(math.sqrt(b_lo * br.upper)))
    elif b_lo is not None:
        low, high = b_lo + 1, top
        target = min(max(round(guess), b_lo + gap), math.floor(b_lo * MAX_JUMP))
        why = f"{b_lo} meets the SLO; the fit puts the crossing at {guess:.0f}"
    else:
        assert br.upper is not None
        low, high = lo, br.upper - 1
        # A tolerance below the fitted crossing: secants from above overshoot a convex latency, and a batch that
        # meets closes the bracket at once. The drop is from the batch the miss ran at: a load that does not fill
        # maxBatchSize runs the same sequences at any maxBatchSize above it. It is at most MAX_DROP while no adequate
        # model says where the crossing lies; an adequate one is followed there.
        missed = h.point(br.upper)
        ran = _ran_upper(h, br.upper)
        least = lo if h.model is not None and h.model.usable and not h.noise.exact else math.ceil(ran / MAX_DROP)
        target = max(min(math.floor(guess * (1 - tol)), ran - gap), least)
        said = (f"{br.upper} meets the SLO as measured but not beyond the noise after {MAX_REPEATS} windows"
                if missed is not None and missed.claim.meets else f"{br.upper} misses the SLO")
        why = f"{said}; the fit puts the crossing at {guess:.0f}"
        if guess < lo:  # the fit puts every batch above the bound: the smallest there is says whether any meets it
            target, why = lo, f"{said}; the fit puts the crossing below {lo}"
    b = _unmeasured(h, target, low, high) if low <= high else None
    if b is None:
        return _verdict(problem, h, "converged", f"no batch left to try between {b_lo} and {br.upper}")
    return _propose(problem, b, why)


def _ran_upper(h: History, upper: int) -> int:
    """The batch the bracket's upper end ran at: its maxBatchSize, or fewer when its load did not fill it (a failure
    or a batch not measured: `upper`)."""
    missed = h.point(upper)
    return min(upper, math.ceil(_ran_at(missed))) if missed is not None else upper


def _upper_text(upper: int, ran: int) -> str:
    return str(upper) if ran >= upper else f"{upper} (ran at {ran})"


def _uncertain_miss(problem: TuningProblem, h: History, br: _Bracket) -> NextTrial | None:
    """The bracket's upper end missed the TPOT bound as measured, within the noise, where the adequate engine model
    puts its TPOT under the bound: measure it again (up to MAX_REPEATS windows) when it lies more than `tolerance`
    above the certain end, so one unlucky window does not close the bracket below the answer. Only a repeat can turn
    it into a meet, and a meet is then claimed on every window. Without a model that disagrees, a miss stands (a
    repeat would cost a trial the search needs)."""
    if h.noise.exact or br.upper is None or h.model is None or not h.model.usable or problem.tpot_ms is None:
        return None
    p = h.point(br.upper)
    if p is None or p.claim.meets or p.claim.certain_miss or len(p.windows) >= MAX_REPEATS:
        return None
    if any(r > 1 for k, r in p.claim.judgement.ratios.items() if k != "tpot"):
        return None  # it misses another bound, which the model says nothing of
    if predict(h.model.calibration, _ran_at(p))[0] > problem.tpot_ms:
        return None
    if br.certain is not None and p.batch - 1 - br.certain.batch <= _within(problem.tolerance, br.certain.batch):
        return None
    return _again(problem, h, p.batch, f"maxBatchSize {p.batch} misses the SLO as measured ({p.ratio:.2f}x the bound, "
                                       f"{len(p.windows)} window(s)) but within the noise ({_noise_text(h)}); "
                                       "measuring it again")


def _inversion(problem: TuningProblem, h: History, pts: Sequence[Point]) -> NextTrial | None:
    """A batch that misses the SLO below one that meets it breaks the monotone shape of latency: with noise, measure
    the one of the two with fewer windows again (until MAX_REPEATS; then the miss wins)."""
    if h.noise.exact:
        return None
    misses = [p for p in pts if not p.claim.meets]
    for low in misses:
        above = [p for p in pts if p.batch > low.batch and p.claim.meets]
        if not above:
            continue
        high = max(above, key=lambda p: p.batch)
        redo = min((low, high), key=lambda p: (len(p.windows), -p.batch))
        if len(redo.windows) < MAX_REPEATS:
            return _again(problem, h, redo.batch, f"{low.batch} misses the SLO ({low.ratio:.2f}x the bound) but "
                                                  f"{high.batch} meets it ({high.ratio:.2f}x): latency never falls "
                                                  f"as the batch grows; measuring {redo.batch} again")
    return None


def _within(tol: float, batch: int) -> int:
    """How many batches above `batch` lie within tolerance of it."""
    return max(1, math.ceil(tol * batch))


def _noise_text(h: History) -> str:
    worst = max(h.noise.latency.values(), default=h.noise.throughput)
    return f"+-{worst:.1%} per window"


def _peak(problem: TuningProblem, h: History, top: int | None = None) -> Decision:
    """The batch of the most output tokens/s in [floor, cap] (and at most `top`), below any batch that misses a
    bound."""
    lo, tol = problem.floor, problem.tolerance
    top = h.cap if top is None else min(top, h.cap)
    missing = [p.batch for p in h.points if not p.claim.meets]
    if missing and min(missing) <= top:
        top = min(missing) - 1
    blocked = top < problem.batch_max  # a failure or a missed bound above
    pts = [p for p in h.points if p.batch <= top]
    if not pts:
        if h.points:  # every point measured misses a bound: find the largest batch that meets them
            return _boundary(problem, h, h.cap)
        return _first(problem, h, top)
    best = max(pts, key=lambda p: p.throughput)
    m, i = best.batch, pts.index(best)
    # The nearest batches known to be no better: measured neighbours, else past the ends of what may be tried.
    lower = pts[i - 1].batch if i > 0 else lo - 1
    upper = pts[i + 1].batch if i + 1 < len(pts) else top + 1
    if i == len(pts) - 1 and upper - 1 - m > tol * m:  # highest at the largest batch measured: go up
        vertex = _vertex(pts[-3:], best) if len(pts) >= 3 else None
        # Past the fitted peak by as much as the best point is short of it, so the next point brackets the peak.
        target = 2 * vertex[0] - m if vertex is not None and vertex[0] > m else m * OUTWARD
        b = min(max(round(target), math.ceil(m * (1 + 2 * tol))), math.floor(m * MAX_JUMP), top)
        if blocked:  # never onto a failure or a missed bound: at most halfway to it
            b = min(b, math.floor(math.sqrt(m * upper)))
        return _near(problem, h, b, m + 1, top, f"throughput still rising at {m} ({best.throughput:.0f} tok/s)")
    if i == 0 and m - lower - 1 > tol * m:  # highest at the smallest batch measured: go down
        vertex = _vertex(pts[:3], best) if len(pts) >= 3 else None
        target = 2 * vertex[0] - m if vertex is not None and vertex[0] < m else m / OUTWARD
        b = max(min(round(target), math.floor(m * (1 - 2 * tol))), math.ceil(m / MAX_JUMP), lo)
        return _near(problem, h, b, lo, m - 1, f"throughput higher at {m} ({best.throughput:.0f} tok/s) than below it"
                     if i + 1 < len(pts) else f"{m} is the smallest batch measured")
    # The peak lies between the batches around the best one.
    if upper - 1 - m <= tol * m and m - lower - 1 <= tol * m:
        return _verdict(problem, h, "converged", f"{m} is the best, and the batches around it lie within {tol:.0%}")
    near = pts[max(0, min(i - 1, len(pts) - 3)):][:3]
    vertex = _vertex(near, best) if len(near) == 3 else None
    if i == len(pts) - 1 and (vertex is None or vertex[0] >= m):
        return _verdict(problem, h, "converged", f"throughput rises up to {m}, the largest batch worth trying")
    if i == 0 and (vertex is None or vertex[0] <= m):
        return _verdict(problem, h, "converged", f"throughput falls from {m}, the smallest batch worth trying")
    below = max(lower, 1)
    halve = round(math.sqrt(m * upper)) if upper / m >= m / below else round(math.sqrt(m * below))
    if vertex is not None:
        v, peak = vertex
        gain = peak / best.throughput - 1
        said = f"{m} is within {max(gain, 0):.1%} of the fitted peak ({peak:.0f} tok/s at {v:.0f})"
        # Stop when the best point sits at the fitted peak, or the fit promises little more; but a parabola across
        # a wide gap misses a peak that falls off a cliff past it (KV pressure): then look into the gap first.
        few = not h.noise.exact and len(h.points) < fits.PEAK_FIT_POINTS
        if not few and (abs(v / m - 1) < tol or (gain < tol / 3 and max(upper / m, m / below) <= OUTWARD)):
            return _verdict(problem, h, "converged", said)
        if few and (abs(v / m - 1) < tol or gain < tol / 3):
            target, why = halve, f"{said}, but {len(h.points)} batches are too few to pool: halving the wider side"
        elif gain < tol / 3:
            target, why = halve, f"{said}, but the gap around it is wide: halving it"
        else:
            target, why = round(v), f"the fitted peak: {peak:.0f} tok/s at {v:.0f}"
    else:  # the points do not bend down (noise): halve the wider side, geometrically
        target, why = halve, f"no concave fit around {m}: halving the wider side"
    if blocked and i == len(pts) - 1:  # never onto a failure or a missed bound: at most halfway to it
        target = min(target, math.floor(math.sqrt(m * upper)))
    return _near(problem, h, target, lower + 1, upper - 1, why)


def _vertex(near: Sequence[Point], best: Point) -> tuple[float, float] | None:
    return fits.vertex([p.batch for p in near], [p.throughput for p in near], best.batch, best.throughput, MAX_JUMP)


def _near(problem: TuningProblem, h: History, target: int, low: int, high: int, why: str) -> Decision:
    """A trial at the unmeasured batch in [low, high] nearest `target`; converged when there is none."""
    b = _unmeasured(h, target, low, high)
    if b is None:
        return _verdict(problem, h, "converged", f"every batch in [{low}, {high}] is measured")
    return _propose(problem, b, why)


# --- the verdict ---------------------------------------------------------------------------------------------------


def _verdict(problem: TuningProblem, h: History, reason: StopReason, why: str) -> Verdict:
    """The verdict: the best schedule by the judge's claims on the windows measured at each batch."""
    pts = h.points
    noise = max(h.noise.latency.values(), default=h.noise.throughput) if not h.noise.exact else 0.0
    if not pts:
        return Verdict(reason="allFailed" if h.failed and reason != "maxTrials" else reason, best=None,
                       schedule=None, slo_met=None, noise=noise,
                       message=f"{why}; no trial gave a usable measurement")
    limit: BatchLimit
    edge: Point | None = None  # latency objectives: the largest batch certain to meet the bounds
    most: Point | None = None  # throughput: the batch that measured the most tok/s
    rule = "most"  # throughput: what chose the best batch (`_most_throughput`)
    if problem.objective in LATENCY_OBJECTIVES:
        # Throughput is the objective under the bounds too: the most tok/s among the batches certain to meet them,
        # which is the largest of them only while throughput rises with the batch.
        br = _bracket(problem, h, h.cap)
        edge = br.certain
        best = _throughput_below(problem, h, edge) if edge is not None else None
        limit = br.upper_why if best is edge else "throughputPeak"
    else:
        top = h.cap
        missing = [p.batch for p in pts if not p.claim.meets]
        if missing and min(missing) <= top:
            top = min(missing) - 1
        meeting = [p for p in pts if p.batch <= top and (p.proof is not None if problem.bounds() else p.claim.meets)]
        most = max(meeting, key=lambda p: p.throughput, default=None)
        best, rule = (_most_throughput(problem, h, [p for p in pts if p.batch <= top], meeting, most)
                      if most is not None else (None, "most"))
        limit = "none"
        if best is not None:
            # What lies next above the best batch: a failure, a miss of a bound, or a batch with less throughput.
            above = min([p.batch for p in pts if p.batch > best.batch] + [b for b in h.failed if b > best.batch],
                        default=None)
            uncertain = [p.batch for p in pts if problem.bounds() and p.proof is None]
            limit = ("memory" if best.batch == problem.batch_max else
                     "none" if above is None else  # nothing measured above it (the trials ran out)
                     "failure" if above in h.failed else
                     "slo" if above in missing or above in uncertain else "throughputPeak")
    if best is None:
        closest = min(pts, key=lambda p: (p.ratio, p.batch))
        i = h.last_trial_at(closest.batch)
        if reason == "converged":
            reason = "sloUnreachable"
        doubt = "" if not closest.claim.meets else (f", met as measured but not beyond the noise "
                                                    f"({_noise_text(h)}) in {closest.claim.windows} window(s)")
        return Verdict(reason=reason, best=i, schedule=h.trials[i].schedule, slo_met=False, noise=noise,
                       evidence=closest.trials, pooled=pooled(closest.windows),
                       message=f"{why}; closest: maxBatchSize {closest.batch} at {closest.ratio:.2f}x the bound{doubt}")
    if best.batch == problem.batch_max:
        limit = "memory"
    elif limit == "memory":  # nothing measured above the best batch stopped it (the trials ran out): not memory
        limit = "none"
    said = [f"{best.throughput:.0f} output tok/s"]
    said += [f"{k.upper()} {problem.statistic} {problem.latency(pooled(best.windows), k):.1f} ms"
             for k in problem.bounds()]
    said.append(f"{len(best.windows)} window(s)")
    nearest = min((p for p in pts if p.batch > best.batch), key=lambda p: p.batch, default=None)
    slo = "is not certain to meet the SLO" if nearest is not None and nearest.claim.meets else "misses the SLO"
    peak = "; throughput falls past it"
    if most is not None and most is not best and rule == "alike":
        peak = (f"; throughput rises no more than {problem.tolerance:.0%} past it (maxBatchSize {most.batch} "
                f"measured {most.throughput:.0f} tok/s): the smaller batch, for its lower latency")
    elif most is not None and most is not best:
        peak = (f"; the parabola through every batch's tok/s peaks there, of the batches measured (maxBatchSize "
                f"{most.batch} measured {most.throughput:.0f} tok/s, within the noise)")
    if edge is not None and edge is not best:
        peak += (f" (maxBatchSize {edge.batch}, the largest batch certain to meet the SLO, gives "
                 f"{edge.throughput:.0f} tok/s)")
    bound = {"memory": f"; {best.batch} is the memory bound (the plan's maximum: what the KV cache holds)",
             "slo": f"; a larger batch {slo}", "failure": f"; maxBatchSize {h.cap + 1} failed",
             "throughputPeak": peak, "pinned": "", "none": ""}[limit]
    i = h.last_trial_at(best.batch)
    basis, proof, proven = _proof_of(h, best)
    return Verdict(reason=reason, best=i, schedule=h.trials[i].schedule, slo_met=True, evidence=best.trials,
                   pooled=pooled(best.windows), limit=limit, noise=noise, basis=basis, proof=proof,
                   message=f"{why}; best: maxBatchSize {best.batch}, {', '.join(said)}{bound}{proven}")


def _proof_of(h: History, best: Point) -> tuple[ClaimBasis | None, tuple[int, ...], str]:
    """The verdict's proof: its basis, the trials behind it and, when they are not the best batch's own, what to
    say of them. A throughput verdict without bounds claims nothing beyond its windows' figures."""
    if best.proof is None:
        return None, (), ""
    if best.proof.basis == "windows":
        return "windows", best.trials, ""
    if best.proof.basis == "model" and h.model is not None:
        params = h.model.calibration.params
        return "model", best.trials, (f"; its TPOT proven by the engine model fitted to every window (bandwidth "
                                      f"{params.bandwidth_efficiency:.0%} of the datasheet; {h.model.adequacy.why})")
    by = h.point(best.proof.batch)
    assert by is not None
    return best.proof.basis, by.trials, (f"; certain to meet the SLO because maxBatchSize {by.batch} is (its "
                                         f"{len(by.windows)} window(s)) and latency never falls as the batch grows")


def online_model(problem: TuningProblem, trials: Sequence[Trial],
                 earlier: Sequence[Trial] = ()) -> OnlineModel | None:
    """The engine model as `decide` calibrates it on these trials (None without `problem.engine`): the model of
    the supportSelectBatch arm in play, for firstTokenAndDecode."""
    return _digest(select_batch_arm(problem, trials, earlier), trials, earlier).model


def best_so_far(problem: TuningProblem, trials: Sequence[Trial],
                earlier: Sequence[Trial] = ()) -> TunedSchedule | None:
    """The schedule to roll back to after a failed trial: the one the verdict would choose now (certain to meet the
    SLO, else the closest measured); None when nothing was measured yet."""
    if "maxBatchSize" in problem.pinned:
        return problem.schedule_for(problem.batch_start)
    start, turn = _arms(problem)
    verdict = _verdict(start, _digest(start, trials, earlier), "converged", "")
    if turn is not None:  # both searches' claims, as `decide` ranks them
        verdict = _better(_verdict(turn, _digest(turn, trials, earlier), "converged", ""), verdict)
    return verdict.schedule
