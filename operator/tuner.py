"""The closed-loop tuner of the ScheduleConfig (DESIGN.md 4.3): the MindIE tuning guide's three best practices,
in fewer benchmark runs than the guide's manual +-100 steps.

Pure: `next_step(problem, trials)` reads the whole history of trials and returns the next schedule to measure or a
verdict. It keeps no state, so the operator resumes from `status.tuning.history` (`trial_from_status`), and the
simulator drives the very same function. No I/O, no clock, no randomness.

The tuner owns four knobs: it searches maxBatchSize within the plan's range, and derives maxPrefillBatchSize,
maxPrefillTokens and supportSelectBatch from it by the plan's rules (DESIGN.md 4.1 steps 5 and 6). A knob pinned
in `spec.engine.schedule` keeps its value in every schedule the tuner proposes.

The search is one-dimensional, over integers:
- `decodeLatency` / `firstTokenAndDecode`: the largest batch whose TPOT (and TTFT) statistic meets the SLO. Each
  latency is fitted in log-log (the prior elasticity from one point, a secant from two, a parabola from three), the
  tuner jumps to the predicted crossing, then closes the bracket (largest batch meeting, smallest missing) to within
  `tolerance` with probes at its edges. With noisy measurements, from four points on, a line in log-log weighted
  around the crossing (its slope held near the prior) smooths the latencies; the tuner measures just below the
  fitted crossing until its standard error is within `tolerance`, and no single window decides a side.
- `throughput`: the most output tokens/s, which rises then falls past a peak. The tuner steps out until the peak is
  bracketed (aiming past the vertex of a parabola in log(batch) once it has three points), then jumps to the vertex
  of the parabola through the best point and its neighbours, and stops when that vertex promises less than a third
  of `tolerance` more throughput, or lies within `tolerance` of the best batch. Any TTFT/TPOT bounds cap the batch.
- Robustness: a trial with errors, KV exhaustion or a preemption storm fails, and the search stays below its batch;
  a trial with too few requests, or one that breaks the monotone shape by more than twice the noise, is measured
  again (repeats are averaged); a range minimum that misses the SLO ends the search as unreachable.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from npuserve.engine_contract import schedule_field
from npuserve.operator.api import (
    Objective,
    Plan,
    PlanSchedule,
    ScheduleKnobs,
    SLOSpec,
    Statistic,
    TuningStatus,
    TuningTrial,
)
from npuserve.operator.planner import MINDIE_MAX_BATCH_SIZE, planned_prefill_tokens

OWNED_KNOBS = ("maxBatchSize", "maxPrefillBatchSize", "maxPrefillTokens", "supportSelectBatch")
StopReason = Literal["converged", "maxTrials", "pinned", "sloUnreachable", "allFailed"]
LatencyName = Literal["ttft", "tpot"]

# Factors of maxBatchSize where no fit can say yet: the outward step from one point (the guide's +100 from 200),
# the longest single jump, and the back-off below a failed trial.
STEP = 1.5
MAX_JUMP = 2.0
BACKOFF = 0.75
# Elasticities (d log latency / d log batch) assumed from a single point. TPOT grows about linearly with a large
# fixed part (the guide: 47 ms at 100, 60 at 200 -> 0.36); TTFT steeply (6365 ms at 100, 21252 at 200 -> 1.7).
PRIOR_ELASTICITY: dict[str, float] = {"tpot": 0.4, "ttft": 1.5}
# Bounds on a fitted elasticity, so a flat or noisy pair of points cannot send a jump to infinity.
MIN_ELASTICITY, MAX_ELASTICITY = 0.08, 6.0
# Smoothing of noisy latencies: from this many points, a line in log-log weighted by a Gaussian of this width in
# log(batch) around the crossing, its slope held to the prior elasticity within this standard deviation.
SMOOTH_POINTS, KERNEL_WIDTH, PRIOR_SPREAD = 4, 0.2, 0.2
AIM_BELOW = 1 / 3  # noisy: trials aim this many tolerances below the fitted crossing, where the answer will be
MAX_REPEATS = 2  # repeats of one batch; after them its average is used as it is


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --- the problem ---------------------------------------------------------------------------------------------------


def _pinned_floor(pinned: dict[str, int | bool]) -> int:
    """The smallest maxBatchSize the pinned knobs allow: MindIE wants maxPrefillBatchSize and maxPreemptCount no
    larger than it."""
    return max(1, int(pinned.get("maxPrefillBatchSize", 0)), int(pinned.get("maxPreemptCount", 0)))


class TunedSchedule(_Model):
    """The ScheduleConfig knobs the tuner sets, under MindIE's names: a body for PUT /admin/schedule."""

    maxBatchSize: int = schedule_field("maxBatchSize", required=True)
    maxPrefillBatchSize: int = schedule_field("maxPrefillBatchSize", required=True)
    maxPrefillTokens: int = schedule_field("maxPrefillTokens", required=True)
    supportSelectBatch: bool = schedule_field("supportSelectBatch", required=True)

    def knobs(self) -> ScheduleKnobs:
        return ScheduleKnobs(**self.model_dump())

    @classmethod
    def from_knobs(cls, knobs: ScheduleKnobs, what: str) -> TunedSchedule:
        """The tuned knobs of a schedule the operator recorded (`what` names it in the error when one is missing)."""
        values = {k: getattr(knobs, k) for k in cls.model_fields}
        missing = [k for k, v in values.items() if v is None]
        if missing:
            raise ValueError(f"{what}: the schedule lacks {', '.join(missing)}, a knob the tuner sets")
        return cls.model_validate(values)


