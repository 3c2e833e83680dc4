"""The CPU engine as a calibration source (issue 32; docs/simulator.md, "The CPU engine as a source"): fits the
`cpu` profile on model A's steps on the real CPU engine, serves model B under a closed-loop load with `npuserve
serve` and this project's load generator, predicts that run with `simulate()`, and prints the fit (each term's value,
bound, source), the fit's in-sample residuals and the prediction table. Asserts nothing (a shared, noisy machine):
tests/sim/test_cpu_calibration.py holds the targets.

    .venv/bin/python benchmarks/cpu_calibration.py [--workdir DIR] [--users 6] [--prompts 36]

The text is `npuserve.sim.cpu_validation.cpu_report`, which the test and benchmarks/simulator_calibration.py print too.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from npuserve.sim.cpu_validation import LoadPlan, cpu_report, run_cpu_calibration


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, help="where the two dummy models go (default: a temporary folder)")
    parser.add_argument("--users", type=int, default=LoadPlan().users)
    parser.add_argument("--prompts", type=int, default=LoadPlan().num_prompts)
    args = parser.parse_args()
    load = LoadPlan(users=args.users, num_prompts=args.prompts)
    with tempfile.TemporaryDirectory() as tmp:
        print(cpu_report(run_cpu_calibration(args.workdir or Path(tmp), load)))


if __name__ == "__main__":
    main()
