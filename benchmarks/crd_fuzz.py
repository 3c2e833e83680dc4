"""Thousands of machine-made InferenceService specs against the local cluster's API server and the operator's
planning: the property test `tests/e2e/test_crd_properties.py` at a benchmark's count (`make test` runs 300).

It prints how the specs ended (refused by the API server naming the field, planned, refused by the planner, or
planned but not servable) and fails, as the test does, on a refusal that names no field, a server error, an
accepted spec the operator cannot parse, or an exception other than the planner's refusal.

    .venv/bin/python -P benchmarks/crd_fuzz.py [--examples 3000]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=3000)
    args = parser.parse_args()
    env = {**os.environ, "NPUSERVE_CRD_EXAMPLES": str(args.examples)}
    test = "tests/e2e/test_crd_properties.py::test_every_spec_is_refused_by_name_or_planned_or_refused_by_the_planner"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", test], cwd=REPO,
                          env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
