"""The simulator's calibration: the MindIE tuning guide's measured table (docs/simulator.md#calibration), the run that
reproduces its setup, and the fitted constants (`benchmarks/simulator_calibration.py` produced them and prints the
table).

The guide's setup: LLaMA3-8B in bf16 on 2 x 910B4 (32 GB) with MindIE, the GSM8K test set (1319 questions; 186
prompt tokens on average after MindIE's benchmark template, 346 output tokens on average, at most 512), the MindIE
benchmark at client concurrency 1000: a closed loop of 1000 users over the 1319 prompts. Simulated the same way:
1319 requests, prompts uniform in [130, 242] tokens, outputs drawn with mean 346 under the cap of 512
(`lengths.draw_output`), 1000 users, maxPrefillTokens 8192 (the plan's min(8192, maxPrefillBatchSize x 186)),
cpuMemSize 5 GiB (unused: maxPreemptCount 0, nothing is swapped).

KV budget: 740 blocks (`CALIBRATED_KV_BLOCKS`), fitted, not the 2176 our planner computes for npuMemSize 17 with
the real head size, nor the guide's own 544 (docs/planning.md#the-steps, step 2; the guide does not print the count the
engine allocated). The measurements are those of an engine whose cache fills at about 200 running requests of this
workload: the throughput rises only 5% from maxBatchSize 200 to 300 and falls 15% at 400, while the decode time keeps
rising with the batch. 740 blocks hold about 205 such requests (3.6 blocks each on average): past that, running requests
stall for blocks (a few are recomputed) and a larger maxBatchSize only adds prefill churn, so the simulated
throughput peaks at 300 and falls at 400. With 2176 blocks the cache never fills: the simulated throughput keeps
rising (3390 tok/s at 300, 3720 at 400: +48% over the guide there). With 544 it fills at about 150 requests: the
throughput is 2330-2430 tok/s from 200 on (15-21% under the guide at 200 and 300), and the prefill-first run at 200
(supportSelectBatch=false) stops prefilling for want of blocks, so its decode time comes out 21% low.

TTFT: the guide's mean TTFT column (6.4 s, 11.3 s, 21.3 s at maxBatchSize 100, 150, 200) cannot come from 1000
requests in flight: by Little's law a closed loop of N users has mean E2E = N / completed requests per second, so
mean TTFT = N x mean output / output tok/s - mean decode time, about 100 s or more at these throughputs (and falling,
not rising, with maxBatchSize). The calibration prints the simulated TTFT beside the guide's and leaves it out of the
fit (`GuidePoint.ttft_ms` is shown, `FITTED_METRICS` says which figures are fitted).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from npuserve.catalog.models import get_model_preset
from npuserve.loadgen.config import BenchConfig, LoadConfig
from npuserve.loadgen.metrics import compute_metrics
from npuserve.mindie_config import MindIEConfig

from .cost_model import FITTED_COST_PARAMS, CostParams, Hardware
from .engine import SimulationConfig, simulate
from .lengths import draw_output
from .runner import SimRequest

MODEL = "llama3-8b"
ACCELERATOR = "ascend-910b4"
WORLD_SIZE = 2
NUM_REQUESTS = 1319  # the GSM8K test set
CONCURRENCY = 1000
MEAN_INPUT, INPUT_SPREAD = 186, 56  # prompts uniform in [130, 242]
MEAN_OUTPUT, MAX_OUTPUT, OUTPUT_CV = 346, 512, 0.5
MAX_PREFILL_TOKENS = 8192
CALIBRATED_KV_BLOCKS = 740  # fitted (benchmarks/simulator_calibration.py); see the docstring
SEED = 0

FITTED_METRICS = ("output_tok_s", "decode_ms")  # the guide's figures the fit matches; TTFT is shown, not fitted


@dataclass(frozen=True)
class GuidePoint:
    """One row of the guide's table; None where the guide reports nothing."""

    select_batch: bool
    max_batch: int
    max_prefill_batch: int
    output_tok_s: float | None = None
    ttft_ms: float | None = None
    decode_ms: float | None = None

    @property
    def label(self) -> str:
        return f"selectBatch={str(self.select_batch).lower()} maxBatchSize={self.max_batch}"


