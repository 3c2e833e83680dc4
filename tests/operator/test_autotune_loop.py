"""The autotune driver's pure pieces: how a Prometheus window becomes the step's measurement, how the step's status
is merged into the status as it is at write time (another writer, readiness, may have written meanwhile), and which
load Jobs an earlier leader left behind."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, cast
from urllib.parse import parse_qs

import httpx
from test_autotune import DECODE_SLO, make_isvc, ready_status

from npuserve.operator import autotune as at
from npuserve.operator import autotune_loop, engine_http
from npuserve.operator import autotune_types as tt
from npuserve.operator import look_timing as lt
from npuserve.operator.autotune_loop import AutotuneLoop, measurement_of, merge_status, outside_signature
from npuserve.operator.autotune_types import GenerationsRun
from npuserve.operator.kube import AutotuneKube, Kube
from npuserve.operator.prometheus import (
    Empty,
    LatencyReading,
    PrometheusClient,
    Selection,
    Selections,
    Unreachable,
    WindowReading,
    grouped_window_queries,
)
from npuserve.operator.status_writer import StatusConflict, StatusUpdate
from npuserve.planning.planner import plan as plan_spec


def reading(finished: float, in_flight: float = 12.0, pods: float | Empty = 2.0) -> WindowReading:
    finished = float(finished)  # Prometheus answers floats; a figure is a float, Empty or NotANumber
    lat = LatencyReading(mean=100.0, p90=150.0, p99=180.0, samples=finished)
    return WindowReading(selection=Selection("ns", "tune"), start=0.0, end=20.0, window_s=20, ttft_ms=lat,
                         tpot_ms=LatencyReading(mean=40.0, p90=50.0, p99=60.0, samples=finished),
                         e2e_mean_ms=2000.0, output_tokens_per_s=300.0, requests_finished=finished, errors=0.0,
                         aborts=0.0, preemptions=0.0, kv_usage_max=0.5, in_flight_sum=in_flight,
                         pods_reporting=pods)


def test_a_window_becomes_metrics_with_the_per_pod_concurrency() -> None:
    m = measurement_of(reading(30))
    assert m.metrics is not None and m.inconclusive is None and not m.unreachable
    assert (m.metrics.tpotMs.mean, m.metrics.samples, m.metrics.outputTokensPerSecond) == (40.0, 30, 300.0)
    assert m.metrics.inFlightPerPod == 6.0


def test_an_empty_window_is_inconclusive_and_an_unreachable_prometheus_says_so() -> None:
    empty = measurement_of(reading(0))
    assert empty.metrics is None and not empty.unreachable and "no requests finished" in (empty.inconclusive or "")
    assert empty.reason == "NoRequestFinished"
    down = measurement_of(Unreachable("http://prom:9090", "ConnectError"))
    assert down.unreachable and down.metrics is None and down.reason == "PrometheusUnreachable"
    assert (down.inconclusive or "").startswith("Prometheus unreachable: ConnectError")
    no_pods = measurement_of(reading(30, in_flight=12.0, pods=0.0))
    assert no_pods.metrics is not None and no_pods.metrics.inFlightPerPod == 0.0
    missing = measurement_of(reading(30, in_flight=12.0, pods=Empty("count")))
    assert missing.metrics is not None and missing.metrics.inFlightPerPod is None


def test_a_window_carries_the_schedule_generations_the_pods_ran_as_facts() -> None:
    m = measurement_of(replace(reading(30), schedule_generation_min=6.0, schedule_generation_max=7.0,
                               schedule_generation_pods=2.0))
    assert m.generations == GenerationsRun(lowest=6, highest=7, pods=2)
    none = measurement_of(reading(30))  # the gauge absent from Prometheus
    assert none.generations == GenerationsRun(lowest=None, highest=None, pods=0)


def _cond(type_: str, status: str, reason: str, t: str = "t0") -> dict[str, Any]:
    return {"type": type_, "status": status, "reason": reason, "message": reason, "lastTransitionTime": t}


def test_merge_takes_what_autotune_owns_and_keeps_what_readiness_wrote() -> None:
    now = {"phase": "Ready", "replicas": 2, "plan": {"p": 1},
           "observed": {"kvBlocksAllocated": 64, "tpotMs": 1.0},
           "capacity": {"phase": "Measured"},
           "conditions": [_cond("Ready", "True", "EnginesReady"), _cond("Deployed", "True", "Applied"),
                          _cond("Tuning", "False", "Converged")]}
    computed = {"phase": "Tuning", "replicas": 1, "plan": {"p": 0},
                "tuning": {"phase": "Running", "trial": 3}, "observed": {"tpotMs": 42.0},
                "schedule": {"maxBatchSize": 30},
                "conditions": [_cond("Ready", "False", "Stale"), _cond("Tuning", "True", "Measuring", "t1"),
                               _cond("SLOMet", "True", "SLOMet", "t1")]}
    merged = merge_status(now, computed)
    assert merged["tuning"] == {"phase": "Running", "trial": 3} and merged["schedule"] == {"maxBatchSize": 30}
    assert merged["observed"] == {"tpotMs": 42.0, "kvBlocksAllocated": 64}  # readiness's blocks survive
    assert "capacity" not in merged  # the step dropped it (a new problem): so does the write
    assert (merged["replicas"], merged["plan"]) == (2, {"p": 1})  # not autotune's to write
    conditions = {c["type"]: c for c in merged["conditions"]}
    assert conditions["Ready"]["reason"] == "EnginesReady"  # a stale copy of another's condition is not written
    assert (conditions["Tuning"]["status"], conditions["Tuning"]["reason"]) == ("True", "Measuring")
    assert conditions["SLOMet"]["status"] == "True" and conditions["Deployed"]["reason"] == "Applied"
    assert merged["phase"] == "Tuning"
    # Before the loop has observed anything (its computed status has no `observed`), readiness's blocks stay too.
    early = merge_status(now, {k: v for k, v in computed.items() if k != "observed"})
    assert early["observed"] == {"kvBlocksAllocated": 64}


def test_merge_moves_the_phase_only_between_ready_and_tuning() -> None:
    computed = {"phase": "Tuning", "conditions": []}
    assert merge_status({"phase": "Deploying"}, computed)["phase"] == "Deploying"  # a pod went: readiness's call
    assert merge_status({"phase": "Ready"}, computed)["phase"] == "Tuning"
    assert merge_status({"phase": "Tuning"}, {"phase": "Ready"})["phase"] == "Ready"
    assert merge_status({"phase": "Failed"}, {"phase": "Ready"})["phase"] == "Failed"


# --- the driver: when it looks, and one Prometheus query per figure for every window that ends together ----------


class FakeCluster:
    """The driver's Kubernetes calls (`Kube`'s and `AutotuneKube`'s) over InferenceServices held in a dict; counts
    the reads and writes."""

    api_client = None

    def __init__(self, objs: list[dict[str, Any]]) -> None:
        self.objs = {(o["metadata"]["namespace"], o["metadata"]["name"]): o for o in objs}
        self.gets = 0
        self.writes = 0
        self.events: list[tuple[str, str, str]] = []

    def get_inference_service(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.gets += 1
        obj = self.objs.get((namespace, name))
        return copy.deepcopy(obj) if obj is not None else None

    def update_status(self, namespace: str, name: str, change: Callable[[Mapping[str, Any]], Any],
                      read: Mapping[str, Any] | None = None) -> StatusUpdate | None:
        obj = read if read is not None else self.get_inference_service(namespace, name)
        assert obj is not None
        old, new = obj.get("status") or {}, change(obj)
        if new != old:
            self.writes += 1
            self.objs[(namespace, name)]["status"] = copy.deepcopy(new)
        return StatusUpdate(old, new, 1)

    def pods(self, namespace: str, selector: str) -> list[tt.PodState]:
        return [tt.PodState(f"{selector}-0", "uid-0", "10.0.0.1", True, 0)]

    def job_phase(self, namespace: str, name: str) -> tt.JobPhase:
        return "active"

    def post_event(self, obj: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        self.events.append((obj["metadata"]["name"], reason, message))

    def admin_token(self, namespace: str, secret: str, key: str) -> str | None:
        return None  # the schedule reaches the engines by the ConfigMap only (a warning event says so)


NAMES = ("alpha", "beta", "gamma")
T0 = 1_700_000_001.0
# One InferenceService's figures as Prometheus answers them (TPOT well under the 25 ms bound).
FIGURES = {"ttft_ms.mean": "120", "ttft_ms.p90": "200", "ttft_ms.p99": "300", "ttft_ms.samples": "100",
           "tpot_ms.mean": "10", "tpot_ms.p90": "12", "tpot_ms.p99": "14", "tpot_ms.samples": "100",
           "e2e_mean_ms": "2000", "output_tokens_per_s": "512", "requests_finished": "100", "errors": "0",
           "aborts": "0", "preemptions": "0", "kv_usage_max": "0.5", "in_flight_sum": "30", "pods_reporting": "1",
           # the trial's schedule generation: past the plan's own (metadata.generation 1)
           "schedule_generation_min": "2", "schedule_generation_max": "2", "schedule_generation_pods": "1"}


def tuned(name: str, mode: str = "online") -> dict[str, Any]:
    isvc = make_isvc(DECODE_SLO, mode=mode)
    data = isvc.model_dump(mode="json", exclude_none=True)
    data["metadata"] = {**data["metadata"], "name": name, "namespace": "default"}
    status = ready_status(plan_spec(isvc.spec)) | {"selector": name}
    return {**data, "status": status}


def driver(objs: list[dict[str, Any]], asked: list[str]) -> tuple[AutotuneLoop, FakeCluster]:
    """The real driver over FakeCluster and a Prometheus that knows only the grouped queries of NAMES' windows."""
    cluster = FakeCluster(objs)
    loop = AutotuneLoop(cast(Kube, cluster), None)
    loop.calls = cast(AutotuneKube, cluster)
    group = Selections(tuple(Selection("default", n) for n in NAMES))

    def answer(request: httpx.Request) -> httpx.Response:
        params = parse_qs(request.content.decode())
        query, at_ = params["query"][0], float(params["time"][0])
        asked.append(query)
        window_s = int(query.split("[", 1)[1].split("s]", 1)[0])
        figure = {q: f for f, q in grouped_window_queries(group, window_s).items()}[query]  # else: KeyError
        series = [{"metric": {"namespace": "default", "npuserve_io_inferenceservice": n},
                   "value": [at_, FIGURES[figure]]} for n in NAMES]
        return httpx.Response(200, json={"status": "success", "data": {"resultType": "vector", "result": series}})

    loop.prometheus = PrometheusClient("http://prometheus.test:9090", transport=httpx.MockTransport(answer))
    for o in objs:
        loop.track("default", o["metadata"]["name"], True, outside_signature(o))
    return loop, cluster


