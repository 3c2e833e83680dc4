"""Every figure of a run, computed from its records (docs/loadgen.md#what-it-measures). Pure arithmetic: no I/O, no
clock.

Per request (t0 send, c1..cK content-chunk arrivals, N output tokens): TTFT = c1 - t0; E2E = cK - t0 (the
response's end when no chunk arrived); TPOT = (E2E - TTFT) / (N - 1), undefined for N <= 1; ITL = every gap
c(k) - c(k-1), pooled over requests. A TGI `/generate` record (timing headers, no chunks) takes TTFT and TPOT from
the headers and E2E from the client. Failed requests add to the counts, never to a latency. Warm-up requests add
to nothing.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Literal

from pydantic import BaseModel, Field

from npuserve.loadgen.config import SLO, SLOStatistic
from npuserve.loadgen.records import RequestRecord

MS_PER_S = 1000.0


def ttft_ms(r: RequestRecord) -> float | None:
    if not r.ok:
        return None
    if r.chunk_times:
        return (r.chunk_times[0] - r.t0) * MS_PER_S
    if r.headers is not None:
        return r.headers.first_token_ms
    return None  # not streamed and no timing headers: the first token's arrival was never seen


def e2e_ms(r: RequestRecord) -> float | None:
    if not r.ok:
        return None
    last = r.chunk_times[-1] if r.chunk_times else r.end
    return None if last is None else (last - r.t0) * MS_PER_S


def tpot_ms(r: RequestRecord) -> float | None:
    """Mean time per output token after the first; None when there is no second token to time."""
    if not r.ok or r.output_tokens is None or r.output_tokens <= 1:
        return None
    if r.chunk_times:
        ttft, e2e = ttft_ms(r), e2e_ms(r)
        assert ttft is not None and e2e is not None  # ok and streamed: both are defined
        return (e2e - ttft) / (r.output_tokens - 1)
    if r.headers is not None:
        return r.headers.time_per_token_ms
    return None


def itls_ms(r: RequestRecord) -> list[float]:
    if not r.ok:
        return []
    return [(b - a) * MS_PER_S for a, b in itertools.pairwise(r.chunk_times)]


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0..100) by numpy's default rule: linear interpolation between the closest ranks."""
    xs = sorted(values)
    if not xs:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile {q} outside 0..100")
    position = q / 100.0 * (len(xs) - 1)
    below = math.floor(position)
    above = min(below + 1, len(xs) - 1)
    t = position - below
    a, b = xs[below], xs[above]
    # numpy's _lerp: interpolate from the nearer end, so the result stays inside [a, b] under rounding
    return b - (b - a) * (1.0 - t) if t >= 0.5 else a + (b - a) * t


