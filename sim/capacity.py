"""Capacity in cards: how many cards of which layout hold a target load under an SLO (docs/planning.md, "Capacity
in cards").

For each candidate layout (card type x tensor-parallel size 1, 2, 4, 8 up to the card's cards per node) the planner
sizes one instance (`plan`: npuMemSize, totalBlocks, schedule; a layout whose weights and KV do not fit is rejected
with the planner's reason). The simulator then finds what one instance holds under the SLO by bisection: the largest
closed-loop concurrency (`target_users`) or Poisson rate (`target_rate`) whose run meets the bounds, as judged by the
tuner's one judge (`TuningProblem.judge`: the SLO's statistic, mean / p90 / p99, against each bound, and its failure
checks). Instances = ceil(target / per instance), cards = instances x TP, nodes = the nodes they fill (an instance never
spans nodes). The answer is the fewest cards; ties go to fewer nodes, then to more headroom.

The interconnect enters through the cost model's comm term (link kind and bandwidth from the catalog, the family's
fitted link efficiency, the engine's all-reduce latency): each candidate shows the all-reduce share of its decode step.

This module composes the planner and the simulator; `npuserve plan` imports it only for --target-users/--target-rate.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from npuserve.catalog.accelerators import ACCELERATORS, LINK_LATENCIES, get_accelerator
from npuserve.catalog.models import get_model_preset
from npuserve.loadgen.config import BenchConfig, LoadConfig
from npuserve.loadgen.metrics import compute_metrics
from npuserve.mindie_config import MindIEConfig
from npuserve.planning.api import InferenceServiceSpec, LatencyStats, Plan, PlanSchedule, SLOSpec, TrialMetrics
from npuserve.planning.planner import PlanError, model_spec, plan
from npuserve.planning.problem import TuningProblem

from .cost_model import DEFAULT_ENGINE, ENGINE_PROFILES, CostModel, Hardware, StepShape
from .engine import SimulationConfig, simulate
from .lengths import draw_output
from .runner import SimRequest

TP_SIZES = (1, 2, 4, 8)
PROBE_REQUESTS = 240  # simulated requests per probe: enough for a stable mean, small enough for a ~30 s CLI run
OUTPUT_CV = 0.5  # spread of output lengths (sd / mean), the simulator's default
INPUT_SPREAD = 0.3  # prompts uniform in mean +- 30 %
RATE_STEPS = 7  # bisection steps on the rate: the answer within 2^-7 of the saturated rate
Target = Literal["users", "rate"]
Verdict = Literal["winner", "more cards", "memory", "unreachable"]


@dataclass(frozen=True)
class Candidate:
    """One layout, judged: what one instance holds, and why it lost when it did."""

    accelerator: str
    world_size: int
    verdict: Verdict
    why: str
    per_instance: float | None = None  # users (closed loop) or requests/s under the SLO
    instances: int | None = None
    cards: int | None = None
    nodes: int | None = None  # None: the card has no cards-per-node figure
    headroom: float | None = None  # instances x per_instance - target
    comm_share: float | None = None  # all-reduce share of a decode step at the instance's batch
    source: str = ""
    probes: list[tuple[float, bool]] = field(default_factory=list)

    @property
    def layout(self) -> str:
        return f"{self.world_size} x {self.accelerator}"


@dataclass(frozen=True)
class CapacityAnswer:
    target: Target
    value: float
    slo: SLOSpec
    winner: Candidate | None
    candidates: list[Candidate]


def slo_of(ttft_ms: float | None, tpot_ms: float | None, statistic: str = "mean") -> SLOSpec:
    """The SLO the bounds make, with `npuserve simulate`'s objective rule."""
    if ttft_ms is None and tpot_ms is None:
        raise ValueError("capacity needs an SLO: --ttft-ms and/or --tpot-ms")
    if tpot_ms is None:
        return SLOSpec.model_validate({"objective": "throughput", "ttftMs": ttft_ms, "statistic": statistic})
    objective = "firstTokenAndDecode" if ttft_ms is not None else "decodeLatency"
    return SLOSpec.model_validate({"objective": objective, "ttftMs": ttft_ms, "tpotMs": tpot_ms,
                                   "statistic": statistic})


