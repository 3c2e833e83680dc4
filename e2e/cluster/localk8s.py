"""A local Kubernetes control plane without containers, for the end-to-end tests (DESIGN.md section 6).

Binaries: kube-apiserver, kube-controller-manager, kube-scheduler and kubectl are built from the Go module proxy on
first use (a wrapper go.mod requiring ``k8s.io/kubernetes`` and replacing each staging module with its published
``v0.X.Y``), KWOK and Helm are ``go install``ed, etcd is Debian's ``etcd-server``. Everything is cached outside the
repository, keyed by version, under ``$NPUSERVE_CACHE_DIR`` (default ``${XDG_CACHE_HOME:-~/.cache}/npuserve``).

Cluster: etcd, kube-apiserver (RBAC), kube-controller-manager, kube-scheduler and KWOK managing two fake nodes with
``huawei.com/Ascend910`` as an extended resource; pods get loopback IPs (127.1.0.0/16). State, logs, PIDs and the
kubeconfig live in ``.cluster/`` (``$NPUSERVE_CLUSTER_DIR``). ``up()`` and ``down()`` are what ``make cluster-up`` /
``make cluster-down`` and the pytest fixtures call.

This file is imported by path (its folder on sys.path) or run through ``cluster.py``; never put the repository root
on sys.path, its ``operator/`` folder shadows the standard library module.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import http.client
import json
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import kubelet

# ---- pinned versions -------------------------------------------------------------------------------------------
# Kubernetes: the newest 1.34 patch whose checksums are in the Go checksum database; etcd 3.4 (Debian bookworm)
# still serves it (1.35+ wants etcd 3.5+). GO_TOOLCHAIN is the Go the release itself is built with (.go-version).
K8S_VERSION = "v1.34.10"
GO_TOOLCHAIN = "go1.25.12"
KWOK_VERSION = "v0.7.0"
HELM_VERSION = "v3.19.5"

K8S_BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")

REPO_ROOT = Path(__file__).resolve().parents[2]

# The extended resource and the two fake nodes.
ACCELERATOR_RESOURCE = "huawei.com/Ascend910"
NODE_NAMES = ("npu-node-0", "npu-node-1")
NPUS_PER_NODE = 8
POD_CIDR = "127.1.0.1/16"


def log(msg: str) -> None:
    print(f"[cluster] {msg}", file=sys.stderr, flush=True)


# ---- binaries --------------------------------------------------------------------------------------------------
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


def k8s_bin_dir(version: str = K8S_VERSION) -> Path:
    return cache_dir() / "k8s" / version / "bin"


def kwok_bin_dir() -> Path:
    return cache_dir() / "kwok" / KWOK_VERSION / "bin"


def helm_bin_dir() -> Path:
    return cache_dir() / "helm" / HELM_VERSION / "bin"


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
def _file_lock(path: Path) -> Iterator[None]:
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
    with _file_lock(root.with_suffix(".lock")):
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


def _go_install(package: str, version: str, bin_dir: Path, ldflags: str = "") -> Path:
    exe = bin_dir / package.rsplit("/", 1)[-1]
    if exe.exists():
        return exe
    with _file_lock(bin_dir.parent / ".lock"):
        if exe.exists():
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
        _run([*cmd, f"{package}@{version}"], env=_go_env(GOBIN=str(tmp), GOFLAGS="-buildvcs=false"))
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
    """Everything the local cluster needs, built or installed on first use."""
    bin_dir = build_kubernetes()
    kwok = install_kwok()
    helm = install_helm() if with_helm else helm_bin_dir() / "helm"
    return Binaries(
        kube_apiserver=bin_dir / "kube-apiserver",
        kube_controller_manager=bin_dir / "kube-controller-manager",
        kube_scheduler=bin_dir / "kube-scheduler",
        kubectl=bin_dir / "kubectl",
        etcd=find_etcd(),
        kwok=kwok,
        helm=helm,
    )


# ---- cluster ---------------------------------------------------------------------------------------------------
# Ports avoid the usual ones (2379/2380/6443/10257/10259/10247) so a real cluster on the machine does not clash.
PORT_DEFAULTS: dict[str, tuple[str, int]] = {
    "etcd": ("NPUSERVE_ETCD_PORT", 23790),
    "etcd_peer": ("NPUSERVE_ETCD_PEER_PORT", 23800),
    "apiserver": ("NPUSERVE_APISERVER_PORT", 26443),
    "controller_manager": ("NPUSERVE_CONTROLLER_MANAGER_PORT", 20257),
    "scheduler": ("NPUSERVE_SCHEDULER_PORT", 20259),
    "kwok": ("NPUSERVE_KWOK_PORT", 20247),
    "kubelet": ("NPUSERVE_KUBELET_PORT", 20250),
}
# Start order; stop runs it backwards.
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "kubelet")
SERVICE_CIDR = "10.0.0.0/24"
SERVICE_IP = "10.0.0.1"


def state_dir() -> Path:
    explicit = os.environ.get("NPUSERVE_CLUSTER_DIR")
    return Path(explicit).expanduser().resolve() if explicit else REPO_ROOT / ".cluster"


def ports_from_env() -> dict[str, int]:
    return {name: int(os.environ.get(var) or default) for name, (var, default) in PORT_DEFAULTS.items()}


@dataclass
class Cluster:
    """A running local cluster, as recorded in its state folder."""

    dir: Path
    ports: dict[str, int]
    binaries: Binaries

    @property
    def kubeconfig(self) -> Path:
        return self.dir / "kubeconfig"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports['apiserver']}"

    @property
    def pki(self) -> Path:
        return self.dir / "pki"

    def env(self) -> dict[str, str]:
        """Environment for tools run against the cluster (kubectl, helm, kopf)."""
        return dict(os.environ, KUBECONFIG=str(self.kubeconfig))

    def kubectl(self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60) -> str:
        cmd = [str(self.binaries.kubectl), f"--kubeconfig={self.kubeconfig}", *args]
        proc = subprocess.run(cmd, input=input, text=True, capture_output=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc.stdout

    def kubectl_json(self, *args: str) -> dict[str, object]:
        out: dict[str, object] = json.loads(self.kubectl(*args, "-o", "json"))
        return out

    def ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        ctx.load_cert_chain(str(self.pki / "admin.crt"), str(self.pki / "admin.key"))
        return ctx

    def api_get(self, path: str, timeout: float = 5) -> tuple[int, str]:
        """GET on the API server with the admin credentials: (status, body)."""
        return _https_get("127.0.0.1", self.ports["apiserver"], path, self.ssl_context(), timeout)

    def ready(self) -> bool:
        try:
            return self.api_get("/readyz")[0] == 200
        except OSError:
            return False


# ---- processes: started detached, recorded as "pid starttime" so stop ends exactly those --------------------------
_children: dict[int, subprocess.Popen[bytes]] = {}


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks) of a live process, None if there is none."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return fields[0], int(fields[19])


def _reap(pid: int) -> None:
    proc = _children.pop(pid, None)
    if proc is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0)
        if proc.returncode is None:
            _children[pid] = proc
        return
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def _alive(pid: int, starttime: int) -> bool:
    _reap(pid)
    stat = _proc_stat(pid)
    return stat is not None and stat[1] == starttime and stat[0] not in ("Z", "X")


def _pid_file(cdir: Path, name: str) -> Path:
    return cdir / "pids" / f"{name}.pid"


def _read_pid(cdir: Path, name: str) -> tuple[int, int] | None:
    try:
        pid, start = _pid_file(cdir, name).read_text().split()
        return int(pid), int(start)
    except (OSError, ValueError):
        return None


def _spawn(cdir: Path, name: str, cmd: Sequence[str], env: Mapping[str, str] | None = None) -> int:
    (cdir / "logs").mkdir(parents=True, exist_ok=True)
    (cdir / "pids").mkdir(parents=True, exist_ok=True)
    with (cdir / "logs" / f"{name}.log").open("ab") as logf:
        logf.write(("\n# " + " ".join(cmd) + "\n").encode())
        logf.flush()
        proc = subprocess.Popen(
            list(cmd),
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=subprocess.STDOUT,
            cwd=cdir,
            env=dict(env) if env is not None else None,
            start_new_session=True,  # outlives `cluster.py up`; not hit by the terminal's Ctrl-C
        )
    _children[proc.pid] = proc
    stat = _proc_stat(proc.pid)
    if stat is None:
        raise RuntimeError(f"{name} exited at once; see {cdir / 'logs' / (name + '.log')}")
    _pid_file(cdir, name).write_text(f"{proc.pid} {stat[1]}\n")
    return proc.pid


def _stop_one(cdir: Path, name: str, grace: float = 15) -> bool:
    """End the process recorded for `name`, if it is still the one we started. True if one was ended."""
    rec = _read_pid(cdir, name)
    _pid_file(cdir, name).unlink(missing_ok=True)
    if rec is None or not _alive(*rec):
        return False
    pid, start = rec
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not _alive(pid, start):
            return True
        time.sleep(0.1)
    log(f"{name} (pid {pid}) did not stop in {grace:.0f}s; killing it")
    os.kill(pid, signal.SIGKILL)
    while _alive(pid, start):
        time.sleep(0.05)
    return True


def _running_components(cdir: Path) -> dict[str, bool]:
    out = {}
    for name in COMPONENTS:
        rec = _read_pid(cdir, name)
        out[name] = rec is not None and _alive(*rec)
    return out


# ---- HTTP probes -----------------------------------------------------------------------------------------------
def _https_get(host: str, port: int, path: str, ctx: ssl.SSLContext | None, timeout: float) -> tuple[int, str]:
    conn: http.client.HTTPConnection
    if ctx is None:
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
    else:
        conn = http.client.HTTPSConnection(host, port, context=ctx, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    finally:
        conn.close()


def _insecure_ctx() -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def _wait_http(
    what: str,
    port: int,
    path: str,
    ctx: ssl.SSLContext | None,
    cdir: Path,
    name: str,
    timeout: float = 120,
) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        rec = _read_pid(cdir, name)
        if rec is None or not _alive(*rec):
            raise RuntimeError(f"{what} exited; last log lines:\n{_tail(cdir / 'logs' / (name + '.log'))}")
        try:
            status, body = _https_get("127.0.0.1", port, path, ctx, timeout=2)
            if status == 200:
                return
            last = f"HTTP {status}: {body[-500:]}"
        except OSError as exc:
            last = repr(exc)
        time.sleep(0.2)
    raise RuntimeError(f"{what} not ready after {timeout:.0f}s ({last}); log: {cdir / 'logs' / (name + '.log')}")


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _port_free(port: int) -> bool:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# ---- certificates (openssl) ------------------------------------------------------------------------------------
def _openssl(*args: str, cwd: Path) -> None:
    _quiet_run(["openssl", *args], cwd=cwd)


def _quiet_run(cmd: Sequence[str], cwd: Path | None = None) -> None:
    proc = subprocess.run(list(cmd), cwd=cwd, text=True, capture_output=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip()}")


def _issue_cert(pki: Path, name: str, subject: str, extensions: str) -> None:
    """An EC P-256 key and a certificate signed by the local CA."""
    (pki / f"{name}.ext").write_text(extensions)
    _openssl(
        "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject, cwd=pki,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-set_serial", "0x" + os.urandom(16).hex(), "-days", "3650", "-sha256",
        "-extfile", f"{name}.ext", "-out", f"{name}.crt", cwd=pki,
    )  # fmt: skip
    (pki / f"{name}.csr").unlink()
    (pki / f"{name}.ext").unlink()


def make_pki(pki: Path) -> None:
    """CA, API server serving cert, client certs (admin in system:masters, controller-manager, scheduler), SA key."""
    if not shutil.which("openssl"):
        raise RuntimeError("openssl not found (apt-get install openssl)")
    pki.mkdir(parents=True, exist_ok=True)
    os.chmod(pki, 0o700)
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", "ca.key", "-out", "ca.crt", "-days", "3650", "-sha256", "-subj", "/CN=npuserve-local-ca",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=pki,
    )  # fmt: skip
    sans = ",".join(
        [
            "IP:127.0.0.1",
            f"IP:{SERVICE_IP}",
            "DNS:localhost",
            "DNS:kubernetes",
            "DNS:kubernetes.default",
            "DNS:kubernetes.default.svc",
            "DNS:kubernetes.default.svc.cluster.local",
        ]
    )
    server_ext = f"subjectAltName={sans}\nextendedKeyUsage=serverAuth\nkeyUsage=critical,digitalSignature\n"
    client_ext = "extendedKeyUsage=clientAuth\nkeyUsage=critical,digitalSignature\n"
    _issue_cert(pki, "apiserver", "/CN=kube-apiserver", server_ext)
    _issue_cert(pki, "admin", "/O=system:masters/CN=npuserve-admin", client_ext)
    _issue_cert(pki, "controller-manager", "/CN=system:kube-controller-manager", client_ext)
    _issue_cert(pki, "scheduler", "/CN=system:kube-scheduler", client_ext)
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", "sa.key", cwd=pki)
    _openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def write_kubeconfig(path: Path, server: str, pki: Path, user: str) -> None:
    """A self-contained kubeconfig (certificates embedded) for one of the client certs."""
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "npuserve-local",
                "cluster": {"server": server, "certificate-authority-data": _b64(pki / "ca.crt")},
            }
        ],
        "users": [
            {
                "name": user,
                "user": {
                    "client-certificate-data": _b64(pki / f"{user}.crt"),
                    "client-key-data": _b64(pki / f"{user}.key"),
                },
            }
        ],
        "contexts": [{"name": "npuserve-local", "context": {"cluster": "npuserve-local", "user": user}}],
        "current-context": "npuserve-local",
    }
    path.write_text(json.dumps(cfg, indent=2) + "\n")  # JSON is YAML
    os.chmod(path, 0o600)


# ---- nodes -----------------------------------------------------------------------------------------------------
def fake_node(name: str, index: int) -> dict[str, object]:
    """A KWOK node: 8 Ascend 910 cards, two NUMA nodes of four cards each (as an Atlas 800 inference server)."""
    resources = {
        "cpu": "192",
        "memory": "1536Gi",
        "pods": "110",
        "ephemeral-storage": "1Ti",
        ACCELERATOR_RESOURCE: str(NPUS_PER_NODE),
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "node-role.kubernetes.io/agent": "",
                "type": "kwok",
                "accelerator": "huawei-Ascend910",  # the label the Ascend device plugin sets
                "npuserve.io/npu-count": str(NPUS_PER_NODE),
                "npuserve.io/numa-nodes": "2",
                "npuserve.io/numa0-npus": "0-3",
                "npuserve.io/numa1-npus": "4-7",
                "topology.kubernetes.io/zone": f"local-{index % 2}",
            },
        },
        "spec": {},
        "status": {"capacity": resources, "allocatable": resources},  # KWOK fills in conditions and nodeInfo
    }


# ---- up / down -------------------------------------------------------------------------------------------------
def _load_state(cdir: Path) -> dict[str, object] | None:
    try:
        data: dict[str, object] = json.loads((cdir / "state.json").read_text())
        return data
    except (OSError, ValueError):
        return None


def current(cdir: Path | None = None) -> Cluster | None:
    """The cluster recorded in the state folder if all its processes run and the API server is ready."""
    cdir = cdir or state_dir()
    state = _load_state(cdir)
    if state is None or not all(_running_components(cdir).values()):
        return None
    ports = {k: int(v) for k, v in dict(state["ports"]).items()}  # type: ignore[call-overload]
    bins = Binaries(**{k: Path(str(v)) for k, v in dict(state["binaries"]).items()})  # type: ignore[call-overload]
    cluster = Cluster(dir=cdir, ports=ports, binaries=bins)
    return cluster if cluster.ready() else None


def _clean_env() -> dict[str, str]:
    """The components must not pick up a developer's KUBECONFIG or ETCD_* settings."""
    return {k: v for k, v in os.environ.items() if not k.startswith("ETCD_") and k != "KUBECONFIG"}


