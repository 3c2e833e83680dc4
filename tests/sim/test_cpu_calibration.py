"""The CPU engine as a calibration source (issue 32, docs/simulator.md "The CPU engine as a source"): the `cpu`
profile fitted on model A's steps on the real CPU engine predicts model B (1.5x the layers, 1.5x the width, another
GQA ratio) served by `npuserve serve` under a closed loop of 6 users and measured by this project's load generator.
Targets (the issue's, for a source left out of the fit): the median |error| of mean TTFT, mean TPOT and output tok/s
within 15%, each within 25%. Benchmark-style: a shared, noisy machine can make it fail (it measures once more before
it does); it asserts no wall time.
`pytest -s` prints the table."""

from __future__ import annotations

import pytest

from npuserve.sim.cost_model import LAUNCH_US_PER_LAYER_BOUND, PER_SEQ_HOST_MS_BOUND
from npuserve.sim.cpu_profile import cpu_hardware, weight_bytes
from npuserve.sim.cpu_validation import (
    CpuCalibration,
    cpu_report,
    cpu_source_rows,
    median_abs_error,
    predict,
    predicted_spec,
    run_cpu_calibration,
)

MEDIAN_TARGET = 0.15
EACH_TARGET = 0.25

pytestmark = [pytest.mark.slow, pytest.mark.wallclock]


@pytest.fixture(scope="module")
def calibration(tmp_path_factory: pytest.TempPathFactory) -> CpuCalibration:
    return run_cpu_calibration(tmp_path_factory.mktemp("cpu-calibration"))


def _report(calibration: CpuCalibration) -> None:
    print("\n" + cpu_report(calibration))


def test_the_fit_is_physical(calibration: CpuCalibration) -> None:
    """The fitted figures are the cost model's own: the bandwidth the memory curve measured at model A's weights, a
    positive compute rate, the host terms inside the bounds every engine profile keeps, and a fit that explains
    model A's own steps (median within 15%: one bandwidth for weights and KV and a roofline's max are what the
    CPU's kernels are fitted with)."""
    _report(calibration)
    profile = calibration.profile
    assert profile.hardware.source == "fitted" and profile.hardware.name == "cpu"
    assert profile.hardware.bandwidth_gbps == profile.memory.at(weight_bytes(profile.model)) > 0  # measured
    assert profile.hardware.tflops > 0
    assert 0 <= profile.params.launch_us_per_layer <= LAUNCH_US_PER_LAYER_BOUND
    assert 0 <= profile.params.per_seq_host_ms <= PER_SEQ_HOST_MS_BOUND
    assert profile.median_abs_error <= MEDIAN_TARGET


def _within_targets(calibration: CpuCalibration) -> bool:
    rows = calibration.rows
    return median_abs_error(rows) <= MEDIAN_TARGET and max(abs(r.error) for r in rows) <= EACH_TARGET


def test_model_b_is_predicted_within_the_targets(calibration: CpuCalibration,
                                                 tmp_path_factory: pytest.TempPathFactory) -> None:
    """One fresh measurement (fit and served run again) when the first misses: the 2 cores are shared, and a
    neighbour's burst slows the served run's several threads and processes more than the in-process fit. An error
    of the model (a wrong spec, a wrong term) misses both times; a burst rarely hits twice."""
    rows = calibration.rows
    assert [r.figure for r in rows] == ["TTFT mean (ms)", "TPOT mean (ms)", "output tok/s"]
    measured = calibration.served.result
    assert all(r.ok for r in measured.measured) and len(measured.measured) == calibration.load.num_prompts
    if not _within_targets(calibration):
        calibration = run_cpu_calibration(tmp_path_factory.mktemp("cpu-calibration-again"))
        print("\nthe first measurement missed the targets; measured again:")
        _report(calibration)
    rows = calibration.rows
    assert median_abs_error(rows) <= MEDIAN_TARGET, rows
    assert max(abs(r.error) for r in rows) <= EACH_TARGET, rows


def test_a_wrong_bandwidth_is_caught(calibration: CpuCalibration) -> None:
    """The comparison can fail: the same served run predicted with half the bandwidth carried to model B. Model B's
    decode steps read its 157 MB of weights in most of their time (memory-bound on any CPU: a few hundred KB of
    activations against them), so halving the bandwidth lengthens TPOT by well over the 25% target."""
    profile = calibration.profile
    model_b = profile.hardware_for(predicted_spec(profile))
    slow = cpu_hardware(model_b.bandwidth_gbps / 2, model_b.tflops)
    wrong = predict(calibration.served, profile, calibration.load, hardware=slow)
    rows = cpu_source_rows(calibration.served, wrong, calibration.load)
    assert max(abs(r.error) for r in rows) > EACH_TARGET
