"""The tuner (`planning/tuner.py`) against the simulated engine, checked against an exhaustive sweep of the same
simulator (issue 12): for each objective it must end within 3% of the sweep's answer in at most 5 trials (for
`throughput`, the chosen point's tok/s within 3% of the sweep's best), on the guide's setup and two others; with
+-5% noise per measured figure, within 5% in at most 8 trials in at least 9 of 10 seeds. The trials are printed
(`pytest -s` shows them)."""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import random
import statistics
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace

import pytest

from npuserve.planning.api import EARLIER_WINDOWS, LatencyStats, SLOSpec, TrialMetrics
from npuserve.planning.problem import TunedSchedule, TuningProblem
from npuserve.planning.tuner import Trial, Verdict, decide, decode_first_ttft_ms, online_model
from npuserve.sim import calibration as cal
from npuserve.sim import tune_cli
from npuserve.sim.engine import SimulationConfig
from npuserve.sim.runner import SimRequest
from npuserve.sim.simulate_cli import build_with_plan

pytestmark = pytest.mark.slow

_POOL: ProcessPoolExecutor | None = None


def _pool() -> ProcessPoolExecutor:
    """Processes for the sweeps' simulator runs (most of this module's time), one per core."""
    global _POOL
    if _POOL is None:
        _POOL = ProcessPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)),
                                    mp_context=multiprocessing.get_context("spawn"))
    return _POOL


@pytest.fixture(scope="module", autouse=True)
def _pool_shut_down() -> Iterator[None]:
    global _POOL
    yield
    if _POOL is not None:
        _POOL.shutdown(cancel_futures=True)
        _POOL = None

GRID_STEP = 1.06  # the sweep's coarse geometric step; answers are then refined (see _sweep)


@dataclass
class Setup:
    name: str
    problem: TuningProblem  # throughput objective, no bounds; the tests set objective and bounds
    base: SimulationConfig
    requests: list[SimRequest]
    benchmark_load: bool  # concurrency = maxBatchSize - 1 (the guide's benchmark) rather than the base's users

    def __post_init__(self) -> None:
        # The simulator is deterministic: a schedule measured once is measured (the sweep, the tuner, every seed).
        self.cache: dict[tuple[str, bool], TrialMetrics] = {}

    def cached(self, schedule: TunedSchedule) -> TrialMetrics:
        key = (schedule.model_dump_json(), self.benchmark_load)
        if key not in self.cache:
            measure = tune_cli.simulator_measure(self.base, self.requests, benchmark_load=self.benchmark_load)
            self.cache[key] = measure(schedule)
        return self.cache[key]

    def prefetch(self, schedules: Iterable[TunedSchedule]) -> None:
        """The schedules not measured yet, simulated in parallel processes. The simulator is deterministic, so where
        a run happens changes no figure; a sweep's grid is known before any of it is measured."""
        missing = {(s.model_dump_json(), self.benchmark_load): s for s in schedules}
        missing = {k: s for k, s in missing.items() if k not in self.cache}
        if len(missing) < 2:
            return
        measure = tune_cli.simulator_measure(self.base, self.requests, benchmark_load=self.benchmark_load)
        # The smallest batches first: they run the most steps, so the pool ends evenly.
        ordered = sorted(missing.items(), key=lambda item: item[1].maxBatchSize)
        for (key, _), metrics in zip(ordered, _pool().map(measure, [s for _, s in ordered]), strict=True):
            self.cache[key] = metrics

    def measure(self, problem: TuningProblem) -> Callable[[int], Trial]:
        def run(batch: int) -> Trial:
            schedule = problem.schedule_for(batch)
            return Trial(schedule=schedule, metrics=self.cached(schedule))

        return run


def _grid(low: int, high: int) -> list[int]:
    values, b = [], float(low)
    while b < high:
        values.append(round(b))
        b *= GRID_STEP
    return sorted({*values, high})


def _guide() -> Setup:
    """LLaMA3-8B on 2 x 910B4 with the calibrated simulator, the guide's 1000 users, and the guide's own plan:
    maxBatchSize in [90, 272] starting at 108 (docs/planning.md#the-steps, step 4)."""
    from npuserve.planning.api import PlanSchedule

    base = cal.guide_config(cal.GuidePoint(True, 108, 54))
    schedule = PlanSchedule.model_validate({**base.engine.schedule.model_dump(include=set(PlanSchedule.model_fields)),
                                            "maxBatchSize": 108, "maxPrefillBatchSize": 54})
    problem = TuningProblem(objective="throughput", batch_min=90, batch_max=272, batch_start=108,
                            base=schedule, mean_input_tokens=186, max_input_tokens=2048, noise=0.0,
                            engine=tune_cli.engine_shape(base, cal.guide_requests()))
    return Setup("llama3-8b on 2 x ascend-910b4 (the guide)", problem, base, cal.guide_requests(), False)