def up(timeout: float = 180, owner: str = "cli") -> Cluster:
    """Start the local cluster (building the binaries on first use). Returns the running cluster if there is one.

    `owner` is recorded: a cluster started by the command line (`make cluster-up`) is never stopped by `release`."""
    cdir = state_dir()
    with _file_lock(cdir / ".lock"):
        return _up_locked(cdir, timeout, owner)


def acquire(timeout: float = 180) -> Cluster:
    """For test sessions: start the cluster if needed and register this process as a user of it. Sessions that run
    at the same time in the same checkout share one cluster; the last `release` stops it, unless `make cluster-up`
    started it."""
    cdir = state_dir()
    with _file_lock(cdir / ".lock"):
        cluster = _up_locked(cdir, timeout, owner="test")
        users = cdir / "users"
        users.mkdir(exist_ok=True)
        stat = _proc_stat(os.getpid())
        (users / f"{os.getpid()}-{stat[1] if stat else 0}").touch()
        return cluster


def release() -> bool:
    """Undo `acquire`: stop the cluster if no live user is left and a test session started it. True if stopped."""
    cdir = state_dir()
    with _file_lock(cdir / ".lock"):
        users = cdir / "users"
        me = os.getpid()
        live = 0
        for entry in users.glob("*-*") if users.exists() else []:
            pid_s, _, start_s = entry.name.partition("-")
            if int(pid_s) == me or not (start_s.isdigit() and _alive(int(pid_s), int(start_s))):
                entry.unlink(missing_ok=True)
            else:
                live += 1
        state = _load_state(cdir)
        if live or (state is not None and state.get("owner") == "cli"):
            return False
        return bool(_down_locked(cdir))


