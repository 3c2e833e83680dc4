"""Built-in accelerator catalog: each card's datasheet figures with their source, and, apart from them, the achieved
fractions of those figures that the simulator fits (`EFFICIENCIES`), and each link kind's fitted all-reduce latency
(`LINK_LATENCIES`).

Rules: every datasheet number names its source (`Accelerator.source`, and a comment where it needs one); a number
with no citable source is None, never a guess. A new card is one entry: its datasheet figures and its family, whose
fitted efficiencies it takes (`efficiency_of`). The fitted efficiencies come from `benchmarks/simulator_calibration.py`
(docs/simulator.md#calibration) and are never copied into a datasheet field.

The 910B variants: Huawei publishes no per-card bandwidth or compute; the figures here are those of Huawei's own
performance model, Ascend/msmodeling (`tensor_cast/device.py`, HEAD 84fec85), by tier: A2_376T_64G, A2_313T_64G,
A2_280T_64G (1.6 TiB/s HBM, BF16 353.9 / 294.9 / 245.8 TFLOPS, HCCS full mesh 196 GB/s per direction) and
A2_280T_32G_PCIE (0.8 TiB/s, BF16 245.8 TFLOPS, PCIe 64 GB/s). No public source maps B1..B4 onto the tiers; the
mapping below follows the FP16 figures most often cited per variant (B2 376, B3 313, B4 280 TFLOPS; B4 the 32 GB
part) and B1 takes the highest tier (cited at 414 FP16 elsewhere, no tier that high): an assumption, said so in
`source`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

GIB = 1024**3
GB = 1000**3
TIB_PER_S_IN_GBPS = 1024**4 / 1e9  # msmodeling states HBM bandwidth in TiB/s

LinkKind = Literal["hccs", "nvlink", "pcie"]
Family = Literal["ascend-910b", "ascend-310p", "nvidia", "cpu"]


class Accelerator(BaseModel):
    """One card as its datasheet gives it. The simulator runs a card with its datasheet figures times its family's
    fitted efficiencies (`EFFICIENCIES`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    vendor: str
    family: Family = Field(description="the fitted efficiencies it takes (EFFICIENCIES)")
    memory_bytes: int | None = Field(description="device memory per card; None for the host CPU")
    idle_memory_bytes: int | None = Field(
        default=None, description="memory a card holds with nothing loaded (driver, runtime, communication buffers)"
    )
    resource_name: str | None = Field(description="Kubernetes extended resource that schedules one card")
    cards_per_node: int | None = None
    peak_tflops_16bit: float | None = Field(default=None, description="dense bf16 TFLOP/s (datasheet)")
    memory_bandwidth_gbps: float | None = Field(default=None, description="GB/s (datasheet)")
    link: LinkKind | None = Field(default=None, description="how cards of one node are joined: HCCS, NVLink or PCIe")
    interconnect_gbps: float | None = Field(default=None, description="card-to-card bandwidth, GB/s per direction")
    npu_device_type: str = Field(default="cpu", description="engine backend that drives it: npu, cuda or cpu")
    source: str = Field(default="", description="where the datasheet figures come from")

    def simulation_figures(self) -> SimulationFigures | None:
        """The datasheet figures the simulator runs this card with; None when one is missing (the host CPU: its
        figures come from a fit on this machine, `npuserve.sim.cpu_profile`)."""
        if self.peak_tflops_16bit is None or self.memory_bandwidth_gbps is None or self.interconnect_gbps is None:
            return None
        return SimulationFigures(tflops_16bit=self.peak_tflops_16bit, memory_bandwidth_gbps=self.memory_bandwidth_gbps,
                                 interconnect_gbps=self.interconnect_gbps, link=self.link or "pcie",
                                 source="datasheet")


class SimulationFigures(BaseModel):
    model_config = ConfigDict(frozen=True)

    tflops_16bit: float
    memory_bandwidth_gbps: float
    interconnect_gbps: float
    link: LinkKind
    source: Literal["datasheet", "fitted"]


class Efficiency(BaseModel):
    """A card family's achieved fractions of its datasheet figures, fitted (benchmarks/simulator_calibration.py),
    each bounded to what published kernels reach."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    bandwidth: float = Field(gt=0, le=1, description="achieved / datasheet memory bandwidth in a decode step")
    compute: float = Field(gt=0, le=1, description="achieved / datasheet 16-bit FLOP/s in a prefill (MFU)")
    link: float = Field(gt=0, le=1, description="achieved / datasheet link bandwidth in an all-reduce (bus bw)")
    source: str = Field(description="what it was fitted on")


# (low, high) of each achieved fraction, by what published kernels reach: memory-bound decode kernels 40-95% of
# datasheet bandwidth, prefill GEMMs 25-85% of peak, all-reduce bus bandwidth 30-90% of the link. The simulator's fit
# (npuserve.sim.fitting.BOUNDS) and the tuner's online model (npuserve.planning.engine_model) both keep to them.
EFFICIENCY_BOUNDS: dict[str, tuple[float, float]] = {"bandwidth": (0.4, 0.95), "compute": (0.25, 0.85),
                                                     "link": (0.3, 0.9)}

# Fitted by benchmarks/simulator_calibration.py --fit (docs/simulator.md#calibration), each within its bound
# (EFFICIENCY_BOUNDS).
EFFICIENCIES: dict[Family, Efficiency] = {
    "ascend-910b": Efficiency(bandwidth=0.95, compute=0.389, link=0.3,
                              source="fitted: MindIE guide, GPUStack and vLLM-Ascend runs (910B3, 910B4)"),
    "ascend-310p": Efficiency(bandwidth=0.95, compute=0.389, link=0.3,
                              source="no measurements: the 910B family's fitted values, assumed"),
    "nvidia": Efficiency(bandwidth=0.633, compute=0.303, link=0.9,
                         source="fitted: GPUStack and AIConfigurator vLLM runs on H100"),
    "cpu": Efficiency(bandwidth=1.0, compute=1.0, link=1.0,
                      source="the CPU's figures are fitted whole (npuserve.sim.cpu_profile): nothing to scale"),
}


def efficiency_of(accelerator: Accelerator) -> Efficiency:
    return EFFICIENCIES[accelerator.family]


class LinkLatency(BaseModel):
    """The fixed cost of one small-message all-reduce over a kind of link (the collective library's, not the
    engine's: the host's launch of it is in the engine's launches per layer), fitted per link kind
    (benchmarks/simulator_calibration.py) within `ALLREDUCE_LATENCY_US_BOUNDS`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    allreduce_us: float = Field(gt=0, description="microseconds per all-reduce, whatever its size")
    source: str = Field(description="what it was fitted on")


# (low, high) of one all-reduce's latency, the same for every link kind: from NCCL's small-message all-reduce over
# NVLink without graphs, 3.5 us (NVIDIA/nccl issue #1984: 1 KB on 4 x H800), up to 200 us, a PCIe all-reduce's.
ALLREDUCE_LATENCY_US_BOUNDS: tuple[float, float] = (3.5, 200.0)

# Fitted by benchmarks/simulator_calibration.py --fit (docs/simulator.md#calibration), each within the bounds.
LINK_LATENCIES: dict[LinkKind, LinkLatency] = {
    "hccs": LinkLatency(allreduce_us=80.0, source="fitted: vLLM-Ascend on 2 and 4 x 910B3 (#1605, #4448, #4656, "
                                                  "nightly CI; best of 20-200 us, flat from 80 to 120)"),
    "nvlink": LinkLatency(allreduce_us=3.5, source="fitted: AIConfigurator's vLLM runs on 2, 4 and 8 x H100 (at the "
                                                   "bound; 5 us scores within 0.2%)"),
    "pcie": LinkLatency(allreduce_us=200.0, source="fitted: the MindIE tuning guide (2 x 910B4; at the bound)"),
}


def allreduce_latency_us(link: LinkKind) -> float:
    return LINK_LATENCIES[link].allreduce_us


_MSMODELING = "Ascend/msmodeling tensor_cast/device.py (HEAD 84fec85), tier {tier}"
_HCCS_GBPS = 196.0  # msmodeling: HCCS full mesh, 196 GB/s per direction (the cited 392 GB/s both ways)


def _ascend_910b(name: str, hbm_gib: int, idle_gib: float | None, tier: str, tflops: float, tib_s: float,
                 link: LinkKind, link_gbps: float, mapping: str) -> Accelerator:
    return Accelerator(
        name=name,
        vendor="huawei",
        family="ascend-910b",
        memory_bytes=hbm_gib * GIB,
        idle_memory_bytes=None if idle_gib is None else int(idle_gib * GIB),
        # Ascend device plugin (MindCluster): one card = huawei.com/Ascend910; Atlas 800I/800T A2 hold 8 cards.
        resource_name="huawei.com/Ascend910",
        cards_per_node=8,
        npu_device_type="npu",
        peak_tflops_16bit=tflops,
        memory_bandwidth_gbps=round(tib_s * TIB_PER_S_IN_GBPS, 1),
        link=link,
        interconnect_gbps=link_gbps,
        source=f"{_MSMODELING.format(tier=tier)}; {mapping}",
    )


ACCELERATORS: dict[str, Accelerator] = {
    # HBM sizes as `npu-smi info` reports them (65536 MB on 910B1/B2/B3, 32768 MB on 910B4).
    # Idle memory: the MindIE tuning guide measured about 3.4 GB held at idle on a 64 GB 910B3, and uses 3 GB in
    # its worked example on 32 GB cards (910B4).
    "ascend-910b1": _ascend_910b("ascend-910b1", 64, None, "A2_376T_64G", 353.9, 1.6, "hccs", _HCCS_GBPS,
                                 "B1 -> the highest tier (assumed: no source maps variants to tiers)"),
    "ascend-910b2": _ascend_910b("ascend-910b2", 64, None, "A2_376T_64G", 353.9, 1.6, "hccs", _HCCS_GBPS,
                                 "B2 -> 376T (FP16 376 as cited for B2; the mapping is assumed)"),
    "ascend-910b3": _ascend_910b("ascend-910b3", 64, 3.4, "A2_313T_64G", 294.9, 1.6, "hccs", _HCCS_GBPS,
                                 "B3 -> 313T (FP16 313 as cited for B3; the mapping is assumed)"),
    "ascend-910b4": _ascend_910b("ascend-910b4", 32, 3.0, "A2_280T_32G_PCIE", 245.8, 0.8, "pcie", 64.0,
                                 "B4 -> the 32 GB tier (the only 32 GB one; it is the PCIe part)"),
    # Huawei Atlas 300I Duo datasheet: 96 GB LPDDR4X at 408 GB/s, 140 TFLOPS FP16 (two 310P chips per card),
    # PCIe 4.0 x16 (about 32 GB/s per direction by the PCIe 4.0 spec). Atlas 800 inference server (model 3000)
    # takes up to 8 such cards.
    "atlas-300i-duo": Accelerator(
        name="atlas-300i-duo", vendor="huawei", family="ascend-310p", memory_bytes=96 * GIB,
        resource_name="huawei.com/Ascend310P", cards_per_node=8, peak_tflops_16bit=140.0, memory_bandwidth_gbps=408.0,
        link="pcie", interconnect_gbps=32.0, npu_device_type="npu",
        source="Huawei Atlas 300I Duo datasheet (as cited by 3dnews.ru/1131049); PCIe 4.0 x16 by the PCIe spec",
    ),
    # NVIDIA A100 datasheet: 312 TFLOPS dense BF16; 40 GB at 1555 GB/s, 80 GB SXM at 2039 GB/s; NVLink 600 GB/s
    # (both directions: 300 per direction). HGX: 8 per node.
    "nvidia-a100-40gb": Accelerator(
        name="nvidia-a100-40gb", vendor="nvidia", family="nvidia",
        memory_bytes=40 * GIB, resource_name="nvidia.com/gpu",
        cards_per_node=8, peak_tflops_16bit=312.0, memory_bandwidth_gbps=1555.0, interconnect_gbps=300.0,
        link="nvlink",
        source="NVIDIA A100 datasheet", npu_device_type="cuda",
    ),
    "nvidia-a100-80gb": Accelerator(
        name="nvidia-a100-80gb", vendor="nvidia", family="nvidia",
        memory_bytes=80 * GIB, resource_name="nvidia.com/gpu",
        cards_per_node=8, peak_tflops_16bit=312.0, memory_bandwidth_gbps=2039.0, interconnect_gbps=300.0,
        link="nvlink",
        source="NVIDIA A100 datasheet (SXM 80 GB)", npu_device_type="cuda",
    ),
    # NVIDIA H100 datasheet (SXM): 989 TFLOPS dense BF16 (1979 with sparsity), 80 GB HBM3 at 3.35 TB/s, NVLink
    # 900 GB/s (450 per direction).
    "nvidia-h100-80gb": Accelerator(
        name="nvidia-h100-80gb", vendor="nvidia", family="nvidia",
        memory_bytes=80 * GIB, resource_name="nvidia.com/gpu",
        cards_per_node=8, peak_tflops_16bit=989.0, memory_bandwidth_gbps=3350.0, interconnect_gbps=450.0,
        link="nvlink",
        source="NVIDIA H100 datasheet (SXM); ai-dynamo/aiconfigurator systems/h100_sxm.yaml", npu_device_type="cuda",
    ),
    # NVIDIA H200 datasheet (SXM): 141 GB HBM3e at 4.8 TB/s, 989 TFLOPS dense BF16, NVLink 900 GB/s (450 per
    # direction).
    "nvidia-h200": Accelerator(
        name="nvidia-h200", vendor="nvidia", family="nvidia",
        memory_bytes=141 * GB, resource_name="nvidia.com/gpu",
        cards_per_node=8, peak_tflops_16bit=989.0, memory_bandwidth_gbps=4800.0, interconnect_gbps=450.0,
        link="nvlink",
        source="NVIDIA H200 datasheet (SXM); ai-dynamo/aiconfigurator systems/h200_sxm.yaml", npu_device_type="cuda",
    ),
    # NVIDIA L40S datasheet: 48 GB GDDR6 at 864 GB/s, 362 TFLOPS dense BF16 (733 with sparsity), PCIe Gen4 x16
    # 64 GB/s (both directions: 32 per direction).
    "nvidia-l40s": Accelerator(
        name="nvidia-l40s", vendor="nvidia", family="nvidia",
        memory_bytes=48 * GIB, resource_name="nvidia.com/gpu",
        cards_per_node=None, peak_tflops_16bit=362.0, memory_bandwidth_gbps=864.0, interconnect_gbps=32.0,
        link="pcie",
        source="NVIDIA L40S datasheet", npu_device_type="cuda",
    ),
    # Development: the host CPU; memory is whatever the pod is given.
    "cpu": Accelerator(
        name="cpu", vendor="any", family="cpu", memory_bytes=None, idle_memory_bytes=0, resource_name=None,
        cards_per_node=None,
        npu_device_type="cpu",
    ),
}


def get_accelerator(name: str) -> Accelerator:
    try:
        return ACCELERATORS[name]
    except KeyError:
        raise KeyError(f"unknown accelerator {name!r}; known: {', '.join(sorted(ACCELERATORS))}") from None
