"""The kopf handlers: thin wrappers that feed the pure planner, renderer and status logic and write results.

Every status change goes through `status_writer.update_status`, the one writer (read, apply a pure
`status -> new status` function from `status.py`, merge-patch with the read's resourceVersion, retry on 409): the
InferenceService handlers and the readiness handler never overwrite each other's conditions. kopf's own `patch`
carries only kopf's annotations.

- create, update of `spec`, resume: plan; write the plan to the status first; where the engine cannot serve the plan
  (`engine_contract.unservable`: a device without a backend), deploy nothing (and delete what an earlier spec
  deployed), phase Planned, condition Deployed=False with reason EngineCannotServe; otherwise apply the rendered
  objects (a required kind whose API is not served, such as the LeaderWorkerSet of a replica spanning nodes:
  Deployed=False with reason <Kind>NotInstalled, a warning event and a retry; an optional one, PodMonitor: skipped
  with a warning event), prune what the render no longer has, condition Deployed=True.
- status.tuning.applied changes (the autotune loop applied a schedule): the ConfigMap is rendered again from it, at
  its schedule generation. Reconcile is the one writer of the ConfigMap, and status.tuning.applied its one source;
  kopf runs one object's handlers one at a time, and the engines take only a newer generation, so a ConfigMap
  rendered from an older read never replaces a newer schedule on them.
- an engine Deployment or LeaderWorkerSet, or a pod of a LeaderWorkerSet group, changes: readiness from its pods
  and each engine's `/info`, judged against `status.plan` (never re-planned). LeaderWorkerSets are watched only
  where their CRD is installed: kopf logs that an unserved resource cannot be watched and starts watching when the
  CRD appears.

kopf settings, chosen on purpose:
- standalone (no peering), so no peering CRDs or RBAC: with several replicas, which one runs kopf is decided before
  kopf starts, by a coordination.k8s.io Lease (`npuserve operator --leader-elect`, `leader.py`); the others wait;
- progress and the last-handled spec live in annotations under npuserve.io, not in `status`, whose schema the
  CRD prunes (kopf's default status storage would be dropped by the API server);
- no finalizer: the delete handler is optional, and readiness comes from watching the engine workloads rather
  than from a timer or daemon on the InferenceService (kopf puts a finalizer on objects with timers, which would
  block `kubectl delete` while the operator is down); children go with their owner by garbage collection;
- events at info level: ours (Planned, Applied, Ready; warnings PlanFailed, EngineCannotServe, <Kind>NotInstalled,
  EngineCrashed, EngineCrashLooping)
  and kopf's per-handler outcomes; the autotune loop posts its own (TrialStarted, TrialMeasured, RolledBack, ...).
- autotune: a thread (`autotune_loop.AutotuneLoop`) started at start-up; `track_autotune`, an event handler, tells
  it which InferenceServices to tune and when one changed (the workload handlers too, when its engines did). Its
  state is all in their status (module docstring of `autotune.py`).
- the Kubernetes client and the autotune loop live in kopf's memo, made by the startup handler (kopf copies the
  operator's memo to each object's, after start-up): no module state, and a test hands the handlers its own.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from collections.abc import Mapping
from typing import Any, cast

import kopf
from kubernetes import client as k8s_client
from pydantic import ValidationError

from npuserve.planning.api import GROUP, PLURAL, VERSION, InferenceService, Plan, PlanSchedule
from npuserve.planning.planner import PlanError, plan, servability

from . import engine_http
from . import kube as kube_module
from . import status as st
from .autotune_loop import AutotuneLoop, outside_signature
from .autotune_types import Status
from .kube import INSTALL_HINTS, OPTIONAL_KINDS
from .names import INSTANCE_LABEL, LWS_WORKER_INDEX_LABEL, MEMO_PROMETHEUS_URL, PROMETHEUS_URL_ENV
from .render import render, render_admin_secret, render_configmap, selector
from .tuning_schedule import configmap_schedule

# The keys of kopf's memo the startup handler fills (beside MEMO_PROMETHEUS_URL, which `npuserve operator` gives).
MEMO_KUBE = "kube"
MEMO_AUTOTUNE_LOOP = "autotune_loop"


def kube_of(memo: kopf.Memo) -> kube_module.Kube:
    client: kube_module.Kube = memo[MEMO_KUBE]
    return client


def autotune_loop_of(memo: kopf.Memo) -> AutotuneLoop | None:
    """None until start-up has made it (a handler that runs without the startup handler, as in a test)."""
    loop: AutotuneLoop | None = memo.get(MEMO_AUTOTUNE_LOOP)
    return loop


@kopf.on.startup()
def configure(*, settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="npuserve.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="npuserve.io", key="last-handled-configuration")
    settings.persistence.finalizer = "npuserve.io/finalizer"
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 300
    # How long kopf waits for the watch to bring back its own annotation patch before it handles the object again.
    # Its 5 s default ran out under a burst (300 InferenceServices created at once: the create handler ran 849
    # times, each event older than the patch taken for a new object); a late patch costs only that wait.
    settings.persistence.consistency_timeout = 30.0
    settings.watching.client_timeout = 330
    settings.execution.max_workers = 16
    # `npuserve operator --prometheus-url` puts it in kopf's memo; `kopf run -m` (the e2e tests) leaves the memo empty.
    prometheus_url = memo.get(MEMO_PROMETHEUS_URL) or os.environ.get(PROMETHEUS_URL_ENV) or None
    client = kube_module.Kube()
    loop = AutotuneLoop(client, prometheus_url)
    memo[MEMO_KUBE], memo[MEMO_AUTOTUNE_LOOP] = client, loop
    loop.start()


@kopf.on.cleanup()
def stop_autotune(*, memo: kopf.Memo, **_: Any) -> None:
    loop = autotune_loop_of(memo)
    if loop is not None:
        loop.stop()


@kopf.on.event(GROUP, VERSION, PLURAL)
def track_autotune(*, body: kopf.Body, type: str | None, memo: kopf.Memo, **_: Any) -> None:
    """Tell the autotune loop which InferenceServices to tune (an event handler: no finalizer, unlike a timer)."""
    loop = autotune_loop_of(memo)
    if loop is None:
        return
    spec, status = body.get("spec") or {}, body.get("status") or {}
    wanted = type != "DELETED" and (bool((spec.get("autotune") or {}).get("enabled"))
                                    or bool((status.get("tuning") or {}).get("current")))
    loop.track(body.metadata.namespace or "default", body.metadata.name or "", wanted, outside_signature(body))


def _parse(body: Mapping[str, Any]) -> InferenceService:
    return InferenceService.model_validate({k: body.get(k) for k in ("apiVersion", "kind", "metadata", "spec")})


def reconcile(body: kopf.Body, logger: kopf.Logger, client: kube_module.Kube) -> Plan:
    """Plan; write the plan; apply and prune, or deploy nothing where the engine cannot serve the plan yet."""
    name, namespace = body.metadata.name or "", body.metadata.namespace or "default"
    generation = body.metadata.get("generation")
    try:
        isvc = _parse({"apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
                       "metadata": dict(body.metadata), "spec": dict(body.spec)})
        result = plan(isvc.spec)
    except (PlanError, ValidationError) as e:
        message = str(e)
        client.update_status(namespace, name, lambda o: st.plan_failed(o.get("status") or {}, message, generation,
                                                                       st.now_rfc3339()))
        kopf.warn(body, reason="PlanFailed", message=message[:1024])
        raise kopf.PermanentError(f"cannot plan: {message}") from e
    sel, autotune = selector(isvc), isvc.spec.autotune.enabled
    why = servability(result)
    if why is not None:
        client.update_status(namespace, name, lambda o: st.cannot_serve(o.get("status") or {}, result, why, generation,
                                                                        sel, st.now_rfc3339(), autotune))
        removed = client.prune(namespace, name, [])  # what an earlier spec deployed
        kopf.warn(body, reason=st.ENGINE_CANNOT_SERVE, message=st.cannot_serve_message(why, result)[:1024])
        logger.warning("not deployed: %s%s", why, f"; removed {', '.join(removed)}" if removed else "")
        return result

    # The plan reaches the status before anything is applied: a failing apply still leaves it readable. The
    # schedule is the tuner's while its trials are of this plan (a re-apply must not put the plan's back), read
    # from the status the write reads anyway.
    schedule: PlanSchedule | None = None
    schedule_generation = 0

    def write_plan(o: Mapping[str, Any]) -> Status:
        nonlocal schedule, schedule_generation
        schedule, schedule_generation = configmap_schedule(isvc, result, o.get("status") or {})
        return st.planned(o.get("status") or {}, result, generation, sel, st.now_rfc3339(), autotune, schedule)

    client.update_status(namespace, name, write_plan)
    kopf.info(body, reason="Planned", message=st.plan_summary(result))
    # The engines' admin token: made once, kept (the pods read it from their environment).
    if isvc.metadata.uid and client.create_if_absent(render_admin_secret(isvc, secrets.token_urlsafe(32))):
        logger.info("created the admin Secret of %s/%s", namespace, name)
    objects = render(isvc, result, schedule, schedule_generation)
    applied, skipped = _apply(client, body, namespace, name, generation, objects)
    removed = client.prune(namespace, name, objects)
    client.update_status(namespace, name, lambda o: st.deployed(o.get("status") or {}, applied, skipped, generation,
                                                                st.now_rfc3339()))
    kopf.info(body, reason="Applied", message=f"applied {', '.join(applied)}"
              + (f"; removed {', '.join(removed)}" if removed else ""))
    logger.info("reconciled: %s", st.plan_summary(result))
    return result


def _apply(client: kube_module.Kube, body: kopf.Body, namespace: str, name: str, generation: int | None,
           objects: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """Server-side apply of each object; (kinds applied, optional kinds skipped because their API is not served).
    A required kind that is not served, or an apply the API server refuses, is said on the Deployed condition and
    raised for kopf to retry."""
    applied: list[str] = []
    skipped: list[str] = []
    for manifest in objects:
        kind = manifest["kind"]
        if not client.serves(manifest):
            hint = INSTALL_HINTS.get(kind, "its CRD")
            if kind in OPTIONAL_KINDS:
                skipped.append(kind)
                kopf.warn(body, reason=f"{kind}NotInstalled",
                          message=f"{kind} skipped: the API server does not serve {manifest['apiVersion']}; "
                                  f"install {hint}")
                continue
            message = f"the API server does not serve {manifest['apiVersion']} {kind}; install {hint}"
            _fail_deploy(client, body, namespace, name, generation, f"{kind}NotInstalled", message)
            raise kopf.TemporaryError(message, delay=60)
        try:
            client.apply(manifest)
        except k8s_client.ApiException as e:
            _fail_deploy(client, body, namespace, name, generation, "ApplyFailed",
                         f"{kind}/{manifest['metadata']['name']}: {e.status} {e.reason}: {e.body}"[:1024])
            raise
        applied.append(kind)
    return applied, skipped


def _fail_deploy(client: kube_module.Kube, body: kopf.Body, namespace: str, name: str, generation: int | None,
                 reason: str, message: str) -> None:
    client.update_status(namespace, name, lambda o: st.not_deployed(o.get("status") or {}, reason, message,
                                                                    generation, st.now_rfc3339()))
    kopf.warn(body, reason=reason, message=message)


@kopf.on.field(GROUP, VERSION, PLURAL, field="status.tuning.applied")
def on_applied_schedule(*, body: kopf.Body, logger: kopf.Logger, memo: kopf.Memo, **_: Any) -> None:
    """The autotune loop applied a schedule (status.tuning.applied): the ConfigMap follows, at its generation."""
    write_configmap(body, logger, kube_of(memo))


def write_configmap(body: Mapping[str, Any], logger: kopf.Logger, client: kube_module.Kube) -> None:
    """The ConfigMap from the status as it is now: the tuner's schedule and generation, or the plan's."""
    metadata = body.get("metadata") or {}
    namespace, name = metadata.get("namespace") or "default", metadata.get("name") or ""
    obj = client.get_inference_service(namespace, name)  # the status now, not the event's (it may be older)
    status = (obj or {}).get("status") or {}
    plan_now = st.plan_of(status) if obj is not None and st.engines_expected(status) else None
    if obj is None or plan_now is None:
        return  # nothing deployed: reconcile renders the ConfigMap with the rest
    try:
        isvc = _parse(obj)
    except ValidationError:
        return
    schedule, schedule_generation = configmap_schedule(isvc, plan_now, status)
    client.apply(render_configmap(isvc, plan_now, schedule, schedule_generation))
    logger.info("ConfigMap of %s/%s at schedule generation %d", namespace, name, schedule_generation)


@kopf.on.create(GROUP, VERSION, PLURAL)
def on_create(*, body: kopf.Body, logger: kopf.Logger, memo: kopf.Memo, **_: Any) -> None:
    reconcile(body, logger, kube_of(memo))


@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
def on_update(*, body: kopf.Body, logger: kopf.Logger, memo: kopf.Memo, **_: Any) -> None:
    reconcile(body, logger, kube_of(memo))


@kopf.on.resume(GROUP, VERSION, PLURAL)
def on_resume(*, body: kopf.Body, logger: kopf.Logger, memo: kopf.Memo, **_: Any) -> None:
    """After an operator restart: re-apply (idempotent by server-side apply) so nothing drifted while it was away."""
    reconcile(body, logger, kube_of(memo))


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
def on_delete(*, name: str, namespace: str | None, logger: kopf.Logger, **_: Any) -> None:
    # optional=True: no finalizer holds the object; its children go by owner-reference garbage collection.
    logger.info("InferenceService %s/%s deleted; its objects are garbage-collected by owner reference",
                namespace, name)


@kopf.on.event("apps", "v1", "deployments", labels={INSTANCE_LABEL: kopf.PRESENT})
def on_engine_deployment(*, body: kopf.Body, type: str | None, logger: kopf.Logger, memo: kopf.Memo,
                         **_: Any) -> None:
    """An engine Deployment changed (its pods became ready or not): update its InferenceService's readiness."""
    _on_workload(body, type, logger, memo)