def layouts(accelerators: Sequence[str] | None) -> list[tuple[str, int]]:
    """(card, TP) pairs: TP 1, 2, 4, 8 up to the card's cards per node (8 when the catalog gives none)."""
    names = list(accelerators) if accelerators else [n for n in ACCELERATORS if n != "cpu"]
    if "all" in names:
        names = [n for n in ACCELERATORS if n != "cpu"]
    out = []
    for name in names:
        per_node = get_accelerator(name).cards_per_node or max(TP_SIZES)
        out += [(name, tp) for tp in TP_SIZES if tp <= per_node]
    return out


def workload_requests(mean_input: int, mean_output: int, max_output: int, n: int, seed: int = 0) -> list[SimRequest]:
    rng = random.Random(seed)
    spread = int(mean_input * INPUT_SPREAD)
    return [SimRequest(max(1, rng.randint(mean_input - spread, mean_input + spread)),
                       draw_output(mean_output, OUTPUT_CV, max_output, rng), max_output) for _ in range(n)]


def _trial(result_records: object, duration: float, preemptions: int) -> TrialMetrics:
    metrics = compute_metrics(result_records, duration)  # type: ignore[arg-type]
    return TrialMetrics(outputTokensPerSecond=metrics.output_throughput,
                        ttftMs=LatencyStats(mean=metrics.ttft_ms.mean, p90=metrics.ttft_ms.p90,
                                            p99=metrics.ttft_ms.p99),
                        tpotMs=LatencyStats(mean=metrics.tpot_ms.mean, p90=metrics.tpot_ms.p90,
                                            p99=metrics.tpot_ms.p99),
                        errorRate=metrics.error_rate, samples=metrics.completed, preemptions=preemptions)


