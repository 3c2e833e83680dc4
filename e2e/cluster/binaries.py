"""The binaries of the local cluster: Kubernetes built from the Go module proxy, KWOK, Helm and Prometheus
`go install`ed, the LeaderWorkerSet controller built from its module (with its CRD beside it), all cached outside the
repository by version (file locks: one builder at a time); Debian's etcd; the `npuserve` the engines run with.
Standard library only."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from processes import log

# ---- pinned versions -------------------------------------------------------------------------------------------
# Kubernetes: the newest 1.34 patch whose checksums are in the Go checksum database; etcd 3.4 (Debian bookworm)
# still serves it (1.35+ wants etcd 3.5+). GO_TOOLCHAIN is the Go the release itself is built with (.go-version).
K8S_VERSION = "v1.34.10"
GO_TOOLCHAIN = "go1.25.12"
KWOK_VERSION = "v0.7.0"
HELM_VERSION = "v3.19.5"
# Prometheus publishes v3.X.Y as the Go module version v0.3XX.Y. 3.16's go.mod has no replace or exclude directives
# (3.15's has), so `go install pkg@version` builds it, and its service discovery mechanisms are build tags, so only
# Kubernetes' is compiled in.
PROMETHEUS_VERSION = "v3.16.0"
PROMETHEUS_MODULE_VERSION = "v0.316.0"
# LeaderWorkerSet (sigs.k8s.io/lws): the controller that runs a replica whose ranks span pods. Its go.mod has no
# replace directives; its main package is sigs.k8s.io/lws/cmd.
LWS_VERSION = "v0.7.0"
LWS_MODULE = "sigs.k8s.io/lws"
LWS_CRD = "leaderworkerset.x-k8s.io_leaderworkersets.yaml"

K8S_BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")

REPO_ROOT = Path(__file__).resolve().parents[2]


# ---- where they go --------------------------------------------------------------------------------------------------
def cache_dir() -> Path:
    explicit = os.environ.get("NPUSERVE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "npuserve"


@dataclass(frozen=True)
class Binaries:
    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kubectl: Path
    etcd: Path
    kwok: Path
    helm: Path
    prometheus: Path
    lws_controller: Path
    lws_crd: Path


def k8s_bin_dir(version: str = K8S_VERSION) -> Path:
    return cache_dir() / "k8s" / version / "bin"


def kwok_bin_dir() -> Path:
    return cache_dir() / "kwok" / KWOK_VERSION / "bin"


def helm_bin_dir() -> Path:
    return cache_dir() / "helm" / HELM_VERSION / "bin"


def prometheus_bin_dir() -> Path:
    return cache_dir() / "prometheus" / PROMETHEUS_VERSION / "bin"


def lws_dir() -> Path:
    """The LeaderWorkerSet controller's cache folder: bin/lws-controller and crd/<the CRD's file>."""
    return cache_dir() / "lws" / LWS_VERSION


def _go_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["GOWORK"] = "off"
    env["CGO_ENABLED"] = "0"
    env.update(extra)
    return env


def _nice() -> list[str]:
    """Builds run at the lowest priority: the machines that run them are shared."""
    level = os.environ.get("NPUSERVE_BUILD_NICE", "19")
    return ["nice", "-n", level] if level != "0" and shutil.which("nice") else []


def _run(cmd: Sequence[str], *, cwd: Path | None = None, env: Mapping[str, str] | None = None) -> str:
    log("$ " + " ".join(cmd))
    proc = subprocess.run(list(cmd), cwd=cwd, env=dict(env) if env else None, text=True, capture_output=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive flock: one builder per cache entry, one start/stop per cluster folder (parallel make runs)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


_STAGING_RE = re.compile(r"^\s*(k8s\.io/[A-Za-z0-9._-]+)\s+=>\s+\./staging/", re.MULTILINE)


def staging_modules(kubernetes_go_mod: str) -> list[str]:
    """The staging modules a k8s.io/kubernetes go.mod replaces with ./staging/... paths."""
    return sorted(set(_STAGING_RE.findall(kubernetes_go_mod)))


def wrapper_go_mod(version: str, kubernetes_go_mod: str) -> str:
    """go.mod of a module that can build k8s.io/kubernetes' commands at `version` from published modules."""
    staging = staging_modules(kubernetes_go_mod)
    if not staging:
        raise RuntimeError("no staging replace directives found in k8s.io/kubernetes' go.mod")
    staging_version = "v0." + version.removeprefix("v").split(".", 1)[1]  # v1.34.10 -> v0.34.10
    go_line = re.search(r"^go\s+(\S+)", kubernetes_go_mod, re.MULTILINE)
    godebug = re.search(r"^godebug\s+\S.*$", kubernetes_go_mod, re.MULTILINE)
    lines = ["module npuserve.local/k8s-build", "", f"go {go_line.group(1) if go_line else '1.24.0'}", ""]
    if godebug:
        lines += [godebug.group(0), ""]
    lines += [f"require k8s.io/kubernetes {version}", "", "replace ("]
    lines += [f"\t{m} => {m} {staging_version}" for m in staging]
    lines += [")", ""]
    return "\n".join(lines)