# Watched only where the LeaderWorkerSet CRD is installed (kopf warns "Unresolved resources cannot be served" and
# carries on without it, and starts watching when the CRD is created).
@kopf.on.event("leaderworkerset.x-k8s.io", "v1", "leaderworkersets", labels={INSTANCE_LABEL: kopf.PRESENT})
def on_engine_leaderworkerset(*, body: kopf.Body, type: str | None, logger: kopf.Logger, memo: kopf.Memo,
                              **_: Any) -> None:
    """A multi-node replica's LeaderWorkerSet changed: the same readiness update as for a Deployment."""
    _on_workload(body, type, logger, memo)


# A LeaderWorkerSet counts a group ready from its leader pod and the worker StatefulSet's size, not the workers'
# readiness (sigs.k8s.io/lws v0.7.0, leaderworkerset_controller.go): a worker that becomes ready after its leader
# changes no LeaderWorkerSet status, so the pods of groups are watched themselves.
@kopf.on.event("", "v1", "pods", labels={INSTANCE_LABEL: kopf.PRESENT, LWS_WORKER_INDEX_LABEL: kopf.PRESENT})
def on_group_pod(*, body: kopf.Body, type: str | None, logger: kopf.Logger, memo: kopf.Memo, **_: Any) -> None:
    """A pod of a multi-node replica changed, or went (its group is down): the same readiness update as for its
    workload."""
    _readiness_of(body, logger, memo)


