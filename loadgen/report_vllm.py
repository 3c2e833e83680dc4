"""vLLM `bench serve`'s summary block and its `--save-result` JSON, so users' scripts read our runs unchanged.

Layout and field names follow vLLM's `vllm/benchmarks/serve.py` (formerly `benchmarks/benchmark_serving.py`).
Two deliberate differences: a statistic over no values prints "n/a" (JSON null) where vLLM prints 0.00, and the
peak output throughput counts every token of a multi-token chunk (`metrics.peak_output_throughput`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

from npuserve.loadgen.metrics import MS_PER_S, BenchMetrics, Distribution, percentile_key
from npuserve.loadgen.records import Endpoint, RequestRecord
from npuserve.loadgen.result import BenchResult

# vLLM's --percentile-metrics keys: (the BenchMetrics field, the short name, the section header)
PERCENTILE_METRICS: dict[str, tuple[str, str, str]] = {
    "ttft": ("ttft_ms", "TTFT", "Time to First Token"),
    "tpot": ("tpot_ms", "TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("itl_ms", "ITL", "Inter-token Latency"),
    "e2el": ("e2e_ms", "E2EL", "End-to-end Latency"),
}
DEFAULT_PERCENTILE_METRICS = ("ttft", "tpot", "itl")
DEFAULT_METRIC_PERCENTILES: tuple[float, ...] = (99,)

BACKENDS = {  # vLLM's --backend names for our endpoints
    Endpoint.COMPLETIONS: "openai",
    Endpoint.CHAT: "openai-chat",
    Endpoint.TGI_STREAM: "tgi",
    Endpoint.TGI: "tgi",
}

_LABEL = "{:<40} {:<10}"
_NUMBER = "{:<40} {:<10.2f}"


def _check(percentile_metrics: Sequence[str]) -> None:
    unknown = [key for key in percentile_metrics if key not in PERCENTILE_METRICS]
    if unknown:
        raise ValueError(f"unknown percentile metric {unknown[0]!r}; choose from {', '.join(PERCENTILE_METRICS)}")


def _distribution(metrics: BenchMetrics, key: str) -> Distribution:
    dist: Distribution = getattr(metrics, PERCENTILE_METRICS[key][0])
    return dist


def _value_line(label: str, value: float | None) -> str:
    return _LABEL.format(label, "n/a") if value is None else _NUMBER.format(label, value)


def render_vllm(result: BenchResult, metrics: BenchMetrics,
                percentile_metrics: Sequence[str] = DEFAULT_PERCENTILE_METRICS,
                metric_percentiles: Sequence[float] = DEFAULT_METRIC_PERCENTILES) -> str:
    _check(percentile_metrics)
    load = result.config.load
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
             _LABEL.format("Successful requests:", metrics.completed),
             _LABEL.format("Failed requests:", metrics.failed)]
    if load.max_concurrency is not None:
        lines.append(_LABEL.format("Maximum request concurrency:", load.max_concurrency))
    if math.isfinite(load.request_rate):
        lines.append(_NUMBER.format("Request rate configured (RPS):", load.request_rate))
    lines += [_NUMBER.format("Benchmark duration (s):", metrics.duration_s),
              _LABEL.format("Total input tokens:", metrics.total_input_tokens),
              _LABEL.format("Total generated tokens:", metrics.total_output_tokens),
              _NUMBER.format("Request throughput (req/s):", metrics.request_throughput)]
    if metrics.goodput is not None:
        lines.append(_NUMBER.format("Request goodput (req/s):", metrics.goodput))
    lines.append(_NUMBER.format("Output token throughput (tok/s):", metrics.output_throughput))
    if metrics.peak_output_throughput is not None:
        lines.append(_NUMBER.format("Peak output token throughput (tok/s):", metrics.peak_output_throughput))
    lines.append(_NUMBER.format("Total Token throughput (tok/s):", metrics.total_token_throughput))
    for key in PERCENTILE_METRICS:  # vLLM prints the sections in its own order, whatever order they were asked in
        if key not in percentile_metrics:
            continue
        dist, (_, name, header) = _distribution(metrics, key), PERCENTILE_METRICS[key]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        lines.append(_value_line(f"Mean {name} (ms):", None if dist.empty else dist.mean))
        lines.append(_value_line(f"Median {name} (ms):", None if dist.empty else dist.median))
        for q in metric_percentiles:
            lines.append(_value_line(f"P{percentile_key(q)} {name} (ms):", None if dist.empty else dist.at(q)))
    lines.append("=" * 50)
    return "\n".join(lines)


def backend_name(result: BenchResult) -> str:
    return BACKENDS[result.config.endpoint]


def _request_rate(result: BenchResult) -> float | str:
    rate = result.config.load.request_rate
    return rate if math.isfinite(rate) else "inf"


def _error(r: RequestRecord) -> str:
    if r.ok:
        return ""
    return r.error or (f"HTTP {r.status}" if r.status is not None else "no response")


def _ttft_s(r: RequestRecord) -> float:
    """What vLLM stores for one request: the first chunk's delay as observed, 0.0 when none arrived (its default)."""
    if r.chunk_times:
        return r.chunk_times[0] - r.t0
    if r.ok and r.headers is not None:
        return r.headers.first_token_ms / MS_PER_S
    return 0.0


