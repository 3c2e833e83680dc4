"""The reconcile and readiness handlers over an in-memory API server: several cards on one node are deployed, a replica
spanning nodes as a LeaderWorkerSet (or Deployed=False naming what to install where its API is missing); what the
engine cannot serve is planned and not deployed (and what an earlier spec deployed is removed), the plan reaches the
status before anything is applied, an optional kind whose API is missing is skipped with a warning, autotune is
reported, readiness reads the plan from the status."""

from __future__ import annotations

import copy
import json
import logging
from typing import Any

import kopf
import pytest
from fake_kube import TINY, FakeKube

from npuserve.operator import engine_http, handlers, kube
from npuserve.operator.autotune_types import EngineReport, Termination

LOG = logging.getLogger("test")


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, str]]:
    posted: list[tuple[str, str, str]] = []
    monkeypatch.setattr(kopf, "info", lambda body, *, reason, message="": posted.append(("Normal", reason, message)))
    monkeypatch.setattr(kopf, "warn", lambda body, *, reason, message="": posted.append(("Warning", reason, message)))
    return posted


def _cluster(monkeypatch: pytest.MonkeyPatch, obj: dict[str, Any], served: set[str] | None = None) -> FakeKube:
    return FakeKube(obj, served)


def _memo(fake: FakeKube) -> kopf.Memo:
    """kopf's memo as the startup handler leaves it, without the autotune loop."""
    return kopf.Memo({handlers.MEMO_KUBE: fake})


def _reconcile(fake: FakeKube, spec_changes: dict[str, Any] | None = None) -> None:
    obj = copy.deepcopy(fake.custom.obj)  # type: ignore[attr-defined]
    obj["spec"].update(spec_changes or {})
    fake.custom.obj["spec"] = obj["spec"]  # type: ignore[attr-defined]
    handlers.reconcile(kopf.Body(obj), LOG, fake)  # type: ignore[arg-type]


def _conditions(fake: FakeKube) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in fake.status.get("conditions", [])}


def test_a_cpu_service_is_planned_applied_and_deployed(monkeypatch: pytest.MonkeyPatch, events: list[Any]) -> None:
    fake = _cluster(monkeypatch, TINY)
    _reconcile(fake)
    assert fake.kinds() == ["ConfigMap/tiny-config", "Deployment/tiny", "Service/tiny"]
    assert fake.created == ["Secret/tiny-admin"]
    assert fake.status["phase"] == "Deploying" and fake.status["plan"]["totalBlocks"] == 8192
    assert {t: c["status"] for t, c in _conditions(fake).items()} == {"Planned": "True", "Deployed": "True"}
    assert [e[1] for e in events] == ["Planned", "Applied"]


def test_an_ascend_service_on_one_node_is_deployed_with_its_cards(
    monkeypatch: pytest.MonkeyPatch, events: list[Any]
) -> None:
    """Tensor parallel runs within one pod: two Ascend cards on one node are served (one rank per card)."""
    fake = _cluster(monkeypatch, TINY)
    _reconcile(fake)  # served on the CPU first
    events.clear()
    _reconcile(fake, {"accelerator": {"type": "ascend-910b4", "cards": 2, "memoryGiB": 32, "reservedGiB": 3}})
    assert fake.kinds() == ["ConfigMap/tiny-config", "Deployment/tiny", "Service/tiny"]
    assert fake.deleted == []
    status = fake.status
    assert status["phase"] == "Deploying" and status["plan"]["warnings"] == []
    assert (status["plan"]["accelerator"], status["plan"]["worldSize"], status["plan"]["npuMemSizeGiB"]) == (
        "ascend-910b4", 2, 23)  # floor((32 - 3 - 0.002 / 2) x 0.8)
    assert {t: c["status"] for t, c in _conditions(fake).items()} == {"Planned": "True", "Deployed": "True"}
    deployment = fake.objects[("Deployment", "team-a", "tiny")]
    (engine,) = deployment["spec"]["template"]["spec"]["containers"]
    assert engine["resources"]["limits"]["huawei.com/Ascend910"] == "2"
    config = json.loads(fake.objects[("ConfigMap", "team-a", "tiny-config")]["data"]["config.json"])
    assert config["BackendConfig"]["npuDeviceIds"] == [[0, 1]]
    assert [e[1] for e in events] == ["Planned", "Applied"]