def _on_workload(body: kopf.Body, type: str | None, logger: kopf.Logger, memo: kopf.Memo) -> None:
    if type == "DELETED":
        return
    _readiness_of(body, logger, memo)


def _readiness_of(body: kopf.Body, logger: kopf.Logger, memo: kopf.Memo) -> None:
    name, namespace = body.metadata.labels[INSTANCE_LABEL], body.metadata.namespace or "default"
    loop = autotune_loop_of(memo)
    if loop is not None:
        loop.poke(namespace, name)  # an engine restarted or went unready: an open trial fails now, not at its end
    update_readiness(name, namespace, logger, kube_of(memo))


# One readiness update at a time per InferenceService: kopf runs the handlers of different objects at once (a
# group's pods, its LeaderWorkerSet), and an update that read the pods before another's must not write after it (a
# stale "worker not ready" landing last, with no later event to correct it).
_READINESS_LOCKS: dict[tuple[str, str], threading.Lock] = {}
_READINESS_LOCKS_GUARD = threading.Lock()


def update_readiness(name: str, namespace: str, logger: kopf.Logger, client: kube_module.Kube) -> None:
    """Pods ready, the Ready condition, phase, and the KV blocks each engine actually allocated (its /info), judged
    against the plan in the status."""
    with _READINESS_LOCKS_GUARD:
        lock = _READINESS_LOCKS.setdefault((namespace, name), threading.Lock())
    with lock:
        _update_readiness(name, namespace, logger, client)


