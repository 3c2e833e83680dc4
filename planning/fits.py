"""The tuner's fits: how noisy the windows are, where a latency reaches a level, where throughput peaks.

Fits only propose: they choose the next batch to measure. Whether a schedule meets the SLO is the judge's
(`problem.py`), from the windows measured at that schedule.

Latency is fitted in log-log, as a shape that cannot fall: the per-batch means are smoothed by isotonic regression
(latency never falls as the batch grows), and a level is found by interpolating the smoothed points that bracket it,
or by extrapolating past the last one with a slope held between MIN_ELASTICITY and MAX_ELASTICITY. The noise is
estimated from the data: the scatter of repeated windows at one batch and the residuals of the isotonic fit, pooled
with the problem's prior as a few pseudo-observations (so that two agreeing windows do not declare a noisy cluster
quiet).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import isotonic_regression

# Elasticities (d log latency / d log batch) assumed from a single point. TPOT grows about linearly with a large
# fixed part (the guide: 47 ms at 100, 60 at 200 -> 0.36); TTFT steeply (6365 ms at 100, 21252 at 200 -> 1.7).
PRIOR_ELASTICITY: dict[str, float] = {"tpot": 0.4, "ttft": 1.5}
# Bounds on a fitted elasticity, so a flat or noisy pair of points cannot send a jump to infinity or fall.
MIN_ELASTICITY, MAX_ELASTICITY = 0.08, 6.0
# Two batches closer than this (in log batch: 25%) give no slope to extrapolate along.
CLOSE_SPAN = math.log(1.25)
# The prior noise counts as this many degrees of freedom beside the ones measured.
PRIOR_DF = 1.0
# Batches a throughput parabola needs to smooth anything: through three it only interpolates their means.
PEAK_FIT_POINTS = 4


@dataclass(frozen=True)
class Series:
    """One figure's windows at each batch, in logarithms: batches ascending, each with its windows' values."""

    batches: tuple[float, ...]  # a latency's: where the tuner places each batch (`_placed_at`)
    values: tuple[tuple[float, ...], ...]  # log of the figure (over its bound, for latencies), per window

    @property
    def means(self) -> list[float]:
        return [sum(v) / len(v) for v in self.values]

    @property
    def counts(self) -> list[int]:
        return [len(v) for v in self.values]


def monotone(series: Series) -> list[float]:
    """The per-batch means smoothed so they never fall as the batch grows (isotonic regression, weighted by the
    windows at each batch)."""
    if len(series.batches) < 2:
        return series.means
    fitted = isotonic_regression(np.array(series.means), weights=np.array(series.counts, dtype=float),
                                 increasing=True)
    return [float(v) for v in fitted.x]


def scatter(series: Series, rising: bool) -> tuple[float, float]:
    """(sum of squares, degrees of freedom) of the windows around what they should be: each batch's own mean
    (repeats), and, for a figure that rises with the batch, a smooth curve through those means (a line in log-log
    through three batches, a parabola through more), whose residuals hold the noise that repeats at one batch cannot
    see (a batch that is slower or faster than its neighbours every time). A curve that fits the true shape badly
    only overstates the noise: the verdicts grow more careful, never bolder."""
    ss, df = 0.0, 0.0
    for values in series.values:
        mean = sum(values) / len(values)
        ss += sum((v - mean) ** 2 for v in values)
        df += len(values) - 1
    smooth = _smooth_residuals(series) if rising else None
    if smooth is not None:
        residuals, residual_df = smooth
        ss += float(np.sum(np.array(series.counts, dtype=float) * residuals**2))
        df += residual_df
    return ss, df


def batch_bias(series: Series, window_sd: float) -> float:
    """The variance of the batches' true means around a smooth curve through them, beyond what their windows' noise
    (`window_sd`, one window's) explains; 0 when it explains it all, or through fewer than three batches. A batch
    whose every window runs slower or faster than its neighbours' (its kernels) shares that bias across its
    repeats: the drift test's seed 15 claimed maxBatchSize 178, 5.4% over the TPOT bound, from three windows that
    agreed within 4% and measured 9.7% under the truth."""
    smooth = _smooth_residuals(series)
    if smooth is None:
        return 0.0
    residuals, residual_df = smooth
    excess = sum(float(r) ** 2 - window_sd**2 / n for r, n in zip(residuals, series.counts, strict=True))
    return max(0.0, excess / residual_df)


def parabola(series: Series) -> list[float] | None:
    """The per-batch means of a figure that rises then falls (throughput), smoothed by the parabola in log batch
    fitted to them, each weighted by its windows; None through fewer than PEAK_FIT_POINTS batches, or when the
    parabola does not bend down (the means then show no peak for it to place; 32B seed 17 at +-10%: 384 measured 7%
    low, and a rising parabola chose 640, past the peak). A batch's own windows share a bias that no repeat averages
    away (some batches run faster kernels than their neighbours); the parabola pools every batch's."""
    if len(series.batches) < PEAK_FIT_POINTS:
        return None
    xs, coefficients = _curve(series, 2)
    if coefficients[0] >= 0:
        return None
    return [float(v) for v in np.polyval(coefficients, xs)]


def _smooth_residuals(series: Series) -> tuple[np.ndarray, int] | None:
    """(the per-batch means' residuals, their degrees of freedom) around a smooth curve in log batch: a line through
    three batches, a parabola through more; None through fewer than three."""
    points = len(series.batches)
    if points < 3:
        return None
    degree = 1 if points == 3 else 2
    xs, coefficients = _curve(series, degree)
    return np.array(series.means) - np.polyval(coefficients, xs), points - degree - 1


def _curve(series: Series, degree: int) -> tuple[np.ndarray, np.ndarray]:
    """(log batches, coefficients): the polynomial in log batch through the per-batch means, each weighted by its
    windows."""
    xs = np.log(np.array(series.batches, dtype=float))
    return xs, np.polyfit(xs, np.array(series.means), degree, w=np.sqrt(np.array(series.counts, dtype=float)))


def noise_estimate(prior: float, parts: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(relative standard deviation of one window, degrees of freedom): the prior, as PRIOR_DF pseudo-observations,
    pooled with the measured sums of squares. `prior` is the standard deviation assumed before any data."""
    ss = sum(s for s, _ in parts)
    df = sum(d for _, d in parts)
    return math.sqrt((PRIOR_DF * prior**2 + ss) / (PRIOR_DF + df)), PRIOR_DF + df


def level_crossing(series: Series, level: float, key: str) -> float:
    """The batch where the smoothed log ratio reaches `level`: interpolated in log-log between the two smoothed
    points around it (never outside them), else extrapolated past the nearest end along a slope of the last two
    points held in [MIN_ELASTICITY, MAX_ELASTICITY] (the prior elasticity from one point). With three or more points
    around the level, a parabola through the nearest follows the upward bend of TPOT and TTFT, when it rises through
    the level inside the bracket."""
    xs = [math.log(b) for b in series.batches]
    ys = monotone(series)
    below = [i for i, y in enumerate(ys) if y <= level]
    above = [i for i, y in enumerate(ys) if y > level]
    if below and above and max(below) < min(above):
        i, j = max(below), min(above)
        x = _parabola_root(xs, ys, level, xs[i], xs[j]) if len(xs) >= 3 else None
        if x is None:
            x = xs[i] + (level - ys[i]) * (xs[j] - xs[i]) / (ys[j] - ys[i])
        return math.exp(x)
    if not above:  # every point below the level: extrapolate up from the last
        i, slope = len(xs) - 1, _end_slope(xs, ys, key, top=True)
    else:  # every point above it (or, after smoothing, none strictly below the first above): down from the first
        i, slope = min(above), _end_slope(xs, ys, key, top=False)
    return math.exp(xs[i] + (level - ys[i]) / slope)


def _end_slope(xs: Sequence[float], ys: Sequence[float], key: str, top: bool) -> float:
    if len(xs) < 2:
        return PRIOR_ELASTICITY[key]
    (xa, ya), (xb, yb) = ((xs[-2], ys[-2]), (xs[-1], ys[-1])) if top else ((xs[0], ys[0]), (xs[1], ys[1]))
    if xb - xa < CLOSE_SPAN:  # points this close give a slope of noise: the prior says more
        return PRIOR_ELASTICITY[key]
    slope = (yb - ya) / (xb - xa)
    return min(max(slope, MIN_ELASTICITY), MAX_ELASTICITY)


def _parabola_root(xs: Sequence[float], ys: Sequence[float], level: float, x_lo: float, x_hi: float) -> float | None:
    """The root of the parabola through the (up to four) points nearest the level, weighted towards the level,
    where it rises through it inside [x_lo, x_hi]; None when there is none, or not one."""
    near = sorted(range(len(xs)), key=lambda i: abs(ys[i] - level))[:4]
    if len({xs[i] for i in near}) < 3:
        return None
    x0 = xs[near[0]]
    px = np.array([xs[i] - x0 for i in near])
    py = np.array([ys[i] - level for i in near])
    c2, c1, c0 = np.polyfit(px, py, 2, w=np.sqrt(1.0 / (np.abs(py) + 0.01)))
    if abs(c2) < 1e-12:
        roots = [-c0 / c1] if c1 > 0 else []
    else:
        disc = c1 * c1 - 4 * c2 * c0
        if disc < 0:
            return None
        roots = [(-c1 - math.sqrt(disc)) / (2 * c2), (-c1 + math.sqrt(disc)) / (2 * c2)]
    rising = [r + x0 for r in roots if x_lo <= r + x0 <= x_hi and c1 + 2 * c2 * r > 0]
    return float(rising[0]) if len(rising) == 1 else None


def vertex(batches: Sequence[int], throughputs: Sequence[float], best: int, best_tps: float,
           reach: float) -> tuple[float, float] | None:
    """(batch, throughput) at the top of the parabola in log(batch) through three points, or None when they do not
    bend down. It lies at most a factor `reach` beyond them: a nearly flat parabola would put it anywhere."""
    x0 = math.log(best)
    xs = np.array([math.log(b) - x0 for b in batches])
    ys = np.array([t / best_tps for t in throughputs])
    c2, c1, c0 = np.polyfit(xs, ys, 2)
    if c2 >= 0:
        return None
    x = min(max(-c1 / (2 * c2), float(xs.min()) - math.log(reach)), float(xs.max()) + math.log(reach))
    return math.exp(x + x0), float(c0 + c1 * x + c2 * x * x) * best_tps