# The e2e test's accelerator: two CPU ranks, one per pod (a LeaderWorkerSet group of two).
CPU_GROUP = {"type": "cpu", "cards": 2, "cardsPerNode": 1, "memoryGiB": 2, "reservedGiB": 0}


def test_a_replica_spanning_nodes_is_deployed_as_a_leaderworkerset_replacing_the_deployment(
    monkeypatch: pytest.MonkeyPatch, events: list[Any]
) -> None:
    fake = _cluster(monkeypatch, TINY, served={"ConfigMap", "Service", "Deployment", "LeaderWorkerSet"})
    _reconcile(fake)  # one pod first
    events.clear()
    _reconcile(fake, {"accelerator": CPU_GROUP})
    assert fake.kinds() == ["ConfigMap/tiny-config", "LeaderWorkerSet/tiny", "Service/tiny"]
    assert fake.deleted == ["Deployment/tiny"]  # pruned: the group replaces it
    status = fake.status
    assert (status["plan"]["worldSize"], status["plan"]["nodes"], status["plan"]["cardsPerPod"]) == (2, 2, 1)
    assert status["plan"]["warnings"] == []
    deployed = _conditions(fake)["Deployed"]
    assert (deployed["status"], deployed["reason"]) == ("True", "Applied")
    assert deployed["message"] == "ConfigMap, LeaderWorkerSet, Service applied by server-side apply"
    lws = fake.objects[("LeaderWorkerSet", "team-a", "tiny")]
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert [e[1] for e in events] == ["Planned", "Applied"]


def test_without_the_leaderworkerset_api_a_group_is_not_deployed_and_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, events: list[Any]
) -> None:
    fake = _cluster(monkeypatch, TINY)  # ConfigMap, Service, Deployment: no LeaderWorkerSet CRD
    with pytest.raises(kopf.TemporaryError):
        _reconcile(fake, {"accelerator": CPU_GROUP})
    assert fake.status["plan"]["nodes"] == 2  # the plan is written first
    assert fake.kinds() == ["ConfigMap/tiny-config"]  # applied in order up to the workload, which is refused
    deployed = _conditions(fake)["Deployed"]
    message = ("the API server does not serve leaderworkerset.x-k8s.io/v1 LeaderWorkerSet; install the "
               "LeaderWorkerSet controller and its CRD (https://lws.sigs.k8s.io)")
    assert (deployed["status"], deployed["reason"], deployed["message"]) == (
        "False", "LeaderWorkerSetNotInstalled", message)
    assert ("Warning", "LeaderWorkerSetNotInstalled", message) in events


def test_a_plan_the_engine_cannot_serve_is_not_deployed_and_earlier_engines_removed(
    monkeypatch: pytest.MonkeyPatch, events: list[Any]
) -> None:
    """Only a device without a backend is refused now (no catalog accelerator is one: the check is stood in for)."""
    fake = _cluster(monkeypatch, TINY)
    _reconcile(fake)
    events.clear()
    why = "the bundled engine cannot serve device 'tpu': it has backends for cpu, cuda, npu only"
    monkeypatch.setattr(handlers, "servability", lambda result: why)
    _reconcile(fake, {"replicas": 2})
    assert fake.kinds() == []
    assert fake.deleted == ["ConfigMap/tiny-config", "Service/tiny", "Deployment/tiny"]
    assert fake.status["phase"] == "Planned" and fake.status["replicas"] == 0
    deployed = _conditions(fake)["Deployed"]
    assert (deployed["status"], deployed["reason"]) == ("False", "EngineCannotServe")
    assert deployed["message"].startswith(why) and "spec.accelerator.type" in deployed["message"]
    assert [(e[0], e[1]) for e in events] == [("Warning", "EngineCannotServe")]


