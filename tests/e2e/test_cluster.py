"""Smoke test of the local cluster: pinned versions, the two KWOK nodes with their NPUs, pods on loopback IPs, the
LeaderWorkerSet controller."""

from __future__ import annotations

import ipaddress
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

import localk8s
import pytest

pytestmark = pytest.mark.e2e


def test_versions_are_the_pinned_release(k8s_cluster: localk8s.Cluster) -> None:
    version = json.loads(k8s_cluster.kubectl("version", "-o", "json"))
    assert version["clientVersion"]["gitVersion"] == localk8s.K8S_VERSION
    assert version["serverVersion"]["gitVersion"] == localk8s.K8S_VERSION
    major, minor = localk8s.K8S_VERSION.removeprefix("v").split(".")[:2]
    assert (version["serverVersion"]["major"], version["serverVersion"]["minor"]) == (major, minor)


def test_two_fake_nodes_with_eight_npus(k8s_cluster: localk8s.Cluster) -> None:
    nodes: list[dict[str, Any]] = k8s_cluster.kubectl_json("get", "nodes")["items"]  # type: ignore[assignment]
    assert sorted(n["metadata"]["name"] for n in nodes) == sorted(localk8s.NODE_NAMES)
    for node in nodes:
        assert node["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"
        assert node["metadata"]["labels"]["npuserve.io/numa-nodes"] == "2"
        for key in ("capacity", "allocatable"):
            assert node["status"][key][localk8s.ACCELERATOR_RESOURCE] == "8"
        ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
        assert ready and ready[0]["status"] == "True"


def test_deployment_pods_run_on_loopback_ips(k8s_cluster: localk8s.Cluster) -> None:
    ns = "smoke-" + uuid.uuid4().hex[:6]
    k8s_cluster.kubectl("create", "namespace", ns)
    # Each pod asks for all 8 cards of a node, so the scheduler must put one on each node.
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "smoke", "namespace": ns},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "smoke"}},
            "template": {
                "metadata": {"labels": {"app": "smoke"}},
                "spec": {
                    "containers": [
                        {
                            "name": "engine",
                            "image": "npuserve/none:0",  # KWOK pulls nothing
                            "resources": {"limits": {localk8s.ACCELERATOR_RESOURCE: "8"}},
                        }
                    ]
                },
            },
        },
    }
    try:
        k8s_cluster.kubectl("apply", "-f", "-", input=json.dumps(deployment))
        k8s_cluster.kubectl("rollout", "status", "-n", ns, "deployment/smoke", "--timeout=120s", timeout=130)
        pods: list[dict[str, Any]] = k8s_cluster.kubectl_json("get", "pods", "-n", ns, "-l", "app=smoke")["items"]  # type: ignore[assignment]
        assert len(pods) == 2
        for pod in pods:
            assert pod["status"]["phase"] == "Running"
            assert ipaddress.ip_address(pod["status"]["podIP"]) in localk8s.POD_NETWORK
        assert sorted(p["spec"]["nodeName"] for p in pods) == sorted(localk8s.NODE_NAMES)
        assert len({p["status"]["podIP"] for p in pods}) == 2
    finally:
        # Free the cards for later tests in the same session (pods gone); the namespace itself may finish later.
        k8s_cluster.kubectl("delete", "deployment", "smoke", "-n", ns, "--wait=true", timeout=70, check=False)
        k8s_cluster.kubectl("wait", "--for=delete", "pod", "-n", ns, "-l", "app=smoke", "--timeout=60s", check=False)
        k8s_cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


# ---- LeaderWorkerSet ----------------------------------------------------------------------------------------------
LWS_LABEL = "leaderworkerset.sigs.k8s.io"


def _get(cluster: localk8s.Cluster, *args: str) -> Any:
    return json.loads(cluster.kubectl("get", *args, "-o", "json"))


def _pods_by_name(cluster: localk8s.Cluster, ns: str, lws: str) -> dict[str, dict[str, Any]]:
    items: list[dict[str, Any]] = _get(cluster, "pods", "-n", ns, "-l", f"{LWS_LABEL}/name={lws}")["items"]
    return {p["metadata"]["name"]: p for p in items}


def _wait_for(what: str, check: Callable[[], bool], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.5)


def _ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def _group_ready(c: localk8s.Cluster, ns: str, name: str, replaced: str | None = None) -> bool:
    """Whether group 0 of the LeaderWorkerSet `name` (size 2) has both pods Ready, with a leader other than the pod
    of uid `replaced`."""
    pods = _pods_by_name(c, ns, name)
    group = [pods.get(f"{name}-0"), pods.get(f"{name}-0-1")]
    if group[0] is None or group[0]["metadata"]["uid"] == replaced:
        return False
    return all(p is not None and _ready(p) for p in group)


def _group_of_two(name: str, ns: str, pod_spec: dict[str, Any], restart_policy: str) -> dict[str, Any]:
    """A LeaderWorkerSet of one group of two pods (leader and worker from the same template)."""
    return {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"replicas": 1, "leaderWorkerTemplate": {
            "size": 2, "restartPolicy": restart_policy, "workerTemplate": {"spec": pod_spec}}},
    }