def nodes_for(instances: int, world_size: int, cards_per_node: int | None) -> int | None:
    """Nodes `instances` of `world_size` cards fill, none spanning nodes; None without a cards-per-node figure."""
    if cards_per_node is None:
        return None
    return math.ceil(instances / (cards_per_node // world_size))


class _Instance:
    """One planned instance and its simulator: `meets(load)` runs one probe and asks the judge."""

    def __init__(self, planned: Plan, spec: InferenceServiceSpec, slo: SLOSpec, engine_profile: str,
                 requests: list[SimRequest]) -> None:
        self.plan = planned
        self.problem = TuningProblem.from_plan(planned, slo)
        self.model = model_spec(spec)
        self.accelerator = spec.accelerator.type
        self.params = ENGINE_PROFILES[engine_profile].params
        self.requests = requests
        self.hardware = Hardware.of(get_accelerator(self.accelerator))
        self.fixed: PlanSchedule | None = None  # every probe's schedule (a tuned one); None: the tuner's

    def config(self, batch: int, load: LoadConfig) -> SimulationConfig:
        schedule = self.fixed or self.problem.full_schedule(self.problem.schedule_for(batch))
        p = self.plan
        engine = MindIEConfig.from_dict({"BackendConfig": {
            "ModelDeployConfig": {"maxSeqLen": p.maxSeqLen, "maxInputTokenLen": p.maxInputTokenLen,
                                  "ModelConfig": [{"modelName": p.model, "modelWeightPath": p.model,
                                                   "worldSize": p.worldSize, "npuMemSize": p.npuMemSizeGiB,
                                                   "cpuMemSize": p.cpuMemSizeGiB}]},
            "ScheduleConfig": schedule.model_dump()}})
        return SimulationConfig(engine=engine, model=self.model, accelerator=self.accelerator,
                                bench=BenchConfig(load=load), num_kv_blocks=p.totalBlocks, cost=self.params,
                                keep_steps=False)

    def run(self, batch: int, load: LoadConfig) -> tuple[bool, TrialMetrics]:
        result = simulate(self.config(batch, load), self.requests[:load.num_prompts])
        trial = _trial(result.bench.measured, result.bench.duration_s, result.num_preemptions)
        return self.problem.judge(trial).meets, trial

    def users(self, users: int) -> tuple[bool, TrialMetrics]:
        """A closed loop of `users`, the engine's maxBatchSize set to hold them all (the tuner's schedule rule)."""
        n = min(len(self.requests), max(PROBE_REQUESTS, 2 * users))
        return self.run(users, LoadConfig(num_prompts=n, max_concurrency=users))

    def rate(self, rate: float) -> tuple[bool, TrialMetrics]:
        """Poisson arrivals at `rate`, the engine at its memory maximum maxBatchSize."""
        return self.run(self.problem.batch_max, LoadConfig(num_prompts=PROBE_REQUESTS, request_rate=rate))

    def comm_share(self, batch: int, context: int) -> float:
        """The all-reduce share of a decode step of `batch` sequences, each attending `context` tokens."""
        cost = CostModel(self.model, self.hardware, self.plan.worldSize, self.params).step(StepShape(
            num_seqs=batch, new_tokens=batch, context_tokens=batch * context, attended_pairs=batch * context,
            sampled_rows=batch))
        return cost.comm_s / cost.total_s if cost.total_s > 0 else 0.0

    def source(self, engine_profile: str) -> str:
        hw = self.hardware
        link = (f", all-reduce {hw.allreduce_us:g} us over {hw.link} ({LINK_LATENCIES[hw.link].source})"
                if self.plan.worldSize > 1 else "")
        return (f"simulated: engine profile {engine_profile} ({ENGINE_PROFILES[engine_profile].source}), card figures "
                f"{hw.source}, efficiencies {hw.efficiency.source}{link}")


def _largest(meets: Callable[[int], bool], high: int) -> tuple[int, list[tuple[float, bool]]]:
    """The largest n in [1, high] with meets(n), assuming meets is monotone (0: not even 1)."""
    probes: list[tuple[float, bool]] = []

    def probe(n: int) -> bool:
        ok = meets(n)
        probes.append((n, ok))
        return ok

    if not probe(1):
        return 0, probes
    if probe(high):
        return high, probes
    low = 1
    while high - low > max(1, low // 32):  # within ~3 %: closer than the simulator's own error
        mid = (low + high) // 2
        low, high = (mid, high) if probe(mid) else (low, mid)
    return low, probes


def per_instance(instance: _Instance, target: Target) -> tuple[float, list[tuple[float, bool]], TrialMetrics]:
    """What one instance holds under the SLO: users (closed loop) or requests/s (Poisson), and its probes."""
    floor_ok, floor = instance.users(1)
    if target == "users":
        best, probes = _largest(lambda n: instance.users(n)[0], instance.problem.batch_max)
        return float(best), probes, floor
    if not floor_ok:
        return 0.0, [(0.0, False)], floor
    # The saturated rate: what a closed loop at the memory maximum completes per second; no open loop holds more.
    _, full = instance.users(instance.problem.batch_max)
    mean_output = sum(r.output_tokens for r in instance.requests) / len(instance.requests)
    saturated = full.outputTokensPerSecond / mean_output
    steps = 1 << RATE_STEPS
    best, probes = _largest(lambda k: instance.rate(saturated * k / steps)[0], steps)
    return saturated * best / steps, [(saturated * k / steps, ok) for k, ok in probes], floor


Measure = Callable[["_Instance", Target], tuple[float, list[tuple[float, bool]], TrialMetrics]]


def search(spec: InferenceServiceSpec, target: Target, value: float, slo: SLOSpec,
           accelerators: Sequence[str] | None = None, engine_profile: str = DEFAULT_ENGINE,
           layouts_to_try: Sequence[tuple[str, int]] | None = None, measure: Measure | None = None) -> CapacityAnswer:
    """The fewest cards that hold `value` users (or requests/s) of `spec`'s workload under `slo`, every layout tried
    and judged. `measure` replaces the simulated per-instance search (tests of the ranking)."""
    measure = measure or per_instance
    w = spec.workload
    requests = workload_requests(w.avgInputTokens, w.avgOutputTokens, w.maxOutputTokens, 4 * PROBE_REQUESTS)
    found: list[Candidate] = []
    for name, tp in layouts_to_try or layouts(accelerators):
        data = spec.model_dump(exclude_none=True)
        data["accelerator"] = {"type": name, "cards": tp}
        data["slo"] = slo.model_dump(exclude_none=True)
        data.pop("replicas", None)
        data.pop("capacity", None)
        try:
            layout_spec = InferenceServiceSpec.model_validate(data)
            planned = plan(layout_spec)
        except (PlanError, ValueError) as e:
            found.append(Candidate(name, tp, "memory", f"does not fit: {str(e).splitlines()[0]}"))
            continue
        instance = _Instance(planned, layout_spec, slo, engine_profile, requests)
        held, probes, floor = measure(instance, target)
        context = w.avgInputTokens + w.avgOutputTokens // 2
        unit = "users" if target == "users" else "req/s"
        if held <= 0:
            share = instance.comm_share(1, context)
            bounds = instance.problem.bounds()
            at_one = ", ".join(f"{k.upper()} {instance.problem.latency(floor, k):.1f} ms ({slo.statistic}) over "
                               f"{bound:g} ms" for k, bound in bounds.items()
                               if instance.problem.latency(floor, k) > bound) or "a failed check"
            found.append(Candidate(name, tp, "unreachable", f"SLO unreachable: one user alone gives {at_one}; "
                                   f"all-reduce {share:.0%} of a decode step", 0.0, comm_share=share,
                                   source=instance.source(engine_profile), probes=probes))
            continue
        instances = math.ceil(value / held - 1e-9)
        per_node = get_accelerator(name).cards_per_node
        batch = max(1, int(held) if target == "users" else instance.problem.batch_max)
        share = instance.comm_share(batch, context)
        found.append(Candidate(name, tp, "more cards", f"{held:.3g} {unit} per instance", held, instances,
                               instances * tp, nodes_for(instances, tp, per_node), instances * held - value, share,
                               instance.source(engine_profile), probes))
    fitting = [c for c in found if c.cards is not None]
    winner = min(fitting, key=lambda c: (c.cards, c.nodes if c.nodes is not None else math.inf, -(c.headroom or 0)),
                 default=None)
    judged = []
    for c in found:
        if c is winner:
            c = Candidate(**{**c.__dict__, "verdict": "winner"})
            winner = c
        elif c.cards is not None and winner is not None:
            more = c.cards - winner.cards  # type: ignore[operator]
            why = (f"needs {c.cards} cards, {more} more than the winner" if more > 0 else
                   f"needs {c.cards} cards, as many as the winner, but " + (
                       f"{c.nodes} nodes" if c.nodes != winner.nodes else "less headroom"))
            c = Candidate(**{**c.__dict__, "why": f"{why}; {c.why}"})
        judged.append(c)
    return CapacityAnswer(target, value, slo, winner, judged)


def model_concurrency(spec: InferenceServiceSpec, planned: Plan, slo: SLOSpec, tuned: PlanSchedule,
                      engine_profile: str = DEFAULT_ENGINE) -> tuple[int, str]:
    """The model's figure beside a measured capacity: the largest closed-loop concurrency one instance of `planned`
    (the service's own card and TP) holds under `slo` with the tuned schedule fixed, at most its maxBatchSize (users
    past it only queue), and its source: status.capacity.modelConcurrencyPerReplica (operator/capacity.py)."""
    w = spec.workload
    requests = workload_requests(w.avgInputTokens, w.avgOutputTokens, w.maxOutputTokens, 4 * PROBE_REQUESTS)
    instance = _Instance(planned, spec, slo, engine_profile, requests)
    instance.fixed = tuned
    held, _ = _largest(lambda n: instance.users(n)[0], tuned.maxBatchSize)
    return held, instance.source(engine_profile)


def preset_spec(preset: str, mean_input: int, mean_output: int, max_output: int = 512) -> InferenceServiceSpec:
    """A spec for a catalog model and a workload (tests and examples)."""
    get_model_preset(preset)
    return InferenceServiceSpec.model_validate({
        "model": {"name": preset, "preset": preset, "weights": {"loadFormat": "dummy"}},
        "accelerator": {"type": "ascend-910b4"},
        "workload": {"avgInputTokens": mean_input, "avgOutputTokens": mean_output, "maxOutputTokens": max_output}})
