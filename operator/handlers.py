"""The kopf handlers: thin wrappers that feed the pure planner, renderer and status logic and write results.

kopf settings, chosen on purpose:
- standalone (no peering): one operator replica, Deployment strategy Recreate, so no peering CRDs or RBAC;
- progress and the last-handled spec live in annotations under npuserve.io, not in `status`, whose schema the
  CRD prunes (kopf's default status storage would be dropped by the API server);
- no blocking finalizer: the delete handler is optional; children go with their owner by garbage collection;
- events: our own (Planned, Applied, PlanFailed, Ready) at info level, kopf's own only for warnings and errors.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf
from pydantic import ValidationError

from . import kube as kube_module
from .api import InferenceService, Plan
from .planner import PlanError, plan
from .render import render, selector
from .status import (
    now_rfc3339,
    plan_failed_status,
    plan_summary,
    planned_status,
    readiness_status,
)

GROUP, VERSION, PLURAL = "npuserve.io", "v1alpha1", "inferenceservices"
READINESS_INTERVAL_SECONDS = 5.0
PROMETHEUS_URL: str | None = None  # set by `npuserve operator --prometheus-url`; read by the tuner

_kube: kube_module.Kube | None = None


def kube() -> kube_module.Kube:
    global _kube
    if _kube is None:
        _kube = kube_module.Kube()
    return _kube


@kopf.on.startup()
def configure(*, settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="npuserve.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="npuserve.io", key="last-handled-configuration")
    settings.persistence.finalizer = "npuserve.io/finalizer"
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.execution.max_workers = 16
    kube()


def _parse(body: kopf.Body) -> InferenceService:
    data = {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"), "metadata": dict(body.metadata),
            "spec": dict(body.spec)}
    return InferenceService.model_validate(data)


def _conditions(body: kopf.Body) -> list[dict[str, Any]]:
    return [dict(c) for c in body.status.get("conditions", [])]


def reconcile(body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger) -> Plan:
    """Plan, render, apply, prune; write the plan and the Planned/Deployed conditions."""
    generation = body.metadata.get("generation")
    now = now_rfc3339()
    try:
        isvc = _parse(body)
        result = plan(isvc.spec)
    except (PlanError, ValidationError) as e:
        message = str(e)
        patch.status.update(plan_failed_status(message, _conditions(body), generation, now))
        kopf.warn(body, reason="PlanFailed", message=message[:1024])
        raise kopf.PermanentError(f"cannot plan: {message}") from e
    objects = render(isvc, result)
    client = kube()
    for manifest in objects:
        client.apply(manifest)
    removed = client.prune(isvc.metadata.namespace, isvc.metadata.name, objects)
    kinds = [m["kind"] for m in objects]
    workload = "LeaderWorkerSet" if "LeaderWorkerSet" in kinds else "Deployment"
    status = planned_status(result, _conditions(body), generation, selector(isvc), workload, now)
    if body.status.get("phase") in (None, "Pending", "Failed", "Planned"):
        status["phase"] = "Deploying"
    patch.status.update(status)
    kopf.info(body, reason="Planned", message=plan_summary(result))
    kopf.info(body, reason="Applied", message=f"applied {', '.join(kinds)}"
              + (f"; removed {', '.join(removed)}" if removed else ""))
    logger.info("reconciled: %s", plan_summary(result))
    return result


@kopf.on.create(GROUP, VERSION, PLURAL)
def on_create(*, body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger, **_: Any) -> None:
    reconcile(body, patch, logger)


@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
def on_update(*, body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger, **_: Any) -> None:
    reconcile(body, patch, logger)


@kopf.on.resume(GROUP, VERSION, PLURAL)
def on_resume(*, body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger, **_: Any) -> None:
    """After an operator restart: re-apply (idempotent by server-side apply) so nothing drifted while it was away."""
    reconcile(body, patch, logger)


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
def on_delete(*, name: str, namespace: str | None, logger: kopf.Logger, **_: Any) -> None:
    # optional=True: no finalizer holds the object; its children go by owner-reference garbage collection.
    logger.info("InferenceService %s/%s deleted; its objects are garbage-collected by owner reference",
                namespace, name)


@kopf.timer(GROUP, VERSION, PLURAL, interval=READINESS_INTERVAL_SECONDS, idle=0, initial_delay=1)
def readiness(*, body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger, **_: Any) -> None:
    """Pods ready, the Ready condition, phase, and the KV blocks each engine actually allocated (its /info)."""
    plan_data = body.status.get("plan")
    if not plan_data or body.status.get("phase") == "Failed":
        return
    result = Plan.model_validate(dict(plan_data))
    sel = body.status.get("selector")
    if not sel:
        return
    desired_pods = result.replicas * result.nodes
    ready_pods, pods = kube().ready_pods(body.metadata.namespace or "default", sel)
    engines = kube_module.read_engines(pods)
    status = readiness_status(result, desired_pods, ready_pods, engines, _conditions(body),
                              body.metadata.get("generation"), now_rfc3339(), body.status.get("observed"))
    was_ready = body.status.get("phase") == "Ready"
    changed = {k: v for k, v in status.items() if body.status.get(k) != v}
    if changed:
        patch.status.update(changed)
    if status["phase"] == "Ready" and not was_ready:
        kopf.info(body, reason="Ready", message=f"{ready_pods}/{desired_pods} engine pods ready")
        logger.info("ready: %d/%d engine pods", ready_pods, desired_pods)
