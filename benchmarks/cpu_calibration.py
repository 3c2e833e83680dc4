"""The CPU engine as a calibration source (issue 32; docs/simulator.md, "The CPU engine as a source"): fits the
`cpu` profile on model A's steps on the real CPU engine, serves model B under a closed-loop load with `npuserve
serve` and this project's load generator, predicts that run with `simulate()`, and prints the fit (each term's value,
bound, source), the fit's in-sample residuals and the prediction table. Asserts nothing (a shared, noisy machine):
tests/sim/test_cpu_calibration.py holds the targets.

    .venv/bin/python benchmarks/cpu_calibration.py [--workdir DIR] [--users 6] [--prompts 36]

`cpu_report(calibration)` returns the same text, for benchmarks/simulator_calibration.py to import.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from npuserve.sim.cpu_validation import CpuCalibration, LoadPlan, median_abs_error, run_cpu_calibration


def cpu_report(calibration: CpuCalibration) -> str:
    profile = calibration.profile
    lines = ["CPU profile (fitted; efficiency 1.0: the figures are fitted whole)",
             f"  {'term':22s} {'value':>10s} {'unit':8s} {'bound':10s} source"]
    for term in calibration.terms:
        lines.append(f"  {term.name:22s} {term.value:10.4g} {term.unit:8s} {term.bound:10s} {term.source}")
    lines += ["", f"In sample (model A's steps; median |error| {profile.median_abs_error:.1%})",
              f"  {'step':26s} {'measured ms':>12s} {'model ms':>10s} {'error':>8s}"]
    for r in profile.residuals:
        lines.append(f"  {r.label:26s} {r.measured_s * 1e3:12.2f} {r.predicted_s * 1e3:10.2f} {r.error:+8.1%}")
    rows = calibration.rows
    lines += ["", f"Predicted out of sample: {rows[0].source}; KV blocks {calibration.served.kv_blocks} (the "
              f"engine's /info); median |error| {median_abs_error(rows):.1%}, worst "
              f"{max(abs(r.error) for r in rows):.1%} (targets 15% / 25%)",
              f"  {'figure':16s} {'measured':>10s} {'predicted':>10s} {'error':>8s}"]
    for row in rows:
        lines.append(f"  {row.figure:16s} {row.measured:10.2f} {row.predicted:10.2f} {row.error:+8.1%}")
    return "\n".join(lines)


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
