"""The operator against the local cluster: `helm install`, then `kubectl apply` of an InferenceService (issue 6).

The operator runs out of cluster in this process, as `kopf.testing.KopfRunner` runs it; the CRD comes from the Helm
chart; the process kubelet (e2e/cluster/kubelet.py) runs the engine of each engine pod on the pod's loopback IP.
Here `examples/tiny-cpu.yaml` runs its engine (a two-layer model on the CPU, one replica); Ascend services are
deployed into a namespace the process kubelet leaves alone (their pods are made, never run); test_multinode.py runs a
replica that spans nodes.

The tests of this module run in order and share one InferenceService: created, restarted over, edited, deleted.
Then, in a namespace the process kubelet leaves alone: an ascend service spanning two nodes deployed as a
LeaderWorkerSet whose group the controller makes, a CPU service edited to ascend whose Deployment is replaced by a
LeaderWorkerSet, and the status writer's retry when another write lands first. The
cluster runs the LeaderWorkerSet controller (its CRD and webhooks): the operator watches LeaderWorkerSets, and a
multi-node example's LeaderWorkerSet passes the server-side dry run.
"""

from __future__ import annotations

import copy
import ipaddress
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import kubernetes
import localk8s
import pytest
import yaml
from operator_harness import (
    RELEASE,
    RELEASE_NAMESPACE,
    Operator,
    events,
    helm_install,
    running_operator,
    scratch_namespace,
    wait_for,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
TINY = EXAMPLES / "tiny-cpu.yaml"
CHART = REPO / "deploy" / "helm" / "npuserve"
INSTANCE_LABEL = "npuserve.io/inferenceservice"
CONFIG_HASH = "npuserve.io/config-hash"

@pytest.fixture(scope="module")
def helm_release(k8s_cluster: localk8s.Cluster) -> str:
    """`helm install` of the chart: the CRD (from crds/), the operator's Deployment, ServiceAccount and RBAC."""
    return helm_install(k8s_cluster)


@pytest.fixture(scope="module")
def operator(k8s_cluster: localk8s.Cluster, helm_release: str) -> Iterator[Operator]:
    with running_operator(k8s_cluster) as op:
        yield op


@pytest.fixture(scope="module")
def namespace(k8s_cluster: localk8s.Cluster) -> Iterator[str]:
    with scratch_namespace(k8s_cluster, "e2e-op-") as ns:
        yield ns


def tiny_manifest(namespace: str) -> dict[str, Any]:
    obj: dict[str, Any] = yaml.safe_load(TINY.read_text())
    obj["metadata"]["namespace"] = namespace
    return obj


def get_json(cluster: localk8s.Cluster, *args: str) -> dict[str, Any]:
    return cluster.kubectl_json(*args)


def items(cluster: localk8s.Cluster, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = get_json(cluster, "get", kind, "-n", namespace, "-l", selector)["items"]  # type: ignore[assignment]
    return found


def ready_pods(cluster: localk8s.Cluster, namespace: str, name: str) -> list[dict[str, Any]]:
    pods = [
        p
        for p in items(cluster, "pods", namespace, f"{INSTANCE_LABEL}={name}")
        if not p["metadata"].get("deletionTimestamp")
    ]
    return [p for p in pods if _ready(p)]


def _ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))


def npuserve_plan(path: Path) -> dict[str, Any]:
    exe = Path(sys.executable).parent / "npuserve"
    out = subprocess.run(
        [str(exe), "plan", "--from-file", str(path), "--format", "json"],
        text=True,
        capture_output=True,
        check=True,
        cwd="/",
    )
    plan: dict[str, Any] = json.loads(out.stdout)
    return plan


def complete(ip: str, prompt: list[int], max_tokens: int = 4) -> httpx.Response:
    return httpx.post(
        f"http://{ip}:8000/v1/completions",
        timeout=60,
        json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
    )


def _events(cluster: localk8s.Cluster, namespace: str, name: str, reason: str) -> int:
    return sum(int(e.get("count") or 1) for e in events(cluster, namespace, name, reason))


