"""Fitting the simulator's free parameters to measured runs, and judging it on runs left out (docs/simulator.md
#calibration). Used by `benchmarks/simulator_calibration.py`; no torch.

The free parameters are physical and bounded: each card family's achieved fractions of its datasheet bandwidth,
compute and link (`Efficiency`), each link kind's all-reduce latency (`LINK_LATENCIES`), and each engine's host terms
(`CostParams`: launches per layer, host work per sequence), each within `BOUNDS`. A case is one measured run (a
point of the MindIE guide's table or of the published measurements) with the engine and card it ran on; its figures
are predicted by running the real scheduler on the simulator. The fit is a coordinate descent in log space
minimising the Huber loss of the log errors (`score`); each step re-runs only the cases the moved parameter touches.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from functools import cache, lru_cache

from npuserve.catalog.accelerators import (
    ALLREDUCE_LATENCY_US_BOUNDS,
    EFFICIENCIES,
    EFFICIENCY_BOUNDS,
    LINK_LATENCIES,
    Efficiency,
    Family,
    LinkKind,
    get_accelerator,
)
from npuserve.catalog.engines import LAUNCH_US_PER_LAYER_BOUND, PER_SEQ_HOST_MS_BOUND

from . import calibration as guide
from .cost_model import ENGINE_PROFILES, CostParams, Hardware
from .published import PUBLISHED_POINTS, PublishedPoint, kv_blocks, point_requests, run_published
from .runner import SimRequest

# (low, high) of each free parameter: the efficiencies' catalog bounds (EFFICIENCY_BOUNDS: what published kernels
# reach), the all-reduce latency's (ALLREDUCE_LATENCY_US_BOUNDS), the host terms by the bounds of
# npuserve/catalog/engines.py (the launch bound is a measurement).
BOUNDS: dict[str, tuple[float, float]] = {
    **EFFICIENCY_BOUNDS, "allreduce_us": ALLREDUCE_LATENCY_US_BOUNDS,
    "launch_us_per_layer": (0.0, LAUNCH_US_PER_LAYER_BOUND), "per_seq_host_ms": (0.0, PER_SEQ_HOST_MS_BOUND),
}
# Where a fit starts, and what a parameter keeps when no case in the fit touches it (a left-out source's engine):
# the middle of each range in log terms, not a fitted value.
PRIOR_EFFICIENCY = Efficiency(bandwidth=0.7, compute=0.5, link=0.6, source="prior: no measurements in the fit")
PRIOR_PARAMS = CostParams(launch_us_per_layer=100.0, per_seq_host_ms=0.1)
PRIOR_ALLREDUCE_US = 30.0
FITTED_FAMILIES: tuple[Family, ...] = ("ascend-910b", "nvidia")
FITTED_LINKS: tuple[LinkKind, ...] = ("hccs", "nvlink", "pcie")
HUBER_DELTA = 0.2  # log error (about 22%) past which a figure's pull on the fit stops growing
MIN_GAIN = 1e-3  # a move must cut the subset's score by this share, or the search stops moving that parameter


@dataclass(frozen=True)
class Fit:
    """One value of every free parameter: the efficiencies by card family, the all-reduce latency by link kind, the
    host terms by engine."""

    efficiencies: dict[str, Efficiency]
    profiles: dict[str, CostParams]
    allreduce_us: dict[str, float]

    @classmethod
    def committed(cls) -> Fit:
        return cls({f: EFFICIENCIES[f] for f in FITTED_FAMILIES},
                   {name: profile.params for name, profile in ENGINE_PROFILES.items()},
                   {link: LINK_LATENCIES[link].allreduce_us for link in FITTED_LINKS})

    @classmethod
    def prior(cls) -> Fit:
        return cls(dict.fromkeys(FITTED_FAMILIES, PRIOR_EFFICIENCY), dict.fromkeys(ENGINE_PROFILES, PRIOR_PARAMS),
                   dict.fromkeys(FITTED_LINKS, PRIOR_ALLREDUCE_US))

    def get(self, param: Param) -> float:
        if param.kind == "link":
            return self.allreduce_us[param.key]
        holder = self.efficiencies[param.key] if param.kind == "eff" else self.profiles[param.key]
        return float(getattr(holder, param.name))

    def with_value(self, param: Param, value: float) -> Fit:
        if param.kind == "link":
            return Fit(self.efficiencies, self.profiles, {**self.allreduce_us, param.key: value})
        if param.kind == "eff":
            eff = self.efficiencies[param.key].model_copy(update={param.name: value})
            return Fit({**self.efficiencies, param.key: eff}, self.profiles, self.allreduce_us)
        params = self.profiles[param.key].model_copy(update={param.name: value})
        return Fit(self.efficiencies, {**self.profiles, param.key: params}, self.allreduce_us)


@dataclass(frozen=True)
class Param:
    kind: str  # "eff" (a family's Efficiency field), "link" (a link kind's all-reduce latency) or "engine"
    key: str
    name: str

    @property
    def label(self) -> str:
        return f"{self.key}.{self.name}"


def free_params() -> list[Param]:
    params = [Param("eff", f, n) for f in FITTED_FAMILIES for n in ("bandwidth", "compute", "link")]
    params += [Param("link", link, "allreduce_us") for link in FITTED_LINKS]
    params += [Param("engine", e, n) for e in ENGINE_PROFILES for n in ("launch_us_per_layer", "per_seq_host_ms")]
    return params


def corner(slowest: bool) -> Fit:
    """Every free parameter at the end of its bound that makes a run slowest (the least achieved fractions, the most
    all-reduce latency and host time) or fastest. Every term of a step adds time, so each figure moves one way with
    each parameter, and the two corners' figures bound what any fit within BOUNDS can reach (`out_of_reach`;
    tests/sim/test_calibration.py checks that the committed fit's figures lie between them)."""
    fit = Fit.prior()
    for p in free_params():
        low, high = BOUNDS[p.name]
        fit = fit.with_value(p, (low if slowest else high) if p.kind == "eff" else (high if slowest else low))
    return fit


