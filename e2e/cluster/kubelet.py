#!/usr/bin/env python3
"""The process kubelet: runs the real `npuserve` as a local process for each process pod on a KWOK node.

KWOK fakes everything a kubelet does for ordinary pods. For process pods (a container whose command is
`npuserve serve ...`, an engine, or `npuserve bench ...`, the load generator of a benchmark Job) KWOK's stage only
sets the pod Running with a loopback pod IP and leaves it not Ready (`kwok.kwok_pod_stages`); this process does the
rest, as a kubelet would:

- starts the container's command with the local `npuserve` (the virtual environment's) in the pod's folder
  `.cluster/pods/<namespace>_<name>/` (PID: `pid`; log: `engine.log` for an engine, `container.log` for a bench);
  an engine gets `--host <podIP>` and the pod's port, a bench its arguments as they are;
- env: plain values, `fieldRef`s (metadata.name/namespace/uid/labels/annotations, spec.nodeName,
  spec.serviceAccountName, status.podIP/hostIP), `secretKeyRef`/`configMapKeyRef` from the real objects (optional
  ones that are missing are skipped; a missing required one keeps the container waiting with
  CreateContainerConfigError); `LD_PRELOAD` is dropped when the library is not on this machine; `OMP_NUM_THREADS`
  is set from the container's CPU limit (else request) unless the pod sets it, as a CPU quota would bound it;
- volumes: ConfigMaps (kept in sync, written atomically, so the engine's config-file watch sees changes) and
  emptyDirs are materialised under the pod folder at their mount paths; every argument or env value under a mount
  path is rewritten to the local folder;
- readiness: an engine's `GET http://<podIP>:<port>/ready` (the container's readinessProbe path and failure
  threshold); a bench, which has no probe, is ready while it runs; the pod's Ready and ContainersReady conditions
  and the container status follow it (strategic-merge patches of `pods/status`);
- a process that exits is restarted with a back-off (CrashLoopBackOff, its exit reported in `lastState`) when the
  pod's restartPolicy asks (Always; OnFailure after a failure); otherwise (Never; OnFailure after exit code 0) the
  container's state becomes terminated (exit code, reason Completed or Error, the log's last lines) and the pod's
  phase Succeeded (0) or Failed, so a Job controller completes or fails its Job;
- a pod that is deleted or goes away: SIGTERM, then SIGKILL after the grace period (capped at 30 s). A new pod that
  gets a freed IP starts only when the previous process on that address has exited.

Namespaces labelled `npuserve.io/process-kubelet=ignore` are left alone (the reconcile benchmark uses this: its
engine pods never start). It talks to the API server with the `kubernetes` client, as the cluster's admin (the
kubeconfig `up` writes), so it runs with the virtual environment's Python; `lifecycle.py` starts and stops it
(`make cluster-up/down`).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import http.client
import http.server
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from binaries import default_npuserve
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kwok import NODE_ANNOTATION, NODE_ANNOTATION_VALUE
from processes import proc_starttime, sweep, tail

IGNORE_LABEL = "npuserve.io/process-kubelet"
IGNORE_VALUE = "ignore"
MAX_GRACE_SECONDS = 30.0
BACKOFF_START, BACKOFF_MAX = 5.0, 120.0
LOOP_SECONDS = 0.5
API_TIMEOUT = 10.0

log = logging.getLogger("kubelet")
T = TypeVar("T")


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parts(pod: client.V1Pod) -> tuple[client.V1ObjectMeta, client.V1PodSpec, client.V1PodStatus]:
    """A pod's metadata, spec and status (the API server always sends the first two)."""
    assert pod.metadata is not None and pod.spec is not None
    return pod.metadata, pod.spec, pod.status or client.V1PodStatus()


# The `npuserve` subcommands run as processes (kwok.PROCESS_COMMANDS): the engine and the load generator.
SERVE, BENCH = "serve", "bench"


def process_kind(container: client.V1Container) -> str | None:
    """SERVE or BENCH for a container this kubelet runs (`npuserve serve|bench ...`), else None."""
    cmd = container.command or []
    if len(cmd) >= 2 and os.path.basename(str(cmd[0])) == "npuserve" and cmd[1] in (SERVE, BENCH):
        return str(cmd[1])
    return None


def process_container(pod: client.V1Pod) -> client.V1Container | None:
    """The pod's container this kubelet runs: its first engine or bench container."""
    for c in parts(pod)[1].containers:
        if process_kind(c) is not None:
            return c
    return None


def container_port(container: client.V1Container) -> int:
    """The port the engine listens on: its `--port` argument, else the first containerPort, else 8000."""
    argv = [*(container.command or []), *(container.args or [])]
    for i, a in enumerate(argv):
        if a == "--port" and i + 1 < len(argv):
            return int(argv[i + 1])
        if str(a).startswith("--port="):
            return int(str(a).split("=", 1)[1])
    ports = container.ports or []
    return int(ports[0].container_port) if ports else 8000


def _cpu_quantity(q: str) -> float:
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


