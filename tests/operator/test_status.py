"""The operator's pure status logic: conditions keep their transition time, phase and readiness follow the pods, the
engines' real KV blocks reach the status, a plan the engine cannot serve is planned and not deployed, and the merge
patch the one writer sends. Expected values are written out (the guide's worked numbers), never read from the code
under test."""

from __future__ import annotations

from typing import Any

from npuserve.operator.autotune_types import EngineReport, Termination
from npuserve.operator.status import (
    cannot_serve,
    deployed,
    engine_crash,
    engines_expected,
    plan_failed,
    planned,
    readiness,
    ready_groups,
    set_condition,
)
from npuserve.planning.api import InferenceServiceSpec
from npuserve.planning.planner import plan

# A two-layer model on the CPU: 1 GiB of KV per pod (floor((2 - 0.002) x 0.8)), blocks of 2 x 2 layers x 128 tokens
# x 2 KV heads x 32 x 4 bytes = 128 KiB, so 8192 blocks; one block per prompt of 64 tokens, two per request.
TINY = InferenceServiceSpec.model_validate({
    "model": {"name": "tiny", "preset": "tiny", "weights": {"loadFormat": "dummy"}},
    "accelerator": {"type": "cpu", "cards": 1, "memoryGiB": 2, "reservedGiB": 0}, "replicas": 2,
    "workload": {"avgInputTokens": 64, "avgOutputTokens": 32, "maxOutputTokens": 64, "maxInputTokens": 256},
    "slo": {"objective": "throughput"},
})
TINY_PLAN = plan(TINY)
TINY_BLOCKS = 8192
# The MindIE guide's example: LLaMA3-8B on two 32 GB 910B4 cards, 3 GB reserved, GSM8K-shaped traffic.
GUIDE = InferenceServiceSpec.model_validate({
    "model": {"name": "llama3-8b", "preset": "llama3-8b", "weights": {"loadFormat": "dummy"}},
    "accelerator": {"type": "ascend-910b4", "cards": 2, "memoryGiB": 32, "reservedGiB": 3},
    "workload": {"avgInputTokens": 186, "avgOutputTokens": 346, "maxOutputTokens": 512},
})
GUIDE_PLAN = plan(GUIDE)
# The same model on 16 cards of 8-card nodes: one replica spans two pods (a LeaderWorkerSet).
SPANNING_PLAN = plan(GUIDE.model_copy(update={"accelerator": GUIDE.accelerator.model_copy(update={"cards": 16})}))
GUIDE_SUMMARY = ("worldSize 2, npuMemSize 17 GiB, 2176 KV blocks per card, maxBatchSize 435 (range 362..1088), "
                 "1 replica(s)")
SELECTOR = "npuserve.io/inferenceservice=tiny,app.kubernetes.io/component=engine"


def _conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


def test_the_tiny_plan_has_the_numbers_worked_out_by_hand() -> None:
    assert (TINY_PLAN.npuMemSizeGiB, TINY_PLAN.blockBytesPerCard, TINY_PLAN.totalBlocks) == (1, 131072, TINY_BLOCKS)
    assert (TINY_PLAN.blocksPerRequest.min, TINY_PLAN.blocksPerRequest.avg, TINY_PLAN.blocksPerRequest.max) == (1, 2, 2)
    assert (TINY_PLAN.replicas, TINY_PLAN.nodes, TINY_PLAN.warnings) == (2, 1, [])


def test_condition_transition_time_moves_only_on_change() -> None:
    conds = set_condition([], "Ready", False, "NoPods", "none yet", "t1", 1)
    conds = set_condition(conds, "Ready", False, "StillNoPods", "none yet", "t2", 1)
    assert conds == [{"type": "Ready", "status": "False", "reason": "StillNoPods", "message": "none yet",
                      "lastTransitionTime": "t1", "observedGeneration": 1}]
    conds = set_condition(conds, "Ready", True, "EnginesReady", "2/2", "t3", 2)
    assert conds[0]["lastTransitionTime"] == "t3" and conds[0]["status"] == "True"


