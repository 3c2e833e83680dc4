"""The `cpu` accelerator's figures, fitted on this project's own engine on this machine's CPU (docs/simulator.md, "The
CPU engine as a source").

`fit_cpu_profile` writes a dummy model (model A: `PROFILE_MODEL`), runs the real `LLMEngine` on the CPU backend over
one batch range (`ProfilePlan`: every batch size at a few prompt lengths, each point a prefill of the whole batch and
then a run of decode steps) and times each `engine.step()` (the scheduler, the forward, the sampler and the output
processor: what one token of a served request waits for). Each step's `StepShape` is the one the simulator builds
(`runner.step_shape` on the engine's own `SchedulerOutput`), so the fit prices exactly what the simulator will price.
The bandwidth is measured, not fitted: the memory curve (`cpu_memory`: the rate the decode kernel reads weights at,
by working set, so that a cache which holds model A's weights but not another model's is seen) at model A's weight
bytes. The fit: the compute rate (tflops; the "cpu" family's efficiency is 1.0, the figures are the CPU's whole) and
the host terms (launch_us_per_layer, per_seq_host_ms), by least squares on the relative error of the cost model's
own `step().total_s`, each host term inside its `CostParams` bound.

A noisy shared machine: the points run in a shuffled order each round (interleaved, so a neighbour's burst hits all
points alike, not one), every figure is a median over rounds and steps, and torch runs a fixed number of threads.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from npuserve.catalog.accelerators import EFFICIENCIES
from npuserve.catalog.models import get_model_preset
from npuserve.engine.engine import LLMEngine
from npuserve.engine.model.dummy import write_dummy_model
from npuserve.engine.scheduler import SchedulerOutput, StepKind
from npuserve.engine.sequence import SamplingParams
from npuserve.mindie_config import minimal_config
from npuserve.modelspec import ModelSpec

from .cost_model import LAUNCH_US_PER_LAYER_BOUND, PER_SEQ_HOST_MS_BOUND, CostModel, CostParams, Hardware, StepShape
from .cpu_memory import MemoryCurve, MemoryProbe
from .minimize import nelder_mead
from .runner import step_shape

# Model A, the one the profile is fitted on: the "tiny" preset widened until a step's work outweighs Python's
# per-op overhead (4 layers, hidden 512, 8 heads of 64 over 4 KV heads, MLP 1536: 52 MB of float32 weights with the
# LM head, beyond the L2 caches; whether the last-level cache holds them is the memory curve's to say).
PROFILE_MODEL: dict[str, object] = {"num_layers": 4, "hidden_size": 512, "num_attention_heads": 8,
                                    "num_key_value_heads": 4, "head_dim": 64, "intermediate_size": 1536,
                                    "dtype": "float32"}
THREADS = 1  # torch intra-op threads: one, so the shared cores' other tenants disturb the timings least


def model_spec(overrides: dict[str, object], base: str = "tiny") -> ModelSpec:
    return get_model_preset(base).model_copy(update=overrides)


@dataclass(frozen=True, slots=True)
class ProfilePlan:
    """The batch range the profile is measured over: every (batch, prompt length) pair, a prefill of the batch then
    `decode_steps` decode steps, `rounds` times in a shuffled order."""

    batches: tuple[int, ...] = (2, 4, 8, 16)
    prompt_lengths: tuple[int, ...] = (96, 192)
    decode_steps: int = 8
    rounds: int = 4
    seed: int = 0

    @property
    def max_seq_len(self) -> int:
        return max(self.prompt_lengths) + self.decode_steps + 8


@dataclass(frozen=True, slots=True)
class MeasuredStep:
    """One measured point: the shape the simulator prices and the median seconds of the engine's steps of it."""

    label: str
    shape: StepShape
    seconds: float
    samples: int


@dataclass(frozen=True, slots=True)
class Residual:
    label: str
    measured_s: float
    predicted_s: float

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1.0