def test_the_plan_is_written_before_a_required_kind_fails(monkeypatch: pytest.MonkeyPatch, events: list[Any]) -> None:
    fake = _cluster(monkeypatch, TINY, served={"ConfigMap", "Service"})  # no Deployment API (absurd, but required)
    with pytest.raises(kopf.TemporaryError):
        _reconcile(fake)
    assert fake.status["plan"]["totalBlocks"] == 8192
    deployed = _conditions(fake)["Deployed"]
    assert (deployed["status"], deployed["reason"]) == ("False", "DeploymentNotInstalled")
    assert ("Warning", "DeploymentNotInstalled") in [(e[0], e[1]) for e in events]


def test_a_missing_podmonitor_api_is_skipped_with_a_warning(monkeypatch: pytest.MonkeyPatch,
                                                            events: list[Any]) -> None:
    fake = _cluster(monkeypatch, TINY)
    _reconcile(fake, {"monitoring": {"podMonitor": True}})
    assert fake.kinds() == ["ConfigMap/tiny-config", "Deployment/tiny", "Service/tiny"]
    deployed = _conditions(fake)["Deployed"]
    assert deployed["status"] == "True" and deployed["message"].endswith("skipped (API not served): PodMonitor")
    (warning,) = [e for e in events if e[0] == "Warning"]
    assert warning[1] == "PodMonitorNotInstalled" and "Prometheus Operator" in warning[2]


def test_the_admin_secret_is_made_once_and_a_tuned_schedule_survives_a_reconcile(
        monkeypatch: pytest.MonkeyPatch, events: list[Any]) -> None:
    """The engines' admin token is created with the objects and never rewritten; a re-apply renders the tuner's
    schedule (status.tuning.applied), not the plan's, while the tuning problem is the plan's."""
    fake = _cluster(monkeypatch, TINY)
    _reconcile(fake, {"autotune": {"enabled": True}})
    assert fake.created == ["Secret/tiny-admin"]
    token = fake.objects[("Secret", "team-a", "tiny-admin")]["stringData"]["token"]
    assert len(token) >= 32
    from npuserve.operator.status import plan_of
    from npuserve.operator.tuning_schedule import problem_for, problem_key
    from npuserve.planning.api import InferenceService
    isvc = InferenceService.model_validate({**TINY, "spec": {**TINY["spec"], "autotune": {"enabled": True}}})
    key = problem_key(problem_for(isvc, plan_of(fake.status)))  # type: ignore[arg-type]
    fake.custom.write({"tuning": {"phase": "Running", "problem": key,  # type: ignore[attr-defined]
                                  "applied": {"maxBatchSize": 7, "maxPrefillBatchSize": 3,
                                              "scheduleGeneration": 9}}})
    _reconcile(fake, {"autotune": {"enabled": True}})
    assert fake.created == ["Secret/tiny-admin"]  # not made again
    assert fake.objects[("Secret", "team-a", "tiny-admin")]["stringData"]["token"] == token
    config = json.loads(fake.objects[("ConfigMap", "team-a", "tiny-config")]["data"]["config.json"])
    assert config["BackendConfig"]["ScheduleConfig"]["maxBatchSize"] == 7
    assert config["npuserve"]["scheduleGeneration"] == 9  # the tuner's generation, as status.tuning.applied says
    assert fake.status["schedule"]["maxBatchSize"] == 7
    _reconcile(fake, {"autotune": {"enabled": False}})  # off: the plan's schedule again
    config = json.loads(fake.objects[("ConfigMap", "team-a", "tiny-config")]["data"]["config.json"])
    assert config["BackendConfig"]["ScheduleConfig"]["maxBatchSize"] == plan_of(fake.status).schedule.maxBatchSize  # type: ignore[union-attr]
    # past the tuner's 9, so engines running the tuned schedule take the plan's back: 9 + metadata.generation 1
    assert config["npuserve"]["scheduleGeneration"] == 10


