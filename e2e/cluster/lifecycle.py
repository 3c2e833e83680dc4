"""The local cluster's lifecycle: `Cluster`, `up`/`down`, `acquire`/`release` for test sessions, `status` and
`current`, and starting the components (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, KWOK, the
LeaderWorkerSet controller with its CRD and webhooks, the process kubelet, Prometheus) under the state folder
`.cluster/`; `stop_prometheus`/`start_prometheus` take Prometheus alone down and back. Standard library only."""

from __future__ import annotations

import base64
import http.client
import importlib.util
import json
import os
import shutil
import ssl
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from binaries import K8S_VERSION, REPO_ROOT, Binaries, default_npuserve, ensure_binaries, file_lock, kubelet_python
from kwok import NODE_ANNOTATION, NODE_ANNOTATION_VALUE, NODE_NAMES, POD_CIDR, fake_node, kwok_config
from pki import SERVICE_CIDR, WEBHOOK_CERT_DIR, make_pki, write_kubeconfig
from processes import (
    alive,
    https_get,
    insecure_ctx,
    log,
    port_free,
    proc_stat,
    read_pid,
    spawn,
    stop_one,
    sweep,
    tail,
    wait_http,
)
from prometheus import ApiServer, dump, find_podmonitor, podmonitor_scrape_configs, prometheus_config

KUBELET_PY = Path(__file__).resolve().with_name("kubelet.py")
# Prometheus scrapes what the chart's PodMonitor selects, rendered as tests/e2e/test_operator.py installs the chart
# (so its `job` label is npuserve-system/npuserve-engines), scraping every second for the tuner's short windows.
CHART = REPO_ROOT / "deploy" / "helm" / "npuserve"
CHART_RELEASE, CHART_NAMESPACE = "npuserve", "npuserve-system"
# NPUSERVE_SCRAPE_INTERVAL, read when Prometheus starts, sets another interval and timeout: at a second, a few hundred
# engine pods are a few hundred scrapes a second (benchmarks/autotune_scale.py asks for 5s).
SCRAPE_INTERVAL = os.environ.get("NPUSERVE_SCRAPE_INTERVAL") or "1s"
CHART_MONITOR_VALUES = (
    "serviceMonitor.enabled=true",
    "serviceMonitor.kind=PodMonitor",
    f"serviceMonitor.interval={SCRAPE_INTERVAL}",
    f"serviceMonitor.scrapeTimeout={SCRAPE_INTERVAL}",
)
PROMETHEUS_RETENTION = "1d"  # a cluster lives for a test session; `up` starts with an empty TSDB


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
    "prometheus": ("NPUSERVE_PROMETHEUS_PORT", 29090),
    "lws_webhook": ("NPUSERVE_LWS_WEBHOOK_PORT", 29443),
    "lws_health": ("NPUSERVE_LWS_HEALTH_PORT", 20281),
    "lws_metrics": ("NPUSERVE_LWS_METRICS_PORT", 20280),
}
# Start order; stop runs it backwards.
COMPONENTS = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kwok",
    "lws-controller",
    "kubelet",
    "prometheus",
)
# Components a running cluster may lack for a while: a test takes Prometheus down and back (stop_prometheus,
# start_prometheus), and meanwhile the cluster is still up for everyone else (`current`, `acquire`).
OPTIONAL_COMPONENTS = ("prometheus",)


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

    @property
    def prometheus_url(self) -> str:
        """Prometheus' HTTP API (also in `.cluster/prometheus-url`)."""
        return f"http://127.0.0.1:{self.ports['prometheus']}"

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
        return https_get("127.0.0.1", self.ports["apiserver"], path, self.ssl_context(), timeout)

    def ready(self) -> bool:
        try:
            return self.api_get("/readyz")[0] == 200
        except OSError:
            return False


# ---- up / down -------------------------------------------------------------------------------------------------
def _running_components(cdir: Path) -> dict[str, bool]:
    out = {}
    for name in COMPONENTS:
        rec = read_pid(cdir, name)
        out[name] = rec is not None and alive(*rec)
    return out


