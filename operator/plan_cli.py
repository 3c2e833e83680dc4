"""`npuserve plan`: the plan the operator would compute, as the guide's step-by-step table or as JSON.

`--format json` prints exactly the object the operator writes to `status.plan`. The spec comes from flags, from an
InferenceService file (`--from-file`), or from both: flags given beside a file override its values.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from npuserve.catalog.accelerators import ACCELERATORS
from npuserve.catalog.models import MODEL_PRESETS
from npuserve.planning.api import NOT_QUANTIZED, InferenceService, InferenceServiceSpec, Plan
from npuserve.planning.planner import PlanError, plan
from npuserve.quantization import QUANT_FORMATS, QUANT_METHODS, QuantizationRequest, parse_quantization

DEFAULT_ACCELERATOR = "ascend-910b4"  # the guide's worked example: 32 GB cards

STEP_TITLES = {
    0: "inputs",
    1: "cards and KV memory per card",
    2: "KV blocks",
    3: "blocks per request",
    4: "maxBatchSize range",
    5: "prefill limits and lengths",
    6: "scheduling policy and swap",
    7: "capacity",
}


# The flag that sets each spec field: errors and warnings name the flag the user typed, not the spec path.
FLAG_OF = {
    "spec.model.preset": "--preset", "spec.model.name": "--name", "spec.accelerator.type": "--accelerator",
    "spec.accelerator.cards": "--cards", "spec.accelerator.cardsPerNode": "--cards-per-node",
    "spec.accelerator.memoryGiB": "--card-memory-gib",
    "spec.accelerator.reservedGiB": "--reserved-gib", "spec.accelerator.memoryFraction": "--memory-fraction",
    "spec.workload.avgInputTokens": "--avg-input-tokens", "spec.workload.avgOutputTokens": "--avg-output-tokens",
    "spec.workload.maxOutputTokens": "--max-output-tokens", "spec.workload.maxInputTokens": "--max-input-tokens",
    "spec.slo.objective": "--objective", "spec.slo.ttftMs": "--ttft-ms", "spec.slo.tpotMs": "--tpot-ms",
    "spec.capacity.targetConcurrentUsers": "--target-concurrent-users", "spec.replicas": "--replicas",
    "spec.engine.schedule.cacheBlockSize": "--block-size", "spec.model.quantization": "--quantization",
}
_SPEC_PATH = re.compile(r"\bspec(?:\.[A-Za-z]+)+")
REQUIRED = "required without --from-file"


def in_user_terms(message: str, args: argparse.Namespace) -> str:
    """`message` with each spec path the user set by a flag named by that flag (every field, without --from-file:
    the flags and their defaults make the whole spec)."""

    def name(match: re.Match[str]) -> str:
        path = match.group(0)
        flag = FLAG_OF.get(path)
        if flag is None or (args.from_file and getattr(args, flag[2:].replace("-", "_"), None) is None):
            return path
        return flag

    return _SPEC_PATH.sub(name, message)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--from-file", metavar="ISVC_YAML", help="an InferenceService manifest (or just its spec); "
                        "flags given beside it override its values")
    parser.add_argument("--preset", choices=sorted(MODEL_PRESETS), help=f"model architecture from the catalog "
                        f"({REQUIRED})")
    parser.add_argument("--name", help="served model name (default: the preset)")
    parser.add_argument("--quantization", type=quantization_flag, metavar="FORMAT:METHOD",
                        help="serve the model's W8A8 checkpoint: FORMAT one of " + ", ".join(QUANT_FORMATS)
                        + "; METHOD one of " + ", ".join(QUANT_METHODS) + " (e.g. msmodelslim:w8a8_dynamic); "
                        "omitted: 16-bit weights")
    parser.add_argument("--accelerator", type=accelerator_list, action="extend", metavar="CARD",
                        help=f"card type, one of {', '.join(sorted(ACCELERATORS))} (default without --from-file: "
                        f"{DEFAULT_ACCELERATOR}, the guide's card); with --target-users/--target-rate: the cards to "
                        "try, given several times or as a comma list, or `all` for every card of the catalog "
                        "(default: the spec's card, a run of ~15 s per card)")
    parser.add_argument("--cards", type=int, help="cards per replica; omitted: the smallest count that fits")
    parser.add_argument("--cards-per-node", type=int, help="cards a node gives a pod; more cards per replica span "
                        "nodes (default: the catalog's; cpu has none)")
    parser.add_argument("--card-memory-gib", type=float, help="memory per card (default: the catalog's)")
    parser.add_argument("--reserved-gib", type=float, help="memory a card holds at idle (default: the catalog's)")
    parser.add_argument("--memory-fraction", type=float, help="NPU_MEMORY_FRACTION (default 0.8)")
    parser.add_argument("--avg-input-tokens", type=int, help=f"mean prompt length ({REQUIRED})")
    parser.add_argument("--avg-output-tokens", type=int, help=f"mean output length ({REQUIRED})")
    parser.add_argument("--max-output-tokens", type=int, help="default 512")
    parser.add_argument("--max-input-tokens", type=int, help="default 2048")
    parser.add_argument("--objective", choices=["throughput", "decodeLatency", "firstTokenAndDecode"])
    parser.add_argument("--ttft-ms", type=float, help="TTFT bound (firstTokenAndDecode)")
    parser.add_argument("--tpot-ms", type=float, help="TPOT bound (decodeLatency, firstTokenAndDecode)")
    parser.add_argument("--target-concurrent-users", type=int, help="plan replicas to hold this many users")
    parser.add_argument("--replicas", type=int, help="a fixed replica count")
    parser.add_argument("--block-size", type=int, help="cacheBlockSize (default 128)")
    parser.add_argument("--format", choices=["table", "json"], default="table")
    c = parser.add_argument_group("capacity in cards (the simulator finds what one instance holds under the SLO)")
    target = c.add_mutually_exclusive_group()
    target.add_argument("--target-users", type=int, metavar="N",
                        help="the fewest cards that hold N concurrent users (closed loop) under --ttft-ms/--tpot-ms")
    target.add_argument("--target-rate", type=float, metavar="R",
                        help="the fewest cards that hold R requests/s (Poisson) under --ttft-ms/--tpot-ms")
    c.add_argument("--statistic", choices=["mean", "p90", "p99"], default="mean",
                   help="the statistic held against the bounds (default mean), as the tuner's judge")
    c.add_argument("--engine-profile", default="mindie",
                   help="whose host terms price a simulated step (npuserve simulate --engine-profile; default mindie)")


def accelerator_list(value: str) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [n for n in names if n not in ACCELERATORS and n != "all"]
    if unknown:
        known = ", ".join(sorted(ACCELERATORS))
        raise argparse.ArgumentTypeError(f"unknown card(s) {', '.join(unknown)}; known: {known}, all")
    return names


def quantization_flag(value: str) -> QuantizationRequest:
    try:
        return parse_quantization(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _set(data: dict[str, Any], path: str, value: Any) -> None:
    if value is None:
        return
    *parents, last = path.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


def build_spec(args: argparse.Namespace) -> InferenceServiceSpec:
    data: dict[str, Any] = {}
    if args.from_file:
        loaded = yaml.safe_load(Path(args.from_file).read_text())
        if not isinstance(loaded, dict):
            raise ValueError(f"{args.from_file}: not a YAML mapping")
        if loaded.get("kind") == "InferenceService":
            InferenceService.model_validate(loaded)  # the whole object must be valid, metadata included
            loaded = loaded["spec"]
        data = loaded
    else:
        missing = [flag for flag, value in (("--preset", args.preset), ("--avg-input-tokens", args.avg_input_tokens),
                                            ("--avg-output-tokens", args.avg_output_tokens)) if value is None]
        if missing:
            raise ValueError(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} required (or --from-file)")
        data = {"model": {"weights": {"loadFormat": "dummy"}}, "accelerator": {"type": DEFAULT_ACCELERATOR}}
    if args.preset:
        data.setdefault("model", {}).pop("architecture", None)
        _set(data, "model.preset", args.preset)
        if not args.from_file or args.name:
            _set(data, "model.name", args.name or args.preset)
    if args.quantization is not None:
        _set(data, "model.quantization", args.quantization.model_dump())
    if args.accelerator and args.accelerator[0] != "all":
        _set(data, "accelerator.type", args.accelerator[0])
    _set(data, "accelerator.cards", args.cards)
    _set(data, "accelerator.cardsPerNode", args.cards_per_node)
    _set(data, "accelerator.memoryGiB", args.card_memory_gib)
    _set(data, "accelerator.reservedGiB", args.reserved_gib)
    _set(data, "accelerator.memoryFraction", args.memory_fraction)
    _set(data, "workload.avgInputTokens", args.avg_input_tokens)
    _set(data, "workload.avgOutputTokens", args.avg_output_tokens)
    _set(data, "workload.maxOutputTokens", args.max_output_tokens)
    _set(data, "workload.maxInputTokens", args.max_input_tokens)
    _set(data, "slo.objective", args.objective)
    _set(data, "slo.ttftMs", args.ttft_ms)
    _set(data, "slo.tpotMs", args.tpot_ms)
    _set(data, "engine.schedule.cacheBlockSize", args.block_size)
    if args.target_concurrent_users is not None:
        data.pop("replicas", None)
        _set(data, "capacity.targetConcurrentUsers", args.target_concurrent_users)
    if args.replicas is not None:
        data.pop("capacity", None)
        data["replicas"] = args.replicas
    return InferenceServiceSpec.model_validate(data)


def format_validation_error(error: ValidationError, prefix: str = "spec") -> str:
    lines = []
    for item in error.errors():
        path = ".".join([prefix, *(str(p) for p in item["loc"])])
        message = item["msg"].removeprefix("Value error, ")
        lines.append(message if message.startswith("spec.") else f"{path}: {message}")
    return "\n".join(lines)


def _number(value: float | int | bool) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return f"{value:g}" if isinstance(value, float) else str(value)


def replica_layout(result: Plan) -> str:
    """Where one replica's cards are: one pod, or a LeaderWorkerSet of pods on several nodes."""
    if result.nodes > 1:
        return (f"Replica: {result.worldSize} cards span {result.nodes} nodes of {result.cardsPerPod} cards "
                f"(a LeaderWorkerSet of {result.nodes} pods x {result.cardsPerPod} cards, tensor parallel "
                f"{result.worldSize})")
    return f"Replica: {result.worldSize} card(s) in one pod on one node"


