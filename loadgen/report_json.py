"""Everything about a run as one JSON document: what was asked, every figure, MindIE's rows, the raw records."""

from __future__ import annotations

import math
from typing import Any

from npuserve.loadgen.metrics import BenchMetrics
from npuserve.loadgen.report_mindie import mindie_common, mindie_rows
from npuserve.loadgen.report_perf import perf_metrics
from npuserve.loadgen.result import BenchResult

SCHEMA_VERSION = 1


def json_safe(value: Any) -> Any:
    """Strict JSON has no infinity (an unbounded request rate): write non-finite floats as "inf", "-inf", "nan"."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def report_json(result: BenchResult, metrics: BenchMetrics) -> dict[str, Any]:
    document = {
        "schema_version": SCHEMA_VERSION,
        "model": result.model,
        "started_at": result.started_at.isoformat(),
        "duration_s": result.duration_s,
        "dataset": result.dataset,
        "token_source": result.token_source.value,
        "tokenizer": result.tokenizer,
        "interrupted": result.interrupted,
        "simulated": result.simulated,
        "config": result.config.model_dump(mode="json"),
        "metrics": metrics.model_dump(mode="json"),
        "perf": perf_metrics(result, metrics).model_dump(mode="json"),
        "mindie": {
            "performance": [row.model_dump(mode="json") for row in mindie_rows(result)],
            "common": dict(mindie_common(result, metrics)),
        },
        "records": [r.model_dump(mode="json") for r in result.records],
    }
    return {k: json_safe(v) for k, v in document.items()}
