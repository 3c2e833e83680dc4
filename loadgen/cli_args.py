"""The dataset, load-shape and SLO flags, declared once for `npuserve bench`, `npuserve simulate` and `npuserve tune`.

Names follow vLLM's `bench serve` where they overlap (`--dataset-name`, `--num-prompts`, `--request-rate`,
`--burstiness`, `--max-concurrency`, `--random-input-len`, ...); `--concurrency` is MindIE's closed-loop user count
(the same setting as `--max-concurrency`); `--think-time` is the seeds' perf scheme.
"""

from __future__ import annotations

import argparse
import math

from pydantic import ValidationError

from npuserve.bench_contract import (
    FLAG_DATASET_NAME,
    FLAG_DURATION,
    FLAG_MAX_CONCURRENCY,
    FLAG_NUM_PROMPTS,
    FLAG_RANDOM_INPUT_LEN,
    FLAG_RANDOM_OUTPUT_LEN,
)
from npuserve.loadgen.config import SLO, DatasetConfig, DatasetName, LoadConfig


class ArgumentError(ValueError):
    """A flag's value cannot make a config; the message names the flag."""


def _float_or_inf(text: str) -> float:
    value = float(text)
    if math.isnan(value):
        raise argparse.ArgumentTypeError("not a number")
    return value


def parse_think_time(text: str) -> tuple[float, float]:
    """`1:3` -> (1.0, 3.0); `2` -> (2.0, 2.0)."""
    low, sep, high = text.partition(":")
    try:
        bounds = (float(low), float(high if sep else low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: want SECONDS or LOW:HIGH, e.g. 1:3") from None
    return bounds


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("dataset")
    g.add_argument(FLAG_DATASET_NAME, choices=[d.value for d in DatasetName], default=DatasetName.RANDOM.value)
    g.add_argument("--dataset-path", help="the dataset file (gsm8k JSONL, ShareGPT JSON, or JSONL of prompts)")
    g.add_argument(FLAG_RANDOM_INPUT_LEN, type=int, default=1024, help="prompt tokens of the random dataset")
    g.add_argument(FLAG_RANDOM_OUTPUT_LEN, type=int, default=128, help="output tokens of the random dataset")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="random lengths drawn uniformly from [L*(1-r), L*(1+r)]")
    g.add_argument("--max-output-len", type=int,
                   help="cap on every request's output tokens; the output length of gsm8k and jsonl prompts "
                        "without one (default 256)")


def add_load_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("load shape")
    g.add_argument(FLAG_NUM_PROMPTS, type=int, default=1000, help="requests to send (default 1000)")
    g.add_argument(FLAG_DURATION, type=float, metavar="SECONDS",
                   help="send for this long, cycling the dataset, instead of stopping after --num-prompts")
    g.add_argument("--request-rate", type=_float_or_inf, default=math.inf,
                   help="requests per second (gamma arrivals, see --burstiness); inf: all at once (default)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the inter-arrival times: 1 = Poisson, < 1 burstier, > 1 steadier")
    g.add_argument(FLAG_MAX_CONCURRENCY, "--concurrency", dest="max_concurrency", type=int,
                   help="at most this many requests in flight: a closed loop of N users (MindIE's Concurrency)")
    g.add_argument("--think-time", type=parse_think_time, metavar="LOW:HIGH",
                   help="each user waits uniformly LOW..HIGH seconds between its requests (the perf scheme: 1:3)")
    g.add_argument("--warmup-requests", type=int, default=0, help="requests sent first and left out of the figures")
    g.add_argument("--seed", type=int, default=0)


def add_slo_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("service-level objectives")
    g.add_argument("--slo-ttft-ms", type=float, help="time-to-first-token objective (ms)")
    g.add_argument("--slo-tpot-ms", type=float, help="time-per-output-token objective (ms)")
    g.add_argument("--slo-statistic", choices=["mean", "p90", "p99"], default="mean",
                   help="the statistic of the run held against each objective (default mean)")


# Where a pydantic field name appears in an error, the flag a user typed.
_FLAGS = {
    "name": "--dataset-name", "path": "--dataset-path", "random_input_len": "--random-input-len",
    "random_output_len": "--random-output-len", "random_range_ratio": "--random-range-ratio",
    "max_output_len": "--max-output-len", "num_prompts": "--num-prompts", "duration_s": "--duration",
    "request_rate": "--request-rate", "burstiness": "--burstiness", "max_concurrency": "--max-concurrency",
    "think_time_s": "--think-time", "warmup_requests": "--warmup-requests", "seed": "--seed",
    "ttft_ms": "--slo-ttft-ms", "tpot_ms": "--slo-tpot-ms", "statistic": "--slo-statistic",
}


def explain(error: ValidationError) -> ArgumentError:
    """A validation error in the flags' words."""
    lines = []
    for e in error.errors():
        field = str(e["loc"][0]) if e["loc"] else ""
        flag = _FLAGS.get(field, field)
        message = e["msg"].removeprefix("Value error, ")
        lines.append(f"{flag}: {message}" if flag else message)
    return ArgumentError("; ".join(lines))


def dataset_config(args: argparse.Namespace) -> DatasetConfig:
    try:
        return DatasetConfig(
            name=DatasetName(args.dataset_name), path=args.dataset_path, random_input_len=args.random_input_len,
            random_output_len=args.random_output_len, random_range_ratio=args.random_range_ratio,
            max_output_len=args.max_output_len,
        )
    except ValidationError as e:
        raise explain(e) from None


def load_config(args: argparse.Namespace) -> LoadConfig:
    try:
        return LoadConfig(
            num_prompts=args.num_prompts, duration_s=args.duration, request_rate=args.request_rate,
            burstiness=args.burstiness, max_concurrency=args.max_concurrency, think_time_s=args.think_time,
            warmup_requests=args.warmup_requests, seed=args.seed,
        )
    except ValidationError as e:
        raise explain(e) from None


def slo_config(args: argparse.Namespace) -> SLO:
    try:
        return SLO(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms, statistic=args.slo_statistic)
    except ValidationError as e:
        raise explain(e) from None


def parse_sweep(text: str, names: tuple[str, ...], whole: tuple[str, ...] = ()) -> tuple[str, list[float]]:
    """`--sweep NAME=V1,V2,...`: the swept setting (one of `names`) and its positive values; settings in `whole`
    (concurrencies, batch sizes) take whole numbers only."""
    name, sep, values = text.partition("=")
    if not sep or name not in names:
        raise ArgumentError(f"--sweep: {text!r}: want one of {', '.join(names)}, e.g. {names[0]}=1,2,4")
    try:
        parsed = [float(v) for v in values.split(",") if v.strip()]
    except ValueError:
        raise ArgumentError(f"--sweep: {text!r} is not a comma-separated list") from None
    if not parsed or any(not v > 0 for v in parsed):
        raise ArgumentError(f"--sweep: {text!r}: want positive values")
    if name in whole and any(v != int(v) for v in parsed):
        raise ArgumentError(f"--sweep: {text!r}: {name} takes whole numbers")
    return name, parsed
