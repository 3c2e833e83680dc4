"""kube.py: the one status writer (optimistic concurrency, retry on 409), pruning of what a previous render made, the
engines' /info read concurrently with a bound and a timeout, how each engine container last ended, and how many
pods the nodes hold."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import httpx
import pytest
from fake_kube import TINY, FakeKube, FakeStatusApi
from kubernetes import client

from npuserve.operator import status as st
from npuserve.operator.autotune_types import EngineReport, Termination
from npuserve.operator.capacity import group_limit
from npuserve.operator.engine_http import EnginePod, read_engines
from npuserve.operator.kube import AutotuneKube, Kube, engine_pods, pod_states
from npuserve.operator.render import render
from npuserve.operator.status_writer import STATUS_WRITE_ATTEMPTS, StatusConflict, merge_patch, update_status
from npuserve.planning.api import InferenceService
from npuserve.planning.planner import plan

NS, NAME = TINY["metadata"]["namespace"], TINY["metadata"]["name"]
ISVC = InferenceService.model_validate(TINY)
PLAN = plan(ISVC.spec)
READY = {"type": "Ready", "status": "True", "reason": "EnginesReady", "message": "1/1 engine pods ready",
         "lastTransitionTime": "t1", "observedGeneration": 1}


def _types(status: dict[str, Any]) -> dict[str, str]:
    return {c["type"]: c["status"] for c in status.get("conditions", [])}


# --- the status writer -----------------------------------------------------------------------------------------------


def test_a_write_from_a_stale_read_is_retried_and_loses_nothing() -> None:
    """Reconcile re-plans while the readiness handler marks the service Ready between reconcile's read and write:
    the API server answers 409 to the stale write, the writer reads again, and both updates survive."""
    api = FakeStatusApi({**TINY, "status": st.deployed(st.planned({}, PLAN, 1, "sel", "t0"), ["Deployment"], [], 1,
                                                         "t0")})
    api.before_next_patch = lambda: api.write({"phase": "Ready", "conditions": [
        *api.obj["status"]["conditions"], READY]})  # type: ignore[index]
    calls: list[dict[str, Any]] = []

    def replan(obj: Any) -> dict[str, Any]:
        calls.append(copy.deepcopy(obj["status"]))
        return st.planned(obj["status"], PLAN, 2, "sel", "t2")

    update = update_status(api, NS, NAME, replan)
    assert update is not None and update.attempts == 2
    assert api.conflicts == 1 and len(calls) == 2
    assert "Ready" not in _types(calls[0]) and _types(calls[1])["Ready"] == "True"  # the second try saw the write
    final = api.obj["status"]  # type: ignore[index]
    assert _types(final) == {"Planned": "True", "Deployed": "True", "Ready": "True"}
    assert final["phase"] == "Ready" and final["observedGeneration"] == 2
    # Every write carried the resourceVersion of the read it was computed from.
    assert [p["metadata"]["resourceVersion"] for p in api.patches] == ["1", "2"]


def test_the_writer_gives_up_after_a_bounded_number_of_conflicts() -> None:
    api = FakeStatusApi({**TINY, "status": {}})

    def always_conflict() -> None:
        api.write({"replicas": 0})
        api.before_next_patch = always_conflict

    api.before_next_patch = always_conflict
    with pytest.raises(StatusConflict):
        update_status(api, NS, NAME, lambda o: {**o["status"], "phase": "Deploying"})
    assert api.conflicts == STATUS_WRITE_ATTEMPTS


def test_nothing_is_written_when_nothing_changes_and_a_gone_object_is_none() -> None:
    api = FakeStatusApi({**TINY, "status": {"phase": "Ready"}})
    update = update_status(api, NS, NAME, lambda o: dict(o["status"]))
    assert update is not None and update.old == update.new == {"phase": "Ready"} and api.patches == []
    assert update_status(api, NS, NAME, lambda o: None) is not None and api.patches == []
    assert update_status(FakeStatusApi(None), NS, NAME, lambda o: {"phase": "Ready"}) is None


def test_the_patch_removes_what_the_new_status_drops() -> None:
    api = FakeStatusApi({**TINY, "status": {"phase": "Ready", "observed": {"kvBlocksAllocated": 8192}}})
    update_status(api, NS, NAME, lambda o: {"phase": "Planned"})
    assert api.obj["status"] == {"phase": "Planned"}  # type: ignore[index]


# --- prune -----------------------------------------------------------------------------------------------------------


def test_prune_removes_the_objects_of_a_previous_render_only() -> None:
    kube = FakeKube(TINY, served={"ConfigMap", "Service", "Deployment", "PodMonitor"})
    monitored = {**TINY, "spec": {**TINY["spec"], "monitoring": {"podMonitor": True}}}
    with_monitor = InferenceService.model_validate(monitored)
    for manifest in render(with_monitor, PLAN):
        kube.apply(manifest)
    other = InferenceService.model_validate({**TINY, "metadata": {**TINY["metadata"], "name": "other"}})
    for manifest in render(other, PLAN):
        kube.apply(manifest)
    assert "PodMonitor/tiny" in kube.kinds()

    removed = kube.prune(NS, NAME, render(ISVC, PLAN))  # the spec no longer asks for a PodMonitor
    assert removed == ["PodMonitor/tiny"]
    assert kube.kinds() == ["ConfigMap/other-config", "ConfigMap/tiny-config", "Deployment/other", "Deployment/tiny",
                            "Service/other", "Service/tiny"]
    assert kube.prune(NS, NAME, []) == ["ConfigMap/tiny-config", "Service/tiny", "Deployment/tiny"]
    assert kube.kinds() == ["ConfigMap/other-config", "Deployment/other", "Service/other"]


# --- the engines' /info ----------------------------------------------------------------------------------------------

INFO = {"model": "/etc/npuserve/model", "served_model_name": "tiny", "model_type": "llama", "dtype": "float32",
        "device": "cpu", "worldSize": 1, "kv_blocks": 8192, "kv_host_blocks": 0, "block_size": 128,
        "kv_bytes_per_block": 131072, "kv_sizing": "npuMemSize 1 GiB", "schedule": {"maxBatchSize": 4096},
        "version": "0.1.0", "ready": True, "max_waiting_requests": 1024, "num_requests_in_flight": 0}


def test_info_reads_run_concurrently_with_a_bound() -> None:
    in_flight, peak, asked = 0, 0, []

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal in_flight, peak
        asked.append(request.url.host)
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.05)
        in_flight -= 1
        return httpx.Response(200, json={**INFO, "kv_blocks": 8000 + int(request.url.host.rsplit(".", 1)[1])})

    pods = [EnginePod(f"tiny-{i}", f"127.1.0.{i}", True) for i in range(20)]
    reports = read_engines(pods, limit=4, transport=httpx.MockTransport(handler))
    assert peak == 4  # concurrent, and never more than the bound
    assert [r.kv_blocks for r in reports] == [8000 + i for i in range(20)]  # in the pods' order
    assert sorted(asked) == sorted(f"127.1.0.{i}" for i in range(20))


def test_info_reads_time_out_and_bad_bodies_are_errors_not_crashes() -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host == "127.1.0.1":
            await asyncio.sleep(5)
        if host == "127.1.0.2":
            return httpx.Response(200, json={"kv_blocks": 10})  # not an EngineInfo
        if host == "127.1.0.3":
            return httpx.Response(503, text="loading")
        assert request.url.port == 8000 and request.url.path == "/info"
        return httpx.Response(200, json=INFO)

    pods = [EnginePod("slow", "127.1.0.1", True), EnginePod("odd", "127.1.0.2", True),
            EnginePod("busy", "127.1.0.3", True), EnginePod("good", "127.1.0.4", True),
            EnginePod("starting", None, False), EnginePod("waiting", "127.1.0.5", False),
            EnginePod("worker", "127.1.0.6", True, serves_http=False)]
    reports = {r.pod: r for r in read_engines(pods, timeout=0.2, transport=httpx.MockTransport(handler))}
    assert reports["good"] == EngineReport("good", True, kv_blocks=8192)
    for name in ("slow", "odd", "busy"):
        assert reports[name].ready and reports[name].kv_blocks is None
        assert (reports[name].error or "").startswith("/info unreadable"), reports[name]
    assert reports["starting"] == EngineReport("starting", False, error="no pod IP yet")
    assert reports["waiting"] == EngineReport("waiting", False, error="not ready")
    assert reports["worker"] == EngineReport("worker", True)  # an LWS worker serves no HTTP: not asked


# --- the merge patch the writer sends -------------------------------------------------------------------------------


def test_merge_patch_sends_changes_and_nulls_removed_keys() -> None:
    old = {"phase": "Ready", "replicas": 1, "observed": {"kvBlocksAllocated": 8192, "ttftMs": 12.0},
           "conditions": [{"type": "Ready", "status": "True"}]}
    new = {"phase": "Planned", "replicas": 1, "observed": {"ttftMs": 12.0},
           "conditions": [{"type": "Ready", "status": "True"}, {"type": "Deployed", "status": "False"}]}
    assert merge_patch(old, new) == {
        "phase": "Planned", "observed": {"kvBlocksAllocated": None},
        # lists are replaced whole: the patch carries every condition, computed from the fresh read
        "conditions": [{"type": "Ready", "status": "True"}, {"type": "Deployed", "status": "False"}]}
    assert merge_patch(new, new) == {}
    assert merge_patch({"observed": {"a": 1}}, {}) == {"observed": None}


# --- how an engine container last ended: facts from the pod's status --------------------------------------------------


def _pod(name: str, *, state: client.V1ContainerState | None = None, last: client.V1ContainerState | None = None,
         restarts: int = 0, ready: bool = False, labels: dict[str, str] | None = None) -> client.V1Pod:
    engine = client.V1ContainerStatus(name="engine", image="i", image_id="", ready=ready, restart_count=restarts,
                                      state=state, last_state=last)
    sidecar = client.V1ContainerStatus(name="other", image="i", image_id="", ready=True, restart_count=7,
                                       state=client.V1ContainerState(terminated=client.V1ContainerStateTerminated(
                                           exit_code=2, message="not the engine")))
    conditions = [client.V1PodCondition(type="Ready", status="True" if ready else "False")]
    return client.V1Pod(metadata=client.V1ObjectMeta(name=name, labels=labels or {}),
                        status=client.V1PodStatus(pod_ip="10.0.0.1", conditions=conditions,
                                                  container_statuses=[sidecar, engine]))


def test_engine_pods_carry_how_their_engine_container_last_ended() -> None:
    crash = client.V1ContainerStateTerminated(exit_code=1, reason="Error",
                                              message="tensor-parallel rank 0 failed in FORWARD #3: boom\n")
    waiting = client.V1ContainerState(waiting=client.V1ContainerStateWaiting(reason="CrashLoopBackOff"))
    pods = engine_pods([
        _pod("down", state=client.V1ContainerState(terminated=crash), restarts=2),
        _pod("backing-off", state=waiting, last=client.V1ContainerState(terminated=crash), restarts=5),
        _pod("fine", state=client.V1ContainerState(running=client.V1ContainerStateRunning()), ready=True),
    ])
    ended = Termination(1, "Error", "tensor-parallel rank 0 failed in FORWARD #3: boom")
    assert [(p.name, p.restarts, p.terminated) for p in pods] == [
        ("down", 2, ended), ("backing-off", 5, ended), ("fine", 0, None)]
    reports = read_engines([p for p in pods if not p.ready])  # not ready: no /info read, the facts carried over
    assert reports == [EngineReport("down", False, error="not ready", restarts=2, terminated=ended),
                       EngineReport("backing-off", False, error="not ready", restarts=5, terminated=ended)]


# --- what the nodes hold ---------------------------------------------------------------------------------------------


class FakeNodes:
    """`core.list_node()` over nodes given as (unschedulable, allocatable)."""

    def __init__(self, nodes: list[tuple[bool, dict[str, str]]]) -> None:
        self.nodes = [client.V1Node(spec=client.V1NodeSpec(unschedulable=off),
                                    status=client.V1NodeStatus(allocatable=allocatable)) for off, allocatable in nodes]

    def list_node(self) -> client.V1NodeList:
        return client.V1NodeList(items=self.nodes)


def test_the_replica_limit_reads_every_quantity_the_api_server_writes() -> None:
    kube = Kube.__new__(Kube)  # no API server: only `core` is read
    kube.core = FakeNodes([(False, {"cpu": "7500m", "npu.example/shares": "1k"}),  # 1000, as Kubernetes writes it
                           (False, {"cpu": "16", "npu.example/shares": "1500"}),
                           (True, {"cpu": "64", "npu.example/shares": "8k"}),  # cordoned: not counted
                           (False, {})])  # type: ignore[assignment]
    calls = AutotuneKube.__new__(AutotuneKube)
    calls.kube = kube
    assert calls.pods_per_node(None, 2.0) == [3, 8]  # the cordoned node and the one without CPUs: none
    assert calls.pods_per_node("npu.example/shares", 250.0) == [4, 6]


def test_a_groups_pods_carry_their_group_and_only_leaders_serve_http() -> None:
    """The LeaderWorkerSet controller's labels: group-index on every pod of a group, worker-index 0 on its leader."""
    def group_pod(name: str, group: str, worker: str) -> client.V1Pod:
        return _pod(name, ready=True, labels={"leaderworkerset.sigs.k8s.io/group-index": group,
                                              "leaderworkerset.sigs.k8s.io/worker-index": worker})

    pods = [group_pod("tiny-0", "0", "0"), group_pod("tiny-0-1", "0", "1"), _pod("deployment-pod", ready=True)]
    assert [(p.name, p.group, p.serves_http) for p in engine_pods(pods)] == [
        ("tiny-0", "0", True), ("tiny-0-1", "0", False), ("deployment-pod", None, True)]
    for pod in pods:
        pod.metadata.uid = pod.metadata.name
    assert [(p.name, p.leader) for p in pod_states(pods)] == [
        ("deployment-pod", True), ("tiny-0", True), ("tiny-0-1", False)]


