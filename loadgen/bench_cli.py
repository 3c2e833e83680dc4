"""`npuserve bench`: the load generator's command line, a thin shell over `npuserve.loadgen`
(docs/loadgen.md#what-it-measures).

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from npuserve.bench_contract import FLAG_BASE_URL, FLAG_IGNORE_EOS, FLAG_MODEL, FLAG_REQUEST_TIMEOUT, FLAG_TOKENIZER
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
from npuserve.loadgen.report_vllm import (
    DEFAULT_METRIC_PERCENTILES,
    DEFAULT_PERCENTILE_METRICS,
    PERCENTILE_METRICS,
    default_result_filename,
    render_vllm,
    vllm_result_json,
)
from npuserve.loadgen.result import BenchResult
from npuserve.loadgen.run import PreparedRun, ServerUnreachable, prepare, run_benchmark
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
SWEEPABLE = ("max-concurrency", "request-rate")
DEFAULT_SEARCH_LIMIT = 4096


@dataclass(frozen=True)
class ReportOptions:
    """The report flags, parsed once."""

    format: str
    percentile_metrics: list[str]
    metric_percentiles: list[float]


def configure(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument(FLAG_BASE_URL, default=f"http://127.0.0.1:{ENGINE_PORT}", help="the server (default %(default)s)")
    g.add_argument("--endpoint", choices=[e.value for e in Endpoint], default=Endpoint.COMPLETIONS.value,
                   help="the route to drive; /generate reads the perf scheme's timing headers")
    g.add_argument(FLAG_MODEL, help="served model name (default: the first /v1/models lists)")
    g.add_argument(FLAG_TOKENIZER, help="an HF model folder to count tokens with (default: the folder the server's "
                                       "/v1/models names, when it is on this machine; else the server's counts)")
    g.add_argument(FLAG_IGNORE_EOS, action="store_true", help="generate every requested token (vLLM's extension)")
    g.add_argument(FLAG_REQUEST_TIMEOUT, type=float, default=600.0, help="seconds per request (default 600)")
    cli_args.add_dataset_args(parser)
    cli_args.add_load_args(parser)
    cli_args.add_slo_args(parser)
    r = parser.add_argument_group("reports")
    # Flags that apply to some runs only default to None, so one given where it does not apply is refused.
    r.add_argument("--format", choices=FORMATS,
                   help="vllm (default): bench serve's summary; mindie: MindIE Benchmark's tables; perf: the perf "
                        "scheme; json: everything with the raw records")
    r.add_argument("--percentile-metrics",
                   help=f"comma-separated metrics to report percentiles of ({', '.join(PERCENTILE_METRICS)}; "
                        f"default {','.join(DEFAULT_PERCENTILE_METRICS)}): the vllm report and --save-result")
    r.add_argument("--metric-percentiles", help="comma-separated percentiles, e.g. 50,90,99 (default 99): the vllm "
                                                "report and --save-result")
    r.add_argument("--save-result", action="store_true", help="write vLLM's result JSON")
    r.add_argument("--result-dir", help="where --save-result writes (default: here)")
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
    s.add_argument("--max-search-concurrency", type=int,
                   help=f"upper bound of that search (default {DEFAULT_SEARCH_LIMIT})")
    s.add_argument("--target-users", type=int, help="with --find-max-concurrency: print the instances needed")


def _csv_list(text: str, flag: str, cast: Callable[[str], Any]) -> list[Any]:
    try:
        return [cast(v.strip()) for v in text.split(",") if v.strip()]
    except ValueError:
        raise cli_args.ArgumentError(f"{flag}: {text!r} is not a comma-separated list") from None


def report_options(args: argparse.Namespace) -> ReportOptions:
    metrics = _csv_list(args.percentile_metrics, "--percentile-metrics", str) if args.percentile_metrics \
        else list(DEFAULT_PERCENTILE_METRICS)
    unknown = [m for m in metrics if m not in PERCENTILE_METRICS]
    if unknown:
        raise cli_args.ArgumentError(f"--percentile-metrics: unknown {', '.join(unknown)}; choose from "
                                     f"{', '.join(PERCENTILE_METRICS)}")
    percentiles = _csv_list(args.metric_percentiles, "--metric-percentiles", float) if args.metric_percentiles \
        else list(DEFAULT_METRIC_PERCENTILES)
    if any(not 0 < p <= 100 for p in percentiles):
        raise cli_args.ArgumentError(f"--metric-percentiles: {args.metric_percentiles!r}: want values in (0, 100]")
    return ReportOptions(args.format or "vllm", metrics, percentiles)


def misplaced_flags(args: argparse.Namespace) -> list[str]:
    """Flags given where they do nothing: each is refused by name rather than ignored."""
    several = args.sweep or args.find_max_concurrency  # many runs: points and a CSV, not one run's report
    rules = [
        (args.target_users is not None and not args.find_max_concurrency,
         "--target-users needs --find-max-concurrency"),
        (args.max_search_concurrency is not None and not args.find_max_concurrency,
         "--max-search-concurrency needs --find-max-concurrency"),
        (bool(args.sweep and args.find_max_concurrency), "--sweep and --find-max-concurrency are two runs; give one"),
        (args.sweep_csv is not None and not args.sweep, "--sweep-csv needs --sweep"),
        (args.plot is not None and not several, "--plot needs --sweep or --find-max-concurrency"),
        ((args.result_dir or args.result_filename) is not None and not args.save_result,
         "--result-dir and --result-filename need --save-result"),
        ((args.percentile_metrics or args.metric_percentiles) is not None and args.format not in (None, "vllm")
         and not args.save_result, "--percentile-metrics and --metric-percentiles apply to --format vllm and "
                                   "--save-result"),
    ]
    rules += [(bool(several) and given, f"{flag} reports one run; a sweep or a search prints its points and the CSV")
              for flag, given in (("--format", args.format is not None), ("--save-result", args.save_result),
                                  ("--save-trace", args.save_trace is not None))]
    return [message for broken, message in rules if broken]


def _parse_sweep(text: str) -> tuple[SweepParameter, list[float]]:
    name, values = cli_args.parse_sweep(text, SWEEPABLE, whole=("max-concurrency",))
    return ("max-concurrency" if name == "max-concurrency" else "request-rate"), values


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


async def _measure(config: BenchConfig, interrupt: _Interrupt, label: str,
                   prepared: PreparedRun | None = None) -> BenchResult:
    total = None if config.load.duration_s is not None else config.load.num_prompts
    with progress(total, label=label) as counter:
        return await run_benchmark(config, on_record=counter.add, stop=interrupt.event, prepared=prepared)


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


def _report(options: ReportOptions, result: BenchResult, metrics: BenchMetrics) -> str:
    if options.format == "mindie":
        return render_mindie(result, metrics)
    if options.format == "perf":
        return render_perf(result, metrics)
    if options.format == "json":
        return json.dumps(report_json(result, metrics), indent=2, default=str)
    return render_vllm(result, metrics, options.percentile_metrics, options.metric_percentiles)


def _save_result(args: argparse.Namespace, options: ReportOptions, result: BenchResult,
                 metrics: BenchMetrics) -> Path:
    directory = Path(args.result_dir or ".")
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / (args.result_filename or default_result_filename(result))
    document = vllm_result_json(result, metrics, options.percentile_metrics, options.metric_percentiles)
    path.write_text(json.dumps(document, indent=2))
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


async def _sweep(args: argparse.Namespace, config: BenchConfig, interrupt: _Interrupt, pcts: list[float]) -> int:
    name, values = _parse_sweep(args.sweep)
    prepared = await prepare(config)  # the points differ only in load: one probe, tokenizer and draw for all
    points: list[SweepPoint] = []
    for value in values:
        load = (config.load.model_copy(update={"max_concurrency": int(value)}) if name == "max-concurrency"
                else config.load.model_copy(update={"request_rate": value}))
        result = await _measure(config.model_copy(update={"load": load}), interrupt, f"{name}={value:g}", prepared)
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


async def _capacity(args: argparse.Namespace, config: BenchConfig, interrupt: _Interrupt, pcts: list[float]) -> int:
    if not config.slo.given:
        raise cli_args.ArgumentError("--find-max-concurrency needs an objective: --slo-ttft-ms and/or --slo-tpot-ms")
    prepared = await prepare(config)
    points: list[SweepPoint] = []

    async def measure(concurrency: int) -> BenchMetrics:
        if interrupt.event.is_set():
            raise KeyboardInterrupt
        load = config.load.model_copy(update={"max_concurrency": concurrency})
        result = await _measure(config.model_copy(update={"load": load}), interrupt, f"concurrency={concurrency}",
                                prepared)
        metrics = _metrics(result, pcts)
        print(_point_line("concurrency", concurrency, metrics), flush=True)
        points.append(SweepPoint.from_run(concurrency, result, metrics))
        return metrics

    search = await find_max_concurrency(measure, config.slo, limit=args.max_search_concurrency or DEFAULT_SEARCH_LIMIT)
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


async def _single(args: argparse.Namespace, config: BenchConfig, interrupt: _Interrupt,
                  options: ReportOptions) -> int:
    result = await _measure(config, interrupt, "bench")
    metrics = _metrics(result, options.metric_percentiles)
    if metrics.sent and metrics.completed == 0:
        print(f"every request failed ({metrics.sent}); the first errors:", file=sys.stderr)
        print("\n".join(_first_errors(result)), file=sys.stderr)
        return 1
    print(_report(options, result, metrics))
    if metrics.failed:
        print(f"failed requests: {metrics.failed} ({metrics.rate_limited} of them HTTP 429)", file=sys.stderr)
        print("\n".join(_first_errors(result)), file=sys.stderr)
    if result.interrupted:
        print("interrupted: the figures cover the requests that ended before the stop", file=sys.stderr)
    line = _slo_line(metrics)
    if line:
        print(line)
    if args.save_result:
        print(f"result: {_save_result(args, options, result, metrics)}")
    return 0


async def _main(args: argparse.Namespace) -> int:
    config = build_config(args)
    options = report_options(args)
    interrupt = _Interrupt()
    with interrupt.installed():
        if args.find_max_concurrency:
            return await _capacity(args, config, interrupt, options.metric_percentiles)
        if args.sweep:
            return await _sweep(args, config, interrupt, options.metric_percentiles)
        return await _single(args, config, interrupt, options)


def run(args: argparse.Namespace) -> int:
    misplaced = misplaced_flags(args)
    if misplaced:
        print(f"npuserve bench: {'; '.join(misplaced)}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_main(args))
    except (ServerUnreachable, cli_args.ArgumentError, DatasetError, TokenizerError, ValueError) as e:
        print(f"npuserve bench: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("npuserve bench: interrupted", file=sys.stderr)
        return 130

