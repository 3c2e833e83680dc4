"""`npuserve bench`: the load generator's command line, a thin shell over `npuserve.loadgen` (DESIGN.md 5).

One run (or a sweep, or a capacity search) measured once and reported as the MindIE Benchmark, vLLM's
`bench serve` (and its `--save-result` JSON), the seeds' perf scheme, or JSON with every record. Exit status: 0 when
the run measured something, 1 when every request failed, 2 when the server cannot be reached or a flag is wrong.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from npuserve.engine_contract import ENGINE_PORT, INFO_PATH
from npuserve.loadgen import cli_args
from npuserve.loadgen.config import BenchConfig
from npuserve.loadgen.datasets import DatasetError
from npuserve.loadgen.metrics import BenchMetrics, compute_metrics
from npuserve.loadgen.progress import progress
from npuserve.loadgen.records import Endpoint
from npuserve.loadgen.report_json import report_json
from npuserve.loadgen.report_mindie import render_mindie
from npuserve.loadgen.report_perf import render_perf
from npuserve.loadgen.report_vllm import default_result_filename, render_vllm, vllm_result_json
from npuserve.loadgen.result import BenchResult
from npuserve.loadgen.run import ServerUnreachable, run_benchmark
from npuserve.loadgen.sweep import (
    SweepParameter,
    SweepPoint,
    find_max_concurrency,
    instances_needed,
    plot_sweep,
    sweep_csv,
)
from npuserve.loadgen.tokenizer import TokenizerError

FORMATS = ("vllm", "mindie", "perf", "json")
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
SWEEPABLE = ("max-concurrency", "request-rate")


def configure(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--base-url", default=f"http://127.0.0.1:{ENGINE_PORT}", help="the server (default %(default)s)")
    g.add_argument("--endpoint", choices=[e.value for e in Endpoint], default=Endpoint.COMPLETIONS.value,
                   help="the route to drive; /generate reads the perf scheme's timing headers")
    g.add_argument("--model", help="served model name (default: the first /v1/models lists)")
    g.add_argument("--tokenizer", help="an HF model folder to count tokens with (default: the folder the server's "
                                       "/v1/models names, when it is on this machine; else the server's counts)")
    g.add_argument("--ignore-eos", action="store_true", help="generate every requested token (vLLM's extension)")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request (default 600)")
    cli_args.add_dataset_args(parser)
    cli_args.add_load_args(parser)
    cli_args.add_slo_args(parser)
    r = parser.add_argument_group("reports")
    r.add_argument("--format", choices=FORMATS, default="vllm",
                   help="vllm: bench serve's summary; mindie: MindIE Benchmark's tables; perf: the perf scheme; "
                        "json: everything with the raw records")
    r.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                   help=f"comma-separated metrics to report percentiles of ({', '.join(PERCENTILE_METRICS)})")
    r.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles, e.g. 50,90,99")
    r.add_argument("--save-result", action="store_true", help="write vLLM's result JSON")
    r.add_argument("--result-dir", default=".", help="where --save-result writes (default: here)")
    r.add_argument("--result-filename", help="the result file's name (default: vLLM's pattern)")
    r.add_argument("--save-trace", metavar="FILE.jsonl", help="every request's record, written as it ends")
    s = parser.add_argument_group("sweeps and capacity")
    s.add_argument("--sweep", metavar="PARAM=V1,V2,...",
                   help=f"run once per value of {' or '.join(SWEEPABLE)} and write the sweep CSV")
    s.add_argument("--sweep-csv", metavar="FILE.csv", help="where the sweep CSV goes (default: standard output)")
    s.add_argument("--plot", metavar="FILE.png", help="plot the sweep (or the capacity search): throughput and "
                                                      "latency against the swept value, SLO lines drawn")
    s.add_argument("--find-max-concurrency", action="store_true",
                   help="search (doubling, then bisection; each point a full run) for the largest concurrency "
                        "that meets --slo-ttft-ms / --slo-tpot-ms")
    s.add_argument("--max-search-concurrency", type=int, default=4096, help="upper bound of that search")
    s.add_argument("--target-users", type=int, help="with --find-max-concurrency: print the instances needed")


def _csv_list(text: str, flag: str, cast: Callable[[str], Any]) -> list[Any]:
    try:
        return [cast(v.strip()) for v in text.split(",") if v.strip()]
    except ValueError:
        raise cli_args.ArgumentError(f"{flag}: {text!r} is not a comma-separated list") from None


def _parse_sweep(text: str) -> tuple[SweepParameter, list[float]]:
    name, sep, values = text.partition("=")
    if not sep or name not in SWEEPABLE:
        raise cli_args.ArgumentError(f"--sweep: {text!r}: want {SWEEPABLE[0]}=1,2,4 or {SWEEPABLE[1]}=1,2.5,5")
    parsed = _csv_list(values, "--sweep", float)
    if not parsed or any(v <= 0 for v in parsed):
        raise cli_args.ArgumentError(f"--sweep: {text!r}: want positive values")
    if name == "max-concurrency" and any(v != int(v) for v in parsed):
        raise cli_args.ArgumentError(f"--sweep: {text!r}: concurrencies are whole numbers")
    return ("max-concurrency" if name == "max-concurrency" else "request-rate"), parsed


def build_config(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        base_url=args.base_url.rstrip("/"), endpoint=Endpoint(args.endpoint), model=args.model,
        tokenizer=Path(args.tokenizer) if args.tokenizer else None, dataset=cli_args.dataset_config(args),
        load=cli_args.load_config(args), slo=cli_args.slo_config(args), ignore_eos=args.ignore_eos,
        request_timeout_s=args.request_timeout, save_trace=Path(args.save_trace) if args.save_trace else None,
    )


class _Interrupt:
    """Ctrl-C once: stop sending and report what was measured. Twice: leave at once."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()

        def first() -> None:
            print("\ninterrupted: no new requests; waiting briefly for those in flight (Ctrl-C again to quit)",
                  file=sys.stderr)
            self.event.set()
            loop.remove_signal_handler(signal.SIGINT)

        try:
            loop.add_signal_handler(signal.SIGINT, first)
        except (NotImplementedError, RuntimeError):  # not the main thread: no handler, Ctrl-C ends the process
            yield
            return
        try:
            yield
        finally:
            loop.remove_signal_handler(signal.SIGINT)


