"""The autotune driver's pure pieces: how a Prometheus window becomes the step's measurement, how the step's status
is merged into the status as it is at write time (another writer, readiness, may have written meanwhile), and which
load Jobs an earlier leader left behind."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from npuserve.operator.autotune import GenerationsRun
from npuserve.operator.autotune_loop import AutotuneLoop, measurement_of, merge_status
from npuserve.operator.prometheus import Empty, LatencyReading, Selection, Unreachable, WindowReading


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


def test_merge_moves_the_phase_only_between_ready_and_tuning() -> None:
    computed = {"phase": "Tuning", "conditions": []}
    assert merge_status({"phase": "Deploying"}, computed)["phase"] == "Deploying"  # a pod went: readiness's call
    assert merge_status({"phase": "Ready"}, computed)["phase"] == "Tuning"
    assert merge_status({"phase": "Tuning"}, {"phase": "Ready"})["phase"] == "Ready"
    assert merge_status({"phase": "Failed"}, {"phase": "Ready"})["phase"] == "Failed"


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

    from npuserve.operator.api import InferenceService
    from npuserve.operator.render import render_bench_job

    isvc = InferenceService.model_validate(load_yaml(REPO / "examples" / "demo.yaml"))
    labels = render_bench_job(isvc, name="j", target_ip="10.0.0.1", concurrency=2, duration_s=10)["metadata"]["labels"]
    jobs = FakeJobs([])
    _loop_over(jobs).delete_orphan_jobs({"metadata": {"name": isvc.metadata.name, "namespace": "ns"}}, {})
    (_, selector), = jobs.listed
    assert all(labels[k] == v for k, v in (pair.split("=") for pair in selector.split(",")))
