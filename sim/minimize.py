"""Nelder-Mead over a few unbounded coordinates (the CPU profile's fit: `cpu_profile`). Small on purpose: the fit has
four parameters and an objective that costs microseconds, and the simulator must not depend on scipy. The cost model
is piecewise linear (maxima of its terms), so a derivative-free simplex with restarts is the robust choice."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def nelder_mead(f: Callable[[list[float]], float], start: Sequence[float], *, step: float = 1.0,
                iterations: int = 2000, tolerance: float = 1e-10) -> tuple[list[float], float]:
    """The minimum of `f` found from `start` (standard coefficients: reflect 1, expand 2, contract 0.5, shrink
    0.5); returns (point, value)."""
    n = len(start)
    simplex = [list(start)] + [[x + (step if i == j else 0.0) for j, x in enumerate(start)] for i in range(n)]
    values = [f(p) for p in simplex]
    for _ in range(iterations):
        order = sorted(range(n + 1), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] <= tolerance * (abs(values[0]) + tolerance):
            break
        centroid = [sum(p[j] for p in simplex[:-1]) / n for j in range(n)]
        worst = simplex[-1]

        def toward(t: float, worst: list[float] = worst, centroid: list[float] = centroid) -> list[float]:
            return [c + t * (w - c) for c, w in zip(centroid, worst, strict=True)]

        reflected = toward(-1.0)
        fr = f(reflected)
        if fr < values[0]:
            expanded = toward(-2.0)
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = toward(0.5) if fr >= values[-1] else toward(-0.5)
            fc = f(contracted)
            if fc < min(fr, values[-1]):
                simplex[-1], values[-1] = contracted, fc
            else:  # shrink towards the best
                best = simplex[0]
                simplex = [best] + [[b + 0.5 * (x - b) for b, x in zip(best, p, strict=True)] for p in simplex[1:]]
                values = [values[0]] + [f(p) for p in simplex[1:]]
    i = min(range(n + 1), key=values.__getitem__)
    return simplex[i], values[i]