# ---- the CRD ------------------------------------------------------------------------------------------------------
def test_helm_install_installs_the_crd(k8s_cluster: localk8s.Cluster, helm_release: str) -> None:
    crd = get_json(k8s_cluster, "get", "crd", "inferenceservices.npuserve.io")
    conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}  # type: ignore[index]
    assert conditions.get("Established") == "True", conditions
    assert crd["metadata"]["labels"].get("app.kubernetes.io/part-of") == "npuserve"  # type: ignore[index]
    status = json.loads(
        subprocess.run(
            [
                str(localk8s.ensure_binaries(with_helm=True).helm),
                "status",
                RELEASE,
                "-n",
                RELEASE_NAMESPACE,
                "-o",
                "json",
                f"--kubeconfig={k8s_cluster.kubeconfig}",
            ],
            text=True,
            capture_output=True,
            check=True,
        ).stdout
    )
    assert status["info"]["status"] == "deployed"
    assert items(k8s_cluster, "deployments", RELEASE_NAMESPACE, f"app.kubernetes.io/instance={RELEASE}")


def _invalid(change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    obj = tiny_manifest("default")
    obj["metadata"]["name"] = "invalid-" + uuid.uuid4().hex[:6]
    change(obj["spec"])
    return obj


INVALID = {
    "preset and architecture": (
        lambda s: s["model"].update(
            architecture={
                "hiddenSize": 64,
                "numLayers": 2,
                "numAttentionHeads": 4,
                "numKeyValueHeads": 2,
                "intermediateSize": 128,
                "vocabSize": 256,
            }
        ),
        "spec.model: set exactly one of preset or architecture",
    ),
    "cards not dividing the heads": (
        lambda s: s["accelerator"].update(cards=3),
        "spec.accelerator.cards (3) must divide the 4 attention heads of spec.model.preset tiny",
    ),
    "decodeLatency without tpotMs": (
        lambda s: s.update(slo={"objective": "decodeLatency"}),
        "spec.slo.tpotMs is required when spec.slo.objective is decodeLatency",
    ),
    "replicas outside the capacity bounds": (
        lambda s: s.update(capacity={"targetConcurrentUsers": 100, "maxReplicas": 0}),
        "spec.capacity.maxReplicas",
    ),
    "replicas above capacity.maxReplicas": (
        lambda s: s.update(replicas=3, capacity={"targetConcurrentUsers": 100, "maxReplicas": 2}),
        "spec.replicas must lie within spec.capacity.minReplicas and maxReplicas",
    ),
    "average output above the maximum": (
        lambda s: s["workload"].update(avgOutputTokens=100),
        "spec.workload.avgOutputTokens must not exceed",
    ),
    "MoE top-k above the experts": (
        lambda s: (s["model"].pop("preset"), s["model"].update(
            architecture={
                "modelType": "qwen3_moe", "hiddenSize": 64, "numLayers": 2, "numAttentionHeads": 4,
                "numKeyValueHeads": 2, "intermediateSize": 128, "vocabSize": 256,
                "numExperts": 4, "numExpertsPerToken": 8, "moeIntermediateSize": 32,
            }
        )),
        "spec.model.architecture.numExpertsPerToken must not exceed numExperts",
    ),
    "MLA fields without vHeadDim": (
        lambda s: (s["model"].pop("preset"), s["model"].update(
            architecture={
                "modelType": "deepseek_v3", "hiddenSize": 64, "numLayers": 2, "numAttentionHeads": 4,
                "numKeyValueHeads": 4, "intermediateSize": 128, "vocabSize": 256,
                "numExperts": 4, "numExpertsPerToken": 2, "moeIntermediateSize": 32,
                "kvLoraRank": 32, "qkNopeHeadDim": 16, "qkRopeHeadDim": 8,
            }
        )),
        "spec.model.architecture: set kvLoraRank, qkNopeHeadDim, qkRopeHeadDim and vHeadDim together",
    ),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_inferenceservice_is_refused_by_the_api_server(
    k8s_cluster: localk8s.Cluster, helm_release: str, case: str
) -> None:
    change, message = INVALID[case]
    obj = _invalid(change)
    out = subprocess.run(
        [str(k8s_cluster.binaries.kubectl), f"--kubeconfig={k8s_cluster.kubeconfig}", "create", "-f", "-"],
        input=json.dumps(obj),
        text=True,
        capture_output=True,
    )
    assert out.returncode != 0, f"{case} was accepted"
    assert message in out.stderr, out.stderr
    assert k8s_cluster.kubectl("get", "inferenceservice", obj["metadata"]["name"], "--ignore-not-found") == ""


# ---- every example's objects are accepted by the API server ---------------------------------------------------------
UNSERVED_KINDS = {"PodMonitor"}  # its CRD (the Prometheus Operator's) is not installed here


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_rendered_objects_pass_server_side_dry_run(
    k8s_cluster: localk8s.Cluster, helm_release: str, example: str
) -> None:
    from npuserve.operator.render import render
    from npuserve.planning.api import InferenceService
    from npuserve.planning.planner import plan

    raw = yaml.safe_load((EXAMPLES / example).read_text())
    # A name of its own: an object of the example's name may exist (`make demo` leaves tiny-cpu's running).
    raw["metadata"]["name"] = f"{raw['metadata']['name']}-{uuid.uuid4().hex[:6]}"
    # The InferenceService itself first, as the API server validates it (CRD schema and CEL rules).
    k8s_cluster.kubectl("create", "--dry-run=server", "-n", "default", "-f", "-", input=json.dumps(raw))
    raw["metadata"].update(namespace="default", uid=str(uuid.uuid4()))
    isvc = InferenceService.model_validate(raw)
    objects = render(isvc, plan(isvc.spec))
    served = {o["kind"] for o in objects if o["kind"] not in UNSERVED_KINDS}
    assert {"ConfigMap", "Service"} <= served
    for kind in {o["kind"] for o in objects} & UNSERVED_KINDS:  # skipped only because the API is not there
        assert k8s_cluster.kubectl("api-resources", "-o", "name", f"--api-group={_group(objects, kind)}") == ""
    accepted = [o for o in objects if o["kind"] not in UNSERVED_KINDS]
    out = k8s_cluster.kubectl(
        "apply",
        "--dry-run=server",
        "--server-side",
        "--field-manager=npuserve-operator",
        "-f",
        "-",
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": accepted}),
    )
    assert out.count("(server dry run)") == len(accepted), out


def _group(objects: list[dict[str, Any]], kind: str) -> str:
    return next(o["apiVersion"].split("/")[0] for o in objects if o["kind"] == kind)


# ---- the process kubelet ------------------------------------------------------------------------------------------
def test_crashing_engine_is_reported_and_never_ready(k8s_cluster: localk8s.Cluster, namespace: str) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "crashes", "namespace": namespace},
        "spec": {
            "containers": [
                {
                    "name": "engine",
                    "image": "npuserve/engine:0.1.0",
                    "command": ["npuserve", "serve", "--model", "/models/none", "--host", "0.0.0.0", "--port", "8000"],
                    "readinessProbe": {"httpGet": {"path": "/ready", "port": 8000}},
                }
            ],
            "terminationGracePeriodSeconds": 5,
        },
    }
    k8s_cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))
    try:

        def crashed() -> dict[str, Any] | None:
            status = get_json(k8s_cluster, "get", "pod", "crashes", "-n", namespace)["status"]
            cs = (status.get("containerStatuses") or [{}])[0]  # type: ignore[union-attr]
            return status if cs.get("lastState", {}).get("terminated") else None

        status = wait_for("the engine's exit in the container status", crashed, timeout=120)
        cs = status["containerStatuses"][0]
        assert cs["lastState"]["terminated"]["exitCode"] != 0
        assert cs["lastState"]["terminated"]["reason"] == "Error"
        assert cs["restartCount"] >= 1 and cs["ready"] is False
        assert not _ready({"status": status}) and status["phase"] == "Running"
        assert ipaddress.ip_address(status["podIP"]) in localk8s.POD_NETWORK
    finally:
        k8s_cluster.kubectl("delete", "pod", "crashes", "-n", namespace, "--wait=true", check=False, timeout=60)