def _load_state(cdir: Path) -> dict[str, object] | None:
    try:
        data: dict[str, object] = json.loads((cdir / "state.json").read_text())
        return data
    except (OSError, ValueError):
        return None


def current(cdir: Path | None = None) -> Cluster | None:
    """The cluster recorded in the state folder if its processes run (Prometheus may be down for a while: a test
    stops and restarts it) and the API server is ready."""
    cdir = cdir or state_dir()
    state = _load_state(cdir)
    running = _running_components(cdir)
    if state is None or not all(up for name, up in running.items() if name not in OPTIONAL_COMPONENTS):
        return None
    ports = {k: int(v) for k, v in dict(state["ports"]).items()}  # type: ignore[call-overload]
    try:
        bins = Binaries(**{k: Path(str(v)) for k, v in dict(state["binaries"]).items()})  # type: ignore[call-overload]
    except TypeError:  # recorded by another version of this harness
        return None
    cluster = Cluster(dir=cdir, ports=ports, binaries=bins)
    return cluster if cluster.ready() else None


def _clean_env() -> dict[str, str]:
    """The components must not pick up a developer's KUBECONFIG or ETCD_* settings."""
    return {k: v for k, v in os.environ.items() if not k.startswith("ETCD_") and k != "KUBECONFIG"}


def up(timeout: float = 180, owner: str = "cli") -> Cluster:
    """Start the local cluster (building the binaries on first use). Returns the running cluster if there is one.

    `owner` is recorded: a cluster started by the command line (`make cluster-up`) is never stopped by `release`."""
    cdir = state_dir()
    with file_lock(cdir / ".lock"):
        return _up_locked(cdir, timeout, owner)


def acquire(timeout: float = 180) -> Cluster:
    """For test sessions: start the cluster if needed and register this process as a user of it. Sessions that run
    at the same time in the same checkout share one cluster; the last `release` stops it, unless `make cluster-up`
    started it."""
    cdir = state_dir()
    with file_lock(cdir / ".lock"):
        cluster = _up_locked(cdir, timeout, owner="test")
        users = cdir / "users"
        users.mkdir(exist_ok=True)
        stat = proc_stat(os.getpid())
        (users / f"{os.getpid()}-{stat[1] if stat else 0}").touch()
        return cluster


def release() -> bool:
    """Undo `acquire`: stop the cluster if no live user is left and a test session started it. True if stopped."""
    cdir = state_dir()
    with file_lock(cdir / ".lock"):
        users = cdir / "users"
        me = os.getpid()
        live = 0
        for entry in users.glob("*-*") if users.exists() else []:
            pid_s, _, start_s = entry.name.partition("-")
            if int(pid_s) == me or not (start_s.isdigit() and alive(int(pid_s), int(start_s))):
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
        if owner == "cli" and not _running_components(cdir)["prometheus"]:
            log("Prometheus is not running (stopped by stop_prometheus?); starting it")
            _start_prometheus(running, _clean_env(), timeout)
        return running
    if any(_running_components(cdir).values()):
        log("a previous cluster is partly running; stopping it first")
        _down_locked(cdir)
    if kubelet_python() == sys.executable and importlib.util.find_spec("kubernetes") is None:
        raise RuntimeError(
            f"the process kubelet needs the `kubernetes` client, which {sys.executable} lacks (make setup)"
        )
    bins = ensure_binaries(with_helm=True)  # Helm renders the chart's PodMonitor for Prometheus
    started = time.monotonic()
    ports = ports_from_env()
    busy = [f"{n}={p} (set {PORT_DEFAULTS[n][0]})" for n, p in ports.items() if not port_free(p)]
    if busy:
        raise RuntimeError("ports in use: " + ", ".join(busy))
    shared = [f"{n}={p}" for n, p in ports.items() if list(ports.values()).count(p) > 1]
    if shared:
        raise RuntimeError("one port for two components: " + ", ".join(shared))

    cdir.mkdir(parents=True, exist_ok=True)
    sweep(cdir / "pods")  # engine processes of an earlier cluster whose kubelet was killed
    for sub in ("pki", "etcd-data", "prometheus-data", "logs", "pids", "config", "users", "pods"):
        shutil.rmtree(cdir / sub, ignore_errors=True)
    for f in ("kubeconfig", "state.json", "prometheus-url"):
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
        f"; Prometheus {cluster.prometheus_url}"
    )
    return cluster