def _version_ldflags(version: str, build_date: str) -> str:
    major, minor = version.removeprefix("v").split(".")[:2]
    flags = ["-s", "-w"]
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [
            f"-X {pkg}.gitVersion={version}",
            f"-X {pkg}.gitMajor={major}",
            f"-X {pkg}.gitMinor={minor}",
            f"-X {pkg}.gitTreeState=clean",
            f"-X {pkg}.buildDate={build_date}",
        ]
    return " ".join(flags)


def build_kubernetes(version: str = K8S_VERSION, toolchain: str = GO_TOOLCHAIN) -> Path:
    """Build the four Kubernetes binaries into the cache (no-op when they are there). Returns the bin folder."""
    root = cache_dir() / "k8s" / version
    bin_dir = root / "bin"
    stamp = root / ".complete"
    if stamp.exists() and all((bin_dir / b).exists() for b in K8S_BINARIES):
        return bin_dir
    with file_lock(root.with_suffix(".lock")):
        if stamp.exists() and all((bin_dir / b).exists() for b in K8S_BINARIES):
            return bin_dir
        if not shutil.which("go"):
            raise RuntimeError("Go is needed to build Kubernetes (https://go.dev/doc/install)")
        started = time.monotonic()
        log(f"building Kubernetes {version} with {toolchain} (first use; tens of minutes on 2 cores)")
        # GOTOOLCHAIN pins the Go the release is built with; `go` fetches it as a module on first use.
        env = _go_env(GOTOOLCHAIN=toolchain, GOFLAGS="-mod=mod -trimpath -buildvcs=false")
        src = root / "src"
        src.mkdir(parents=True, exist_ok=True)
        info = json.loads(_run(["go", "mod", "download", "-json", f"k8s.io/kubernetes@{version}"], cwd=src, env=env))
        if info.get("Error"):
            raise RuntimeError(f"go mod download k8s.io/kubernetes@{version}: {info['Error']}")
        kubernetes_go_mod = Path(info["GoMod"]).read_text()
        (src / "go.mod").write_text(wrapper_go_mod(version, kubernetes_go_mod))
        (src / "go.sum").unlink(missing_ok=True)
        build_date = "1970-01-01T00:00:00Z"
        if info.get("Info"):
            build_date = str(json.loads(Path(info["Info"]).read_text()).get("Time") or build_date)
        tmp_bin = root / "bin.tmp"
        shutil.rmtree(tmp_bin, ignore_errors=True)
        tmp_bin.mkdir(parents=True)
        pkgs = [f"k8s.io/kubernetes/cmd/{b}" for b in K8S_BINARIES]
        ldflags = _version_ldflags(version, build_date)
        _run([*_nice(), "go", "build", "-o", str(tmp_bin) + "/", "-ldflags", ldflags, *pkgs], cwd=src, env=env)
        shutil.rmtree(bin_dir, ignore_errors=True)
        tmp_bin.rename(bin_dir)
        seconds = round(time.monotonic() - started)
        stamp.write_text(json.dumps({"version": version, "toolchain": toolchain, "build_seconds": seconds}) + "\n")
        log(f"built Kubernetes {version} in {time.monotonic() - started:.0f}s -> {bin_dir}")
    return bin_dir