def test_planned_carries_the_guides_plan_and_the_planned_condition() -> None:
    status = planned({}, GUIDE_PLAN, 3, SELECTOR, "t")
    assert status["phase"] == "Deploying" and status["observedGeneration"] == 3 and status["selector"] == SELECTOR
    assert status["plan"]["npuMemSizeGiB"] == 17 and status["plan"]["totalBlocks"] == 2176
    assert status["plan"]["blocksPerRequest"] == {"min": 2, "avg": 5, "max": 6}
    assert status["plan"]["maxBatchSize"] == {"min": 362, "avg": 435, "max": 1088}
    assert status["conditions"] == [{"type": "Planned", "status": "True", "reason": "Planned",
                                     "message": GUIDE_SUMMARY, "lastTransitionTime": "t", "observedGeneration": 3}]
    # status.schedule: the tunable knobs only (maxIterTimes comes from the workload; the schema would prune it)
    assert status["schedule"] == {"cacheBlockSize": 128, "maxBatchSize": 435, "maxPrefillBatchSize": 217,
                                  "maxPrefillTokens": 8192, "prefillTimeMsPerReq": 150, "decodeTimeMsPerReq": 50,
                                  "maxPreemptCount": 0, "supportSelectBatch": True,
                                  "maxQueueDelayMicroseconds": 5000}


def test_a_running_service_keeps_its_phase_when_replanned() -> None:
    assert planned({"phase": "Ready"}, TINY_PLAN, 2, SELECTOR, "t")["phase"] == "Ready"
    assert planned({"phase": "Failed"}, TINY_PLAN, 2, SELECTOR, "t")["phase"] == "Deploying"


def test_deployed_names_what_was_applied_and_skipped() -> None:
    status = deployed({}, ["ConfigMap", "Deployment", "Service"], ["PodMonitor"], 1, "t")
    assert status["conditions"][0] == {
        "type": "Deployed", "status": "True", "reason": "Applied", "lastTransitionTime": "t", "observedGeneration": 1,
        "message": "ConfigMap, Deployment, Service applied by server-side apply; skipped (API not served): PodMonitor"}


def test_the_tuning_condition_is_the_loops_while_autotune_is_on_and_cleared_when_off() -> None:
    running = {"conditions": [{"type": "Tuning", "status": "True", "reason": "Measuring", "message": "trial 0",
                               "lastTransitionTime": "t0"}]}
    assert _conditions(planned(running, TINY_PLAN, 1, SELECTOR, "t", autotune=True))["Tuning"]["reason"] == "Measuring"
    assert "Tuning" not in _conditions(planned(running, TINY_PLAN, 2, SELECTOR, "t2", autotune=False))


def test_plan_failure_is_a_failed_phase_with_the_reason() -> None:
    status = plan_failed({}, "spec.accelerator.cards: 3 does not divide 32 heads", 1, "t")
    assert status["phase"] == "Failed"
    assert status["conditions"][0]["reason"] == "PlanFailed" and "cards" in status["conditions"][0]["message"]


# --- what the engine cannot serve ----------------------------------------------------------------------------------


def test_the_guides_two_card_plan_and_a_replica_spanning_nodes_are_servable() -> None:
    assert GUIDE_PLAN.warnings == []  # tensor parallel within one pod
    assert (SPANNING_PLAN.nodes, SPANNING_PLAN.warnings) == (2, [])  # across the pods of a LeaderWorkerSet group


def test_a_plan_the_engine_cannot_serve_is_planned_not_deployed() -> None:
    # Was Ready, then replanned for a device the engine has no backend for: the old engines' readiness and blocks
    # must not linger.
    before = {"phase": "Ready", "replicas": 1, "observed": {"kvBlocksAllocated": 8192},
              "conditions": set_condition([], "Ready", True, "EnginesReady", "1/1", "t0", 1)}
    why = "the bundled engine cannot serve device 'tpu': it has backends for cpu, cuda, npu only"
    status = cannot_serve(before, GUIDE_PLAN, why, 2, SELECTOR, "t")
    assert status["phase"] == "Planned" and status["replicas"] == 0 and "observed" not in status
    conds = _conditions(status)
    assert conds["Planned"]["status"] == "True"
    assert (conds["Deployed"]["status"], conds["Deployed"]["reason"]) == ("False", "EngineCannotServe")
    assert conds["Deployed"]["message"] == (
        f"{why}. Nothing is deployed (the pods would crash); the plan is in status.plan. To serve now, set "
        "spec.accelerator.type to an accelerator of a device the engine runs on (cpu, cuda, npu) (the plan's is "
        "ascend-910b4)")  # what the user can do
    assert (conds["Ready"]["status"], conds["Ready"]["reason"], conds["Ready"]["lastTransitionTime"]) == (
        "False", "EngineCannotServe", "t")
    # A Deployment event while the old one is being deleted does not judge readiness.
    assert not engines_expected(status)
    assert readiness(status, 1, [EngineReport("tiny-a", True, kv_blocks=8192)], 2, "t2") is None