def test_windows_that_end_together_are_read_in_one_query_per_figure_and_each_looked_at_when_due() -> None:
    asked: list[str] = []
    loop, cluster = driver([tuned(n) for n in NAMES], asked)
    keys = [("default", n) for n in NAMES]
    assert all(loop.next_look[k] == 0.0 for k in keys)  # new: due at once
    opened = loop.look(keys, T0)
    assert set(opened) == set(keys) and all(a.apply is not None for a in opened.values())
    ends = {at.parse_rfc3339(cluster.objs[k]["status"]["tuning"]["current"]["measureUntil"]) for k in keys}
    assert ends == {math.ceil((T0 + 5 + 20) / 5) * 5}  # settle 5 s, window 20 s, ending on the 5 s grid: together
    (end,) = ends
    assert all(loop.next_look[k] == end for k in keys)  # nothing to do before the window's end
    assert cluster.gets == 3 and asked == []

    loop.look(keys, end + 0.5)
    assert len(asked) == len(FIGURES)  # one query per figure for the three windows, not one per window
    for k in keys:
        (entry,) = cluster.objs[k]["status"]["tuning"]["history"]
        assert entry["window"] == f"{at.rfc3339(end - 20)}/{at.rfc3339(end)}" and entry["metrics"]["samples"] == 100
        assert loop.next_look[k] == at.parse_rfc3339(cluster.objs[k]["status"]["tuning"]["current"]["measureUntil"])
    assert cluster.gets == 6  # one read per InferenceService per look: the status write reuses it