def _up_locked(cdir: Path, timeout: float, owner: str) -> Cluster:
    running = current(cdir)
    if running is not None:
        log(f"cluster already running (API server {running.server}); KUBECONFIG={running.kubeconfig}")
        state = _load_state(cdir)
        if owner == "cli" and state is not None and state.get("owner") != "cli":
            (cdir / "state.json").write_text(json.dumps({**state, "owner": "cli"}, indent=2) + "\n")  # keep it up
        return running
    if any(_running_components(cdir).values()):
        log("a previous cluster is partly running; stopping it first")
        _down_locked(cdir)
    bins = ensure_binaries(with_helm=False)
    started = time.monotonic()
    ports = ports_from_env()
    busy = [f"{n}={p} (set {PORT_DEFAULTS[n][0]})" for n, p in ports.items() if not _port_free(p)]
    if busy:
        raise RuntimeError("ports in use: " + ", ".join(busy))

    cdir.mkdir(parents=True, exist_ok=True)
    kubelet.sweep(cdir / "pods")  # engine processes of an earlier cluster whose kubelet was killed
    for sub in ("pki", "etcd-data", "logs", "pids", "config", "users", "pods"):
        shutil.rmtree(cdir / sub, ignore_errors=True)
    for f in ("kubeconfig", "state.json"):
        (cdir / f).unlink(missing_ok=True)
    pki, conf = cdir / "pki", cdir / "config"
    conf.mkdir()
    make_pki(pki)
    cluster = Cluster(dir=cdir, ports=ports, binaries=bins)
    write_kubeconfig(cluster.kubeconfig, cluster.server, pki, "admin")
    for user in ("controller-manager", "scheduler"):
        write_kubeconfig(conf / f"{user}.kubeconfig", cluster.server, pki, user)
    state = {
        "k8s_version": K8S_VERSION,
        "ports": ports,
        "binaries": {k: str(v) for k, v in bins.__dict__.items()},
        "server": cluster.server,
        "owner": owner,
    }
    (cdir / "state.json").write_text(json.dumps(state, indent=2) + "\n")
    env = _clean_env()
    try:
        _start_components(cluster, env, timeout)
        _create_nodes(cluster, timeout)
    except BaseException:
        log("start failed; stopping what was started (logs stay in " + str(cdir / "logs") + ")")
        _down_locked(cdir)
        raise
    log(
        f"cluster up in {time.monotonic() - started:.1f}s: API server {cluster.server}; KUBECONFIG={cluster.kubeconfig}"
    )
    return cluster


