"""Closed-loop autotuning on the local cluster (issue 13): real engine processes, real Prometheus scraping them
through the chart's PodMonitor selection, the operator's autotune loop in this process, load-generator Jobs run as
processes by the process kubelet.

One InferenceService (`examples/demo.yaml` with a shorter window) goes through, in order: trials applied through
PUT /admin/schedule and seen in the engines' /info; Prometheus taken down mid-trial (the trial is inconclusive,
tuning resumes when it is back); an engine killed mid-trial (the trial fails, the engines roll back to the best
schedule, the status keeps its history); convergence with the history, best and SLOMet, the pods never restarted
by tuning; the capacity measured and the replicas scaled from it; a new round (an SLO edit) deleted mid-trial,
leaving no engine, Job or Job pod behind.
"""

from __future__ import annotations

import json
import math
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import demo
import httpx
import localk8s
import pytest
import yaml
from operator_harness import REPO, Operator, events, say, scratch_namespace, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

NAME = "tune"
INSTANCE_LABEL = "npuserve.io/inferenceservice"
CONFIG_HASH = "npuserve.io/config-hash"
WINDOW = "20s"


@pytest.fixture(scope="module")
def namespace(k8s_cluster: localk8s.Cluster) -> Iterator[str]:
    try:
        with scratch_namespace(k8s_cluster, "e2e-tune-") as ns:
            yield ns
    finally:
        localk8s.start_prometheus(k8s_cluster)  # a failed test may have left it down


def manifest(namespace: str, model: Path) -> dict[str, Any]:
    obj: dict[str, Any] = yaml.safe_load((REPO / "examples" / "demo.yaml").read_text())
    obj["metadata"] = {"name": NAME, "namespace": namespace}
    spec = obj["spec"]
    spec["model"]["weights"] = {"hostPath": {"path": str(model)}}
    # 10 trials: the killed one spends one, and on a noisy machine the chosen batch may need more windows before the
    # verdict clears the noise (with 6, a run ended Stopped at 0.89x the bound, "met as measured but not beyond the
    # noise", and no SLOMet; with 8, a CI run ended so at 0.74x in 3 windows of +-25.5%, its 4th the next trial).
    spec["autotune"].update(window=WINDOW, maxTrials=10, minSamples=10)
    return obj


def get(cluster: localk8s.Cluster, namespace: str) -> dict[str, Any]:
    return cluster.kubectl_json("get", "nisvc", NAME, "-n", namespace)


def status(cluster: localk8s.Cluster, namespace: str) -> dict[str, Any]:
    found: dict[str, Any] = get(cluster, namespace).get("status") or {}
    return found


def condition(st: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in st.get("conditions") or [] if c["type"] == type_), {})


def engine_pods(cluster: localk8s.Cluster, namespace: str) -> list[dict[str, Any]]:
    found = cluster.kubectl_json("get", "pods", "-n", namespace, "-l",
                                 f"{INSTANCE_LABEL}={NAME},app.kubernetes.io/component=engine")["items"]
    assert isinstance(found, list)
    return [p for p in found if not p["metadata"].get("deletionTimestamp")]


def ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or [])


