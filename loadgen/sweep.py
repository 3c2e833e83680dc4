"""Sweeps and the capacity search (docs/loadgen.md#what-it-measures): the seeds' sweep CSV, the sweep's PNG, and the
largest concurrency that still meets the SLOs, found with as few runs as doubling and bisection allow."""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from npuserve.loadgen.config import SLO
from npuserve.loadgen.metrics import BenchMetrics, Distribution, judge_slo, mean_tokens
from npuserve.loadgen.result import BenchResult

SweepParameter = Literal["max-concurrency", "request-rate"]

CSV_HEADER = ["tp", "data_type", "batch", "prompt_tokens", "completion_tokens", "TOTAL_THROUGHPUT(toks/s)",
              "generate_throughput(toks/s)", "TTFT(ms)", "TPOT(ms)", "ITL(MS)",
              "P99_TTFT(ms)", "P99_TPOT(ms)", "P99_ITL(ms)"]


class SweepPoint(BaseModel):
    value: float  # the swept setting: a concurrency or a request rate
    metrics: BenchMetrics
    mean_prompt_tokens: float | None = None
    mean_completion_tokens: float | None = None

    @classmethod
    def from_run(cls, value: float, result: BenchResult, metrics: BenchMetrics) -> SweepPoint:
        prompt, completion = mean_tokens(result.measured)  # as the metrics: warm-up left out
        return cls(value=value, metrics=metrics, mean_prompt_tokens=prompt, mean_completion_tokens=completion)


def _number(value: float | None) -> str:
    """Whole numbers as integers (a batch of 8, 512 tokens), others to two decimals; nothing measured: empty."""
    if value is None:
        return ""
    return str(int(value)) if value == int(value) else f"{value:.2f}"


def _stat(dist: Distribution, p99: bool) -> str:
    return "" if dist.empty else f"{dist.p99 if p99 else dist.mean:.2f}"


def sweep_csv(points: Sequence[SweepPoint], parameter: SweepParameter, tp: int | None = None,
              data_type: str | None = None) -> str:
    """One row per point; the `batch` column (the concurrency) is named `request_rate` for a rate sweep. A
    statistic the run could not measure is an empty cell."""
    header = list(CSV_HEADER)
    if parameter == "request-rate":
        header[2] = "request_rate"
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    for p in points:
        m = p.metrics
        writer.writerow([
            "" if tp is None else tp, data_type or "", _number(p.value),
            _number(p.mean_prompt_tokens), _number(p.mean_completion_tokens),
            f"{m.total_token_throughput:.2f}", f"{m.output_throughput:.2f}",
            _stat(m.ttft_ms, False), _stat(m.tpot_ms, False), _stat(m.itl_ms, False),
            _stat(m.ttft_ms, True), _stat(m.tpot_ms, True), _stat(m.itl_ms, True),
        ])
    return buffer.getvalue()


def _series(points: Sequence[SweepPoint], dist: Callable[[BenchMetrics], Distribution],
            p99: bool) -> list[float]:
    return [math.nan if (d := dist(p.metrics)).empty else (d.p99 if p99 else d.mean) for p in points]


def plot_sweep(points: Sequence[SweepPoint], parameter: SweepParameter, slo: SLO | None, path: Path) -> Path:
    """Left: output and total tok/s against the swept setting; right: TTFT and TPOT (mean and P99) with the SLO
    lines. Drawn on an Agg canvas without pyplot, so no global backend is set and matplotlib loads only here."""
    from matplotlib.figure import Figure

    xs = [p.value for p in points]
    label = "max concurrency" if parameter == "max-concurrency" else "request rate (req/s)"
    figure = Figure(figsize=(12, 5), layout="constrained")
    throughput, latency = figure.subplots(1, 2)
    throughput.plot(xs, [p.metrics.output_throughput for p in points], "o-", label="output tok/s")
    throughput.plot(xs, [p.metrics.total_token_throughput for p in points], "s-", label="total tok/s")
    throughput.set(title="Throughput", xlabel=label, ylabel="tokens/s")
    for name, dist in (("TTFT", lambda m: m.ttft_ms), ("TPOT", lambda m: m.tpot_ms)):
        mean_line, = latency.plot(xs, _series(points, dist, False), "o-", label=f"{name} mean")
        latency.plot(xs, _series(points, dist, True), "o--", color=mean_line.get_color(), label=f"{name} P99")
        objective = None if slo is None else (slo.ttft_ms if name == "TTFT" else slo.tpot_ms)
        if objective is not None:
            latency.axhline(objective, color=mean_line.get_color(), linestyle=":",
                            label=f"{name} SLO ({slo.statistic if slo else ''})")
    latency.set(title="Latency", xlabel=label, ylabel="ms")
    latency.set_yscale("log")  # TTFT is often orders of magnitude above TPOT
    for axes in (throughput, latency):
        axes.grid(True, alpha=0.3)
        axes.legend()
    figure.suptitle(f"Sweep over {label}")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=100)
    return path


class CapacityPoint(BaseModel):
    concurrency: int
    metrics: BenchMetrics
    passed: bool


class CapacitySearch(BaseModel):
    points: list[CapacityPoint]  # in the order measured
    max_concurrency: int | None  # None: even the first concurrency failed
    limit_reached: bool  # the limit itself passed: the capacity may be higher


def point_passes(metrics: BenchMetrics, slo: SLO) -> bool:
    """Passing: some request completed, none failed, and the SLO verdict holds."""
    verdict = judge_slo(metrics.ttft_ms, metrics.tpot_ms, slo)
    return metrics.completed > 0 and metrics.error_rate == 0 and verdict is not None and verdict.passed


async def find_max_concurrency(measure: Callable[[int], Awaitable[BenchMetrics]], slo: SLO, *, start: int = 1,
                               limit: int = 4096) -> CapacitySearch:
    """Double from `start` until a concurrency fails (or `limit` passes), then bisect between the last pass and the
    first fail. Each concurrency is measured once."""
    if not slo.given:
        raise ValueError("the capacity search needs an objective: a TTFT or TPOT SLO")
    if not 1 <= start <= limit:
        raise ValueError(f"want 1 <= start ({start}) <= limit ({limit})")
    points: list[CapacityPoint] = []

    async def passes(concurrency: int) -> bool:
        metrics = await measure(concurrency)
        points.append(CapacityPoint(concurrency=concurrency, metrics=metrics, passed=point_passes(metrics, slo)))
        return points[-1].passed

    if not await passes(start):
        return CapacitySearch(points=points, max_concurrency=None, limit_reached=False)
    good, bad = start, None
    while bad is None and good < limit:
        trial = min(good * 2, limit)
        if await passes(trial):
            good = trial
        else:
            bad = trial
    if bad is None:
        return CapacitySearch(points=points, max_concurrency=good, limit_reached=True)
    while bad - good > 1:
        middle = (good + bad) // 2
        if await passes(middle):
            good = middle
        else:
            bad = middle
    return CapacitySearch(points=points, max_concurrency=good, limit_reached=False)


def instances_needed(target_users: int, max_concurrency: int) -> int:
    """Instances to serve `target_users` at `max_concurrency` each (10000 users at 90 -> 112)."""
    if max_concurrency <= 0:
        raise ValueError("max_concurrency must be positive")
    return math.ceil(target_users / max_concurrency)