def _update_readiness(name: str, namespace: str, logger: kopf.Logger, client: kube_module.Kube) -> None:
    obj = client.get_inference_service(namespace, name)
    status = (obj or {}).get("status") or {}
    sel = status.get("selector")
    if obj is None or not sel or not st.engines_expected(status):
        return  # no plan yet, a failed plan, or nothing deployed: nothing to judge
    pods = client.engine_pods(namespace, sel)
    ready = sum(1 for p in pods if p.ready)
    engines = engine_http.read_engines(pods)
    update = client.update_status(namespace, name, lambda o: st.readiness(
        o.get("status") or {}, ready, engines, o["metadata"].get("generation"), st.now_rfc3339()))
    if update is None:
        return
    crash = st.condition(update.new, "Ready") or {}
    if crash.get("reason") in st.ENGINE_CRASH_REASONS and crash.get("reason") != (
            st.condition(update.old, "Ready") or {}).get("reason"):  # once per change, not per workload event
        kopf.warn(kopf.Body(cast(kopf.RawBody, obj)), reason=str(crash["reason"]),
                  message=str(crash.get("message", ""))[:1024])
        logger.warning("%s/%s: %s", namespace, name, crash.get("message"))
    if update.new.get("phase") != "Ready" or update.old.get("phase") == "Ready":
        return
    message = str((st.condition(update.new, "Ready") or {}).get("message", ""))
    kopf.info(kopf.Body(cast(kopf.RawBody, obj)), reason="Ready", message=message)
    logger.info("%s/%s ready: %s", namespace, name, message)