def test_the_loops_own_writes_do_not_wake_it_and_others_do() -> None:
    obj = tuned("alpha")
    loop, _ = driver([obj], [])
    key = ("default", "alpha")
    loop.next_look[key] = T0 + 100
    own = copy.deepcopy(obj)
    own["status"] |= {"tuning": {"phase": "Running"}, "phase": "Tuning", "observed": {"tpotMs": 1.0}}
    own["status"]["conditions"] = [*own["status"]["conditions"], _cond("Tuning", "True", "Measuring")]
    loop.track("default", "alpha", True, outside_signature(own))
    assert loop.next_look[key] == T0 + 100
    for changed in (lambda o: o["metadata"].update(generation=2),
                    lambda o: o["status"]["conditions"][0].update(status="False", reason="EnginesNotReady"),
                    lambda o: o["status"].update(replicas=2)):
        other = copy.deepcopy(own)
        changed(other)
        loop.next_look[key] = T0 + 100
        loop.track("default", "alpha", True, outside_signature(other))
        assert loop.next_look[key] == 0.0
    loop.next_look[key] = T0 + 100
    loop.poke("default", "alpha")  # its engine workload changed
    assert loop.next_look[key] == 0.0
    loop.track("default", "alpha", False)
    loop.poke("default", "alpha")
    assert key not in loop.next_look