def test_the_configmap_follows_status_tuning_applied_from_the_status_now(
        monkeypatch: pytest.MonkeyPatch, events: list[Any]) -> None:
    """The autotune loop writes status.tuning.applied only; reconcile's field handler renders the ConfigMap from the
    status as it is when it runs (a newer applied than the event's wins), at the applied generation."""
    fake = _cluster(monkeypatch, TINY)
    _reconcile(fake, {"autotune": {"enabled": True}})
    from npuserve.operator.status import plan_of
    from npuserve.operator.tuning_schedule import problem_for, problem_key
    from npuserve.planning.api import InferenceService
    isvc = InferenceService.model_validate({**TINY, "spec": {**TINY["spec"], "autotune": {"enabled": True}}})
    key = problem_key(problem_for(isvc, plan_of(fake.status)))  # type: ignore[arg-type]

    def tuned(batch: int, generation: int) -> dict[str, Any]:
        return {"tuning": {"phase": "Running", "problem": key, "applied": {
            "maxBatchSize": batch, "maxPrefillBatchSize": 3, "scheduleGeneration": generation}}}

    fake.custom.write(tuned(7, 11))  # type: ignore[attr-defined]
    event_body = copy.deepcopy(fake.custom.obj)  # type: ignore[attr-defined]
    fake.custom.write(tuned(9, 12))  # type: ignore[attr-defined]  # the loop applied again before the handler ran
    handlers.on_applied_schedule(body=kopf.Body(event_body), logger=LOG, memo=_memo(fake))  # type: ignore[arg-type]
    config = json.loads(fake.objects[("ConfigMap", "team-a", "tiny-config")]["data"]["config.json"])
    assert config["BackendConfig"]["ScheduleConfig"]["maxBatchSize"] == 9
    assert config["npuserve"]["scheduleGeneration"] == 12


def test_readiness_reads_the_plan_from_the_status(monkeypatch: pytest.MonkeyPatch, events: list[Any]) -> None:
    fake = _cluster(monkeypatch, TINY)
    _reconcile(fake)
    # The spec changes behind the operator's back (no reconcile yet): readiness judges against status.plan.
    fake.custom.obj["spec"]["replicas"] = 3  # type: ignore[attr-defined]
    monkeypatch.setattr(fake, "engine_pods", lambda ns, sel: [engine_http.EnginePod("tiny-a", "127.1.0.1", True)])
    monkeypatch.setattr(engine_http, "read_engines", lambda pods: [EngineReport("tiny-a", True, kv_blocks=8192)])
    handlers.update_readiness("tiny", "team-a", LOG, fake)  # type: ignore[arg-type]
    assert fake.status["phase"] == "Ready" and fake.status["observed"] == {"kvBlocksAllocated": 8192}
    assert _conditions(fake)["Ready"]["message"] == "1/1 engine pods ready"
    assert events[-1] == ("Normal", "Ready", "1/1 engine pods ready")


def test_a_group_pods_change_or_end_updates_readiness(monkeypatch: pytest.MonkeyPatch, events: list[Any]) -> None:
    """A LeaderWorkerSet's status does not follow its workers' readiness: a group's pod events update readiness,
    its going included (the group is down); the workload's own deletion does not."""
    fake = _cluster(monkeypatch, TINY)
    _reconcile(fake)
    asked: list[tuple[str, str]] = []
    monkeypatch.setattr(handlers, "update_readiness", lambda name, ns, logger, client: asked.append((name, ns)))
    labels = {"npuserve.io/inferenceservice": "tiny", "leaderworkerset.sigs.k8s.io/worker-index": "1"}
    pod = kopf.Body({"metadata": {"name": "tiny-0-1", "namespace": "team-a", "labels": labels}})
    lws = kopf.Body({"metadata": {"name": "tiny", "namespace": "team-a", "labels": {
        "npuserve.io/inferenceservice": "tiny"}}})
    for kind in ("MODIFIED", "DELETED"):
        handlers.on_group_pod(body=pod, type=kind, logger=LOG, memo=_memo(fake))  # type: ignore[arg-type]
    handlers.on_engine_leaderworkerset(body=lws, type="DELETED", logger=LOG, memo=_memo(fake))  # type: ignore[arg-type]
    assert asked == [("tiny", "team-a"), ("tiny", "team-a")]


