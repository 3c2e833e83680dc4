#!/usr/bin/env python3
"""The autotune loop at scale: N InferenceServices with autotune on (online) against the local cluster's Prometheus,
fed by synthetic engines; the operator's CPU, its Prometheus queries, how late windows are read, reconcile latency.

    .venv/bin/python benchmarks/autotune_scale.py [--count 300] [--minutes 10] [--window 30s]

Against the local cluster (e2e/, started if needed and stopped afterwards unless `make cluster-up` started it), with
the chart's CRD (`helm upgrade --install`). Enough extra KWOK nodes are added for N engine pods (removed at the end).
The InferenceServices go to a namespace of their own labelled `npuserve.io/process-kubelet=ignore`: the process
kubelet leaves their pods alone, KWOK gives them Running and a loopback pod IP, and this script marks them Ready
(pods/status) once `benchmarks/synthetic_engines.py`, one process, answers on every pod IP's port 8000 as the engine
does (metrics, /info, PUT /admin/schedule with each service's admin token). The operator runs as it is deployed:
`npuserve operator --all-namespaces --prometheus-url <the cluster's Prometheus>`, a subprocess of its own.

Phases: create the N services (each create -> Deployed is timed), wait for their pods' IPs and admin Secrets, start
the engines, mark the pods Ready, wait until every service has started tuning (`status.tuning` holds a trial) or
`--ready-timeout`, then the steady phase of `--minutes`, in which one service in turn gets a spec change every
`--update-every` seconds (`spec.autotune.maxTrials` 8 <-> 9: reconciled, re-planned, no restart).

Figures, each over the steady phase:
- operator CPU: utime + stime (+ children's) of the operator process from /proc/<pid>/stat, per minute of wall time,
  and as % of one core; the engines', Prometheus's and the API server's beside it, and the load average (a shared
  machine);
- Prometheus queries: `prometheus_http_requests_total` by handler from Prometheus's own /metrics before and after
  (nothing else queries Prometheus in the steady phase): per minute, and per window read;
- windows read and how late: a watch on the InferenceServices sees each read. A trial's window is read when
  `status.tuning.current` moves past it (a new trial, the verdict, or the window measured again): lateness = when
  the watch saw that - its `measureUntil`. After the verdict a window is due `window` after `tuning.lastCheckAt`:
  lateness = when the watch saw lastCheckAt move - (previous lastCheckAt + window). p50/p99/max and count;
- reconcile: create -> Deployed (the Deployed condition True with observedGeneration = the object's generation), for
  all N; and spec change -> Deployed at the new generation in the steady phase. p50/p99/max.
Targets (issue 23): windows read within 10 s of their end, operator CPU under 20% of a core, reconcile p99 under 5 s.

A cluster this script starts scrapes the engines every `--scrape-interval` (5s) and has a /16 service range
(NPUSERVE_SCRAPE_INTERVAL, NPUSERVE_SERVICE_CIDR); a running one keeps its own (printed). `--py-spy PATH` records the
operator's stacks over the steady phase. The logs and result.json stay in `--out`.

Run by path, never with `-m` from the repository root (its `operator/` folder shadows the standard library's).
"""

from __future__ import annotations

import argparse
import base64
import collections
import datetime as dt
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "e2e" / "cluster"))
# A cluster this script starts gets a service range for more than 254 InferenceServices (each has a Service); read
# by e2e/cluster/pki.py at import. A running cluster keeps its own (`make cluster-up` with it set, for --count > 250).
os.environ.setdefault("NPUSERVE_SERVICE_CIDR", "10.0.0.0/16")
# And a scrape interval for a few hundred engine pods: the e2e tests' 1 s is 300 scrapes a second here (the chart's
# default is 15s). Changed with --scrape-interval, for a cluster this script starts.
for _i, _arg in enumerate(sys.argv):
    if _arg.startswith("--scrape-interval"):
        os.environ["NPUSERVE_SCRAPE_INTERVAL"] = _arg.partition("=")[2] or sys.argv[_i + 1]