def _planned(preset: str, accelerator: str, cards: int) -> Setup:
    """A model on cards as `npuserve tune --simulate` plans it: the plan's KV blocks and range, 1300 requests of the
    guide's lengths (enough that maxBatchSize - 1 users stay busy across the range), the guide's benchmark load."""
    parser = argparse.ArgumentParser()
    tune_cli.configure(parser)
    args = parser.parse_args(["--simulate", "--preset", preset, "--accelerator", accelerator, "--cards", str(cards),
                              "--dataset-name", "random", "--random-input-len", "186", "--random-output-len", "346",
                              "--random-range-ratio", "0.3", "--num-prompts", "1300"])
    args.slo_ttft_ms = args.slo_tpot_ms = None
    args.slo_statistic = "mean"
    base, requests, _, planned = build_with_plan(args)
    problem = TuningProblem.from_plan(planned, SLOSpec(objective="throughput"), noise=0.0,
                                      engine=tune_cli.engine_shape(base, requests))
    return Setup(f"{preset} on {cards} x {accelerator}", problem, base, requests, True)


@dataclass
class KneeSetup(Setup):
    """A misspecified engine (issue 33): the guide's simulated engine whose steps turn host-bound past `knee`, so
    that TPOT grows in proportion to the batch from there (and output tok/s stops growing): a knee no linear cost model
    expresses. Its noise-free truth is the knee's too."""

    knee: int = 90

    def cached(self, schedule: TunedSchedule) -> TrialMetrics:
        m = super().cached(schedule)
        f = max(1.0, schedule.maxBatchSize / self.knee)
        tpot = m.tpotMs
        return m.model_copy(update={"outputTokensPerSecond": m.outputTokensPerSecond / f,
                                    "tpotMs": LatencyStats(mean=tpot.mean * f, p90=tpot.p90 * f, p99=tpot.p99 * f)})


def _knee() -> Setup:
    guide = _setup("guide")
    knee = KneeSetup(f"{guide.name.split(' (')[0]}, host-bound past 90 (misspecified)", guide.problem, guide.base,
                     guide.requests, guide.benchmark_load)
    knee.cache = guide.cache
    return knee


# 32 GB cards, as the guide's: the plan's ranges are [213, 640] (32B on 4) and [307, 921] (72B on 8).
SETUPS = {"guide": _guide, "32b": lambda: _planned("qwen2.5-32b", "ascend-910b4", 4),
          "72b": lambda: _planned("qwen2.5-72b", "ascend-910b4", 8)}
# The noise table's setups besides: a mixture of experts (Qwen3-30B-A3B on 2 x 64 GB 910B3), and the misspecified
# engine.
NOISE_SETUPS = {"moe": lambda: _planned("qwen3-30b-a3b", "ascend-910b3", 2), "knee": _knee}
_BUILT: dict[str, Setup] = {}


def _setup(name: str) -> Setup:
    if name not in _BUILT:
        _BUILT[name] = {**SETUPS, **NOISE_SETUPS}[name]()
    return _BUILT[name]


@pytest.fixture(params=sorted(SETUPS))
def setup(request: pytest.FixtureRequest) -> Setup:
    return _setup(request.param)


def _problem(setup: Setup, objective: str, **bounds: float) -> TuningProblem:
    return setup.problem.model_copy(update={"objective": objective, **bounds})