def _start_components(c: Cluster, env: Mapping[str, str], timeout: float) -> None:
    p, pki, conf, b, cdir = c.ports, c.pki, c.dir / "config", c.binaries, c.dir
    etcd_url, peer_url = f"http://127.0.0.1:{p['etcd']}", f"http://127.0.0.1:{p['etcd_peer']}"
    spawn(
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
    wait_http("etcd", p["etcd"], "/health", None, cdir, "etcd", timeout)
    spawn(
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
    wait_http("kube-apiserver", p["apiserver"], "/readyz", c.ssl_context(), cdir, "kube-apiserver", timeout)
    common = ["--leader-elect=false", "--bind-address=127.0.0.1", "--profiling=false"]
    kcm_kubeconfig = conf / "controller-manager.kubeconfig"
    spawn(
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
    spawn(
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
    # The LeaderWorkerSet CRD goes in while the controllers start: the LeaderWorkerSet controller watches it.
    apply_lws_crd(c, timeout)
    kwok_config_file = conf / "kwok.yaml"
    kwok_config_file.write_text(kwok_config())
    spawn(
        cdir,
        "kwok",
        [
            str(b.kwok),
            f"--config={kwok_config_file}",
            f"--kubeconfig={c.kubeconfig}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={NODE_ANNOTATION}={NODE_ANNOTATION_VALUE}",
            f"--cidr={POD_CIDR}",
            "--node-ip=127.0.0.1",
            f"--server-address=127.0.0.1:{p['kwok']}",
            "--node-lease-duration-seconds=40",  # heartbeats by Lease (renewed every 10s), as kubelets do
        ],
        env,
    )
    spawn_lws_controller(c, env)
    insecure = insecure_ctx()
    wait_http("kube-controller-manager", p["controller_manager"], "/healthz", insecure, cdir, "kube-controller-manager")
    wait_http("kube-scheduler", p["scheduler"], "/healthz", insecure, cdir, "kube-scheduler", timeout)
    wait_http("kwok", p["kwok"], "/healthz", None, cdir, "kwok", timeout)
    wait_lws_controller(c, timeout)
    spawn(
        cdir,
        "kubelet",
        [
            kubelet_python(),
            str(KUBELET_PY),
            f"--cluster-dir={cdir}",
            f"--port={p['kubelet']}",
            f"--npuserve={default_npuserve()}",
        ],
        env,
    )
    wait_http("kubelet", p["kubelet"], "/healthz", None, cdir, "kubelet", timeout)
    _start_prometheus(c, env, timeout)


# ---- LeaderWorkerSet --------------------------------------------------------------------------------------------
LWS_NAMESPACE = "lws-system"  # config/default's namespace; the controller's own default (no service-account file)
LWS_CRD_NAME = "leaderworkersets.leaderworkerset.x-k8s.io"
LWS_MUTATING_WEBHOOK = "lws-mutating-webhook-configuration"
LWS_VALIDATING_WEBHOOK = "lws-validating-webhook-configuration"
# The webhooks of the release's config/webhook (manifests.yaml with mutating-patch.yaml and validating-patch.yaml,
# which add the objectSelector to the pod webhooks and UPDATE to the mutating one): (name, path, group, resource,
# operations, pod webhook).
_LWS_SELECTOR = {"matchExpressions": [{"key": "leaderworkerset.sigs.k8s.io/name", "operator": "Exists"}]}
LWS_WEBHOOKS: dict[str, list[tuple[str, str, str, str, tuple[str, ...], bool]]] = {
    "MutatingWebhookConfiguration": [
        ("mleaderworkerset.kb.io", "/mutate-leaderworkerset-x-k8s-io-v1-leaderworkerset", "leaderworkerset.x-k8s.io",
         "leaderworkersets", ("CREATE", "UPDATE"), False),
        ("mpod.kb.io", "/mutate--v1-pod", "", "pods", ("CREATE", "UPDATE"), True),
    ],
    "ValidatingWebhookConfiguration": [
        ("vleaderworkerset.kb.io", "/validate-leaderworkerset-x-k8s-io-v1-leaderworkerset", "leaderworkerset.x-k8s.io",
         "leaderworkersets", ("CREATE", "UPDATE"), False),
        ("vpod.kb.io", "/validate--v1-pod", "", "pods", ("CREATE", "UPDATE"), True),
    ],
}  # fmt: skip


def lws_webhook_configurations(port: int, ca_bundle: str) -> list[dict[str, object]]:
    """The controller's Mutating/ValidatingWebhookConfigurations as the release installs them, but calling the
    webhook server by URL (https://127.0.0.1:`port`<path>) and trusting `ca_bundle` (base64 PEM): the controller runs
    outside any pod, so the API server could not reach it through a Service."""
    out: list[dict[str, object]] = []
    for kind, hooks in LWS_WEBHOOKS.items():
        webhooks = []
        for name, path, group, resource, operations, pod in hooks:
            hook: dict[str, object] = {
                "name": name,
                "admissionReviewVersions": ["v1"],
                "clientConfig": {"url": f"https://127.0.0.1:{port}{path}", "caBundle": ca_bundle},
                "failurePolicy": "Fail",
                "sideEffects": "None",
                "rules": [
                    {
                        "apiGroups": [group],
                        "apiVersions": ["v1"],
                        "operations": list(operations),
                        "resources": [resource],
                    }
                ],
            }
            if pod:
                hook["objectSelector"] = _LWS_SELECTOR
            webhooks.append(hook)
        name = LWS_MUTATING_WEBHOOK if kind.startswith("Mutating") else LWS_VALIDATING_WEBHOOK
        out.append(
            {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": kind,
                "metadata": {"name": name},
                "webhooks": webhooks,
            }
        )
    return out


def lws_configuration(ports: Mapping[str, int], cert_dir: Path) -> dict[str, object]:
    """The controller's component configuration (config.lws.x-k8s.io/v1alpha1): one replica, no leader election,
    webhooks served on 127.0.0.1 with the harness's certificate (no internal cert rotation: it would write a
    Secret for a Service that does not exist here), health and metrics on 127.0.0.1."""
    return {
        "apiVersion": "config.lws.x-k8s.io/v1alpha1",
        "kind": "Configuration",
        "leaderElection": {"leaderElect": False},
        "webhook": {"port": ports["lws_webhook"], "host": "127.0.0.1", "certDir": str(cert_dir)},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{ports['lws_health']}"},
        "metrics": {"bindAddress": f"127.0.0.1:{ports['lws_metrics']}"},
        "internalCertManagement": {"enable": False},
    }


def apply_lws_crd(c: Cluster, timeout: float) -> None:
    """The LeaderWorkerSet CRD (server-side: it is over a megabyte, too big for the last-applied annotation) and the
    controller's namespace. The release's CRD patch that routes conversion to its webhook is left out: the CRD has
    one version, so nothing is ever converted."""
    c.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(c.binaries.lws_crd), timeout=timeout)
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": LWS_NAMESPACE}}
    c.kubectl("apply", "-f", "-", input=json.dumps(namespace))
    # Polled, not `kubectl wait`: that fails at once while the new CRD has no conditions yet.
    deadline = time.monotonic() + timeout
    while not _crd_established(c, LWS_CRD_NAME):
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the CRD {LWS_CRD_NAME} is not Established; log: {c.dir / 'logs' / 'kube-apiserver.log'}"
            )
        time.sleep(0.1)


def _crd_established(c: Cluster, name: str) -> bool:
    raw = c.kubectl("get", f"crd/{name}", "-o", "jsonpath={.status.conditions}")
    conditions = json.loads(raw) if raw.strip() else None
    return any(cond.get("type") == "Established" and cond.get("status") == "True" for cond in conditions or [])


def spawn_lws_controller(c: Cluster, env: Mapping[str, str]) -> None:
    config = c.dir / "config" / "lws-controller.yaml"
    config.write_text(json.dumps(lws_configuration(c.ports, c.pki / WEBHOOK_CERT_DIR), indent=2) + "\n")  # JSON is YAML
    # controller-runtime reads KUBECONFIG; the admin's, as the kubelet and KWOK use.
    spawn(
        c.dir,
        "lws-controller",
        [str(c.binaries.lws_controller), f"--config={config}", "--zap-devel=false"],
        {**env, "KUBECONFIG": str(c.kubeconfig)},
    )


def wait_lws_controller(c: Cluster, timeout: float) -> None:
    """Wait for the controller's health endpoint and for both its pod webhooks to answer over TLS (verified with the
    cluster CA), then register the webhook configurations: registered before, they would refuse every
    LeaderWorkerSet and its pods (failurePolicy Fail) until the server is up."""
    p, cdir = c.ports, c.dir
    wait_http("lws-controller", p["lws_health"], "/readyz", None, cdir, "lws-controller", timeout)
    _wait_lws_webhooks(c, timeout)
    ca_bundle = base64.b64encode((c.pki / "ca.crt").read_bytes()).decode()
    configs = {"apiVersion": "v1", "kind": "List", "items": lws_webhook_configurations(p["lws_webhook"], ca_bundle)}
    c.kubectl("apply", "-f", "-", input=json.dumps(configs))
    rec, log_file = read_pid(cdir, "lws-controller"), cdir / "logs" / "lws-controller.log"
    if rec is None or not alive(*rec):  # its metrics server, say, failed after the webhooks came up
        raise RuntimeError(f"lws-controller exited (log: {log_file}); last log lines:\n{tail(log_file)}")


# An AdmissionReview for a plain pod (no LeaderWorkerSet label): both pod webhooks allow it and log no error, as an
# empty GET would make them do.
_PROBE_REVIEW = {
    "apiVersion": "admission.k8s.io/v1",
    "kind": "AdmissionReview",
    "request": {
        "uid": "00000000-0000-0000-0000-000000000000",
        "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"},
        "operation": "CREATE",
        "namespace": "default",
        "name": "probe",
        "userInfo": {},
        "object": {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "probe", "namespace": "default"},
            "spec": {"containers": [{"name": "probe", "image": "probe"}]},
        },
    },
}