# KWOK's pod stages (they replace its default "fast" ones; the node stages stay the defaults). Pods whose
# container runs `npuserve serve` (render.engine_command) get Running and an IP but not Ready: the process kubelet
# (kubelet.py) runs the engine and sets readiness from its /ready. Other pods behave as KWOK's defaults: Ready at
# once. Each status stage matches only while the pod has no IP yet, so KWOK plays it once and never overwrites
# the kubelet's patches afterwards.
ENGINE_POD_QUERY = (
    '.spec.containers[] | (.command // []) | select(length >= 2) | (.[0] | split("/") | last) + " " + .[1]'
)
_POD_STATUS_COMMON = """
      initContainerStatuses:
      {{ range .spec.initContainers }}
      - image: {{ .image | Quote }}
        name: {{ .name | Quote }}
        ready: true
        restartCount: 0
        state:
          terminated:
            exitCode: 0
            finishedAt: {{ $now | Quote }}
            reason: Completed
            startedAt: {{ $now | Quote }}
      {{ end }}
      hostIP: {{ NodeIPWith .spec.nodeName | Quote }}
      podIP: {{ PodIPWith .spec.nodeName ( or .spec.hostNetwork false ) ( or .metadata.uid "" ) \
(or .metadata.name "" ) ( or .metadata.namespace "" ) | Quote }}
      phase: Running
      startTime: {{ $now | Quote }}
"""


