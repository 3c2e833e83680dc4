"""Find Helm, or install it from the Go module proxy into the cache outside the repository.

    .venv/bin/python -P tests/deploy/helmtool.py        # prints the path of a helm binary, installing it if needed

Order: `$NPUSERVE_HELM`; the pinned build in the cache; any other Helm 3 in the cache; `helm` on PATH (Helm 3 only);
otherwise `go install helm.sh/helm/v3/cmd/helm@HELM_VERSION` at the lowest CPU priority. The cache layout, the
version and the build flags are the ones of the local cluster harness (e2e/cluster/localk8s.py), so a machine builds
Helm once for both: `$NPUSERVE_CACHE_DIR` (default `${XDG_CACHE_HOME:-~/.cache}/npuserve`)/helm/<version>/bin/helm,
one builder at a time under `helm/<version>/.lock`. The version ldflags make `helm version` honest and give
`helm lint`/`helm template` Kubernetes 1.34 as their default capabilities.
Stdlib only.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HELM_VERSION = "v3.19.5"
HELM_PACKAGE = "helm.sh/helm/v3/cmd/helm"
KUBE_MAJOR, KUBE_MINOR = "1", "34"  # the default capabilities baked in (the local cluster's Kubernetes)


def cache_dir() -> Path:
    explicit = os.environ.get("NPUSERVE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "npuserve"


def pinned_path() -> Path:
    return cache_dir() / "helm" / HELM_VERSION / "bin" / "helm"


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
    candidates = [pinned_path()]
    candidates += sorted((cache_dir() / "helm").glob("v3.*/bin/helm"), reverse=True)
    candidates.append(cache_dir() / "bin" / "helm")
    on_path = shutil.which("helm")
    if on_path:
        candidates.append(Path(on_path))
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK) and _is_helm3(candidate):
            return candidate
    return None


def _ldflags() -> str:
    return " ".join(
        [
            "-s -w",
            f"-X helm.sh/helm/v3/internal/version.version={HELM_VERSION}",
            "-X helm.sh/helm/v3/internal/version.gitTreeState=clean",
            f"-X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor={KUBE_MAJOR}",
            f"-X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor={KUBE_MINOR}",
            f"-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor={KUBE_MAJOR}",
            f"-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor={KUBE_MINOR}",
        ]
    )


def install_helm() -> Path:
    """`go install` the pinned Helm into the cache (a few minutes on two cores; the module download is most of it
    on a cold Go cache). Safe to call from several processes at once."""
    exe = pinned_path()
    bin_dir = exe.parent
    bin_dir.parent.mkdir(parents=True, exist_ok=True)
    with (bin_dir.parent / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if exe.exists():
            return exe
        go = shutil.which("go")
        if go is None:
            raise RuntimeError(f"Helm is not installed and Go is not on PATH to build it; install Go, or put a Helm 3 "
                               f"binary on PATH or at {exe}, or point NPUSERVE_HELM at one")
        tmp = bin_dir.with_name("bin.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        nice = ["nice", "-n", os.environ.get("NPUSERVE_BUILD_NICE", "19")] if shutil.which("nice") else []
        env = dict(os.environ, GOBIN=str(tmp), GOFLAGS="-mod=mod -buildvcs=false", GOWORK="off", CGO_ENABLED="0")
        started = time.monotonic()
        print(f"installing {HELM_PACKAGE}@{HELM_VERSION} into {bin_dir} ...", file=sys.stderr, flush=True)
        proc = subprocess.run(
            [*nice, go, "install", "-trimpath", "-ldflags", _ldflags(), f"{HELM_PACKAGE}@{HELM_VERSION}"],
            env=env, capture_output=True, text=True,
        )
        if proc.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise RuntimeError(f"go install {HELM_PACKAGE}@{HELM_VERSION} failed:\n{proc.stdout}\n{proc.stderr}")
        shutil.rmtree(bin_dir, ignore_errors=True)
        tmp.rename(bin_dir)
        print(f"installed Helm {HELM_VERSION} in {time.monotonic() - started:.0f}s", file=sys.stderr, flush=True)
    return exe


def ensure_helm() -> Path:
    return find_helm() or install_helm()


if __name__ == "__main__":
    print(ensure_helm())
