"""The CPU engine as a calibration source (issue 32, docs/simulator.md "The CPU engine as a source"): the `cpu`
profile fitted on model A's steps on the real CPU engine predicts model B (1.5x the layers, 1.5x the width, another
GQA ratio) served by `npuserve serve` under a closed loop of 6 users and measured by this project's load generator.
Targets (the issue's, for a source left out of the fit): the median |error| of mean TTFT, mean TPOT and output tok/s
within 15%, each within 25%; model A's own steps (in sample) within a median of 20%. Benchmark-style: a shared, noisy
machine can make it fail (it measures once more before it does); it asserts no wall time.
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
# Model A's own steps: a bound on the fit, not the target. The decode rows are the model's known weak rows (one
# bandwidth and a roofline's max cannot follow the small-matrix kernels' rate falling with the rows,
# docs/simulator.md): CI's machine once put all 8 of them 15-63% low, and the median of the 16 rows at 16.1%. A wrong
# compute rate (the fit's x1.3 or /1.3) puts the prefill rows past it: 23-36% on that run and on one here.
IN_SAMPLE_TARGET = 0.20

pytestmark = [pytest.mark.slow, pytest.mark.wallclock]


def _within_targets(calibration: CpuCalibration) -> bool:
    rows = calibration.rows
    return (calibration.profile.median_abs_error <= IN_SAMPLE_TARGET and median_abs_error(rows) <= MEDIAN_TARGET
            and max(abs(r.error) for r in rows) <= EACH_TARGET)


@pytest.fixture(scope="module")
def calibration(tmp_path_factory: pytest.TempPathFactory) -> CpuCalibration:
    """One fresh measurement (fit and served run again) when the first misses a target: the 2 cores are shared, and
    a neighbour's burst slows the served run's several threads and processes more than the in-process fit. An error
    of the model (a wrong spec, a wrong term) misses both times; a burst rarely hits twice."""
    first = run_cpu_calibration(tmp_path_factory.mktemp("cpu-calibration"))
    if _within_targets(first):
        return first
    print("\nthe first measurement missed a target:\n" + cpu_report(first) + "\nmeasured again:")
    return run_cpu_calibration(tmp_path_factory.mktemp("cpu-calibration-again"))


def _report(calibration: CpuCalibration) -> None:
    print("\n" + cpu_report(calibration))


def test_the_fit_is_physical(calibration: CpuCalibration) -> None:
    """The fitted figures are the cost model's own: the bandwidth the memory curve measured at model A's weights, a
    positive compute rate, the host terms inside the bounds every engine profile keeps, and a fit that explains
    model A's own steps (median within IN_SAMPLE_TARGET: one bandwidth for weights and KV and a roofline's max are
    what the CPU's kernels are fitted with)."""
    _report(calibration)
    profile = calibration.profile
    assert profile.hardware.source == "fitted" and profile.hardware.name == "cpu"
    assert profile.hardware.bandwidth_gbps == profile.memory.at(weight_bytes(profile.model)) > 0  # measured
    assert profile.hardware.tflops > 0
    assert 0 <= profile.params.launch_us_per_layer <= LAUNCH_US_PER_LAYER_BOUND
    assert 0 <= profile.params.per_seq_host_ms <= PER_SEQ_HOST_MS_BOUND
    assert profile.median_abs_error <= IN_SAMPLE_TARGET


def test_model_b_is_predicted_within_the_targets(calibration: CpuCalibration) -> None:
    """Model B's served run, predicted from model A's fit (measured again once if the first missed: the fixture)."""
    rows = calibration.rows
    assert [r.figure for r in rows] == ["TTFT mean (ms)", "TPOT mean (ms)", "output tok/s"]
    measured = calibration.served.result
    assert all(r.ok for r in measured.measured) and len(measured.measured) == calibration.load.num_prompts
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