os.environ.setdefault("NPUSERVE_SCRAPE_INTERVAL", "5s")

import kubernetes  # noqa: E402
import localk8s  # noqa: E402
import yaml  # noqa: E402
from operator_reconcile import helm_install, percentile  # noqa: E402

GROUP, VERSION, PLURAL = "npuserve.io", "v1alpha1", "inferenceservices"
IGNORE_LABEL = "npuserve.io/process-kubelet"
INSTANCE_LABEL = "npuserve.io/inferenceservice"
ADMIN_TOKEN_KEY = "token"  # npuserve.operator.render.ADMIN_TOKEN_KEY; the Secret is <name>-admin
PODS_PER_NODE = 40  # engine pods per KWOK node (192 CPUs, 110 pods: room for pods of 4 CPUs)
BENCH_NODE_PREFIX = "npu-node-bench-"
CLK_TCK = os.sysconf("SC_CLK_TCK")
TARGET_LATE_S, TARGET_CPU_PCT, TARGET_RECONCILE_P99_S = 10.0, 20.0, 5.0

TEMPLATE = """
apiVersion: npuserve.io/v1alpha1
kind: InferenceService
metadata:
  name: tune
spec:
  model: {name: tiny, preset: tiny, weights: {loadFormat: dummy}}
  accelerator: {type: cpu, cards: 1, memoryGiB: 2, reservedGiB: 0}
  replicas: 1
  workload: {avgInputTokens: 64, avgOutputTokens: 128, maxOutputTokens: 256, maxInputTokens: 256}
  slo: {objective: decodeLatency, tpotMs: 30}
  autotune: {enabled: true, mode: online, window: 30s, maxTrials: 8, minSamples: 20}
  engine: {cpu: 1, memoryGiB: 4}
  host: {cpuPinning: none, jemalloc: false}
"""


def parse_rfc3339(text: str) -> float:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def parse_duration(text: str) -> float:
    """A Go duration of h/m/s parts (`30s`, `2m`, `1m30s`)."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|m|s)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a duration of h/m/s: {text!r}")
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)


def cpu_seconds(pid: int) -> float:
    """utime + stime + cutime + cstime of a process, seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / CLK_TCK


