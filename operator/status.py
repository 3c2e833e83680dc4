"""Pure status logic: conditions, phase and the status patch, from the plan and what the cluster reports.

The kopf handlers only gather inputs and write the result; everything here is testable without a cluster.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from .api import Plan, ScheduleKnobs

CONDITION_TYPES = ("Planned", "Deployed", "Ready", "SLOMet", "Tuning")


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


def plan_summary(plan: Plan) -> str:
    s = plan.schedule
    return (f"worldSize {plan.worldSize}, npuMemSize {plan.npuMemSizeGiB} GiB, {plan.totalBlocks} KV blocks per "
            f"card, maxBatchSize {s.maxBatchSize} (range {plan.maxBatchSize.min}..{plan.maxBatchSize.max}), "
            f"{plan.replicas} replica(s)")


def planned_status(plan: Plan, conditions: Sequence[Mapping[str, Any]], generation: int | None, selector: str,
                   workload_kind: str, now: str) -> dict[str, Any]:
    """The status after a successful plan and apply."""
    conds = set_condition(conditions, "Planned", True, "Planned", plan_summary(plan), now, generation)
    conds = set_condition(conds, "Deployed", True, "Applied",
                          f"ConfigMap, {workload_kind} and Service applied by server-side apply", now, generation)
    return {
        "observedGeneration": generation,
        "plan": plan.model_dump(mode="json"),
        # status.schedule holds the tunable knobs only (maxIterTimes is not one: it comes from the workload)
        "schedule": {k: v for k, v in plan.schedule.model_dump(mode="json", exclude_none=True).items()
                     if k in ScheduleKnobs.model_fields},
        "selector": selector,
        "conditions": conds,
    }


def plan_failed_status(message: str, conditions: Sequence[Mapping[str, Any]], generation: int | None,
                       now: str) -> dict[str, Any]:
    conds = set_condition(conditions, "Planned", False, "PlanFailed", message, now, generation)
    return {"phase": "Failed", "observedGeneration": generation, "conditions": conds}


@dataclass(frozen=True)
class EngineReport:
    """One engine pod as the operator sees it."""

    pod: str
    ready: bool
    kv_blocks: int | None = None  # from the engine's /info
    error: str | None = None


def readiness_status(plan: Plan, desired_pods: int, ready_pods: int, engines: Sequence[EngineReport],
                     conditions: Sequence[Mapping[str, Any]], generation: int | None, now: str,
                     observed: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Phase, the Ready condition, replicas and the KV blocks the engines actually allocated."""
    ready = desired_pods > 0 and ready_pods >= desired_pods
    if ready:
        reason, message = "EnginesReady", f"{ready_pods}/{desired_pods} engine pods ready"
    elif not engines:
        reason, message = "NoEnginePods", (f"0/{desired_pods} engine pods exist yet; check the Deployment's events "
                                           "(scheduling, image pulls, accelerator resources)")
    else:
        waiting = [e.pod + (f" ({e.error})" if e.error else "") for e in engines if not e.ready]
        reason, message = "EnginesNotReady", (f"{ready_pods}/{desired_pods} engine pods ready; waiting for "
                                              f"{', '.join(waiting) or 'pods to be created'}")
    conds = set_condition(conditions, "Ready", ready, reason, message, now, generation)
    blocks = sorted({e.kv_blocks for e in engines if e.kv_blocks is not None})
    observed_out = dict(observed or {})
    if blocks:
        observed_out["kvBlocksAllocated"] = blocks[0]  # the smallest pool bounds what any replica can hold
        if blocks[0] < plan.totalBlocks:
            conds = set_condition(conds, "Planned", True, "FewerBlocksThanPlanned",
                                  f"{plan_summary(plan)}; the engines allocated {blocks[0]} blocks, fewer than the "
                                  f"{plan.totalBlocks} planned (idle memory higher than the catalog's?)",
                                  now, generation)
    status: dict[str, Any] = {"phase": "Ready" if ready else "Deploying", "replicas": ready_pods // max(plan.nodes, 1),
                              "conditions": conds}
    if observed_out:
        status["observed"] = observed_out
    return status
