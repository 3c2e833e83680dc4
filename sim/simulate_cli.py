"""`npuserve simulate`: a load-generator run against the simulated engine, reported as `npuserve bench` reports.

The engine's settings come from the plan the operator would compute (`npuserve plan`'s flags: `--preset` or
`--model-config`, `--accelerator`, `--cards`, `--card-memory-gib`, `--reserved-gib`), with the workload's mean lengths
taken from the drawn requests and the objective from the SLO flags (TTFT and TPOT bounds: firstTokenAndDecode; TPOT
only: decodeLatency; otherwise throughput); KV blocks are the plan's totalBlocks. `--config` replaces the plan's engine
config with a MindIE config.json (its npuMemSize sizes the KV cache unless it is -1), and `--schedule k=v` overrides
ScheduleConfig fields by MindIE's names. The dataset, load and SLO flags are `npuserve bench`'s.

This is the one module of the simulator that reads the operator's planner: a command line composes the two parts;
the simulator itself (`engine.py`, `runner.py`) takes a MindIE config and imports nothing of the operator.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from npuserve.catalog.accelerators import ACCELERATORS
from npuserve.catalog.models import MODEL_PRESETS, get_model_preset
from npuserve.engine_contract import FLAG_CONFIG, SCHEDULE_FIELD_BY_NAME, SCHEDULE_FIELDS
from npuserve.loadgen import cli_args
from npuserve.loadgen.config import BenchConfig
from npuserve.loadgen.datasets import DatasetError
from npuserve.loadgen.metrics import BenchMetrics, compute_metrics
from npuserve.loadgen.report_json import json_safe, report_json
from npuserve.loadgen.report_mindie import render_mindie
from npuserve.loadgen.report_vllm import render_vllm
from npuserve.loadgen.sweep import SweepParameter, SweepPoint, sweep_csv
from npuserve.mindie_config import EngineEnvironment, MindIEConfig, MindIEConfigError
from npuserve.modelspec import ModelSpec, UnsupportedModelError
from npuserve.planning.api import InferenceServiceSpec, Plan
from npuserve.planning.planner import PlanError, architecture_of, plan
from npuserve.quantization import MSMODELSLIM_DESCRIPTION, parse_quantization

from .cost_model import DEFAULT_ENGINE, ENGINE_PROFILES
from .engine import SimulationConfig, SimulationResult, draw_requests, simulate, sweep
from .lengths import OutputLengths
from .runner import SimRequest

DEFAULT_ACCELERATOR = "ascend-910b4"  # as `npuserve plan`: the guide's card
FORMATS = ("vllm", "mindie", "json")
SWEEPABLE = ("maxBatchSize", "max-concurrency", "request-rate")


class SimulateError(ValueError):
    """A flag or file that cannot make a simulation; the message names it."""


def add_simulation_args(parser: argparse.ArgumentParser) -> None:
    """The model, cards, engine config, dataset, load and output-length flags (`npuserve tune --simulate` too)."""
    m = parser.add_argument_group("model and cards (as npuserve plan)")
    source = m.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", choices=sorted(MODEL_PRESETS), help="model architecture from the catalog")
    source.add_argument("--model-config", metavar="CONFIG_JSON", help="a Hugging Face config.json")
    m.add_argument("--name", help="served model name (default: the preset, or the config's folder)")
    m.add_argument("--quantization", metavar="FORMAT:METHOD",
                   help="W8A8 weights (e.g. msmodelslim:w8a8_dynamic, compressed-tensors:w8a8), as `npuserve plan`; "
                   "with --model-config: what its folder declares (config.json's quantization_config or "
                   "quant_model_description.json beside it), which this flag must match")
    m.add_argument("--accelerator", choices=sorted(ACCELERATORS), default=DEFAULT_ACCELERATOR,
                   help=f"card type (default {DEFAULT_ACCELERATOR}, the guide's card)")
    m.add_argument("--engine-profile", choices=sorted(ENGINE_PROFILES), default=DEFAULT_ENGINE,
                   help=f"whose host terms price a step (launches, per-sequence work, all-reduce latency; "
                        f"default {DEFAULT_ENGINE}: MindIE's scheduling on the cards)")
    m.add_argument("--cards", type=int, help="cards per replica (worldSize); omitted: the plan's")
    m.add_argument("--card-memory-gib", type=float, help="memory per card (default: the catalog's)")
    m.add_argument("--reserved-gib", type=float, help="memory a card holds at idle (default: the catalog's)")
    e = parser.add_argument_group("engine")
    e.add_argument(FLAG_CONFIG, dest="config", metavar="CONFIG_JSON", help="a MindIE config.json instead of the plan's")
    e.add_argument("--schedule", nargs="+", metavar="K=V", default=[],
                   help="ScheduleConfig fields by MindIE's names, e.g. maxBatchSize=300 supportSelectBatch=false "
                        "(maxBatchSize alone also sets maxPrefillBatchSize to half of it, the plan's rule)")
    cli_args.add_dataset_args(parser)
    cli_args.add_load_args(parser)
    o = parser.add_argument_group("simulated outputs")
    o.add_argument("--ignore-eos", action="store_true", help="every request generates its max_tokens")
    o.add_argument("--mean-output-len", type=float,
                   help="mean output tokens of datasets that give only a cap (gsm8k, jsonl); omitted: run to the cap")
    o.add_argument("--output-len-cv", type=float, default=0.5, help="spread of those lengths (sd / mean)")


def configure(parser: argparse.ArgumentParser) -> None:
    add_simulation_args(parser)
    cli_args.add_slo_args(parser)
    r = parser.add_argument_group("reports")
    r.add_argument("--format", choices=FORMATS,
                   help="vllm (default): bench serve's summary; mindie: MindIE Benchmark's tables; json: everything "
                        "(one run; a sweep prints its CSV)")
    r.add_argument("--sweep", metavar="PARAM=V1,V2,...",
                   help="one run per value, printed as the sweep CSV: maxBatchSize=100,200,300 (maxPrefillBatchSize "
                        "follows at half), max-concurrency=1,8,64 or request-rate=1,2,4")


# --- configuration -------------------------------------------------------------------------------------------------


def parse_schedule(pairs: list[str]) -> dict[str, Any]:
    """`k=v` pairs as ScheduleConfig values, typed from the contract's field table; unknown names are refused."""
    values: dict[str, Any] = {}
    unknown = []
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep:
            raise SimulateError(f"--schedule: {pair!r}: want NAME=VALUE, e.g. maxBatchSize=200")
        field = SCHEDULE_FIELD_BY_NAME.get(name)
        if field is None:
            unknown.append(name)
            continue
        if field.type is bool:
            if text.lower() not in ("true", "false", "1", "0"):
                raise SimulateError(f"--schedule: {name}={text!r}: want true or false")
            values[name] = text.lower() in ("true", "1")
        else:
            try:
                values[name] = int(text)
            except ValueError:
                raise SimulateError(f"--schedule: {name}={text!r}: want an integer") from None
    if unknown:
        known = ", ".join(f.name for f in SCHEDULE_FIELDS)
        raise SimulateError(f"--schedule: unknown ScheduleConfig field(s) {', '.join(unknown)}; known: {known}")
    return values