def _pod_stage(name: str, engine: bool) -> str:
    ready, reason = ("False", "\n        reason: ContainersNotReady") if engine else ("True", "")
    state = (
        "waiting:\n            reason: ContainerCreating"
        if engine
        else "running:\n            startedAt: {{ $now | Quote }}"
    )
    return (
        f"""---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: {name}
spec:
  resourceRef:
    apiGroup: v1
    kind: Pod
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: 'DoesNotExist'
    - key: '.status.podIP'
      operator: 'DoesNotExist'
    - key: '{ENGINE_POD_QUERY}'
      operator: '{"In" if engine else "NotIn"}'
      values: ['npuserve serve']
  next:
    statusTemplate: |
      {{{{ $now := Now }}}}
      conditions:
      - lastTransitionTime: {{{{ $now | Quote }}}}
        status: "True"
        type: Initialized
      - lastTransitionTime: {{{{ $now | Quote }}}}
        status: "{ready}"
        type: Ready{reason}
      - lastTransitionTime: {{{{ $now | Quote }}}}
        status: "{ready}"
        type: ContainersReady{reason}
      {{{{ range .spec.readinessGates }}}}
      - lastTransitionTime: {{{{ $now | Quote }}}}
        status: "True"
        type: {{{{ .conditionType | Quote }}}}
      {{{{ end }}}}
      containerStatuses:
      {{{{ range .spec.containers }}}}
      - image: {{{{ .image | Quote }}}}
        name: {{{{ .name | Quote }}}}
        ready: {"false" if engine else "true"}
        restartCount: 0
        state:
          {state}
      {{{{ end }}}}"""
        + _POD_STATUS_COMMON
    )