class TuningProblem(_Model):
    """What the tuner optimises and how it judges a measurement; `from_plan` builds it from a plan and the SLO.

    Every bound set constrains every objective (a throughput search stays below a TPOT bound when one is given)."""

    objective: Objective
    ttft_ms: float | None = Field(default=None, gt=0, description="bound on the TTFT statistic")
    tpot_ms: float | None = Field(default=None, gt=0, description="bound on the TPOT statistic")
    statistic: Statistic = "mean"
    batch_min: int = Field(ge=1, description="plan.maxBatchSize.min")
    batch_max: int = Field(ge=1, le=MINDIE_MAX_BATCH_SIZE, description="plan.maxBatchSize.max")
    batch_start: int = Field(ge=1, description="the first trial: plan.schedule.maxBatchSize")
    base: PlanSchedule = Field(description="the plan's schedule; the knobs the tuner does not own stay as here")
    mean_input_tokens: int = Field(ge=1)
    max_input_tokens: int = Field(ge=1)
    pinned: dict[str, int | bool] = Field(default_factory=dict, description="knobs set in spec.engine.schedule")
    max_trials: int = Field(default=8, ge=1, le=100)
    min_samples: int = Field(default=50, ge=1, description="requests a trial must measure to count")
    max_error_rate: float = Field(default=0.01, ge=0, le=1, description="above: the trial failed")
    max_preemption_ratio: float = Field(default=0.5, ge=0, description="preemptions per request above: a storm")
    noise: float = Field(default=0.05, ge=0, lt=1,
                         description="relative noise of one measurement (+-); 0 for a deterministic engine")
    tolerance: float = Field(default=0.03, gt=0, lt=1, description="how close to the optimum is close enough")

    @model_validator(mode="after")
    def _check(self) -> TuningProblem:
        if not self.batch_min <= self.batch_start <= self.batch_max:
            raise ValueError(f"batch_start {self.batch_start} outside [{self.batch_min}, {self.batch_max}]")
        if self.objective in ("decodeLatency", "firstTokenAndDecode") and self.tpot_ms is None:
            raise ValueError(f"objective {self.objective} needs tpot_ms")
        if self.objective == "firstTokenAndDecode" and self.ttft_ms is None:
            raise ValueError("objective firstTokenAndDecode needs ttft_ms")
        unknown = set(self.pinned) - set(ScheduleKnobs.model_fields)
        if unknown:
            raise ValueError(f"pinned: not ScheduleConfig knobs: {', '.join(sorted(unknown))}")
        if "maxBatchSize" not in self.pinned and self.batch_min < _pinned_floor(self.pinned):
            raise ValueError(f"batch_min {self.batch_min} is below the pinned maxPrefillBatchSize or maxPreemptCount "
                             f"({_pinned_floor(self.pinned)}); MindIE requires both <= maxBatchSize")
        return self

    @classmethod
    def from_plan(cls, plan: Plan, slo: SLOSpec, *, mean_input_tokens: int | None = None,
                  **settings: object) -> TuningProblem:
        """The problem of one planned InferenceService. The mean input comes from the plan's explanation unless
        given; `settings` sets the other fields (max_trials, min_samples, noise, tolerance, ...)."""
        if mean_input_tokens is None:
            mean_input_tokens = int(plan.explained("blocksPerRequest.min").inputs["avgInputTokens"])
        pinned = {k: getattr(plan.schedule, k) for k in plan.pinned if k in ScheduleKnobs.model_fields}
        low = max(plan.maxBatchSize.min, _pinned_floor(pinned))
        high = max(min(plan.maxBatchSize.max, MINDIE_MAX_BATCH_SIZE), low)
        return cls.model_validate({
            "objective": slo.objective, "ttft_ms": slo.ttftMs, "tpot_ms": slo.tpotMs, "statistic": slo.statistic,
            "batch_min": low, "batch_max": high,
            "batch_start": min(max(plan.schedule.maxBatchSize, low), high),
            "base": plan.schedule, "mean_input_tokens": mean_input_tokens, "max_input_tokens": plan.maxInputTokenLen,
            "pinned": pinned, **settings,
        })

    def bounds(self) -> dict[LatencyName, float]:
        """The latency bounds the search must meet: 'ttft' / 'tpot' -> ms."""
        found: dict[LatencyName, float | None] = {"ttft": self.ttft_ms, "tpot": self.tpot_ms}
        return {k: v for k, v in found.items() if v is not None}

    def schedule_for(self, batch: int) -> TunedSchedule:
        """The knobs at one maxBatchSize: prefill batch half of it, prefill tokens by the plan's rule, select-batch
        off when TTFT is bound; a pinned knob keeps its value."""
        p = self.pinned
        batch = int(p.get("maxBatchSize", batch))
        prefill_batch = int(p.get("maxPrefillBatchSize", max(1, batch // 2)))
        tokens = int(p.get("maxPrefillTokens",
                           planned_prefill_tokens(prefill_batch, self.mean_input_tokens, self.max_input_tokens)))
        select = bool(p.get("supportSelectBatch", self.objective != "firstTokenAndDecode"))
        return TunedSchedule(maxBatchSize=batch, maxPrefillBatchSize=prefill_batch, maxPrefillTokens=tokens,
                             supportSelectBatch=select)

    def full_schedule(self, tuned: TunedSchedule) -> PlanSchedule:
        """The plan's whole schedule with the tuned knobs (the ConfigMap's), maxPreemptCount held <= maxBatchSize as
        MindIE requires unless it is pinned."""
        values = self.base.model_dump() | tuned.model_dump()
        if "maxPreemptCount" not in self.pinned:
            values["maxPreemptCount"] = min(values["maxPreemptCount"], tuned.maxBatchSize)
        return PlanSchedule.model_validate(values)


# --- trials and answers --------------------------------------------------------------------------------------------


class LatencyStats(_Model):
    mean: float = Field(ge=0)
    p90: float = Field(ge=0)
    p99: float = Field(ge=0)

    def of(self, statistic: Statistic) -> float:
        value: float = getattr(self, statistic)
        return value


class TrialMetrics(_Model):
    """What one settled window measured."""

    output_tokens_per_s: float = Field(ge=0)
    ttft_ms: LatencyStats
    tpot_ms: LatencyStats
    error_rate: float = Field(default=0, ge=0, le=1)
    samples: int = Field(ge=0, description="requests measured")
    preemptions: int = Field(default=0, ge=0)
    kv_exhausted: bool = False


class Trial(_Model):
    """One trial: the schedule applied, and its metrics or why none came (a failure)."""

    schedule: TunedSchedule
    metrics: TrialMetrics | None = None
    failure: str | None = None

    @model_validator(mode="after")
    def _check(self) -> Trial:
        if (self.metrics is None) == (self.failure is None):
            raise ValueError("a trial has metrics or a failure, exactly one")
        return self


class NextTrial(_Model):
    kind: Literal["trial"] = "trial"
    schedule: TunedSchedule
    reason: str
    repeat_of: int | None = Field(default=None, description="index of the trial this one measures again")


class Verdict(_Model):
    kind: Literal["verdict"] = "verdict"
    reason: StopReason
    best: int | None = Field(description="index of the best trial (the closest when the SLO is unreachable)")
    schedule: TunedSchedule | None = Field(description="the best trial's schedule; for `pinned`, the pinned one")
    slo_met: bool | None = Field(description="the best trial meets every bound; None when none was measured")
    message: str


Step = NextTrial | Verdict


def failure_of(problem: TuningProblem, trial: Trial) -> str | None:
    """Why a trial counts as failed (the search stays below its batch), or None."""
    if trial.failure is not None:
        return trial.failure
    m = trial.metrics
    assert m is not None
    if m.kv_exhausted:
        return "KV cache exhausted"
    if m.output_tokens_per_s <= 0:
        return "no output tokens"
    if m.error_rate > problem.max_error_rate:
        return f"error rate {m.error_rate:.1%} above {problem.max_error_rate:.1%}"
    if m.preemptions > problem.max_preemption_ratio * max(m.samples, 1):
        return f"preemption storm: {m.preemptions} preemptions in {m.samples} requests"
    return None


# --- the history, digested -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Point:
    """The usable trials at one batch, averaged (weighted by requests)."""

    batch: int
    samples: int
    throughput: float
    latency: dict[str, float]  # 'ttft' / 'tpot' at the SLO's statistic
    ratio: float  # the worst latency over its bound, as measured; 0 without bounds


@dataclass(frozen=True)
class _History:
    trials: Sequence[Trial]
    relevant: tuple[int, ...]  # the trials of this problem: the schedule it would set at their batch
    points: tuple[_Point, ...]  # usable, by batch, below the lowest failure
    failed: dict[int, str]  # batch -> why
    thin: dict[int, int]  # batch -> pooled requests, short of min_samples
    counts: dict[int, int]  # batch -> trials measured there
    cap: int  # the highest batch worth trying: below the lowest failure

    def measured(self, batch: int) -> bool:
        return batch in self.counts

    def last_trial_at(self, batch: int) -> int:
        return max(i for i in self.relevant if self.trials[i].schedule.maxBatchSize == batch)


def _digest(problem: TuningProblem, trials: Sequence[Trial]) -> _History:
    # Trials of another problem (another objective, pinned value or range) say nothing about this one.
    relevant = tuple(i for i, t in enumerate(trials)
                     if problem.batch_min <= t.schedule.maxBatchSize <= problem.batch_max
                     and t.schedule == problem.schedule_for(t.schedule.maxBatchSize))
    failed: dict[int, str] = {}
    usable: dict[int, list[TrialMetrics]] = {}
    counts: dict[int, int] = {}
    for i in relevant:
        t = trials[i]
        b = t.schedule.maxBatchSize
        counts[b] = counts.get(b, 0) + 1
        why = failure_of(problem, t)
        if why is not None:
            failed.setdefault(b, why)
        elif t.metrics is not None:
            usable.setdefault(b, []).append(t.metrics)
    cap = min(failed, default=problem.batch_max + 1) - 1
    bounds = problem.bounds()
    points: list[_Point] = []
    thin: dict[int, int] = {}
    for b, ms in sorted(usable.items()):
        if b > cap:
            continue  # a lower batch failed since: the failure wins
        samples = sum(m.samples for m in ms)
        if samples < problem.min_samples and counts[b] <= MAX_REPEATS:
            thin[b] = samples
            continue
        weights = [max(m.samples, 1) for m in ms]

        def avg(values: list[float], weights: list[int] = weights) -> float:
            return sum(v * w for v, w in zip(values, weights, strict=True)) / sum(weights)

        # Fits work in logarithms: a latency of 0 (none measured, e.g. one-token outputs) counts as a tiny one.
        latency = {"ttft": max(avg([m.ttft_ms.of(problem.statistic) for m in ms]), 1e-6),
                   "tpot": max(avg([m.tpot_ms.of(problem.statistic) for m in ms]), 1e-6)}
        ratio = max((latency[k] / bound for k, bound in bounds.items()), default=0.0)
        points.append(_Point(b, samples, avg([m.output_tokens_per_s for m in ms]), latency, ratio))
    return _History(trials, relevant, tuple(points), failed, thin, counts, cap)


# --- fits ----------------------------------------------------------------------------------------------------------


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(rhs)
    a = [[*row, r] for row, r in zip(matrix, rhs, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(n):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col], strict=True)]
    return [a[r][n] / a[r][r] for r in range(n)]


def _parabola(xs: Sequence[float], ys: Sequence[float], ws: Sequence[float]) -> tuple[float, float, float] | None:
    """Weighted least squares y = c0 + c1 x + c2 x^2 (x centred by the caller)."""
    matrix = [[sum(w * x ** (i + j) for x, w in zip(xs, ws, strict=True)) for j in range(3)] for i in range(3)]
    rhs = [sum(w * y * x**i for x, y, w in zip(xs, ys, ws, strict=True)) for i in range(3)]
    c = _solve(matrix, rhs)
    return None if c is None else (c[0], c[1], c[2])


def _ridge_line(xs: Sequence[float], ys: Sequence[float], ws: Sequence[float], prior: float,
                strength: float) -> tuple[float, float] | None:
    """Weighted least squares y = a + s x with s pulled towards `prior` (a pseudo-observation of weight
    `strength`): points bunched at the crossing say little about the slope, and then the prior speaks."""
    sw, sx = sum(ws), sum(w * x for w, x in zip(ws, xs, strict=True))
    sxx = sum(w * x * x for w, x in zip(ws, xs, strict=True)) + strength
    sy = sum(w * y for w, y in zip(ws, ys, strict=True))
    sxy = sum(w * x * y for w, x, y in zip(ws, xs, ys, strict=True)) + strength * prior
    solved = _solve([[sw, sx], [sx, sxx]], [sy, sxy])
    return None if solved is None else (solved[0], solved[1])


def _rising_root(c: tuple[float, float, float], x_lo: float, x_hi: float) -> float | None:
    """The one root of c0 + c1 x + c2 x^2 in [x_lo, x_hi] where the parabola rises, or None."""
    c0, c1, c2 = c
    if abs(c2) < 1e-12:
        roots = [-c0 / c1] if c1 > 0 else []
    else:
        disc = c1 * c1 - 4 * c2 * c0
        if disc < 0:
            return None
        roots = [(-c1 - math.sqrt(disc)) / (2 * c2), (-c1 + math.sqrt(disc)) / (2 * c2)]
    rising = [r for r in roots if x_lo <= r <= x_hi and c1 + 2 * c2 * r > 0]
    return rising[0] if len(rising) == 1 else None


def _crossing(points: Sequence[_Point], key: str, bound: float, extrapolate: bool) -> tuple[float, float]:
    """The batch where latency `key` reaches `bound`, and the elasticity there, from a log-log fit of the points
    nearest the bound: a parabola through three or more when it rises through the bound among them (or, with
    `extrapolate`, within one jump beyond them), which follows the upward bend of TPOT and TTFT; else a line with
    its elasticity clamped to a sane range; else the prior elasticity through the one point."""
    near = sorted(points, key=lambda p: abs(math.log(p.latency[key] / bound)))[:4]
    x0 = math.log(near[0].batch)
    xs = [math.log(p.batch) - x0 for p in near]
    ys = [math.log(p.latency[key] / bound) for p in near]
    if len(near) >= 3:
        reach = math.log(MAX_JUMP) if extrapolate else 0.0
        c = _parabola(xs, ys, [1.0 / (abs(y) + 0.01) for y in ys])  # right at the bound matters most
        root = None if c is None else _rising_root(c, min(xs) - reach, max(xs) + reach)
        if c is not None and root is not None:
            return math.exp(root + x0), c[1] + 2 * c[2] * root
    if len(near) >= 2:
        below = [(x, y) for x, y in zip(xs, ys, strict=True) if y <= 0]
        above = [(x, y) for x, y in zip(xs, ys, strict=True) if y > 0]
        # A secant across the bound when there is one, else through the two points nearest it.
        if below and above:
            (xa, ya), (xb, yb) = max(below, key=lambda p: p[1]), min(above, key=lambda p: p[1])
        else:
            (xa, ya), (xb, yb) = sorted(zip(xs[:2], ys[:2], strict=True))
        slope = (yb - ya) / (xb - xa) if xb != xa else PRIOR_ELASTICITY[key]
        slope = min(max(slope, MIN_ELASTICITY), MAX_ELASTICITY)
        return math.exp(x0 + xa - ya / slope), slope
    slope = PRIOR_ELASTICITY[key]
    return math.exp(x0 - ys[0] / slope), slope


@dataclass(frozen=True)
class _LatencyFit:
    crossing: float  # the batch where the binding latency reaches its bound
    ratio: dict[int, float]  # batch -> worst latency over its bound: smoothed when smoothed, else as measured
    error: float  # relative standard error of `crossing`: 0 for exact measurements, inf before smoothing
    smoothed: bool

    def meets(self, p: _Point) -> bool:
        return self.ratio[p.batch] <= 1.0


def _latency_fit(problem: TuningProblem, pts: Sequence[_Point]) -> _LatencyFit:
    """The latencies against their bounds. With noise and enough points, each one is smoothed by a line in log-log
    weighted around its crossing, so that no single noisy window decides on which side of the bound a batch lies."""
    sigma = problem.noise / math.sqrt(3)  # the standard deviation of a uniform +-noise
    smooth = sigma > 0 and len(pts) >= SMOOTH_POINTS
    ratio = {p.batch: 0.0 for p in pts}
    crossings: list[tuple[float, float]] = []
    for key, bound in problem.bounds().items():
        guess, slope = _crossing(pts, key, bound, extrapolate=sigma == 0)
        prior = PRIOR_ELASTICITY[key]
        values = [p.latency[key] / bound for p in pts]
        n_eff = float(len(pts))
        if smooth:
            x0 = math.log(guess)
            xs = [math.log(p.batch) - x0 for p in pts]
            ws = [math.exp(-0.5 * (x / KERNEL_WIDTH) ** 2) for x in xs]
            line = _ridge_line(xs, [math.log(v) for v in values], ws, prior, (sigma / PRIOR_SPREAD) ** 2)
            if line is not None and line[1] > 0:
                a, slope = line
                root = min(max(-a / slope, min(xs) - math.log(MAX_JUMP)), max(xs) + math.log(MAX_JUMP))
                values = [math.exp(a + slope * x) for x in xs]
                guess = math.exp(x0 + root)
                n_eff = sum(ws) ** 2 / sum(w * w for w in ws)
        for p, v in zip(pts, values, strict=True):
            ratio[p.batch] = max(ratio[p.batch], v)
        # Before smoothing, one noisy window may sit on the wrong side whatever the fit says. The error takes no
        # steeper slope than the prior: a steep fit through bunched noisy points would promise too much.
        error = 0.0 if sigma == 0 else math.inf if not smooth else \
            sigma / (min(max(slope, MIN_ELASTICITY), prior) * math.sqrt(n_eff))
        crossings.append((guess, error))
    if pts[0].batch == problem.batch_min and pts[0].ratio <= 1:
        # The range minimum measured meeting the SLO meets it: there is no smaller batch to fall back on.
        ratio[pts[0].batch] = min(ratio[pts[0].batch], pts[0].ratio)
    crossing = min(c for c, _ in crossings)
    # A bound whose crossing may be the lowest, within its error, makes the answer as uncertain as it is.
    error = max(e for c, e in crossings if c * (1 - 2 * e) <= crossing)
    return _LatencyFit(crossing, ratio, error, smooth)


def _vertex(near: Sequence[_Point], best: _Point) -> tuple[float, float] | None:
    """(batch, throughput) at the top of the parabola in log(batch) through three points, or None when they do not
    bend down. It lies at most one jump beyond them: a nearly flat parabola would put it anywhere."""
    x0 = math.log(best.batch)
    xs = [math.log(p.batch) - x0 for p in near]
    c = _parabola(xs, [p.throughput / best.throughput for p in near], [1.0] * len(near))
    if c is None or c[2] >= 0:
        return None
    x = min(max(-c[1] / (2 * c[2]), min(xs) - math.log(MAX_JUMP)), max(xs) + math.log(MAX_JUMP))
    return math.exp(x + x0), (c[0] + c[1] * x + c[2] * x * x) * best.throughput


# --- the search ----------------------------------------------------------------------------------------------------


def next_step(problem: TuningProblem, trials: Sequence[Trial]) -> Step:
    """The next trial to measure, or the verdict, from the problem and every trial so far (oldest first).

    Only the trials of this problem count (the schedule it would set at their batch): after a change of objective
    or of a pinned knob, the earlier ones are left out, of the fits and of `max_trials` alike."""
    if "maxBatchSize" in problem.pinned:
        which = "every knob the tuner owns is" if set(OWNED_KNOBS) <= set(problem.pinned) else "maxBatchSize is"
        return Verdict(reason="pinned", best=None, schedule=problem.schedule_for(problem.batch_start),
                       slo_met=None, message=f"{which} pinned in spec.engine.schedule: nothing to tune")
    h = _digest(problem, trials)
    step = _repeat(problem, h) or _search(problem, h)
    if isinstance(step, NextTrial) and len(h.relevant) >= problem.max_trials:
        return _verdict(problem, h, "maxTrials", f"{problem.max_trials} trials spent (next: {step.reason})")
    return step


def _propose(problem: TuningProblem, batch: int, reason: str) -> NextTrial:
    return NextTrial(schedule=problem.schedule_for(batch), reason=reason)


def _again(problem: TuningProblem, h: _History, batch: int, reason: str) -> NextTrial:
    return NextTrial(schedule=problem.schedule_for(batch), reason=reason, repeat_of=h.last_trial_at(batch))


def _repeat(problem: TuningProblem, h: _History) -> NextTrial | None:
    """A repeat of a measurement that cannot be trusted: too few requests, or a break of the shape it must have."""
    if h.thin:
        b = min(h.thin)
        return _again(problem, h, b, f"only {h.thin[b]} requests measured at maxBatchSize {b}, fewer than "
                                     f"{problem.min_samples}; measuring it again")
    if problem.noise == 0:
        return None  # exact measurements: a repeat would say the same
    for why, group in _inconsistent(problem, h):
        once = [p for p in group if h.counts[p.batch] == 1]
        if once:
            # The newest of the points measured once: it is the one that disagrees with what was there.
            p = max(once, key=lambda p: h.last_trial_at(p.batch))
            return _again(problem, h, p.batch, f"{why}; measuring {p.batch} again")
    return None


def _inconsistent(problem: TuningProblem, h: _History) -> list[tuple[str, list[_Point]]]:
    """Neighbouring points that break, by more than twice the noise, what must hold: no latency falls as the batch
    grows, and throughput has no dip between two higher points."""
    slack = 2 * problem.noise
    found: list[tuple[str, list[_Point]]] = []
    pts = h.points
    keys = list(problem.bounds()) or ["tpot"]
    for a, b in itertools.pairwise(pts):
        for key in keys:
            if a.latency[key] > b.latency[key] * (1 + slack):
                found.append((f"{key.upper()} {a.latency[key]:.1f} ms at {a.batch} exceeds {b.latency[key]:.1f} ms "
                              f"at {b.batch}", [a, b]))
    if problem.objective == "throughput":
        for a, b, c in zip(pts, pts[1:], pts[2:], strict=False):
            if b.throughput < min(a.throughput, c.throughput) * (1 - slack):
                found.append((f"throughput dips to {b.throughput:.0f} tok/s at {b.batch} between {a.batch} and "
                              f"{c.batch}", [a, b, c]))
    return found


def _search(problem: TuningProblem, h: _History) -> Step:
    lo = problem.batch_min
    if h.cap < lo:
        return _verdict(problem, h, "allFailed", f"the range minimum {lo} failed ({h.failed[lo]})")
    if lo == problem.batch_max:
        if not h.measured(lo):
            return _propose(problem, lo, f"the range holds the one value {lo}")
        met = not h.points or h.points[0].ratio <= 1
        return _verdict(problem, h, "converged" if met else "sloUnreachable", f"the range holds the one value {lo}")
    if problem.objective == "throughput":
        return _peak(problem, h)
    return _boundary(problem, h, h.cap)


def _first(problem: TuningProblem, h: _History, top: int) -> Step:
    """The first usable trial: the plan's start, or well below the lowest failure."""
    lo = problem.batch_min
    if not h.failed:
        return _propose(problem, problem.batch_start, "the plan's starting point")
    f = min(h.failed)
    b = _unmeasured(h, max(lo, min(problem.batch_start, math.floor(f * BACKOFF))), lo, top)
    if b is None:
        return _verdict(problem, h, "allFailed", f"every batch below {f} was tried")
    return _propose(problem, b, f"backing off below maxBatchSize {f} ({h.failed[f]})")


def _unmeasured(h: _History, target: int, lo: int, hi: int) -> int | None:
    """The unmeasured batch in [lo, hi] nearest `target`, or None."""
    target = min(max(target, lo), hi)
    for d in range(hi - lo + 1):
        for b in (target - d, target + d):
            if lo <= b <= hi and not h.measured(b):
                return b
    return None


def _boundary(problem: TuningProblem, h: _History, top: int) -> Step:
    """The largest batch in [batch_min, top] that meets every bound."""
    lo, tol = problem.batch_min, problem.tolerance
    pts = [p for p in h.points if p.batch <= top]
    if not pts:
        return _first(problem, h, top)
    fit = _latency_fit(problem, pts)
    guess = fit.crossing
    b_lo = max((p.batch for p in pts if fit.meets(p)), default=None)  # the largest batch meeting the SLO
    missing = [p.batch for p in pts if not fit.meets(p) and p.batch > (b_lo or 0)]
    b_hi = min(missing, default=top + 1 if top < problem.batch_max else None)  # the smallest above it missing
    sure = fit.error <= tol
    if b_lo is not None and b_lo >= top and (sure or guess > top):
        edge = "the range maximum" if top == problem.batch_max else f"the largest batch below a failure ({top + 1}),"
        return _verdict(problem, h, "converged", f"{edge} {top} meets the SLO")
    if b_lo is None and h.measured(lo) and (sure or guess < lo):
        if fit.ratio[lo] <= 1 + problem.noise and h.counts[lo] < 2:
            return _again(problem, h, lo, f"the range minimum {lo} misses the SLO by {fit.ratio[lo] - 1:.1%}, "
                                          "within the noise; measuring it again")
        return _verdict(problem, h, "sloUnreachable", f"even the range minimum {lo} misses the SLO")
    if fit.smoothed:
        # Noisy: the fit, not any one window, places the crossing. Measure just below it, where the answer (the
        # largest batch the fit says meets the SLO) will be, until the crossing is known within tolerance.
        if sure and b_lo is not None and b_lo >= guess * (1 - tol):
            return _verdict(problem, h, "converged",
                            f"the fit puts the SLO crossing at {guess:.0f} +-{fit.error:.1%}, and {b_lo} meets it")
        return _near(problem, h, math.floor(guess * (1 - tol * AIM_BELOW)), lo, top,
                     f"the fit puts the SLO crossing at {guess:.0f} +-{fit.error:.1%}")
    b = None
    why = ""
    if b_lo is not None and b_hi is not None and b_hi - 1 - b_lo <= tol * b_lo:
        # Closed: the optimum lies in [b_lo, b_hi - 1], within tolerance of b_lo.
        if fit.error == 0:
            return _verdict(problem, h, "converged", f"{b_lo} meets the SLO and {b_hi} does not: within {tol:.0%}")
    else:
        step = max(1, math.floor(tol * (b_lo or b_hi or lo)))
        if b_lo is not None and b_hi is not None:
            # In the bracket; near one end, probe one tolerance inside it, so it closes whichever way that falls.
            target = min(max(round(guess), b_lo + step), b_hi - step)
            why = f"the fit puts the SLO crossing at {guess:.0f}, between {b_lo} (meets) and {b_hi} (misses)"
        elif b_lo is not None:
            target = min(max(round(guess), b_lo + step), math.floor(b_lo * MAX_JUMP))
            why = f"{b_lo} meets the SLO; the fit puts the crossing at {guess:.0f}"
        else:
            assert b_hi is not None
            target = max(min(round(guess), b_hi - step), math.ceil(b_hi / MAX_JUMP))
            why = f"{b_hi} misses the SLO; the fit puts the crossing at {guess:.0f}"
        if b_hi is not None and b_hi > top:  # a failure above: never onto it, at most halfway (geometric)
            target = min(target, math.floor(math.sqrt((b_lo or lo) * b_hi)))
        low, high = (lo if b_lo is None else b_lo + 1), (top if b_hi is None else b_hi - 1)
        b = _unmeasured(h, target, low, high) if low <= high else None
    if b is not None:
        return _propose(problem, b, why)
    if fit.error > 0:  # noisy, and too few points to smooth: an end that looks settled may not be
        return _near(problem, h, round(guess), lo, top, f"the fit puts the SLO crossing at {guess:.0f}")
    return _verdict(problem, h, "converged", f"no batch left to try between {b_lo} and {b_hi}")


def _near(problem: TuningProblem, h: _History, target: int, low: int, high: int, why: str) -> Step:
    """A trial at the unmeasured batch in [low, high] nearest `target`; converged when there is none."""
    b = _unmeasured(h, target, low, high)
    if b is None:
        return _verdict(problem, h, "converged", f"every batch in [{low}, {high}] is measured")
    return _propose(problem, b, why)


def _peak(problem: TuningProblem, h: _History) -> Step:
    """The batch of the most output tokens/s in [batch_min, cap], below any batch that misses a bound."""
    lo, tol = problem.batch_min, problem.tolerance
    top = h.cap
    missing = [p.batch for p in h.points if p.ratio > 1]
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
        target = 2 * vertex[0] - m if vertex is not None and vertex[0] > m else m * STEP
        b = min(max(round(target), math.ceil(m * (1 + 2 * tol))), math.floor(m * MAX_JUMP), top)
        if blocked:  # never onto a failure or a missed bound: at most halfway to it
            b = min(b, math.floor(math.sqrt(m * upper)))
        return _near(problem, h, b, m + 1, top, f"throughput still rising at {m} ({best.throughput:.0f} tok/s)")
    if i == 0 and m - lower - 1 > tol * m:  # highest at the smallest batch measured: go down
        vertex = _vertex(pts[:3], best) if len(pts) >= 3 else None
        target = 2 * vertex[0] - m if vertex is not None and vertex[0] < m else m / STEP
        b = max(min(round(target), math.floor(m * (1 - 2 * tol))), math.ceil(m / MAX_JUMP), lo)
        return _near(problem, h, b, lo, m - 1, f"throughput higher at {m} ({best.throughput:.0f} tok/s) than above it")
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
        if abs(v / m - 1) < tol or (gain < tol / 3 and max(upper / m, m / below) <= STEP):
            return _verdict(problem, h, "converged", said)
        if gain < tol / 3:
            target, why = halve, f"{said}, but the gap around it is wide: halving it"
        else:
            target, why = round(v), f"the fitted peak: {peak:.0f} tok/s at {v:.0f}"
    else:  # the points do not bend down (noise): halve the wider side, geometrically
        target, why = halve, f"no concave fit around {m}: halving the wider side"
    if blocked and i == len(pts) - 1:  # never onto a failure or a missed bound: at most halfway to it
        target = min(target, math.floor(math.sqrt(m * upper)))
    return _near(problem, h, target, lower + 1, upper - 1, why)


# --- the verdict ---------------------------------------------------------------------------------------------------


def _verdict(problem: TuningProblem, h: _History, reason: StopReason, why: str) -> Verdict:
    pts = h.points
    if not pts:
        return Verdict(reason="allFailed" if h.failed and reason != "maxTrials" else reason, best=None,
                       schedule=None, slo_met=None, message=f"{why}; no trial gave a usable measurement")
    # The latency objectives judge by the smoothed latencies (when noisy); throughput by what each point measured.
    ratio = {p.batch: p.ratio for p in pts}
    if problem.objective != "throughput":
        ratio = _latency_fit(problem, pts).ratio
    meeting = [p for p in pts if ratio[p.batch] <= 1]
    if not meeting:
        closest = min(pts, key=lambda p: (ratio[p.batch], p.batch))
        i = h.last_trial_at(closest.batch)
        return Verdict(reason=reason, best=i, schedule=h.trials[i].schedule, slo_met=False,
                       message=f"{why}; closest: maxBatchSize {closest.batch} at {ratio[closest.batch]:.2f}x the bound")
    if problem.objective == "throughput":
        best = max(meeting, key=lambda p: p.throughput)
    else:
        best = max(meeting, key=lambda p: p.batch)
    said = [f"{best.throughput:.0f} output tok/s"]
    said += [f"{k.upper()} {problem.statistic} {best.latency[k]:.1f} ms" for k in problem.bounds()]
    i = h.last_trial_at(best.batch)
    return Verdict(reason=reason, best=i, schedule=h.trials[i].schedule, slo_met=True,
                   message=f"{why}; best: maxBatchSize {best.batch}, {', '.join(said)}")


# --- the operator's status -----------------------------------------------------------------------------------------

_METRIC_KEYS = ("outputTokensPerSecond", "ttftMeanMs", "ttftP90Ms", "ttftP99Ms", "tpotMeanMs", "tpotP90Ms",
                "tpotP99Ms", "errorRate", "samples", "preemptions", "kvExhausted")
FAILED_PREFIX = "failed: "


def trial_status(problem: TuningProblem, index: int, trial: Trial) -> TuningTrial:
    """One trial as `status.tuning.history` holds it (`trial_from_status` reads it back): the knobs, the metrics
    under camelCase names, and a one-line judgement."""
    m = trial.metrics
    if m is None:
        return TuningTrial(trial=index, schedule=trial.schedule.knobs(), verdict=f"{FAILED_PREFIX}{trial.failure}")
    values = (m.output_tokens_per_s, m.ttft_ms.mean, m.ttft_ms.p90, m.ttft_ms.p99, m.tpot_ms.mean, m.tpot_ms.p90,
              m.tpot_ms.p99, m.error_rate, m.samples, m.preemptions, m.kv_exhausted)
    metrics = dict(zip(_METRIC_KEYS, (float(v) for v in values), strict=True))
    why = failure_of(problem, trial)
    if why is not None:
        verdict = f"{FAILED_PREFIX}{why}"
    else:
        parts = [f"{m.output_tokens_per_s:.0f} tok/s"]
        for key, bound in problem.bounds().items():
            value = (m.ttft_ms if key == "ttft" else m.tpot_ms).of(problem.statistic)
            parts.append(f"{key.upper()} {problem.statistic} {value:.1f} ms {'<=' if value <= bound else '>'} "
                         f"{bound:g}")
        if m.samples < problem.min_samples:
            parts.append(f"only {m.samples} requests")
        verdict = "; ".join(parts)
    return TuningTrial(trial=index, schedule=trial.schedule.knobs(), metrics=metrics, verdict=verdict)


def trial_from_status(entry: TuningTrial) -> Trial:
    """A trial back from `status.tuning.history`, so the tuner resumes where it was."""
    schedule = TunedSchedule.from_knobs(entry.schedule, f"tuning trial {entry.trial}")
    g = entry.metrics
    if not g:
        return Trial(schedule=schedule, failure=entry.verdict.removeprefix(FAILED_PREFIX) or "no metrics")
    return Trial(schedule=schedule, metrics=TrialMetrics(
        output_tokens_per_s=g["outputTokensPerSecond"],
        ttft_ms=LatencyStats(mean=g["ttftMeanMs"], p90=g["ttftP90Ms"], p99=g["ttftP99Ms"]),
        tpot_ms=LatencyStats(mean=g["tpotMeanMs"], p90=g["tpotP90Ms"], p99=g["tpotP99Ms"]),
        error_rate=g["errorRate"], samples=round(g["samples"]), preemptions=round(g["preemptions"]),
        kv_exhausted=bool(g["kvExhausted"])))


_PHASE: dict[StopReason, Literal["Converged", "Stopped", "Failed"]] = {
    "converged": "Converged", "maxTrials": "Stopped", "pinned": "Stopped", "sloUnreachable": "Stopped",
    "allFailed": "Failed"}


def tuning_status(problem: TuningProblem, trials: Sequence[Trial]) -> TuningStatus:
    """`status.tuning` for a history: Running while there is a next trial, then the verdict's phase and best."""
    step = next_step(problem, trials)
    history = [trial_status(problem, i, t) for i, t in enumerate(trials)][-100:]
    if isinstance(step, NextTrial):
        return TuningStatus(phase="Running", trial=len(trials), history=history)
    best = None if step.best is None else trial_status(problem, step.best, trials[step.best])
    return TuningStatus(phase=_PHASE[step.reason], trial=len(trials), best=best, history=history)