def _model(args: argparse.Namespace) -> tuple[ModelSpec, str]:
    """The model, with its quantization scheme: --quantization's (standard coverage) on a preset; a config.json's
    folder's own declaration (every module as declared), which --quantization, when given, must match."""
    try:
        request = parse_quantization(args.quantization) if args.quantization else None
    except ValueError as e:
        raise SimulateError(str(e)) from None
    if args.preset:
        spec = get_model_preset(args.preset)
        if request is not None:
            spec = spec.model_copy(update={"quantization": request.scheme()})
        return spec, args.name or args.preset
    path = Path(args.model_config)
    try:
        config = json.loads(path.read_text())
        description = path.parent / MSMODELSLIM_DESCRIPTION
        spec = ModelSpec.from_hf_config(config, json.loads(description.read_text()) if description.exists() else None)
    except (OSError, json.JSONDecodeError, KeyError, UnsupportedModelError) as e:
        raise SimulateError(f"--model-config {path}: {e}") from None
    declared = spec.quantization
    if request is not None and declared is None:
        spec = spec.model_copy(update={"quantization": request.scheme()})
    elif request is not None and declared is not None and not request.matches(declared):
        raise SimulateError(f"--quantization {args.quantization}: {path.parent} declares {declared.name}")
    return spec, args.name or path.parent.name or "model"


