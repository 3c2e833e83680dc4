"""`npuserve tune --simulate`: the operator's tuner (`npuserve.planning.tuner`, pure) against the simulated engine.

Each trial applies the tuner's schedule to the simulated engine, runs the load, and hands the tuner what a settled
Prometheus window would show (output tok/s, TTFT and TPOT mean/p90/p99, errors, preemptions, samples). The same
`decide` runs in the operator against real engines, so what this prints is what the operator would do.

The load of a trial is the guide's benchmark (docs/simulator.md#npuserve-tune---simulate): maxBatchSize - 1
closed-loop users, unless `--max-concurrency` or `--request-rate` fixes it. `--noise` multiplies every measured
figure by a seeded uniform factor in [1 - noise, 1 + noise], to see how the tuner copes with a noisy cluster.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import sys
from collections.abc import Callable

from npuserve.catalog.accelerators import get_accelerator
from npuserve.loadgen import cli_args
from npuserve.loadgen.datasets import DatasetError
from npuserve.loadgen.metrics import BenchMetrics, Distribution, compute_metrics
from npuserve.mindie_config import MindIEConfigError
from npuserve.planning.api import LatencyStats, SLOSpec, TrialMetrics
from npuserve.planning.engine_model import EngineShape
from npuserve.planning.problem import TunedSchedule, TuningProblem
from npuserve.planning.tuner import Trial, Verdict, decide
from npuserve.planning.tuning_status import trial_status

from . import simulate_cli
from .engine import SimulationConfig, SimulationResult, simulate
from .runner import SimRequest

OBJECTIVES = ("throughput", "decodeLatency", "firstTokenAndDecode")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--simulate", action="store_true", required=True,
                        help="tune against the simulated engine (the only mode outside a cluster)")
    simulate_cli.add_simulation_args(parser)
    t = parser.add_argument_group("tuning")
    t.add_argument("--objective", choices=OBJECTIVES, default="throughput",
                   help="throughput: the most output tok/s; decodeLatency: the most output tok/s meeting --tpot-ms; "
                        "firstTokenAndDecode: the most meeting --ttft-ms and --tpot-ms (supportSelectBatch false)")
    t.add_argument("--ttft-ms", type=float, help="TTFT bound (ms)")
    t.add_argument("--tpot-ms", type=float, help="TPOT bound (ms)")
    t.add_argument("--statistic", choices=["mean", "p90", "p99"], default="mean",
                   help="the statistic held against the bounds (default mean)")
    t.add_argument("--max-trials", type=int, default=8, help="trials at most (default 8)")
    t.add_argument("--noise", type=float, default=0.0,
                   help="inject +-this relative noise into every measured figure (default 0: the simulator's own)")
    t.add_argument("--noise-seed", type=int, help="seed of --noise's draws (default 0)")


def trial_metrics(metrics: BenchMetrics, result: SimulationResult) -> TrialMetrics:
    """What the tuner reads of one run: the figures a Prometheus window gives."""
    def stats(d: Distribution) -> LatencyStats:
        return LatencyStats(mean=d.mean, p90=d.p90, p99=d.p99)

    return TrialMetrics(outputTokensPerSecond=metrics.output_throughput, ttftMs=stats(metrics.ttft_ms),
                        tpotMs=stats(metrics.tpot_ms), errorRate=metrics.error_rate, samples=metrics.completed,
                        preemptions=result.num_preemptions)


def with_noise(m: TrialMetrics, noise: float, rng: random.Random) -> TrialMetrics:
    """Each figure times its own factor in [1 - noise, 1 + noise]."""
    def f() -> float:
        return 1.0 + rng.uniform(-noise, noise)

    def stats(s: LatencyStats) -> LatencyStats:
        return LatencyStats(mean=s.mean * f(), p90=s.p90 * f(), p99=s.p99 * f())

    return m.model_copy(update={"outputTokensPerSecond": m.outputTokensPerSecond * f(), "ttftMs": stats(m.ttftMs),
                                "tpotMs": stats(m.tpotMs)})


Measure = Callable[[TunedSchedule], TrialMetrics]


def simulator_trial(base: SimulationConfig, requests: list[SimRequest], benchmark_load: bool,
                    schedule: TunedSchedule) -> TrialMetrics:
    """One trial on the simulator: the schedule applied, the load run (maxBatchSize - 1 users when
    `benchmark_load`), the window's figures. A module-level function, so that a process pool can run it."""
    config = base.with_schedule(**schedule.model_dump())
    if benchmark_load:
        load = base.bench.load.model_copy(update={"max_concurrency": max(1, schedule.maxBatchSize - 1)})
        config = config.model_copy(update={"bench": base.bench.model_copy(update={"load": load})})
    result = simulate(config.model_copy(update={"keep_steps": False}), requests)
    return trial_metrics(compute_metrics(result.bench.measured, result.bench.duration_s), result)