def test_next_look() -> None:
    isvc = make_isvc(DECODE_SLO)
    benchmark = make_isvc(DECODE_SLO, mode="benchmark")
    now = T0
    assert lt.next_look(isvc, {}, now) == now + lt.RECHECK_S  # no tuning yet: waiting for engines or Prometheus
    current = {"kind": "trial", "trial": 0, "schedule": {"maxBatchSize": 8}, "appliedAt": at.rfc3339(now),
               "measureFrom": at.rfc3339(now + 20), "measureUntil": at.rfc3339(now + 40), "pods": []}
    trial = {"tuning": {"phase": "Running", "problem": "p", "current": current}}
    assert lt.next_look(isvc, trial, now) == now + 40  # the window's end
    with_job = copy.deepcopy(trial)
    with_job["tuning"]["current"]["job"] = "tiny-b1t0-00001"
    assert lt.next_look(benchmark, with_job, now) == now + lt.RECHECK_S  # the Job is watched for failure
    waiting = copy.deepcopy(trial)
    waiting["tuning"]["current"]["inconclusiveReason"] = "PrometheusUnreachable"
    assert lt.next_look(isvc, waiting, now) == now + lt.RECHECK_S
    far = copy.deepcopy(trial)
    far["tuning"]["current"]["measureUntil"] = at.rfc3339(now + 3600)
    assert lt.next_look(isvc, far, now) == now + lt.IDLE_LOOK_S
    converged = {"tuning": {"phase": "Converged", "problem": "p", "lastCheckAt": at.rfc3339(1_700_000_010.0)}}
    assert lt.next_look(isvc, converged, 1_700_000_011.0) == 1_700_000_030.0  # last check + 20 s window, on the grid
    converged["tuning"]["lastCheckAt"] = at.rfc3339(1_700_000_012.0)
    assert lt.next_look(isvc, converged, 1_700_000_013.0) == 1_700_000_035.0
    assert lt.window_due(isvc, converged, 1_700_000_034.9) is None
    assert lt.window_due(isvc, converged, 1_700_000_035.2) == tt.WindowRequest(1_700_000_015.0, 1_700_000_035.0, None)


# --- record, then act: the status names the trial before the engines and the Job see it ---------------------------


