"""The autotune driver: a thread of the operator that runs `autotune.advance` for each InferenceService with
`spec.autotune.enabled`, every LOOP_INTERVAL_S.

Why a thread and not a kopf timer or daemon: kopf puts a finalizer on every object with a timer or daemon, and a
finalizer blocks `kubectl delete` while the operator is down. The thread keeps the no-finalizer design: the kopf
event handler only tells it which InferenceServices exist, the whole tuning state lives in their status, and the
children (engines, Secret, Jobs) go with their owner by garbage collection. One tick: read the object, gather what
`advance` needs (engine pods, the due Prometheus window, the Job's phase, the replicas the nodes hold), run the
actions it returns (delete a Job, apply a schedule to every engine, create a Job, scale), then write the status
through the one status writer and post the events. The loop never writes the ConfigMap: reconcile does, from
status.tuning.applied (`handlers.on_applied_schedule`), so the ConfigMap has one writer and one source.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from npuserve.catalog.accelerators import get_accelerator

from . import autotune as at
from . import kube as kube_module
from .api import AppliedSchedule, InferenceService, Plan
from .autotune_types import Status
from .names import COMPONENT_LABEL, INSTANCE_LABEL
from .prometheus import Figure, PrometheusClient, Selection, Unreachable, WindowReading
from .render import ADMIN_TOKEN_KEY, LOADGEN_COMPONENT, admin_secret_name, engine_cpus
from .status import engines_expected, plan_of, set_condition

log = logging.getLogger(__name__)

LOOP_INTERVAL_S = 2.0
_OWNED_KEYS = ("tuning", "capacity", "observed", "schedule")
_OWNED_CONDITIONS = ("Tuning", "SLOMet")


class AutotuneLoop:
    def __init__(self, kube: kube_module.Kube, prometheus_url: str | None,
                 interval: float = LOOP_INTERVAL_S) -> None:
        self.kube = kube
        self.calls = kube_module.AutotuneKube(kube)
        self.prometheus = PrometheusClient(prometheus_url) if prometheus_url else None
        self.interval = interval
        self.services: set[tuple[str, str]] = set()
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None

    # -- which InferenceServices --

    def track(self, namespace: str, name: str, wanted: bool) -> None:
        with self.lock:
            (self.services.add if wanted else self.services.discard)((namespace, name))

    def start(self) -> None:
        self.thread = threading.Thread(target=self.run, name="autotune", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(timeout=30)

    def run(self) -> None:
        while not self.stopping.is_set():
            with self.lock:
                services = sorted(self.services)
            for namespace, name in services:
                try:
                    self.tick(namespace, name)
                except Exception:  # one InferenceService's failure must not stop the others' tuning
                    log.exception("autotune of %s/%s failed; trying again", namespace, name)
            self.stopping.wait(self.interval)

    # -- one InferenceService --

    def tick(self, namespace: str, name: str, now: float | None = None) -> at.Actions | None:
        obj = self.kube.get_inference_service(namespace, name)
        if obj is None:
            self.track(namespace, name, False)
            return None
        try:
            isvc = InferenceService.model_validate({k: obj.get(k) for k in ("apiVersion", "kind", "metadata",
                                                                            "spec")})
        except ValidationError:
            return None
        status: Status = obj.get("status") or {}
        if not isvc.spec.autotune.enabled:
            self._stop_tuning(obj, namespace, name, status)
            return None
        plan = plan_of(status) if engines_expected(status) else None
        deployed = any(c.get("type") == "Deployed" and c.get("status") == "True"
                       for c in status.get("conditions") or [])
        if plan is None or not deployed or not status.get("selector"):
            return None
        now = time.time() if now is None else now
        pods = self.calls.pods(namespace, str(status["selector"]))
        obs = self._observe(isvc, plan, status, pods, now)
        actions = at.advance(isvc, plan, status, obs)
        self._act(obj, isvc, plan, pods, actions)
        self.kube.update_status(namespace, name, lambda o: merge_status(o.get("status") or {}, actions.status))
        if actions.create_job is not None:
            self.delete_orphan_jobs(obj, actions.status)
        for type_, reason, message in actions.events:
            self.calls.post_event(obj, type_, reason, message)
        return actions

    def delete_orphan_jobs(self, obj: Mapping[str, Any], status: Status) -> list[str]:
        """Delete this InferenceService's load Jobs other than the one `status.tuning.current.job` names. A leader
        that died between creating a trial's Job and writing the status naming it left that Job running; its
        successor opened the trial again with a Job of a new name. Called after a tick that created a Job (the
        successor's first such tick), once the status names it."""
        meta = obj.get("metadata") or {}
        namespace, name, uid = meta.get("namespace") or "default", meta.get("name") or "", meta.get("uid")
        current = ((status.get("tuning") or {}).get("current") or {}).get("job")
        selector = f"{INSTANCE_LABEL}={name},{COMPONENT_LABEL}={LOADGEN_COMPONENT}"
        orphans = sorted(job for job, owner in self.calls.jobs(namespace, selector) if owner == uid and job != current)
        for job in orphans:
            log.warning("%s/%s: deleting the load Job %s, which no open trial names (left by an earlier leader)",
                        namespace, name, job)
            self.calls.delete_job(namespace, job)
        return orphans

    def _observe(self, isvc: InferenceService, plan: Plan, status: Status, pods: list[at.PodState],
                 now: float) -> at.Observation:
        ns, name = isvc.metadata.namespace, isvc.metadata.name
        tuning = at.tuning_of(status)
        current = tuning.current if tuning is not None else None
        # Asked only when the open trial waits for it: a closed window's read says the rest.
        up = self.prometheus is not None and (not at.waits_for_prometheus(status) or self.prometheus.ready())
        measurement = None
        due = at.window_due(isvc, status, now)
        if due is not None and self.prometheus is not None:
            reading = self.prometheus.read_window(Selection(namespace=ns, inference_service=name, pods=due.pods),
                                                  due.start, due.end)
            measurement = measurement_of(reading)
        job = self.calls.job_phase(ns, current.job) if current is not None and current.job else None
        limit = None
        if at.needs_replica_limit(isvc, plan, status):
            acc = get_accelerator(isvc.spec.accelerator.type)
            per_pod = plan.cardsPerPod if acc.resource_name else float(engine_cpus(isvc, plan))
            limit = self.calls.replica_limit(acc.resource_name, per_pod)
            limit = None if limit is None else limit // max(plan.nodes, 1)
        return at.Observation(now=now, pods=pods, measurement=measurement, prometheus=up,
                              prometheus_configured=self.prometheus is not None, job=job, replica_limit=limit)

    def _act(self, obj: Mapping[str, Any], isvc: InferenceService, plan: Plan, pods: list[at.PodState],
             actions: at.Actions) -> None:
        ns, name = isvc.metadata.namespace, isvc.metadata.name
        if actions.delete_job:
            self.calls.delete_job(ns, actions.delete_job)
        if actions.apply is not None:
            self._apply(obj, isvc, plan, pods, actions.apply, actions)
        if actions.create_job is not None:
            self.kube.create_if_absent(actions.create_job)
        if actions.scale is not None:
            self.calls.scale(ns, name, actions.scale)

    def _apply(self, obj: Mapping[str, Any], isvc: InferenceService, plan: Plan, pods: list[at.PodState],
               applied: AppliedSchedule, actions: at.Actions) -> None:
        """The schedule hot on every engine (PUT /admin/schedule, with its generation). The ConfigMap follows
        from the status this tick writes (reconcile's `on_applied_schedule`): a restarted pod keeps the schedule,
        and an engine the PUT missed takes it from its config file."""
        ns = isvc.metadata.namespace
        token = self.calls.admin_token(ns, admin_secret_name(isvc), ADMIN_TOKEN_KEY)
        if token is None:
            actions.events.append(("Warning", "ScheduleNotApplied",
                                   f"the admin Secret {admin_secret_name(isvc)} is missing: the engines take the "
                                   "schedule from the ConfigMap only, when the kubelet refreshes it"))
            return
        errors = kube_module.put_schedule([p for p in pods if p.ready], token, applied.model_dump(exclude_none=True))
        if errors:
            said = "; ".join(f"{pod}: {error}" for pod, error in sorted(errors.items()))
            log.warning("%s/%s: schedule not applied everywhere: %s", ns, isvc.metadata.name, said)
            actions.events.append(("Warning", "ScheduleNotApplied", f"PUT /admin/schedule failed on {said}"))

    def _stop_tuning(self, obj: Mapping[str, Any], namespace: str, name: str, status: Status) -> None:
        """Autotune turned off: end an open trial's Job and close the trial; the ConfigMap goes back to the plan's
        schedule on the reconcile the spec change started."""
        tuning = at.tuning_of(status)
        if tuning is None or tuning.current is None:
            self.track(namespace, name, False)
            return
        if tuning.current.job:
            self.calls.delete_job(namespace, tuning.current.job)

        def close(o: Mapping[str, Any]) -> Status:
            new = dict(o.get("status") or {})
            if new.get("tuning"):
                new["tuning"] = {k: v for k, v in new["tuning"].items() if k != "current"}
            return new

        self.kube.update_status(namespace, name, close)
        self.track(namespace, name, False)


def measurement_of(reading: WindowReading | Unreachable) -> at.Measurement:
    """A Prometheus window as the autotune step reads it."""
    if isinstance(reading, Unreachable):
        return at.Measurement(inconclusive=f"Prometheus unreachable: {reading.error}", reason="PrometheusUnreachable")
    metrics = reading.trial_metrics(min_requests=1)
    if isinstance(metrics, str):
        return at.Measurement(inconclusive=metrics, reason="NoRequestFinished")
    return at.Measurement(metrics=metrics, generations=generations_of(reading))


def generations_of(reading: WindowReading) -> at.GenerationsRun:
    """The engines' schedule-generation gauge over the window, as facts (the step judges them)."""

    def whole(figure: Figure) -> int | None:
        return round(figure) if isinstance(figure, float) else None

    return at.GenerationsRun(lowest=whole(reading.schedule_generation_min),
                             highest=whole(reading.schedule_generation_max),
                             pods=whole(reading.schedule_generation_pods) or 0)


def merge_status(now: Mapping[str, Any], computed: Mapping[str, Any]) -> Status:
    """The status as it is now with what the autotune step owns taken from `computed`: tuning, capacity, observed
    (but the KV blocks readiness writes), the applied schedule, the Tuning and SLOMet conditions, and the phase
    between Ready and Tuning."""
    new: Status = dict(now)
    for key in _OWNED_KEYS:
        if key in computed:
            new[key] = computed[key]
        else:
            new.pop(key, None)
    if "observed" in computed and (now.get("observed") or {}).get("kvBlocksAllocated") is not None:
        new["observed"] = {**computed["observed"], "kvBlocksAllocated": now["observed"]["kvBlocksAllocated"]}
    conditions = list(now.get("conditions") or [])
    for cond in computed.get("conditions") or []:
        if cond.get("type") in _OWNED_CONDITIONS:
            conditions = set_condition(conditions, cond["type"], cond["status"] == "True", cond["reason"],
                                       cond.get("message", ""), cond["lastTransitionTime"],
                                       cond.get("observedGeneration"))
    new["conditions"] = conditions
    if new.get("phase") in ("Ready", "Tuning") and computed.get("phase") in ("Ready", "Tuning"):
        new["phase"] = computed["phase"]
    return new