def percentile_key(q: float) -> str:
    """How vLLM names a percentile: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(q)) if int(q) == q else str(q)


class Distribution(BaseModel):
    """Summary statistics of one latency (or count) over a run. An empty distribution (n = 0) holds 0.0 in every
    statistic so that it always serialises; reports test `empty` and print such a row as absent, never as 0."""

    n: int = 0
    mean: float = 0.0
    median: float = 0.0
    std: float = Field(default=0.0, description="population standard deviation (numpy's default, as vLLM's)")
    p75: float = 0.0
    p90: float = 0.0
    p95: float = 0.0
    p99: float = 0.0
    min: float = 0.0
    max: float = 0.0
    percentiles: dict[str, float] = Field(default_factory=dict,
                                          description="extra percentiles asked for, keyed as vLLM names them")

    @property
    def empty(self) -> bool:
        return self.n == 0

    def at(self, q: float) -> float:
        """The q-th percentile, from the fixed fields or the extra ones computed."""
        key = percentile_key(q)
        fixed = {"50": self.median, "75": self.p75, "90": self.p90, "95": self.p95, "99": self.p99,
                 "0": self.min, "100": self.max}
        if key in self.percentiles:
            return self.percentiles[key]
        if key in fixed:
            return fixed[key]
        raise KeyError(f"percentile {key} was not computed: pass it in compute_metrics' extra_percentiles")

    def statistic(self, name: SLOStatistic) -> float:
        return {"mean": self.mean, "p90": self.p90, "p99": self.p99}[name]


def distribution(values: Iterable[float], extra_percentiles: Sequence[float] = ()) -> Distribution:
    xs = sorted(values)
    if not xs:
        return Distribution()
    mean = math.fsum(xs) / len(xs)
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / len(xs))
    return Distribution(
        n=len(xs), mean=mean, median=percentile(xs, 50), std=std,
        p75=percentile(xs, 75), p90=percentile(xs, 90), p95=percentile(xs, 95), p99=percentile(xs, 99),
        min=xs[0], max=xs[-1], percentiles={percentile_key(q): percentile(xs, q) for q in extra_percentiles},
    )


class ObjectiveVerdict(BaseModel):
    metric: Literal["ttft", "tpot"]
    statistic: SLOStatistic
    objective_ms: float
    measured_ms: float | None = Field(description="None: the run measured none (no request had one)")
    met: bool


class SLOVerdict(BaseModel):
    """PASS/FAIL: `statistic` of each metric over the run against its objective. An objective the run could not
    measure is not met: a verdict needs evidence."""

    objectives: list[ObjectiveVerdict]
    passed: bool


def judge_slo(ttft: Distribution, tpot: Distribution, slo: SLO) -> SLOVerdict | None:
    if not slo.given:
        return None
    verdicts = []
    for metric, objective, dist in (("ttft", slo.ttft_ms, ttft), ("tpot", slo.tpot_ms, tpot)):
        if objective is None:
            continue
        measured = None if dist.empty else dist.statistic(slo.statistic)
        verdicts.append(ObjectiveVerdict(metric=metric, statistic=slo.statistic, objective_ms=objective,
                                         measured_ms=measured, met=measured is not None and measured <= objective))
    return SLOVerdict(objectives=verdicts, passed=all(v.met for v in verdicts))


def is_good(r: RequestRecord, slo: SLO) -> bool:
    """vLLM's --goodput: a successful request meeting every objective given. As in vLLM, a request with no second
    token has no TPOT to miss."""
    if not r.ok:
        return False
    ttft, tpot = ttft_ms(r), tpot_ms(r)
    if slo.ttft_ms is not None and (ttft is None or ttft > slo.ttft_ms):
        return False
    return slo.tpot_ms is None or tpot is None or tpot <= slo.tpot_ms


def peak_output_throughput(records: Sequence[RequestRecord]) -> float | None:
    """vLLM's "Peak output token throughput": the most output tokens arriving within one second (buckets from the
    first send). vLLM counts a token per chunk; here each chunk carries its request's N/K tokens, so multi-token
    chunks count in full. None when no successful request streamed."""
    streamed = [r for r in records if r.ok and r.chunk_times and r.output_tokens]
    if not streamed:
        return None
    origin = min(r.t0 for r in records)
    buckets: dict[int, float] = {}
    for r in streamed:
        assert r.output_tokens is not None
        per_chunk = r.output_tokens / len(r.chunk_times)
        for t in r.chunk_times:
            second = int(t - origin)
            buckets[second] = buckets.get(second, 0.0) + per_chunk
    return max(buckets.values())


class BenchMetrics(BaseModel):
    duration_s: float
    sent: int = Field(description="measured requests (warm-up excluded)")
    completed: int
    failed: int = Field(description="sent - completed; 429s included")
    rate_limited: int = Field(description="HTTP 429 answers, also counted in failed")
    total_input_tokens: int = Field(description="prompt tokens of the completed requests")
    total_output_tokens: int = Field(description="output tokens of the completed requests")
    request_throughput: float = Field(description="completed / duration, req/s")
    output_throughput: float = Field(description="output tokens / duration, tok/s")
    total_token_throughput: float = Field(description="(input + output tokens) / duration, tok/s")
    peak_output_throughput: float | None = Field(default=None, description="most output tokens in one second")
    error_rate: float = Field(description="failed / sent")
    good_requests: int | None = Field(default=None, description="requests meeting every objective; None: no SLO")
    goodput: float | None = Field(default=None, description="good requests / duration, req/s; None: no SLO")
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2e_ms: Distribution
    slo: SLOVerdict | None = None


def _defined(fn: Callable[[RequestRecord], float | None], records: Iterable[RequestRecord]) -> list[float]:
    return [v for v in map(fn, records) if v is not None]


def compute_metrics(records: Sequence[RequestRecord], duration_s: float, slo: SLO | None = None,
                    extra_percentiles: Sequence[float] = ()) -> BenchMetrics:
    """The run's figures over its measured (non-warm-up) records."""
    measured = [r for r in records if not r.warmup]
    ok = [r for r in measured if r.ok]
    input_tokens = sum(r.prompt_tokens or 0 for r in ok)
    output_tokens = sum(r.output_tokens or 0 for r in ok)

    def per_second(count: float) -> float:
        return count / duration_s if duration_s > 0 else 0.0

    ttft = distribution(_defined(ttft_ms, ok), extra_percentiles)
    tpot = distribution(_defined(tpot_ms, ok), extra_percentiles)
    good = None if slo is None or not slo.given else sum(is_good(r, slo) for r in ok)
    return BenchMetrics(
        duration_s=duration_s, sent=len(measured), completed=len(ok), failed=len(measured) - len(ok),
        rate_limited=sum(r.rate_limited for r in measured),
        total_input_tokens=input_tokens, total_output_tokens=output_tokens,
        request_throughput=per_second(len(ok)), output_throughput=per_second(output_tokens),
        total_token_throughput=per_second(input_tokens + output_tokens),
        peak_output_throughput=peak_output_throughput(measured),
        error_rate=(len(measured) - len(ok)) / len(measured) if measured else 0.0,
        good_requests=good, goodput=None if good is None else per_second(good),
        ttft_ms=ttft, tpot_ms=tpot,
        itl_ms=distribution((gap for r in ok for gap in itls_ms(r)), extra_percentiles),
        e2e_ms=distribution(_defined(e2e_ms, ok), extra_percentiles),
        slo=None if slo is None else judge_slo(ttft, tpot, slo),
    )


def mean_tokens(records: Iterable[RequestRecord]) -> tuple[float | None, float | None]:
    """Mean prompt and output tokens of the completed measured requests that counted them (None: none did)."""
    ok = [r for r in records if r.ok and not r.warmup]
    prompts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    outputs = [r.output_tokens for r in ok if r.output_tokens is not None]
    return (sum(prompts) / len(prompts) if prompts else None, sum(outputs) / len(outputs) if outputs else None)
