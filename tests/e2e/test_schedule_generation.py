"""The tuned schedule's one source on the local cluster (issue 22): a trial's schedule reaches the engine through
PUT /admin/schedule at its generation (status.tuning.applied), reconcile writes the ConfigMap from that status at
the same generation, and a ConfigMap rewritten mid-window with an older schedule (as a stale writer would) reaches
the engine's config-file watch and is refused: the engine keeps the trial's schedule, and the window is measured.
"""

from __future__ import annotations

import calendar
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import localk8s
import pytest
import yaml
from operator_harness import REPO, Operator, scratch_namespace, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

NAME = "gen"
CONFIG_MAP = f"{NAME}-config"
WINDOW = "60s"  # long enough to rewrite the ConfigMap and see the engine refuse it inside the window


@pytest.fixture(scope="module")
def namespace(k8s_cluster: localk8s.Cluster) -> Iterator[str]:
    with scratch_namespace(k8s_cluster, "e2e-gen-") as ns:
        yield ns


def manifest(namespace: str, model: Path) -> dict[str, Any]:
    obj: dict[str, Any] = yaml.safe_load((REPO / "examples" / "demo.yaml").read_text())
    obj["metadata"] = {"name": NAME, "namespace": namespace}
    spec = obj["spec"]
    spec["model"]["weights"] = {"hostPath": {"path": str(model)}}
    spec.pop("capacity", None)
    spec["autotune"].update(window=WINDOW, maxTrials=4, minSamples=10)
    return obj


def status(cluster: localk8s.Cluster, namespace: str) -> dict[str, Any]:
    found: dict[str, Any] = cluster.kubectl_json("get", "nisvc", NAME, "-n", namespace).get("status") or {}
    return found


def engine_pod(cluster: localk8s.Cluster, namespace: str) -> dict[str, Any] | None:
    pods = cluster.kubectl_json("get", "pods", "-n", namespace, "-l",
                                f"npuserve.io/inferenceservice={NAME},app.kubernetes.io/component=engine")["items"]
    assert isinstance(pods, list)
    ready = [p for p in pods if not p["metadata"].get("deletionTimestamp") and any(
        c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or [])]
    return ready[0] if len(ready) == 1 else None


def info(pod: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = httpx.get(f"http://{pod['status']['podIP']}:8000/info", timeout=5).json()
    return found


def configmap_config(cluster: localk8s.Cluster, namespace: str) -> dict[str, Any]:
    cm = cluster.kubectl_json("get", "configmap", CONFIG_MAP, "-n", namespace)
    found: dict[str, Any] = json.loads(cm["data"]["config.json"])  # type: ignore[index]
    return found


def parse_rfc3339(text: str) -> float:
    return float(calendar.timegm(time.strptime(text, "%Y-%m-%dT%H:%M:%SZ")))


def test_a_stale_configmap_mid_window_leaves_the_trials_schedule_on_the_engine(
        k8s_cluster: localk8s.Cluster, tuning_operator: Operator, namespace: str, demo_model_dir: Path) -> None:
    k8s_cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest(namespace, demo_model_dir)))
    pod = wait_for("the engine pod Ready", lambda: engine_pod(k8s_cluster, namespace), timeout=300)

    def trial_everywhere() -> dict[str, Any] | None:
        """An open trial whose generation the engine runs (PUT) and the ConfigMap holds (reconcile's writer)."""
        st = status(k8s_cluster, namespace)
        tuning = st.get("tuning") or {}
        current, applied = tuning.get("current"), tuning.get("applied")
        if not current or current.get("kind") != "trial" or not applied:
            return None
        running = info(pod)
        config = configmap_config(k8s_cluster, namespace)
        generation = applied["scheduleGeneration"]
        if (running["scheduleGeneration"] == generation and config["npuserve"]["scheduleGeneration"] == generation
                and running["schedule"]["maxBatchSize"] == current["schedule"]["maxBatchSize"]
                and time.time() < parse_rfc3339(current["measureFrom"])):  # still settling: the window is ahead
            return st
        return None

    st = wait_for("a trial's generation on the engine and in the ConfigMap", trial_everywhere, timeout=600,
                  interval=1)
    trial = st["tuning"]["current"]
    generation, batch = st["tuning"]["applied"]["scheduleGeneration"], trial["schedule"]["maxBatchSize"]

    # A stale writer: the ConfigMap rewritten with an older generation and another batch.
    stale = configmap_config(k8s_cluster, namespace)
    stale_batch = max(1, batch // 2)
    stale["npuserve"]["scheduleGeneration"] = generation - 1
    schedule = stale["BackendConfig"]["ScheduleConfig"]
    schedule.update(maxBatchSize=stale_batch, maxPrefillBatchSize=min(schedule["maxPrefillBatchSize"], stale_batch))
    k8s_cluster.kubectl("patch", "configmap", CONFIG_MAP, "-n", namespace, "--type", "merge", "-p",
                        json.dumps({"data": {"config.json": json.dumps(stale, indent=4)}}))

    log = k8s_cluster.dir / "pods" / f"{namespace}_{pod['metadata']['name']}" / "engine.log"
    refused = f"scheduleGeneration {generation - 1} is not newer than the {generation} the engine runs"
    wait_for("the engine's config watch refusing the stale file", lambda: refused in log.read_text(), timeout=60,
             interval=0.5)
    if time.time() >= parse_rfc3339(trial["measureUntil"]):
        pytest.fail("the stale ConfigMap reached the engine after the trial's window: not mid-window")
    running = info(pod)
    assert (running["scheduleGeneration"], running["schedule"]["maxBatchSize"]) == (generation, batch)

    # The window closes: every sample of the generation gauge was the trial's, so the trial is measured.
    def closed() -> dict[str, Any] | None:
        st = status(k8s_cluster, namespace)
        entries = [e for e in (st.get("tuning") or {}).get("history") or [] if e["trial"] >= trial["trial"]]
        return st if entries else None

    st = wait_for("the trial's window closed", closed, timeout=300, interval=1)
    entries = [e for e in st["tuning"]["history"] if e["trial"] >= trial["trial"]]
    assert [e.get("reason") for e in entries if e["outcome"] == "inconclusive"] in ([], ["NoRequestFinished"])
    assert not [e for e in st["tuning"]["history"] if e.get("reason") == "ScheduleNotRun"]
    running = info(pod)
    assert running["scheduleGeneration"] >= generation  # never went back