def engine_shape(base: SimulationConfig, requests: list[SimRequest]) -> EngineShape:
    """The online model's shape of the simulated engine: its model and card, its worldSize, the load's mean lengths."""
    mean_in = sum(r.prompt_tokens for r in requests) / len(requests)
    mean_out = sum(r.output_tokens for r in requests) / len(requests)
    return EngineShape.of(base.model, get_accelerator(base.accelerator), base.engine.model.worldSize, mean_in,
                          mean_out)


def simulator_measure(base: SimulationConfig, requests: list[SimRequest], *, benchmark_load: bool) -> Measure:
    """`simulator_trial` of this base and load (picklable: a process pool can run it)."""
    return functools.partial(simulator_trial, base, requests, benchmark_load)


def tune(problem: TuningProblem, measure: Measure, *, noise: float = 0.0, seed: int = 0
         ) -> tuple[list[Trial], Verdict]:
    """The loop the operator runs: decide, measure (with `noise` drawn per trial, seeded), until a verdict."""
    rng = random.Random(seed)
    trials: list[Trial] = []
    while not isinstance(step := decide(problem, trials), Verdict):
        metrics = measure(step.schedule)
        if noise > 0:
            metrics = with_noise(metrics, noise, rng)
        trials.append(Trial(schedule=step.schedule, metrics=metrics))
    return trials, step


def _table(problem: TuningProblem, trials: list[Trial], verdict: Verdict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"tuning ({problem.objective}): {verdict.reason}; * best, + its other windows")
    for column in ("trial", "maxBatchSize", "prefill batch", "selectBatch", "output tok/s", "TTFT ms", "TPOT ms",
                   "SLO", "verdict"):
        table.add_column(column)
    for i, trial in enumerate(trials):
        m, s = trial.metrics, trial.schedule
        status = trial_status(problem, i, trial)
        mark = " *" if verdict.best == i else " +" if i in verdict.evidence else ""
        slo = "-" if status.sloMet is None else "met" if status.sloMet else "missed"
        table.add_row(f"{i}{mark}", str(s.maxBatchSize), str(s.maxPrefillBatchSize), str(s.supportSelectBatch),
                      f"{m.outputTokensPerSecond:.0f}" if m else "-",
                      f"{problem.latency(m, 'ttft'):.1f}" if m else "-",
                      f"{problem.latency(m, 'tpot'):.1f}" if m else "-", slo, status.verdict)
    Console(file=sys.stderr).print(table)


def run(args: argparse.Namespace) -> int:
    if args.max_trials < 1:
        print("npuserve tune: --max-trials: want >= 1", file=sys.stderr)
        return 2
    if not 0 <= args.noise < 1:
        print("npuserve tune: --noise: want 0 <= noise < 1", file=sys.stderr)
        return 2
    if args.noise_seed is not None and args.noise == 0:
        print("npuserve tune: --noise-seed needs --noise", file=sys.stderr)
        return 2
    # The plan reads the objective from the SLO flags, as `npuserve simulate` does.
    args.slo_ttft_ms, args.slo_tpot_ms, args.slo_statistic = args.ttft_ms, args.tpot_ms, args.statistic
    try:
        base, requests, _, planned = simulate_cli.build_with_plan(args)
        slo = SLOSpec.model_validate({"objective": args.objective, "ttftMs": args.ttft_ms, "tpotMs": args.tpot_ms,
                                      "statistic": args.statistic})
        problem = TuningProblem.from_plan(planned, slo, max_trials=args.max_trials, noise=args.noise,
                                          engine=engine_shape(base, requests))
        pinned = simulate_cli.parse_schedule(args.schedule)
        if pinned:  # --schedule sets knobs as spec.engine.schedule does: pinned, the tuner leaves them alone
            problem = TuningProblem.model_validate({**problem.model_dump(), "pinned": pinned})
    except (simulate_cli.SimulateError, cli_args.ArgumentError, DatasetError, MindIEConfigError, OSError,
            ValueError) as e:  # pydantic's ValidationError is a ValueError
        print(f"npuserve tune: {e}", file=sys.stderr)
        return 2
    benchmark_load = args.max_concurrency is None and not math.isfinite(args.request_rate)
    measure = simulator_measure(base, requests, benchmark_load=benchmark_load)
    trials, verdict = tune(problem, measure, noise=args.noise, seed=args.noise_seed or 0)
    for i, trial in enumerate(trials):
        print(trial_status(problem, i, trial).model_dump_json(exclude_none=True), flush=True)
    print(json.dumps({"verdict": verdict.model_dump(mode="json")}))
    if sys.stderr.isatty():
        _table(problem, trials, verdict)
    return 0