def _spec(args: argparse.Namespace, spec: ModelSpec, name: str, requests: list[SimRequest], cards: int | None,
          bench: BenchConfig) -> InferenceServiceSpec:
    model: dict[str, Any] = {"name": name, "weights": {"loadFormat": "dummy"}}
    if args.preset:
        model["preset"] = args.preset
    else:
        model["architecture"] = architecture_of(spec).model_dump(exclude_none=True)
    if spec.quantization is not None:  # the plan sizes the weights by the scheme's standard coverage
        model["quantization"] = {"format": spec.quantization.format, "method": spec.quantization.method}
    accelerator: dict[str, Any] = {"type": args.accelerator}
    for key, value in (("cards", cards), ("memoryGiB", args.card_memory_gib), ("reservedGiB", args.reserved_gib)):
        if value is not None:
            accelerator[key] = value
    longest_prompt = max(r.prompt_tokens for r in requests)
    max_output = max(r.max_tokens for r in requests)
    workload = {
        "avgInputTokens": max(1, round(statistics.fmean(r.prompt_tokens for r in requests))),
        "avgOutputTokens": max(1, round(statistics.fmean(r.output_tokens for r in requests))),
        "maxOutputTokens": max_output,
        "maxInputTokens": max(2048, longest_prompt),
    }
    slo: dict[str, Any] = {}
    ttft, tpot = bench.slo.ttft_ms, bench.slo.tpot_ms
    if ttft is not None and tpot is not None:
        slo = {"objective": "firstTokenAndDecode", "ttftMs": ttft, "tpotMs": tpot}
    elif tpot is not None:
        slo = {"objective": "decodeLatency", "tpotMs": tpot}
    elif ttft is not None:  # the plan's objectives bound TTFT only together with TPOT
        slo = {"objective": "throughput", "ttftMs": ttft}
    return InferenceServiceSpec.model_validate({"model": model, "accelerator": accelerator, "workload": workload,
                                                "slo": slo})


def build(args: argparse.Namespace) -> tuple[SimulationConfig, list[SimRequest], list[str]]:
    """The simulation the flags ask for, its requests (drawn once) and notes for the report."""
    config, requests, notes, _ = build_with_plan(args)
    return config, requests, notes


