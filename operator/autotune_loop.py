"""The autotune driver: a thread of the operator that runs `autotune.advance` for each InferenceService with
`spec.autotune.enabled` when something about it is due.

Why a thread and not a kopf timer or daemon: kopf puts a finalizer on every object with a timer or daemon, and a
finalizer blocks `kubectl delete` while the operator is down. The thread keeps the no-finalizer design: the kopf
event handlers only tell it which InferenceServices exist and when one changed, the whole tuning state lives in
their status, and the children (engines, Secret, Jobs) go with their owner by garbage collection.

When it looks (so that hundreds of InferenceServices cost little): each InferenceService has a time of its next look,
`look_timing.next_look` of its status (its open window's end, the next window after tuning, a recheck while it waits, a
minute at the latest); a change to it that the loop did not write itself, or to its engine workloads, makes it due at
once (`track`, `poke`). Every look at a set of due InferenceServices reads each (one GET, its engine pods; LOOK_WORKERS
at a time), reads every due window from Prometheus together (windows end on a grid, so those that end together are one
query per figure: `PrometheusClient.read_windows`), then for each writes the status `advance` returns through the one
status writer (from the object it read; read again only on a conflict), and only then acts: deletes a Job, applies the
written schedule to every engine, creates the written trial's Job, scales, and posts the events. Record, then act: a
write that fails leaves nothing applied and the next look decides again; a written intent this process has not carried
out (a new leader, acts that raised) is carried out by the next look (`_act`). The loop never writes the ConfigMap:
reconcile does, from status.tuning.applied (`handlers.on_applied_schedule`), so the ConfigMap has one writer and one
source.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from pydantic import ValidationError

from npuserve.catalog.accelerators import get_accelerator
from npuserve.planning.api import AppliedSchedule, InferenceService, Plan

from . import autotune as at
from . import autotune_types as tt
from . import engine_http
from . import kube as kube_module
from . import look_timing as lt
from . import tuning_schedule as ts
from .autotune_types import Status
from .capacity import group_limit
from .names import COMPONENT_LABEL, INSTANCE_LABEL
from .prometheus import Figure, PrometheusClient, Selection, Unreachable, WindowReading
from .render import ADMIN_TOKEN_KEY, LOADGEN_COMPONENT, admin_secret_name, engine_cpus
from .status import engines_expected, plan_of, set_condition

log = logging.getLogger(__name__)

LOOP_INTERVAL_S = 1.0  # the longest the loop sleeps before it looks at what is due (a change wakes it sooner)
LOOK_WORKERS = 8  # threads for the InferenceServices of one look (the Kubernetes client's pool holds 32)
_OWNED_KEYS = ("tuning", "capacity", "observed", "schedule")
_OWNED_CONDITIONS = ("Tuning", "SLOMet")
Key = tuple[str, str]  # namespace, name


@dataclass
class _Look:
    """One InferenceService as read at the start of a look: what `advance` needs but the Prometheus window."""

    obj: Mapping[str, Any]
    isvc: InferenceService
    plan: Plan
    status: Status
    pods: list[tt.PodState]
    due: tt.WindowRequest | None


class AutotuneLoop:
    def __init__(self, kube: kube_module.Kube, prometheus_url: str | None,
                 interval: float = LOOP_INTERVAL_S) -> None:
        self.kube = kube
        self.calls = kube_module.AutotuneKube(kube)
        self.prometheus = PrometheusClient(prometheus_url) if prometheus_url else None
        self.interval = interval
        self.next_look: dict[Key, float] = {}  # the InferenceServices tuned, and when each is due (unix seconds)
        self.outside: dict[Key, str] = {}  # what each last looked like outside the loop's own status keys
        # The intent (`Intent.key`) of each one's written status that this process has carried out (`_act`).
        self.carried: dict[Key, tuple[int | None, str | None]] = {}
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None
        # The calls of one look run on a few threads: each InferenceService's are a handful of round trips to the
        # API server and its engines, and hundreds due at once (an operator that starts) went one after another.
        self._workers = ThreadPoolExecutor(max_workers=LOOK_WORKERS, thread_name_prefix="autotune")

    # -- which InferenceServices, and when --

    def track(self, namespace: str, name: str, wanted: bool, outside: str | None = None) -> None:
        """Tune it or not; `outside` (`outside_signature` of its body) makes it due at once when it differs from
        the last one seen: its spec or what others write in its status changed, not only the loop's own keys."""
        key = (namespace, name)
        with self.lock:
            if not wanted:
                self.next_look.pop(key, None)
                self.outside.pop(key, None)
                self.carried.pop(key, None)
                return
            if key in self.next_look and (outside is None or self.outside.get(key) == outside):
                return
            self.next_look[key] = 0.0
            if outside is not None:
                self.outside[key] = outside
        self.wake.set()

    def poke(self, namespace: str, name: str) -> None:
        """Look at it now, if it is tuned (its engine workload changed)."""
        with self.lock:
            if (namespace, name) not in self.next_look:
                return
            self.next_look[(namespace, name)] = 0.0
        self.wake.set()

    def _schedule(self, key: Key, when: float) -> None:
        with self.lock:
            if key in self.next_look:
                self.next_look[key] = when

    def start(self) -> None:
        self.thread = threading.Thread(target=self.run, name="autotune", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.wake.set()
        if self.thread is not None:
            self.thread.join(timeout=30)
        self._workers.shutdown(wait=False, cancel_futures=True)

    def run(self) -> None:
        while not self.stopping.is_set():
            self.wake.clear()
            try:
                now = time.time()
                with self.lock:
                    due = sorted(k for k, when in self.next_look.items() if when <= now)
                if due:
                    self.look(due)
            except Exception:  # the thread must outlive any bug of one look
                log.exception("an autotune look failed; looking again")
            with self.lock:
                soonest = min(self.next_look.values(), default=time.time() + self.interval)
            self.wake.wait(min(max(soonest - time.time(), 0.0), self.interval))

    # -- a look at the due InferenceServices --

    def look(self, keys: list[Key], now: float | None = None) -> dict[Key, tt.Actions]:
        """Read each, read their due windows from Prometheus together, advance each; the actions taken, by key.
        `now`: the clock for the whole look (tests); by default each part takes the time when it runs, since a look at
        many InferenceServices takes a while."""

        def clock() -> float:
            return time.time() if now is None else now

        def read(key: Key) -> _Look | None:
            try:
                return self._read(key, clock())
            except Exception:  # one InferenceService's failure must not stop the others' tuning
                log.exception("autotune of %s/%s failed; trying again", *key)
                self._schedule(key, clock() + lt.RECHECK_S)
                return None

        looks = {key: r for key, r in zip(keys, self._workers.map(read, keys), strict=True) if r is not None}
        readings = self._read_windows(looks)
        up: dict[str, bool] = {}

        def advance(key: Key) -> tt.Actions | None:
            try:
                return self._advance(looks[key], readings.get(key), clock(), up)
            except Exception:
                log.exception("autotune of %s/%s failed; trying again", *key)
                self._schedule(key, clock() + lt.RECHECK_S)
                return None

        taken = zip(looks, self._workers.map(advance, list(looks)), strict=True)
        return {key: actions for key, actions in taken if actions is not None}

    def _read(self, key: Key, now: float) -> _Look | None:
        namespace, name = key
        obj = self.kube.get_inference_service(namespace, name)
        if obj is None:
            self.track(namespace, name, False)
            return None
        try:
            isvc = InferenceService.model_validate({k: obj.get(k) for k in ("apiVersion", "kind", "metadata",
                                                                            "spec")})
        except ValidationError:
            self._schedule(key, now + lt.IDLE_LOOK_S)  # the API server refuses such specs; a change wakes it
            return None
        status: Status = obj.get("status") or {}
        if not isvc.spec.autotune.enabled:
            self._stop_tuning(obj, namespace, name, status)
            return None
        plan = plan_of(status) if engines_expected(status) else None
        deployed = any(c.get("type") == "Deployed" and c.get("status") == "True"
                       for c in status.get("conditions") or [])
        if plan is None or not deployed or not status.get("selector"):
            self._schedule(key, lt.next_look(isvc, status, now))  # reconcile's writes wake it
            return None
        pods = self.calls.pods(namespace, str(status["selector"]))
        return _Look(obj, isvc, plan, status, pods, lt.window_due(isvc, status, now))

    def _read_windows(self, looks: Mapping[Key, _Look]) -> dict[Key, WindowReading | Unreachable]:
        wanted = [(key, read.due) for key, read in looks.items() if read.due is not None]
        if not wanted or self.prometheus is None:
            return {}
        try:
            readings = self.prometheus.read_windows(
                [(Selection(namespace=k[0], inference_service=k[1], pods=due.pods), due.start, due.end)
                 for k, due in wanted])
        except ValueError:  # a query that answered what it must not: a bug here, said, and nothing measured
            log.exception("reading %d window(s) from Prometheus failed", len(wanted))
            return {}
        return {key: reading for (key, _), reading in zip(wanted, readings, strict=True)}

    def _advance(self, read: _Look, reading: WindowReading | Unreachable | None, now: float,
                 up: dict[str, bool]) -> tt.Actions:
        isvc, status = read.isvc, read.status
        namespace, name = isvc.metadata.namespace, isvc.metadata.name
        key = (namespace, name)
        obs = self._observe(read, reading, now, up)
        actions = at.advance(isvc, read.plan, status, obs)
        # Record, then act (controller-runtime's order): the status naming the trial, its schedule and generation is
        # written first; a write that fails (conflicts exhausted) raises here and nothing is applied, so the next look
        # decides again from the status as it was. What the write records is then carried out.
        update = self.kube.update_status(namespace, name, lambda o: merge_status(o.get("status") or {},
                                                                                   actions.status), read=read.obj)
        if update is None:  # deleted meanwhile: its children go with it
            self.track(namespace, name, False)
            return actions
        written = update.new
        self._act(read, written, actions, now)
        if actions.create_job is not None:
            self.delete_orphan_jobs(read.obj, written)
        for type_, reason, message in actions.events:
            self.calls.post_event(read.obj, type_, reason, message)
        when = lt.next_look(isvc, written, now)
        if when <= now:  # a window due and not read (Prometheus not configured, a bad answer): not in a busy loop
            when = now + (lt.RECHECK_S if read.due is not None and reading is None else self.interval)
        self._schedule(key, when)
        return actions

    def delete_orphan_jobs(self, obj: Mapping[str, Any], status: Status) -> list[str]:
        """Delete this InferenceService's load Jobs other than the one `status.tuning.current.job` names: one whose
        delete failed, or one an older operator (which created the Job before writing the status) left running when
        it died between the two. Called after a look that created a Job, once the status names it."""
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

    def _observe(self, read: _Look, reading: WindowReading | Unreachable | None, now: float,
                 up: dict[str, bool]) -> tt.Observation:
        isvc, plan, status = read.isvc, read.plan, read.status
        ns = isvc.metadata.namespace
        tuning = ts.tuning_of(status)
        current = tuning.current if tuning is not None else None
        # Asked only when the open trial waits for it (once per look): a closed window's read says the rest.
        if self.prometheus is not None and lt.waits_for_prometheus(status) and "ready" not in up:
            up["ready"] = self.prometheus.ready()
        answers = self.prometheus is not None and (not lt.waits_for_prometheus(status) or up["ready"])
        measurement = None
        if read.due is not None and reading is not None:
            measurement = replace(measurement_of(reading), start=read.due.start, end=read.due.end)
        job = self.calls.job_phase(ns, current.job) if current is not None and current.job else None
        limit = None
        if lt.needs_replica_limit(isvc, plan, status):
            acc = get_accelerator(isvc.spec.accelerator.type)
            per_pod = plan.cardsPerPod if acc.resource_name else float(engine_cpus(isvc, plan))
            # Replicas of `nodes` pods, every pod of one on a different node, from what each node's allocatable holds
            # (ignoring what else runs there: the scheduler has the last word).
            limit = group_limit(self.calls.pods_per_node(acc.resource_name, per_pod), plan.nodes)
        return tt.Observation(now=now, pods=read.pods, measurement=measurement, prometheus=answers,
                              prometheus_configured=self.prometheus is not None, job=job, replica_limit=limit)

    def _act(self, read: _Look, written: Status, actions: tt.Actions, now: float) -> None:
        """Carry out what the written status records (`ts.recorded_intent`): the applied schedule on every engine
        and the open trial's Job, unless this process already did for this intent. A new leader, or a look whose
        acts raised after the write, finds the intent not carried out and carries it out again (an engine already
        at that generation answers 409, an existing Job is kept), so the retry heals itself."""
        isvc = read.isvc
        ns, name = isvc.metadata.namespace, isvc.metadata.name
        if actions.delete_job:
            self.calls.delete_job(ns, actions.delete_job)
        intent = ts.recorded_intent(isvc, read.plan, written, read.pods, now)
        with self.lock:
            carried = self.carried.get((ns, name))
        if intent.key != carried:
            if intent.apply is not None and (carried is None or intent.key[0] != carried[0]):
                self._apply(isvc, read.pods, intent.apply, actions)
            if intent.job is not None:
                self.kube.create_if_absent(intent.job)
            with self.lock:
                self.carried[(ns, name)] = intent.key
        if actions.scale is not None:
            self.calls.scale(ns, name, actions.scale)

    def _apply(self, isvc: InferenceService, pods: list[tt.PodState], applied: AppliedSchedule,
               actions: tt.Actions) -> None:
        """The schedule hot on every engine (PUT /admin/schedule, with its generation). The ConfigMap follows
        from the status this look wrote (reconcile's `on_applied_schedule`): a restarted pod keeps the schedule,
        and an engine the PUT missed takes it from its config file."""
        ns = isvc.metadata.namespace
        token = self.calls.admin_token(ns, admin_secret_name(isvc), ADMIN_TOKEN_KEY)
        if token is None:
            actions.events.append(("Warning", "ScheduleNotApplied",
                                   f"the admin Secret {admin_secret_name(isvc)} is missing: the engines take the "
                                   "schedule from the ConfigMap only, when the kubelet refreshes it"))
            return
        # The leaders only: a group is one engine, whose leader runs the scheduler (its workers serve no admin API).
        errors = engine_http.put_schedule([p for p in pods if p.ready and p.leader], token,
                                          applied.model_dump(exclude_none=True))
        if errors:
            said = "; ".join(f"{pod}: {error}" for pod, error in sorted(errors.items()))
            log.warning("%s/%s: schedule not applied everywhere: %s", ns, isvc.metadata.name, said)
            actions.events.append(("Warning", "ScheduleNotApplied", f"PUT /admin/schedule failed on {said}"))

    def _stop_tuning(self, obj: Mapping[str, Any], namespace: str, name: str, status: Status) -> None:
        """Autotune turned off: end an open trial's Job and close the trial; the ConfigMap goes back to the plan's
        schedule on the reconcile the spec change started."""
        tuning = ts.tuning_of(status)
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


def measurement_of(reading: WindowReading | Unreachable) -> tt.Measurement:
    """A Prometheus window as a look of the autotune loop reads it."""
    if isinstance(reading, Unreachable):
        return tt.Measurement(inconclusive=f"Prometheus unreachable: {reading.error}", reason="PrometheusUnreachable")
    metrics = reading.trial_metrics(min_requests=1)
    if isinstance(metrics, str):
        return tt.Measurement(inconclusive=metrics, reason="NoRequestFinished")
    return tt.Measurement(metrics=metrics, generations=generations_of(reading))


def generations_of(reading: WindowReading) -> tt.GenerationsRun:
    """The engines' schedule-generation gauge over the window, as facts (the look judges them)."""

    def whole(figure: Figure) -> int | None:
        return round(figure) if isinstance(figure, float) else None

    return tt.GenerationsRun(lowest=whole(reading.schedule_generation_min),
                             highest=whole(reading.schedule_generation_max),
                             pods=whole(reading.schedule_generation_pods) or 0)


def merge_status(now: Mapping[str, Any], computed: Mapping[str, Any]) -> Status:
    """The status as it is now with what the autotune loop owns taken from `computed`: tuning, capacity, observed
    (but the KV blocks readiness writes), the applied schedule, the Tuning and SLOMet conditions, and the phase
    between Ready and Tuning."""
    new: Status = dict(now)
    for key in _OWNED_KEYS:
        if key in computed:
            new[key] = computed[key]
        else:
            new.pop(key, None)
    blocks = (now.get("observed") or {}).get("kvBlocksAllocated")
    if blocks is not None:  # readiness's, whether or not the loop has observed anything yet
        new["observed"] = {**(computed.get("observed") or {}), "kvBlocksAllocated": blocks}
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



def outside_signature(body: Mapping[str, Any]) -> str:
    """What of an InferenceService the autotune loop does not write itself: its generation and its status but for
    the loop's own keys, conditions and phase. When it changes (a spec change, a new plan, engines that became ready
    or went) the loop looks at it again at once; the loop's own writes do not wake it."""
    status = body.get("status") or {}
    kept = {k: v for k, v in status.items() if k not in (*_OWNED_KEYS, "phase", "conditions")}
    conditions = sorted((str(c.get("type")), str(c.get("status")), str(c.get("reason")), str(c.get("message")))
                        for c in status.get("conditions") or [] if c.get("type") not in _OWNED_CONDITIONS)
    generation = (body.get("metadata") or {}).get("generation")
    return json.dumps([generation, kept, conditions], sort_keys=True, default=str)