def _go_install(
    package: str, version: str, bin_dir: Path, ldflags: str = "", tags: str = "", also: Sequence[str] = ()
) -> Path:
    """`go install` of `package` (and the packages `also` of the same module) at `version` into `bin_dir`."""
    exe = bin_dir / package.rsplit("/", 1)[-1]
    exes = [exe, *(bin_dir / p.rsplit("/", 1)[-1] for p in also)]
    if all(e.exists() for e in exes):
        return exe
    with file_lock(bin_dir.parent / ".lock"):
        if all(e.exists() for e in exes):
            return exe
        if not shutil.which("go"):
            raise RuntimeError("Go is needed to install " + package)
        started = time.monotonic()
        tmp = bin_dir.with_name("bin.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        cmd = [*_nice(), "go", "install", "-trimpath"]
        if ldflags:
            cmd += ["-ldflags", ldflags]
        if tags:
            cmd += ["-tags", tags]
        targets = [f"{p}@{version}" for p in (package, *also)]
        _run([*cmd, *targets], env=_go_env(GOBIN=str(tmp), GOFLAGS="-buildvcs=false"))
        shutil.rmtree(bin_dir, ignore_errors=True)
        tmp.rename(bin_dir)
        log(f"installed {package}@{version} in {time.monotonic() - started:.0f}s")
    return exe


def install_kwok() -> Path:
    return _go_install(
        "sigs.k8s.io/kwok/cmd/kwok",
        KWOK_VERSION,
        kwok_bin_dir(),
        f"-s -w -X sigs.k8s.io/kwok/pkg/consts.Version={KWOK_VERSION.removeprefix('v')}",
    )


def install_helm() -> Path:
    major, minor = K8S_VERSION.removeprefix("v").split(".")[:2]
    return _go_install(
        "helm.sh/helm/v3/cmd/helm",
        HELM_VERSION,
        helm_bin_dir(),
        " ".join(
            [
                "-s -w",
                f"-X helm.sh/helm/v3/internal/version.version={HELM_VERSION}",
                "-X helm.sh/helm/v3/internal/version.gitTreeState=clean",
                f"-X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor={major}",
                f"-X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor={minor}",
                f"-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor={major}",
                f"-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor={minor}",
            ]
        ),
    )


def install_prometheus() -> Path:
    """Prometheus (and promtool beside it) with Kubernetes service discovery, the only one compiled in. Not a
    distribution's package: Debian's (bookworm's 2.42 included) is built without Kubernetes service discovery, so it
    cannot discover pods through the API server as a Prometheus Operator user's Prometheus does."""
    info = "github.com/prometheus/common/version"
    return _go_install(
        "github.com/prometheus/prometheus/cmd/prometheus",
        PROMETHEUS_MODULE_VERSION,
        prometheus_bin_dir(),
        f"-s -w -X {info}.Version={PROMETHEUS_VERSION.removeprefix('v')} -X {info}.Branch=HEAD",
        tags="remove_all_sd,enable_kubernetes_sd",
        also=["github.com/prometheus/prometheus/cmd/promtool"],
    )


def install_lws() -> tuple[Path, Path]:
    """The LeaderWorkerSet controller (`lws-controller`) and its CRD, from the module at LWS_VERSION. Returns the
    binary and the CRD's YAML (no-op when both are cached).

    Built inside the downloaded module with its own go.mod and go.sum, which pins exactly the dependencies that
    `go install sigs.k8s.io/lws/cmd@<version>` would; `go install pkg@version` also asks the proxy for the module's
    version list (to report a deprecation), and a proxy that refuses that list (HTTP 403) fails the install. The
    CRD is the module's generated `config/crd/bases` file, as `make install` of the project applies it."""
    root = lws_dir()
    exe, crd = root / "bin" / "lws-controller", root / "crd" / LWS_CRD
    if exe.exists() and crd.exists():
        return exe, crd
    with file_lock(root.with_suffix(".lock")):
        if exe.exists() and crd.exists():
            return exe, crd
        if not shutil.which("go"):
            raise RuntimeError("Go is needed to build the LeaderWorkerSet controller (https://go.dev/doc/install)")
        started = time.monotonic()
        log(f"building the LeaderWorkerSet controller {LWS_VERSION} (first use; minutes)")
        env = _go_env(GOFLAGS="-buildvcs=false")
        root.mkdir(parents=True, exist_ok=True)
        info = json.loads(_run(["go", "mod", "download", "-json", f"{LWS_MODULE}@{LWS_VERSION}"], cwd=root, env=env))
        if info.get("Error"):
            raise RuntimeError(f"go mod download {LWS_MODULE}@{LWS_VERSION}: {info['Error']}")
        module_dir = Path(info["Dir"])
        commit = str((info.get("Origin") or {}).get("Hash") or "")
        version_pkg = f"{LWS_MODULE}/pkg/version"
        ldflags = f"-s -w -X {version_pkg}.GitVersion={LWS_VERSION}" + (
            f" -X {version_pkg}.GitCommit={commit}" if commit else ""
        )
        tmp = root / "tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "bin").mkdir(parents=True)
        (tmp / "crd").mkdir()
        _run(
            [*_nice(), "go", "build", "-trimpath", "-ldflags", ldflags, "-o", str(tmp / "bin" / exe.name), "./cmd"],
            cwd=module_dir,
            env=env,
        )
        shutil.copyfile(module_dir / "config" / "crd" / "bases" / LWS_CRD, tmp / "crd" / LWS_CRD)
        for sub in ("bin", "crd"):
            shutil.rmtree(root / sub, ignore_errors=True)
            (tmp / sub).rename(root / sub)
        shutil.rmtree(tmp, ignore_errors=True)
        seconds = time.monotonic() - started
        (root / ".complete").write_text(json.dumps({"version": LWS_VERSION, "build_seconds": round(seconds)}) + "\n")
        log(f"built the LeaderWorkerSet controller {LWS_VERSION} in {seconds:.0f}s -> {exe}")
    return exe, crd


def ensure_prometheus() -> Path:
    """The Prometheus the cluster runs: $NPUSERVE_PROMETHEUS (one with Kubernetes service discovery), else the pinned
    release built from the Go module proxy on first use."""
    explicit = os.environ.get("NPUSERVE_PROMETHEUS")
    return Path(explicit) if explicit else install_prometheus()


def find_etcd(install: bool = True) -> Path:
    """etcd from $NPUSERVE_ETCD, PATH, or Debian's etcd-server (installed with apt-get when missing)."""
    explicit = os.environ.get("NPUSERVE_ETCD")
    if explicit:
        return Path(explicit)
    found = shutil.which("etcd") or (Path("/usr/bin/etcd").exists() and "/usr/bin/etcd")
    if found:
        return Path(found)
    if not install or not shutil.which("apt-get"):
        raise RuntimeError("etcd not found: install Debian's etcd-server (apt-get install etcd-server)")
    sudo = [] if os.geteuid() == 0 else ["sudo"]
    log("installing etcd-server with apt-get")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    _run([*sudo, "apt-get", "update", "-qq"], env=env)
    _run([*sudo, "apt-get", "install", "-y", "-qq", "--no-install-recommends", "etcd-server"], env=env)
    # The package may start a system etcd on the default ports; ours uses its own ports and data dir.
    found = shutil.which("etcd") or "/usr/bin/etcd"
    return Path(found)


def ensure_binaries(with_helm: bool = True) -> Binaries:
    """Everything the local cluster needs, built or installed on first use. Helm first: the chart's tests need only
    it, and a test run builds all of this in the background while its first tests run (tests/conftest.py)."""
    helm = install_helm() if with_helm else helm_bin_dir() / "helm"
    bin_dir = build_kubernetes()
    kwok = install_kwok()
    lws_controller, lws_crd = install_lws()
    return Binaries(
        kube_apiserver=bin_dir / "kube-apiserver",
        kube_controller_manager=bin_dir / "kube-controller-manager",
        kube_scheduler=bin_dir / "kube-scheduler",
        kubectl=bin_dir / "kubectl",
        etcd=find_etcd(),
        kwok=kwok,
        helm=helm,
        prometheus=ensure_prometheus(),
        lws_controller=lws_controller,
        lws_crd=lws_crd,
    )


# ---- npuserve (the engines the process kubelet runs) --------------------------------------------------------------
def default_npuserve() -> str:
    """The `npuserve` beside this Python, else the repository's virtual environment's, else the one on PATH."""
    beside = Path(sys.executable).parent / "npuserve"
    if beside.exists():
        return str(beside)
    repo_venv = REPO_ROOT / ".venv" / "bin" / "npuserve"
    return str(repo_venv) if repo_venv.exists() else (shutil.which("npuserve") or str(repo_venv))


def kubelet_python() -> str:
    """The Python to run the process kubelet with: the one beside `default_npuserve()` (it needs the `kubernetes`
    client of npuserve's environment), else this one."""
    beside = Path(default_npuserve()).with_name("python")
    return str(beside) if beside.exists() else sys.executable