async def _measure(config: BenchConfig, interrupt: _Interrupt, label: str) -> BenchResult:
    total = None if config.load.duration_s is not None else config.load.num_prompts
    with progress(total, label=label) as counter:
        return await run_benchmark(config, on_record=counter.add, stop=interrupt.event)


def _metrics(result: BenchResult, percentiles: list[float]) -> BenchMetrics:
    return compute_metrics(result.measured, result.duration_s, result.config.slo, percentiles)


def _slo_line(metrics: BenchMetrics) -> str | None:
    if metrics.slo is None:
        return None
    parts = []
    for o in metrics.slo.objectives:
        measured = "none measured" if o.measured_ms is None else f"{o.measured_ms:.2f} ms"
        parts.append(f"{o.statistic} {o.metric.upper()} {measured} {'<=' if o.met else '>'} {o.objective_ms:g} ms")
    return f"SLO: {'PASS' if metrics.slo.passed else 'FAIL'} ({'; '.join(parts)})"


def _first_errors(result: BenchResult, limit: int = 5) -> list[str]:
    seen: dict[str, int] = {}
    for r in result.measured:
        if not r.ok:
            key = f"HTTP {r.status}: {r.error}" if r.status is not None else str(r.error)
            seen[key] = seen.get(key, 0) + 1
    return [f"  {count} x {error}" for error, count in list(seen.items())[:limit]]


def _report(args: argparse.Namespace, result: BenchResult, metrics: BenchMetrics) -> str:
    pct_metrics = _csv_list(args.percentile_metrics, "--percentile-metrics", str)
    pcts = _csv_list(args.metric_percentiles, "--metric-percentiles", float)
    if args.format == "mindie":
        return render_mindie(result, metrics)
    if args.format == "perf":
        return render_perf(result, metrics)
    if args.format == "json":
        return json.dumps(report_json(result, metrics), indent=2, default=str)
    return render_vllm(result, metrics, pct_metrics, pcts)


