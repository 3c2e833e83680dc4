"""The CPU profile's memory curve (sim/cpu_memory.py): the bandwidth at a model's working set, for model A's fit and
for any model it predicts. Numbers written out; the served prediction is tests/sim/test_cpu_calibration.py's."""

from __future__ import annotations

import pytest

from npuserve.sim.cost_model import CostParams
from npuserve.sim.cpu_memory import MIB, MemoryCurve, MemoryProbe
from npuserve.sim.cpu_profile import PROFILE_MODEL, CpuProfile, cpu_hardware, model_spec, weight_bytes

# A host like one this project ran on: its shared L3 serves up to 64 MiB at 28 GB/s, DRAM 14 GB/s from 128 MiB.
CACHED_HOST = MemoryCurve((16 * MIB, 64 * MIB, 128 * MIB, 512 * MIB), (28.0, 28.0, 14.0, 14.0))


def test_the_curve_interpolates_in_log_size_and_holds_its_ends() -> None:
    assert CACHED_HOST.at(1 * MIB) == 28.0  # below the smallest size: the smallest's
    assert CACHED_HOST.at(4096 * MIB) == 14.0  # beyond the largest: the largest's (DRAM)
    assert CACHED_HOST.at(32 * MIB) == 28.0
    # A host whose caches hold neither model: flat.
    assert MemoryCurve((8 * MIB, 512 * MIB), (9.0, 9.0)).at(157e6) == 9.0
    # 64 -> 128 MiB is one doubling: sqrt(2) x 64 MiB is halfway in log size, so halfway from 28 to 14.
    assert CACHED_HOST.at(64 * MIB * 2**0.5) == pytest.approx(21.0)
    assert CACHED_HOST.at(256 * MIB) == 14.0


def test_the_profile_reads_each_model_at_its_own_working_set() -> None:
    model_a = model_spec(PROFILE_MODEL)
    model_b = model_spec({**PROFILE_MODEL, "num_layers": 6, "hidden_size": 768, "num_attention_heads": 12,
                          "intermediate_size": 2048})
    assert weight_bytes(model_a) < 64 * MIB < 128 * MIB < weight_bytes(model_b)
    profile = CpuProfile(cpu_hardware(28.0, 0.1), CostParams(), [], model_a, 1, CACHED_HOST)
    # model A (52 MB) inside the cache's 64 MiB, model B (157 MB) beyond 128 MiB: DRAM's rate
    assert profile.hardware_for(model_a).bandwidth_gbps == 28.0
    assert profile.hardware_for(model_b).bandwidth_gbps == 14.0
    assert profile.hardware_for(model_b).tflops == 0.1


@pytest.mark.parametrize(("sizes", "gbps"), [((), ()), ((2, 1), (1.0, 1.0)), ((1, 2), (1.0,)), ((1, 2), (1.0, 0.0))])
def test_a_malformed_curve_is_refused(sizes: tuple[int, ...], gbps: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="memory curve"):
        MemoryCurve(sizes, gbps)


def test_the_probe_measures_each_size_it_holds() -> None:
    probe = MemoryProbe(sizes_mib=(4, 8), rows=2)
    with pytest.raises(RuntimeError, match="measure"):
        probe.curve()
    probe.measure(passes_bytes=8 * MIB)
    probe.measure(passes_bytes=8 * MIB)
    curve = probe.curve()
    assert curve.sizes == (4 * MIB, 8 * MIB)
    assert all(g > 0 for g in curve.gbps) and all(len(s) == 2 for s in probe.samples)