def rewrite_path(value: str, mounts: list[tuple[str, Path]]) -> str:
    """`value` with a leading mount path (or `--flag=<mount path>...`) replaced by the local folder."""
    prefix, sep, rest = value.partition("=")
    if sep and prefix.startswith("-"):
        return prefix + "=" + rewrite_path(rest, mounts)
    for mount_path, local in mounts:  # longest first
        if value == mount_path:
            return str(local)
        if value.startswith(mount_path.rstrip("/") + "/"):
            return str(local) + "/" + value[len(mount_path.rstrip("/")) + 1 :]
    return value


def field_ref(pod: client.V1Pod, path: str) -> str | None:
    meta, spec, status = parts(pod)
    simple = {
        "metadata.name": meta.name,
        "metadata.namespace": meta.namespace,
        "metadata.uid": meta.uid,
        "spec.nodeName": spec.node_name,
        "spec.serviceAccountName": spec.service_account_name,
        "status.podIP": status.pod_ip,
        "status.hostIP": status.host_ip,
    }
    if path in simple:
        v = simple[path]
        return None if v is None else str(v)
    for kind, values in (("labels", meta.labels), ("annotations", meta.annotations)):
        head = f"metadata.{kind}['"
        if path.startswith(head) and path.endswith("']"):
            v = (values or {}).get(path[len(head) : -2])
            return None if v is None else str(v)
    return None


