"""npuMemSize -1 on a device (MindIE's behaviour): the free memory is measured after the weights are loaded and a
warm-up prefill of maxPrefillTokens tokens, and NPU_MEMORY_FRACTION of it becomes the KV blocks.

No accelerator is here: `RecordingDevice` is a CPU backend under another name (so the device path of the sizing
runs) that records what the runner did before each memory reading, and reports a fixed amount of free memory.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from npuserve.engine import rank_runner  # noqa: E402
from npuserve.engine.backends.base import AttentionMetadata, MemoryInfo  # noqa: E402
from npuserve.engine.backends.cpu import CPUBackend  # noqa: E402
from npuserve.mindie_config import EngineEnvironment, minimal_config  # noqa: E402

GiB = 1024**3
FREE = 3 * GiB
# One 128-token block of the tiny preset, written out: K and V x 2 layers x 2 KV heads x head_dim 32 x 4 bytes
# (float32) x 128 tokens = 128 KiB.
PER_BLOCK = 2 * 2 * 2 * 32 * 4 * 128


class RecordingDevice(CPUBackend):
    name = "recording-device"

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, int]] = []

    def memory_info(self) -> MemoryInfo:
        self.events.append(("memory_info", 0))
        return MemoryInfo(free_bytes=FREE, total_bytes=4 * FREE)

    def prefill_attention(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if not self.events or self.events[-1] != ("prefill", q.shape[0]):
            self.events.append(("prefill", q.shape[0]))  # once per forward pass, not per layer
        return super().prefill_attention(q, kv_cache, meta)


@pytest.mark.parametrize(("npu_mem_size", "expect_warmup"), [(-1, True), (1, False)])
def test_auto_sizing_measures_free_memory_after_a_warm_up_at_the_largest_prefill(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, npu_mem_size: int, expect_warmup: bool) -> None:
    device = RecordingDevice()
    monkeypatch.setattr(rank_runner, "get_backend", lambda *args: device)
    config = minimal_config(tiny_model_dir, max_seq_len=512, max_input_len=300, model={"npuMemSize": npu_mem_size},
                            maxPrefillTokens=300, maxBatchSize=4)
    built = rank_runner.build_rank_runner(config, tiny_model_dir, seed=0,
                                          env=EngineEnvironment(npu_memory_fraction=0.5))
    assert config.schedule.cacheBlockSize == 128
    if expect_warmup:
        assert device.events[:2] == [("prefill", 300), ("memory_info", 0)]  # the warm-up, then the reading
        assert built.kv_plan.num_blocks == int(FREE * 0.5) // PER_BLOCK  # no CPU cap on a device
        assert "auto: 0.50 of 3.0 GiB free" in built.kv_plan.source
    else:
        assert ("prefill", 300) not in device.events
        assert built.kv_plan.num_blocks == GiB // PER_BLOCK


class MeasuringDevice(RecordingDevice):
    """A device whose backend measures the warm-up's peak (as the npu backend does, having emptied its allocator's
    cache before reading free memory)."""

    name = "measuring-device"
    PEAK = GiB // 2

    def measure_peak(self, run: object) -> int:
        assert callable(run)
        run()
        self.events.append(("peak", self.PEAK))
        return self.PEAK


def test_auto_sizing_sets_the_measured_warm_up_peak_aside(tiny_model_dir: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    device = MeasuringDevice()
    monkeypatch.setattr(rank_runner, "get_backend", lambda *args: device)
    config = minimal_config(tiny_model_dir, max_seq_len=512, max_input_len=300, model={"npuMemSize": -1},
                            maxPrefillTokens=300, maxBatchSize=4)
    built = rank_runner.build_rank_runner(config, tiny_model_dir, seed=0,
                                          env=EngineEnvironment(npu_memory_fraction=0.5))
    assert config.schedule.cacheBlockSize == 128
    assert device.events[:3] == [("prefill", 300), ("peak", MeasuringDevice.PEAK), ("memory_info", 0)]
    assert built.kv_plan.num_blocks == (int(FREE * 0.5) - MeasuringDevice.PEAK) // PER_BLOCK
    assert "less the warm-up's 0.50 GiB peak" in built.kv_plan.source