def test_a_cpu_plan_of_one_card_is_servable() -> None:
    assert engines_expected(planned({}, TINY_PLAN, 1, SELECTOR, "t"))


# --- readiness -------------------------------------------------------------------------------------------------------


def _deployed_tiny() -> dict[str, Any]:
    return deployed(planned({}, TINY_PLAN, 1, SELECTOR, "t0"), ["ConfigMap", "Deployment", "Service"], [], 1, "t0")


def test_readiness_follows_the_pods_and_reads_allocated_blocks() -> None:
    engines = [EngineReport("tiny-a", True, kv_blocks=TINY_BLOCKS), EngineReport("tiny-b", False, error="not ready")]
    status = readiness(_deployed_tiny(), 1, engines, 1, "t")
    assert status is not None
    assert status["phase"] == "Deploying" and status["replicas"] == 1
    ready = _conditions(status)["Ready"]
    assert ready["status"] == "False" and ready["message"] == "1/2 engine pods ready; waiting for tiny-b (not ready)"
    assert status["observed"] == {"kvBlocksAllocated": 8192}

    engines = [EngineReport("tiny-a", True, kv_blocks=TINY_BLOCKS), EngineReport("tiny-b", True, kv_blocks=TINY_BLOCKS)]
    status = readiness(status, 2, engines, 1, "t2")
    assert status is not None
    assert status["phase"] == "Ready" and status["replicas"] == 2
    assert _conditions(status)["Ready"] == {"type": "Ready", "status": "True", "reason": "EnginesReady",
                                            "message": "2/2 engine pods ready", "lastTransitionTime": "t2",
                                            "observedGeneration": 1}
    # The conditions written before (Planned, Deployed) are kept.
    assert [c["type"] for c in status["conditions"]] == ["Planned", "Deployed", "Ready"]


def test_fewer_blocks_than_planned_is_said_on_the_planned_condition() -> None:
    status = readiness(_deployed_tiny(), 2, [EngineReport("tiny-a", True, kv_blocks=8000),
                                             EngineReport("tiny-b", True, kv_blocks=8100)], 1, "t")
    assert status is not None
    planned_cond = _conditions(status)["Planned"]
    assert planned_cond["reason"] == "FewerBlocksThanPlanned"
    assert "the engines allocated 8000 blocks, fewer than the 8192 planned" in planned_cond["message"]
    assert status["observed"] == {"kvBlocksAllocated": 8000}  # the smallest pool bounds what any replica holds


def test_no_pods_tells_where_to_look() -> None:
    status = readiness(_deployed_tiny(), 0, [], 1, "t")
    assert status is not None
    assert _conditions(status)["Ready"]["reason"] == "NoEnginePods"
    assert "events" in _conditions(status)["Ready"]["message"]


def test_readiness_needs_a_plan_and_skips_a_failed_one() -> None:
    assert readiness({}, 1, [], 1, "t") is None
    assert readiness(plan_failed(_deployed_tiny(), "bad", 2, "t"), 1, [], 2, "t") is None


# --- an engine that crashed: its termination message on the Ready condition -----------------------------------------

FATAL = Termination(1, "Error", "tensor-parallel rank 0 failed in FORWARD #12 (decode: 8 sequences, 8 tokens): "
                                "RuntimeError: device lost; the engine exits")