class ActingCluster(FakeCluster):
    """FakeCluster with the acts counted: the schedule PUTs (through `engine_http.put_schedule`), the Jobs created, and
    status writes that can be made to fail (`failing_writes` conflicts exhausted) or an admin-token read that raises."""

    def __init__(self, objs: list[dict[str, Any]]) -> None:
        super().__init__(objs)
        self.created: list[str] = []
        self.manifests: list[dict[str, Any]] = []
        self.deleted: list[str] = []
        self.failing_writes = 0
        self.failing_token_reads = 0

    def update_status(self, namespace: str, name: str, change: Callable[[Mapping[str, Any]], Any],
                      read: Mapping[str, Any] | None = None) -> StatusUpdate | None:
        if self.failing_writes:
            self.failing_writes -= 1
            raise StatusConflict(f"{namespace}/{name}: the status write conflicted 5 times in a row")
        return super().update_status(namespace, name, change, read)

    def admin_token(self, namespace: str, secret: str, key: str) -> str | None:
        if self.failing_token_reads:
            self.failing_token_reads -= 1
            raise RuntimeError("the API server went away")
        return "token"

    def create_if_absent(self, manifest: dict[str, Any]) -> bool:
        self.created.append(manifest["metadata"]["name"])
        self.manifests.append(manifest)
        return True

    def jobs(self, namespace: str, selector: str) -> list[tuple[str, str | None]]:
        return []

    def delete_job(self, namespace: str, name: str) -> None:
        self.deleted.append(name)


def acting_driver(obj: dict[str, Any], monkeypatch: Any) -> tuple[AutotuneLoop, ActingCluster, list[int]]:
    """The real driver over one benchmark-mode InferenceService; the schedule generations PUT to the engines."""
    cluster = ActingCluster([obj])
    puts: list[int] = []

    def put_schedule(pods: list[tt.PodState], token: str, knobs: Mapping[str, Any]) -> dict[str, str]:
        puts.append(knobs["scheduleGeneration"])
        return {}

    monkeypatch.setattr(engine_http, "put_schedule", put_schedule)
    return fresh_leader(cluster), cluster, puts


def fresh_leader(cluster: ActingCluster) -> AutotuneLoop:
    loop = AutotuneLoop(cast(Kube, cluster), None)
    loop.calls = cast(AutotuneKube, cluster)
    loop.prometheus = PrometheusClient("http://prometheus.test:9090",
                                       transport=httpx.MockTransport(lambda r: httpx.Response(500)))
    loop.track("default", "alpha", True)
    return loop


def test_a_groups_leader_alone_takes_the_schedule_and_the_load(monkeypatch: Any) -> None:
    """A LeaderWorkerSet group is one engine: PUT /admin/schedule goes to its leader (a worker serves no admin API),
    and the benchmark Job's users go to a leader, whatever the pods' names sort as."""
    cluster = ActingCluster([tuned("alpha", mode="benchmark")])
    worker = tt.PodState("alpha-0-1", "uid-w", "10.0.0.2", True, 0, leader=False)  # sorts before its leader
    leader = tt.PodState("alpha-1", "uid-l", "10.0.0.3", True, 0)
    cluster.pods = lambda namespace, selector: [worker, leader]  # type: ignore[method-assign]
    put_to: list[list[str]] = []

    def put_schedule(pods: list[tt.PodState], token: str, knobs: Mapping[str, Any]) -> dict[str, str]:
        put_to.append([p.name for p in pods])
        return {}

    monkeypatch.setattr(engine_http, "put_schedule", put_schedule)
    loop = fresh_leader(cluster)
    taken = loop.look([("default", "alpha")], T0)
    assert taken[("default", "alpha")].create_job is not None
    assert put_to == [["alpha-1"]]
    (job,) = cluster.manifests
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--base-url") + 1] == "http://10.0.0.3:8000"
    assert cluster.objs[("default", "alpha")]["status"]["tuning"]["current"]["target"] == "alpha-1"


