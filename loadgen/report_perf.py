"""The seeds' perf-test scheme (notes/benchmark-report-formats.md): per-request latencies and system figures.

A TGI `/generate` record (timing headers, no chunks) is read as that scheme reads it: first-token latency =
x-prefill-time + x-queue-time, average token latency = x-time-per-token, response time = x-inference-time. Streamed
records use TTFT, TPOT and E2E.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pydantic import BaseModel, Field

from npuserve.loadgen.metrics import BenchMetrics, e2e_ms, percentile, tpot_ms, ttft_ms
from npuserve.loadgen.records import RequestRecord
from npuserve.loadgen.result import BenchResult
from npuserve.loadgen.table import aligned_columns


class LatencySummary(BaseModel):
    """Milliseconds."""

    n: int
    mean: float
    p50: float
    p90: float
    p95: float
    p99: float


class PerfReport(BaseModel):
    first_token_latency: LatencySummary | None = Field(description="None: no request measured one")
    avg_token_latency: LatencySummary | None = Field(description="None: no request had a second token")
    response_time: LatencySummary | None
    benchmark_time: float = Field(description="seconds: the longest user's run, first send to last response")
    throughput_token_rate: float = Field(description="output tokens/s (TPS)")
    throughput_request_rate: float = Field(description="completed requests/s (QPS)")
    error_rate: float
    concurrency_users: int | None = Field(description="the closed-loop users; None for an open-loop run")


def _header_mode(r: RequestRecord) -> bool:
    return r.headers is not None and not r.chunk_times


def _response_ms(r: RequestRecord) -> float | None:
    if r.ok and _header_mode(r):
        assert r.headers is not None
        return r.headers.inference_ms
    return e2e_ms(r)


def _summary(values: Iterable[float | None]) -> LatencySummary | None:
    xs = [v for v in values if v is not None]
    if not xs:
        return None
    return LatencySummary(n=len(xs), mean=sum(xs) / len(xs), p50=percentile(xs, 50), p90=percentile(xs, 90),
                          p95=percentile(xs, 95), p99=percentile(xs, 99))


def benchmark_time(records: Iterable[RequestRecord]) -> float:
    """The longest user's run: per user, its last response's end minus its first send. Records without a user
    (open loop) count as one user."""
    spans: dict[int | None, tuple[float, float]] = {}
    for r in records:
        end = r.end if r.end is not None else (r.chunk_times[-1] if r.chunk_times else None)
        if end is None:
            continue
        first, last = spans.get(r.user, (r.t0, end))
        spans[r.user] = (min(first, r.t0), max(last, end))
    return max((last - first for first, last in spans.values()), default=0.0)


def perf_metrics(result: BenchResult, metrics: BenchMetrics) -> PerfReport:
    measured = result.measured

    def per_record(fn: Callable[[RequestRecord], float | None]) -> LatencySummary | None:
        return _summary(fn(r) for r in measured)

    load = result.config.load
    return PerfReport(
        first_token_latency=per_record(ttft_ms), avg_token_latency=per_record(tpot_ms),
        response_time=per_record(_response_ms), benchmark_time=benchmark_time(measured),
        throughput_token_rate=metrics.output_throughput, throughput_request_rate=metrics.request_throughput,
        error_rate=metrics.error_rate, concurrency_users=load.max_concurrency if load.closed_loop else None,
    )


def render_perf(result: BenchResult, metrics: BenchMetrics) -> str:
    return format_perf(perf_metrics(result, metrics))


def format_perf(report: PerfReport) -> str:
    rows = [["latency (ms)", "mean", "P50", "P90", "P95", "P99", "N"]]
    for name in ("first_token_latency", "avg_token_latency", "response_time"):
        s: LatencySummary | None = getattr(report, name)
        if s is None:
            rows.append([name, *["n/a"] * 5, "0"])
        else:
            rows.append([name, *(f"{v:.2f}" for v in (s.mean, s.p50, s.p90, s.p95, s.p99)), str(s.n)])
    users = "n/a (open loop)" if report.concurrency_users is None else str(report.concurrency_users)
    system = [
        ["benchmark_time (s)", f"{report.benchmark_time:.2f}"],
        ["throughput_token_rate (tok/s)", f"{report.throughput_token_rate:.2f}"],
        ["throughput_request_rate (req/s)", f"{report.throughput_request_rate:.2f}"],
        ["error_rate", f"{report.error_rate:.2%}"],
        ["concurrency_users", users],
    ]
    return "\n".join(["Perf test result", aligned_columns(rows), "", aligned_columns(system)])
