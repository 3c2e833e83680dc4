#!/usr/bin/env python3
"""The process kubelet: runs the real `npuserve serve` as a local process for each engine pod on a KWOK node.

KWOK fakes everything a kubelet does for ordinary pods. For engine pods (a container whose command is
`npuserve serve ...`) KWOK's stage only sets the pod Running with a loopback pod IP and leaves it not Ready
(`kwok.kwok_pod_stages`); this process does the rest, as a kubelet would:

- starts the container's command with the local `npuserve` (the virtual environment's), `--host <podIP>` and the
  pod's port, in the pod's folder `.cluster/pods/<namespace>_<name>/` (log: `engine.log`, PID: `pid`);
- env: plain values, `fieldRef`s (metadata.name/namespace/uid/labels/annotations, spec.nodeName,
  spec.serviceAccountName, status.podIP/hostIP), `secretKeyRef`/`configMapKeyRef` from the real objects (optional
  ones that are missing are skipped; a missing required one keeps the container waiting with
  CreateContainerConfigError); `LD_PRELOAD` is dropped when the library is not on this machine; `OMP_NUM_THREADS`
  is set from the container's CPU limit (else request) unless the pod sets it, as a CPU quota would bound it;
- volumes: ConfigMaps (kept in sync, written atomically, so the engine's config-file watch sees changes) and
  emptyDirs are materialised under the pod folder at their mount paths; every argument or env value under a mount
  path is rewritten to the local folder;
- readiness: `GET http://<podIP>:<port>/ready` (the container's readinessProbe path and failure threshold); the
  pod's Ready and ContainersReady conditions and the container status follow it (strategic-merge patches of
  `pods/status`); a process that exits is reported as terminated (exit code, reason) and restarted with a
  back-off (CrashLoopBackOff), as `restartPolicy: Always` asks;
- a pod that is deleted or goes away: SIGTERM, then SIGKILL after the grace period (capped at 30 s). A new pod that
  gets a freed IP starts only when the previous process on that address has exited.

Namespaces labelled `npuserve.io/process-kubelet=ignore` are left alone (the reconcile benchmark uses this: its
engine pods never start). Standard library only; started and stopped by `lifecycle.py` (`make cluster-up/down`).
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
import signal
import ssl
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from binaries import default_npuserve
from kwok import NODE_ANNOTATION, NODE_ANNOTATION_VALUE
from processes import proc_starttime, sweep, tail

IGNORE_LABEL = "npuserve.io/process-kubelet"
IGNORE_VALUE = "ignore"
MAX_GRACE_SECONDS = 30.0
BACKOFF_START, BACKOFF_MAX = 5.0, 120.0
LOOP_SECONDS = 0.5

log = logging.getLogger("kubelet")


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def is_engine_container(container: dict[str, Any]) -> bool:
    cmd = container.get("command") or []
    return len(cmd) >= 2 and os.path.basename(str(cmd[0])) == "npuserve" and cmd[1] == "serve"


def engine_container(pod: dict[str, Any]) -> dict[str, Any] | None:
    for c in pod.get("spec", {}).get("containers", []):
        if is_engine_container(c):
            return dict(c)
    return None


def container_port(container: dict[str, Any]) -> int:
    """The port the engine listens on: its `--port` argument, else the first containerPort, else 8000."""
    argv = [*container.get("command", []), *container.get("args", [])]
    for i, a in enumerate(argv):
        if a == "--port" and i + 1 < len(argv):
            return int(argv[i + 1])
        if str(a).startswith("--port="):
            return int(str(a).split("=", 1)[1])
    ports = container.get("ports") or []
    return int(ports[0]["containerPort"]) if ports else 8000


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


def field_ref(pod: dict[str, Any], path: str) -> str | None:
    meta, spec, status = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status", {})
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.podIP": status.get("podIP"),
        "status.hostIP": status.get("hostIP"),
    }
    if path in simple:
        v = simple[path]
        return None if v is None else str(v)
    for kind in ("labels", "annotations"):
        head = f"metadata.{kind}['"
        if path.startswith(head) and path.endswith("']"):
            v = (meta.get(kind) or {}).get(path[len(head) : -2])
            return None if v is None else str(v)
    return None


# ---- the API server ----------------------------------------------------------------------------------------------
class ApiError(RuntimeError):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status = status


class Api:
    """A minimal client over the admin certificates of the local cluster."""

    def __init__(self, cluster_dir: Path) -> None:
        state = json.loads((cluster_dir / "state.json").read_text())
        self.port = int(state["ports"]["apiserver"])
        pki = cluster_dir / "pki"
        self.ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        self.ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
        self._local = threading.local()

    def _conn(self) -> http.client.HTTPSConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = http.client.HTTPSConnection("127.0.0.1", self.port, context=self.ctx, timeout=10)
            self._local.conn = conn
        return conn

    def request(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = content_type
        for attempt in (0, 1):
            conn = self._conn()
            try:
                conn.request(method, path, body=data, headers=headers)
                resp = conn.getresponse()
                text = resp.read().decode(errors="replace")
            except (OSError, http.client.HTTPException):
                conn.close()
                self._local.conn = None
                if attempt:
                    raise
                continue
            if resp.status >= 300:
                raise ApiError(resp.status, text)
            return json.loads(text) if text else None
        return None

    def get(self, path: str) -> Any:
        return self.request("GET", path)

    def get_optional(self, path: str) -> Any | None:
        try:
            return self.get(path)
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def patch_pod_status(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        self.request(
            "PATCH",
            f"/api/v1/namespaces/{namespace}/pods/{name}/status",
            patch,
            "application/strategic-merge-patch+json",
        )


@dataclass
class Container:
    uid: str
    namespace: str
    name: str
    container: str
    ip: str
    port: int
    folder: Path
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

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Kubelet:
    def __init__(self, cluster_dir: Path, npuserve: str) -> None:
        self.dir = cluster_dir
        self.pods_dir = cluster_dir / "pods"
        self.npuserve = npuserve
        self.api = Api(cluster_dir)
        self.containers: dict[str, Container] = {}
        self.stopping: list[Container] = []
        self.waiting_reported: dict[str, str] = {}
        self.nodes: set[str] = set()
        self.nodes_read = 0.0
        self.stop = threading.Event()

    # -- the loop ----------------------------------------------------------------------------------------------------
    def run(self) -> None:
        self.pods_dir.mkdir(parents=True, exist_ok=True)
        for folder in sweep(self.pods_dir):
            log.info("ended a leftover engine process of %s", folder)
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
            nodes = self.api.get("/api/v1/nodes")["items"]
            self.nodes = {
                n["metadata"]["name"]
                for n in nodes
                if (n["metadata"].get("annotations") or {}).get(NODE_ANNOTATION) == NODE_ANNOTATION_VALUE
            }
            self.nodes_read = time.monotonic()
        return self.nodes

    def sync(self) -> None:
        nodes = self.fake_nodes()
        ignored = {
            ns["metadata"]["name"]
            for ns in self.api.get(f"/api/v1/namespaces?labelSelector={IGNORE_LABEL}%3D{IGNORE_VALUE}")["items"]
        }
        wanted: dict[str, dict[str, Any]] = {}
        for pod in self.api.get("/api/v1/pods")["items"]:
            meta, spec, status = pod["metadata"], pod.get("spec", {}), pod.get("status", {})
            if spec.get("nodeName") not in nodes or meta["namespace"] in ignored:
                continue
            if meta.get("deletionTimestamp") or status.get("phase") in ("Succeeded", "Failed"):
                continue
            if engine_container(pod) is None or not status.get("podIP"):
                continue
            wanted[meta["uid"]] = pod
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
            except ApiError as e:
                if e.status != 404:  # 404: the pod went meanwhile
                    log.warning("%s/%s: %s", pod["metadata"]["namespace"], pod["metadata"]["name"], e)

    # -- one pod -----------------------------------------------------------------------------------------------------
    def admit(self, pod: dict[str, Any]) -> Container | None:
        meta, spec = pod["metadata"], pod["spec"]
        ctr = engine_container(pod)
        assert ctr is not None
        probe = ctr.get("readinessProbe") or {}
        http_get = probe.get("httpGet") or {}
        grace = float(spec.get("terminationGracePeriodSeconds", 30))
        c = Container(
            uid=meta["uid"],
            namespace=meta["namespace"],
            name=meta["name"],
            container=ctr["name"],
            ip=pod["status"]["podIP"],
            port=container_port(ctr),
            folder=self.pods_dir / f"{meta['namespace']}_{meta['name']}",
            ready_path=str(http_get.get("path") or "/ready"),
            failure_threshold=int(probe.get("failureThreshold", 3)),
            grace=min(grace, MAX_GRACE_SECONDS),
            image=str(ctr.get("image", "")),
        )
        self.containers[c.uid] = c
        return c

    def address_busy(self, c: Container) -> bool:
        return any(o.ip == c.ip and o.port == c.port for o in self.stopping) or any(
            o is not c and o.ip == c.ip and o.port == c.port and o.running() for o in self.containers.values()
        )

    def tend(self, c: Container, pod: dict[str, Any]) -> None:
        c.others = [s for s in pod["status"].get("containerStatuses", []) if s.get("name") != c.container]
        if c.proc is not None and c.proc.poll() is not None:
            self.exited(c)
        if c.proc is None:
            if time.monotonic() >= c.next_start and not self.address_busy(c):
                self.start(c, pod)
            return
        self.sync_configmaps(c, pod)
        if time.monotonic() >= c.next_probe:
            self.probe(c)

    def start(self, c: Container, pod: dict[str, Any]) -> None:
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
        logf = (c.folder / "engine.log").open("ab")
        logf.write(f"\n# {now()} {' '.join(argv)}\n".encode())
        logf.flush()
        c.proc = subprocess.Popen(
            argv, cwd=c.folder, env=env, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        logf.close()
        start = proc_starttime(c.proc.pid)
        (c.folder / "pid").write_text(f"{c.proc.pid} {start or 0}\n")
        c.ready, c.failures, c.next_probe = False, 0, time.monotonic() + 0.5
        log.info("%s/%s: started pid %d on %s:%d", c.namespace, c.name, c.proc.pid, c.ip, c.port)
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
        c.restarts += 1
        c.next_start = time.monotonic() + c.backoff
        log.warning("%s/%s: engine exited with %s; restarting in %.0fs (log: %s)",
                    c.namespace, c.name, code, c.backoff, c.folder / "engine.log")  # fmt: skip
        c.backoff = min(c.backoff * 2, BACKOFF_MAX)
        reason = "Completed" if code == 0 else "Error"
        terminated = {
            "exitCode": code if code >= 0 else 128 - code,
            "reason": reason,
            "finishedAt": now(),
            "message": tail(c.folder / "engine.log", lines=5, missing="")[-1000:],
        }
        if code < 0:
            terminated["signal"] = -code
        c.state = {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off restarting the engine"}}
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

    def status_patch(self, c: Container) -> dict[str, Any]:
        """Conditions merge by type; containerStatuses has no merge key in a strategic-merge patch, so the whole
        list goes: this container's full status and the others' as last seen."""
        ready = "True" if c.ready and all(o.get("ready") for o in c.others) else "False"
        reason = None if ready == "True" else "ContainersNotReady"
        message = None if ready == "True" else f"containers with unready status: [{c.container}]"
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
        return {"status": {"conditions": conditions, "containerStatuses": [cs, *c.others]}}

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
    def mounts(self, c: Container, pod: dict[str, Any]) -> list[tuple[str, Path, dict[str, Any]]]:
        ctr = engine_container(pod) or {}
        volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
        out = []
        for m in ctr.get("volumeMounts", []):
            local = c.folder / m["mountPath"].lstrip("/")
            out.append((m["mountPath"], local, {**volumes.get(m["name"], {}), "_mount": m}))
        out.sort(key=lambda t: len(t[0]), reverse=True)
        return out

    def sync_configmaps(self, c: Container, pod: dict[str, Any], first: bool = False) -> None:
        """Write each ConfigMap volume (atomically per file) when its resourceVersion changed."""
        for _, local, vol in self.mounts(c, pod):
            ref = vol.get("configMap")
            if ref is None:
                continue
            cm = self.api.get_optional(f"/api/v1/namespaces/{c.namespace}/configmaps/{ref['name']}")
            if cm is None:
                if first and not ref.get("optional"):
                    raise MissingReference(f'configmap "{ref["name"]}" not found')
                continue
            version = cm["metadata"]["resourceVersion"]
            if c.configmaps.get(vol["name"]) == version:
                continue
            data: dict[str, str] = dict(cm.get("data") or {})
            for k, v in (cm.get("binaryData") or {}).items():
                data[k] = base64.b64decode(v).decode(errors="replace")
            items = ref.get("items") or [{"key": k, "path": k} for k in data]
            sub_path = vol["_mount"].get("subPath")
            for item in items:
                if item["key"] not in data:
                    continue
                if sub_path and item["path"] != sub_path:
                    continue
                target = local if sub_path else local / item["path"]
                target.parent.mkdir(parents=True, exist_ok=True)
                tmp = target.with_name(target.name + ".tmp")
                tmp.write_text(data[item["key"]])
                tmp.replace(target)
            c.configmaps[vol["name"]] = version

    def prepare(self, c: Container, pod: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
        ctr = engine_container(pod)
        assert ctr is not None
        c.folder.mkdir(parents=True, exist_ok=True)
        mounts = self.mounts(c, pod)
        for _, local, vol in mounts:
            if "emptyDir" in vol:
                local.mkdir(parents=True, exist_ok=True)
            elif "hostPath" in vol:
                if not local.exists():
                    local.parent.mkdir(parents=True, exist_ok=True)
                    local.symlink_to(vol["hostPath"]["path"])
            elif "configMap" not in vol:
                log.warning("%s/%s: volume %s (%s) is not materialised", c.namespace, c.name, vol.get("name"),
                            ", ".join(k for k in vol if k not in ("name", "_mount")))  # fmt: skip
        c.configmaps.clear()
        self.sync_configmaps(c, pod, first=True)
        paths = [(mp, local) for mp, local, _ in mounts]

        argv = [self.npuserve] + [rewrite_path(str(a), paths) for a in [*ctr["command"][1:], *ctr.get("args", [])]]
        for i, a in enumerate(argv):
            if a == "--host" and i + 1 < len(argv):
                argv[i + 1] = c.ip
            elif a.startswith("--host="):
                argv[i] = f"--host={c.ip}"
        if "--host" not in argv and not any(a.startswith("--host=") for a in argv):
            argv += ["--host", c.ip]

        env = {k: os.environ[k] for k in ("PATH", "LANG", "LC_ALL", "TZ") if k in os.environ}
        env["HOSTNAME"] = c.name
        resources = ctr.get("resources") or {}
        cpu = (resources.get("limits") or {}).get("cpu") or (resources.get("requests") or {}).get("cpu")
        if cpu:
            env["OMP_NUM_THREADS"] = str(max(1, min(os.cpu_count() or 1, math.ceil(_cpu_quantity(str(cpu))))))
        for e in ctr.get("env", []):
            value = self.env_value(c, pod, e)
            if value is not None:
                env[e["name"]] = rewrite_path(value, paths)
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

    def env_value(self, c: Container, pod: dict[str, Any], e: dict[str, Any]) -> str | None:
        if "value" in e:
            return str(e["value"])
        src = e.get("valueFrom") or {}
        if "fieldRef" in src:
            v = field_ref(pod, src["fieldRef"]["fieldPath"])
            if v is None:
                log.info("%s/%s: env %s: fieldRef %s not resolved; skipped", c.namespace, c.name, e["name"],
                         src["fieldRef"]["fieldPath"])  # fmt: skip
            return v
        for kind, plural in (("secretKeyRef", "secrets"), ("configMapKeyRef", "configmaps")):
            if kind in src:
                ref = src[kind]
                obj = self.api.get_optional(f"/api/v1/namespaces/{c.namespace}/{plural}/{ref['name']}")
                data = (obj or {}).get("data") or {}
                if ref["key"] in data:
                    raw = data[ref["key"]]
                    return base64.b64decode(raw).decode() if kind == "secretKeyRef" else str(raw)
                if ref.get("optional"):
                    return None
                raise MissingReference(f"{plural[:-1]} {ref['name']!r} (key {ref['key']!r}) not found")
        log.info("%s/%s: env %s: unsupported source %s; skipped", c.namespace, c.name, e["name"], list(src))
        return None


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