def _webhook_allows(port: int, path: str, ctx: ssl.SSLContext) -> bool:
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=2)
    try:
        conn.request("POST", path, json.dumps(_PROBE_REVIEW), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        body = resp.read()
        return resp.status == 200 and bool(json.loads(body).get("response", {}).get("allowed"))
    except (OSError, http.client.HTTPException, ValueError):
        return False
    finally:
        conn.close()


def _wait_lws_webhooks(c: Cluster, timeout: float) -> None:
    """Wait until the controller serves both pod webhooks over TLS (verified with the cluster CA). The server starts
    before the controller registers its paths (an unregistered one is a 404); the LeaderWorkerSet webhooks are
    registered before the pod webhooks."""
    ctx = ssl.create_default_context(cafile=str(c.pki / "ca.crt"))
    deadline = time.monotonic() + timeout
    log_file = c.dir / "logs" / "lws-controller.log"
    while not all(
        _webhook_allows(c.ports["lws_webhook"], path, ctx) for path in ("/mutate--v1-pod", "/validate--v1-pod")
    ):
        rec = read_pid(c.dir, "lws-controller")
        if rec is None or not alive(*rec):
            raise RuntimeError(f"lws-controller exited (log: {log_file}); last log lines:\n{tail(log_file)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"lws-controller's webhooks not served after {timeout:.0f}s; log: {log_file}")
        time.sleep(0.2)


# ---- Prometheus --------------------------------------------------------------------------------------------------
def chart_podmonitor(helm: Path, python: str | None = None) -> dict[str, object]:
    """The PodMonitor of the Helm chart, rendered by `helm template` with the monitor on (1 s interval and timeout,
    or NPUSERVE_SCRAPE_INTERVAL).

    Helm writes YAML and the standard library reads none: the virtual environment's Python (PyYAML is an npuserve
    dependency) turns it into JSON."""
    cmd = [str(helm), "template", CHART_RELEASE, str(CHART), "--namespace", CHART_NAMESPACE]
    rendered = subprocess.run(
        [*cmd, "--set", ",".join(CHART_MONITOR_VALUES)], text=True, capture_output=True, env=_clean_env(), timeout=60
    )
    if rendered.returncode != 0:
        raise RuntimeError(f"helm template {CHART} failed: {rendered.stderr.strip()}")
    to_json = "import json, sys, yaml; json.dump(list(yaml.safe_load_all(sys.stdin)), sys.stdout)"
    converted = subprocess.run(
        [python or kubelet_python(), "-c", to_json], input=rendered.stdout, text=True, capture_output=True, timeout=60
    )
    if converted.returncode != 0:
        raise RuntimeError(f"reading helm's YAML needs PyYAML (make setup): {converted.stderr.strip()[-500:]}")
    return find_podmonitor(json.loads(converted.stdout))


def write_prometheus_config(c: Cluster) -> Path:
    """`.cluster/config/prometheus.yml`: the chart's PodMonitor as the Prometheus Operator would configure it,
    discovering pods through the API server with the admin's client certificate."""
    api = ApiServer(
        url=c.server,
        ca_file=str(c.pki / "ca.crt"),
        cert_file=str(c.pki / "admin.crt"),
        key_file=str(c.pki / "admin.key"),
    )
    config = prometheus_config(podmonitor_scrape_configs(chart_podmonitor(c.binaries.helm), api))
    path = c.dir / "config" / "prometheus.yml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump(config))
    return path


def _start_prometheus(c: Cluster, env: Mapping[str, str], timeout: float) -> None:
    rec = read_pid(c.dir, "prometheus")
    if rec is not None and alive(*rec):
        return
    port = c.ports["prometheus"]
    if not port_free(port):
        raise RuntimeError(f"port {port} for Prometheus is in use (set {PORT_DEFAULTS['prometheus'][0]})")
    config = write_prometheus_config(c)
    spawn(
        c.dir,
        "prometheus",
        [
            str(c.binaries.prometheus),
            f"--config.file={config}",
            f"--storage.tsdb.path={c.dir / 'prometheus-data'}",
            f"--storage.tsdb.retention.time={PROMETHEUS_RETENTION}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        env,
    )
    wait_http("prometheus", port, "/-/ready", None, c.dir, "prometheus", timeout)
    (c.dir / "prometheus-url").write_text(c.prometheus_url + "\n")


def start_prometheus(c: Cluster, timeout: float = 60) -> str:
    """Start Prometheus again after `stop_prometheus` (a no-op while it runs): same port, configuration (rendered
    afresh from the chart) and TSDB, so what it scraped before is still there. Returns its URL once it is ready."""
    with file_lock(c.dir / ".lock"):
        _start_prometheus(c, _clean_env(), timeout)
    return c.prometheus_url


def stop_prometheus(c: Cluster) -> bool:
    """Stop only Prometheus (SIGTERM: it flushes its TSDB); the rest of the cluster keeps running. True if it ran."""
    with file_lock(c.dir / ".lock"):
        return stop_one(c.dir, "prometheus")


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
    with file_lock(cdir / ".lock"):
        return _down_locked(cdir)


def _down_locked(cdir: Path) -> list[str]:
    stopped = [name for name in reversed(COMPONENTS) if stop_one(cdir, name, grace=45 if name == "kubelet" else 15)]
    # The kubelet ends its engine processes as it stops; these are the ones a killed kubelet left behind.
    stopped += [f"engine {folder}" for folder in sweep(cdir / "pods")]
    shutil.rmtree(cdir / "users", ignore_errors=True)
    shutil.rmtree(cdir / "etcd-data", ignore_errors=True)
    shutil.rmtree(cdir / "prometheus-data", ignore_errors=True)
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
        "prometheus_url": cluster.prometheus_url if cluster else None,
    }