# ---- one InferenceService through its life ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(k8s_cluster: localk8s.Cluster, operator: Operator, namespace: str) -> dict[str, Any]:
    obj = tiny_manifest(namespace)
    k8s_cluster.kubectl("apply", "-f", "-", input=json.dumps(obj))
    return obj


def _isvc(cluster: localk8s.Cluster, namespace: str) -> dict[str, Any]:
    return get_json(cluster, "get", "inferenceservice", "tiny", "-n", namespace)


def _config_json(cluster: localk8s.Cluster, namespace: str) -> dict[str, Any]:
    cm = get_json(cluster, "get", "configmap", "tiny-config", "-n", namespace)
    config: dict[str, Any] = json.loads(cm["data"]["config.json"])  # type: ignore[index]
    return config


def test_tiny_cpu_is_planned_deployed_and_served(
    k8s_cluster: localk8s.Cluster, namespace: str, tiny: dict[str, Any]
) -> None:
    expected_plan = npuserve_plan(TINY)
    # The objects, with the planned values.
    wait_for(
        "the ConfigMap, Deployment and Service",
        lambda: all(
            k8s_cluster.kubectl("get", kind, "-n", namespace, "--ignore-not-found", "-o", "name")
            for kind in ("configmap/tiny-config", "deployment/tiny", "service/tiny")
        ),
    )
    config = _config_json(k8s_cluster, namespace)
    schedule = config["BackendConfig"]["ScheduleConfig"]
    assert schedule["maxBatchSize"] == expected_plan["schedule"]["maxBatchSize"]
    assert schedule["maxPrefillBatchSize"] == expected_plan["schedule"]["maxPrefillBatchSize"]
    model_config = config["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]
    assert model_config["npuMemSize"] == expected_plan["npuMemSizeGiB"]
    assert model_config["worldSize"] == expected_plan["worldSize"]
    assert config["BackendConfig"]["ModelDeployConfig"]["maxInputTokenLen"] == expected_plan["maxInputTokenLen"]
    deployment = get_json(k8s_cluster, "get", "deployment", "tiny", "-n", namespace)
    assert deployment["spec"]["replicas"] == expected_plan["replicas"] == 1  # type: ignore[index]
    owner = deployment["metadata"]["ownerReferences"][0]  # type: ignore[index]
    assert (owner["kind"], owner["name"], owner["controller"]) == ("InferenceService", "tiny", True)
    service = get_json(k8s_cluster, "get", "service", "tiny", "-n", namespace)
    assert service["spec"]["ports"][0]["port"] == 8000  # type: ignore[index]

    # Running and Ready (Ready only once the engine's /ready says so), the engine answering on its pod IP.
    (pod,) = wait_for("a Ready engine pod", lambda: ready_pods(k8s_cluster, namespace, "tiny"), timeout=300)
    assert pod["status"]["phase"] == "Running"
    ip = pod["status"]["podIP"]
    assert httpx.get(f"http://{ip}:8000/ready", timeout=5).status_code == 200
    (cs,) = pod["status"]["containerStatuses"]
    assert cs["ready"] is True and "running" in cs["state"]
    from openai import OpenAI

    client = OpenAI(base_url=f"http://{ip}:8000/v1", api_key="none", max_retries=0)
    out = client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=8, temperature=0)
    assert out.choices[0].text and out.usage is not None and out.usage.completion_tokens > 0
    info = httpx.get(f"http://{ip}:8000/info", timeout=5).json()

    # The status: the plan exactly as `npuserve plan` prints it, the blocks the engine allocated, phase Ready.
    status = wait_for(
        "phase Ready with the observed KV blocks",
        lambda: (
            (s := _isvc(k8s_cluster, namespace).get("status", {})).get("phase") == "Ready"
            and s.get("observed", {}).get("kvBlocksAllocated")
            and s
        ),
        timeout=120,
    )
    assert status["plan"] == expected_plan
    assert status["observed"]["kvBlocksAllocated"] == info["kv_blocks"]
    conditions = {c["type"]: c for c in status["conditions"]}
    assert all(conditions[t]["status"] == "True" for t in ("Planned", "Deployed", "Ready"))
    assert _events(k8s_cluster, namespace, "tiny", "Applied") >= 1