def out_of_reach(measured: float, slowest: float, fastest: float, within: float) -> float | None:
    """The least error (simulated / measured - 1) any fit within BOUNDS makes on a figure, when that is more than
    `within`; None when some fit can come within it. The corners' figures bound the reachable range."""
    low, high = sorted((slowest, fastest))
    nearest = min(max(measured, low), high)
    error = nearest / measured - 1
    return error if abs(error) > within else None


@dataclass(frozen=True)
class Case:
    """One measured run: what it ran on and the figures it reports."""

    id: str
    source: str
    cite: str
    engine: str
    accelerator: str
    cards: int
    measured: dict[str, float]
    assumed: str = ""
    point: PublishedPoint | guide.GuidePoint | None = field(default=None, compare=False)

    @property
    def family(self) -> str:
        return get_accelerator(self.accelerator).family

    @property
    def link(self) -> str | None:
        return get_accelerator(self.accelerator).link

    def touched_by(self, param: Param) -> bool:
        if param.kind == "eff":
            return param.key == self.family and (param.name != "link" or self.cards > 1)
        if param.kind == "link":
            return param.key == self.link and self.cards > 1
        return param.key == self.engine


def cases() -> list[Case]:
    rows = [Case(p.id, guide.SOURCE, guide.CITE, guide.ENGINE, guide.ACCELERATOR, guide.WORLD_SIZE, p.measured,
                 "outputs drawn with mean 346 under the cap 512, prompts uniform in [130, 242] (calibration.py)",
                 point=p)
            for p in guide.GUIDE_POINTS]
    rows += [Case(p.id, p.source, p.cite, p.engine, p.accelerator, p.cards, p.measured, p.assumed, point=p)
             for p in PUBLISHED_POINTS]
    return rows