def kwok_pod_stages() -> str:
    """KWOK Stage documents for pods: engine pods Running but not Ready, others Ready; Job pods complete; deleted
    pods go at once (KWOK's fast stages otherwise)."""
    complete_and_delete = """---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: pod-complete
spec:
  resourceRef:
    apiGroup: v1
    kind: Pod
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: 'DoesNotExist'
    - key: '.status.phase'
      operator: 'In'
      values: ['Running']
    - key: '.metadata.ownerReferences.[].kind'
      operator: 'In'
      values: ['Job']
  next:
    statusTemplate: |
      {{ $now := Now }}
      containerStatuses:
      {{ range .spec.containers }}
      - image: {{ .image | Quote }}
        name: {{ .name | Quote }}
        ready: false
        restartCount: 0
        started: false
        state:
          terminated:
            exitCode: 0
            finishedAt: {{ $now | Quote }}
            reason: Completed
            startedAt: {{ $now | Quote }}
      {{ end }}
      phase: Succeeded
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: pod-delete
spec:
  resourceRef:
    apiGroup: v1
    kind: Pod
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: 'Exists'
  next:
    finalizers:
      empty: true
    delete: true
"""
    return _pod_stage("pod-ready", engine=False) + _pod_stage("engine-pod-running", engine=True) + complete_and_delete


