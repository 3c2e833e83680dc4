"""Built-in accelerator catalog: memory, the memory a card holds at idle, peak compute and bandwidth.

Rules: every number names its source in a comment; a number that has no published source is None, never a
guess. Huawei publishes no per-card FLOP/s or bandwidth for the 910B variants (third-party figures disagree), so
those stay None; the planner needs only memory. The simulated runner (`npuserve.sim`) needs bandwidth
and compute for every card it simulates: where no figure is published it takes the `fitted_*` fields, values fitted
by `benchmarks/simulator_calibration.py` to the MindIE tuning guide's measurements and named as fitted wherever they
are shown (`simulation_figures().source`). A fitted value is never copied into a published-figure field.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

GIB = 1024**3
GB = 1000**3


class Accelerator(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    vendor: str
    memory_bytes: int | None = Field(description="device memory per card; None for the host CPU")
    idle_memory_bytes: int | None = Field(
        default=None, description="memory a card holds with nothing loaded (driver, runtime, communication buffers)"
    )
    resource_name: str | None = Field(description="Kubernetes extended resource that schedules one card")
    cards_per_node: int | None = None
    peak_tflops_16bit: float | None = Field(default=None, description="dense bf16/fp16 TFLOP/s")
    memory_bandwidth_gbps: float | None = Field(default=None, description="GB/s")
    interconnect_gbps: float | None = Field(default=None, description="card-to-card bandwidth, GB/s per direction")
    npu_device_type: str = Field(default="cpu", description="engine backend that drives it: npu, cuda or cpu")
    # Fitted, not published: used by the simulator only where the published field above is None.
    fitted_tflops_16bit: float | None = Field(default=None, description="fitted dense 16-bit TFLOP/s (simulator)")
    fitted_memory_bandwidth_gbps: float | None = Field(default=None, description="fitted GB/s (simulator)")
    fitted_interconnect_gbps: float | None = Field(default=None, description="fitted GB/s per direction (simulator)")

    def simulation_figures(self) -> SimulationFigures | None:
        """The figures the simulator runs this card with: the published ones where they exist, else the fitted
        ones (source "fitted" when any figure is); None when a figure is neither published nor fitted."""
        tflops = self.peak_tflops_16bit or self.fitted_tflops_16bit
        bandwidth = self.memory_bandwidth_gbps or self.fitted_memory_bandwidth_gbps
        link = self.interconnect_gbps or self.fitted_interconnect_gbps
        if tflops is None or bandwidth is None or link is None:
            return None
        published = (self.peak_tflops_16bit is not None and self.memory_bandwidth_gbps is not None
                     and self.interconnect_gbps is not None)
        return SimulationFigures(tflops_16bit=tflops, memory_bandwidth_gbps=bandwidth, interconnect_gbps=link,
                                 source="datasheet" if published else "fitted")


class SimulationFigures(BaseModel):
    model_config = ConfigDict(frozen=True)

    tflops_16bit: float
    memory_bandwidth_gbps: float
    interconnect_gbps: float
    source: Literal["datasheet", "fitted"]


def _ascend_910b(name: str, hbm_gib: int, idle_gib: float | None, tflops: float, bandwidth: float) -> Accelerator:
    return Accelerator(
        name=name,
        vendor="huawei",
        memory_bytes=hbm_gib * GIB,
        idle_memory_bytes=None if idle_gib is None else int(idle_gib * GIB),
        # Ascend device plugin (MindCluster): one card = huawei.com/Ascend910; Atlas 800I/800T A2 hold 8 cards.
        resource_name="huawei.com/Ascend910",
        cards_per_node=8,
        npu_device_type="npu",
        fitted_tflops_16bit=tflops,
        fitted_memory_bandwidth_gbps=bandwidth,
        fitted_interconnect_gbps=FITTED_910B_HCCS_GBPS,
    )


# FITTED, not published (see the module docstring). Third-party figures for "the 910B" disagree and rarely name the
# variant: 256-414 TFLOPS FP16, 0.4-1.6 TB/s (64 GB parts usually cited at 1.6 TB/s, 32 GB parts at 0.8-1.2 TB/s),
# HCCS 392 GB/s per card (56 GB/s x 7 links, both directions). The 910B4's two figures are fitted by
# benchmarks/simulator_calibration.py to the MindIE tuning guide's LLaMA3-8B measurements on 2 x 910B4 (the only
# published measurements): 1108 GB/s and 220 TFLOPS, peak-equivalent (the simulator applies its achieved fractions,
# 0.85 and 0.6, on top). The 64 GB variants have no measurements, so they take the 910B4's fit scaled by the ratios of
# the most often cited per-variant figures (FP16 414 / 376 / 313 / 280 TFLOPS for B1 / B2 / B3 / B4; 1.6 TB/s for the
# 64 GB parts against 1.2 TB/s for the 32 GB one). HCCS: half the cited 392 GB/s, per direction; only the
# all-reduce's bytes term uses it (its latency is a cost-model parameter).
FITTED_910B4_TFLOPS = 220.0
FITTED_910B4_BANDWIDTH_GBPS = 1108.0
FITTED_910B_HCCS_GBPS = 196.0
_CITED_TFLOPS = {"ascend-910b1": 414.0, "ascend-910b2": 376.0, "ascend-910b3": 313.0, "ascend-910b4": 280.0}
_CITED_BANDWIDTH = {"ascend-910b1": 1600.0, "ascend-910b2": 1600.0, "ascend-910b3": 1600.0, "ascend-910b4": 1200.0}


def _fitted_910b(name: str, hbm_gib: int, idle_gib: float | None) -> Accelerator:
    tflops = FITTED_910B4_TFLOPS * _CITED_TFLOPS[name] / _CITED_TFLOPS["ascend-910b4"]
    bandwidth = FITTED_910B4_BANDWIDTH_GBPS * _CITED_BANDWIDTH[name] / _CITED_BANDWIDTH["ascend-910b4"]
    return _ascend_910b(name, hbm_gib, idle_gib, round(tflops, 1), round(bandwidth, 1))


ACCELERATORS: dict[str, Accelerator] = {
    # HBM sizes as `npu-smi info` reports them (65536 MB on 910B1/B2/B3, 32768 MB on 910B4).
    # Idle memory: the MindIE tuning guide measured about 3.4 GB held at idle on a 64 GB 910B3, and uses 3 GB in
    # its worked example on 32 GB cards (910B4). Compute and bandwidth: fitted, see above.
    "ascend-910b1": _fitted_910b("ascend-910b1", 64, None),
    "ascend-910b2": _fitted_910b("ascend-910b2", 64, None),
    "ascend-910b3": _fitted_910b("ascend-910b3", 64, 3.4),
    "ascend-910b4": _fitted_910b("ascend-910b4", 32, 3.0),
    # Huawei Atlas 300I Duo datasheet: 96 GB LPDDR4X at 408 GB/s, 140 TFLOPS FP16 (two 310P chips per card),
    # PCIe 4.0 x16 (about 32 GB/s per direction by the PCIe 4.0 spec). Atlas 800 inference server (model 3000)
    # takes up to 8 such cards.
    "atlas-300i-duo": Accelerator(
        name="atlas-300i-duo", vendor="huawei", memory_bytes=96 * GIB, resource_name="huawei.com/Ascend310P",
        cards_per_node=8, peak_tflops_16bit=140.0, memory_bandwidth_gbps=408.0, interconnect_gbps=32.0,
        npu_device_type="npu",
    ),
    # NVIDIA A100 datasheet: 312 TFLOPS dense BF16; 40 GB at 1555 GB/s, 80 GB SXM at 2039 GB/s; NVLink 600 GB/s
    # (both directions: 300 per direction). HGX: 8 per node.
    "nvidia-a100-40gb": Accelerator(
        name="nvidia-a100-40gb", vendor="nvidia", memory_bytes=40 * GIB, resource_name="nvidia.com/gpu",
        cards_per_node=8, peak_tflops_16bit=312.0, memory_bandwidth_gbps=1555.0, interconnect_gbps=300.0,
        npu_device_type="cuda",
    ),
    "nvidia-a100-80gb": Accelerator(
        name="nvidia-a100-80gb", vendor="nvidia", memory_bytes=80 * GIB, resource_name="nvidia.com/gpu",
        cards_per_node=8, peak_tflops_16bit=312.0, memory_bandwidth_gbps=2039.0, interconnect_gbps=300.0,
        npu_device_type="cuda",
    ),
    # NVIDIA H100 datasheet (SXM): 989 TFLOPS dense BF16 (1979 with sparsity), 80 GB HBM3 at 3.35 TB/s, NVLink
    # 900 GB/s (450 per direction).
    "nvidia-h100-80gb": Accelerator(
        name="nvidia-h100-80gb", vendor="nvidia", memory_bytes=80 * GIB, resource_name="nvidia.com/gpu",
        cards_per_node=8, peak_tflops_16bit=989.0, memory_bandwidth_gbps=3350.0, interconnect_gbps=450.0,
        npu_device_type="cuda",
    ),
    # NVIDIA H200 datasheet (SXM): 141 GB HBM3e at 4.8 TB/s, 989 TFLOPS dense BF16, NVLink 900 GB/s (450 per
    # direction).
    "nvidia-h200": Accelerator(
        name="nvidia-h200", vendor="nvidia", memory_bytes=141 * GB, resource_name="nvidia.com/gpu",
        cards_per_node=8, peak_tflops_16bit=989.0, memory_bandwidth_gbps=4800.0, interconnect_gbps=450.0,
        npu_device_type="cuda",
    ),
    # NVIDIA L40S datasheet: 48 GB GDDR6 at 864 GB/s, 362 TFLOPS dense BF16 (733 with sparsity), PCIe Gen4 x16
    # 64 GB/s (both directions: 32 per direction).
    "nvidia-l40s": Accelerator(
        name="nvidia-l40s", vendor="nvidia", memory_bytes=48 * GIB, resource_name="nvidia.com/gpu",
        cards_per_node=None, peak_tflops_16bit=362.0, memory_bandwidth_gbps=864.0, interconnect_gbps=32.0,
        npu_device_type="cuda",
    ),
    # Development: the host CPU; memory is whatever the pod is given.
    "cpu": Accelerator(
        name="cpu", vendor="any", memory_bytes=None, idle_memory_bytes=0, resource_name=None, cards_per_node=None,
        npu_device_type="cpu",
    ),
}


def get_accelerator(name: str) -> Accelerator:
    try:
        return ACCELERATORS[name]
    except KeyError:
        raise KeyError(f"unknown accelerator {name!r}; known: {', '.join(sorted(ACCELERATORS))}") from None
