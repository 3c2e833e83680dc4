"""The sweep CSV, the sweep plot, and the capacity search with a fake measurement of known capacity."""

from __future__ import annotations

import asyncio
import csv
import io
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from npuserve.loadgen.config import SLO
from npuserve.loadgen.metrics import BenchMetrics, distribution
from npuserve.loadgen.sweep import (
    CSV_HEADER,
    SweepPoint,
    find_max_concurrency,
    instances_needed,
    plot_sweep,
    sweep_csv,
)


def figures(ttft: list[float], tpot: list[float], itl: list[float], output: float, total: float,
            failed: int = 0) -> BenchMetrics:
    return BenchMetrics(
        duration_s=10.0, sent=len(ttft) + failed, completed=len(ttft), failed=failed, rate_limited=0,
        total_input_tokens=0, total_output_tokens=0, request_throughput=1.0, output_throughput=output,
        total_token_throughput=total, error_rate=failed / (len(ttft) + failed), ttft_ms=distribution(ttft),
        tpot_ms=distribution(tpot), itl_ms=distribution(itl), e2e_ms=distribution(ttft),
    )


POINTS = [
    SweepPoint(value=8, metrics=figures([100.0, 300.0], [10.0, 20.0], [10.0, 20.0, 30.0], 1000.0, 2000.123),
               mean_prompt_tokens=512, mean_completion_tokens=512),
    SweepPoint(value=16, metrics=figures([200.0, 400.0], [20.0, 40.0], [], 1500.0, 3000.0),
               mean_prompt_tokens=511.5, mean_completion_tokens=None),
]


def test_sweep_csv_header_and_rows() -> None:
    rows = list(csv.reader(io.StringIO(sweep_csv(POINTS, "max-concurrency", tp=8, data_type="bf16"))))
    assert rows[0] == ["tp", "data_type", "batch", "prompt_tokens", "completion_tokens", "TOTAL_THROUGHPUT(toks/s)",
                       "generate_throughput(toks/s)", "TTFT(ms)", "TPOT(ms)", "ITL(MS)", "P99_TTFT(ms)",
                       "P99_TPOT(ms)", "P99_ITL(ms)"]
    # P99 of 100, 300: 100 + 0.99 * 200 = 298; of 10, 20: 19.9; of 10, 20, 30: rank 1.98 -> 29.8
    assert rows[1] == ["8", "bf16", "8", "512", "512", "2000.12", "1000.00", "200.00", "15.00", "20.00", "298.00",
                       "19.90", "29.80"]
    # nothing measured is an empty cell, not 0
    assert rows[2][2:5] == ["16", "511.50", ""] and rows[2][9] == "" and rows[2][12] == ""
    assert len(rows) == 3


def test_sweep_csv_of_a_request_rate_sweep_names_the_column() -> None:
    header = sweep_csv(POINTS[:1], "request-rate").splitlines()[0].split(",")
    assert header[2] == "request_rate" and header[:2] == ["tp", "data_type"]
    assert sweep_csv(POINTS[:1], "request-rate").splitlines()[1].startswith(",,8,")
    assert CSV_HEADER[2] == "batch"  # the shared header is not changed by a rate sweep


def test_plot_sweep_writes_a_png(tmp_path: Path) -> None:
    out = plot_sweep(POINTS, "max-concurrency", SLO(ttft_ms=250.0, tpot_ms=30.0), tmp_path / "plots" / "sweep.png")
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 10_000
    plot_sweep(POINTS, "request-rate", None, tmp_path / "no_slo.png")
    assert (tmp_path / "no_slo.png").stat().st_size > 0


def test_sweep_module_does_not_import_matplotlib() -> None:
    check = "import sys, npuserve.loadgen.sweep; print(any(m.startswith('matplotlib') for m in sys.modules))"
    # -P: the repository's operator/ folder must not shadow the standard library's operator module
    result = subprocess.run([sys.executable, "-P", "-c", check], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


Measure = Callable[[int], Awaitable[BenchMetrics]]


def fake_service(capacity: int, fails_with_errors_from: int | None = None) -> tuple[list[int], Measure]:
    """A service whose mean TTFT is `concurrency` ms: it meets a 37 ms objective up to `capacity` users."""
    calls: list[int] = []

    async def measure(concurrency: int) -> BenchMetrics:
        calls.append(concurrency)
        ttft = float(concurrency) * 37.0 / capacity
        erroring = fails_with_errors_from is not None and concurrency >= fails_with_errors_from
        return figures([ttft], [1.0], [1.0], 1.0, 1.0, failed=1 if erroring else 0)

    return calls, measure


SLO_37 = SLO(ttft_ms=37.0)


def test_capacity_search_finds_the_threshold_with_few_measurements() -> None:
    calls, measure = fake_service(37)
    search = asyncio.run(find_max_concurrency(measure, SLO_37))
    assert search.max_concurrency == 37
    # doubling 1..64 (64 fails), then bisecting 32..64
    assert calls == [1, 2, 4, 8, 16, 32, 64, 48, 40, 36, 38, 37]
    assert [p.concurrency for p in search.points] == calls
    assert [p.passed for p in search.points][-6:] == [False, False, False, True, False, True]
    assert not search.limit_reached


def test_capacity_search_fails_on_errors() -> None:
    calls, measure = fake_service(10_000, fails_with_errors_from=20)
    search = asyncio.run(find_max_concurrency(measure, SLO_37))
    assert search.max_concurrency == 19
    assert len(calls) == len(set(calls))  # no concurrency measured twice


def test_capacity_search_when_even_the_start_fails_or_the_limit_passes() -> None:
    calls, measure = fake_service(3)
    search = asyncio.run(find_max_concurrency(measure, SLO_37, start=4))
    assert (search.max_concurrency, calls) == (None, [4])
    calls, measure = fake_service(1000)
    search = asyncio.run(find_max_concurrency(measure, SLO_37, limit=50))
    assert (search.max_concurrency, search.limit_reached) == (50, True)
    assert calls == [1, 2, 4, 8, 16, 32, 50]


def test_capacity_search_needs_an_objective() -> None:
    _, measure = fake_service(37)
    with pytest.raises(ValueError, match="objective"):
        asyncio.run(find_max_concurrency(measure, SLO()))


def test_instances_needed_rounds_up() -> None:
    assert instances_needed(10_000, 90) == 112
    assert instances_needed(180, 90) == 2
