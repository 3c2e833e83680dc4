"""What the tuner solves, and the one judge of what it measures.

`TuningProblem` is one InferenceService's tuning problem: the objective, the SLO's bounds and statistic, the plan's
range and base schedule, the knobs pinned in the spec. `TuningProblem.judge` is the only place that decides whether a
measured window meets the SLO or failed: the search, its verdict, `status.observed`, the drift check after tuning and
the capacity probes all ask it. `TuningProblem.claim` judges the windows measured at one schedule together, with the
noise the tuner estimated: whether their pooled figures meet every bound, and whether the noise leaves no more than
`tolerance` of doubt that the true figure does.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from npuserve.engine_contract import schedule_field
from npuserve.planning.api import (
    LatencyStats,
    Objective,
    Plan,
    PlanSchedule,
    ScheduleKnobs,
    SLOSpec,
    Statistic,
    TrialMetrics,
    TrialReason,
)
from npuserve.planning.engine_model import EngineShape
from npuserve.planning.planner import MINDIE_MAX_BATCH_SIZE, planned_prefill_tokens

OWNED_KNOBS = ("maxBatchSize", "maxPrefillBatchSize", "maxPrefillTokens", "supportSelectBatch")
LatencyName = Literal["ttft", "tpot"]
LATENCY_FIELDS: dict[LatencyName, Literal["ttftMs", "tpotMs"]] = {"ttft": "ttftMs", "tpot": "tpotMs"}
LATENCY_OBJECTIVES = ("decodeLatency", "firstTokenAndDecode")
KV_EXHAUSTED_USAGE = 0.99  # KV usage at or above this, with preemptions, is an exhausted cache


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _pinned_floor(pinned: Mapping[str, int | bool]) -> int:
    """The smallest maxBatchSize the pinned knobs allow: MindIE wants maxPrefillBatchSize and maxPreemptCount no
    larger than it."""
    return max(1, int(pinned.get("maxPrefillBatchSize", 0)), int(pinned.get("maxPreemptCount", 0)))


def _pinned_knobs(plan: Plan) -> dict[str, int | bool]:
    return {k: getattr(plan.schedule, k) for k in plan.pinned if k in ScheduleKnobs.model_fields}


def tuned_batch_max(plan: Plan) -> int:
    """The largest maxBatchSize the tuner may propose for `plan`: its memory maximum (maxBatchSize.max, at most
    MindIE's 5000), or what the pinned knobs need when that is more."""
    return max(min(plan.maxBatchSize.max, MINDIE_MAX_BATCH_SIZE), _pinned_floor(_pinned_knobs(plan)))


def max_batch_size_limit(plan: Plan) -> int:
    """The rendered config's npuserve.maxBatchSizeLimit: the largest maxBatchSize any schedule of `plan` runs, the
    tuner's or the plan's own (a pinned maxBatchSize past the memory maximum). The engine sizes its KV pool's CPU
    cap and its decode graphs for it, so every tuned value runs at full speed."""
    return max(tuned_batch_max(plan), plan.schedule.maxBatchSize)


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


# --- the judge's word ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Judgement:
    """The judge's word on one window, or on the windows of one schedule pooled."""

    failure: TrialReason | None  # a check the window failed (the search stays below its batch), or None
    why: str  # the failure, for people ("" without one)
    ratios: Mapping[LatencyName, float]  # each bound's statistic over the bound, as measured
    failing: tuple[str, ...]  # the failed check's figure, or each figure over its bound ("tpotMs.mean")

    @property
    def meets(self) -> bool:
        """No failed check, and every bound met as measured."""
        return self.failure is None and all(r <= 1 for r in self.ratios.values())

    @property
    def worst(self) -> float:
        """The largest statistic-over-bound ratio (0 without bounds)."""
        return max(self.ratios.values(), default=0.0)


@dataclass(frozen=True)
class Noise:
    """How much one window's figures scatter around their true values: the relative standard deviation of a
    latency statistic and of the throughput, and the degrees of freedom behind the estimate (inf: taken as known,
    as for a deterministic engine)."""

    latency: Mapping[LatencyName, float] = field(default_factory=dict)
    throughput: float = 0.0
    df: float = math.inf
    # Each latency's bias that every window at one batch shares (a variance in log units, `fits.batch_bias`): some
    # batches run slower or faster kernels than their neighbours every time, and no repeat at that batch averages it
    # away, so a claim on many windows is no surer than it.
    batch_bias: Mapping[LatencyName, float] = field(default_factory=dict)

    @property
    def exact(self) -> bool:
        return self.throughput == 0 and all(s == 0 for s in self.latency.values())


@dataclass(frozen=True)
class Claim:
    """The judge's word on every window measured at one schedule."""

    judgement: Judgement  # of the pooled figures
    windows: int
    upper: Mapping[LatencyName, float]  # each ratio's upper confidence bound, given the noise
    tolerance: float
    lower: Mapping[LatencyName, float] = field(default_factory=dict)  # each ratio's lower confidence bound

    @property
    def meets(self) -> bool:
        """The pooled windows meet every bound, as measured."""
        return self.judgement.meets

    @property
    def certain(self) -> bool:
        """They meet it, and the noise leaves at most `tolerance` of doubt about any bound: what SLOMet=True says."""
        return self.meets and all(u <= 1 + self.tolerance for u in self.upper.values())

    @property
    def certain_miss(self) -> bool:
        """They miss a bound beyond the noise (or failed a check): a repeat would not turn them into a meet."""
        return self.judgement.failure is not None or any(v > 1 for v in self.lower.values())


def kv_exhausted(metrics: TrialMetrics) -> bool:
    """Whether the KV cache ran out in the window: some engine's usage reached KV_EXHAUSTED_USAGE and requests were
    preempted. A full cache without preemptions is the cache in use; preemptions with room left are not this failure
    (too many of them are a preemption storm, `TuningProblem.judge`)."""
    usage = metrics.kvUsageMax
    return usage is not None and usage >= KV_EXHAUSTED_USAGE and metrics.preemptions > 0


def with_findings(metrics: TrialMetrics) -> TrialMetrics:
    """The window with the judge's finding `kvExhausted` computed from its facts, as status shows it."""
    exhausted = kv_exhausted(metrics)
    return metrics if metrics.kvExhausted == exhausted else metrics.model_copy(update={"kvExhausted": exhausted})


def pooled(windows: Sequence[TrialMetrics]) -> TrialMetrics:
    """The windows of one schedule as one: each figure averaged by requests, counts added, the highest KV usage (what
    one window spanning them would read)."""
    if len(windows) == 1:
        return with_findings(windows[0])
    weights = [max(m.samples, 1) for m in windows]
    total = sum(weights)

    def avg(values: Sequence[float]) -> float:
        return sum(v * w for v, w in zip(values, weights, strict=True)) / total

    def stats(name: Literal["ttftMs", "tpotMs"]) -> LatencyStats:
        return LatencyStats(**{s: avg([getattr(getattr(m, name), s) for m in windows]) for s in ("mean", "p90", "p99")})

    in_flight = [m.inFlightPerPod for m in windows if m.inFlightPerPod is not None]
    e2e = [m.e2eMeanMs for m in windows if m.e2eMeanMs is not None]
    kv_usage = [m.kvUsageMax for m in windows if m.kvUsageMax is not None]
    return with_findings(TrialMetrics(
        outputTokensPerSecond=avg([m.outputTokensPerSecond for m in windows]), ttftMs=stats("ttftMs"),
        tpotMs=stats("tpotMs"), errorRate=avg([m.errorRate for m in windows]), samples=sum(m.samples for m in windows),
        preemptions=sum(m.preemptions for m in windows), kvUsageMax=max(kv_usage) if kv_usage else None,
        inFlightPerPod=sum(in_flight) / len(in_flight) if in_flight else None,
        e2eMeanMs=sum(e2e) / len(e2e) if e2e else None))


# The one-sided confidence with which a claim holds: the Student-t quantile at the noise estimate's degrees of freedom.
CLAIM_CONFIDENCE = 0.975


def t_quantile(df: float, confidence: float = CLAIM_CONFIDENCE) -> float:
    """The one-sided `confidence` quantile of Student's t with `df` degrees of freedom (the normal's when df is
    infinite)."""
    from scipy.stats import norm, t  # scipy imports slowly: only when a noisy claim is judged

    return float(norm.ppf(confidence) if math.isinf(df) else t.ppf(confidence, max(df, 1.0)))


# --- the problem ---------------------------------------------------------------------------------------------------


class TuningProblem(_Model):
    """What the tuner optimises and how it judges a measurement; `from_plan` builds it from a plan and the SLO.

    Every bound set constrains every objective (a throughput search stays below a TPOT bound when one is given).
    The plan's range is a memory range: its maximum is what the KV cache holds and bounds every search; its minimum
    (every request at its maximum length fits) is where a search starts from, not a floor: a latency SLO is met by
    going below it, and a batch that fails is left for a smaller one, down to 1."""

    objective: Objective
    ttft_ms: float | None = Field(default=None, gt=0, description="bound on the TTFT statistic")
    tpot_ms: float | None = Field(default=None, gt=0, description="bound on the TPOT statistic")
    statistic: Statistic = "mean"
    batch_min: int = Field(ge=1, description="plan.maxBatchSize.min")
    batch_max: int = Field(ge=1, le=MINDIE_MAX_BATCH_SIZE, description="plan.maxBatchSize.max: the memory bound")
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
                         description="the prior relative noise of one window (+-); the tuner estimates the real one "
                                     "from repeats and the fit's residuals. 0: a deterministic engine, nothing "
                                     "estimated")
    engine: EngineShape | None = Field(default=None, description="the engine's shape for the online model "
                                       "(planning/engine_model.py): fitted to the windows, it proposes the next batch "
                                       "and, while it passes its adequacy test, proves TPOT claims; None: no model")
    tolerance: float = Field(default=0.03, gt=0, lt=1,
                             description="how close to the optimum is close enough; and how much doubt the noise may "
                                         "leave that a schedule whose measured windows meet a bound truly meets it")

    @model_validator(mode="after")
    def _check(self) -> TuningProblem:
        if not 1 <= self.batch_start <= self.batch_max:
            raise ValueError(f"batch_start {self.batch_start} outside [1, {self.batch_max}]")
        if self.batch_min > self.batch_max:
            raise ValueError(f"batch_min {self.batch_min} above batch_max {self.batch_max}")
        if self.objective in LATENCY_OBJECTIVES and self.tpot_ms is None:
            raise ValueError(f"objective {self.objective} needs tpot_ms")
        if self.objective == "firstTokenAndDecode" and self.ttft_ms is None:
            raise ValueError("objective firstTokenAndDecode needs ttft_ms")
        unknown = set(self.pinned) - set(ScheduleKnobs.model_fields)
        if unknown:
            raise ValueError(f"pinned: not ScheduleConfig knobs: {', '.join(sorted(unknown))}")
        if "maxBatchSize" not in self.pinned and self.batch_max < _pinned_floor(self.pinned):
            raise ValueError(f"batch_max {self.batch_max} is below the pinned maxPrefillBatchSize or maxPreemptCount "
                             f"({_pinned_floor(self.pinned)}); MindIE requires both <= maxBatchSize")
        return self

    @classmethod
    def from_plan(cls, plan: Plan, slo: SLOSpec, *, mean_input_tokens: int | None = None,
                  **settings: object) -> TuningProblem:
        """The problem of one planned InferenceService. The mean input comes from the plan's explanation unless
        given; `settings` sets the other fields (max_trials, min_samples, noise, tolerance, ...)."""
        if mean_input_tokens is None:
            mean_input_tokens = int(plan.explained("blocksPerRequest.min").inputs["avgInputTokens"])
        pinned = _pinned_knobs(plan)
        floor = _pinned_floor(pinned)
        high = tuned_batch_max(plan)
        low = min(max(plan.maxBatchSize.min, floor), high)
        return cls.model_validate({
            "objective": slo.objective, "ttft_ms": slo.ttftMs, "tpot_ms": slo.tpotMs, "statistic": slo.statistic,
            "batch_min": low, "batch_max": high,
            "batch_start": min(max(plan.schedule.maxBatchSize, floor), high),
            "base": plan.schedule, "mean_input_tokens": mean_input_tokens, "max_input_tokens": plan.maxInputTokenLen,
            "pinned": pinned, **settings,
        })

    @property
    def floor(self) -> int:
        """The smallest maxBatchSize any search may try: 1, or what the pinned knobs need."""
        return min(_pinned_floor(self.pinned), self.batch_max)

    def bounds(self) -> dict[LatencyName, float]:
        """The latency bounds the search must meet: 'ttft' / 'tpot' -> ms."""
        found: dict[LatencyName, float | None] = {"ttft": self.ttft_ms, "tpot": self.tpot_ms}
        return {k: v for k, v in found.items() if v is not None}

    def latency(self, metrics: TrialMetrics, key: LatencyName) -> float:
        """A window's TTFT or TPOT at the SLO's statistic (ms)."""
        stats: LatencyStats = getattr(metrics, LATENCY_FIELDS[key])
        return stats.of(self.statistic)

    # -- the judge --

    def judge(self, metrics: TrialMetrics) -> Judgement:
        """Whether one window (or one schedule's windows pooled) failed a check or meets every bound: the one
        definition the search, the verdict, status.observed, drift detection and capacity all use."""
        ratios = {k: self.latency(metrics, k) / bound for k, bound in self.bounds().items()}
        over = tuple(f"{LATENCY_FIELDS[k]}.{self.statistic}" for k, r in ratios.items() if r > 1)
        failure: TrialReason | None = None
        if kv_exhausted(metrics):
            failure, why, figure = "KVCacheExhausted", "KV cache exhausted", "kvExhausted"
        elif metrics.outputTokensPerSecond <= 0:
            failure, why, figure = "NoOutputTokens", "no output tokens", "outputTokensPerSecond"
        elif metrics.errorRate > self.max_error_rate:
            failure, why, figure = ("ErrorRate", f"error rate {metrics.errorRate:.1%} above "
                                    f"{self.max_error_rate:.1%}", "errorRate")
        elif metrics.preemptions > self.max_preemption_ratio * max(metrics.samples, 1):
            failure, why, figure = ("PreemptionStorm", f"preemption storm: {metrics.preemptions} preemptions in "
                                    f"{metrics.samples} requests", "preemptions")
        if failure is not None:
            return Judgement(failure, why, ratios, (figure, *over))
        return Judgement(None, "", ratios, over)

    def claim(self, windows: Sequence[TrialMetrics], noise: Noise) -> Claim:
        """The windows measured at one schedule, judged together: their pooled figures, and how far the noise lets
        each true ratio lie above the measured one (a t interval on the mean of `len(windows)` windows, whose
        variance is the windows' own over their count plus the batch's bias, which they all share)."""
        judgement = self.judge(pooled(windows))
        n = len(windows)
        t = 0.0 if noise.exact else t_quantile(noise.df)
        spread = {k: t * math.sqrt(noise.latency.get(k, 0.0) ** 2 / n + noise.batch_bias.get(k, 0.0))
                  for k in judgement.ratios}
        upper = {k: r * math.exp(spread[k]) for k, r in judgement.ratios.items()}
        lower = {k: r * math.exp(-spread[k]) for k, r in judgement.ratios.items()}
        return Claim(judgement, n, upper, self.tolerance, lower)

    # -- schedules --

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

    def knobs(self, tuned: TunedSchedule) -> ScheduleKnobs:
        """The knobs a tuned schedule sets on the engines (with maxPreemptCount held <= maxBatchSize)."""
        return ScheduleKnobs(**tuned.model_dump(), maxPreemptCount=self.full_schedule(tuned).maxPreemptCount)