@dataclass(frozen=True)
class CpuProfile:
    """The fit: the cpu Hardware at model A (source "fitted": measured on this machine), the host terms, the memory
    curve (the bandwidth at any model's weight bytes: `hardware_for`), and how well they explain the measured steps."""

    hardware: Hardware
    params: CostParams
    residuals: list[Residual]
    model: ModelSpec
    threads: int
    memory: MemoryCurve
    plan: ProfilePlan = field(default_factory=ProfilePlan)

    @property
    def median_abs_error(self) -> float:
        return statistics.median(abs(r.error) for r in self.residuals)

    def hardware_for(self, spec: ModelSpec) -> Hardware:
        """The Hardware for a model of `spec`'s weight bytes: the memory curve's bandwidth at them, the compute rate
        as fitted (model A's own is `hardware`)."""
        return cpu_hardware(self.memory.at(weight_bytes(spec)), self.hardware.tflops)


def weight_bytes(spec: ModelSpec) -> float:
    """The weight bytes a decode step reads (the working set the memory curve is looked up at)."""
    return spec.step_weight_bytes(1 << 62)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def measure_steps(model_dir: Path, plan: ProfilePlan, between: Callable[[], object] | None = None,
                  each_round: Callable[[], object] | None = None) -> list[MeasuredStep]:
    """Runs the plan on the real engine (the caller fixes torch's threads); one `MeasuredStep` per point and kind.
    `between` runs halfway through the rounds: a measurement to be compared with the fit (the served run) then sees
    the machine as the fit saw it, before and after, when neighbours come and go. `each_round` runs before every
    round (the memory curve's reads, interleaved with the points for the same reason)."""
    most = max(plan.batches)
    config = minimal_config(model_dir, max_seq_len=plan.max_seq_len, maxBatchSize=most, maxPrefillBatchSize=most,
                            maxPrefillTokens=most * max(plan.prompt_lengths))
    engine = LLMEngine(config, seed=plan.seed)
    shapes: list[StepShape] = []
    schedule = engine.scheduler.schedule

    def scheduled() -> SchedulerOutput:  # the shape of each step as the simulator builds it, before the update
        out = schedule()
        if out.seqs:
            shapes.append(step_shape(out))
        return out

    engine.scheduler.schedule = scheduled  # type: ignore[method-assign]
    vocab = engine.spec.vocab_size
    rng = random.Random(plan.seed)
    timings: dict[str, list[tuple[StepShape, float]]] = defaultdict(list)

    def run_point(batch: int, prompt_len: int, record: bool) -> None:
        params = SamplingParams(max_tokens=plan.decode_steps + 1, ignore_eos=True, temperature=0.0)
        for i in range(batch):
            ids = [rng.randrange(3, vocab) for _ in range(prompt_len)]
            engine.add_request(f"p{batch}-{prompt_len}-{i}-{time.monotonic_ns()}", None, params,
                               prompt_token_ids=ids)
        while engine.has_unfinished():
            t0 = time.perf_counter()
            result = engine.step()
            seconds = time.perf_counter() - t0
            if result.stats is None:
                continue
            shape = shapes.pop()
            kind = "decode" if result.stats.kind is StepKind.DECODE else "prefill"
            if record:
                timings[f"{kind} b={batch} len={prompt_len}"].append((shape, seconds))

    run_point(most, min(plan.prompt_lengths), record=False)  # warm the allocator and caches once
    points = [(b, n) for b in plan.batches for n in plan.prompt_lengths]
    for round_ in range(plan.rounds):
        if between is not None and round_ == plan.rounds // 2:
            between()
        if each_round is not None:
            each_round()
        rng.shuffle(points)
        for batch, prompt_len in points:
            run_point(batch, prompt_len, record=True)
    engine.close()
    measured = []
    for label, samples in sorted(timings.items()):
        per_round = len(samples) // plan.rounds
        middle = samples[per_round // 2][0]  # decode: the middle step's context; prefill: the one step
        measured.append(MeasuredStep(label, middle, statistics.median(s for _, s in samples), len(samples)))
    return measured


# The fit's coordinates: log TFLOP/s (positive, any scale), and a logistic of each host term's share of its bound (so
# every candidate stays inside the bound the cost model enforces).
def _decode(u: list[float]) -> tuple[float, CostParams]:
    def share(x: float) -> float:
        return 1.0 / (1.0 + math.exp(-max(-60.0, min(60.0, x))))

    params = CostParams(launch_us_per_layer=LAUNCH_US_PER_LAYER_BOUND * share(u[1]),
                        per_seq_host_ms=PER_SEQ_HOST_MS_BOUND * share(u[2]))
    return math.exp(u[0]), params


def cpu_hardware(bandwidth_gbps: float, tflops: float) -> Hardware:
    # One host's ranks exchange activations through its memory: the link is the memory's bandwidth (unused at
    # worldSize 1, the only size the CPU profile is measured at).
    return Hardware("cpu", bandwidth_gbps, tflops, bandwidth_gbps, "fitted", "pcie", EFFICIENCIES["cpu"])


def _logit(share: float) -> float:
    return math.log(share / (1.0 - share))


def fit_steps(model: ModelSpec, steps: list[MeasuredStep], bandwidth_gbps: float,
              block_size: int = 128) -> tuple[Hardware, CostParams, list[Residual]]:
    """Least squares on the relative error of `CostModel.step(shape).total_s` against each measured median, over
    (compute, launch per layer, host per sequence) at the measured `bandwidth_gbps`; several starts, the best kept.
    The bandwidth is measured, not fitted: with one model a decode step's fixed part is layers x launch + weight
    bytes / bandwidth, and only their sum is seen (docs/simulator.md, "Where it is weak")."""

    def predicted(u: list[float]) -> list[float]:
        tflops, params = _decode(u)
        cost = CostModel(model, cpu_hardware(bandwidth_gbps, tflops), 1, params, block_size=block_size)
        return [cost.step(s.shape).total_s for s in steps]

    def loss(u: list[float]) -> float:
        return sum((p / s.seconds - 1.0) ** 2 for p, s in zip(predicted(u), steps, strict=True))

    best: tuple[list[float], float] | None = None
    for tflops in (0.02, 0.2):
        for launch in (0.1, 0.6):
            found = nelder_mead(loss, [math.log(tflops), _logit(launch), _logit(0.1)], step=0.7)
            if best is None or found[1] < best[1]:
                best = found
    assert best is not None
    tflops, params = _decode(best[0])
    residuals = [Residual(s.label, s.seconds, p) for s, p in zip(steps, predicted(best[0]), strict=True)]
    return cpu_hardware(bandwidth_gbps, tflops), params, residuals


def fit_cpu_profile(workdir: Path, plan: ProfilePlan | None = None, *, threads: int = THREADS,
                    overrides: dict[str, object] | None = None,
                    between: Callable[[], object] | None = None) -> CpuProfile:
    """Writes model A under `workdir`, measures `plan` on the real CPU engine with `threads` torch threads (running
    `between` halfway: `measure_steps`) and the memory curve once a round, fits."""
    plan = plan or ProfilePlan()
    spec = model_spec(overrides or PROFILE_MODEL)
    model_dir = write_dummy_model(spec, workdir / "cpu-profile-model", seed=plan.seed)
    with torch_threads(threads):
        probe = MemoryProbe()
        steps = measure_steps(model_dir, plan, between, each_round=probe.measure)
        memory = probe.curve()
        del probe  # its largest working set (512 MiB) is not kept with the profile
    served = ModelSpec.from_pretrained(model_dir)  # what the engine loaded (the dummy writer fixes special ids)
    hardware, params, residuals = fit_steps(served, steps, memory.at(weight_bytes(served)))
    return CpuProfile(hardware, params, residuals, served, threads, memory, plan)