@pytest.mark.parametrize(("pods_per_node", "nodes", "limit"), [
    ([3, 8], 1, 11),  # one pod per replica: every pod the nodes hold
    ([1, 1, 1, 1, 1], 2, 2),  # whole-node pods (8 cards of 8): 5 nodes hold 2 replicas of 2, one node left over
    ([1, 1, 1, 0], 4, 0),  # 3 nodes can take a pod: no replica of 4
    ([4, 0, 0], 2, 0),  # 4 pods fit, all on one node: no replica of 2 pods on 2 nodes (4 // 2 would say 2)
    ([3, 1], 2, 1),  # 4 pods fit, but the second node takes one: 1 replica (4 // 2 would say 2)
    ([2, 2, 1], 2, 2),  # 5 pods: 2 replicas (the third would need 2 more nodes with room)
    ([2, 2, 2], 3, 2),
])
def test_a_replicas_pods_go_to_different_nodes(pods_per_node: list[int], nodes: int, limit: int) -> None:
    assert group_limit(pods_per_node, nodes) == limit


def test_the_replica_limit_of_groups_counts_nodes_not_cards() -> None:
    """Five 8-card nodes, one of them cordoned, one with 4 free: pods of 8 cards fit on three, so one replica of two
    pods (20 + 8 + 8 cards would say 36 // 16 = 2)."""
    kube = Kube.__new__(Kube)
    kube.core = FakeNodes([(False, {"huawei.com/Ascend910": "8"}), (False, {"huawei.com/Ascend910": "8"}),
                           (False, {"huawei.com/Ascend910": "8"}), (True, {"huawei.com/Ascend910": "8"}),
                           (False, {"huawei.com/Ascend910": "4"})])  # type: ignore[assignment]
    calls = AutotuneKube.__new__(AutotuneKube)
    calls.kube = kube
    assert group_limit(calls.pods_per_node("huawei.com/Ascend910", 8.0), 2) == 1
    assert group_limit(calls.pods_per_node("huawei.com/Ascend910", 8.0), 3) == 1
    assert group_limit(calls.pods_per_node("huawei.com/Ascend910", 4.0), 2) == 3  # 2 + 2 + 2 + 1 pods of 4
