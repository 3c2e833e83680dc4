"""The tuner's online model of the engine it tunes (docs/operator.md, "The online model"): steady-state TPOT as a
function of maxBatchSize, from the simulator's cost model (docs/simulator.md) with its free parameters fitted to the
service's own windows. Pure: no I/O, no clock, no randomness, no scipy.

The model. Under a saturating closed loop a decoding token waits for one decode step of the batch b, plus its share
of the prefills run between decode steps: each decode step retires, and so admits, b / mean_output requests on
average, whose prompts' FLOPs delay every running token. With x the cost model's free parameters

    x = (1 / eff.bandwidth, 1 / eff.compute, launch ms per layer, host ms per sequence)

every term is linear in x:

    TPOT(b) = H(b) . x + c(b)                                                            (ms)
    H(b)    = ( decode read(b) / datasheet bandwidth,                   weights touched + KV of b contexts
                (decode FLOPs(b) + b / mean_output x prefill FLOPs) / datasheet FLOP/s,
                layers,
                b )
    c(b)    = the all-reduces of the decode step and of the admitted prompts' tokens (the prior's link efficiency
              and all-reduce latency: known, not fitted; constant per step, they are collinear with the launches)

The cost model takes max(memory, compute) on the device and max(device, host) between device and host; here they
add. A sum keeps TPOT linear in x, so that the filter below is the exact Bayesian update (a max would make the fit
nonlinear and the uncertainty approximate). Over a tuning range TPOT is close to a straight line in b either way,
and the fitted parameters absorb the overlap (they are effective values, not the simulator's); where a sum cannot
follow the engine (a knee: the step turning host-bound), the adequacy test (`adequate`) sees the residuals outgrow
the noise, and the tuner stops using the model for claims.

The filter: a Kalman filter on x (recursive least squares with a Gaussian prior), one update per window, oldest
first, in relative terms (each window's row divided by its measured TPOT: the noise is multiplicative). Older
windows weigh less: a window `age` windows old counts `FORGETTING ** age` of a new one (its variance is divided by
that), the prior never decays (the windows rarely pin all four parameters: they see TPOT's level and slope over b;
a decaying prior would let the unseen directions drift without bound). The measurement noise is the conjugate
(normal-inverse-gamma) estimate: the prior relative noise as NOISE_PRIOR_DF pseudo-windows pooled with the
standardized one-step-ahead residuals.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist
from typing import NamedTuple

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from npuserve.catalog.accelerators import (
    EFFICIENCY_BOUNDS,
    Accelerator,
    allreduce_latency_us,
    efficiency_of,
    get_accelerator,
)
from npuserve.catalog.engines import (
    DEFAULT_ENGINE,
    ENGINE_PROFILES,
    LAUNCH_US_PER_LAYER_BOUND,
    PER_SEQ_HOST_MS_BOUND,
)
from npuserve.modelspec import ModelSpec
from npuserve.planning.api import InferenceServiceSpec, Plan
from npuserve.planning.planner import model_spec

# A window `age` windows old weighs FORGETTING ** age of the newest: 0.9 halves a window's weight in ~6.6 windows,
# so the first windows of a 16-trial round still count, while after the engine changes (a restart, a neighbour on
# the node) the new windows outweigh the old within a few trials. Traffic changes need no forgetting: the mean
# lengths are the shape's, and a new shape is built from the new traffic.
FORGETTING = 0.9
# The prior relative noise counts as this many windows beside the measured residuals.
NOISE_PRIOR_DF = 2.0
# The least relative noise assumed: a deterministic engine (noise 0) still leaves the model's own approximation
# (the sum for the cost model's max) of a percent or so; a zero would make the filter trust every window exactly.
NOISE_FLOOR = 0.01
# The adequacy test looks at the last ADEQUACY_WINDOWS one-step-ahead residuals and needs MIN_WINDOWS at least.
ADEQUACY_WINDOWS = 8
MIN_WINDOWS = 3
# One-sided confidence of the adequacy test: the tuner's claim confidence (problem.CLAIM_CONFIDENCE), so that a model
# rejected by chance is as rare as a false claim.
ADEQUACY_CONFIDENCE = 0.975
# The host CPU has no datasheet figures: nominal ones, with a prior of the achieved fraction wide enough for any
# machine (5-50 GB/s of memory bandwidth, 20-500 GFLOP/s).
CPU_NOMINAL_BANDWIDTH = 1e9  # bytes/s
CPU_NOMINAL_FLOPS = 1e12
CPU_PRIOR = ((0.063, 0.1), (10.0, 25.0))  # (mean, sd) of 1/eff.bandwidth and 1/eff.compute at the nominal figures

PARAMETERS = ("inv_bandwidth_efficiency", "inv_compute_efficiency", "launch_ms_per_layer", "host_ms_per_seq")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Prior(_Frozen):
    """Gaussian prior of x (PARAMETERS' order): independent, each standard deviation wide enough that the parameter's
    bounds lie within two of it."""

    mean: tuple[float, float, float, float]
    sd: tuple[float, float, float, float]


class EngineShape(_Frozen):
    """What the model needs of one service (one pod): per card, the bytes a decode step reads, the FLOPs of a token,
    the all-reduces; the card's datasheet figures; the traffic's mean lengths; and the prior of the parameters."""

    engine: str
    accelerator: str
    layers: int = Field(gt=0)
    dense_weight_bytes: float = Field(ge=0, description="per card: what every step reads (all but routed experts)")
    expert_weight_bytes: float = Field(ge=0, description="per card: every routed expert (0 for a dense model)")
    num_experts: int = Field(ge=0)
    experts_per_token: int = Field(ge=0)
    kv_bytes_per_token: float = Field(ge=0, description="per card")
    flops_per_token: float = Field(gt=0, description="per card: 2 x active layer parameters / world size")
    flops_per_row: float = Field(ge=0, description="per card: the LM head of one sampled row")
    flops_per_pair: float = Field(ge=0, description="per card: attention of one (query, key) pair")
    comm_ms_per_step: float = Field(ge=0, description="the all-reduces' fixed latency per step (known)")
    comm_ms_per_token: float = Field(ge=0, description="the all-reduces' transfer per token (known)")
    bandwidth: float = Field(gt=0, description="datasheet (nominal for the host CPU) bytes/s")
    flops: float = Field(gt=0, description="datasheet (nominal for the host CPU) 16-bit FLOP/s")
    mean_input_tokens: float = Field(gt=0)
    mean_output_tokens: float = Field(gt=0)
    prior: Prior

    @classmethod
    def of(cls, model: ModelSpec, accelerator: Accelerator, world_size: int, mean_input_tokens: float,
           mean_output_tokens: float, engine: str = DEFAULT_ENGINE) -> EngineShape:
        n = world_size
        host = ENGINE_PROFILES[engine].params
        eff = efficiency_of(accelerator)
        figures = accelerator.simulation_figures()
        dense = model.step_weight_bytes(0)  # no token: every weight but the routed experts
        comm_step = comm_token = 0.0
        if figures is None:
            bandwidth, flops = CPU_NOMINAL_BANDWIDTH, CPU_NOMINAL_FLOPS
            (bw_mean, bw_sd), (c_mean, c_sd) = CPU_PRIOR
        else:
            bandwidth, flops = figures.memory_bandwidth_gbps * 1e9, figures.tflops_16bit * 1e12
            bw_mean, bw_sd = _inverse_prior(eff.bandwidth, EFFICIENCY_BOUNDS["bandwidth"])
            c_mean, c_sd = _inverse_prior(eff.compute, EFFICIENCY_BOUNDS["compute"])
            if n > 1:  # as the cost model: after attention and the MLP of each layer, and the LM head
                all_reduces = 2 * model.num_layers + 1
                comm_step = all_reduces * allreduce_latency_us(figures.link) / 1e3
                link = figures.interconnect_gbps * 1e9 * eff.link
                comm_token = all_reduces * 2.0 * (n - 1) / n * model.hidden_size * model.dtype_bytes / link * 1e3
        launch, per_seq = host.launch_us_per_layer / 1e3, host.per_seq_host_ms
        # Each host term's bounds [0, bound] within two standard deviations of the engine's fitted value.
        launch_sd = max(launch, LAUNCH_US_PER_LAYER_BOUND / 1e3 - launch) / 2
        per_seq_sd = max(per_seq, PER_SEQ_HOST_MS_BOUND - per_seq) / 2
        v_head_dim = model.mla.v_head_dim if model.mla is not None else model.head_dim
        return cls(
            engine=engine, accelerator=accelerator.name, layers=model.num_layers,
            dense_weight_bytes=dense / n, expert_weight_bytes=(model.step_weight_bytes(1 << 62) - dense) / n,
            num_experts=model.moe.num_experts if model.moe else 0,
            experts_per_token=model.moe.num_experts_per_tok if model.moe else 0,
            kv_bytes_per_token=model.kv_bytes_per_block(1, n), flops_per_token=2.0 * model.active_layer_parameters / n,
            flops_per_row=2.0 * model.vocab_size * model.hidden_size / n,
            flops_per_pair=2.0 * model.num_layers * model.num_attention_heads * (model.head_dim + v_head_dim) / n,
            comm_ms_per_step=comm_step, comm_ms_per_token=comm_token, bandwidth=bandwidth, flops=flops,
            mean_input_tokens=mean_input_tokens, mean_output_tokens=mean_output_tokens,
            prior=Prior(mean=(bw_mean, c_mean, launch, per_seq), sd=(bw_sd, c_sd, launch_sd, per_seq_sd)))

    @classmethod
    def of_service(cls, spec: InferenceServiceSpec, plan: Plan) -> EngineShape:
        """The shape of one planned InferenceService: its model and card, the plan's worldSize, the workload's mean
        lengths, MindIE's host terms (the engine npuserve runs schedules as MindIE does)."""
        w = spec.workload
        return cls.of(model_spec(spec), get_accelerator(spec.accelerator.type), plan.worldSize, w.avgInputTokens,
                      w.avgOutputTokens)

    def features(self, batch: float) -> tuple[np.ndarray, float]:
        """(H(b), c(b)) in ms: TPOT(b) = H(b) . x + c(b)."""
        b, n_in = float(batch), self.mean_input_tokens
        admitted = b / self.mean_output_tokens  # prompts prefilled per decode step
        context = n_in + self.mean_output_tokens / 2  # a decoding sequence's mean context
        weights = self.dense_weight_bytes
        if self.num_experts:  # the expert-touch rule (ModelSpec.experts_touched) at b tokens
            weights += self.expert_weight_bytes * (1 - (1 - self.experts_per_token / self.num_experts) ** b)
        read = weights + b * context * self.kv_bytes_per_token
        decode_flops = b * (self.flops_per_token + self.flops_per_row + context * self.flops_per_pair)
        prefill_flops = n_in * self.flops_per_token + self.flops_per_row + n_in * (n_in + 1) / 2 * self.flops_per_pair
        h = np.array([read / self.bandwidth * 1e3, (decode_flops + admitted * prefill_flops) / self.flops * 1e3,
                      float(self.layers), b])
        return h, self.comm_ms_per_step + (b + admitted * n_in) * self.comm_ms_per_token


def _inverse_prior(value: float, bounds: tuple[float, float]) -> tuple[float, float]:
    """(mean, sd) of 1 / efficiency: the family's fitted value, both bounds within two standard deviations."""
    low, high = 1 / bounds[1], 1 / bounds[0]
    mean = 1 / value
    return mean, max(mean - low, high - mean) / 2


class Window(NamedTuple):
    """One measured window: the batch it ran at, its mean TPOT, and how many windows were measured after it (0: the
    newest). The batch is maxBatchSize under a load that fills it; where the load does not (fewer requests in flight
    than maxBatchSize), the measured mean running batch is the one the model means."""

    batch: float
    tpot_ms: float
    age: float = 0.0


class EngineParams(_Frozen):
    """The parameters as physical values (each efficiency 1 / its x; inf where x is not positive)."""

    bandwidth_efficiency: float
    compute_efficiency: float
    launch_us_per_layer: float
    per_seq_host_ms: float


class PredictionError(_Frozen):
    """A window against the model fitted to the windows before it (one step ahead)."""

    batch: float
    predicted_ms: float
    measured_ms: float
    sd_ms: float = Field(description="the prediction's standard deviation: parameters and one window's noise")

    @property
    def relative(self) -> float:
        return (self.predicted_ms - self.measured_ms) / self.measured_ms


class Calibration(_Frozen):
    """The filter's state after every window: x's mean and covariance, the noise estimate, and each window's
    one-step-ahead prediction error (the adequacy test's evidence)."""

    shape: EngineShape
    mean: tuple[float, float, float, float]
    covariance: tuple[tuple[float, ...], ...]
    noise: float = Field(description="relative standard deviation of one window's TPOT, estimated")
    noise_df: float
    prior_noise: float = Field(description="the relative noise the calibration was given (the adequacy reference)")
    errors: tuple[PredictionError, ...] = Field(description="one per window, oldest first")
    standardized: tuple[float, ...] = Field(description="each window's one-step-ahead residual over its standard "
                                                        "deviation at the given noise, oldest first")

    @property
    def params(self) -> EngineParams:
        x = self.mean
        return EngineParams(bandwidth_efficiency=_inverse(x[0]), compute_efficiency=_inverse(x[1]),
                            launch_us_per_layer=x[2] * 1e3, per_seq_host_ms=x[3])

    @property
    def params_sd(self) -> EngineParams:
        """Standard deviations of `params` (the efficiencies' by the delta method: sd(1/x) = sd(x) / x^2)."""
        x, sd = self.mean, [math.sqrt(max(self.covariance[i][i], 0.0)) for i in range(4)]
        return EngineParams(bandwidth_efficiency=sd[0] / x[0] ** 2 if x[0] > 0 else math.inf,
                            compute_efficiency=sd[1] / x[1] ** 2 if x[1] > 0 else math.inf,
                            launch_us_per_layer=sd[2] * 1e3, per_seq_host_ms=sd[3])


def _inverse(x: float) -> float:
    return 1 / x if x > 0 else math.inf


def calibrate(shape: EngineShape, windows: Sequence[Window | tuple[float, float, float]], noise: float) -> Calibration:
    """The parameters fitted to `windows` from the shape's prior. `noise`: the prior relative standard deviation of
    one window's TPOT (the tuner's: its +-noise / sqrt(3), or its estimate from repeats); best a model-free one, as
    the adequacy test holds the model's residuals against it. Deterministic: the windows are taken oldest first
    (largest age), ties in the given order."""
    sigma0 = max(noise, NOISE_FLOOR)
    ordered = sorted((Window(*w) for w in windows), key=lambda w: -w.age)
    for w in ordered:
        if not (w.batch >= 1 and math.isfinite(w.tpot_ms) and w.tpot_ms > 0 and w.age >= 0):
            raise ValueError(f"a window needs maxBatchSize >= 1, a positive TPOT and an age >= 0: got {w}")
    # The state in units of sigma0^2 (the conjugate form): x ~ N(mean, sigma^2 P), a window's relative noise sigma^2.
    x = np.array(shape.prior.mean, dtype=float)
    p = np.diag(np.square(shape.prior.sd) / sigma0**2)
    errors: list[PredictionError] = []
    standardized: list[float] = []
    squares = 0.0
    for w in ordered:
        h_ms, c_ms = shape.features(w.batch)
        h, z = h_ms / w.tpot_ms, 1.0 - c_ms / w.tpot_ms  # relative: h . x = z when the model is exact
        ph = p @ h
        spread = float(h @ ph)  # the parameters' part of the residual's variance
        innovation = z - float(h @ x)
        squares += innovation**2 / (spread + 1.0)  # each estimates sigma^2 (a window's noise is not aged)
        standardized.append(innovation / (sigma0 * math.sqrt(spread + 1.0)))
        predicted = float(h_ms @ x) + c_ms
        errors.append(PredictionError(batch=w.batch, predicted_ms=predicted, measured_ms=w.tpot_ms,
                                      sd_ms=sigma0 * w.tpot_ms * math.sqrt(spread + 1.0)))
        gain = ph / (spread + FORGETTING ** -w.age)
        x = x + gain * innovation
        p = p - np.outer(gain, ph)
    df = NOISE_PRIOR_DF + len(ordered)
    sigma2 = (NOISE_PRIOR_DF * sigma0**2 + squares) / df
    covariance = sigma2 * p
    return Calibration(shape=shape, mean=(float(x[0]), float(x[1]), float(x[2]), float(x[3])),
                       covariance=tuple(tuple(float(v) for v in row) for row in covariance),
                       noise=math.sqrt(sigma2), noise_df=df, prior_noise=sigma0, errors=tuple(errors),
                       standardized=tuple(standardized))


def predict(cal: Calibration, batch: float, *, window: bool = False) -> tuple[float, float]:
    """(TPOT ms, its standard deviation ms) at `batch`: the model's steady-state TPOT and the parameters'
    uncertainty; with `window`, one window's noise added (what a next window would measure)."""
    h, c = cal.shape.features(batch)
    tpot = float(h @ np.array(cal.mean)) + c
    variance = float(h @ np.array(cal.covariance) @ h)
    if window:
        variance += (cal.noise * tpot) ** 2
    return tpot, math.sqrt(max(variance, 0.0))


def output_tokens_per_second(cal: Calibration, batch: float) -> float:
    """Predicted output tok/s of the saturated engine: b tokens every TPOT."""
    return batch / predict(cal, batch)[0] * 1e3


class Adequacy(_Frozen):
    ok: bool
    statistic: float
    threshold: float
    why: str


def adequate(cal: Calibration) -> Adequacy:
    """Whether the model explains the windows: a chi-square test of the last ADEQUACY_WINDOWS standardized
    one-step-ahead residuals at the given noise (`Calibration.prior_noise`).

    One-step-ahead (predictive) residuals, not the fit's: a window's residual against the model fitted to the windows
    before it is, under the model, N(0, noise^2 x (1 + the parameters' share)) and independent of the others, so the
    sum of their squares over noise is chi-square with k degrees of freedom exactly; the fit's own residuals would be
    shrunk by the fit and a flexible enough model would pass anything. The reference is the given noise, not the
    estimate from these residuals (a misfit would inflate that estimate and hide itself). A knee the linear model
    cannot follow leaves the windows on one side of it mispredicted by the knee's size, each time: at 10% noise a
    40% knee is several standard deviations per window, and the sum grows with every window. The threshold is the
    chi-square quantile at ADEQUACY_CONFIDENCE (Wilson-Hilferty's approximation, within 1% of the exact quantile for
    k >= 3), so a right model fails by chance as often as a claim is allowed to be wrong."""
    n = len(cal.standardized)
    if n < MIN_WINDOWS:
        return Adequacy(ok=False, statistic=0.0, threshold=math.inf,
                        why=f"not enough windows: {n} of the {MIN_WINDOWS} the test needs")
    last = cal.standardized[-ADEQUACY_WINDOWS:]
    k = len(last)
    statistic = sum(u * u for u in last)
    threshold = chi2_quantile(ADEQUACY_CONFIDENCE, k)
    ok = statistic <= threshold
    worst = max(range(k), key=lambda i: abs(last[i]))
    error = cal.errors[n - k + worst]
    why = (f"the last {k} windows' one-step-ahead residuals {'stay within' if ok else 'exceed'} the noise "
           f"({cal.prior_noise:.1%}): chi-square {statistic:.1f} {'<=' if ok else '>'} {threshold:.1f}; worst at "
           f"batch {error.batch:g}: predicted {error.predicted_ms:.1f} ms, measured {error.measured_ms:.1f} ms")
    return Adequacy(ok=ok, statistic=statistic, threshold=threshold, why=why)


def chi2_quantile(p: float, k: int) -> float:
    """The p quantile of chi-square with k degrees of freedom (Wilson-Hilferty: the cube root of chi2/k is close to
    normal), without scipy."""
    z = NormalDist().inv_cdf(p)
    c = 2.0 / (9.0 * k)
    return float(k * (1.0 - c + z * math.sqrt(c)) ** 3)