def _start_components(c: Cluster, env: Mapping[str, str], timeout: float) -> None:
    p, pki, conf, b, cdir = c.ports, c.pki, c.dir / "config", c.binaries, c.dir
    etcd_url, peer_url = f"http://127.0.0.1:{p['etcd']}", f"http://127.0.0.1:{p['etcd_peer']}"
    _spawn(
        cdir,
        "etcd",
        [
            str(b.etcd),
            "--name=default",
            f"--data-dir={cdir / 'etcd-data'}",
            f"--listen-client-urls={etcd_url}",
            f"--advertise-client-urls={etcd_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=default={peer_url}",
            "--initial-cluster-state=new",
            "--logger=zap",
            "--log-level=warn",
        ],
        env,
    )
    _wait_http("etcd", p["etcd"], "/health", None, cdir, "etcd", timeout)
    _spawn(
        cdir,
        "kube-apiserver",
        [
            str(b.kube_apiserver),
            f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={p['apiserver']}",
            f"--cert-dir={pki / 'apiserver-generated'}",
            f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--authorization-mode=RBAC",
            "--allow-privileged=true",
            "--endpoint-reconciler-type=none",  # loopback addresses are not valid Endpoints
            "--profiling=false",
            # 1.34 turns legacy watches (resourceVersion "" or "0") into watch-list streams, which need etcd's
            # RequestWatchProgress (3.4.31+/3.5.13+); Debian bookworm's etcd is 3.4.23, so those watches would fail
            # (KWOK's do, and its nodes go NotReady). Off, the API server serves them as 1.33 does.
            "--feature-gates=WatchList=false",
        ],
        env,
    )
    _wait_http("kube-apiserver", p["apiserver"], "/readyz", c.ssl_context(), cdir, "kube-apiserver", timeout)
    common = ["--leader-elect=false", "--bind-address=127.0.0.1", "--profiling=false"]
    kcm_kubeconfig = conf / "controller-manager.kubeconfig"
    _spawn(
        cdir,
        "kube-controller-manager",
        [
            str(b.kube_controller_manager),
            f"--kubeconfig={kcm_kubeconfig}",
            f"--authentication-kubeconfig={kcm_kubeconfig}",
            f"--authorization-kubeconfig={kcm_kubeconfig}",
            f"--secure-port={p['controller_manager']}",
            f"--root-ca-file={pki / 'ca.crt'}",
            f"--service-account-private-key-file={pki / 'sa.key'}",
            "--use-service-account-credentials=true",
            "--cluster-name=npuserve-local",
            *common,
        ],
        env,
    )
    sched_kubeconfig = conf / "scheduler.kubeconfig"
    _spawn(
        cdir,
        "kube-scheduler",
        [
            str(b.kube_scheduler),
            f"--kubeconfig={sched_kubeconfig}",
            f"--authentication-kubeconfig={sched_kubeconfig}",
            f"--authorization-kubeconfig={sched_kubeconfig}",
            f"--secure-port={p['scheduler']}",
            *common,
        ],
        env,
    )
    kwok_config = conf / "kwok.yaml"
    kwok_config.write_text(
        "apiVersion: config.kwok.x-k8s.io/v1alpha1\nkind: KwokConfiguration\noptions: {}\n" + kwok_pod_stages()
    )
    _spawn(
        cdir,
        "kwok",
        [
            str(b.kwok),
            f"--config={kwok_config}",
            f"--kubeconfig={c.kubeconfig}",
            "--manage-all-nodes=false",
            "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
            f"--cidr={POD_CIDR}",
            "--node-ip=127.0.0.1",
            f"--server-address=127.0.0.1:{p['kwok']}",
            "--node-lease-duration-seconds=40",  # heartbeats by Lease (renewed every 10s), as kubelets do
        ],
        env,
    )
    insecure = _insecure_ctx()
    _wait_http(
        "kube-controller-manager", p["controller_manager"], "/healthz", insecure, cdir, "kube-controller-manager"
    )
    _wait_http("kube-scheduler", p["scheduler"], "/healthz", insecure, cdir, "kube-scheduler", timeout)
    _wait_http("kwok", p["kwok"], "/healthz", None, cdir, "kwok", timeout)
    _spawn(
        cdir,
        "kubelet",
        [
            sys.executable,
            str(Path(kubelet.__file__).resolve()),
            f"--cluster-dir={cdir}",
            f"--port={p['kubelet']}",
            f"--npuserve={kubelet.default_npuserve()}",
        ],
        env,
    )
    _wait_http("kubelet", p["kubelet"], "/healthz", None, cdir, "kubelet", timeout)