def _sweep(setup: Setup, problem: TuningProblem) -> dict[int, Trial]:
    """Every 6% of the range, then finer where the answer lies: to the integer between the last grid point meeting
    the bounds and the first missing them (latencies grow with the batch), every 2% around the best throughput."""
    measure = setup.measure(problem)
    grid = _grid(problem.batch_min, problem.batch_max)
    setup.prefetch(problem.schedule_for(b) for b in grid)
    sweep = {b: measure(b) for b in grid}
    if problem.bounds():
        meeting = [b for b in grid if _meets(sweep[b], problem)]
        if meeting and meeting[-1] != grid[-1]:
            low, high = meeting[-1], grid[grid.index(meeting[-1]) + 1]
            while high - low > 1:  # bisection to the integer: the exact largest batch meeting the bounds
                middle = (low + high) // 2
                sweep[middle] = measure(middle)
                low, high = (middle, high) if _meets(sweep[middle], problem) else (low, middle)
    else:
        best = max(grid, key=lambda b: sweep[b].metrics.outputTokensPerSecond)  # type: ignore[union-attr]
        i = grid.index(best)
        around = range(grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)] + 1, max(1, best // 50))
        setup.prefetch(problem.schedule_for(b) for b in around)
        for b in around:
            sweep[b] = measure(b)
    return sweep


def _meets(trial: Trial, problem: TuningProblem) -> bool:
    m = trial.metrics
    return m is not None and all((m.ttftMs if k == "ttft" else m.tpotMs).of(problem.statistic) <= bound
                                 for k, bound in problem.bounds().items())


def _tune(setup: Setup, problem: TuningProblem, noise: float = 0.0, seed: int = 0) -> tuple[list[Trial], Verdict]:
    """`npuserve tune --simulate`'s loop, each trial from the setup's cache of the (deterministic) simulator."""
    trials, verdict = tune_cli.tune(problem, setup.cached, noise=noise, seed=seed)
    for i, t in enumerate(trials):
        m = t.metrics
        assert m is not None
        print(f"  trial {i}: maxBatchSize {t.schedule.maxBatchSize} selectBatch {t.schedule.supportSelectBatch}: "
              f"{m.outputTokensPerSecond:.0f} tok/s, TTFT {m.ttftMs.mean:.0f} ms, TPOT {m.tpotMs.mean:.1f} ms")
    print(f"  verdict: {verdict.reason}: {verdict.message}")
    return trials, verdict


def _chosen(verdict: Verdict) -> int:
    assert verdict.schedule is not None
    return verdict.schedule.maxBatchSize


def _largest_meeting(sweep: dict[int, Trial], problem: TuningProblem) -> int:
    meeting = [b for b, t in sweep.items() if _meets(t, problem)]
    assert meeting, "the bound is below the whole range"
    return max(meeting)


def _inner_bound(setup: Setup, problem: TuningProblem, key: str) -> float:
    """A bound whose answer lies inside the range, where the latency still climbs with the batch: the latency at
    1.25 x the range's minimum (higher up, under KV pressure, TPOT flattens and the answer would be ill-posed)."""
    m = setup.measure(problem)(round(problem.batch_min * 1.25)).metrics
    assert m is not None
    return float((m.ttftMs if key == "ttft" else m.tpotMs).mean)


def test_throughput_ends_at_the_sweeps_peak(setup: Setup) -> None:
    problem = _problem(setup, "throughput")
    sweep = _sweep(setup, problem)
    best = max(sweep, key=lambda b: sweep[b].metrics.outputTokensPerSecond)  # type: ignore[union-attr]
    best_tps = sweep[best].metrics.outputTokensPerSecond  # type: ignore[union-attr]
    print(f"\n{setup.name}, throughput: the sweep's best {best_tps:.0f} tok/s at maxBatchSize {best}")
    trials, verdict = _tune(setup, problem)
    chosen = trials[verdict.best or 0].metrics
    assert chosen is not None and verdict.slo_met
    assert len(trials) <= 5
    assert chosen.outputTokensPerSecond >= 0.97 * best_tps


def test_decode_latency_ends_at_the_largest_batch_meeting_tpot(setup: Setup) -> None:
    tpot = 50.0 if setup.name.endswith("(the guide)") else _inner_bound(setup, _problem(setup, "throughput"), "tpot")
    problem = _problem(setup, "decodeLatency", tpot_ms=tpot)
    answer = _largest_meeting(_sweep(setup, problem), problem)
    print(f"\n{setup.name}, decodeLatency TPOT <= {tpot:.1f} ms: the sweep's answer maxBatchSize {answer}")
    trials, verdict = _tune(setup, problem)
    assert verdict.slo_met and len(trials) <= 5
    assert abs(_chosen(verdict) - answer) <= 0.03 * answer + 1


def test_first_token_and_decode_ends_at_the_largest_batch_meeting_both(setup: Setup) -> None:
    benchmark = Setup(setup.name, setup.problem, setup.base, setup.requests, True)  # TTFT in seconds, not minutes
    benchmark.cache = setup.cache
    probe = _problem(benchmark, "firstTokenAndDecode", ttft_ms=1e9, tpot_ms=1e9)
    guide = setup.name.endswith("(the guide)")
    ttft = 8000.0 if guide else _inner_bound(benchmark, probe, "ttft") * 1.5  # TPOT binds; TTFT must hold
    tpot = 50.0 if guide else _inner_bound(benchmark, probe, "tpot")
    problem = _problem(benchmark, "firstTokenAndDecode", ttft_ms=ttft, tpot_ms=tpot)
    if guide:
        # With prefill first under the benchmark load, the simulated TPOT crosses 50 ms near maxBatchSize 70, below
        # the guide's plan minimum of 90: the range opens down to 40 so the answer lies inside it.
        problem = problem.model_copy(update={"batch_min": 40})
    # The search chooses supportSelectBatch too: the answer is the largest batch meeting both bounds with the knob
    # that serves more tok/s there (decode first on the guide, where TTFT never binds; prefill first elsewhere,
    # where the TTFT bound, 1.5x prefill first's, stops decode first lower).
    answers = {}
    for arm in _arms(problem):
        sweep = _sweep(benchmark, arm)
        meeting = [b for b, t in sweep.items() if _meets(t, arm)]
        if meeting:  # decode first on the 32B meets TTFT only below the range (134, 1212 tok/s; 213 off: 1404)
            b = max(meeting)
            answers[arm.pinned["supportSelectBatch"]] = (sweep[b].metrics.outputTokensPerSecond, b)  # type: ignore[union-attr]
    select = max(answers, key=answers.__getitem__)
    answer = answers[select][1]
    print(f"\n{setup.name}, firstTokenAndDecode TTFT <= {ttft:.0f} ms, TPOT <= {tpot:.1f} ms: the sweep's answer "
          f"maxBatchSize {answer} with supportSelectBatch {select} (tok/s, batch by supportSelectBatch: {answers})")
    trials, verdict = _tune(benchmark, problem)
    assert verdict.slo_met and verdict.schedule is not None and verdict.schedule.supportSelectBatch is select
    # The policy's wait at the TPOT bound (a lower bound on decode first's TTFT: the prefills and any wait for a
    # slot come on top) says where to search: on the guide it is 14% of the TTFT bound, and TPOT stops decode first
    # before TTFT does; on the 32B past the bound, and the search is prefill first alone. On the 72B it is 84% of
    # the bound: decode first is tried, its TTFT misses, and the search turns to prefill first.
    wait = decode_first_ttft_ms(problem)
    assert wait is not None
    arms = {t.schedule.supportSelectBatch for t in trials}
    if guide:
        assert wait <= ttft and arms == {True}
    if wait > ttft:
        assert arms == {False}
    assert len(trials) <= (5 if len(arms) == 1 else 10)
    assert abs(_chosen(verdict) - answer) <= 0.03 * answer + 1
    if guide:  # the wait as the simulated engine shows it: its mean TTFT at the answer, prefills included
        m = verdict.pooled
        assert m is not None
        at_answer = decode_first_ttft_ms(problem.model_copy(update={"tpot_ms": m.tpotMs.mean}))
        assert at_answer is not None
        print(f"  decode first's mean wait at the answer's TPOT: {at_answer:.0f} ms; simulated mean TTFT "
              f"{m.ttftMs.mean:.0f} ms")
        assert 0.8 * m.ttftMs.mean <= at_answer <= m.ttftMs.mean


# --- noise ---------------------------------------------------------------------------------------------------------
# Each window's figures times a uniform factor in [1 - noise, 1 + noise] of their own, and the latencies times a
# jitter fixed per batch (and seed) of up to +-3%, the throughput divided by it: a curve that is not monotone in the
# batch, as a real engine's is not (some batches run faster kernels than their neighbours), which no repeat averages
# away. The problem's prior noise stays at the operator's default (+-5%): the tuner must find the real one.

JITTER = 0.03
NOISE_SEEDS = 20
BUDGET = {0.10: 8, 0.20: 12}
FALSE_CLAIM = 1.05  # SLOMet=True for a schedule whose noise-free latency exceeds a bound by more than this


def _noisy(setup: Setup, problem: TuningProblem, noise: float, seed: int) -> Callable[[TunedSchedule], TrialMetrics]:
    rng = random.Random(seed)

    def measure(schedule: TunedSchedule) -> TrialMetrics:
        m = setup.cached(schedule)
        jitter = 1 + JITTER * math.sin(2.399 * schedule.maxBatchSize + 1.7 * seed)

        def f() -> float:
            return 1 + rng.uniform(-noise, noise)

        def stats(s: LatencyStats) -> LatencyStats:
            return LatencyStats(mean=s.mean * f() * jitter, p90=s.p90 * f() * jitter, p99=s.p99 * f() * jitter)

        return m.model_copy(update={"outputTokensPerSecond": m.outputTokensPerSecond * f() / jitter,
                                    "ttftMs": stats(m.ttftMs), "tpotMs": stats(m.tpotMs)})

    return measure


def _noise_bounds(setup: Setup) -> dict[str, dict[str, float]]:
    """The bounds of each objective: the guide's own (TPOT 50 ms, TTFT 8 s), else where the answer lies inside the
    range (as the exact tests above)."""
    if setup.name.endswith("(the guide)"):
        return {"throughput": {}, "decodeLatency": {"tpot_ms": 50.0},
                "firstTokenAndDecode": {"ttft_ms": 8000.0, "tpot_ms": 50.0}}
    probe = _problem(setup, "firstTokenAndDecode", ttft_ms=1e9, tpot_ms=1e9)
    tpot = _inner_bound(setup, _problem(setup, "throughput"), "tpot")
    return {"throughput": {}, "decodeLatency": {"tpot_ms": tpot},
            "firstTokenAndDecode": {"ttft_ms": _inner_bound(setup, probe, "ttft") * 1.5, "tpot_ms": tpot}}


def _arms(problem: TuningProblem) -> list[TuningProblem]:
    """The problem with each supportSelectBatch the search may choose pinned (both for firstTokenAndDecode)."""
    if problem.objective != "firstTokenAndDecode" or "supportSelectBatch" in problem.pinned:
        return [problem]
    return [problem.model_copy(update={"pinned": {**problem.pinned, "supportSelectBatch": s}}) for s in (True, False)]


SWEEP_FLOOR = 8  # the optimum sweep's first batch: a batch below it takes 2-8x as long to simulate (more steps)


def _optimum(setup: Setup, problem: TuningProblem) -> float:
    """The noise-free optimum's throughput: the most output tok/s of a batch meeting every bound, over a sweep
    from SWEEP_FLOOR to the range's maximum (the plan's minimum is no floor), and over supportSelectBatch where the
    search chooses it. Below the optimum, throughput grows with the batch, so an optimum well above the floor is the
    optimum of the sweep from 1 (asserted: one near the floor fails, and the floor must come down)."""
    best, at = 0.0, 0
    for arm in _arms(problem):
        measure = setup.measure(arm)
        grid = _grid(SWEEP_FLOOR, arm.batch_max)
        setup.prefetch(arm.schedule_for(b) for b in grid)
        sweep = {b: measure(b) for b in grid}
        if arm.bounds():
            meeting = [b for b in grid if _meets(sweep[b], arm)]
            if not meeting:
                continue
            low = max(meeting)
            if low != grid[-1]:
                high = grid[grid.index(low) + 1]
                while high - low > 1:
                    middle = (low + high) // 2
                    sweep[middle] = measure(middle)
                    low, high = (middle, high) if _meets(sweep[middle], arm) else (low, middle)
        for b, t in sweep.items():
            assert t.metrics is not None
            if _meets(t, arm) and t.metrics.outputTokensPerSecond > best:
                best, at = t.metrics.outputTokensPerSecond, b
    assert best > 0, "no batch meets the bounds"
    assert at >= 4 * SWEEP_FLOOR, f"the optimum at batch {at} is near the sweep's floor {SWEEP_FLOOR}"
    return best


@dataclass
class NoiseRow:
    setup: str
    objective: str
    noise: float
    false_claims: int = 0
    slo_met: int = 0
    within_5: int = 0
    trials: list[int] = field(default_factory=list)
    first_true: list[float] = field(default_factory=list)  # trials until the verdict, stopped there, is a true claim
    chosen: list[int | None] = field(default_factory=list)

    def line(self) -> str:
        return (f"| {self.setup} | {self.objective} | {self.noise:.0%} | {self.false_claims} | {self.slo_met}/"
                f"{NOISE_SEEDS} | {self.within_5}/{NOISE_SEEDS} | {max(self.trials)} | "
                f"{statistics.median(self.trials):g} | {statistics.median(self.first_true):g} |")


def _true_claim(setup: Setup, exact: TuningProblem, verdict: Verdict) -> bool:
    """SLOMet=True for a schedule whose noise-free latencies are within FALSE_CLAIM of every bound."""
    if not verdict.slo_met or verdict.schedule is None:
        return False
    truth = setup.cached(verdict.schedule)
    return all(exact.latency(truth, k) <= FALSE_CLAIM * b for k, b in exact.bounds().items())


def _first_true_claim(setup: Setup, exact: TuningProblem, problem: TuningProblem, run: list[Trial],
                      earlier: list[Trial] | None = None) -> float:
    """The live trials after which the verdict, were the search stopped there, is a true SLOMet (inf: never)."""
    for k in range(1, len(run) + 1):
        verdict = decide(problem.model_copy(update={"max_trials": k}), run[:k], earlier or [])
        if isinstance(verdict, Verdict) and _true_claim(setup, exact, verdict):
            return k
    return math.inf


def _lockstep(setup: Setup, problems: list[TuningProblem], noise: float, first_seed: int = 0,
              earlier: list[list[Trial]] | None = None) -> tuple[list[list[Trial]], list[Verdict]]:
    """One noisy run per problem to its verdict (seeds first_seed, first_seed + 1, ...), each given its `earlier`
    windows (a previous round's, as the operator gives them). The runs go in lockstep: each one's next schedules, the
    ones not simulated yet, go to the processes at once (the simulator is deterministic and each seed draws its noise
    in its own order, so every run is as if alone)."""
    before = earlier or [[] for _ in problems]
    measures = [_noisy(setup, problem, noise, first_seed + i) for i, problem in enumerate(problems)]
    runs: list[list[Trial]] = [[] for _ in problems]
    verdicts: dict[int, Verdict] = {}
    while len(verdicts) < len(problems):
        wanted: dict[int, TunedSchedule] = {}
        for i, problem in enumerate(problems):
            if i not in verdicts:
                decision = decide(problem, runs[i], before[i])
                if isinstance(decision, Verdict):
                    verdicts[i] = decision
                else:
                    wanted[i] = decision.schedule
        setup.prefetch(wanted.values())
        for i, schedule in wanted.items():
            runs[i].append(Trial(schedule=schedule, metrics=measures[i](schedule)))
    return runs, [verdicts[i] for i in range(len(problems))]


def _for_objective(setup: Setup, objective: str) -> Setup:
    """The setup a noise row of `objective` runs: firstTokenAndDecode under the benchmark load, as the exact test
    (TTFT in seconds), sharing the simulations already cached."""
    if objective != "firstTokenAndDecode" or setup.benchmark_load:
        return setup
    benchmark = replace(setup, benchmark_load=True)
    benchmark.cache = setup.cache
    return benchmark


def _under_noise(exact: TuningProblem, noise: float) -> TuningProblem:
    """The problem a noisy run solves: the prior noise 5% (the tuner is not told the table's), the noise's budget."""
    return exact.model_copy(update={"noise": 0.05, "max_trials": BUDGET[noise]})


def _noise_row(setup: Setup, objective: str, noise: float) -> NoiseRow:
    setup = _for_objective(setup, objective)
    exact = _problem(setup, objective, **_noise_bounds(setup)[objective])
    best_tps = _optimum(setup, exact)
    noisy = _under_noise(exact, noise)
    row = NoiseRow(setup.name.split(" (")[0], objective, noise)
    runs, verdicts = _lockstep(setup, [noisy] * NOISE_SEEDS, noise)
    for seed, verdict in enumerate(verdicts):
        row.trials.append(len(runs[seed]))
        row.first_true.append(_first_true_claim(setup, exact, noisy, runs[seed]))
        row.chosen.append(verdict.schedule.maxBatchSize if verdict.schedule else None)
        if not verdict.slo_met or verdict.schedule is None:
            continue
        row.slo_met += 1
        row.false_claims += not _true_claim(setup, exact, verdict)
        row.within_5 += setup.cached(verdict.schedule).outputTokensPerSecond >= 0.95 * best_tps
    print(row.line(), row.chosen)
    return row


@pytest.mark.parametrize("name", ["guide", "32b", "moe", "knee"])
def test_under_noise_no_verdict_is_false_and_the_budget_holds(name: str) -> None:
    """20 seeds at 10% and 20% noise with jitter, each objective: no run ends with SLOMet=True for a schedule whose
    noise-free latency exceeds a bound by more than 5%; at most 8 trials at 10%, 12 at 20%; at 10%, the verdict
    were the search stopped there is a true SLOMet after a median of at most 4 trials. How close the verdicts come
    to the noise-free optimum is printed (`pytest -s`); the throughput objective's is held to 18 of 20 within 5% at
    10% noise."""
    setup = _setup(name)
    print("\n| setup | objective | noise | false SLOMet | SLOMet | within 5% of the optimum | max trials | "
          "median trials | median trials to the first true claim |")
    rows = [_noise_row(setup, objective, noise) for objective in ("throughput", "decodeLatency",
                                                                   "firstTokenAndDecode") for noise in BUDGET]
    for row in rows:
        assert row.false_claims == 0, row
        assert max(row.trials) <= BUDGET[row.noise], row
        if row.noise == 0.10:  # issue 33: the first true claim within a median of 4 live trials
            assert statistics.median(row.first_true) <= 4, row
    for row in rows:  # issue 33: 18 of 20 within 5% of the optimum at 10% noise, met for throughput
        if row.objective == "throughput" and row.noise == 0.10:
            assert row.within_5 >= 18, row


DRIFT_PROMPTS = 0.25  # the traffic change of the drift test: every prompt a quarter as long


def _drifted(setup: Setup) -> Setup:
    """The same engine and problem under other traffic: every prompt DRIFT_PROMPTS as long (shorter contexts: TPOT
    falls at every batch and the answer rises). The problem keeps the spec's lengths, as the operator's does: nobody
    edited it."""
    requests = [replace(r, prompt_tokens=max(1, round(r.prompt_tokens * DRIFT_PROMPTS))) for r in setup.requests]
    return Setup(f"{setup.name}, prompts x{DRIFT_PROMPTS}", setup.problem, setup.base, requests,
                 setup.benchmark_load)


def test_after_a_traffic_change_no_verdict_is_false() -> None:
    """A second round after a traffic change, as the operator runs it after missed windows: the guide's
    decode-latency practice (TPOT mean <= 50 ms) at 10% noise, 20 seeds, round 1 under the guide's traffic, then
    every prompt a quarter as long and round 2 from round 1's choice, its engine model given round 1's last windows
    (as the operator gives status.tuning.earlier; its adequacy test keeps them in most runs: shorter prompts move
    TPOT little). Its first true claim comes after a median of 2 live trials, and no claim is false. Seed 15 once
    claimed maxBatchSize 178 (noise-free TPOT 52.7 ms, 5.4% over the bound) from three windows 9.7% under the truth
    in the mean, the batch's fixed jitter and three draws low: a claim now carries the bias the windows at one batch
    share (`fits.batch_bias`), and that claim is no longer made."""
    guide = _setup("guide")
    after = _drifted(guide)
    after.cache = {}
    exact = _problem(guide, "decodeLatency", tpot_ms=50.0)
    noisy = _under_noise(exact, 0.10)
    before, first = _lockstep(guide, [noisy] * NOISE_SEEDS, 0.10)
    starts = [v.schedule.maxBatchSize if v.schedule is not None else noisy.batch_start for v in first]
    problems = [noisy.model_copy(update={"batch_start": start}) for start in starts]
    earlier = [run[-EARLIER_WINDOWS:] for run in before]  # the operator's status.tuning.earlier
    runs, verdicts = _lockstep(after, problems, 0.10, first_seed=1000, earlier=earlier)
    first_true = [_first_true_claim(after, exact, p, r, e) for p, r, e in zip(problems, runs, earlier, strict=True)]
    carried = [m.earlier for m in (online_model(p, r, e) for p, r, e in zip(problems, runs, earlier, strict=True))
               if m is not None]
    print(f"\nround 2's models read {carried} of round 1's windows at their verdicts")
    assert any(carried), carried
    chosen = [v.schedule.maxBatchSize if v.schedule is not None else None for v in verdicts]
    print(f"\nround 1 chose {starts}; round 2 (prompts x{DRIFT_PROMPTS}) chose {chosen}, the first true claim after "
          f"a median of {statistics.median(first_true):g} trials")
    assert statistics.median(first_true) <= 2, first_true
    false = [(i, chosen[i]) for i, v in enumerate(verdicts) if v.slo_met and not _true_claim(after, exact, v)]
    assert false == [], false