def build_with_plan(args: argparse.Namespace) -> tuple[SimulationConfig, list[SimRequest], list[str], Plan]:
    """`build`, and the plan it started from (`npuserve tune --simulate` takes the tuner's range from it)."""
    spec, name = _model(args)
    bench = BenchConfig(dataset=cli_args.dataset_config(args), load=cli_args.load_config(args),
                        slo=cli_args.slo_config(args), ignore_eos=args.ignore_eos)
    lengths = OutputLengths(mean=args.mean_output_len, cv=args.output_len_cv)
    changes = parse_schedule(args.schedule)
    notes: list[str] = []
    file_config = MindIEConfig.load(args.config) if args.config else None
    cards = args.cards
    if file_config is not None:
        world = file_config.model.worldSize
        if cards is not None and cards != world:
            raise SimulateError(f"--cards {cards} disagrees with worldSize {world} of {args.config}")
        cards = world
    requests = draw_requests(bench, bench.load.warmup_requests + bench.load.num_prompts, lengths)
    try:
        planned = plan(_spec(args, spec, name, requests, cards, bench))
    except ValidationError as e:
        raise SimulateError(f"the plan's spec is invalid: {e}") from None
    except PlanError as e:
        raise SimulateError(f"plan: {e}") from None
    if file_config is not None:
        engine = file_config
        blocks = planned.totalBlocks if engine.model.npuMemSize < 0 else None
        source = f"{args.config}"
    else:
        engine = MindIEConfig.from_dict({"BackendConfig": {
            "ModelDeployConfig": {"maxSeqLen": planned.maxSeqLen, "maxInputTokenLen": planned.maxInputTokenLen,
                                  "ModelConfig": [{"modelName": name, "modelWeightPath": name,
                                                   "worldSize": planned.worldSize, "npuMemSize": planned.npuMemSizeGiB,
                                                   "cpuMemSize": planned.cpuMemSizeGiB}]},
            "ScheduleConfig": planned.schedule.model_dump(),
        }})
        blocks = planned.totalBlocks
        source = "the plan"
        if "maxBatchSize" in changes and "maxPrefillBatchSize" not in changes:
            changes["maxPrefillBatchSize"] = max(1, changes["maxBatchSize"] // 2)
    if changes:
        engine = engine.with_schedule(**changes)
    config = SimulationConfig(engine=engine, model=spec, accelerator=args.accelerator, bench=bench,
                              cost=ENGINE_PROFILES[args.engine_profile].params,
                              output_lengths=lengths, num_kv_blocks=blocks,
                              recompute_threshold=EngineEnvironment.from_environ().recompute_threshold)
    s = engine.schedule
    notes.append(
        f"simulated: {name} on {config.world_size} x {args.accelerator}, engine config from {source}"
        f"{' with --schedule' if changes else ''}: maxBatchSize {s.maxBatchSize}, maxPrefillBatchSize "
        f"{s.maxPrefillBatchSize}, maxPrefillTokens {s.maxPrefillTokens}, supportSelectBatch "
        f"{str(s.supportSelectBatch).lower()}; {config.kv_blocks} KV blocks, {config.host_blocks} host blocks; "
        f"weights {spec.quantization.name if spec.quantization is not None else spec.dtype}")
    return config, requests, notes, planned


# --- reports -------------------------------------------------------------------------------------------------------


def cost_lines(result: SimulationResult) -> list[str]:
    totals = result.cost_totals()
    total = totals.pop("total_s") or 1.0
    hw = result.hardware
    parts = ", ".join(f"{k.removesuffix('_s')} {v:.1f} s ({v / total:.0%})" for k, v in totals.items())
    eff = hw.efficiency
    return [f"hardware: {hw.name} {hw.bandwidth_gbps:g} GB/s x {eff.bandwidth:g}, {hw.tflops:g} TFLOPS x "
            f"{eff.compute:g}, {hw.link} {hw.interconnect_gbps:g} GB/s x {eff.link:g} ({hw.source} figures; "
            f"achieved fractions {eff.source}); {len(result.steps)} steps, {result.num_preemptions} preemptions",
            f"step time by term (memory and compute overlap, so they sum past the total): {parts}"]


def render(args: argparse.Namespace, result: SimulationResult, metrics: BenchMetrics, notes: list[str]) -> str:
    if args.format == "json":
        document = report_json(result.bench, metrics)
        document["simulation"] = {"notes": notes, "cost_totals_s": result.cost_totals(),
                                  "kv_blocks": result.kv_blocks, "host_blocks": result.host_blocks,
                                  "hardware": {"name": result.hardware.name, "source": result.hardware.source,
                                               "bandwidth_gbps": result.hardware.bandwidth_gbps,
                                               "tflops": result.hardware.tflops, "link": result.hardware.link,
                                               "interconnect_gbps": result.hardware.interconnect_gbps,
                                               "efficiency": result.hardware.efficiency.model_dump()},
                                  "num_preemptions": result.num_preemptions}
        return json.dumps(json_safe(document), indent=2, default=str)
    body = render_mindie(result.bench, metrics) if args.format == "mindie" else render_vllm(result.bench, metrics)
    return "\n".join([*notes, *cost_lines(result), body])


def _with_load(config: SimulationConfig, name: str, value: float) -> SimulationConfig:
    update: dict[str, Any] = ({"max_concurrency": int(value)} if name == "max-concurrency"
                              else {"request_rate": value})
    bench = config.bench.model_copy(update={"load": config.bench.load.model_copy(update=update)})
    return config.model_copy(update={"bench": bench})


def _sweep(args: argparse.Namespace, config: SimulationConfig, requests: list[SimRequest]) -> str:
    name, values = cli_args.parse_sweep(str(args.sweep), SWEEPABLE, whole=("maxBatchSize", "max-concurrency"))
    config = config.model_copy(update={"keep_steps": False})
    runs: list[tuple[float, SimulationResult]]
    if name == "maxBatchSize":
        runs = list(sweep(config, [int(v) for v in values], requests=requests))
    else:
        runs = [(v, simulate(_with_load(config, name, v), requests)) for v in values]
    points = [SweepPoint.from_run(value, result.bench,
                                  compute_metrics(result.bench.measured, result.bench.duration_s, config.bench.slo))
              for value, result in runs]
    parameter: SweepParameter = "request-rate" if name == "request-rate" else "max-concurrency"
    return sweep_csv(points, parameter, tp=config.world_size, data_type=config.model.dtype).rstrip("\n")


def run(args: argparse.Namespace) -> int:
    if args.sweep and args.format is not None:
        print("npuserve simulate: --format reports one run; a sweep prints its CSV", file=sys.stderr)
        return 2
    try:
        config, requests, notes = build(args)
        if args.sweep:
            print(_sweep(args, config, requests))
            return 0
        result = simulate(config, requests)
    except (SimulateError, cli_args.ArgumentError, DatasetError, MindIEConfigError, OSError, ValueError) as e:
        print(f"npuserve simulate: {e}", file=sys.stderr)
        return 2
    metrics = compute_metrics(result.bench.measured, result.bench.duration_s, config.bench.slo)
    print(render(args, result, metrics, notes))
    return 0 if metrics.completed else 1
