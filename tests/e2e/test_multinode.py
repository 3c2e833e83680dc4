"""A replica whose ranks span nodes, end to end on the local cluster (issue 30): the operator renders a
LeaderWorkerSet, the real LeaderWorkerSet controller (built from the Go module proxy, its pod webhook registered with
the API server) makes the group's pods and injects LWS_*, the process kubelet runs each pod's `npuserve serve` with
the pod's host name and the cluster's names in its /etc/hosts, and the two engines form one tensor-parallel world
through the leader's address.

One InferenceService on the CPU, worldSize 2 over two nodes of one card each (`cardsPerNode: 1`), the demo's model
folder: Ready through the controller; its greedy completions equal the same model's at worldSize 1 (in this process);
autotune runs a trial against the group; killing the worker's engine process makes the controller recreate the
group, and the service is Ready again; `kubectl delete` removes everything.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import localk8s
import pytest
import yaml
from operator_harness import REPO, Operator, scratch_namespace, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

NAME = "group"
INSTANCE_LABEL = "npuserve.io/inferenceservice"
WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"
GROUP_INDEX = "leaderworkerset.sigs.k8s.io/group-index"
LEADER, WORKER = f"{NAME}-0", f"{NAME}-0-1"  # the controller's pod names: <lws>-<group> and <lws>-<group>-<index>
PROMPTS = ["The capital of France is", "Tensor parallel across pods", "one two three four"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def namespace(k8s_cluster: localk8s.Cluster) -> Iterator[str]:
    with scratch_namespace(k8s_cluster, "e2e-group-") as ns:
        yield ns
        k8s_cluster.kubectl("delete", "leaderworkersets", "--all", "-n", ns, "--wait=true", check=False, timeout=90)


def manifest(namespace: str, model: Path) -> dict[str, Any]:
    """examples/demo.yaml on two cards of one-card nodes: one replica is a group of two pods."""
    obj: dict[str, Any] = yaml.safe_load((REPO / "examples" / "demo.yaml").read_text())
    obj["metadata"] = {"name": NAME, "namespace": namespace}
    spec = obj["spec"]
    spec["model"]["weights"] = {"hostPath": {"path": str(model)}}
    spec["accelerator"].update(cards=2, cardsPerNode=1)
    spec["capacity"] = {"targetConcurrentUsers": 8, "maxReplicas": 1}
    # Short requests: tensor parallel over two processes on two shared cores decodes at a few tokens a second, and
    # a trial's window must see requests finish.
    spec["workload"] = {"avgInputTokens": 32, "avgOutputTokens": 16, "maxOutputTokens": 32, "maxInputTokens": 256}
    spec["autotune"].update(window="30s", maxTrials=2, minSamples=5)
    return obj


def pods(cluster: localk8s.Cluster, namespace: str) -> dict[str, dict[str, Any]]:
    found = cluster.kubectl_json("get", "pods", "-n", namespace, "-l", f"{INSTANCE_LABEL}={NAME}")["items"]
    assert isinstance(found, list)
    return {p["metadata"]["name"]: p for p in found if not p["metadata"].get("deletionTimestamp")}


def ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or [])


def status(cluster: localk8s.Cluster, namespace: str) -> dict[str, Any]:
    found: dict[str, Any] = cluster.kubectl_json("get", "nisvc", NAME, "-n", namespace).get("status") or {}
    return found


def group_ready(cluster: localk8s.Cluster, namespace: str) -> dict[str, dict[str, Any]] | None:
    found = pods(cluster, namespace)
    return found if set(found) == {LEADER, WORKER} and all(ready(p) for p in found.values()) else None


class Waiting(dict[str, Any]):
    """A status that is not yet the one waited for: falsy, so `wait_for` goes on, and shown when it gives up."""

    def __bool__(self) -> bool:
        return False


def service_ready(cluster: localk8s.Cluster, namespace: str) -> dict[str, Any]:
    st = status(cluster, namespace)
    ready = st.get("replicas") == 1 and st.get("phase") in ("Ready", "Tuning")
    return st if ready else Waiting(phase=st.get("phase"), replicas=st.get("replicas"),
                                    conditions=[(c["type"], c["status"], c.get("reason")) for c in
                                                st.get("conditions") or []])


def completions(ip: str) -> list[tuple[int | None, str]]:
    """Each prompt's greedy completion from the leader, through the official client: (tokens, text)."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://{ip}:8000/v1", api_key="none", max_retries=0)
    out: list[tuple[int | None, str]] = []
    for prompt in PROMPTS:
        done = client.completions.create(model="demo", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                         extra_body={"ignore_eos": True})
        out.append((done.usage.completion_tokens if done.usage else None, done.choices[0].text))
    return out


def world_size_1(model: Path) -> list[tuple[int | None, str]]:
    from npuserve.engine.engine import LLMEngine
    from npuserve.engine.sequence import SamplingParams
    from npuserve.mindie_config import EngineEnvironment, minimal_config

    engine = LLMEngine(minimal_config(model, max_seq_len=256), env=EngineEnvironment())
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return [(len(o.token_ids), o.text) for o in outs]


class Seen:
    leader_uid = ""