def _create_nodes(c: Cluster, timeout: float) -> None:
    nodes = {"apiVersion": "v1", "kind": "List", "items": [fake_node(n, i) for i, n in enumerate(NODE_NAMES)]}
    c.kubectl("apply", "-f", "-", input=json.dumps(nodes))
    c.kubectl("wait", "--for=condition=Ready", "node", *NODE_NAMES, f"--timeout={int(timeout)}s", timeout=timeout + 10)
    # Pods are refused until the token controller has made the namespace's default ServiceAccount.
    deadline = time.monotonic() + timeout
    while c.kubectl("get", "serviceaccount", "default", "-n", "default", "--ignore-not-found", "-o", "name") == "":
        if time.monotonic() > deadline:
            raise RuntimeError("the default ServiceAccount was not created; see logs/kube-controller-manager.log")
        time.sleep(0.2)


def down(cdir: Path | None = None) -> list[str]:
    """Stop the processes `up` started (by recorded PID and start time). Returns the names of those it ended."""
    cdir = cdir or state_dir()
    if not cdir.exists():
        return []
    with _file_lock(cdir / ".lock"):
        return _down_locked(cdir)


def _down_locked(cdir: Path) -> list[str]:
    stopped = [name for name in reversed(COMPONENTS) if _stop_one(cdir, name, grace=45 if name == "kubelet" else 15)]
    # The kubelet ends its engine processes as it stops; these are the ones a killed kubelet left behind.
    stopped += [f"engine {folder}" for folder in kubelet.sweep(cdir / "pods")]
    shutil.rmtree(cdir / "users", ignore_errors=True)
    shutil.rmtree(cdir / "etcd-data", ignore_errors=True)
    (cdir / "state.json").unlink(missing_ok=True)
    return stopped


def status(cdir: Path | None = None) -> dict[str, object]:
    cdir = cdir or state_dir()
    cluster = current(cdir)
    return {
        "running": cluster is not None,
        "components": _running_components(cdir),
        "kubeconfig": str(cdir / "kubeconfig"),
        "server": cluster.server if cluster else None,
    }
