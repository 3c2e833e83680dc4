"""Find Helm, or install it the way the local cluster harness does.

    .venv/bin/python -P tests/deploy/helmtool.py        # prints the path of a helm binary, installing it if needed

Order: `$NPUSERVE_HELM`; the pinned build in the cache; any other Helm 3 in the cache; `helm` on PATH (Helm 3 only);
otherwise the harness's `install_helm` (e2e/cluster/localk8s.py: `go install` of the pinned version with the version
ldflags that make `helm version` honest and give `helm lint`/`helm template` Kubernetes 1.34 as their default
capabilities, cached outside the repository, one builder at a time). One build serves the chart tests and the
cluster. Stdlib only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

# The harness lives outside the package; import it by its folder (never the repository root: `operator/`).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "e2e" / "cluster"))

import localk8s


def _is_helm3(path: Path | str) -> bool:
    try:
        out = subprocess.run([str(path), "version", "--short"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and out.stdout.strip().startswith("v3.")


def find_helm() -> Path | None:
    """A Helm 3 binary already on this machine, or None."""
    explicit = os.environ.get("NPUSERVE_HELM")
    if explicit:
        return Path(explicit)
    cache = localk8s.cache_dir() / "helm"
    candidates = [localk8s.helm_bin_dir() / "helm", *sorted(cache.glob("v3.*/bin/helm"), reverse=True)]
    on_path = shutil.which("helm")
    if on_path:
        candidates.append(Path(on_path))
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK) and _is_helm3(candidate):
            return candidate
    return None


def ensure_helm() -> Path:
    return find_helm() or localk8s.install_helm()


if __name__ == "__main__":
    print(ensure_helm())