def prometheus_requests(url: str) -> dict[str, float]:
    """prometheus_http_requests_total by handler, from Prometheus's own /metrics."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    out: dict[str, float] = collections.defaultdict(float)
    for line in text.splitlines():
        if line.startswith("prometheus_http_requests_total{"):
            handler = re.search(r'handler="([^"]*)"', line)
            if handler:
                out[handler.group(1)] += float(line.rsplit(" ", 1)[1])
    return dict(out)


def prometheus_value(url: str, promql: str) -> float | None:
    q = urllib.parse.urlencode({"query": promql})
    body = json.loads(urllib.request.urlopen(f"{url}/api/v1/query?{q}", timeout=10).read())
    result = body["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def stats(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"count": 0, "p50": None, "p99": None, "max": None}
    return {"count": len(values), "p50": round(percentile(values, 50), 3), "p99": round(percentile(values, 99), 3),
            "max": round(max(values), 3)}


@dataclass
class Window:
    name: str
    kind: str  # "trial": a trial's window; "check": a window after the verdict
    due: float  # unix time the window ended (was due)
    seen: float  # unix time the watch saw it read

    @property
    def late(self) -> float:
        return self.seen - self.due


@dataclass
class Seen:
    until: str | None = None  # status.tuning.current.measureUntil
    last_check: str | None = None
    history: int = 0
    tuning: bool = False


@dataclass
class Watcher:
    """A watch on the namespace's InferenceServices, in a thread: windows read, reconciles done."""

    custom: Any
    ns: str
    window_s: float
    seen: dict[str, Seen] = field(default_factory=lambda: collections.defaultdict(Seen))
    windows: list[Window] = field(default_factory=list)
    history_entries: int = 0
    pending: dict[str, tuple[int, float]] = field(default_factory=dict)  # name -> (generation, monotonic start)
    reconciled: list[tuple[str, int, float, float]] = field(default_factory=list)  # name, generation, start, end
    lock: threading.Lock = field(default_factory=threading.Lock)
    stopping: threading.Event = field(default_factory=threading.Event)
    started: threading.Event = field(default_factory=threading.Event)
    events: int = 0

    def expect(self, name: str, generation: int, start: float) -> None:
        with self.lock:
            self.pending[name] = (generation, start)

    def tuning_started(self) -> int:
        with self.lock:
            return sum(1 for s in self.seen.values() if s.tuning)

    def run(self) -> None:
        resource_version = None
        while not self.stopping.is_set():
            watch = kubernetes.watch.Watch()
            try:
                if resource_version is None:
                    listed = self.custom.list_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL)
                    for obj in listed.get("items") or []:
                        self.on_object(obj, time.time(), time.monotonic())
                    resource_version = listed["metadata"]["resourceVersion"]
                    self.started.set()
                for event in watch.stream(self.custom.list_namespaced_custom_object, GROUP, VERSION, self.ns,
                                          PLURAL, resource_version=resource_version, timeout_seconds=60,
                                          allow_watch_bookmarks=True):  # fmt: skip
                    obj = event["object"]
                    if event["type"] == "ERROR":
                        resource_version = None  # 410 Gone: list again
                        break
                    resource_version = obj["metadata"]["resourceVersion"]
                    if event["type"] in ("ADDED", "MODIFIED"):
                        self.on_object(obj, time.time(), time.monotonic())
                    if self.stopping.is_set():
                        break
            except kubernetes.client.ApiException as e:
                if e.status == 410:
                    resource_version = None
                else:
                    logging.warning("watch: %s", e)
                    time.sleep(1)
            except Exception as e:  # a dropped connection: watch again from where it was
                logging.warning("watch: %r", e)
                time.sleep(1)
            finally:
                watch.stop()

    def on_object(self, obj: dict[str, Any], wall: float, mono: float) -> None:
        name = obj["metadata"]["name"]
        status = obj.get("status") or {}
        tuning = status.get("tuning") or {}
        current = tuning.get("current") or None
        until = current.get("measureUntil") if current else None
        last_check = tuning.get("lastCheckAt")
        history = len(tuning.get("history") or [])
        with self.lock:
            self.events += 1
            s = self.seen[name]
            if s.until is not None and until != s.until:
                self.windows.append(Window(name, "trial", parse_rfc3339(s.until), wall))
            elif (s.until is None and until is None and s.last_check and last_check
                  and last_check != s.last_check):
                self.windows.append(Window(name, "check", parse_rfc3339(s.last_check) + self.window_s, wall))
            self.history_entries += max(0, history - s.history)
            s.until, s.last_check, s.history = until, last_check, history
            s.tuning = s.tuning or current is not None or history > 0
            waiting = self.pending.get(name)
            if waiting is not None:
                generation, start = waiting
                for cond in status.get("conditions") or []:
                    if (cond.get("type") == "Deployed" and cond.get("status") == "True"
                            and int(cond.get("observedGeneration") or 0) >= generation):
                        self.reconciled.append((name, generation, start, mono))
                        del self.pending[name]
                        break