def print_table(result: Plan, warnings: list[str] | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 180)
    title = (
        f"npuserve plan: {result.model} on {result.worldSize} x {result.accelerator}"
        f" ({result.nodes} node{'s' if result.nodes > 1 else ''} per replica), objective {result.objective}"
    )
    table = Table(title=title, show_lines=False, expand=False)
    table.add_column("step", style="dim")
    table.add_column("quantity", style="bold")
    table.add_column("value", justify="right", style="cyan")
    table.add_column("formula")
    table.add_column("inputs", style="dim")
    last_step = -1
    for entry in result.explain:
        step = ""
        if entry.step != last_step:
            step = f"{entry.step} {STEP_TITLES.get(entry.step, '')}".strip()
            if last_step != -1:
                table.add_section()
            last_step = entry.step
        value = _number(entry.value) + (f" {entry.unit}" if entry.unit else "")
        formula = entry.formula + (f"\n[dim italic]{entry.note}[/]" if entry.note else "")
        inputs = ", ".join(f"{k}={_number(v)}" for k, v in entry.inputs.items())
        table.add_row(step, entry.name, value, formula, inputs)
    console.print(table)
    s = result.schedule
    console.print(
        f"ScheduleConfig: maxBatchSize {s.maxBatchSize}, maxPrefillBatchSize {s.maxPrefillBatchSize}, "
        f"maxPrefillTokens {s.maxPrefillTokens}, supportSelectBatch {str(s.supportSelectBatch).lower()}, "
        f"maxPreemptCount {s.maxPreemptCount}; npuMemSize {result.npuMemSizeGiB} GiB, cpuMemSize "
        f"{result.cpuMemSizeGiB} GiB; {result.replicas} replica(s)",
        highlight=False,
    )
    console.print(replica_layout(result), highlight=False)
    console.print(f"Weights: {result.weightsGiB:g} GiB, "
                  + (f"quantized {result.quantization}" if result.quantization != NOT_QUANTIZED else "not quantized")
                  + "; the KV cache stays in the model's dtype", highlight=False)
    for warning in result.warnings if warnings is None else warnings:
        console.print(f"[yellow]warning:[/] {warning}", highlight=False)


def run(args: argparse.Namespace) -> int:
    if args.target_users is not None or args.target_rate is not None:
        from npuserve.sim.capacity_cli import run_capacity  # the simulator: only for capacity in cards

        return run_capacity(args, build_spec)
    if args.accelerator and len(args.accelerator) > 1:
        print("npuserve plan: several --accelerator cards need --target-users or --target-rate", file=sys.stderr)
        return 2
    try:
        spec = build_spec(args)
        result = plan(spec)
    except ValidationError as e:
        print(f"npuserve plan: invalid spec:\n{in_user_terms(format_validation_error(e), args)}", file=sys.stderr)
        return 2
    except (PlanError, ValueError, OSError, yaml.YAMLError) as e:
        print(f"npuserve plan: {in_user_terms(str(e), args)}", file=sys.stderr)
        return 2
    if args.format == "json":
        sys.stdout.write(json.dumps(result.model_dump(mode="json"), indent=2) + "\n")
    else:
        print_table(result, [in_user_terms(w, args) for w in result.warnings])
    return 0
