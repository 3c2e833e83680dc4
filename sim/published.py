"""Published serving runs as simulator inputs: each run of `../shared/datasets/published-serving/points.csv` (and the
MindIE tuning guide's table, `calibration.py`) that the simulator can rebuild, with its source, what the source does
not say and what is assumed in its place (docs/simulator.md#calibration).

A point is rebuilt as a user would rebuild it: the model preset, the card and tensor-parallel size, the engine whose
host terms it runs with (`ENGINE_PROFILES`), the engine's batch limits (stated, or the engine's documented default),
the KV budget the planner computes for that card, memory fraction and model (never a fitted count), the request
lengths and the load. Left out, and why: prefix-cache runs (A4, A5: simulated prompts carry no content), W4A4 and
FP8 weights (A11, N17-N20: no such scheme in the cost model), speculative decoding (A19, A20), runs without a card
count (M1-M3) or without a figure the simulator predicts (A17's throughput is kept; A12-A15 have no output length).

Lengths. ShareGPT runs give token totals only: prompts and outputs are drawn log-normal (sigma 0.9, about ShareGPT's
spread) and scaled to the published totals, under vLLM's ShareGPT filter (prompt <= 1024, prompt + output <= 2048).
Random runs use the stated lengths exactly (vLLM's random dataset at range ratio 0). Outputs run to their length
(vLLM's benchmark sets ignore_eos for random; ShareGPT outputs are the reference lengths).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from npuserve.catalog.models import get_model_preset
from npuserve.loadgen.config import BenchConfig, LoadConfig
from npuserve.loadgen.metrics import compute_metrics
from npuserve.mindie_config import MindIEConfig
from npuserve.planning.api import InferenceServiceSpec
from npuserve.planning.planner import plan
from npuserve.quantization import parse_quantization

from .cost_model import ENGINE_PROFILES, CostParams, Hardware
from .engine import SimulationConfig, simulate
from .runner import SimRequest

Metric = Literal["ttft_ms", "tpot_ms", "itl_ms", "output_tok_s"]
METRICS: tuple[Metric, ...] = ("ttft_ms", "tpot_ms", "itl_ms", "output_tok_s")
CHUNKING_ENGINES = frozenset({"vllm", "vllm-ascend-graph"})  # vLLM V1: prompts chunked into the token budget
SHAREGPT_SIGMA = 0.9
SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL = 1024, 2048


@dataclass(frozen=True)
class Lengths:
    """Request lengths: `fixed` (every request `input` in, `output` out) or `sharegpt` (means, see the docstring)."""

    kind: Literal["fixed", "sharegpt"]
    input: float
    output: float
    output_jitter: float = 0.0  # fixed: outputs uniform in output x [1 - jitter, 1 + jitter]

    def draw(self, n: int, seed: int) -> list[tuple[int, int]]:
        rng = random.Random(seed)
        if self.kind == "fixed":
            j = self.output_jitter
            return [(round(self.input), max(1, round(self.output * rng.uniform(1 - j, 1 + j)))) for _ in range(n)]
        pairs = []
        for _ in range(n):
            p = math.exp(rng.gauss(0.0, SHAREGPT_SIGMA))
            o = math.exp(rng.gauss(0.0, SHAREGPT_SIGMA))
            pairs.append((p, o))
        scale_in = self.input / (sum(p for p, _ in pairs) / n)
        scale_out = self.output / (sum(o for _, o in pairs) / n)
        out = []
        for p, o in pairs:
            prompt = max(4, min(SHAREGPT_MAX_PROMPT, round(p * scale_in)))
            out.append((prompt, max(4, min(SHAREGPT_MAX_TOTAL - prompt, round(o * scale_out)))))
        return out


@dataclass(frozen=True)
class PublishedPoint:
    """One published run, rebuilt. `measured`: the figures the source gives (ms, tok/s); `assumed`: what the source
    does not say and what stands in for it."""

    id: str
    source: str  # the group a leave-one-source-out validation leaves out whole
    cite: str
    model: str
    accelerator: str
    cards: int
    engine: str  # ENGINE_PROFILES key
    lengths: Lengths
    num_requests: int
    measured: dict[str, float]
    max_batch: int
    max_prefill_tokens: int
    max_prefill_batch: int | None = None  # MindIE's; vLLM has none (the batch limit)
    concurrency: int | None = None  # closed loop; None: open loop at `rate`
    rate: float = math.inf
    quantization: str | None = None  # FORMAT:METHOD
    memory_fraction: float = 0.9  # vLLM's gpu_memory_utilization default; GPUStack's MindIE: 0.8
    select_batch: bool = True
    assumed: str = ""
    extra_schedule: dict[str, Any] = field(default_factory=dict)

    @property
    def chunked(self) -> bool:
        return self.engine in CHUNKING_ENGINES

    def label(self) -> str:
        load = "inf" if math.isinf(self.rate) else f"{self.rate:g} QPS"
        if self.concurrency:
            load = f"c{self.concurrency}"
        return f"{self.id} {self.model} {self.cards}x{self.accelerator} {self.engine} {load}"


def _sharegpt(total_in: int, total_out: int, n: int) -> Lengths:
    return Lengths("sharegpt", total_in / n, total_out / n)


GS = "gpustack/gpustack docs/performance-lab"
AIC = "ai-dynamo/aiconfigurator silicon_sample.csv (HEAD 095f58a)"
B_910 = "the 910B variant is not stated: ascend-910b3 (the 64 GB part most runs name) assumed"
VLLM_910B_DEFAULTS = "vLLM's defaults on a card under 70 GiB: max_num_seqs 256, max_num_batched_tokens 2048"
MINDIE_STREAM = ("TTFT and ITL left out, throughput kept: by Little's law 1000 requests through 200 slots at the "
                 "measured throughput wait tens of seconds on average (TTFT 8 s is below that floor), and an ITL of "
                 "150 ms at 200 running sequences is half the measured throughput: MindIE's stream is not one token "
                 "per chunk here")
VLLM_ASCEND_09 = ("prompts prefilled whole, prefill first (vLLM-Ascend 0.9's Ascend scheduler), not chunked: a "
                  "2048-token chunk of Qwen3-8B is 33.6 TFLOP, >= 114 ms at the datasheet's 294.9 TFLOPS, more than "
                  "the 99 ms TPOT measured at 4000-token prompts")
AIC_STAGGER = ("users out of step (outputs +-25% around the stated length): equal lengths started together keep "
               "every user's prompt in one wave, and 8 x 1024 tokens of Qwen3-32B on 2 H100s is >= 272 ms at the "
               "datasheet's 989 TFLOPS, above the 154 ms TTFT measured")
VLLM_H100_DEFAULTS = "vLLM's defaults on a card of 70 GiB or more: max_num_seqs 1024, max_num_batched_tokens 8192"

PUBLISHED_POINTS: tuple[PublishedPoint, ...] = (
    # --- GPUStack, Qwen3-8B on one 910B (vLLM-Ascend 0.9.1 defaults; MindIE 2.1RC1 at GPUStack's 200 / 50) ---------
    PublishedPoint("A1", "gpustack-910b", f"{GS}/qwen3-8b/910b.md s1", "qwen3-8b", "ascend-910b3", 1, "vllm-ascend",
                   _sharegpt(217_393, 201_469, 1000), 1000,
                   {"ttft_ms": 43963, "tpot_ms": 125.09, "itl_ms": 112.9, "output_tok_s": 1512.2},
                   max_batch=256, max_prefill_tokens=40960,
                   select_batch=False, assumed=f"{B_910}; {VLLM_910B_DEFAULTS}; {VLLM_ASCEND_09}"),
    PublishedPoint("A2", "gpustack-910b", f"{GS}/qwen3-8b/910b.md s1", "qwen3-8b", "ascend-910b3", 1, "mindie",
                   _sharegpt(217_393, 201_469, 1000), 1000,
                   {"output_tok_s": 2711.1},
                   max_batch=200, max_prefill_tokens=8192, max_prefill_batch=50, memory_fraction=0.8,
                   select_batch=False,
                   assumed=f"{B_910}; maxPrefillTokens 8192, supportSelectBatch false (MindIE's defaults); "
                           f"{MINDIE_STREAM}"),
    PublishedPoint("A3", "gpustack-910b", f"{GS}/qwen3-8b/910b.md s2", "qwen3-8b", "ascend-910b3", 1, "mindie",
                   _sharegpt(217_393, 201_469, 1000), 1000,
                   {"output_tok_s": 2903.9},
                   max_batch=200, max_prefill_tokens=8192, max_prefill_batch=50, memory_fraction=0.8,
                   select_batch=False, quantization="msmodelslim:w8a8",
                   assumed=f"{B_910}; msModelSlim W8A8 (static) assumed; MindIE's defaults as A2; {MINDIE_STREAM}"),
    PublishedPoint("A6", "gpustack-910b", f"{GS}/qwen3-8b/910b.md random 32K", "qwen3-8b", "ascend-910b3", 1,
                   "vllm-ascend", Lengths("fixed", 32000, 100), 100,
                   {"ttft_ms": 559_550, "tpot_ms": 344.2, "output_tok_s": 9.01},
                   max_batch=256, max_prefill_tokens=40960,
                   select_batch=False, assumed=f"{B_910}; {VLLM_910B_DEFAULTS}; {VLLM_ASCEND_09}; KV-starved"),
    PublishedPoint("A7", "gpustack-910b", f"{GS}/qwen3-8b/910b.md random 4K", "qwen3-8b", "ascend-910b3", 1,
                   "vllm-ascend", Lengths("fixed", 4000, 200), 500,
                   {"ttft_ms": 132_541, "tpot_ms": 99.26, "output_tok_s": 365.4},
                   max_batch=256, max_prefill_tokens=40960,
                   select_batch=False, assumed=f"{B_910}; {VLLM_910B_DEFAULTS}; {VLLM_ASCEND_09}"),
    PublishedPoint("A8", "gpustack-910b", f"{GS}/qwen3-8b/910b.md random 2K", "qwen3-8b", "ascend-910b3", 1,
                   "vllm-ascend", Lengths("fixed", 2000, 100), 500,
                   {"ttft_ms": 53_979, "tpot_ms": 140.4, "output_tok_s": 457.5},
                   max_batch=256, max_prefill_tokens=40960,
                   select_batch=False, assumed=f"{B_910}; {VLLM_910B_DEFAULTS}; {VLLM_ASCEND_09}"),
    PublishedPoint("A9", "gpustack-910b", f"{GS}/qwen3-8b/910b.md random 128", "qwen3-8b", "ascend-910b3", 1,
                   "vllm-ascend", Lengths("fixed", 128, 4), 1000,
                   {"ttft_ms": 18_464, "tpot_ms": 125.6, "output_tok_s": 177.1},
                   max_batch=256, max_prefill_tokens=40960,
                   select_batch=False, assumed=f"{B_910}; {VLLM_910B_DEFAULTS}; {VLLM_ASCEND_09}"),
    # --- vLLM-Ascend's own issues and CI (Qwen3-32B over 4 cards, Qwen3-8B over 2) --------------------------------
    PublishedPoint("A16", "vllm-ascend", "vllm-project/vllm-ascend issue #1605", "qwen3-32b", "ascend-910b3", 4,
                   "vllm-ascend", _sharegpt(43_560, 44_697, 200), 200,
                   {"ttft_ms": 297.7, "tpot_ms": 131.0, "itl_ms": 129.4, "output_tok_s": 170.3},
                   max_batch=256, max_prefill_tokens=40960, select_batch=False, rate=1.0,
                   assumed=f"{B_910}; TP4 and version (~0.9) inferred by the dataset; {VLLM_910B_DEFAULTS}; "
                           f"{VLLM_ASCEND_09}"),
    PublishedPoint("A17", "vllm-ascend", "vllm-project/vllm-ascend issue #1605", "qwen3-32b", "ascend-910b3", 4,
                   "vllm-ascend", _sharegpt(43_560, 44_697, 200), 200, {"output_tok_s": 333.0},
                   max_batch=256, max_prefill_tokens=40960, select_batch=False, rate=4.0, assumed="as A16"),
    PublishedPoint("A18", "vllm-ascend",
                   "vllm-ascend tests/e2e/nightly/single_node/models/configs/Qwen3-32B-Int8-A2.yaml", "qwen3-32b",
                   "ascend-910b3", 4, "vllm-ascend-graph", Lengths("fixed", 3500, 1500), 288,
                   {"output_tok_s": 1065.2}, max_batch=256, max_prefill_tokens=40960, concurrency=72,
                   quantization="msmodelslim:w8a8",
                   assumed=f"{B_910}; every answer runs to its 1500-token cap (AISBench perf runs ignore EOS); "
                           "msModelSlim W8A8 (static); max_num_seqs 256"),
    PublishedPoint("A21", "vllm-ascend", "vllm-project/vllm-ascend issue #4448", "qwen3-8b", "ascend-910b3", 2,
                   "vllm-ascend-graph", Lengths("fixed", 128, 256), 4, {"tpot_ms": 18.5},
                   max_batch=256, max_prefill_tokens=2048, concurrency=1,
                   assumed="prompt 128 and answer 256 tokens (not stated)"),
    PublishedPoint("A22", "vllm-ascend", "vllm-project/vllm-ascend issue #4656", "qwen3-32b", "ascend-910b3", 4,
                   "vllm-ascend-graph", Lengths("fixed", 15_000, 256), 4, {"tpot_ms": 38.0},
                   max_batch=16, max_prefill_tokens=8192, concurrency=1,
                   assumed=f"{B_910}; answer 256 tokens (not stated)"),
    # --- GPUStack, vLLM 0.11.0 on one H100 ---------------------------------------------------------------------------
    PublishedPoint("N5", "gpustack-h100", f"{GS}/qwen3-14b/h100.md s1", "qwen3-14b", "nvidia-h100-80gb", 1, "vllm",
                   _sharegpt(217_393, 201_648, 1000), 1000,
                   {"ttft_ms": 22_141, "tpot_ms": 226.0, "output_tok_s": 3173.9},
                   max_batch=1024, max_prefill_tokens=8192, assumed=VLLM_H100_DEFAULTS),
    PublishedPoint("N6", "gpustack-h100", f"{GS}/qwen3-14b/h100.md random 4K", "qwen3-14b", "nvidia-h100-80gb", 1,
                   "vllm", Lengths("fixed", 4000, 200), 500,
                   {"ttft_ms": 112_717, "tpot_ms": 132.5, "output_tok_s": 438.6},
                   max_batch=1024, max_prefill_tokens=8192, assumed=VLLM_H100_DEFAULTS),
    PublishedPoint("N7", "gpustack-h100", f"{GS}/qwen3-32b/h100.md s1", "qwen3-32b", "nvidia-h100-80gb", 1, "vllm",
                   _sharegpt(217_393, 201_422, 1000), 1000,
                   {"ttft_ms": 78_119, "tpot_ms": 88.09, "output_tok_s": 1131.6},
                   max_batch=1024, max_prefill_tokens=8192, assumed=f"{VLLM_H100_DEFAULTS}; KV-starved"),
    PublishedPoint("N8", "gpustack-h100", f"{GS}/qwen3-32b/h100.md random 4K", "qwen3-32b", "nvidia-h100-80gb", 1,
                   "vllm", Lengths("fixed", 4000, 200), 500,
                   {"ttft_ms": 482_284, "tpot_ms": 66.61, "output_tok_s": 102.2},
                   max_batch=1024, max_prefill_tokens=8192, assumed=f"{VLLM_H100_DEFAULTS}; KV-starved"),
    # --- AIConfigurator's measured vLLM 0.12.0 rows, Qwen3-32B on H100 SXM -------------------------------------------
    *(PublishedPoint(pid, "aiconfigurator", AIC, "qwen3-32b", "nvidia-h100-80gb", tp, "vllm",
                     Lengths("fixed", isl, osl, output_jitter=0.25), max(6 * c, 48), {"ttft_ms": ttft, "tpot_ms": tpot},
                     max_batch=1024, max_prefill_tokens=8192, concurrency=c,
                     assumed=f"{VLLM_H100_DEFAULTS}; {max(6 * c, 48)} requests (not stated); {AIC_STAGGER}")
      for pid, tp, isl, osl, c, ttft, tpot in (
          ("N9", 2, 1024, 1024, 8, 154.3, 15.90), ("N10", 2, 1024, 1024, 64, 380.7, 26.09),
          ("N11", 2, 4096, 1024, 64, 4375.8, 52.57), ("N12", 2, 4096, 1024, 128, 58_752.6, 55.20),
          ("N13", 4, 1024, 1024, 8, 129.8, 10.60), ("N14", 4, 4096, 1024, 128, 1354.7, 46.41),
          ("N15", 8, 1024, 1024, 128, 313.6, 19.28), ("N16", 8, 4096, 512, 32, 471.9, 15.33))),
)


def kv_blocks(point: PublishedPoint, block_size: int = 128) -> int:
    """The planner's KV budget for the point's card, cards, model and memory fraction (never a fitted count)."""
    data: dict[str, Any] = {
        "model": {"name": point.model, "preset": point.model, "weights": {"loadFormat": "dummy"}},
        "accelerator": {"type": point.accelerator, "cards": point.cards, "memoryFraction": point.memory_fraction},
        "workload": {"avgInputTokens": max(1, round(point.lengths.input)),
                     "avgOutputTokens": max(1, round(point.lengths.output)),
                     "maxInputTokens": max(SHAREGPT_MAX_PROMPT, round(point.lengths.input)),
                     "maxOutputTokens": max(SHAREGPT_MAX_TOTAL, round(point.lengths.output))},
        "engine": {"schedule": {"cacheBlockSize": block_size}},
    }
    if point.quantization:
        data["model"]["quantization"] = parse_quantization(point.quantization).model_dump()
    return plan(InferenceServiceSpec.model_validate(data)).totalBlocks


def point_config(point: PublishedPoint, params: CostParams, hardware: Hardware | None = None,
                 blocks: int | None = None) -> SimulationConfig:
    max_in = max(SHAREGPT_MAX_PROMPT, round(point.lengths.input))
    max_out = max(SHAREGPT_MAX_TOTAL, round(point.lengths.output))
    model = get_model_preset(point.model)
    if point.quantization:
        model = model.model_copy(update={"quantization": parse_quantization(point.quantization).scheme()})
    schedule: dict[str, Any] = {
        "maxBatchSize": point.max_batch,
        "maxPrefillBatchSize": point.max_prefill_batch or point.max_batch,
        "maxPrefillTokens": max(point.max_prefill_tokens, max_in) if not point.chunked else point.max_prefill_tokens,
        "supportSelectBatch": point.select_batch, "maxIterTimes": max_out, **point.extra_schedule,
    }
    engine = MindIEConfig.from_dict({
        "BackendConfig": {
            "ModelDeployConfig": {"maxSeqLen": max_in + max_out, "maxInputTokenLen": max_in,
                                  "ModelConfig": [{"modelName": point.model, "modelWeightPath": point.model,
                                                   "worldSize": point.cards, "npuMemSize": 1, "cpuMemSize": 0}]},
            "ScheduleConfig": schedule,
        },
        "npuserve": {"chunkedPrefill": point.chunked, "enablePrefixCaching": False},
    })
    load = LoadConfig(num_prompts=point.num_requests, max_concurrency=point.concurrency, request_rate=point.rate,
                      seed=0)
    return SimulationConfig(engine=engine, model=model, accelerator=point.accelerator, bench=BenchConfig(load=load),
                            num_kv_blocks=blocks or kv_blocks(point), num_host_blocks=0, cost=params,
                            hardware=hardware, keep_steps=False)


def point_requests(point: PublishedPoint) -> list[SimRequest]:
    return [SimRequest(p, o, o) for p, o in point.lengths.draw(point.num_requests, seed=0)]


def run_published(point: PublishedPoint, params: CostParams | None = None, hardware: Hardware | None = None,
                  blocks: int | None = None, requests: Sequence[SimRequest] | None = None) -> dict[str, float]:
    """The simulated figures of the point's measured metrics."""
    params = params or ENGINE_PROFILES[point.engine].params
    result = simulate(point_config(point, params, hardware, blocks), requests or point_requests(point))
    m = compute_metrics(result.bench.records, result.bench.duration_s)
    figures = {"ttft_ms": m.ttft_ms.mean, "tpot_ms": m.tpot_ms.mean, "itl_ms": m.itl_ms.mean,
               "output_tok_s": m.output_throughput}
    return {k: figures[k] for k in point.measured}