def test_a_group_of_two_pods_on_two_nodes_is_ready_and_answers_as_one_rank_does(
        k8s_cluster: localk8s.Cluster, tuning_operator: Operator, namespace: str, demo_model_dir: Path) -> None:
    k8s_cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest(namespace, demo_model_dir)))
    group = wait_for("the leader and the worker pod Ready", lambda: group_ready(k8s_cluster, namespace), timeout=300)
    leader, worker = group[LEADER], group[WORKER]
    # The controller's webhook labelled the pods and set their variables; the anti-affinity put them on two nodes.
    assert leader["metadata"]["labels"][WORKER_INDEX] == "0" and worker["metadata"]["labels"][WORKER_INDEX] == "1"
    assert leader["spec"]["nodeName"] != worker["spec"]["nodeName"]
    env = {e["name"]: e.get("value") for e in worker["spec"]["containers"][0]["env"]}
    # One headless Service per group (the InferenceService's Service holds the name `group`).
    assert env["LWS_LEADER_ADDRESS"] == f"{LEADER}.{LEADER}.{namespace}"
    assert env["LWS_GROUP_SIZE"] == "2" and env["LWS_WORKER_INDEX"] == "1"
    Seen.leader_uid = leader["metadata"]["uid"]
    ip = leader["status"]["podIP"]
    info = httpx.get(f"http://{ip}:8000/info", timeout=5).json()
    assert info["worldSize"] == 2 and info["nodes"] == 2
    assert [(r["rank"], r["node_rank"]) for r in info["ranks"]] == [(0, 0), (1, 1)]
    assert info["ranks"][1]["host"] == WORKER  # the worker pod's own host name, as its process saw it
    # The worker serves health only; the leader serves the API.
    worker_ip = worker["status"]["podIP"]
    assert httpx.get(f"http://{worker_ip}:8000/ready", timeout=5).status_code == 200
    assert httpx.get(f"http://{worker_ip}:8000/v1/models", timeout=5).status_code == 404
    assert completions(ip) == world_size_1(demo_model_dir)
    st = wait_for("status: one replica (one whole group)", lambda: service_ready(k8s_cluster, namespace), timeout=180)
    assert st["plan"]["nodes"] == 2 and st["plan"]["cardsPerPod"] == 1
    from kubernetes import client as kclient
    from kubernetes import config as kconfig

    from npuserve.operator import engine_http, kube
    core = kclient.CoreV1Api(kconfig.new_client_from_config(config_file=str(k8s_cluster.kubeconfig)))
    engines = engine_http.read_engines(kube.engine_pods(core.list_namespaced_pod(
        namespace, label_selector=st["selector"]).items))
    print("DEBUG engines", engines, "status", status(k8s_cluster, namespace))
    blocks = wait_for("status.observed: the leader's KV blocks", lambda: (
        status(k8s_cluster, namespace).get("observed") or {}).get("kvBlocksAllocated"), timeout=120)
    assert blocks == info["kv_blocks"]


def test_autotune_runs_a_trial_against_the_group(k8s_cluster: localk8s.Cluster, namespace: str) -> None:
    def measured() -> dict[str, Any] | None:
        st = status(k8s_cluster, namespace)
        history = [e for e in (st.get("tuning") or {}).get("history") or [] if e["outcome"] != "inconclusive"]
        return history[0] if history else None

    trial = wait_for("a measured trial", measured, timeout=420, interval=2)
    assert trial["metrics"]["samples"] >= 1 and trial["metrics"]["tpotMs"]["mean"] > 0
    # The schedule went to the leader, which runs it for the whole group (the worker has no admin API).
    leader = pods(k8s_cluster, namespace)[LEADER]
    info = httpx.get(f"http://{leader['status']['podIP']}:8000/info", timeout=5).json()
    assert info["scheduleGeneration"] is not None


def test_killing_the_workers_engine_recreates_the_group(k8s_cluster: localk8s.Cluster, namespace: str) -> None:
    pid_file = k8s_cluster.dir / "pods" / f"{namespace}_{WORKER}" / "pid"
    pid = int(pid_file.read_text().split()[0])
    os.kill(pid, signal.SIGKILL)
    # RecreateGroupOnPodRestart: the restarted container makes the controller delete the leader, and with it the group.
    wait_for("a new leader pod", lambda: (p := pods(k8s_cluster, namespace).get(LEADER))
             and p["metadata"]["uid"] != Seen.leader_uid, timeout=180)
    group = wait_for("the recreated group Ready", lambda: group_ready(k8s_cluster, namespace), timeout=300)
    assert all(p["status"]["containerStatuses"][0]["restartCount"] == 0 for p in group.values())
    wait_for("status: one replica again", lambda: service_ready(k8s_cluster, namespace), timeout=180)
    # The old leader said which pod took the group down (its log is in the pod's folder, which the new one reuses).
    leader_log = (k8s_cluster.dir / "pods" / f"{namespace}_{LEADER}" / "engine.log").read_text()
    assert "pod 1" in leader_log, leader_log[-2000:]


def test_delete_removes_the_group(k8s_cluster: localk8s.Cluster, namespace: str) -> None:
    k8s_cluster.kubectl("delete", "nisvc", NAME, "-n", namespace, "--wait=true", timeout=120)

    def gone() -> bool:
        left = [k8s_cluster.kubectl("get", kind, "-n", namespace, "-o", "name")
                for kind in ("leaderworkersets", "statefulsets", "pods", "configmaps", "services")]
        return all(not out.strip() or out.strip() == "configmap/kube-root-ca.crt" for out in left)

    wait_for("no LeaderWorkerSet, StatefulSet, pod, ConfigMap or Service left", gone, timeout=180)