def test_the_replica_limit_is_asked_for_groups_of_the_plans_pods(monkeypatch: Any) -> None:
    """With spec.capacity, the look asks how many replicas the nodes hold: replicas of `nodes` pods of cardsPerPod
    (here CPUs: the pod's cores), one pod per node (capacity.group_limit over kube's pods_per_node)."""
    isvc = make_isvc(DECODE_SLO, capacity={"targetConcurrentUsers": 100})
    isvc.spec.accelerator = isvc.spec.accelerator.model_copy(update={"cards": 2, "cardsPerNode": 1})
    plan = plan_spec(isvc.spec)
    data = isvc.model_dump(mode="json", exclude_none=True)
    data["metadata"] = {**data["metadata"], "name": "alpha", "namespace": "default"}
    cluster = ActingCluster([{**data, "status": ready_status(plan) | {"selector": "alpha"}}])
    asked: list[tuple[str | None, float]] = []

    def pods_per_node(resource: str | None, per_pod: float) -> list[int]:
        asked.append((resource, per_pod))
        return [4, 0, 1]  # a pod of each replica per node: 1 replica of 2 pods (5 // 2 would say 2)

    cluster.pods_per_node = pods_per_node  # type: ignore[attr-defined]
    groups: list[tuple[list[int], int]] = []
    real = autotune_loop.group_limit
    monkeypatch.setattr(autotune_loop, "group_limit", lambda per_node, nodes: groups.append((per_node, nodes))
                        or real(per_node, nodes))
    monkeypatch.setattr(engine_http, "put_schedule", lambda pods, token, knobs: {})
    fresh_leader(cluster).look([("default", "alpha")], T0)
    assert asked == [(None, 2.0)]  # tiny-cpu.yaml: spec.engine.cpu 2 per pod
    assert groups == [([4, 0, 1], 2)]  # two pods per replica


def test_a_failed_status_write_applies_nothing_and_the_next_look_opens_the_trial(monkeypatch: Any) -> None:
    loop, cluster, puts = acting_driver(tuned("alpha", mode="benchmark"), monkeypatch)
    key = ("default", "alpha")
    cluster.failing_writes = 1
    assert loop.look([key], T0) == {}  # the look failed at the write
    assert puts == [] and cluster.created == []  # nothing the status does not name reached the engines or the Jobs
    assert "tuning" not in cluster.objs[key]["status"]
    assert loop.next_look[key] == T0 + lt.RECHECK_S  # looked at again soon

    taken = loop.look([key], T0 + lt.RECHECK_S)
    assert taken[key].apply is not None and taken[key].create_job is not None
    tuning = cluster.objs[key]["status"]["tuning"]
    assert puts == [tuning["applied"]["scheduleGeneration"]] == [2]  # the generation the status names
    assert cluster.created == [tuning["current"]["job"]]
    loop.look([key], T0 + 2 * lt.RECHECK_S)  # the trial runs on: nothing is applied or created again
    assert len(puts) == 1 and len(cluster.created) == 1


def test_what_a_written_status_names_and_was_not_carried_out_is_carried_out_by_the_next_look(
        monkeypatch: Any) -> None:
    loop, cluster, puts = acting_driver(tuned("alpha", mode="benchmark"), monkeypatch)
    key = ("default", "alpha")
    cluster.failing_token_reads = 1  # the acts after the write raise (as a leader dying there leaves them undone)
    assert loop.look([key], T0) == {}
    tuning = cluster.objs[key]["status"]["tuning"]
    job, generation = tuning["current"]["job"], tuning["applied"]["scheduleGeneration"]
    assert puts == [] and cluster.created == []

    loop.look([key], T0 + lt.RECHECK_S)  # the same trial, now on the engines with its Job
    assert cluster.objs[key]["status"]["tuning"]["current"]["job"] == job
    assert puts == [generation] and cluster.created == [job]
    successor = fresh_leader(cluster)  # a new leader carries the recorded intent out once (409s on the engines)
    successor.look([key], T0 + 2 * lt.RECHECK_S)
    successor.look([key], T0 + 3 * lt.RECHECK_S)
    assert puts == [generation] * 2 and cluster.created == [job] * 2


