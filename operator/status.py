"""Pure status logic: conditions, phase and the status of an InferenceService, from the plan and what the cluster
reports.

Every function here takes the status as it is now and returns the whole new status (`status -> new status`); the
one status writer (`status_writer.update_status`) reads the object, applies one of them and writes the difference with
the object's resourceVersion, retrying on a conflict. The kopf handlers only gather inputs; everything here is testable
without a cluster.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from npuserve.engine_contract import SERVABLE_DEVICES
from npuserve.planning.api import Plan, PlanSchedule, ScheduleKnobs

from .autotune_types import EngineReport, Status

CONDITION_TYPES = ("Planned", "Deployed", "Ready", "SLOMet", "Tuning")
# Reasons a person acts on (docs/operator.md lists them).
ENGINE_CANNOT_SERVE = "EngineCannotServe"
ENGINE_CRASHED = "EngineCrashed"  # an engine container that is not ready ended with an error: its message
ENGINE_CRASH_LOOPING = "EngineCrashLooping"  # the same, restarted more than CRASH_LOOP_RESTARTS times
ENGINE_CRASH_REASONS = (ENGINE_CRASHED, ENGINE_CRASH_LOOPING)
CRASH_LOOP_RESTARTS = 3
_CRASH_MESSAGE_CHARS = 600  # of the termination message, in the condition (the pod's status has it whole)
# Phases the first successful plan moves on from: nothing runs yet, or what ran was refused.
_UNDEPLOYED_PHASES = (None, "Pending", "Failed", "Planned")


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def set_condition(conditions: Sequence[Mapping[str, Any]], type_: str, status: bool, reason: str, message: str,
                  now: str, generation: int | None) -> list[dict[str, Any]]:
    """Conditions with `type_` set; lastTransitionTime moves only when the status changes (metav1.Condition)."""
    value = "True" if status else "False"
    out: list[dict[str, Any]] = []
    found = False
    for cond in conditions:
        if cond.get("type") != type_:
            out.append(dict(cond))
            continue
        found = True
        changed = cond.get("status") != value
        out.append({"type": type_, "status": value, "reason": reason, "message": message,
                    "lastTransitionTime": now if changed else cond.get("lastTransitionTime", now),
                    **({"observedGeneration": generation} if generation is not None else {})})
    if not found:
        out.append({"type": type_, "status": value, "reason": reason, "message": message, "lastTransitionTime": now,
                    **({"observedGeneration": generation} if generation is not None else {})})
    return out


def condition(status: Mapping[str, Any], type_: str) -> Mapping[str, Any] | None:
    return next((c for c in status.get("conditions") or [] if c.get("type") == type_), None)


def _with_condition(status: Mapping[str, Any], type_: str, value: bool, reason: str, message: str, now: str,
                    generation: int | None) -> Status:
    new = copy.deepcopy(dict(status))
    new["conditions"] = set_condition(new.get("conditions") or [], type_, value, reason, message, now, generation)
    return new


def plan_of(status: Mapping[str, Any]) -> Plan | None:
    """The plan the operator wrote to `status.plan` (readiness never re-plans), or None when there is none."""
    data = status.get("plan")
    return None if data is None else Plan.model_validate(data)


def plan_summary(plan: Plan) -> str:
    s = plan.schedule
    return (f"worldSize {plan.worldSize}, npuMemSize {plan.npuMemSizeGiB} GiB, {plan.totalBlocks} KV blocks per "
            f"card, maxBatchSize {s.maxBatchSize} (range {plan.maxBatchSize.min}..{plan.maxBatchSize.max}), "
            f"{plan.replicas} replica(s)")


def planned(status: Mapping[str, Any], plan: Plan, generation: int | None, selector: str, now: str,
            autotune: bool = False, schedule: PlanSchedule | None = None) -> Status:
    """The plan is written: status.plan (exactly `npuserve plan --format json`), the schedule now applied (the plan's,
    or `schedule`, the tuner's), the selector and the Planned condition; without autotune, no Tuning condition.
    Phase Deploying when nothing was running; a running service keeps its phase until its pods say otherwise."""
    new = _with_condition(status, "Planned", True, "Planned", plan_summary(plan), now, generation)
    new.update({
        "observedGeneration": generation,
        "plan": plan.model_dump(mode="json"),
        # status.schedule holds the tunable knobs only (maxIterTimes is not one: it comes from the workload)
        "schedule": {k: v for k, v in (schedule or plan.schedule).model_dump(mode="json", exclude_none=True).items()
                     if k in ScheduleKnobs.model_fields},
        "selector": selector,
    })
    if not autotune:
        new["conditions"] = [c for c in new["conditions"] if c.get("type") != "Tuning"]
    if new.get("phase") in _UNDEPLOYED_PHASES:
        new["phase"] = "Deploying"
    return new


def deployed(status: Mapping[str, Any], applied: Sequence[str], skipped: Sequence[str], generation: int | None,
             now: str) -> Status:
    """Deployed=True after the apply: which kinds were applied and which optional ones were skipped."""
    message = f"{', '.join(applied)} applied by server-side apply"
    if skipped:
        message += f"; skipped (API not served): {', '.join(skipped)}"
    return _with_condition(status, "Deployed", True, "Applied", message, now, generation)


def not_deployed(status: Mapping[str, Any], reason: str, message: str, generation: int | None, now: str) -> Status:
    """Deployed=False: the apply could not be done (a required kind is not served, the API server refused)."""
    return _with_condition(status, "Deployed", False, reason, message, now, generation)


def cannot_serve_message(why: str, plan: Plan | None = None) -> str:
    """The Deployed condition's message: why, and what to do now. The engine serves tensor parallel within one pod and
    across the pods of a LeaderWorkerSet group, on the devices it has backends for; what it cannot serve is another
    device, so the advice is an accelerator of one of those."""
    on = f" (the plan's is {plan.accelerator})" if plan is not None else ""
    devices = ", ".join(sorted(SERVABLE_DEVICES))
    return (f"{why}. Nothing is deployed (the pods would crash); the plan is in status.plan. To serve now, set "
            f"spec.accelerator.type to an accelerator of a device the engine runs on ({devices}){on}")


def cannot_serve(status: Mapping[str, Any], plan: Plan, why: str, generation: int | None, selector: str,
                 now: str, autotune: bool = False) -> Status:
    """The plan needs what the bundled engine cannot serve (`engine_contract.unservable`): the plan is written,
    nothing runs. Phase Planned (planned, not deployed), Deployed=False and Ready=False with reason
    EngineCannotServe, no replicas, and no blocks observed from engines that are gone."""
    new = planned(status, plan, generation, selector, now, autotune)
    message = cannot_serve_message(why, plan)
    new["conditions"] = set_condition(new["conditions"], "Deployed", False, ENGINE_CANNOT_SERVE, message, now,
                                      generation)
    new["conditions"] = set_condition(new["conditions"], "Ready", False, ENGINE_CANNOT_SERVE,
                                      "no engine pods: the engine cannot serve this plan yet (see Deployed)", now,
                                      generation)
    new["phase"] = "Planned"
    new["replicas"] = 0
    observed = {k: v for k, v in (new.get("observed") or {}).items() if k != "kvBlocksAllocated"}
    if observed:
        new["observed"] = observed
    else:
        new.pop("observed", None)
    return new


def plan_failed(status: Mapping[str, Any], message: str, generation: int | None, now: str) -> Status:
    new = _with_condition(status, "Planned", False, "PlanFailed", message, now, generation)
    new.update({"phase": "Failed", "observedGeneration": generation})
    return new


def serving_phase(tuning: Mapping[str, Any]) -> str:
    """The phase of a service whose engines are all ready: Tuning while trials run (or a window is open), else
    Ready. `tuning` is `status.tuning` (empty without one)."""
    return "Tuning" if tuning.get("phase") == "Running" or tuning.get("current") else "Ready"


def engines_expected(status: Mapping[str, Any]) -> bool:
    """Whether engines may be running: a plan, not failed, and not one the engine cannot serve (nothing deployed;
    a workload event then comes from the workload being deleted)."""
    cond = condition(status, "Deployed") or {}
    return (status.get("plan") is not None and status.get("phase") != "Failed"
            and cond.get("reason") != ENGINE_CANNOT_SERVE)


def engine_crash(engines: Sequence[EngineReport]) -> tuple[str, str] | None:
    """(reason, message) when an engine that is not ready ended with an error (a fatal engine error, a crash at
    start-up, an OOM kill): EngineCrashLooping once it restarted more than CRASH_LOOP_RESTARTS times, else
    EngineCrashed; the message names the pod, the exit and the engine's own termination message. None otherwise."""
    crashed = [e for e in engines if not e.ready and e.terminated is not None and e.terminated.exit_code != 0]
    if not crashed:
        return None
    worst = max(crashed, key=lambda e: e.restarts)
    ended = worst.terminated
    assert ended is not None
    reason = ENGINE_CRASH_LOOPING if worst.restarts > CRASH_LOOP_RESTARTS else ENGINE_CRASHED
    how = f"exited with code {ended.exit_code}" + (f" ({ended.reason})" if ended.reason else "")
    text = ended.message or "no termination message"
    if len(text) > _CRASH_MESSAGE_CHARS:
        text = text[:_CRASH_MESSAGE_CHARS] + "..."
    others = f"; {len(crashed) - 1} more engine pod(s) crashed too" if len(crashed) > 1 else ""
    return reason, (f"engine pod {worst.pod} {how}, restarted {worst.restarts} time(s): {text}{others}; the pod's "
                    "status and its previous log (kubectl logs --previous) say more")


def ready_groups(engines: Sequence[EngineReport], nodes: int) -> int:
    """Replicas of `nodes` pods each (LeaderWorkerSet groups, by their group-index label) whose every pod is ready; a
    pod without a group label (not yet labelled by the controller's webhook) belongs to none."""
    members: dict[str, list[bool]] = {}
    for engine in engines:
        if engine.group is not None:
            members.setdefault(engine.group, []).append(engine.ready)
    return sum(1 for ready in members.values() if len(ready) >= nodes and all(ready))


def readiness(status: Mapping[str, Any], ready_pods: int, engines: Sequence[EngineReport], generation: int | None,
              now: str) -> Status | None:
    """Phase, the Ready condition, replicas and the KV blocks the engines actually allocated, from the plan in
    `status.plan`; None when there is nothing to judge (no plan, a failed plan, nothing deployed). A replica spanning
    nodes is ready when every pod of its group is (`ready_groups`): status.replicas counts replicas, not pods."""
    plan = plan_of(status) if engines_expected(status) else None
    if plan is None:
        return None
    desired_pods = plan.replicas * plan.nodes
    ready_replicas = ready_pods if plan.nodes <= 1 else ready_groups(engines, plan.nodes)
    ready = plan.replicas > 0 and ready_replicas >= plan.replicas
    pods_ready = f"{ready_pods}/{desired_pods} engine pods ready"
    if plan.nodes > 1:
        pods_ready = (f"{ready_replicas}/{plan.replicas} replicas ready (every pod of the group), "
                      f"{ready_pods}/{desired_pods} engine pods")
    if ready:
        reason, message = "EnginesReady", pods_ready
    elif not engines:
        reason, message = "NoEnginePods", (f"0/{desired_pods} engine pods exist yet; check the workload's events "
                                           "(scheduling, image pulls, accelerator resources)")
    elif (crash := engine_crash(engines)) is not None:
        reason, message = crash[0], f"{pods_ready}; {crash[1]}"
    else:
        waiting = [e.pod + (f" ({e.error})" if e.error else "") for e in engines if not e.ready]
        reason, message = "EnginesNotReady", (f"{pods_ready}; waiting for "
                                              f"{', '.join(waiting) or 'pods to be created'}")
    new = _with_condition(status, "Ready", ready, reason, message, now, generation)
    blocks = sorted({e.kv_blocks for e in engines if e.kv_blocks is not None})
    if blocks:
        new["observed"] = {**(new.get("observed") or {}), "kvBlocksAllocated": blocks[0]}  # the smallest bounds all
        if blocks[0] < plan.totalBlocks:
            new["conditions"] = set_condition(
                new["conditions"], "Planned", True, "FewerBlocksThanPlanned",
                f"{plan_summary(plan)}; the engines allocated {blocks[0]} blocks, fewer than the {plan.totalBlocks} "
                "planned (idle memory higher than the catalog's?)", now, generation)
    new["phase"] = serving_phase(new.get("tuning") or {}) if ready else "Deploying"
    new["replicas"] = ready_replicas
    return new