def _itls_s(r: RequestRecord) -> list[float]:
    return [b - a for a, b in itertools.pairwise(r.chunk_times)]


def vllm_result_json(result: BenchResult, metrics: BenchMetrics,
                     percentile_metrics: Sequence[str] = DEFAULT_PERCENTILE_METRICS,
                     metric_percentiles: Sequence[float] = DEFAULT_METRIC_PERCENTILES) -> dict[str, Any]:
    """vLLM's `--save-result` file. The per-request lists run over every measured request in sending order, as
    vLLM's do: a failed request has output length 0, its error text, and whatever timings arrived (ttft 0.0 when
    none did)."""
    _check(percentile_metrics)
    load = result.config.load
    measured = sorted(result.measured, key=lambda r: r.index)
    out: dict[str, Any] = {
        "date": result.started_at.strftime("%Y%m%d-%H%M%S"),
        "backend": backend_name(result),
        "model_id": result.model,
        "tokenizer_id": result.tokenizer or result.model,
        "num_prompts": load.num_prompts,
        "request_rate": _request_rate(result),
        "burstiness": load.burstiness,
        "max_concurrency": load.max_concurrency,
        "duration": metrics.duration_s,
        "completed": metrics.completed,
        "failed": metrics.failed,
        "total_input_tokens": metrics.total_input_tokens,
        "total_output_tokens": metrics.total_output_tokens,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.goodput,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "max_output_tokens_per_s": metrics.peak_output_throughput,
        "input_lens": [r.prompt_tokens for r in measured],
        "output_lens": [(r.output_tokens or 0) if r.ok else 0 for r in measured],
        "ttfts": [_ttft_s(r) for r in measured],
        "itls": [_itls_s(r) for r in measured],
        "generated_texts": [r.text for r in measured],
        "errors": [_error(r) for r in measured],
    }
    for key in PERCENTILE_METRICS:
        if key not in percentile_metrics:
            continue
        dist = _distribution(metrics, key)
        out[f"mean_{key}_ms"] = None if dist.empty else dist.mean
        out[f"median_{key}_ms"] = None if dist.empty else dist.median
        out[f"std_{key}_ms"] = None if dist.empty else dist.std
        for q in metric_percentiles:
            out[f"p{percentile_key(q)}_{key}_ms"] = None if dist.empty else dist.at(q)
    return out


def default_result_filename(result: BenchResult) -> str:
    """vLLM's name for a saved result: `{backend}-{rate}qps[-concurrency{N}]-{model}-{date}.json`."""
    load = result.config.load
    concurrency = f"-concurrency{load.max_concurrency}" if load.max_concurrency is not None else ""
    model = result.model.split("/")[-1]
    date = result.started_at.strftime("%Y%m%d-%H%M%S")
    return f"{backend_name(result)}-{float(load.request_rate)}qps{concurrency}-{model}-{date}.json"