OWNED_KINDS = ("configmaps", "deployments", "replicasets", "services", "pods")


def _counts(cluster: localk8s.Cluster, namespace: str) -> dict[str, int]:
    out = {}
    for kind in OWNED_KINDS:
        found = items(cluster, kind, namespace, f"{INSTANCE_LABEL}=tiny")
        out[kind] = len([o for o in found if not o["metadata"].get("deletionTimestamp")])
    return out


def test_operator_restart_resumes_without_duplicates(
    k8s_cluster: localk8s.Cluster, namespace: str, tiny: dict[str, Any], operator: Operator
) -> None:
    before = _isvc(k8s_cluster, namespace)
    counts = _counts(k8s_cluster, namespace)
    assert counts == {"configmaps": 1, "deployments": 1, "replicasets": 1, "services": 1, "pods": 1}
    applied = _events(k8s_cluster, namespace, "tiny", "Applied")
    pod_uids = {p["metadata"]["uid"] for p in ready_pods(k8s_cluster, namespace, "tiny")}
    operator.stop()
    operator.start()
    # The new operator's resume handler re-applies (an Applied event); nothing is created twice.
    wait_for("the resume handler's apply", lambda: _events(k8s_cluster, namespace, "tiny", "Applied") > applied)
    time.sleep(3)  # let any (wrong) duplicate appear
    assert _counts(k8s_cluster, namespace) == counts
    after = _isvc(k8s_cluster, namespace)
    assert after["status"]["plan"] == before["status"]["plan"]
    assert after["status"]["phase"] == "Ready"
    assert after["status"]["observed"] == before["status"]["observed"]
    assert after["metadata"]["uid"] == before["metadata"]["uid"]
    # The pods were left alone: same ones, still Ready.
    assert {p["metadata"]["uid"] for p in ready_pods(k8s_cluster, namespace, "tiny")} == pod_uids