def test_a_crashed_engine_says_why_on_the_ready_condition() -> None:
    engines = [EngineReport("tiny-a", True, kv_blocks=TINY_BLOCKS),
               EngineReport("tiny-b", False, error="not ready", restarts=1, terminated=FATAL)]
    status = readiness(_deployed_tiny(), 1, engines, 1, "t")
    assert status is not None and status["phase"] == "Deploying"
    ready = _conditions(status)["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "EngineCrashed")
    assert ready["message"].startswith("1/2 engine pods ready; engine pod tiny-b exited with code 1 (Error), "
                                       "restarted 1 time(s): tensor-parallel rank 0 failed in FORWARD #12")

    looping = [engines[0], EngineReport("tiny-b", False, restarts=4, terminated=FATAL)]
    status = readiness(status, 1, looping, 1, "t2")
    assert status is not None and _conditions(status)["Ready"]["reason"] == "EngineCrashLooping"


def test_only_an_engine_down_after_an_error_counts_as_crashed() -> None:
    assert engine_crash([EngineReport("a", False, restarts=3, terminated=FATAL)]) is not None
    assert engine_crash([EngineReport("a", False, restarts=3, terminated=FATAL)])[0] == "EngineCrashed"  # type: ignore[index]
    # up again after the crash, a clean stop (SIGTERM drained: exit 0), a pod that never ended: no crash
    assert engine_crash([EngineReport("a", True, restarts=9, terminated=FATAL)]) is None
    assert engine_crash([EngineReport("a", False, restarts=1, terminated=Termination(0, "Completed"))]) is None
    assert engine_crash([EngineReport("a", False, error="not ready")]) is None
    # no message of its own (an OOM kill): said so; a long one is cut
    oom = engine_crash([EngineReport("a", False, terminated=Termination(137, "OOMKilled"))])
    assert oom == ("EngineCrashed", "engine pod a exited with code 137 (OOMKilled), restarted 0 time(s): no "
                   "termination message; the pod's status and its previous log (kubectl logs --previous) say more")
    long = engine_crash([EngineReport("a", False, terminated=Termination(1, None, "x" * 5000))])
    assert long is not None and len(long[1]) < 1000


# --- replicas spanning nodes: a replica is a group, ready when every pod of it is -----------------------------------

# The e2e test's spec: two CPU ranks, one per pod; two replicas, so two groups of two pods.
GROUPS = TINY.model_copy(update={"accelerator": TINY.accelerator.model_copy(update={"cards": 2, "cardsPerNode": 1})})
GROUPS_PLAN = plan(GROUPS)


def _deployed_groups() -> dict[str, Any]:
    return deployed(planned({}, GROUPS_PLAN, 1, SELECTOR, "t0"), ["ConfigMap", "LeaderWorkerSet", "Service"], [], 1,
                    "t0")


def _pod(name: str, group: str, ready: bool, kv_blocks: int | None = None) -> EngineReport:
    return EngineReport(name, ready, kv_blocks=kv_blocks, group=group)


def test_ready_groups_counts_groups_whose_every_pod_is_ready() -> None:
    assert (GROUPS_PLAN.replicas, GROUPS_PLAN.nodes) == (2, 2)
    whole, half = [_pod("g-0", "0", True), _pod("g-0-1", "0", True)], [_pod("g-1", "1", True),
                                                                         _pod("g-1-1", "1", False)]
    assert ready_groups(whole + half, 2) == 1
    assert ready_groups([_pod("g-0", "0", True)], 2) == 0  # its worker does not exist yet
    assert ready_groups([EngineReport("unlabelled", True)], 1) == 0  # no group label: in no group


def test_a_replica_spanning_nodes_is_ready_when_its_whole_group_is() -> None:
    # Each group's leader ready, each worker not: 2 of 4 pods ready, no replica (2 // 2 would say one).
    engines = [_pod("tiny-0", "0", True, TINY_BLOCKS), _pod("tiny-0-1", "0", False), _pod("tiny-1", "1", True,
                                                                                           TINY_BLOCKS),
               _pod("tiny-1-1", "1", False)]
    status = readiness(_deployed_groups(), 2, engines, 1, "t")
    assert status is not None
    assert status["replicas"] == 0 and status["phase"] == "Deploying"
    assert _conditions(status)["Ready"]["message"] == (
        "0/2 replicas ready (every pod of the group), 2/4 engine pods; waiting for tiny-0-1, tiny-1-1")
    assert status["observed"] == {"kvBlocksAllocated": 8192}  # from the leaders' /info


def test_four_ready_pods_of_three_groups_are_not_two_ready_replicas() -> None:
    # A scale-down under way: group 0 whole, groups 1 and 2 half ready. Four pods ready is two replicas' worth of
    # pods, but one replica is ready.
    engines = [_pod("tiny-0", "0", True), _pod("tiny-0-1", "0", True), _pod("tiny-1", "1", True),
               _pod("tiny-1-1", "1", False), _pod("tiny-2", "2", True), _pod("tiny-2-1", "2", False)]
    status = readiness(_deployed_groups(), 4, engines, 1, "t")
    assert status is not None
    ready = _conditions(status)["Ready"]
    assert (ready["status"], status["replicas"], status["phase"]) == ("False", 1, "Deploying")
    engines = [_pod("tiny-0", "0", True), _pod("tiny-0-1", "0", True), _pod("tiny-1", "1", True),
               _pod("tiny-1-1", "1", True)]
    status = readiness(status, 4, engines, 1, "t2")
    assert status is not None
    assert (_conditions(status)["Ready"]["message"], status["replicas"], status["phase"]) == (
        "2/2 replicas ready (every pod of the group), 4/4 engine pods", 2, "Ready")
