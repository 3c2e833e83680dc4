"""Smoke test of the local cluster: pinned versions, the two KWOK nodes with their NPUs, pods on loopback IPs."""

from __future__ import annotations

import ipaddress
import json
import uuid
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