# ---- $(VAR) references -------------------------------------------------------------------------------------------
def expand(value: str, *contexts: Mapping[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion of a container's command, args and env values (the kubelet's
    third_party/forked/golang/expansion): `$(NAME)` becomes the first context's value of NAME, or stays as written
    when no context has it; `$$` is an escaped `$` (so `$$(NAME)` gives `$(NAME)`); any other `$`, and a `$(` with
    no closing parenthesis, stay as they are."""
    out: list[str] = []
    i, n = 0, len(value)
    while i < n:
        ch = value[i]
        if ch != "$" or i + 1 == n:
            out.append(ch)
            i += 1
            continue
        nxt = value[i + 1]
        if nxt == "$":  # escaped operator
            out.append("$")
            i += 2
        elif nxt == "(":
            close = value.find(")", i + 2)
            if close < 0:  # incomplete reference
                out.append("$(")
                i += 2
                continue
            name = value[i + 2 : close]
            out.append(next((ctx[name] for ctx in contexts if name in ctx), f"$({name})"))
            i = close + 1
        else:
            out.append("$" + nxt)
            i += 2
    return "".join(out)


# ---- names: the pod's hostname and the cluster's records ----------------------------------------------------------
CLUSTER_DOMAIN = "cluster.local"
# What a kubelet writes at the top of the hosts file it mounts into a container (kubelet_pods.go, managedHostsHeader).
HOSTS_HEADER = (
    "# Kubernetes-managed hosts file.\n"
    "127.0.0.1\tlocalhost\n"
    "::1\tlocalhost ip6-localhost ip6-loopback\n"
    "fe00::0\tip6-localnet\n"
    "fe00::0\tip6-mcastprefix\n"
    "fe00::1\tip6-allnodes\n"
    "fe00::2\tip6-allrouters\n"
)


class DnsRecord(NamedTuple):
    """A pod's cluster DNS name `<hostname>.<subdomain>.<namespace>.svc.<cluster domain>` and its address."""

    ip: str
    hostname: str
    subdomain: str
    namespace: str


def pod_hostname(pod: client.V1Pod) -> tuple[str, str | None]:
    """The pod's hostname (spec.hostname, else its name cut to 63 characters) and its domain
    (`<subdomain>.<namespace>.svc.cluster.local` when spec.subdomain is set), as a kubelet gives them."""
    meta, spec, _ = parts(pod)
    hostname = str(spec.hostname or "") or str(meta.name)[:63].rstrip("-.")
    domain = f"{spec.subdomain}.{meta.namespace}.svc.{CLUSTER_DOMAIN}" if spec.subdomain else None
    return hostname, domain


def _pod_ready(pod: client.V1Pod) -> bool:
    return any(cond.type == "Ready" and cond.status == "True" for cond in parts(pod)[2].conditions or [])


def dns_records(pods: list[client.V1Pod], services: list[client.V1Service]) -> list[DnsRecord]:
    """The per-pod A records cluster DNS serves: a pod with spec.hostname, spec.subdomain and an IP, selected by the
    headless Service named after its subdomain in its namespace (ready, or the Service publishes not-ready
    addresses, as LeaderWorkerSet's does). Sorted by namespace, subdomain, hostname."""
    headless: dict[tuple[str, str], client.V1Service] = {}
    for svc in services:
        if svc.metadata is not None and svc.spec is not None and svc.spec.cluster_ip == "None":
            headless[(str(svc.metadata.namespace), str(svc.metadata.name))] = svc
    out = []
    for pod in pods:
        meta, spec, status = parts(pod)
        if not (spec.hostname and spec.subdomain and status.pod_ip) or meta.deletion_timestamp:
            continue
        service = headless.get((str(meta.namespace), str(spec.subdomain)))
        if service is None or service.spec is None:
            continue
        selector = service.spec.selector or {}
        labels = meta.labels or {}
        if not selector or any(labels.get(k) != v for k, v in selector.items()):
            continue  # no endpoints for this pod
        if not (service.spec.publish_not_ready_addresses or _pod_ready(pod)):
            continue
        out.append(DnsRecord(str(status.pod_ip), str(spec.hostname), str(spec.subdomain), str(meta.namespace)))
    return sorted(out, key=lambda r: (r.namespace, r.subdomain, r.hostname, r.ip))


def hosts_file(
    ip: str,
    hostname: str,
    domain: str | None,
    records: list[DnsRecord],
    aliases: list[tuple[str, list[str]]] | None = None,
) -> str:
    """A process pod's /etc/hosts: the kubelet's (its header, the pod's own `<ip> <fqdn> <hostname>` line, the
    pod's hostAliases), then the cluster DNS records (`dns_records`) under each name a resolver with the cluster's
    search path (`<namespace>.svc.cluster.local svc.cluster.local cluster.local`) would find them by."""
    lines = [HOSTS_HEADER.rstrip("\n")]
    lines.append(f"{ip}\t{hostname}.{domain}\t{hostname}" if domain else f"{ip}\t{hostname}")
    if aliases:
        lines.append("")
        lines.append("# Entries added by HostAliases.")
        lines += [alias_ip + "\t" + "\t".join(names) for alias_ip, names in aliases]
    if records:
        lines.append("")
        lines.append("# Cluster DNS records (the process kubelet's stand-in for cluster DNS).")
        for r in records:
            name = f"{r.hostname}.{r.subdomain}.{r.namespace}"
            lines.append(f"{r.ip}\t{name}.svc.{CLUSTER_DOMAIN}\t{name}.svc\t{name}")
    return "\n".join(lines) + "\n"


def write_in_place(path: Path, content: str) -> None:
    """Replace a file's content keeping its inode (a bind mount of it pins the inode: a rename would not be seen)."""
    data = content.encode()
    with contextlib.suppress(FileNotFoundError), path.open("r+b") as fh:
        fh.write(data)
        fh.truncate()
        return
    path.write_bytes(data)


# ---- launching a process pod: its own /etc/hosts and hostname ------------------------------------------------------
# A container sees the kubelet's hosts file at /etc/hosts and the pod's hostname (gloo, for one, resolves the host
# name to pick its address). A process pod gets both through a mount and a UTS namespace of its own: `unshare`
# (without --fork, so it execs and the PID stays the engine's) runs a shell that bind-mounts the pod's hosts file
# on /etc/hosts, sets the hostname, and execs the command.
_NAMES_SCRIPT = 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"'


def namespace_wrapper(scratch: Path) -> list[str] | None:
    """The command prefix that starts a process with its own /etc/hosts and hostname (`wrap`'s first argument), or
    None (with one warning) where `unshare` is missing or may not make mount and UTS namespaces here; then processes
    start as before, with the machine's /etc/hosts and hostname. Probed once, by running it."""
    unshare = shutil.which("unshare")
    if unshare is None:
        log.warning("unshare not found (util-linux): process pods see this machine's /etc/hosts and hostname")
        return None
    prefix = [unshare, "--mount", "--uts", "--propagation", "private"]
    if os.geteuid() != 0:
        prefix += ["--user", "--map-root-user"]
    scratch.mkdir(parents=True, exist_ok=True)
    hosts = scratch / ".hosts-probe"
    hosts.write_text(hosts_file("127.0.0.1", "npuserve-probe", None, []))
    try:
        proc = subprocess.run(
            wrap(prefix, hosts, "npuserve-probe", ["cat", "/etc/hosts"]), capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        proc = subprocess.CompletedProcess([], 1, "", str(e))
    finally:
        hosts.unlink(missing_ok=True)
    if proc.returncode != 0 or "npuserve-probe" not in proc.stdout:
        why = (proc.stderr.strip() or f"exit {proc.returncode}")[-300:]
        log.warning("%s cannot give processes their own /etc/hosts and hostname (%s); process pods see this "
                    "machine's", " ".join(prefix), why)  # fmt: skip
        return None
    return prefix


def wrap(prefix: list[str] | None, hosts: Path, hostname: str, argv: list[str]) -> list[str]:
    """`argv` run through `prefix` (`namespace_wrapper`) with `hosts` as its /etc/hosts and `hostname`; `argv` as
    it is without a prefix."""
    if not prefix:
        return list(argv)
    return [*prefix, "sh", "-c", _NAMES_SCRIPT, "sh", str(hosts), hostname, *argv]


# ---- the API server ----------------------------------------------------------------------------------------------
class Api:
    """The calls the kubelet makes, through the `kubernetes` client as the cluster's admin."""

    def __init__(self, kubeconfig: Path) -> None:
        configuration = client.Configuration()
        config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=str(kubeconfig), client_configuration=configuration
        )
        self.client = client.ApiClient(configuration)
        self.core = client.CoreV1Api(self.client)

    def to_dict(self, obj: Any) -> dict[str, Any]:
        """An object of the client as the API server's JSON (camelCase keys, no nulls)."""
        out: dict[str, Any] = self.client.sanitize_for_serialization(obj)  # type: ignore[no-untyped-call]
        return out

    def fake_nodes(self) -> set[str]:
        return {
            str(n.metadata.name)
            for n in self.core.list_node(_request_timeout=API_TIMEOUT).items
            if n.metadata is not None and (n.metadata.annotations or {}).get(NODE_ANNOTATION) == NODE_ANNOTATION_VALUE
        }

    def ignored_namespaces(self) -> set[str]:
        selector = f"{IGNORE_LABEL}={IGNORE_VALUE}"
        items = self.core.list_namespace(label_selector=selector, _request_timeout=API_TIMEOUT).items
        return {str(ns.metadata.name) for ns in items if ns.metadata is not None}

    def live_pods(self, skip_namespaces: set[str]) -> list[client.V1Pod]:
        """Every pod not finished (phase neither Succeeded nor Failed), outside `skip_namespaces`. The API server
        filters: the client takes about 2 ms to build a pod's model, and this runs twice a second (the reconcile
        benchmark's 50 InferenceServices are all in an ignored namespace)."""
        selector = ["status.phase!=Succeeded", "status.phase!=Failed"]
        selector += [f"metadata.namespace!={ns}" for ns in sorted(skip_namespaces)]
        pods = self.core.list_pod_for_all_namespaces(field_selector=",".join(selector), _request_timeout=API_TIMEOUT)
        return list(pods.items)

    @staticmethod
    def _optional(read: Callable[..., T], name: str, namespace: str) -> T | None:
        """`read(name, namespace)`, None if there is no such object."""
        try:
            return read(name, namespace, _request_timeout=API_TIMEOUT)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def headless_services(self) -> list[client.V1Service]:
        items = self.core.list_service_for_all_namespaces(_request_timeout=API_TIMEOUT).items
        return [s for s in items if s.spec is not None and s.spec.cluster_ip == "None"]

    def config_map(self, namespace: str, name: str) -> client.V1ConfigMap | None:
        return self._optional(self.core.read_namespaced_config_map, name, namespace)

    def secret(self, namespace: str, name: str) -> client.V1Secret | None:
        return self._optional(self.core.read_namespaced_secret, name, namespace)

    def patch_pod_status(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        self.core.patch_namespaced_pod_status(
            name,
            namespace,
            patch,
            _content_type="application/strategic-merge-patch+json",
            _request_timeout=API_TIMEOUT,
        )


@dataclass
class Container:
    uid: str
    namespace: str
    name: str
    container: str
    ip: str
    port: int  # the engine's; 0 for a bench, which listens on nothing
    folder: Path
    hostname: str = ""
    kind: str = SERVE
    restart_policy: str = "Always"
    ready_path: str = "/ready"
    failure_threshold: int = 3
    grace: float = MAX_GRACE_SECONDS
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    ready: bool = False
    failures: int = 0
    next_probe: float = 0.0
    next_start: float = 0.0
    stopping_since: float | None = None
    backoff: float = BACKOFF_START
    configmaps: dict[str, str] = field(default_factory=dict)  # volume name -> resourceVersion written
    image: str = ""
    state: dict[str, Any] = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: dict[str, Any] = field(default_factory=dict)
    container_id: str | None = None
    others: list[dict[str, Any]] = field(default_factory=list)  # the statuses of the pod's other containers
    final: dict[str, Any] | None = None  # the terminal status patch of a container that is not restarted
    hosts: str = ""  # the hosts file's content as last written

    @property
    def hosts_path(self) -> Path:
        return self.folder / "hosts"

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def log_path(self) -> Path:
        return self.folder / ("engine.log" if self.kind == SERVE else "container.log")

    def restarts_after(self, code: int) -> bool:
        """Whether the pod's restartPolicy restarts a container that exited with `code`."""
        return self.restart_policy == "Always" or (self.restart_policy == "OnFailure" and code != 0)


class Mount(NamedTuple):
    """A volume mount of the process container, and where it is on this machine."""

    path: str
    local: Path
    volume: client.V1Volume | None
    mount: client.V1VolumeMount


class Kubelet:
    def __init__(self, cluster_dir: Path, npuserve: str) -> None:
        self.dir = cluster_dir
        self.pods_dir = cluster_dir / "pods"
        self.npuserve = npuserve
        self.api = Api(cluster_dir / "kubeconfig")
        self.containers: dict[str, Container] = {}
        self.stopping: list[Container] = []
        self.waiting_reported: dict[str, str] = {}
        self.nodes: set[str] = set()
        self.nodes_read = 0.0
        self.records: list[DnsRecord] = []
        self.wrapper: list[str] | None = None
        self.stop = threading.Event()

    # -- the loop ----------------------------------------------------------------------------------------------------
    def run(self) -> None:
        self.pods_dir.mkdir(parents=True, exist_ok=True)
        for folder in sweep(self.pods_dir):
            log.info("ended a leftover engine process of %s", folder)
        self.wrapper = namespace_wrapper(self.pods_dir)
        if self.wrapper:
            log.info("process pods get their own /etc/hosts and hostname (%s)", " ".join(self.wrapper))
        while not self.stop.is_set():
            try:
                self.sync()
            except Exception:
                log.exception("sync failed")
            self.stop.wait(LOOP_SECONDS)
        self.shutdown()

    def shutdown(self) -> None:
        for c in list(self.containers.values()):
            self.begin_stop(c, "kubelet stopping")
        self.containers.clear()
        deadline = time.monotonic() + MAX_GRACE_SECONDS
        while self.stopping and time.monotonic() < deadline + 5:
            self.reap_stopping()
            time.sleep(0.1)

    def fake_nodes(self) -> set[str]:
        if time.monotonic() - self.nodes_read > 10 or not self.nodes:
            self.nodes = self.api.fake_nodes()
            self.nodes_read = time.monotonic()
        return self.nodes

    def sync(self) -> None:
        nodes = self.fake_nodes()
        wanted: dict[str, client.V1Pod] = {}
        on_nodes = [
            pod
            for pod in self.api.live_pods(skip_namespaces=self.api.ignored_namespaces())
            if parts(pod)[1].node_name in nodes
        ]
        named = [pod for pod in on_nodes if parts(pod)[1].subdomain]
        self.records = dns_records(named, self.api.headless_services()) if named else []
        for pod in on_nodes:
            meta, _, status = parts(pod)
            if meta.deletion_timestamp:
                continue
            if process_container(pod) is None or not status.pod_ip:
                continue
            wanted[str(meta.uid)] = pod
        for uid in [u for u in self.containers if u not in wanted]:
            self.begin_stop(self.containers.pop(uid), "pod deleted")
        self.reap_stopping()
        for uid, pod in wanted.items():
            c = self.containers.get(uid)
            try:
                if c is None:
                    c = self.admit(pod)
                    if c is None:
                        continue
                self.tend(c, pod)
            except ApiException as e:
                if e.status != 404:  # 404: the pod went meanwhile
                    meta = parts(pod)[0]
                    log.warning("%s/%s: HTTP %s: %s", meta.namespace, meta.name, e.status, str(e.body)[:300])

    # -- one pod -----------------------------------------------------------------------------------------------------
    def admit(self, pod: client.V1Pod) -> Container | None:
        meta, spec, status = parts(pod)
        ctr = process_container(pod)
        assert ctr is not None
        kind = process_kind(ctr) or SERVE
        probe = ctr.readiness_probe if kind == SERVE else None
        http_get = probe.http_get if probe is not None else None
        threshold = probe.failure_threshold if probe is not None else None
        grace = spec.termination_grace_period_seconds
        hostname = pod_hostname(pod)[0]
        c = Container(
            uid=str(meta.uid),
            namespace=str(meta.namespace),
            name=str(meta.name),
            container=ctr.name,
            ip=str(status.pod_ip),
            port=container_port(ctr) if kind == SERVE else 0,
            folder=self.pods_dir / f"{meta.namespace}_{meta.name}",
            hostname=hostname,
            kind=kind,
            restart_policy=str(spec.restart_policy or "Always"),
            ready_path=str((http_get.path if http_get is not None else None) or "/ready"),
            failure_threshold=int(3 if threshold is None else threshold),
            grace=min(float(30 if grace is None else grace), MAX_GRACE_SECONDS),
            image=str(ctr.image or ""),
        )
        self.containers[c.uid] = c
        return c

    def address_busy(self, c: Container) -> bool:
        if c.kind != SERVE:
            return False  # a bench binds no address
        return any(o.ip == c.ip and o.port == c.port for o in self.stopping) or any(
            o is not c and o.ip == c.ip and o.port == c.port and o.running() for o in self.containers.values()
        )

    def tend(self, c: Container, pod: client.V1Pod) -> None:
        statuses = parts(pod)[2].container_statuses or []
        c.others = [self.api.to_dict(s) for s in statuses if s.name != c.container]
        if c.proc is not None and c.proc.poll() is not None:
            self.exited(c)
        if c.final is not None:
            # Finished for good; the pod is still listed as live only until the API server has the terminal
            # status (this repeats the patch if an earlier one failed).
            self.api.patch_pod_status(c.namespace, c.name, c.final)
            return
        self.write_hosts(c, pod)
        if c.proc is None:
            if time.monotonic() >= c.next_start and not self.address_busy(c):
                self.start(c, pod)
            return
        self.sync_configmaps(c, pod)
        if time.monotonic() >= c.next_probe:
            self.probe(c)

    def start(self, c: Container, pod: client.V1Pod) -> None:
        try:
            argv, env = self.prepare(c, pod)
        except MissingReference as e:
            self.report_waiting(c, "CreateContainerConfigError", str(e))
            c.next_start = time.monotonic() + 2
            return
        if not Path(self.npuserve).exists():
            self.report_waiting(c, "CreateContainerError", f"{self.npuserve} not found (make setup)")
            c.next_start = time.monotonic() + 10
            return
        logf = c.log_path.open("ab")
        logf.write(f"\n# {now()} {' '.join(argv)}\n".encode())
        logf.flush()
        c.proc = subprocess.Popen(
            wrap(self.wrapper, c.hosts_path, c.hostname, argv), cwd=c.folder, env=env, stdin=subprocess.DEVNULL,
            stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        logf.close()
        start = proc_starttime(c.proc.pid)
        (c.folder / "pid").write_text(f"{c.proc.pid} {start or 0}\n")
        c.ready, c.failures, c.next_probe = False, 0, time.monotonic() + 0.5
        if c.kind == SERVE:
            log.info("%s/%s: started pid %d on %s:%d", c.namespace, c.name, c.proc.pid, c.ip, c.port)
        else:  # no readiness probe: ready once started, as a kubelet does
            c.ready, c.next_probe = True, math.inf
            log.info("%s/%s: started %s pid %d", c.namespace, c.name, c.kind, c.proc.pid)
        self.waiting_reported.pop(c.uid, None)
        c.state = {"running": {"startedAt": now()}}
        c.container_id = f"process://{c.proc.pid}"
        self.api.patch_pod_status(c.namespace, c.name, self.status_patch(c))

    def exited(self, c: Container) -> None:
        assert c.proc is not None
        code = c.proc.returncode
        (c.folder / "pid").unlink(missing_ok=True)
        c.proc = None
        c.ready = False
        started_at = (c.state.get("running") or {}).get("startedAt")
        terminated: dict[str, Any] = {
            "exitCode": code if code >= 0 else 128 - code,
            "reason": "Completed" if code == 0 else "Error",
            "finishedAt": now(),
            "message": tail(c.log_path, lines=5, missing="")[-1000:],
        }
        if started_at:
            terminated["startedAt"] = started_at
        if code < 0:
            terminated["signal"] = -code
        if not c.restarts_after(code):
            phase = "Succeeded" if code == 0 else "Failed"
            log.info("%s/%s: %s exited with %s; pod %s (log: %s)", c.namespace, c.name, c.kind, code, phase,
                     c.log_path)  # fmt: skip
            c.state = {"terminated": terminated}
            c.final = self.status_patch(c, phase=phase)
            self.api.patch_pod_status(c.namespace, c.name, c.final)
            return
        c.restarts += 1
        c.next_start = time.monotonic() + c.backoff
        log.warning("%s/%s: %s exited with %s; restarting in %.0fs (log: %s)",
                    c.namespace, c.name, c.kind, code, c.backoff, c.log_path)  # fmt: skip
        c.backoff = min(c.backoff * 2, BACKOFF_MAX)
        c.state = {"waiting": {"reason": "CrashLoopBackOff", "message": f"back-off restarting the {c.kind} process"}}
        c.last_state = {"terminated": terminated}
        self.api.patch_pod_status(c.namespace, c.name, self.status_patch(c))

    def probe(self, c: Container) -> None:
        ok = False
        try:
            conn = http.client.HTTPConnection(c.ip, c.port, timeout=2)
            try:
                conn.request("GET", c.ready_path)
                ok = conn.getresponse().status == 200
            finally:
                conn.close()
        except (OSError, http.client.HTTPException):
            ok = False
        c.failures = 0 if ok else c.failures + 1
        c.next_probe = time.monotonic() + (2.0 if c.ready else 1.0)
        if ok and not c.ready:
            c.ready = True
            log.info("%s/%s: ready", c.namespace, c.name)
            self.api.patch_pod_status(c.namespace, c.name, self.status_patch(c))
        elif c.ready and c.failures >= c.failure_threshold:
            c.ready = False
            log.warning("%s/%s: not ready (%d failed probes of %s)", c.namespace, c.name, c.failures, c.ready_path)
            self.api.patch_pod_status(c.namespace, c.name, self.status_patch(c))

    def status_patch(self, c: Container, phase: str | None = None) -> dict[str, Any]:
        """Conditions merge by type; containerStatuses has no merge key in a strategic-merge patch, so the whole
        list goes: this container's full status and the others' as last seen. `phase`: the pod's terminal phase
        (Succeeded, Failed), with the conditions a kubelet gives a finished pod."""
        ready = "True" if c.ready and all(o.get("ready") for o in c.others) else "False"
        reason = None if ready == "True" else "ContainersNotReady"
        message = None if ready == "True" else f"containers with unready status: [{c.container}]"
        if phase is not None:
            reason, message = "PodCompleted", None
        t = now()
        conditions = [
            {"type": kind, "status": ready, "reason": reason, "message": message, "lastTransitionTime": t}
            for kind in ("Ready", "ContainersReady")
        ]
        cs: dict[str, Any] = {
            "name": c.container,
            "image": c.image,
            "imageID": "",
            "ready": c.ready,
            "started": c.ready,
            "restartCount": c.restarts,
            "state": c.state,
            "lastState": c.last_state,
        }
        if c.container_id:
            cs["containerID"] = c.container_id
        status: dict[str, Any] = {"conditions": conditions, "containerStatuses": [cs, *c.others]}
        if phase is not None:
            status["phase"] = phase
        return {"status": status}

    def report_waiting(self, c: Container, reason: str, message: str) -> None:
        if self.waiting_reported.get(c.uid) == message:
            return
        self.waiting_reported[c.uid] = message
        log.warning("%s/%s: %s: %s", c.namespace, c.name, reason, message)
        c.state = {"waiting": {"reason": reason, "message": message}}
        self.api.patch_pod_status(c.namespace, c.name, self.status_patch(c))

    def begin_stop(self, c: Container, why: str) -> None:
        if c.running():
            assert c.proc is not None
            log.info("%s/%s: %s; SIGTERM to pid %d", c.namespace, c.name, why, c.proc.pid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(c.proc.pid, signal.SIGTERM)
            c.stopping_since = time.monotonic()
            self.stopping.append(c)
        else:
            (c.folder / "pid").unlink(missing_ok=True)

    def reap_stopping(self) -> None:
        for c in list(self.stopping):
            assert c.proc is not None and c.stopping_since is not None
            if c.proc.poll() is not None:
                log.info("%s/%s: pid %d exited (%s)", c.namespace, c.name, c.proc.pid, c.proc.returncode)
                (c.folder / "pid").unlink(missing_ok=True)
                self.stopping.remove(c)
            elif time.monotonic() - c.stopping_since > c.grace:
                log.warning("%s/%s: pid %d still running after %.0fs; SIGKILL", c.namespace, c.name, c.proc.pid,
                            c.grace)  # fmt: skip
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(c.proc.pid, signal.SIGKILL)
                c.stopping_since = time.monotonic() - c.grace + 5  # look again in 5 s

    # -- the container's files, argv and env --------------------------------------------------------------------------
    def write_hosts(self, c: Container, pod: client.V1Pod) -> None:
        """The pod's hosts file (`hosts_file`), rewritten in place when its records change."""
        hostname, domain = pod_hostname(pod)
        aliases = [(str(a.ip), [str(h) for h in a.hostnames or []]) for a in parts(pod)[1].host_aliases or []]
        content = hosts_file(c.ip, hostname, domain, self.records, aliases)
        if content == c.hosts and c.hosts_path.exists():
            return
        c.folder.mkdir(parents=True, exist_ok=True)
        write_in_place(c.hosts_path, content)
        c.hosts = content

    def mounts(self, c: Container, pod: client.V1Pod) -> list[Mount]:
        ctr = process_container(pod)
        volumes = {v.name: v for v in parts(pod)[1].volumes or []}
        out = [
            Mount(m.mount_path, c.folder / m.mount_path.lstrip("/"), volumes.get(m.name), m)
            for m in (ctr.volume_mounts if ctr is not None else None) or []
        ]
        out.sort(key=lambda m: len(m.path), reverse=True)
        return out

    def sync_configmaps(self, c: Container, pod: client.V1Pod, first: bool = False) -> None:
        """Write each ConfigMap volume (atomically per file) when its resourceVersion changed."""
        for m in self.mounts(c, pod):
            ref = m.volume.config_map if m.volume is not None else None
            if ref is None:
                continue
            cm = self.api.config_map(c.namespace, str(ref.name))
            if cm is None:
                if first and not ref.optional:
                    raise MissingReference(f'configmap "{ref.name}" not found')
                continue
            version = str(cm.metadata.resource_version if cm.metadata is not None else "")
            if c.configmaps.get(m.mount.name) == version:
                continue
            data: dict[str, str] = dict(cm.data or {})
            for k, v in (cm.binary_data or {}).items():
                data[k] = base64.b64decode(v).decode(errors="replace")
            items = [(i.key, i.path) for i in ref.items] if ref.items else [(k, k) for k in data]
            sub_path = m.mount.sub_path
            for key, path in items:
                if key not in data:
                    continue
                if sub_path and path != sub_path:
                    continue
                target = m.local if sub_path else m.local / path
                target.parent.mkdir(parents=True, exist_ok=True)
                tmp = target.with_name(target.name + ".tmp")
                tmp.write_text(data[key])
                tmp.replace(target)
            c.configmaps[m.mount.name] = version

    def prepare(self, c: Container, pod: client.V1Pod) -> tuple[list[str], dict[str, str]]:
        ctr = process_container(pod)
        assert ctr is not None and ctr.command is not None
        c.folder.mkdir(parents=True, exist_ok=True)
        mounts = self.mounts(c, pod)
        for m in mounts:
            vol = m.volume
            if vol is not None and vol.empty_dir is not None:
                m.local.mkdir(parents=True, exist_ok=True)
            elif vol is not None and vol.host_path is not None:
                if not m.local.exists():
                    m.local.parent.mkdir(parents=True, exist_ok=True)
                    m.local.symlink_to(vol.host_path.path)
            elif vol is not None and vol.projected is not None and m.mount.name.startswith("kube-api-access-"):
                pass  # the service account token a Job's pod gets by default; nothing here talks to the API server
            elif vol is None or vol.config_map is None:
                kinds = [k for k in self.api.to_dict(vol) if k != "name"] if vol is not None else []
                log.warning("%s/%s: volume %s (%s) is not materialised", c.namespace, c.name, m.mount.name,
                            ", ".join(kinds))  # fmt: skip
        c.configmaps.clear()
        self.sync_configmaps(c, pod, first=True)
        paths = [(m.path, m.local) for m in mounts]

        env = {k: os.environ[k] for k in ("PATH", "LANG", "LC_ALL", "TZ") if k in os.environ}
        env["HOSTNAME"] = c.hostname
        resources = ctr.resources or client.V1ResourceRequirements()
        cpu = (resources.limits or {}).get("cpu") or (resources.requests or {}).get("cpu")
        if cpu:
            env["OMP_NUM_THREADS"] = str(max(1, min(os.cpu_count() or 1, math.ceil(_cpu_quantity(str(cpu))))))
        # The container's own variables, as its processes see them: a value may refer to those defined before it
        # with $(NAME); the command and args to all of them.
        defined: dict[str, str] = {}
        for e in ctr.env or []:
            value = self.env_value(c, pod, e)
            if value is not None:
                defined[e.name] = expand(value, defined) if e.value is not None else value
                env[e.name] = rewrite_path(defined[e.name], paths)

        argv = [self.npuserve] + [
            rewrite_path(expand(str(a), defined), paths) for a in [*ctr.command[1:], *(ctr.args or [])]
        ]
        if c.kind == SERVE:  # the engine binds the pod's IP; a bench's arguments are its own business
            for i, a in enumerate(argv):
                if a == "--host" and i + 1 < len(argv):
                    argv[i + 1] = c.ip
                elif a.startswith("--host="):
                    argv[i] = f"--host={c.ip}"
            if "--host" not in argv and not any(a.startswith("--host=") for a in argv):
                argv += ["--host", c.ip]

        preload = env.get("LD_PRELOAD")
        if preload:
            kept = [p for p in preload.replace(":", " ").split() if Path(p).exists()]
            dropped = [p for p in preload.replace(":", " ").split() if p not in kept]
            if dropped:
                log.info("%s/%s: LD_PRELOAD %s not on this machine; dropped", c.namespace, c.name, " ".join(dropped))
            if kept:
                env["LD_PRELOAD"] = " ".join(kept)
            else:
                del env["LD_PRELOAD"]
        return argv, env

    def env_value(self, c: Container, pod: client.V1Pod, e: client.V1EnvVar) -> str | None:
        if e.value is not None:
            return str(e.value)
        src = e.value_from or client.V1EnvVarSource()
        if src.field_ref is not None:
            v = field_ref(pod, src.field_ref.field_path)
            if v is None:
                log.info("%s/%s: env %s: fieldRef %s not resolved; skipped", c.namespace, c.name, e.name,
                         src.field_ref.field_path)  # fmt: skip
            return v
        ref: client.V1SecretKeySelector | client.V1ConfigMapKeySelector
        obj: client.V1Secret | client.V1ConfigMap | None
        if src.secret_key_ref is not None:
            ref, kind = src.secret_key_ref, "secret"
            obj = self.api.secret(c.namespace, str(ref.name))
        elif src.config_map_key_ref is not None:
            ref, kind = src.config_map_key_ref, "configmap"
            obj = self.api.config_map(c.namespace, str(ref.name))
        else:
            log.info("%s/%s: env %s: unsupported source %s; skipped", c.namespace, c.name, e.name,
                     list(self.api.to_dict(src)))  # fmt: skip
            return None
        data = (obj.data if obj is not None else None) or {}
        if ref.key in data:
            raw = data[ref.key]
            return base64.b64decode(raw).decode() if kind == "secret" else str(raw)
        if ref.optional:
            return None
        raise MissingReference(f"{kind} {ref.name!r} (key {ref.key!r}) not found")


class MissingReference(Exception):
    pass


# ---- health endpoint and main ---------------------------------------------------------------------------------------
def serve_health(port: int, kubelet: Kubelet) -> http.server.ThreadingHTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"pods": sorted(f"{c.namespace}/{c.name}" for c in kubelet.containers.values())})
            self.send_response(200 if self.path.startswith("/healthz") else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kubelet.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cluster-dir", required=True, type=Path)
    parser.add_argument("--port", type=int, required=True, help="health endpoint (127.0.0.1)")
    parser.add_argument("--npuserve", default=default_npuserve(), help="the npuserve executable to run")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stdout)
    kubelet = Kubelet(args.cluster_dir.resolve(), args.npuserve)
    signal.signal(signal.SIGTERM, lambda *_: kubelet.stop.set())
    signal.signal(signal.SIGINT, lambda *_: kubelet.stop.set())
    server = serve_health(args.port, kubelet)
    log.info("process kubelet: engines run with %s", args.npuserve)
    kubelet.run()
    server.shutdown()
    log.info("process kubelet stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
