"""The tuner's online model of the engine (planning/engine_model.py): the shape's figures against the models' own
numbers, the filter recovering written-out parameters from noisy windows, the adequacy test passing the linear
engine and failing one with a knee, and the filter following an engine that changed. The simulator's windows are in
tests/sim/test_engine_model_on_simulator.py."""

from __future__ import annotations

import math
import random
import time

import numpy as np
import pytest

from npuserve.catalog.accelerators import get_accelerator
from npuserve.catalog.models import get_model_preset
from npuserve.planning.engine_model import (
    Calibration,
    EngineShape,
    Window,
    adequate,
    calibrate,
    chi2_quantile,
    predict,
)

NOISE = 0.10  # +-10% multiplicative, uniform: the tuner's convention
SD = NOISE / math.sqrt(3)  # its standard deviation, what calibrate() takes
# A tuner's batches: the plan's start, x1.5, x2.25, then back into the bracket.
BATCHES = (64, 96, 144, 120, 80, 132, 108, 72)
# The true engine of the synthetic windows, away from the prior (910B: bandwidth 0.95, compute 0.389; MindIE's
# launches 300.5 us/layer, host 0.246 ms/sequence), within the bounds.
TRUE_X = (1 / 0.6, 1 / 0.5, 0.150, 0.40)  # 1/eff.bandwidth, 1/eff.compute, launch ms/layer, host ms/sequence


def _llama_shape() -> EngineShape:
    return EngineShape.of(get_model_preset("llama3-8b"), get_accelerator("ascend-910b4"), 2, 186, 346)


def _linear_tpot(shape: EngineShape, batch: int, x: tuple[float, ...] = TRUE_X) -> float:
    h, c = shape.features(batch)
    return float(h @ np.array(x)) + c


def _windows(tpot: dict[int, float] | None, shape: EngineShape, batches: tuple[int, ...], seed: int,
             knee: tuple[int, float] | None = None) -> list[Window]:
    """Windows at `batches` in that order (the last the newest), each TPOT times its own uniform +-NOISE factor;
    with `knee` (batch, factor), TPOT times the factor past that batch."""
    rng = random.Random(seed)
    out = []
    for i, b in enumerate(batches):
        true = tpot[b] if tpot else _linear_tpot(shape, b)
        if knee and b > knee[0]:
            true *= knee[1]
        out.append(Window(b, true * (1 + rng.uniform(-NOISE, NOISE)), len(batches) - 1 - i))
    return out


def test_shape_takes_the_models_own_figures() -> None:
    shape = _llama_shape()
    # LLaMA3-8B: 6,979,584,000 decoder parameters + the 128256 x 4096 LM head, bf16, halved over 2 cards.
    assert shape.dense_weight_bytes == (6_979_584_000 + 525_336_576) * 2 / 2
    assert shape.expert_weight_bytes == 0
    assert shape.kv_bytes_per_token == 32 * 8 * 128 * 2 * 2 / 2  # layers x KV heads x head dim x (K, V) x bf16 / 2
    assert shape.flops_per_token == 2 * 6_979_584_000 / 2
    assert shape.bandwidth == 879.6e9 and shape.flops == 245.8e12  # the 910B4's datasheet figures
    # Dense: what a decode step reads grows only by the KV of its contexts (186 + 346 / 2 tokens each).
    h1, h2 = shape.features(1)[0], shape.features(101)[0]
    assert h2[0] - h1[0] == pytest.approx(100 * (186 + 173) * 65_536 / 879.6e9 * 1e3)
    assert h1[2] == 32 and h2[3] == 101


def test_moe_shape_reads_the_experts_its_batch_touches() -> None:
    """Qwen3-30B-A3B on one card: 48 layers of 128 experts of 3 x 2048 x 768 bf16 parameters each; a step of one
    token touches 8 of 128 per layer, a large batch nearly all (the expert-touch rule)."""
    shape = EngineShape.of(get_model_preset("qwen3-30b-a3b"), get_accelerator("ascend-910b3"), 1, 186, 346)
    experts = 48 * 128 * 3 * 2048 * 768 * 2
    assert shape.expert_weight_bytes == experts
    kv = 48 * 4 * 128 * 2 * 2  # 4 KV heads of 128
    one = shape.features(1)[0][0] - (186 + 173) * kv / shape.bandwidth * 1e3
    assert one == pytest.approx((shape.dense_weight_bytes + experts * 8 / 128) / shape.bandwidth * 1e3)
    many = shape.features(512)[0][0] - 512 * (186 + 173) * kv / shape.bandwidth * 1e3
    assert many == pytest.approx((shape.dense_weight_bytes + experts) / shape.bandwidth * 1e3, rel=1e-3)


def test_the_host_cpu_gets_nominal_figures_and_a_wide_prior() -> None:
    shape = EngineShape.of(get_model_preset("tiny"), get_accelerator("cpu"), 1, 32, 16)
    assert shape.bandwidth == 1e9 and shape.flops == 1e12
    assert shape.comm_ms_per_step == 0 and shape.comm_ms_per_token == 0
    calibrate(shape, [Window(4, 30.0, 1), Window(8, 40.0, 0)], SD)


