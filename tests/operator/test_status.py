"""The operator's pure status logic: conditions keep their transition time, phase and readiness follow the pods,
and the engines' real KV blocks reach the status."""

from __future__ import annotations

from npuserve.operator.api import InferenceService
from npuserve.operator.planner import plan
from npuserve.operator.status import (
    EngineReport,
    plan_failed_status,
    planned_status,
    readiness_status,
    set_condition,
)

TINY = InferenceService.model_validate({
    "metadata": {"name": "tiny"},
    "spec": {"model": {"name": "tiny", "preset": "tiny", "weights": {"loadFormat": "dummy"}},
             "accelerator": {"type": "cpu", "cards": 1, "memoryGiB": 2, "reservedGiB": 0}, "replicas": 2,
             "workload": {"avgInputTokens": 64, "avgOutputTokens": 32, "maxOutputTokens": 64,
                          "maxInputTokens": 256},
             "slo": {"objective": "throughput"}},
})
PLAN = plan(TINY.spec)


def test_condition_transition_time_moves_only_on_change() -> None:
    conds = set_condition([], "Ready", False, "NoPods", "none yet", "t1", 1)
    conds = set_condition(conds, "Ready", False, "StillNoPods", "none yet", "t2", 1)
    assert conds == [{"type": "Ready", "status": "False", "reason": "StillNoPods", "message": "none yet",
                      "lastTransitionTime": "t1", "observedGeneration": 1}]
    conds = set_condition(conds, "Ready", True, "EnginesReady", "2/2", "t3", 2)
    assert conds[0]["lastTransitionTime"] == "t3" and conds[0]["status"] == "True"


def test_planned_status_carries_the_plan_and_both_conditions() -> None:
    status = planned_status(PLAN, [], 3, "npuserve.io/inferenceservice=tiny", "Deployment", "t")
    assert status["plan"] == PLAN.model_dump(mode="json")  # what `npuserve plan --format json` prints
    assert status["observedGeneration"] == 3
    types = {c["type"]: c for c in status["conditions"]}
    assert types["Planned"]["status"] == "True" and str(PLAN.totalBlocks) in types["Planned"]["message"]
    assert types["Deployed"]["status"] == "True" and "Deployment" in types["Deployed"]["message"]


def test_plan_failure_is_a_failed_phase_with_the_reason() -> None:
    status = plan_failed_status("spec.accelerator.cards: 3 does not divide 32 heads", [], 1, "t")
    assert status["phase"] == "Failed"
    assert status["conditions"][0]["reason"] == "PlanFailed" and "cards" in status["conditions"][0]["message"]


def test_readiness_follows_the_pods_and_reads_allocated_blocks() -> None:
    engines = [EngineReport("tiny-a", True, kv_blocks=PLAN.totalBlocks), EngineReport("tiny-b", False,
                                                                                       error="not ready")]
    status = readiness_status(PLAN, 2, 1, engines, [], 1, "t")
    assert status["phase"] == "Deploying" and status["replicas"] == 1
    ready = status["conditions"][0]
    assert ready["status"] == "False" and "tiny-b (not ready)" in ready["message"]
    assert status["observed"]["kvBlocksAllocated"] == PLAN.totalBlocks

    engines = [EngineReport("tiny-a", True, kv_blocks=PLAN.totalBlocks),
               EngineReport("tiny-b", True, kv_blocks=PLAN.totalBlocks)]
    status = readiness_status(PLAN, 2, 2, engines, status["conditions"], 1, "t2")
    assert status["phase"] == "Ready" and status["conditions"][0]["reason"] == "EnginesReady"


def test_fewer_blocks_than_planned_is_said_on_the_planned_condition() -> None:
    engines = [EngineReport("tiny-a", True, kv_blocks=PLAN.totalBlocks - 10)]
    status = readiness_status(PLAN, 1, 1, engines, [], 1, "t")
    planned = next(c for c in status["conditions"] if c["type"] == "Planned")
    assert planned["reason"] == "FewerBlocksThanPlanned"
    assert status["observed"]["kvBlocksAllocated"] == PLAN.totalBlocks - 10


def test_no_pods_tells_where_to_look() -> None:
    status = readiness_status(PLAN, 2, 0, [], [], 1, "t")
    assert status["conditions"][0]["reason"] == "NoEnginePods"
    assert "events" in status["conditions"][0]["message"]


def test_status_schedule_holds_only_what_the_status_schema_keeps() -> None:
    from npuserve.operator.api import ScheduleKnobs

    status = planned_status(PLAN, [], 1, "x=y", "Deployment", "t")
    assert set(status["schedule"]) <= set(ScheduleKnobs.model_fields)
    assert status["schedule"]["maxBatchSize"] == PLAN.schedule.maxBatchSize
    assert "maxIterTimes" not in status["schedule"]  # the API server would prune it and kopf would warn