def test_a_readiness_update_that_read_the_pods_first_never_writes_last(monkeypatch: pytest.MonkeyPatch,
                                                                      events: list[Any]) -> None:
    """Two pods of a group change at once (kopf runs their handlers concurrently): the update that read the worker
    not ready yet must not land after the one that read it ready."""
    import threading

    fake = _cluster(monkeypatch, TINY, served={"ConfigMap", "Service", "Deployment", "LeaderWorkerSet"})
    _reconcile(fake, {"accelerator": CPU_GROUP})
    leader = engine_http.EnginePod("tiny-0", "127.1.0.1", True, group="0")
    stale = [leader, engine_http.EnginePod("tiny-0-1", "127.1.0.2", False, serves_http=False, group="0")]
    fresh = [leader, engine_http.EnginePod("tiny-0-1", "127.1.0.2", True, serves_http=False, group="0")]
    reads = iter([stale, fresh])
    monkeypatch.setattr(fake, "engine_pods", lambda ns, sel: next(reads))
    second_wrote = threading.Event()

    def read_engines(pods: list[engine_http.EnginePod]) -> list[EngineReport]:
        if pods is stale:  # the first update is slow to read /info: the second one's write may come meanwhile
            second_wrote.wait(timeout=1.0)
        return [EngineReport(p.name, p.ready, kv_blocks=64 if p.serves_http else None, group=p.group) for p in pods]

    monkeypatch.setattr(engine_http, "read_engines", read_engines)
    update = fake.update_status

    def update_status(*args: Any, **kwargs: Any) -> Any:
        out = update(*args, **kwargs)
        if threading.current_thread().name == "second":
            second_wrote.set()
        return out

    monkeypatch.setattr(fake, "update_status", update_status)
    first = threading.Thread(target=handlers.update_readiness, args=("tiny", "team-a", LOG, fake), name="first")
    second = threading.Thread(target=handlers.update_readiness, args=("tiny", "team-a", LOG, fake), name="second")
    first.start()
    second.start()
    first.join()
    second.join()
    assert fake.status["replicas"] == 1 and fake.status["phase"] == "Ready", _conditions(fake)["Ready"]


