"""`simulate(config) -> SimulationResult`: a load-generator run against the simulated engine (docs/simulator.md).

The config is what a real run would have: the engine's MindIE `config.json` (`MindIEConfig`: ScheduleConfig,
worldSize, npuMemSize, cpuMemSize, maxSeqLen, maxInputTokenLen, the npuserve extensions policy and chunkedPrefill),
the model's architecture, the card, and the load generator's `BenchConfig` (dataset, load shape, SLO, ignore_eos).
The engine side is built as `LLMEngine` builds it (a `KVCacheManager` of the configured blocks, a `Scheduler` with the
config's schedule, policy, maxSeqLen and the recompute threshold), and the requests are drawn by the load generator's
own dataset code. The result is the load generator's `BenchResult` (simulated=True), so `loadgen.metrics` and every
report read it unchanged, plus the step trace with each step's cost breakdown.

KV blocks: `num_kv_blocks` when given (the plan's totalBlocks: `npuserve simulate` passes it), else npuMemSize GiB per
card over the bytes of a block per card (the engine's sizing with a fixed npuMemSize); host blocks from cpuMemSize.
Prefix caching is off: simulated prompts carry token counts, not content, so a hit would be an artefact.

Sweeping a knob is a loop over `config.with_schedule(...)`: each run rebuilds the scheduler and costs about a second
per thousand requests (see `sweep`).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from npuserve.catalog.accelerators import GIB, get_accelerator
from npuserve.engine.kvcache import KVCacheManager
from npuserve.engine.scheduler import Scheduler
from npuserve.loadgen.config import BenchConfig
from npuserve.loadgen.datasets import dataset_label, load_requests
from npuserve.loadgen.records import TokenCountSource
from npuserve.loadgen.result import BenchResult
from npuserve.mindie_config import MindIEConfig
from npuserve.modelspec import ModelSpec

from .cost_model import FITTED_COST_PARAMS, CostModel, CostParams, Hardware
from .lengths import OutputLengths, output_tokens, prompt_tokens
from .load import LoadDriver
from .runner import RunTrace, SimRequest, StepRecord, VirtualClockRunner


class SimulationConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=False)

    engine: MindIEConfig = Field(description="the engine's MindIE config.json (schedule, worldSize, memory sizes)")
    model: ModelSpec = Field(description="the model's architecture")
    accelerator: str = Field(description="a card of the catalog (npuserve.catalog.accelerators)")
    bench: BenchConfig = Field(default_factory=BenchConfig, description="dataset, load shape, SLO, ignore_eos")
    output_lengths: OutputLengths = Field(default_factory=OutputLengths,
                                          description="true output lengths of datasets that give only a cap")
    num_kv_blocks: int | None = Field(default=None, gt=0, description="device KV blocks; None: from npuMemSize")
    num_host_blocks: int | None = Field(default=None, ge=0, description="host KV blocks; None: from cpuMemSize")
    recompute_threshold: float = Field(default=0.5, ge=0.0, lt=1.0,
                                       description="MindIE's recompute threshold (its variables: engine_contract)")
    cost: CostParams = Field(default_factory=lambda: FITTED_COST_PARAMS, description="the cost model's parameters")
    hardware: Hardware | None = Field(default=None, description="the card's figures; None: the catalog's (published, "
                                                                "else fitted)")
    keep_steps: bool = Field(default=True, description="keep each step's cost breakdown in the result")

    @model_validator(mode="after")
    def _sized(self) -> SimulationConfig:
        get_accelerator(self.accelerator)  # a KeyError naming the known cards
        if self.num_kv_blocks is None and self.engine.model.npuMemSize < 0:
            raise ValueError("npuMemSize is -1 (auto): give num_kv_blocks (npuserve simulate takes the plan's "
                             "totalBlocks)")
        return self

    @property
    def world_size(self) -> int:
        return self.engine.model.worldSize

    @property
    def block_bytes_per_card(self) -> int:
        return self.model.kv_bytes_per_block(self.engine.schedule.cacheBlockSize, self.world_size)

    @property
    def kv_blocks(self) -> int:
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        return self.engine.model.npuMemSize * GIB // self.block_bytes_per_card

    @property
    def host_blocks(self) -> int:
        if self.num_host_blocks is not None:
            return self.num_host_blocks
        return self.engine.model.cpuMemSize * GIB // self.block_bytes_per_card

    def with_schedule(self, **changes: Any) -> SimulationConfig:
        """A copy with ScheduleConfig fields changed (validated as MindIE validates them)."""
        return self.model_copy(update={"engine": self.engine.with_schedule(**changes)})


@dataclass
class SimulationResult:
    bench: BenchResult  # what `npuserve bench` would have recorded
    steps: list[StepRecord]  # every step, with its cost breakdown (empty when keep_steps is False)
    kv_blocks: int
    host_blocks: int
    hardware: Hardware
    num_preemptions: int

    def cost_totals(self) -> dict[str, float]:
        """Seconds spent in each cost term over the run (the breakdown summed)."""
        names = ("weights_s", "kv_s", "compute_s", "comm_s", "host_s", "launch_s", "swap_s", "total_s")
        totals = dict.fromkeys(names, 0.0)
        for step in self.steps:
            for name in names:
                totals[name] += getattr(step.cost, name)
        return totals


def draw_requests(bench: BenchConfig, num: int, lengths: OutputLengths | None = None) -> list[SimRequest]:
    """`num` requests from the bench config's dataset (the load generator's own code, without a tokenizer), with
    their token counts and true output lengths (see `lengths`)."""
    drawn = load_requests(bench.dataset, num, tokenizer=None, seed=bench.load.seed)
    rng = random.Random(bench.load.seed + 2)  # its own stream: the arrivals use seed + 1, the dataset seed
    lengths = lengths or OutputLengths()
    return [SimRequest(prompt_tokens(r), output_tokens(r, bench.dataset.name, lengths, bench.ignore_eos, rng),
                       r.max_tokens)
            for r in drawn]


def simulate(config: SimulationConfig, requests: Sequence[SimRequest] | None = None,
             model_name: str | None = None) -> SimulationResult:
    """One run on the virtual clock. `requests` replaces the dataset (warm-up ones first, then the measured ones:
    `warmup_requests + num_prompts` of them)."""
    bench, load = config.bench, config.bench.load
    total = load.warmup_requests + load.num_prompts
    drawn = list(requests) if requests is not None else draw_requests(bench, total, config.output_lengths)
    if len(drawn) != total:
        raise ValueError(f"{len(drawn)} requests given; the load asks for {total} (warm-up included)")
    warmups, measured = drawn[:load.warmup_requests], drawn[load.warmup_requests:]
    engine = config.engine
    schedule = engine.schedule
    hardware = config.hardware or Hardware.of(get_accelerator(config.accelerator))
    kv = KVCacheManager(config.kv_blocks, config.host_blocks, schedule.cacheBlockSize, enable_prefix_caching=False)
    ext = engine.extensions
    scheduler = Scheduler(schedule, kv, policy=ext.policy, max_seq_len=engine.deploy.maxSeqLen,
                          recompute_threshold=config.recompute_threshold, chunked_prefill=ext.chunkedPrefill)
    cost = CostModel(config.model, hardware, config.world_size, config.cost, block_size=schedule.cacheBlockSize)
    runner = VirtualClockRunner(scheduler, cost, max_input_len=engine.deploy.maxInputTokenLen,
                                truncation=engine.deploy.truncation, max_waiting=ext.maxWaitingRequests,
                                keep_steps=config.keep_steps)
    trace = RunTrace()
    origin = 0.0
    if warmups:
        warm = LoadDriver(load, len(warmups), users=load.max_concurrency or 1, cycle=False)
        runner.run(warmups, warm, warmup=True, trace=trace)
        origin = runner.now
        for record in trace.records:  # warm-up times relative to the measured phase's start, as the client does
            _shift(record, origin)
        trace.steps.clear()
    driver = LoadDriver(load, len(measured), start=origin)
    runner.run(measured, driver, origin=origin, trace=trace, first_index=len(warmups))
    measured_records = [r for r in trace.records if not r.warmup]
    ended = max((r.end if r.end is not None else r.t0 for r in measured_records), default=0.0)
    result = BenchResult(
        config=bench, model=model_name or engine.model.modelName, started_at=datetime.now(UTC).astimezone(),
        duration_s=max(ended, 1e-9), records=trace.records, token_source=TokenCountSource.SIMULATED,
        tokenizer=None, dataset=dataset_label(bench.dataset), simulated=True,
    )
    return SimulationResult(bench=result, steps=trace.steps, kv_blocks=config.kv_blocks,
                            host_blocks=config.host_blocks, hardware=hardware,
                            num_preemptions=scheduler.num_preemptions_total)


def _shift(record: Any, origin: float) -> None:
    record.t0 -= origin
    record.end = None if record.end is None else record.end - origin
    record.chunk_times[:] = [t - origin for t in record.chunk_times]


def sweep(config: SimulationConfig, values: Iterable[int], *, prefill_half: bool = True,
          requests: Sequence[SimRequest] | None = None) -> list[tuple[int, SimulationResult]]:
    """One run per maxBatchSize (maxPrefillBatchSize = half of it, the plan's rule, unless `prefill_half` is False),
    the same requests every run (drawn once)."""
    load = config.bench.load
    if requests is None:
        requests = draw_requests(config.bench, load.warmup_requests + load.num_prompts, config.output_lengths)
    drawn = list(requests)
    results = []
    for batch in values:
        changes: dict[str, int] = {"maxBatchSize": batch}
        if prefill_half:
            changes["maxPrefillBatchSize"] = max(1, batch // 2)
        results.append((batch, simulate(config.with_schedule(**changes), drawn)))
    return results
