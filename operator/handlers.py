"""The kopf handlers: thin wrappers that feed the pure planner, renderer and status logic and write results.

kopf settings, chosen on purpose:
- standalone (no peering): one operator replica, Deployment strategy Recreate, so no peering CRDs or RBAC;
- progress and the last-handled spec live in annotations under npuserve.io, not in `status`, whose schema the
  CRD prunes (kopf's default status storage would be dropped by the API server);
- no finalizer: the delete handler is optional, and readiness comes from watching the engine Deployments rather
  than from a timer or daemon on the InferenceService (kopf puts a finalizer on objects with timers, which would
  block `kubectl delete` while the operator is down); children go with their owner by garbage collection;
- events at info level: ours (Planned, Applied, PlanFailed, Ready) and kopf's per-handler outcomes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, cast

import kopf
from pydantic import ValidationError

from . import kube as kube_module
from .api import InferenceService, Plan
from .kube import GROUP, PLURAL, VERSION
from .planner import PlanError, plan
from .render import INSTANCE_LABEL, render, selector
from .status import (
    now_rfc3339,
    plan_failed_status,
    plan_summary,
    planned_status,
    readiness_status,
)

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
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.execution.max_workers = 16
    kube()


def _parse(body: kopf.Body) -> InferenceService:
    return _parse_dict({"apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
                        "metadata": dict(body.metadata), "spec": dict(body.spec)})


def _parse_dict(data: Mapping[str, Any]) -> InferenceService:
    return InferenceService.model_validate({k: data.get(k) for k in ("apiVersion", "kind", "metadata", "spec")})


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


@kopf.on.event("apps", "v1", "deployments", labels={INSTANCE_LABEL: kopf.PRESENT})
def on_engine_deployment(*, body: kopf.Body, type: str | None, logger: kopf.Logger, **_: Any) -> None:
    """An engine Deployment changed (its pods became ready or not): update its InferenceService's readiness."""
    if type == "DELETED":
        return
    name, namespace = body.metadata.labels[INSTANCE_LABEL], body.metadata.namespace or "default"
    update_readiness(name, namespace, logger)


def update_readiness(name: str, namespace: str, logger: kopf.Logger) -> None:
    """Pods ready, the Ready condition, phase, and the KV blocks each engine actually allocated (its /info)."""
    client = kube()
    isvc_body = client.get_inference_service(namespace, name)
    if isvc_body is None:
        return
    status = isvc_body.get("status") or {}
    if status.get("phase") == "Failed":
        return
    try:
        isvc = _parse_dict(isvc_body)
        result = plan(isvc.spec)  # pure: the same plan the create/update handler wrote
    except (PlanError, ValidationError):
        return
    sel = selector(isvc)
    ready_pods, pods = client.ready_pods(namespace, sel)
    engines = kube_module.read_engines(pods)
    generation = isvc_body["metadata"].get("generation")
    new = readiness_status(result, result.replicas * result.nodes, ready_pods, engines,
                           status.get("conditions", []), generation, now_rfc3339(), status.get("observed"))
    changed = {k: v for k, v in new.items() if status.get(k) != v}
    if not changed:
        return
    client.patch_inference_service_status(namespace, name, changed)
    if new["phase"] == "Ready" and status.get("phase") != "Ready":
        message = f"{ready_pods}/{result.replicas * result.nodes} engine pods ready"
        kopf.info(kopf.Body(cast(kopf.RawBody, isvc_body)), reason="Ready", message=message)
        logger.info("%s/%s ready: %s", namespace, name, message)
