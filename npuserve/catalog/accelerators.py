"""Built-in accelerator catalog: memory, the memory a card holds at idle, peak compute and bandwidth.

Rules: every number names its source in a comment; a number that has no published source is None, never a
guess. Huawei publishes no per-card FLOP/s or bandwidth for the 910B variants (third-party figures disagree), so
those stay None; the planner needs only memory, and the simulated runner takes its own calibration.
"""

from __future__ import annotations

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
    npu_device_type: str = Field(default="cpu", description="engine backend that drives it: npu, cuda or cpu")

    @property
    def memory_gib(self) -> float | None:
        return None if self.memory_bytes is None else self.memory_bytes / GIB


def _ascend_910b(name: str, hbm_gib: int, idle_gib: float | None) -> Accelerator:
    return Accelerator(
        name=name,
        vendor="huawei",
        memory_bytes=hbm_gib * GIB,
        idle_memory_bytes=None if idle_gib is None else int(idle_gib * GIB),
        # Ascend device plugin (MindCluster): one card = huawei.com/Ascend910; Atlas 800I/800T A2 hold 8 cards.
        resource_name="huawei.com/Ascend910",
        cards_per_node=8,
        npu_device_type="npu",
    )


ACCELERATORS: dict[str, Accelerator] = {
    # HBM sizes as `npu-smi info` reports them (65536 MB on 910B1/B2/B3, 32768 MB on 910B4).
    # Idle memory: the MindIE tuning guide measured about 3.4 GB held at idle on a 64 GB 910B3, and uses 3 GB in
    # its worked example on 32 GB cards (910B4).
    "ascend-910b1": _ascend_910b("ascend-910b1", 64, None),
    "ascend-910b2": _ascend_910b("ascend-910b2", 64, None),
    "ascend-910b3": _ascend_910b("ascend-910b3", 64, 3.4),
    "ascend-910b4": _ascend_910b("ascend-910b4", 32, 3.0),
    # Huawei Atlas 300I Duo datasheet: 96 GB LPDDR4X at 408 GB/s, 140 TFLOPS FP16 (two 310P chips per card).
    # Atlas 800 inference server (model 3000) takes up to 8 such cards.
    "atlas-300i-duo": Accelerator(
        name="atlas-300i-duo", vendor="huawei", memory_bytes=96 * GIB, resource_name="huawei.com/Ascend310P",
        cards_per_node=8, peak_tflops_16bit=140.0, memory_bandwidth_gbps=408.0, npu_device_type="npu",
    ),
    # NVIDIA A100 datasheet: 312 TFLOPS dense BF16; 40 GB at 1555 GB/s, 80 GB SXM at 2039 GB/s. HGX: 8 per node.
    "nvidia-a100-40gb": Accelerator(
        name="nvidia-a100-40gb", vendor="nvidia", memory_bytes=40 * GIB, resource_name="nvidia.com/gpu",
        cards_per_node=8, peak_tflops_16bit=312.0, memory_bandwidth_gbps=1555.0, npu_device_type="cuda",
    ),
    "nvidia-a100-80gb": Accelerator(
        name="nvidia-a100-80gb", vendor="nvidia", memory_bytes=80 * GIB, resource_name="nvidia.com/gpu",
        cards_per_node=8, peak_tflops_16bit=312.0, memory_bandwidth_gbps=2039.0, npu_device_type="cuda",
    ),
    # NVIDIA H100 datasheet (SXM): 989 TFLOPS dense BF16 (1979 with sparsity), 80 GB HBM3 at 3.35 TB/s.
    "nvidia-h100-80gb": Accelerator(
        name="nvidia-h100-80gb", vendor="nvidia", memory_bytes=80 * GIB, resource_name="nvidia.com/gpu",
        cards_per_node=8, peak_tflops_16bit=989.0, memory_bandwidth_gbps=3350.0, npu_device_type="cuda",
    ),
    # NVIDIA H200 datasheet (SXM): 141 GB HBM3e at 4.8 TB/s, 989 TFLOPS dense BF16.
    "nvidia-h200": Accelerator(
        name="nvidia-h200", vendor="nvidia", memory_bytes=141 * GB, resource_name="nvidia.com/gpu",
        cards_per_node=8, peak_tflops_16bit=989.0, memory_bandwidth_gbps=4800.0, npu_device_type="cuda",
    ),
    # NVIDIA L40S datasheet: 48 GB GDDR6 at 864 GB/s, 362 TFLOPS dense BF16 (733 with sparsity).
    "nvidia-l40s": Accelerator(
        name="nvidia-l40s", vendor="nvidia", memory_bytes=48 * GIB, resource_name="nvidia.com/gpu",
        cards_per_node=None, peak_tflops_16bit=362.0, memory_bandwidth_gbps=864.0, npu_device_type="cuda",
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