def test_leaderworkerset_controller_makes_a_group(k8s_cluster: localk8s.Cluster) -> None:
    """The real LeaderWorkerSet controller and its webhooks: a group of a leader and a worker (ordinary containers,
    which KWOK makes Ready), their labels and LWS_* variables, the headless Service, the group recreated when a
    pod goes (RecreateGroupOnPodRestart), and the pods gone with the LeaderWorkerSet."""
    c, ns, name = k8s_cluster, "lws-" + uuid.uuid4().hex[:6], "grp"
    for kind, config in (
        ("mutatingwebhookconfiguration", localk8s.LWS_MUTATING_WEBHOOK),
        ("validatingwebhookconfiguration", localk8s.LWS_VALIDATING_WEBHOOK),
    ):
        hooks = _get(c, kind, config)["webhooks"]
        assert len(hooks) == 2 and all(h["clientConfig"]["url"].startswith("https://127.0.0.1:") for h in hooks)
    c.kubectl("create", "namespace", ns)
    container = {"name": "main", "image": "npuserve/none:0"}  # KWOK pulls nothing
    lws = _group_of_two(name, ns, {"containers": [container]}, "RecreateGroupOnPodRestart")
    leader, worker = f"{name}-0", f"{name}-0-1"
    try:
        c.kubectl("apply", "-f", "-", input=json.dumps(lws))
        _wait_for("the leader and the worker Ready", lambda: _group_ready(c, ns, name))
        pods = _pods_by_name(c, ns, name)
        assert set(pods) == {leader, worker}
        for pod_name, index in ((leader, "0"), (worker, "1")):
            pod = pods[pod_name]
            assert pod["metadata"]["labels"][f"{LWS_LABEL}/worker-index"] == index
            assert (pod["spec"]["hostname"], pod["spec"]["subdomain"]) == (pod_name, name)
            env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0].get("env", [])}
            assert env["LWS_LEADER_ADDRESS"] == f"{leader}.{name}.{ns}"
            assert env["LWS_GROUP_SIZE"] == "2"
            assert env["LWS_WORKER_INDEX"] == index
        assert pods[leader]["metadata"]["labels"][f"{LWS_LABEL}/group-index"] == "0"
        service = _get(c, "service", name, "-n", ns)
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["publishNotReadyAddresses"] is True

        leader_uid = pods[leader]["metadata"]["uid"]
        c.kubectl("delete", "pod", worker, "-n", ns, "--wait=false")
        _wait_for("the group recreated and Ready", lambda: _group_ready(c, ns, name, replaced=leader_uid))

        c.kubectl("delete", "leaderworkerset", name, "-n", ns, "--wait=true", timeout=130)
        _wait_for("the group's pods deleted", lambda: not _pods_by_name(c, ns, name))
    finally:
        c.kubectl("delete", "leaderworkerset", name, "-n", ns, "--ignore-not-found", "--wait=false", check=False)
        c.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_process_pods_of_a_leaderworkerset_get_names_and_variables(k8s_cluster: localk8s.Cluster) -> None:
    """Process pods (`npuserve serve`, which fails here: no model) of a LeaderWorkerSet: the process kubelet
    expands the LWS_* references of the command and writes each pod a hosts file with both pods' names (the
    wrapper that mounts it is tested in test_kubelet_names.py)."""
    c, ns, name = k8s_cluster, "lwsp-" + uuid.uuid4().hex[:6], "eng"
    c.kubectl("create", "namespace", ns)
    command = ["npuserve", "serve", "--model", "/models/none", "--port", "8000"]
    command += ["--node-rank", "$(LWS_WORKER_INDEX)", "--master-addr", "$(LWS_LEADER_ADDRESS)", "--x", "$$(KEPT)"]
    container = {"name": "engine", "image": "npuserve/engine:0", "command": command}
    # restartPolicy None: the engines fail and restart in place; the group stays.
    lws = _group_of_two(name, ns, {"containers": [container], "terminationGracePeriodSeconds": 1}, "None")
    leader, worker = f"{name}-0", f"{name}-0-1"
    folders = {pod: c.dir / "pods" / f"{ns}_{pod}" for pod in (leader, worker)}
    records = [f"{pod}.{name}.{ns}.svc.cluster.local\t{pod}.{name}.{ns}.svc\t{pod}.{name}.{ns}" for pod in folders]

    def hosts_written() -> bool:
        try:
            return all(all(r in (f / "hosts").read_text() for r in records) for f in folders.values())
        except OSError:
            return False

    try:
        c.kubectl("apply", "-f", "-", input=json.dumps(lws))
        _wait_for("both pods' hosts files with both records", hosts_written)
        pods = _pods_by_name(c, ns, name)
        for pod, index in ((leader, "0"), (worker, "1")):
            ip = pods[pod]["status"]["podIP"]
            own = f"{ip}\t{pod}.{name}.{ns}.svc.cluster.local\t{pod}\n"
            assert own in (folders[pod] / "hosts").read_text()
            engine_log = folders[pod] / "engine.log"
            _wait_for(f"{pod}'s engine started", engine_log.exists)
            argv = next(line for line in engine_log.read_text().splitlines() if line.startswith("# "))
            assert f" --node-rank {index} --master-addr {leader}.{name}.{ns} --x $(KEPT) " in argv + " "
    finally:
        c.kubectl(
            "delete", "leaderworkerset", name, "-n", ns, "--ignore-not-found", "--wait=true", timeout=70, check=False
        )
        _wait_for("the group's pods deleted", lambda: not _pods_by_name(c, ns, name))
        c.kubectl("delete", "namespace", ns, "--wait=false", check=False)