def info(pod: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = httpx.get(f"http://{pod['status']['podIP']}:8000/info", timeout=5).json()
    return found


def history(st: dict[str, Any]) -> list[dict[str, Any]]:
    return list((st.get("tuning") or {}).get("history") or [])


def conclusive(st: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in history(st) if e["outcome"] != "inconclusive"]


def current(st: dict[str, Any]) -> dict[str, Any] | None:
    found: dict[str, Any] | None = (st.get("tuning") or {}).get("current")
    return found


class Seen:
    """What the tests see across the module: the first pod, each trial's maxBatchSize as /info showed it, and the
    load Job each open trial named, seen in the cluster."""

    pod_uid = ""
    template_hash = ""
    info_batches: ClassVar[dict[int, int]] = {}
    trial_jobs: ClassVar[dict[int, str]] = {}


def _watch_current_trial(cluster: localk8s.Cluster, namespace: str) -> dict[str, Any] | None:
    """While a trial is open, the engines' /info must run its maxBatchSize and the Job it names must exist: both
    recorded per trial number (the Job is deleted when the trial closes)."""
    st = status(cluster, namespace)
    cur = current(st)
    if cur is None or cur.get("kind") != "trial":
        return None
    if cur.get("job") and any(j["metadata"]["name"] == cur["job"]
                              for j in cluster.kubectl_json("get", "jobs", "-n", namespace)["items"]):
        Seen.trial_jobs[cur["trial"]] = cur["job"]
    pods = [p for p in engine_pods(cluster, namespace) if ready(p)]
    if pods and all(info(p)["schedule"]["maxBatchSize"] == cur["schedule"]["maxBatchSize"] for p in pods):
        Seen.info_batches[cur["trial"]] = cur["schedule"]["maxBatchSize"]
    return st


def test_the_service_comes_up_and_its_first_trial_runs_through_admin_schedule(
        k8s_cluster: localk8s.Cluster, tuning_operator: Operator, namespace: str, demo_model_dir: Path) -> None:
    k8s_cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest(namespace, demo_model_dir)))
    (pod,) = wait_for("the engine pod Ready", lambda: [p for p in engine_pods(k8s_cluster, namespace) if ready(p)],
                      timeout=300)
    Seen.pod_uid = pod["metadata"]["uid"]
    deployment = k8s_cluster.kubectl_json("get", "deployment", NAME, "-n", namespace)
    Seen.template_hash = deployment["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH]  # type: ignore[index]
    secret = k8s_cluster.kubectl_json("get", "secret", f"{NAME}-admin", "-n", namespace)
    assert secret["metadata"]["ownerReferences"][0]["name"] == NAME  # type: ignore[index]

    def first_trial() -> dict[str, Any] | None:
        st = _watch_current_trial(k8s_cluster, namespace) or status(k8s_cluster, namespace)
        return st if conclusive(st) else None

    st = wait_for("the first measured trial", first_trial, timeout=300, interval=1)
    first = conclusive(st)[0]
    assert Seen.info_batches.get(first["trial"]) == first["schedule"]["maxBatchSize"]
    assert first["metrics"]["samples"] >= 1 and first["metrics"]["tpotMs"]["mean"] > 0
    assert st["phase"] in ("Tuning", "Ready")
    assert Seen.trial_jobs.get(first["trial"]), "benchmark mode: a load-generator Job per trial"


def test_prometheus_down_mid_trial_is_inconclusive_and_tuning_resumes(
        k8s_cluster: localk8s.Cluster, tuning_operator: Operator, namespace: str) -> None:
    wait_for("an open trial", lambda: current(status(k8s_cluster, namespace)), timeout=120, interval=1)
    measured = len(conclusive(status(k8s_cluster, namespace)))
    assert localk8s.stop_prometheus(k8s_cluster)
    try:
        st = wait_for("the trial marked inconclusive",
                      lambda: (lambda s: s if any(e["outcome"] == "inconclusive" and
                                                  e["reason"] == "PrometheusUnreachable"
                                                  for e in history(s)) else None)(status(k8s_cluster, namespace)),
                      timeout=240, interval=1)  # the open window may be a stretched one (measured again)
        assert condition(st, "Tuning")["reason"] == "PrometheusUnreachable"
        assert len(conclusive(st)) == measured  # nothing was decided without a measurement
    finally:
        localk8s.start_prometheus(k8s_cluster)
    wait_for("a measured trial after Prometheus came back",
             lambda: len(conclusive(_watch_current_trial(k8s_cluster, namespace) or status(k8s_cluster, namespace)))
             > measured, timeout=240, interval=1)


def _kill_engine(cluster: localk8s.Cluster, namespace: str, pod: str) -> None:
    pid = int((cluster.dir / "pods" / f"{namespace}_{pod}" / "pid").read_text().split()[0])
    os.kill(pid, signal.SIGKILL)


def test_an_engine_killed_mid_trial_fails_the_trial_and_rolls_back(
        k8s_cluster: localk8s.Cluster, tuning_operator: Operator, namespace: str) -> None:
    st = wait_for("an open trial", lambda: (lambda s: s if current(s) and current(s)["kind"] == "trial" else None)(
        status(k8s_cluster, namespace)), timeout=240, interval=1)
    trial = current(st)
    assert trial is not None
    (pod,) = engine_pods(k8s_cluster, namespace)
    _kill_engine(k8s_cluster, namespace, pod["metadata"]["name"])
    st = wait_for("the trial recorded as failed",
                  lambda: (lambda s: s if any(e.get("reason") in ("EngineRestarted", "EngineNotReady")
                                              for e in history(s))
                           else None)(status(k8s_cluster, namespace)), timeout=120, interval=1)
    failed = next(e for e in history(st) if e["outcome"] == "failed")
    assert failed["schedule"]["maxBatchSize"] == trial["schedule"]["maxBatchSize"]
    applied = st["tuning"]["applied"]
    # Until the next trial opens the condition says the rollback and its cause, also while the engine restarts.
    said = condition(st, "Tuning")
    assert (said["reason"] == "RolledBack" and failed["verdict"] in said["message"]) or current(st) is not None, said
    rolled_back = wait_for("the RolledBack event", lambda: [
        e for e in events(k8s_cluster, namespace, NAME, "RolledBack") if failed["verdict"] in e["message"]], timeout=30)
    assert rolled_back[0]["type"] == "Warning"
    assert st["plan"] and st["tuning"]["history"]  # the InferenceService kept its state
    # The restarted engine runs the rolled-back schedule (from the ConfigMap) or the next trial's.
    (restarted,) = wait_for("the engine back", lambda: [p for p in engine_pods(k8s_cluster, namespace) if ready(p)],
                            timeout=180)
    batch = info(restarted)["schedule"]["maxBatchSize"]
    now = status(k8s_cluster, namespace)["tuning"]
    assert batch in (applied["maxBatchSize"], now["applied"]["maxBatchSize"])


def trail(st: dict[str, Any]) -> str:
    """The round's trials and the engine model, a line each: what a failed verdict assertion needs to be read."""
    tuning = st.get("tuning") or {}
    lines = [f"{tuning.get('phase')}: {tuning.get('message')}"]
    for e in history(st):
        m = e.get("metrics") or {}
        tpot = (m.get("tpotMs") or {}).get("mean")
        lines.append(f"  trial {e['trial']} maxBatchSize {e['schedule']['maxBatchSize']} {e['outcome']}: "
                     + (f"TPOT {tpot:.1f} ms, {m.get('outputTokensPerSecond', 0):.0f} tok/s, "
                        f"{m.get('samples')} samples" if tpot is not None else "no metrics"))
    model = tuning.get("model") or {}
    lines.append(f"  model: {model.get('windows')} windows, noise {model.get('noise')}, adequate "
                 f"{model.get('adequate')} ({model.get('adequacy')}), last errors {model.get('lastErrors')}")
    return "\n".join(lines)


def test_tuning_converges_with_history_best_and_slo_met_without_restarting_pods(
        k8s_cluster: localk8s.Cluster, tuning_operator: Operator, namespace: str) -> None:
    st = wait_for("tuning to finish",
                  lambda: (lambda s: s if (s.get("tuning") or {}).get("phase") in ("Converged", "Stopped")
                           and current(s) is None else None)(
                      _watch_current_trial(k8s_cluster, namespace) or status(k8s_cluster, namespace)),
                  timeout=900, interval=1)
    tuning = st["tuning"]
    say(trail(st))
    measured = [e for e in conclusive(st) if e.get("metrics")]
    assert len(conclusive(st)) >= 3 and len(measured) >= 2, trail(st)
    assert len([t for t in Seen.info_batches if t is not None]) >= 3, Seen.info_batches
    best = tuning["best"]
    assert best["metrics"] and f"best: maxBatchSize {best['schedule']['maxBatchSize']}" in tuning["message"], trail(st)
    assert condition(st, "SLOMet")["status"] == "True" and condition(st, "Tuning")["status"] == "False"
    # The verdict rests on the windows measured at the chosen schedule, and they meet the bound (pooled here).
    assert demo.verdict_contradiction(st, get(k8s_cluster, namespace)["spec"]["slo"]) is None
    assert tuning["verdict"]["sloMet"] and tuning["verdict"]["trials"]
    assert all(history(st)[i]["schedule"] == best["schedule"] for i in tuning["verdict"]["trials"])
    assert st["schedule"]["maxBatchSize"] == best["schedule"]["maxBatchSize"] == tuning["applied"]["maxBatchSize"]
    assert st["observed"]["tpotMs"] > 0 and st["observed"]["samples"] >= 1
    for pod in [p for p in engine_pods(k8s_cluster, namespace) if ready(p)]:
        assert info(pod)["schedule"]["maxBatchSize"] == best["schedule"]["maxBatchSize"]
    deployment = k8s_cluster.kubectl_json("get", "deployment", NAME, "-n", namespace)
    assert deployment["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH] == Seen.template_hash  # type: ignore[index]
    # The one pod from the start is still there: tuning never rolled it (the kill restarted its process in place).
    assert Seen.pod_uid in [p["metadata"]["uid"] for p in engine_pods(k8s_cluster, namespace)]
    table = k8s_cluster.kubectl("get", "nisvc", NAME, "-n", namespace)
    assert tuning["phase"] in table and "True" in table


def test_capacity_is_measured_and_sets_the_replicas(k8s_cluster: localk8s.Cluster, tuning_operator: Operator,
                                                    namespace: str) -> None:
    st = wait_for("the capacity measured",
                  lambda: (lambda s: s if (s.get("capacity") or {}).get("phase") in ("Measured", "Failed")
                           else None)(status(k8s_cluster, namespace)), timeout=600, interval=1)
    cap = st["capacity"]
    assert cap["phase"] == "Measured", cap
    per = cap["measuredConcurrencyPerReplica"]
    assert per >= 1 and cap["method"].startswith("benchmark")
    want = min(math.ceil(cap["targetConcurrentUsers"] / per), 3)  # spec.capacity.maxReplicas 3
    assert cap["replicas"] == want and cap["staticReplicas"] == 3
    wait_for("spec.replicas from the scale subresource",
                   lambda: (lambda o: o if o["spec"].get("replicas") == want else None)(get(k8s_cluster, namespace)),
                   timeout=60)
    wait_for(f"{want} engine pods Ready",
             lambda: len([p for p in engine_pods(k8s_cluster, namespace) if ready(p)]) == want, timeout=300)


def test_deleting_it_mid_trial_leaves_no_engine_or_job(k8s_cluster: localk8s.Cluster, tuning_operator: Operator,
                                                       namespace: str) -> None:
    # A new SLO is a new tuning problem: a new round starts, with a Job.
    k8s_cluster.kubectl("patch", "nisvc", NAME, "-n", namespace, "--type=merge", "-p",
                        json.dumps({"spec": {"slo": {"objective": "decodeLatency", "tpotMs": 150}}}))
    wait_for("a trial of the new round with its Job",
             lambda: (lambda c: c if c and c.get("job") else None)(current(status(k8s_cluster, namespace))),
             timeout=300, interval=1)
    k8s_cluster.kubectl("delete", "nisvc", NAME, "-n", namespace, "--wait=true", timeout=90)

    def left() -> dict[str, int]:
        counts = {kind: len(k8s_cluster.kubectl_json("get", kind, "-n", namespace)["items"])  # type: ignore[arg-type]
                  for kind in ("deployments", "jobs", "pods", "configmaps", "secrets")}
        return {k: v for k, v in counts.items() if v and not (k == "configmaps" and v == 1)}  # kube-root-ca.crt

    wait_for("no engine, Job or Job pod left", lambda: not left() or None, timeout=180)

    def processes() -> list[str]:
        """The pods of this namespace the process kubelet still runs a process for."""
        running = httpx.get(f"http://127.0.0.1:{k8s_cluster.ports['kubelet']}/healthz", timeout=5).json()["pods"]
        return [p for p in running if p.startswith(f"{namespace}/")]

    # The kubelet notices a deleted pod on its next sync (every 0.5 s) and then ends the process.
    wait_for("the kubelet to end every process of the namespace", lambda: not processes() or None, timeout=60)
    assert not processes()
