"""Each engine's host-side terms of the cost model (`CostParams`: kernel launches per layer, host work per sequence),
their bounds, and the fitted values per engine (`ENGINE_PROFILES`): catalog data, like the
cards' achieved fractions (`accelerators.EFFICIENCIES`). The simulator's cost model (`npuserve.sim.cost_model`,
docs/simulator.md) prices a step with them; the tuner's online model of an engine (`npuserve.planning.engine_model`)
starts from them as its prior. The fitted values come from `benchmarks/simulator_calibration.py --fit`
(docs/simulator.md#calibration) and may be refitted: nothing should hard-code today's numbers.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

# Bounds of the engine's host terms, each from a measurement (docs/simulator.md#the-terms-and-their-bounds):
# - launch: vllm-ascend issue #9404 (2 x 910B3, vLLM-Ascend 0.18.0rc1, eager decode) profiled 832 us per transformer
#   block of which 591 us was the device idle waiting for the host's launches; an engine with decode graphs launches
#   less. No engine here is allowed more than that measured eager figure per layer.
# - per-sequence host work (scheduling, input building, sampling, output): 1 ms per sequence per step bounds it
#   (this project's CPU engine measures well under it: benchmarks/scheduler_overhead.py).
# The all-reduce's fixed latency is the link's, not the engine's (accelerators.LINK_LATENCIES).
LAUNCH_US_PER_LAYER_BOUND = 591.0
PER_SEQ_HOST_MS_BOUND = 1.0


class CostParams(BaseModel):
    """An engine's host-side terms (fitted per engine: `ENGINE_PROFILES`), each bounded by a measurement. The card's
    achieved fractions of its datasheet figures are the catalog's (`Efficiency`), not these."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    launch_us_per_layer: float = Field(default=0.0, ge=0, le=LAUNCH_US_PER_LAYER_BOUND,
                                       description="per decoder layer per step: launches the device waits for "
                                                   "(overlapping nothing)")
    per_seq_host_ms: float = Field(default=0.0, ge=0, le=PER_SEQ_HOST_MS_BOUND,
                                   description="host work per sequence in a step (inputs, sampling, outputs), "
                                               "overlapped with the device")
    host_link_gbps: float = Field(default=25.0, gt=0, description="device <-> host copies (swap), GB/s; PCIe 4.0 "
                                                                  "x16 as an assumption, not a measurement")


class EngineProfile(BaseModel):
    """One engine's fitted host terms and what they were fitted on."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    params: CostParams
    source: str


# Fitted by benchmarks/simulator_calibration.py --fit (docs/simulator.md#calibration), within the bounds above.
ENGINE_PROFILES: dict[str, EngineProfile] = {
    "mindie": EngineProfile(params=CostParams(launch_us_per_layer=300.5, per_seq_host_ms=0.246),
                            source="fitted: MindIE tuning guide (2 x 910B4), GPUStack MindIE 2.1RC1 (910B)"),
    "vllm-ascend": EngineProfile(params=CostParams(launch_us_per_layer=591.0, per_seq_host_ms=0.3158),
                                 source="fitted: GPUStack vLLM-Ascend 0.9.1 (910B), vllm-ascend #1605 (4 x 910B)"),
    "vllm-ascend-graph": EngineProfile(params=CostParams(launch_us_per_layer=315.9, per_seq_host_ms=0.1),
                                       source="fitted: vLLM-Ascend with ACL graphs (nightly CI, #4448, #4656)"),
    "vllm": EngineProfile(params=CostParams(launch_us_per_layer=11.82, per_seq_host_ms=0.1419),
                          source="fitted: GPUStack vLLM 0.11 and AIConfigurator vLLM 0.12 runs on H100"),
}
DEFAULT_ENGINE = "mindie"  # what npuserve simulates by default: MindIE's scheduling on Ascend cards
FITTED_COST_PARAMS = ENGINE_PROFILES[DEFAULT_ENGINE].params