class FakeJobs:
    """AutotuneKube's Job calls: the Jobs a label selector finds (name, controlling owner uid), and deletions."""

    def __init__(self, jobs: list[tuple[str, str | None]]) -> None:
        self.listed: list[tuple[str, str]] = []
        self.deleted: list[tuple[str, str]] = []
        self._jobs = jobs

    def jobs(self, namespace: str, selector: str) -> list[tuple[str, str | None]]:
        self.listed.append((namespace, selector))
        return list(self._jobs)

    def delete_job(self, namespace: str, name: str) -> None:
        self.deleted.append((namespace, name))


def _loop_over(jobs: FakeJobs) -> AutotuneLoop:
    loop = AutotuneLoop.__new__(AutotuneLoop)  # no API client: only the Job calls are used
    loop.calls = jobs  # type: ignore[assignment]
    return loop


def test_a_load_job_no_open_trial_names_is_deleted_after_the_status_names_the_new_one() -> None:
    """A leader died between creating trial 3's Job and writing the status; its successor opened trial 3 again."""
    obj = {"metadata": {"namespace": "ns", "name": "tune", "uid": "u1"}}
    jobs = FakeJobs([("tune-b0t3-00100", "u1"), ("tune-b0t3-00130", "u1"), ("tune-b0t2-00050", "u1"),
                     ("tune-b0t3-00099", "someone-else"), ("tune-b0t3-00098", None)])
    status = {"tuning": {"current": {"trial": 3, "job": "tune-b0t3-00130"}}}
    deleted = _loop_over(jobs).delete_orphan_jobs(obj, status)
    assert jobs.listed == [("ns", "npuserve.io/inferenceservice=tune,app.kubernetes.io/component=loadgen")]
    assert deleted == ["tune-b0t2-00050", "tune-b0t3-00100"]  # another owner's Jobs stay
    assert jobs.deleted == [("ns", "tune-b0t2-00050"), ("ns", "tune-b0t3-00100")]


def test_with_no_open_trial_every_load_job_of_the_service_goes_and_the_named_one_stays() -> None:
    obj = {"metadata": {"namespace": "ns", "name": "tune", "uid": "u1"}}
    jobs = FakeJobs([("tune-b0t3-00130", "u1")])
    assert _loop_over(jobs).delete_orphan_jobs(obj, {"tuning": {"current": {"job": "tune-b0t3-00130"}}}) == []
    assert _loop_over(jobs).delete_orphan_jobs(obj, {"tuning": {}}) == ["tune-b0t3-00130"]
    assert _loop_over(jobs).delete_orphan_jobs(obj, {}) == ["tune-b0t3-00130"]


def test_the_selector_is_the_one_the_bench_job_carries() -> None:
    from isvc_helpers import REPO, load_yaml

    from npuserve.operator.render import render_bench_job
    from npuserve.planning.api import InferenceService

    isvc = InferenceService.model_validate(load_yaml(REPO / "examples" / "demo.yaml"))
    labels = render_bench_job(isvc, name="j", target_ip="10.0.0.1", concurrency=2, duration_s=10)["metadata"]["labels"]
    jobs = FakeJobs([])
    _loop_over(jobs).delete_orphan_jobs({"metadata": {"name": isvc.metadata.name, "namespace": "ns"}}, {})
    (_, selector), = jobs.listed
    assert all(labels[k] == v for k, v in (pair.split("=") for pair in selector.split(",")))


def test_the_job_the_driver_creates_from_the_status_is_the_job_the_trial_opened(monkeypatch: Any) -> None:
    """One definition of a trial's Job (`tuning_schedule.trial_job`): what `advance` reports and what the driver
    creates from the written status are the same manifest."""
    loop, cluster, _ = acting_driver(tuned("alpha", mode="benchmark"), monkeypatch)
    key = ("default", "alpha")
    taken = loop.look([key], T0)
    assert taken[key].create_job is not None
    assert cluster.manifests == [taken[key].create_job]