def test_recovers_known_parameters_within_their_uncertainty() -> None:
    """Windows from the linear model with TRUE_X at +-10% noise, each of BATCHES measured twice: every parameter
    within two reported standard deviations in at least 90% of 50 seeds, and the windows move the estimate towards
    the truth (the prior alone is far off)."""
    shape = _llama_shape()
    covered = [0, 0, 0, 0]
    closer = 0
    prior_sd = np.array(shape.prior.sd)
    prior_distance = float(np.sum(np.abs(np.array(shape.prior.mean) - TRUE_X) / prior_sd))
    for seed in range(50):
        cal = calibrate(shape, _windows(None, shape, BATCHES * 2, seed), SD)
        sd = np.sqrt(np.diag(np.array(cal.covariance)))
        error = np.abs(np.array(cal.mean) - TRUE_X)
        for i in range(4):
            covered[i] += error[i] <= 2 * sd[i]
        closer += float(np.sum(error / prior_sd)) < prior_distance
    print(f"parameters within 2 sd in 50 seeds: {covered}; closer to the truth than the prior: {closer}")
    assert min(covered) >= 45
    assert closer >= 45


def test_predictions_cover_the_linear_engine() -> None:
    """predict()'s standard deviation (the parameters' uncertainty) covers the true TPOT at batches measured and
    not (2 sd) in at least 90% of the cases, after 3 and after 8 windows."""
    shape = _llama_shape()
    hits = total = 0
    for seed in range(50):
        for n in (3, 8):
            cal = calibrate(shape, _windows(None, shape, BATCHES[:n], seed), SD)
            for b in (48, 64, 100, 144, 200):
                tpot, sd = predict(cal, b)
                hits += abs(tpot - _linear_tpot(shape, b)) <= 2 * sd
                total += 1
    print(f"true TPOT within 2 sd of the prediction: {hits} of {total}")
    assert hits >= 0.9 * total


def test_adequacy_passes_the_linear_engine_and_fails_a_knee() -> None:
    """The linear engine passes on most seeds (the false alarms printed); an engine whose TPOT jumps x1.4 past
    batch 100 (a host-bound step the sum cannot follow: written out here, not the model's) fails on nearly all."""
    shape = _llama_shape()
    seeds = 100
    false_alarms = sum(not adequate(calibrate(shape, _windows(None, shape, BATCHES, s), SD)).ok for s in range(seeds))
    caught = sum(not adequate(calibrate(shape, _windows(None, shape, BATCHES, s, knee=(100, 1.4)), SD)).ok
                 for s in range(seeds))
    print(f"linear engine at +-10%: {false_alarms} false alarms in {seeds}; knee x1.4 at 100: caught {caught}")
    assert false_alarms <= 0.1 * seeds
    assert caught >= 0.9 * seeds
    verdict = adequate(calibrate(shape, _windows(None, shape, BATCHES, 0, knee=(100, 1.4)), SD))
    assert not verdict.ok and "exceed" in verdict.why and verdict.statistic > verdict.threshold


@pytest.mark.parametrize("count", [0, 1, 2])
def test_adequacy_needs_three_windows(count: int) -> None:
    shape = _llama_shape()
    verdict = adequate(calibrate(shape, _windows(None, shape, BATCHES[:count], 0), SD))
    assert not verdict.ok and "not enough windows" in verdict.why


@pytest.mark.parametrize("window", [Window(0, 40.0, 0), Window(8, 0.0, 0), Window(8, math.nan, 0),
                                    Window(8, 40.0, -1)])
def test_a_window_with_no_tpot_is_refused(window: Window) -> None:
    with pytest.raises(ValueError, match="a window needs"):
        calibrate(_llama_shape(), [Window(4, 30.0, 1), window], SD)


def test_forgetting_follows_an_engine_that_changed() -> None:
    """Eight windows of one engine, then six of the same engine with twice the host work per sequence (another
    tenant on the host), noise-free: the newest windows outweigh the old, so the model comes closer to the new
    engine than weighing every window alike (a sixth of the error less, at least: FORGETTING is mild, for the
    precision of a round's claims), and the adequacy test sees the change (the windows after it were mispredicted:
    the tuner may then drop the windows before it)."""
    shape = _llama_shape()
    changed = (*TRUE_X[:3], 2 * TRUE_X[3])
    old = [(b, _linear_tpot(shape, b)) for b in BATCHES]
    new = [(b, _linear_tpot(shape, b, changed)) for b in BATCHES[:6]]
    history = [*old, *new]
    worst = {}
    for label, ages in (("aged", [len(history) - 1 - i for i in range(len(history))]), ("alike", [0] * len(history))):
        cal = calibrate(shape, [Window(b, t, a) for (b, t), a in zip(history, ages, strict=True)], SD)
        errors = [abs(predict(cal, b)[0] / _linear_tpot(shape, b, changed) - 1) for b in (64, 100, 144)]
        print(f"{label}: errors against the new engine {[f'{e:.1%}' for e in errors]}; {adequate(cal).why}")
        worst[label] = max(errors)
        assert not adequate(cal).ok
    assert worst["aged"] <= 5 / 6 * worst["alike"]


def test_deterministic_and_fast() -> None:
    """The same windows give the same calibration; 16 windows calibrate in well under 10 ms (it runs inside every
    decide() call)."""
    shape = _llama_shape()
    windows = _windows(None, shape, BATCHES * 2, 3)
    assert calibrate(shape, windows, SD) == calibrate(shape, list(windows), SD)
    runs = 200
    start = time.perf_counter()
    for _ in range(runs):
        cal = calibrate(shape, windows, SD)
    per_call_ms = (time.perf_counter() - start) / runs * 1e3
    print(f"calibrate() of 16 windows: {per_call_ms:.3f} ms")
    assert per_call_ms < 10
    assert isinstance(cal, Calibration) and len(cal.errors) == 16


def test_chi2_quantile_matches_the_tables() -> None:
    """Against the printed tables (e.g. NIST's): the 0.975 quantiles at 3, 8 and 16 degrees of freedom."""
    for k, table in ((3, 9.348), (8, 17.535), (16, 28.845)):
        assert chi2_quantile(0.975, k) == pytest.approx(table, rel=0.01)