def test_a_crashed_engine_is_on_the_ready_condition_with_one_warning_event(monkeypatch: pytest.MonkeyPatch,
                                                                          events: list[Any]) -> None:
    fake = _cluster(monkeypatch, TINY)
    _reconcile(fake)
    fatal = Termination(1, "Error", "no engine step has completed for 301.0 s (npuserve.stepTimeoutSeconds 300): ...")
    monkeypatch.setattr(fake, "engine_pods", lambda ns, sel: [engine_http.EnginePod("tiny-a", "127.1.0.1", False)])
    monkeypatch.setattr(engine_http, "read_engines", lambda pods: [EngineReport("tiny-a", False, restarts=1,
                                                                         terminated=fatal)])
    handlers.update_readiness("tiny", "team-a", LOG, fake)  # type: ignore[arg-type]
    ready = _conditions(fake)["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "EngineCrashed")
    assert "engine pod tiny-a exited with code 1 (Error), restarted 1 time(s): no engine step has completed" in (
        ready["message"])
    assert [e[:2] for e in events if e[0] == "Warning"] == [("Warning", "EngineCrashed")]
    assert "no engine step has completed" in events[-1][2]
    handlers.update_readiness("tiny", "team-a", LOG, fake)  # type: ignore[arg-type]  # the next workload event
    assert [e[1] for e in events].count("EngineCrashed") == 1  # one event per change, not one per workload event
    monkeypatch.setattr(engine_http, "read_engines", lambda pods: [EngineReport("tiny-a", False, restarts=4,
                                                                         terminated=fatal)])
    handlers.update_readiness("tiny", "team-a", LOG, fake)  # type: ignore[arg-type]
    assert _conditions(fake)["Ready"]["reason"] == "EngineCrashLooping"
    assert events[-1][:2] == ("Warning", "EngineCrashLooping")


# --- how the operator starts: `npuserve operator` loads the handlers by name and hands them its Prometheus --------


def test_npuserve_operator_loads_the_handlers_by_name_and_passes_prometheus_in_kopfs_memo(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from npuserve import cli
    from npuserve.operator import operator_cli

    ran: dict[str, Any] = {}
    monkeypatch.setattr(kopf, "run", lambda **kwargs: ran.update(kwargs))
    assert cli.main(["operator", "--prometheus-url", "http://prometheus:9090", "-n", "team-a"]) == 0
    assert handlers.__name__ == operator_cli.HANDLERS_MODULE  # the module kopf's registry gets its handlers from
    assert ran["memo"] == {"prometheus_url": "http://prometheus:9090"}
    assert (ran["standalone"], ran["clusterwide"], ran["namespaces"]) == (True, False, ["team-a"])


@pytest.mark.parametrize(("memo_url", "env_url", "expected"), [
    ("http://cli:9090", "http://env:9090", "http://cli:9090"),  # npuserve operator --prometheus-url
    (None, "http://env:9090", "http://env:9090"),  # kopf run -m npuserve.operator.handlers: an empty memo
    (None, None, None),  # nowhere: the loop reports autotune and tunes nothing
])
def test_the_startup_handler_takes_prometheus_from_the_memo_then_the_environment(
        monkeypatch: pytest.MonkeyPatch, memo_url: str | None, env_url: str | None, expected: str | None) -> None:
    started: list[tuple[object, str | None]] = []
    client = object()

    class Loop:
        def __init__(self, kube: object, prometheus_url: str | None) -> None:
            started.append((kube, prometheus_url))

        def start(self) -> None:
            pass

    monkeypatch.setattr(handlers, "AutotuneLoop", Loop)
    monkeypatch.setattr(kube, "Kube", lambda: client)
    if env_url is None:
        monkeypatch.delenv("NPUSERVE_PROMETHEUS_URL", raising=False)
    else:
        monkeypatch.setenv("NPUSERVE_PROMETHEUS_URL", env_url)
    memo = kopf.Memo() if memo_url is None else kopf.Memo(prometheus_url=memo_url)
    handlers.configure(settings=kopf.OperatorSettings(), memo=memo)
    assert started == [(client, expected)]
    # The handlers find the client and the loop in the memo kopf copies to every object's.
    assert handlers.kube_of(memo) is client and isinstance(handlers.autotune_loop_of(memo), Loop)


def test_the_handlers_tell_the_autotune_loop_from_the_memo(monkeypatch: pytest.MonkeyPatch,
                                                           events: list[Any]) -> None:
    """The event handler tracks an InferenceService, the workload handler pokes it, with the memo's loop; without
    one (before start-up), neither fails."""
    fake = _cluster(monkeypatch, TINY)
    _reconcile(fake)
    calls: list[tuple[str, ...]] = []

    class Loop:
        def track(self, namespace: str, name: str, wanted: bool, signature: object) -> None:
            calls.append(("track", namespace, name, str(wanted)))

        def poke(self, namespace: str, name: str) -> None:
            calls.append(("poke", namespace, name))

    isvc = kopf.Body(copy.deepcopy(fake.custom.obj))  # type: ignore[attr-defined]
    workload = kopf.Body({"metadata": {"namespace": "team-a", "name": "tiny",
                                       "labels": {"npuserve.io/inferenceservice": "tiny"}}})
    monkeypatch.setattr(fake, "engine_pods", lambda ns, sel: [])
    monkeypatch.setattr(engine_http, "read_engines", lambda pods: [])
    for memo in (_memo(fake), kopf.Memo({**_memo(fake), handlers.MEMO_AUTOTUNE_LOOP: Loop()})):
        handlers.track_autotune(body=isvc, type="ADDED", memo=memo)
        handlers.on_engine_deployment(body=workload, type="MODIFIED", logger=LOG, memo=memo)  # type: ignore[arg-type]
    assert calls == [("track", "team-a", "tiny", "False"), ("poke", "team-a", "tiny")]