GUIDE_POINTS: tuple[GuidePoint, ...] = (
    GuidePoint(True, 200, 100, output_tok_s=2845.3, decode_ms=60.1889),
    GuidePoint(True, 300, 150, output_tok_s=2980.3),
    GuidePoint(True, 400, 200, output_tok_s=2520.6),
    GuidePoint(True, 100, 50, decode_ms=46.9689),
    GuidePoint(True, 150, 75, decode_ms=49.846),
    GuidePoint(False, 200, 100, ttft_ms=21252.0612, decode_ms=73.7486),
    GuidePoint(False, 150, 75, ttft_ms=11265.0242, decode_ms=61.9161),
    GuidePoint(False, 100, 50, ttft_ms=6364.6507, decode_ms=49.9804),
)


@dataclass(frozen=True)
class Simulated:
    output_tok_s: float
    ttft_ms: float
    decode_ms: float  # MindIE's DecodeTime average: every inter-token gap, pooled
    mean_decode_batch: float
    preemptions: int


@dataclass(frozen=True)
class Comparison:
    point: GuidePoint
    metric: str
    measured: float
    simulated: float
    fitted: bool

    @property
    def error(self) -> float:
        return (self.simulated - self.measured) / self.measured


def guide_requests(seed: int = SEED) -> list[SimRequest]:
    rng = random.Random(seed)
    return [SimRequest(rng.randint(MEAN_INPUT - INPUT_SPREAD, MEAN_INPUT + INPUT_SPREAD),
                       draw_output(MEAN_OUTPUT, OUTPUT_CV, MAX_OUTPUT, rng), MAX_OUTPUT)
            for _ in range(NUM_REQUESTS)]


def guide_config(point: GuidePoint, params: CostParams = FITTED_COST_PARAMS, kv_blocks: int = CALIBRATED_KV_BLOCKS,
                 hardware: Hardware | None = None) -> SimulationConfig:
    engine = MindIEConfig.from_dict({"BackendConfig": {
        "ModelDeployConfig": {"ModelConfig": [{"modelName": MODEL, "modelWeightPath": MODEL, "worldSize": WORLD_SIZE,
                                               "npuMemSize": 17, "cpuMemSize": 5}]},
        "ScheduleConfig": {"maxBatchSize": point.max_batch, "maxPrefillBatchSize": point.max_prefill_batch,
                           "maxPrefillTokens": MAX_PREFILL_TOKENS, "supportSelectBatch": point.select_batch,
                           "maxIterTimes": MAX_OUTPUT},
    }})
    bench = BenchConfig(load=LoadConfig(num_prompts=NUM_REQUESTS, max_concurrency=CONCURRENCY, seed=SEED))
    return SimulationConfig(engine=engine, model=get_model_preset(MODEL), accelerator=ACCELERATOR, bench=bench,
                            num_kv_blocks=kv_blocks, cost=params, hardware=hardware,
                            keep_steps=False)


def run_point(point: GuidePoint, params: CostParams = FITTED_COST_PARAMS, kv_blocks: int = CALIBRATED_KV_BLOCKS,
              requests: list[SimRequest] | None = None, hardware: Hardware | None = None) -> Simulated:
    """The guide's run at one point (the fitted model by default; the calibration script passes candidates)."""
    result = simulate(guide_config(point, params, kv_blocks, hardware), requests or guide_requests())
    metrics = compute_metrics(result.bench.records, result.bench.duration_s)
    batches = [r.server.mean_decode_batch_size for r in result.bench.measured
               if r.server is not None and r.server.mean_decode_batch_size is not None]
    return Simulated(output_tok_s=metrics.output_throughput, ttft_ms=metrics.ttft_ms.mean,
                     decode_ms=metrics.itl_ms.mean, mean_decode_batch=sum(batches) / max(1, len(batches)),
                     preemptions=result.num_preemptions)


def compare(point: GuidePoint, simulated: Simulated) -> list[Comparison]:
    rows = []
    for metric in ("output_tok_s", "ttft_ms", "decode_ms"):
        measured = getattr(point, metric)
        if measured is not None:
            rows.append(Comparison(point, metric, measured, getattr(simulated, metric), metric in FITTED_METRICS))
    return rows
