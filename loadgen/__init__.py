"""The load generator (docs/loadgen.md#what-it-measures): `npuserve bench`, and the library the simulator and the tuner
call.

    from npuserve.loadgen import BenchConfig, benchmark
    report = await benchmark(BenchConfig(base_url="http://127.0.0.1:8000"))   # -> BenchReport (records + metrics)

The names below load on first use, so importing a torch- and httpx-free part (datasets, arrivals, metrics, reports,
which the simulator uses) does not import the HTTP client.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BenchConfig": "npuserve.loadgen.config", "DatasetConfig": "npuserve.loadgen.config",
    "LoadConfig": "npuserve.loadgen.config", "SLO": "npuserve.loadgen.config",
    "RequestRecord": "npuserve.loadgen.records", "BenchResult": "npuserve.loadgen.result",
    "BenchMetrics": "npuserve.loadgen.metrics", "compute_metrics": "npuserve.loadgen.metrics",
    "BenchReport": "npuserve.loadgen.run", "benchmark": "npuserve.loadgen.run", "run_benchmark": "npuserve.loadgen.run",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'npuserve.loadgen' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