def test_spec_edit_replans_and_rolls_the_pods(
    k8s_cluster: localk8s.Cluster, namespace: str, tiny: dict[str, Any]
) -> None:
    (old_pod,) = wait_for("the Ready pod", lambda: ready_pods(k8s_cluster, namespace, "tiny"))
    old_hash = old_pod["metadata"]["annotations"][CONFIG_HASH]
    long_prompt = [5] * 300  # above maxInputTokens 256, within 512
    refused = complete(old_pod["status"]["podIP"], long_prompt)
    assert refused.status_code == 400, refused.text

    edited = copy.deepcopy(tiny)
    edited["spec"]["workload"]["maxInputTokens"] = 512
    k8s_cluster.kubectl("apply", "-f", "-", input=json.dumps(edited))
    wait_for(
        "config.json with maxInputTokenLen 512",
        lambda: _config_json(k8s_cluster, namespace)["BackendConfig"]["ModelDeployConfig"]["maxInputTokenLen"] == 512,
    )
    expected = npuserve_plan_of(edited)
    new_pods = wait_for(
        "a Ready pod with the new config hash",
        lambda: [
            p
            for p in ready_pods(k8s_cluster, namespace, "tiny")
            if p["metadata"]["annotations"][CONFIG_HASH] != old_hash
        ],
        timeout=300,
    )
    (new_pod,) = new_pods
    assert new_pod["metadata"]["uid"] != old_pod["metadata"]["uid"]
    wait_for(
        "the old pod to go",
        lambda: all(
            p["metadata"]["uid"] != old_pod["metadata"]["uid"]
            for p in items(k8s_cluster, "pods", namespace, f"{INSTANCE_LABEL}=tiny")
        ),
    )
    served = complete(new_pod["status"]["podIP"], long_prompt)
    assert served.status_code == 200, served.text
    assert served.json()["usage"]["prompt_tokens"] == 300
    status = wait_for(
        "the new plan in the status",
        lambda: (s := _isvc(k8s_cluster, namespace)["status"])["plan"] == expected and s["phase"] == "Ready" and s,
    )
    assert status["observedGeneration"] == _isvc(k8s_cluster, namespace)["metadata"]["generation"]


def npuserve_plan_of(obj: dict[str, Any]) -> dict[str, Any]:
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"npuserve-e2e-{uuid.uuid4().hex[:8]}.yaml"
    path.write_text(yaml.safe_dump(obj))
    try:
        return npuserve_plan(path)
    finally:
        path.unlink()


