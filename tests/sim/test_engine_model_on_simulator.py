"""Issue 33's target for the tuner's online model (planning/engine_model.py) on the simulator: after three windows
(the plan's start, x1.5, x2.25, as the tuner tries them), the next window's TPOT at another batch is predicted within
10% at +-10% noise; the adequacy test passes the simulator's engine at +-10% and +-20% and fails it with a knee.

The setup is the guide's (LLaMA3-8B on 2 x 910B4, GSM8K lengths, 1000 users: `_guide`), the noise that of the
tuner's noise table (`_noisy`: +-noise per figure and a +-3% jitter fixed per batch). The truth is the simulator's
noise-free TPOT. The tables are printed (`pytest -s`)."""

from __future__ import annotations

import math
import statistics

import pytest

from npuserve.catalog.accelerators import get_accelerator
from npuserve.catalog.models import get_model_preset
from npuserve.planning.engine_model import EngineShape, Window, adequate, calibrate, predict
from npuserve.sim import calibration as guide
from tests.sim.test_tuner_on_simulator import Setup, _guide, _noisy

pytestmark = pytest.mark.slow

SEEDS = 20
FIRST = (108, 162, 243)  # the guide plan's start, x1.5, x2.25
NEXT = (90, 136, 200, 272)  # the next window: below, inside, inside, the plan's top
# A tuner's windows after the first three: back into the bracket, then around the boundary.
LATER = (200, 136, 180, 150, 162, 120, 170)
_SETUP: list[Setup] = []


def _setup() -> Setup:
    if not _SETUP:
        _SETUP.append(_guide())
    return _SETUP[0]


def _shape() -> EngineShape:
    return EngineShape.of(get_model_preset(guide.MODEL), get_accelerator(guide.ACCELERATOR), guide.WORLD_SIZE,
                          guide.MEAN_INPUT, guide.MEAN_OUTPUT, engine=guide.ENGINE)


def _truth(batch: int) -> float:
    setup = _setup()
    return setup.cached(setup.problem.schedule_for(batch)).tpotMs.mean


def _windows(batches: tuple[int, ...], noise: float, seed: int, knee: tuple[int, float] | None = None
             ) -> list[Window]:
    """The noisy windows at `batches`, in that order (the last the newest); with `knee` (batch, factor), the
    engine's TPOT times the factor past that batch."""
    setup = _setup()
    measure = _noisy(setup, setup.problem, noise, seed)
    out = []
    for i, b in enumerate(batches):
        tpot = measure(setup.problem.schedule_for(b)).tpotMs.mean
        if knee and b > knee[0]:
            tpot *= knee[1]
        out.append(Window(b, tpot, len(batches) - 1 - i))
    return out


def test_three_windows_predict_the_next_within_ten_percent() -> None:
    """For each next batch, over 20 seeds: the prediction's error against the noise-free TPOT (median, max), and
    against the next window as measured (noisy). Required at every next batch: the median within the issue's 10%,
    and at least 16 of 20 seeds within it (three windows at +-10% leave a few seeds further out, above all when
    extrapolating: the noise, not the model's bias, which is a few percent noise-free)."""
    shape = _shape()
    noise = 0.10
    print(f"\nafter windows at {FIRST} (+-{noise:.0%}), the next window's TPOT, {SEEDS} seeds:")
    results = {}
    for batch in NEXT:
        truth = _truth(batch)
        errors, measured_errors = [], []
        for seed in range(SEEDS):
            cal = calibrate(shape, _windows(FIRST, noise, seed), noise / math.sqrt(3))
            predicted = predict(cal, batch)[0]
            errors.append(abs(predicted / truth - 1))
            measured = _windows((*FIRST, batch), noise, seed)[-1].tpot_ms
            measured_errors.append(abs(predicted / measured - 1))
        within = sum(e <= 0.10 for e in errors)
        print(f"  maxBatchSize {batch}: TPOT {truth:.1f} ms; error median {statistics.median(errors):.1%}, "
              f"max {max(errors):.1%}, within 10% in {within}/{SEEDS}; against the measured window median "
              f"{statistics.median(measured_errors):.1%}, max {max(measured_errors):.1%}")
        results[batch] = (statistics.median(errors), within)
    for median, within in results.values():
        assert median <= 0.10
        assert within >= 16


@pytest.mark.parametrize("noise", [0.10, 0.20])
def test_adequacy_passes_the_simulators_engine(noise: float) -> None:
    """The windows of a tuner's round (FIRST then LATER), judged after each from the third on: the false alarms
    over every judgement of 20 seeds at most 10%."""
    shape = _shape()
    batches = (*FIRST, *LATER)
    alarms = judged = 0
    for seed in range(SEEDS):
        windows = _windows(batches, noise, seed)
        for n in range(3, len(batches) + 1):
            aged = [w._replace(age=n - 1 - i) for i, w in enumerate(windows[:n])]
            alarms += not adequate(calibrate(shape, aged, noise / math.sqrt(3))).ok
            judged += 1
    print(f"\nadequacy on the simulator at +-{noise:.0%}: {alarms} false alarms in {judged} judgements "
          f"({alarms / judged:.1%})")
    assert alarms <= 0.10 * judged


def test_adequacy_catches_a_knee_in_the_simulators_engine() -> None:
    """The simulator's TPOT times 1.4 past maxBatchSize 150 (a host-bound step the sum cannot express): the full
    round fails the test at +-10% noise in at least 18 of 20 seeds."""
    shape = _shape()
    batches = (*FIRST, *LATER)
    caught = 0
    for seed in range(SEEDS):
        verdict = adequate(calibrate(shape, _windows(batches, 0.10, seed, knee=(150, 1.4)), 0.10 / math.sqrt(3)))
        caught += not verdict.ok
    print(f"\nknee x1.4 past 150 at +-10%: caught in {caught}/{SEEDS}")
    assert caught >= 18
