"""MindIE Benchmark's two tables (notes/benchmark-report-formats.md), computed from the records.

Rows the client cannot measure and the server did not report print "n/a" with a line under the table saying why;
no figure here is invented.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from datetime import timedelta

from pydantic import BaseModel

from npuserve.loadgen.metrics import BenchMetrics, Distribution, distribution, e2e_ms, itls_ms, percentile, ttft_ms
from npuserve.loadgen.records import RequestRecord
from npuserve.loadgen.result import BenchResult
from npuserve.loadgen.table import bordered_table

PERFORMANCE_TITLE = "The BenchMark test performance metric result is:"
COMMON_TITLE = "The BenchMark test common metric result is:"
PERFORMANCE_COLUMNS = ("Metric", "average", "max", "min", "P75", "P90", "SLO_P90", "P99", "N")
NOT_AVAILABLE = "n/a"

NO_SERVER_TIMINGS = "the server sent no per-request timings"
NO_TOKENIZER = "the client tokenized nothing (no tokenizer)"
NOT_REPORTED = "the server reports no such timings and the client cannot measure them"
NOT_STREAMED = "no request streamed two content chunks"


class MindieRow(BaseModel):
    """One row of the performance table. `stats` None or empty: the row prints n/a (`missing` says why)."""

    metric: str
    unit: str = ""
    stats: Distribution | None = None
    slo_p90: float | None = None  # None: the SLO_P90 cell shows "/"
    average_only: bool = False  # CharactersPerToken: only the average is meaningful
    average: float | None = None  # for average_only rows
    missing: str | None = None


def _row(metric: str, unit: str, values: Iterable[float], missing: str | None = None,
         slo_p90: bool = True) -> MindieRow:
    stats = distribution(values)
    return MindieRow(metric=metric, unit=unit, stats=stats, slo_p90=stats.p90 if slo_p90 and not stats.empty else None,
                     missing=missing if stats.empty else None)


def _server_values(records: list[RequestRecord], pick: str) -> list[float]:
    values: list[float] = []
    for r in records:
        if pick == "queue_us":
            queue_ms = r.server.queue_time_ms if r.server is not None else None
            if queue_ms is None and r.headers is not None:  # TGI's x-queue-time is the server's figure as well
                queue_ms = r.headers.queue_ms
            if queue_ms is not None:
                values.append(queue_ms * 1000.0)
        elif r.server is not None:
            value = r.server.prefill_batch_size if pick == "prefill" else r.server.mean_decode_batch_size
            if value is not None:
                values.append(float(value))
    return values


def mindie_rows(result: BenchResult) -> list[MindieRow]:
    """The performance table's rows over the completed measured requests, in MindIE's order."""
    ok = [r for r in result.measured if r.ok]
    gaps = [itls_ms(r) for r in ok]
    e2e = [(r, e) for r in ok if (e := e2e_ms(r)) is not None]
    chars = sum(r.output_chars for r in ok if r.output_tokens)
    tokens = sum(r.output_tokens or 0 for r in ok)
    decode = _row("DecodeTime", "ms", (g for per_request in gaps for g in per_request), NOT_STREAMED)
    if decode.stats is not None and not decode.stats.empty:  # SLO_P90 of DecodeTime: P90 of each request's mean gap
        decode.slo_p90 = percentile((math.fsum(g) / len(g) for g in gaps if g), 90)
    return [
        _row("FirstTokenTime", "ms", (v for r in ok if (v := ttft_ms(r)) is not None)),
        decode,
        _row("LastDecodeTime", "ms", (g[-1] for g in gaps if g), NOT_STREAMED),
        _row("MaxDecodeTime", "ms", (max(g) for g in gaps if g), NOT_STREAMED),
        _row("GenerateTime", "ms", (e for _, e in e2e)),
        _row("InputTokens", "", (r.prompt_tokens for r in ok if r.prompt_tokens is not None)),
        _row("GeneratedTokens", "", (r.output_tokens for r in ok if r.output_tokens is not None)),
        _row("GeneratedTokenSpeed", "token/s",
             (r.output_tokens / (e / 1000.0) for r, e in e2e if r.output_tokens is not None and e > 0)),
        _row("GeneratedCharacters", "", (r.output_chars for r in ok)),
        _row("Tokenizer", "ms", (r.tokenize_ms for r in ok if r.tokenize_ms is not None), NO_TOKENIZER),
        _row("Detokenizer", "ms", (r.detokenize_ms for r in ok if r.detokenize_ms is not None), NO_TOKENIZER),
        MindieRow(metric="CharactersPerToken", average_only=True, average=chars / tokens if tokens else None),
        MindieRow(metric="PostProcessingTime", unit="ms", missing=NOT_REPORTED),
        MindieRow(metric="ForwardTime", unit="ms", missing=NOT_REPORTED),
        _row("PrefillBatchsize", "", _server_values(ok, "prefill"), NO_SERVER_TIMINGS),
        _row("DecoderBatchsize", "", _server_values(ok, "decode"), NO_SERVER_TIMINGS, slo_p90=False),
        _row("QueueWaitTime", "μs", _server_values(ok, "queue_us"), NO_SERVER_TIMINGS, slo_p90=False),
    ]


def _fmt(value: float, unit: str) -> str:
    return f"{value:.4f} {unit}" if unit else f"{value:.4f}"


def _slash(unit: str) -> str:
    return f"/ {unit}" if unit else "/"


def _cells(row: MindieRow) -> list[str]:
    if row.average_only:
        average = NOT_AVAILABLE if row.average is None else _fmt(row.average, row.unit)
        return [row.metric, average, *["/"] * (len(PERFORMANCE_COLUMNS) - 2)]
    s = row.stats
    if s is None or s.empty:
        return [row.metric, *[NOT_AVAILABLE] * (len(PERFORMANCE_COLUMNS) - 2), "0"]
    slo = _slash(row.unit) if row.slo_p90 is None else _fmt(row.slo_p90, row.unit)
    stats = [_fmt(v, row.unit) for v in (s.mean, s.max, s.min, s.p75, s.p90)]
    return [row.metric, *stats, slo, _fmt(s.p99, row.unit), str(s.n)]


def _notes(rows: list[MindieRow]) -> list[str]:
    """One line per reason, naming the rows it leaves empty, in the order the reasons first appear."""
    by_reason: dict[str, list[str]] = {}
    for row in rows:
        if row.missing is not None:
            by_reason.setdefault(row.missing, []).append(row.metric)
    return [f"{', '.join(names)}: {reason}" for reason, names in by_reason.items()]


def _share(count: int, total: int, brackets: str = "()") -> str:
    pct = 100.0 * count / total if total else 0.0
    return f"{count}{brackets[0]} {pct:.1f}% {brackets[1]}"


def mindie_common(result: BenchResult, metrics: BenchMetrics) -> list[tuple[str, str]]:
    """The common metric table's rows (name, value)."""
    load = result.config.load
    ok = [r for r in result.measured if r.ok]
    paired = [(t, r.prompt_tokens) for r in ok if (t := ttft_ms(r)) is not None and r.prompt_tokens]
    prompt_total = sum(p for _, p in paired)
    lpct = f"{math.fsum(t for t, _ in paired) / prompt_total:.4f} ms" if prompt_total else NOT_AVAILABLE
    generate_speed = metrics.output_throughput
    concurrency = result.concurrency
    rows = [
        ("CurrentTime", (result.started_at + timedelta(seconds=metrics.duration_s)).strftime("%Y-%m-%d %H:%M:%S")),
        ("TimeElapsed", f"{metrics.duration_s:.4f} s"),
        ("DataSource", result.dataset),
        ("Failed", _share(metrics.failed, metrics.sent)),
        ("Returned", _share(metrics.completed, metrics.sent)),
        ("Total", _share(metrics.sent, metrics.sent, "[]")),
        ("Concurrency", "/" if concurrency is None else str(concurrency)),
    ]
    if math.isfinite(load.request_rate):  # open loop: the arrival rate is the load's size
        rows.append(("RequestRate", f"{load.request_rate:.4f} req/s"))
    rows += [
        ("ModelName", result.model),
        ("lpct", lpct),
        ("Throughput", f"{metrics.request_throughput:.4f} req/s"),
        ("GenerateSpeed", f"{generate_speed:.4f} token/s"),
        ("GenerateSpeedPerClient", "/" if not concurrency else f"{generate_speed / concurrency:.4f} token/s"),
        ("accuracy", "/"),
    ]
    return rows


def render_mindie(result: BenchResult, metrics: BenchMetrics) -> str:
    rows = mindie_rows(result)
    performance = bordered_table(PERFORMANCE_COLUMNS, [_cells(row) for row in rows])
    common = bordered_table(("Common Metric", "Value"), mindie_common(result, metrics))
    return "\n".join([PERFORMANCE_TITLE, performance, *_notes(rows), COMMON_TITLE, common])