def test_delete_removes_everything_it_made(k8s_cluster: localk8s.Cluster, namespace: str, tiny: dict[str, Any]) -> None:
    pods = items(k8s_cluster, "pods", namespace, f"{INSTANCE_LABEL}=tiny")
    ips = {p["status"]["podIP"] for p in pods}
    k8s_cluster.kubectl("delete", "inferenceservice", "tiny", "-n", namespace, "--wait=true", timeout=90)
    # Garbage collection by owner reference (the controller manager), not by the operator.
    wait_for("every object of tiny to go", lambda: not any(_counts(k8s_cluster, namespace).values()), timeout=120)
    # ... and the engine processes with their pods.
    for ip in ips:
        wait_for(f"the engine on {ip} to stop", lambda ip=ip: not _answers(ip), timeout=60)


def _answers(ip: str) -> bool:
    try:
        httpx.get(f"http://{ip}:8000/health", timeout=2)
        return True
    except httpx.HTTPError:
        return False


# ---- a replica spanning nodes (not run here); pruning; the one status writer --------------------------------------
IGNORE_LABEL = "npuserve.io/process-kubelet"  # the process kubelet starts no engines in such a namespace
ASCEND = {"type": "ascend-910b4", "cards": 16}  # two 8-card nodes: one replica is a LeaderWorkerSet group of 2 pods
MULTI_NODE_MODEL = {"name": "tiny", "preset": "llama3-8b", "weights": {"loadFormat": "dummy"}}  # 32 heads split 16 ways
WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"


@pytest.fixture(scope="module")
def quiet_namespace(k8s_cluster: localk8s.Cluster) -> Iterator[str]:
    ns = "e2e-op-quiet-" + uuid.uuid4().hex[:6]
    k8s_cluster.kubectl("create", "namespace", ns)
    k8s_cluster.kubectl("label", "namespace", ns, f"{IGNORE_LABEL}=ignore")
    try:
        yield ns
    finally:
        k8s_cluster.kubectl("delete", "inferenceservices", "--all", "-n", ns, "--wait=true", check=False, timeout=90)
        k8s_cluster.kubectl("wait", "--for=delete", "pod", "--all", "-n", ns, "--timeout=60s", check=False, timeout=70)
        k8s_cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def _service(namespace: str, name: str, accelerator: dict[str, Any] | None = None) -> dict[str, Any]:
    obj = tiny_manifest(namespace)
    obj["metadata"]["name"] = name
    if accelerator is not None:
        obj["spec"]["accelerator"] = accelerator
        obj["spec"]["model"] = MULTI_NODE_MODEL
    return obj


def _get(cluster: localk8s.Cluster, namespace: str, name: str) -> dict[str, Any]:
    return get_json(cluster, "get", "inferenceservice", name, "-n", namespace)


def _condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == type_), {})


def _children(cluster: localk8s.Cluster, namespace: str, name: str) -> list[str]:
    return sorted(
        f"{kind}/{o['metadata']['name']}"
        for kind in ("configmaps", "deployments", "leaderworkersets", "services")
        for o in items(cluster, kind, namespace, f"{INSTANCE_LABEL}={name}")
        if not o["metadata"].get("deletionTimestamp")
    )


def test_an_ascend_service_spanning_nodes_is_deployed_as_a_leaderworkerset(
    k8s_cluster: localk8s.Cluster, operator: Operator, quiet_namespace: str
) -> None:
    obj = _service(quiet_namespace, "big", ASCEND)
    k8s_cluster.kubectl("apply", "-f", "-", input=json.dumps(obj))
    expected = ["configmaps/big-config", "leaderworkersets/big", "services/big"]
    wait_for("the ConfigMap, LeaderWorkerSet and Service", lambda: _children(k8s_cluster, quiet_namespace, "big")
             == expected)
    status = wait_for("Deployed=True", lambda: (o := _get(k8s_cluster, quiet_namespace, "big"))
                      and _condition(o, "Deployed").get("status") == "True" and o)["status"]
    assert status["plan"] == npuserve_plan_of(obj) and status["plan"]["nodes"] == 2
    assert not any("cannot serve" in w for w in status["plan"]["warnings"])
    lws = get_json(k8s_cluster, "get", "leaderworkerset", "big", "-n", quiet_namespace)
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2  # type: ignore[index]
    # The controller made the group: a leader and a worker, 8 cards each, so one on each node (nothing runs them in
    # this namespace, so the replica is not Ready).
    pods = wait_for("the group's two pods on two nodes", lambda: (
        found := [p for p in items(k8s_cluster, "pods", quiet_namespace, f"{INSTANCE_LABEL}=big")
                  if p["spec"].get("nodeName")]) and len(found) == 2 and found)
    assert sorted(p["metadata"]["labels"][WORKER_INDEX] for p in pods) == ["0", "1"]
    assert len({p["spec"]["nodeName"] for p in pods}) == 2
    assert _condition(_get(k8s_cluster, quiet_namespace, "big"), "Ready")["status"] == "False"


