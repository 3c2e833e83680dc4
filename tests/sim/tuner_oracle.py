"""The noise table's ceiling (docs/operator.md, "How the tuner decides, under noise"): how many of its seeds could end
with a certain claim at a batch within 5% of the optimum, had the search known that batch from its first trial and
spent every window of its budget there. It runs the noise table's own setups, noise (`_noisy`: +-noise per window and
the batch's fixed jitter) and judge (the tuner's `_digest`: the pooled claim, its noise estimate, the engine model's
proof), one batch at a time; no search. A search spends windows finding the batch (the plan's start first), so a row
needs its ceiling well above issue 33's 18 of 20 at fewer windows than the budget; windows elsewhere add a search
only degrees of freedom to the noise estimate and the engine model's proof.

    .venv/bin/python tests/sim/tuner_oracle.py 32b firstTokenAndDecode --noise 0.1 --batches 195,200,205

prints, per batch and supportSelectBatch arm, its noise-free tok/s over the optimum's and latencies over their
bounds, and the number of seeds certain after 2, 3, ... windows. Not collected by pytest (no test here): a
measurement tool.
"""

from __future__ import annotations

import argparse
import math

import test_tuner_on_simulator as table  # type: ignore[import-not-found]

from npuserve.planning import tuner
from npuserve.planning.problem import TuningProblem
from npuserve.planning.tuner import Trial


def first_certain(setup: table.Setup, arm: TuningProblem, batch: int, noise: float, seed: int) -> float:
    """The windows at `batch` after which the judge first finds it certain (inf: not within the budget)."""
    noisy = table._under_noise(arm, noise)
    measure = table._noisy(setup, noisy, noise, seed)
    schedule = arm.schedule_for(batch)
    trials: list[Trial] = []
    for n in range(1, noisy.max_trials + 1):
        trials.append(Trial(schedule=schedule, metrics=measure(schedule)))
        if tuner._digest(noisy, trials).points[0].proof is not None:
            return n
    return math.inf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("setup", choices=sorted({**table.SETUPS, **table.NOISE_SETUPS}))
    parser.add_argument("objective", choices=["decodeLatency", "firstTokenAndDecode"])
    parser.add_argument("--noise", type=float, default=0.10, choices=sorted(table.BUDGET))
    parser.add_argument("--batches", required=True, help="maxBatchSize values, comma-separated")
    args = parser.parse_args()
    setup = table._for_objective(table._setup(args.setup), args.objective)
    exact = table._problem(setup, args.objective, **table._noise_bounds(setup)[args.objective])
    best = table._optimum(setup, exact)
    budget = table.BUDGET[args.noise]
    batches = [int(b) for b in args.batches.split(",")]
    print(f"{setup.name}, {args.objective}, {args.noise:.0%} noise, {table.NOISE_SEEDS} seeds, budget {budget}; "
          f"the optimum {best:.0f} tok/s")
    for arm in table._arms(exact):
        setup.prefetch(arm.schedule_for(b) for b in batches)
        for b in batches:
            truth = setup.cached(arm.schedule_for(b))
            ratios = {k: arm.latency(truth, k) / bound for k, bound in arm.bounds().items()}
            firsts = [first_certain(setup, arm, b, args.noise, seed) for seed in range(table.NOISE_SEEDS)]
            certain = ", ".join(f"{n}: {sum(f <= n for f in firsts)}" for n in range(2, budget + 1))
            select = arm.pinned.get("supportSelectBatch", arm.schedule_for(b).supportSelectBatch)
            print(f"maxBatchSize {b} (supportSelectBatch {select}): {truth.outputTokensPerSecond / best:.3f} of the "
                  f"optimum's tok/s, " + ", ".join(f"{k.upper()} {r:.3f}x" for k, r in ratios.items())
                  + f" the bound; seeds certain after n windows: {certain}")


if __name__ == "__main__":
    main()