class Bench:
    def __init__(self, args: argparse.Namespace, cluster: Any, out: Path) -> None:
        self.args = args
        self.cluster = cluster
        self.out = out
        api_client = kubernetes.config.new_client_from_config(config_file=str(cluster.kubeconfig))
        self.core = kubernetes.client.CoreV1Api(api_client)
        self.custom = kubernetes.client.CustomObjectsApi(api_client)
        self.ns = "bench-autotune-" + uuid.uuid4().hex[:6]
        self.window_s = parse_duration(args.window)
        self.template: dict[str, Any] = yaml.safe_load(TEMPLATE)
        self.template["spec"]["autotune"]["window"] = args.window
        self.template["spec"]["slo"]["tpotMs"] = args.tpot_ms
        self.names = [f"tune-{i:03d}" for i in range(args.count)]
        self.nodes: list[str] = []
        self.operator: subprocess.Popen[bytes] | None = None
        self.engines: subprocess.Popen[bytes] | None = None
        self.watcher = Watcher(self.custom, self.ns, self.window_s)
        self.result: dict[str, Any] = {}

    def say(self, text: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)

    # -- set up --

    def add_nodes(self) -> None:
        have = len(self.core.list_node().items)
        want = math.ceil(self.args.count / PODS_PER_NODE)
        for i in range(max(0, want - have)):
            node = localk8s.fake_node(f"{BENCH_NODE_PREFIX}{i}", i)
            self.core.create_node(node)
            self.nodes.append(node["metadata"]["name"])  # type: ignore[index]
        if self.nodes:
            self.say(f"added {len(self.nodes)} KWOK nodes ({have} there)")

    def start_operator(self) -> None:
        log = open(self.out / "operator.log", "wb")  # noqa: SIM115 - the subprocess writes it until stopped
        self.operator = subprocess.Popen(
            [str(REPO / ".venv" / "bin" / "npuserve"), "operator", "--all-namespaces", "--prometheus-url",
             self.cluster.prometheus_url, "--log-level", self.args.operator_log_level],
            stdout=log, stderr=subprocess.STDOUT, env=self.cluster.env())  # fmt: skip
        self.say(f"operator pid {self.operator.pid}, log {self.out / 'operator.log'}")

    def create_services(self) -> None:
        def create(name: str) -> None:
            obj = json.loads(json.dumps(self.template))
            obj["metadata"] = {"name": name, "namespace": self.ns}
            start = time.monotonic()
            created = self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, obj)
            self.watcher.expect(name, int(created["metadata"]["generation"]), start)

        started = time.monotonic()
        for name in self.names:
            create(name)
        self.result["create_calls_s"] = round(time.monotonic() - started, 2)

    def wait(self, what: str, done: Any, timeout: float, every: float = 2.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if done():
                return True
            time.sleep(every)
        self.say(f"timed out after {timeout:.0f} s waiting for {what}")
        return False

    def pods(self) -> list[Any]:
        return [p for p in self.core.list_namespaced_pod(self.ns, label_selector=INSTANCE_LABEL).items
                if p.metadata.deletion_timestamp is None]

    def start_engines(self) -> list[Any]:
        def placed() -> bool:
            pods = self.pods()
            return len(pods) >= self.args.count and all(p.status.pod_ip for p in pods)

        self.wait("every engine pod to have an IP", placed, self.args.ready_timeout)
        pods = [p for p in self.pods() if p.status.pod_ip]
        kv_blocks = {}
        for item in self.custom.list_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL)["items"]:
            kv_blocks[item["metadata"]["name"]] = int(((item.get("status") or {}).get("plan") or {})
                                                      .get("totalBlocks") or 8192)
        tokens: dict[str, str] = {}

        def secrets() -> bool:
            for s in self.core.list_namespaced_secret(self.ns).items:
                if s.metadata.name.endswith("-admin") and (s.data or {}).get(ADMIN_TOKEN_KEY):
                    tokens[s.metadata.name[: -len("-admin")]] = base64.b64decode(s.data[ADMIN_TOKEN_KEY]).decode()
            return all(p.metadata.labels[INSTANCE_LABEL] in tokens for p in pods)

        self.wait("the admin Secrets", secrets, 120)
        spec = [{"name": p.metadata.name, "ip": p.status.pod_ip,
                 "token": tokens.get(p.metadata.labels[INSTANCE_LABEL], ""),
                 "kv_blocks": kv_blocks.get(p.metadata.labels[INSTANCE_LABEL], 8192)} for p in pods]
        (self.out / "pods.json").write_text(json.dumps(spec))
        log = open(self.out / "engines.log", "wb")  # noqa: SIM115
        self.engines = subprocess.Popen(
            [sys.executable, str(REPO / "benchmarks" / "synthetic_engines.py"), "--pods", str(self.out / "pods.json"),
             "--stats", str(self.out / "engines.json"), "--rate", str(self.args.rate)],
            stdout=log, stderr=subprocess.STDOUT)  # fmt: skip

        def answering() -> bool:
            try:
                urllib.request.urlopen(f"http://{spec[-1]['ip']}:8000/health", timeout=2).read()
                return True
            except OSError:
                return False

        if not self.wait("the synthetic engines", answering, 120, every=1):
            raise RuntimeError(f"the synthetic engines do not answer; see {self.out / 'engines.log'}")
        self.say(f"synthetic engines pid {self.engines.pid} answer on {len(spec)} pod IPs")
        return pods

    def mark_ready(self, pods: list[Any]) -> None:
        now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

        def ready(pod: Any) -> None:
            containers = [{"name": c.name, "image": c.image, "imageID": "", "ready": True, "started": True,
                           "restartCount": 0, "state": {"running": {"startedAt": now}}} for c in pod.spec.containers]
            conditions = [{"type": t, "status": "True", "lastTransitionTime": now}
                          for t in ("Ready", "ContainersReady")]
            self.core.patch_namespaced_pod_status(pod.metadata.name, self.ns,
                                                  {"status": {"conditions": conditions,
                                                              "containerStatuses": containers}})

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(ready, pods))

    # -- the steady phase --

    def processes(self) -> dict[str, int]:
        pids = {}
        assert self.operator is not None and self.engines is not None
        pids["operator"] = self.operator.pid
        pids["engines"] = self.engines.pid
        for name in ("prometheus", "kube-apiserver"):
            f = self.cluster.dir / "pids" / f"{name}.pid"
            if f.exists():
                pids[name] = int(f.read_text().split()[0])
        return pids

    def steady(self) -> None:
        args = self.args
        url = self.cluster.prometheus_url
        up = prometheus_value(url, f'count(up{{namespace="{self.ns}"}} == 1)')
        self.result["targets_up"] = up
        pids = self.processes()
        cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
        queries0 = prometheus_requests(url)
        t0_wall, t0 = time.time(), time.monotonic()
        with self.watcher.lock:
            reconciles0 = len(self.watcher.reconciled)
            history0 = self.watcher.history_entries
        self.say(f"steady phase: {args.minutes} min, a spec change every {args.update_every:g} s "
                 f"({up} Prometheus targets up)")
        spy = None
        if args.py_spy:
            spy = subprocess.Popen(
                [args.py_spy, "record", "--pid", str(pids["operator"]), "--duration", str(int(args.minutes * 60)),
                 "--rate", "50", "--nonblocking", "--format", "raw", "--output", str(self.out / "operator.pyspy")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        end = t0 + args.minutes * 60
        i = 0
        changes: list[tuple[str, int, float, float]] = []
        while time.monotonic() < end:
            name = self.names[(i * 7919) % len(self.names)]  # a stride through all of them
            obj = self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name)
            trials = 9 if obj["spec"]["autotune"].get("maxTrials", 8) == 8 else 8  # a change: a new generation
            start, start_wall = time.monotonic(), time.time()
            patched = self.custom.patch_namespaced_custom_object(
                GROUP, VERSION, self.ns, PLURAL, name, {"spec": {"autotune": {"maxTrials": trials}}})
            generation = int(patched["metadata"]["generation"])
            self.watcher.expect(name, generation, start)
            changes.append((name, generation, start, start_wall))
            i += 1
            time.sleep(max(0.0, min(args.update_every, end - time.monotonic())))
        wall = time.monotonic() - t0
        cpu1 = {k: cpu_seconds(p) for k, p in pids.items()}
        queries1 = prometheus_requests(url)
        t1_wall = time.time()
        time.sleep(5)  # the last spec changes' reconciles
        if spy is not None:
            spy.wait(60)
        minutes = wall / 60
        cpu = {k: round((cpu1[k] - cpu0[k]) / minutes, 2) for k in pids}
        with self.watcher.lock:
            windows = [w for w in self.watcher.windows if t0_wall <= w.seen <= t1_wall]
            done = {(n, g): e for n, g, s, e in self.watcher.reconciled[reconciles0:]}
            pending = sorted(n for n, (g, s) in self.watcher.pending.items() if g > 1)
            history = self.watcher.history_entries - history0
        updates = [done[(n, g)] - s for n, g, s, w in changes if (n, g) in done]
        self.result["spec_change_log"] = [
            {"name": n, "generation": g, "at": dt.datetime.fromtimestamp(w, dt.UTC).isoformat(timespec="milliseconds"),
             "reconcile_s": round(done[(n, g)] - s, 3) if (n, g) in done else None} for n, g, s, w in changes]
        q = {h: queries1.get(h, 0) - queries0.get(h, 0) for h in queries1
             if queries1.get(h, 0) != queries0.get(h, 0) and h != "/metrics"}  # /metrics: this script's reads
        instant = q.get("/api/v1/query", 0) + q.get("/api/v1/query_range", 0)
        self.result["steady"] = {
            "wall_s": round(wall, 1),
            "cpu_s_per_min": cpu,
            "operator_cpu_pct_of_core": round(cpu["operator"] / 60 * 100, 1),
            "prometheus_requests_by_handler": q,
            "queries_per_min": round(instant / minutes, 1),
            "windows_read": len(windows),
            "windows_read_by_kind": dict(collections.Counter(w.kind for w in windows)),
            "history_entries_added": history,
            "queries_per_window": round(instant / len(windows), 1) if windows else None,
            "lateness_s": stats([w.late for w in windows]),
            "lateness_s_trial_windows": stats([w.late for w in windows if w.kind == "trial"]),
            "lateness_s_check_windows": stats([w.late for w in windows if w.kind == "check"]),
            "windows_within_10s": sum(1 for w in windows if w.late <= TARGET_LATE_S),
            "spec_change_reconcile_s": stats(updates),
            "spec_changes": i,
            "spec_changes_not_reconciled": len(pending),
            "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        }

    def run(self) -> int:
        args = self.args
        self.add_nodes()
        self.core.create_namespace({"metadata": {"name": self.ns, "labels": {IGNORE_LABEL: "ignore"}}})
        threading.Thread(target=self.watcher.run, name="watch", daemon=True).start()
        self.watcher.started.wait(30)
        self.start_operator()
        time.sleep(5)  # the operator's watches are up
        self.say(f"creating {args.count} InferenceServices in {self.ns}")
        t0 = time.monotonic()
        self.create_services()
        self.wait("every InferenceService Deployed", lambda: len(self.watcher.reconciled) >= args.count,
                  args.ready_timeout)
        with self.watcher.lock:
            created = [e - s for n, g, s, e in self.watcher.reconciled]
        self.result["create_reconcile_s"] = stats(created)
        self.say(f"{len(created)} Deployed in {time.monotonic() - t0:.1f} s: {self.result['create_reconcile_s']}")
        pods = self.start_engines()
        original = {p.metadata.uid for p in pods}
        self.mark_ready(pods)
        t1 = time.monotonic()
        self.say(f"{len(pods)} engine pods marked Ready; waiting for every service to start tuning")
        self.wait("every InferenceService to start tuning", lambda: self.watcher.tuning_started() >= args.count,
                  args.ready_timeout, every=1)
        self.result["all_tuning_after_ready_s"] = round(time.monotonic() - t1, 1)
        self.result["tuning_started"] = self.watcher.tuning_started()
        self.say(f"{self.result['tuning_started']} services tuning, {self.result['all_tuning_after_ready_s']} s "
                 "after the pods were Ready")
        self.steady()
        self.result["pods_replaced"] = sum(1 for p in self.pods() if p.metadata.uid not in original)
        phases = collections.Counter(((i.get("status") or {}).get("tuning") or {}).get("phase", "-") for i in
                                     self.custom.list_namespaced_custom_object(GROUP, VERSION, self.ns,
                                                                               PLURAL)["items"])
        self.result["tuning_phases_at_end"] = dict(phases)
        return 0

    # -- tear down --

    def stop(self, proc: subprocess.Popen[bytes] | None) -> None:
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

    def cleanup(self) -> None:
        self.watcher.stopping.set()
        self.stop(self.operator)
        self.stop(self.engines)
        try:
            self.core.delete_namespace(self.ns)
            self.cluster.kubectl("wait", "--for=delete", "pod", "--all", "-n", self.ns, "--timeout=300s",
                                 check=False, timeout=310)  # fmt: skip
        except kubernetes.client.ApiException as e:
            if e.status != 404:
                raise
        for node in self.nodes:
            self.core.delete_node(node)


def summarize(result: dict[str, Any], out: Path) -> None:
    log = out / "operator.log"
    if log.exists():
        counts: collections.Counter[str] = collections.Counter()
        for line in log.read_text(errors="replace").splitlines():
            parts = line.split(" ", 3)
            if len(parts) == 4 and parts[2] in ("WARNING", "ERROR", "INFO", "DEBUG"):
                counts[parts[2] + " " + re.sub(r"\d+", "N", parts[3])[:100]] += 1
        result["operator_log_top"] = counts.most_common(8)
    spy = out / "operator.pyspy"
    if spy.exists():
        result["operator_profile"] = profile(spy)
    engines = out / "engines.json"
    if engines.exists():
        result["engines"] = json.loads(engines.read_text())
        result["engines"].pop("model", None)


def profile(path: Path, top: int = 25) -> dict[str, Any]:
    """py-spy's raw output (`frame;frame;... count`, outermost first): the share of the samples each function is on
    the stack for (inclusive, once per stack), the most first."""
    total = 0
    inclusive: collections.Counter[str] = collections.Counter()
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = {re.sub(r":\d+\)$", ")", f) for f in stack.split(";")}
        for f in frames:
            inclusive[f] += n
    return {"samples": total,
            "inclusive_pct": [(f, round(100 * n / total, 1)) for f, n in inclusive.most_common(top)] if total else []}


def report(result: dict[str, Any]) -> None:
    s = result.get("steady")
    if not s:
        return

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    late, cpu = s["lateness_s"], s["operator_cpu_pct_of_core"]
    create, change = result["create_reconcile_s"], s["spec_change_reconcile_s"]
    print()
    print(f"{result['count']} InferenceServices, window {result['window']}, steady phase {s['wall_s']:.0f} s; "
          f"load average at the end {s['loadavg_end']} on {os.cpu_count()} CPUs")
    print(f"operator CPU: {s['cpu_s_per_min']['operator']:.1f} s per minute = {cpu:.1f}% of a core "
          f"(target < {TARGET_CPU_PCT:g}%): {verdict(cpu < TARGET_CPU_PCT)}; beside it, per minute: "
          + ", ".join(f"{k} {v:.1f} s" for k, v in s["cpu_s_per_min"].items() if k != "operator"))
    print(f"Prometheus queries: {s['queries_per_min']:.0f} per minute, {s['queries_per_window']} per window read "
          f"({s['windows_read']} windows read: {s['windows_read_by_kind']})")
    ok_late = late["count"] > 0 and late["max"] <= TARGET_LATE_S
    print(f"window lateness: p50 {late['p50']} s, p99 {late['p99']} s, max {late['max']} s over {late['count']} "
          f"windows, {s['windows_within_10s']} within {TARGET_LATE_S:g} s (target: all): {verdict(ok_late)}")
    ok_rec = change["count"] > 0 and change["p99"] < TARGET_RECONCILE_P99_S and s["spec_changes_not_reconciled"] == 0
    print(f"reconcile, spec change -> Deployed: p50 {change['p50']} s, p99 {change['p99']} s, max {change['max']} s "
          f"over {change['count']} ({s['spec_changes_not_reconciled']} not reconciled) "
          f"(target p99 < {TARGET_RECONCILE_P99_S:g} s): {verdict(ok_rec)}")
    prof = result.get("operator_profile")
    if prof and prof["samples"]:
        print(f"operator stacks (py-spy, {prof['samples']} samples of busy threads), % of samples on the stack:")
        for f, pct in prof["inclusive_pct"]:
            print(f"  {pct:5.1f}%  {f}")
    print(f"reconcile, create -> Deployed (all {create['count']} at once): p50 {create['p50']} s, p99 {create['p99']} "
          f"s, max {create['max']} s: {verdict(create['count'] > 0 and create['p99'] < TARGET_RECONCILE_P99_S)}")


def main() -> int:
    logging.basicConfig(level=os.environ.get("NPUSERVE_BENCH_LOG", "WARNING"), stream=sys.stderr)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=300, help="InferenceServices (one engine pod each)")
    parser.add_argument("--minutes", type=float, default=10, help="the steady phase")
    parser.add_argument("--window", default="30s", help="spec.autotune.window (Go duration)")
    parser.add_argument("--tpot-ms", type=float, default=30, help="the SLO (decodeLatency)")
    parser.add_argument("--rate", type=float, default=4.0, help="finished requests per engine pod per second")
    parser.add_argument("--update-every", type=float, default=5.0, help="seconds between two spec changes")
    parser.add_argument("--ready-timeout", type=float, default=900, help="for each phase before the steady one")
    parser.add_argument("--operator-log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--out", type=Path, help="folder for the logs and the JSON result (default: a temp dir)")
    parser.add_argument("--scrape-interval", default=os.environ["NPUSERVE_SCRAPE_INTERVAL"],
                        help="Prometheus's scrape interval and timeout, for a cluster this script starts (default 5s)")
    parser.add_argument("--json", action="store_true", help="print the whole result as JSON")
    parser.add_argument("--py-spy", metavar="PATH", help="a py-spy binary: record the operator over the steady phase")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="autotune-scale-"))
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"count": args.count, "window": args.window, "minutes": args.minutes,
                              "loadavg_start": [round(x, 2) for x in os.getloadavg()]}
    cluster = localk8s.acquire()
    code = 1
    try:
        scraping = re.findall(r'"scrape_(?:interval|timeout)": "([^"]+)"',
                              (cluster.dir / "config" / "prometheus.yml").read_text())
        result["scrape_interval_timeout"] = scraping[-2:]  # the engines' job's, after the global ones
        print(f"Prometheus scrapes the engines every {scraping[-2]} (timeout {scraping[-1]})", flush=True)
        helm_install(cluster)
        os.environ["KUBECONFIG"] = str(cluster.kubeconfig)
        bench = Bench(args, cluster, out)
        try:
            code = bench.run()
        finally:
            result.update(bench.result)
            bench.cleanup()
    finally:
        localk8s.release()
        summarize(result, out)
        (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
        if args.json:
            print(json.dumps(result, indent=2))
        report(result)
        print(f"logs and result.json in {out}")
    return code


if __name__ == "__main__":
    sys.exit(main())