def test_editing_a_cpu_service_to_ascend_replaces_its_deployment_with_a_leaderworkerset(
    k8s_cluster: localk8s.Cluster, operator: Operator, quiet_namespace: str
) -> None:
    obj = _service(quiet_namespace, "edited")
    k8s_cluster.kubectl("apply", "-f", "-", input=json.dumps(obj))
    expected = ["configmaps/edited-config", "deployments/edited", "services/edited"]
    wait_for("the CPU service's objects", lambda: _children(k8s_cluster, quiet_namespace, "edited") == expected)
    wait_for("Deployed=True", lambda: _condition(_get(k8s_cluster, quiet_namespace, "edited"), "Deployed").get(
        "status") == "True")
    obj["spec"]["accelerator"] = ASCEND
    obj["spec"]["model"] = MULTI_NODE_MODEL
    k8s_cluster.kubectl("apply", "-f", "-", input=json.dumps(obj))
    replaced = ["configmaps/edited-config", "leaderworkersets/edited", "services/edited"]
    wait_for("the Deployment pruned and a LeaderWorkerSet in its place",
             lambda: _children(k8s_cluster, quiet_namespace, "edited") == replaced, timeout=60)
    edited = wait_for("the edit observed", lambda: (o := _get(k8s_cluster, quiet_namespace, "edited"))
                      and o["status"].get("observedGeneration") == o["metadata"]["generation"] and o)
    assert edited["status"]["plan"]["nodes"] == 2


def test_a_status_write_from_a_stale_read_is_refused_and_retried(
    k8s_cluster: localk8s.Cluster, operator: Operator, quiet_namespace: str
) -> None:
    """Against the real API server: another writer lands between the writer's read and its write; the API server
    answers 409 to the stale resourceVersion, the writer reads again, and neither write is lost."""
    from npuserve.operator import status_writer
    from npuserve.operator.status import set_condition
    from npuserve.planning.api import GROUP, PLURAL, VERSION

    wait_for("big deployed", lambda: _condition(_get(k8s_cluster, quiet_namespace, "big"), "Deployed").get(
        "status") == "True")
    api = kubernetes.client.CustomObjectsApi(
        kubernetes.config.new_client_from_config(config_file=str(k8s_cluster.kubeconfig)))
    other = {"type": "SLOMet", "status": "Unknown", "reason": "NoMeasurements", "message": "another writer",
             "lastTransitionTime": "2026-01-01T00:00:00Z"}
    reads: list[list[str]] = []

    def change(obj: Any) -> dict[str, Any]:
        conditions = obj["status"]["conditions"]
        reads.append([c["type"] for c in conditions])
        if len(reads) == 1:  # the other write, after this read: its conditions list is now stale
            api.patch_namespaced_custom_object_status(
                GROUP, VERSION, quiet_namespace, PLURAL, "big",
                {"status": {"conditions": [*conditions, other]}})
        return {**obj["status"], "conditions": set_condition(conditions, "Tuning", False, "TestWriter", "ours",
                                                             "2026-01-01T00:00:01Z", None)}

    update = status_writer.update_status(api, quiet_namespace, "big", change)
    assert update is not None and update.attempts == 2, reads
    assert "SLOMet" not in reads[0] and "SLOMet" in reads[1]
    final = _get(k8s_cluster, quiet_namespace, "big")
    assert _condition(final, "SLOMet")["message"] == "another writer"  # not lost to the stale list
    assert _condition(final, "Tuning")["reason"] == "TestWriter"
    assert _condition(final, "Deployed")["status"] == "True"