def _save_result(args: argparse.Namespace, result: BenchResult, metrics: BenchMetrics) -> Path:
    pct_metrics = _csv_list(args.percentile_metrics, "--percentile-metrics", str)
    pcts = _csv_list(args.metric_percentiles, "--metric-percentiles", float)
    directory = Path(args.result_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / (args.result_filename or default_result_filename(result))
    path.write_text(json.dumps(vllm_result_json(result, metrics, pct_metrics, pcts), indent=2))
    return path


async def _engine_layout(base_url: str) -> tuple[int | None, str | None]:
    """worldSize and dtype for the sweep CSV's tp and data_type columns, from the engine's /info when it has one."""
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
        async with httpx.AsyncClient(base_url=base_url, timeout=5.0) as http:
            response = await http.get(INFO_PATH)
            if response.status_code == 200:
                info = response.json()
                return int(info["worldSize"]), str(info["dtype"])
    return None, None


def _point_line(name: str, value: float, metrics: BenchMetrics) -> str:
    verdict = f"  SLO {'PASS' if metrics.slo.passed else 'FAIL'}" if metrics.slo else ""
    return (f"{name}={value:g}: {metrics.completed}/{metrics.sent} ok, {metrics.output_throughput:.1f} output tok/s, "
            f"TTFT mean {metrics.ttft_ms.mean:.1f} ms, TPOT mean {metrics.tpot_ms.mean:.1f} ms{verdict}")


async def _sweep(args: argparse.Namespace, config: BenchConfig, interrupt: _Interrupt) -> int:
    name, values = _parse_sweep(args.sweep)
    pcts = _csv_list(args.metric_percentiles, "--metric-percentiles", float)
    points: list[SweepPoint] = []
    for value in values:
        load = (config.load.model_copy(update={"max_concurrency": int(value)}) if name == "max-concurrency"
                else config.load.model_copy(update={"request_rate": value}))
        result = await _measure(config.model_copy(update={"load": load}), interrupt, f"{name}={value:g}")
        metrics = _metrics(result, pcts)
        print(_point_line(name, value, metrics), flush=True)
        points.append(SweepPoint.from_run(value, result, metrics))
        if interrupt.event.is_set():
            break
    tp, dtype = await _engine_layout(config.base_url)
    text = sweep_csv(points, name, tp, dtype)
    if args.sweep_csv:
        Path(args.sweep_csv).write_text(text)
        print(f"sweep CSV: {args.sweep_csv}")
    else:
        print(text, end="")
    if args.plot:
        plot_sweep(points, name, config.slo, Path(args.plot))
        print(f"plot: {args.plot}")
    return 0 if any(p.metrics.completed for p in points) else 1


async def _capacity(args: argparse.Namespace, config: BenchConfig, interrupt: _Interrupt) -> int:
    if not config.slo.given:
        raise cli_args.ArgumentError("--find-max-concurrency needs an objective: --slo-ttft-ms and/or --slo-tpot-ms")
    pcts = _csv_list(args.metric_percentiles, "--metric-percentiles", float)
    points: list[SweepPoint] = []

    async def measure(concurrency: int) -> BenchMetrics:
        if interrupt.event.is_set():
            raise KeyboardInterrupt
        load = config.load.model_copy(update={"max_concurrency": concurrency})
        result = await _measure(config.model_copy(update={"load": load}), interrupt, f"concurrency={concurrency}")
        metrics = _metrics(result, pcts)
        print(_point_line("concurrency", concurrency, metrics), flush=True)
        points.append(SweepPoint.from_run(concurrency, result, metrics))
        return metrics

    search = await find_max_concurrency(measure, config.slo, limit=args.max_search_concurrency)
    if args.plot and points:
        plot_sweep(sorted(points, key=lambda p: p.value), "max-concurrency", config.slo, Path(args.plot))
        print(f"plot: {args.plot}")
    if search.max_concurrency is None:
        print("max concurrency meeting the SLO: none (even concurrency 1 misses it)")
        return 0
    print(f"max concurrency meeting the SLO: {search.max_concurrency}")
    if args.target_users:
        n = instances_needed(args.target_users, search.max_concurrency)
        print(f"instances for {args.target_users} users: {n} (ceil({args.target_users} / {search.max_concurrency}))")
    return 0


async def _single(args: argparse.Namespace, config: BenchConfig, interrupt: _Interrupt) -> int:
    pcts = _csv_list(args.metric_percentiles, "--metric-percentiles", float)
    result = await _measure(config, interrupt, "bench")
    metrics = _metrics(result, pcts)
    if metrics.sent and metrics.completed == 0:
        print(f"every request failed ({metrics.sent}); the first errors:", file=sys.stderr)
        print("\n".join(_first_errors(result)), file=sys.stderr)
        return 1
    print(_report(args, result, metrics))
    if metrics.failed:
        print(f"failed requests: {metrics.failed} ({metrics.rate_limited} of them HTTP 429)", file=sys.stderr)
        print("\n".join(_first_errors(result)), file=sys.stderr)
    if result.interrupted:
        print("interrupted: the figures cover the requests that ended before the stop", file=sys.stderr)
    line = _slo_line(metrics)
    if line:
        print(line)
    if args.save_result:
        print(f"result: {_save_result(args, result, metrics)}")
    return 0


async def _main(args: argparse.Namespace) -> int:
    config = build_config(args)
    interrupt = _Interrupt()
    with interrupt.installed():
        if args.find_max_concurrency:
            return await _capacity(args, config, interrupt)
        if args.sweep:
            return await _sweep(args, config, interrupt)
        return await _single(args, config, interrupt)


def run(args: argparse.Namespace) -> int:
    if args.target_users and not args.find_max_concurrency:
        print("npuserve bench: --target-users needs --find-max-concurrency", file=sys.stderr)
        return 2
    if args.find_max_concurrency and args.sweep:
        print("npuserve bench: --sweep and --find-max-concurrency are two runs; give one", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_main(args))
    except (ServerUnreachable, cli_args.ArgumentError, DatasetError, TokenizerError, ValueError) as e:
        print(f"npuserve bench: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("npuserve bench: interrupted", file=sys.stderr)
        return 130