def hardware_for(case: Case, fit: Fit) -> Hardware:
    acc = get_accelerator(case.accelerator)
    return Hardware.of(acc, fit.efficiencies.get(acc.family, EFFICIENCIES[acc.family]),
                       fit.allreduce_us.get(acc.link) if acc.link else None)


def predict(case: Case, fit: Fit) -> dict[str, float]:
    """The case's figures on the simulator under `fit`."""
    params, hardware = fit.profiles[case.engine], hardware_for(case, fit)
    if isinstance(case.point, guide.GuidePoint):
        sim = guide.run_point(case.point, params, requests=_guide_requests(), hardware=hardware)
        figures = {"output_tok_s": sim.output_tok_s, "itl_ms": sim.decode_ms}
        return {k: figures[k] for k in case.measured}
    assert isinstance(case.point, PublishedPoint)
    return run_published(case.point, params, hardware, _blocks_of(case.point.id), _requests_of(case.point.id))


# Each is drawn once per process (a fit re-runs every case dozens of times): the same requests and KV budget per case.
_guide_requests = lru_cache(maxsize=1)(guide.guide_requests)
_POINTS = {p.id: p for p in PUBLISHED_POINTS}


@cache
def _blocks_of(point_id: str) -> int:
    return kv_blocks(_POINTS[point_id])


@cache
def _requests_of(point_id: str) -> list[SimRequest]:
    return point_requests(_POINTS[point_id])


def _predict_job(job: tuple[Case, Fit]) -> dict[str, float]:
    return predict(*job)


def log_errors(case: Case, predicted: dict[str, float]) -> list[float]:
    return [math.log(max(predicted[k], 1e-9) / v) for k, v in case.measured.items()]


def score(rows: Iterable[tuple[Case, dict[str, float]]]) -> float:
    """Huber loss of the log errors: squared within HUBER_DELTA, linear past it, so a run the model cannot explain
    (an engine behaviour it lacks, a wrong assumption about the source) does not drag every other fit with it."""
    total = 0.0
    for case, pred in rows:
        for e in log_errors(case, pred):
            a = abs(e)
            total += a * a if a <= HUBER_DELTA else 2 * HUBER_DELTA * a - HUBER_DELTA * HUBER_DELTA
    return total


@dataclass
class Fitter:
    """Coordinate descent over `free_params()` on `fit_cases`, predictions run on `pool`."""

    fit_cases: Sequence[Case]
    pool: Executor
    log: Callable[[str], None] = print

    def evaluate(self, fit: Fit, subset: Sequence[Case]) -> list[tuple[Case, dict[str, float]]]:
        preds = list(self.pool.map(_predict_job, [(c, fit) for c in subset]))
        return list(zip(subset, preds, strict=True))

    def run(self, start: Fit, rounds: int = 2, step: float = 0.5) -> Fit:
        best = start
        for round_ in range(rounds):
            for param in free_params():
                subset = [c for c in self.fit_cases if c.touched_by(param)]
                if not subset:
                    continue  # no case in the fit depends on it: it keeps its start (the prior)
                best_score = score(self.evaluate(best, subset))
                low, high = BOUNDS[param.name]
                for direction in (1.0, -1.0):
                    moved = False
                    while True:
                        value = best.get(param)
                        new = value * math.exp(direction * step) if value > 0 else (high - low) * 0.02
                        new = min(high, max(low, new))
                        if abs(new - value) < 1e-9:
                            break
                        trial = best.with_value(param, new)
                        trial_score = score(self.evaluate(trial, subset))
                        if trial_score >= best_score - MIN_GAIN * max(1.0, best_score):
                            break
                        best, best_score, moved = trial, trial_score, True
                        self.log(f"  round {round_ + 1} {param.label} -> {new:.4g} (subset score {best_score:.3f})")
                    if moved:
                        break
            step /= 2
        return best
