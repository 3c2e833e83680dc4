"""The operator's contact with the API server: server-side apply, pruning, reading the engine pods, and the autotune
loop's Secrets, Jobs, scale and events. The status writer is `status_writer.py`; the engines' HTTP (`/info`, `PUT
/admin/schedule`) is `engine_http.py`.

Server-side apply under one field manager makes every reconcile idempotent (a restarted operator re-applies the
same objects: no duplicates) and leaves fields owned by other managers (a user's annotations and labels) alone.
Nothing in npuserve makes a HorizontalPodAutoscaler: the operator owns the workload's replicas (the plan's), and a
`kubectl scale` of the InferenceService changes `spec.replicas`, which re-plans.
"""

from __future__ import annotations

import base64
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import UTC, datetime
from typing import Any

from kubernetes import client, config
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import NotFoundError, ResourceNotFoundError
from kubernetes.utils import parse_quantity

from npuserve.planning.api import GROUP, PLURAL, VERSION

from .autotune_types import JobPhase, PodState, Status, Termination
from .engine_http import EnginePod
from .names import ENGINE_CONTAINER, INSTANCE_LABEL, LWS_GROUP_INDEX_LABEL, LWS_WORKER_INDEX_LABEL
from .status_writer import StatusUpdate, get_inference_service, update_status

log = logging.getLogger(__name__)

FIELD_MANAGER = "npuserve-operator"
MISSING_KIND_TTL = 60.0
# Every kind the renderer can produce: what prune looks at. Kinds whose API is not installed are skipped.
MANAGED_KINDS: tuple[tuple[str, str], ...] = (
    ("v1", "ConfigMap"),
    ("v1", "Service"),
    ("apps/v1", "Deployment"),
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
)
# Kinds whose API a cluster may lack, and what to install for each.
INSTALL_HINTS: dict[str, str] = {
    "LeaderWorkerSet": "the LeaderWorkerSet controller and its CRD (https://lws.sigs.k8s.io)",
    "PodMonitor": "the Prometheus Operator's CRDs (monitoring.coreos.com), or set spec.monitoring.podMonitor false",
}
# Kinds an InferenceService runs without: skipped with a warning event when their API is not served.
OPTIONAL_KINDS = frozenset({"PodMonitor"})


def engine_termination(status: client.V1PodStatus) -> tuple[int, Termination | None]:
    """The engine container's restart count and how it last ended: its terminated state now (it is down), else the
    last one (it was restarted); None if it never ended."""
    for c in status.container_statuses or []:
        if c.name != ENGINE_CONTAINER:
            continue
        ended = (c.state.terminated if c.state is not None else None) or (
            c.last_state.terminated if c.last_state is not None else None)
        if ended is None:
            return int(c.restart_count or 0), None
        return int(c.restart_count or 0), Termination(int(ended.exit_code), ended.reason,
                                                      (ended.message or "").strip() or None)
    return 0, None


class Kube:
    def __init__(self, api_client: client.ApiClient | None = None) -> None:
        if api_client is None:
            try:
                config.load_incluster_config()  # type: ignore[no-untyped-call]
            except config.ConfigException:
                # KUBECONFIG as it is now: the client library's default is read once, when it is imported.
                config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))  # type: ignore[no-untyped-call]
            configuration = client.Configuration.get_default_copy()
            # kopf's 16 handler threads and the autotune loop share it: a pool of the default 10 connections
            # discarded the others ("Connection pool is full") and opened new ones for each call.
            configuration.connection_pool_maxsize = 32
            api_client = client.ApiClient(configuration)
        self.api_client = api_client
        self.dynamic = DynamicClient(api_client)  # type: ignore[no-untyped-call]
        self.core = client.CoreV1Api(api_client)
        # The dynamic client's discovery cache is not thread-safe: kopf runs handlers in a thread pool, and
        # concurrent lookups raised KeyError ('resources', 'apis') inside it, which kopf retried a minute later.
        self._discovery_lock = threading.Lock()
        self._resources: dict[tuple[str, str], tuple[Any | None, float]] = {}
        self.custom = client.CustomObjectsApi(api_client)

    def _resource(self, api_version: str, kind: str) -> Any | None:
        """The API resource of a kind, None if the API server does not serve it (looked up again after a minute:
        a CRD may be installed later)."""
        key = (api_version, kind)
        with self._discovery_lock:
            cached = self._resources.get(key)
            if cached is not None and (cached[0] is not None or time.monotonic() - cached[1] < MISSING_KIND_TTL):
                return cached[0]
            try:
                found = self.dynamic.resources.get(api_version=api_version, kind=kind)
            except ResourceNotFoundError:
                found = None
            self._resources[key] = (found, time.monotonic())
            return found

    def serves(self, manifest: Mapping[str, Any]) -> bool:
        """Whether the API server serves this manifest's kind (a CRD such as PodMonitor may be missing)."""
        return self._resource(manifest["apiVersion"], manifest["kind"]) is not None

    def apply(self, manifest: dict[str, Any]) -> None:
        resource = self._resource(manifest["apiVersion"], manifest["kind"])
        if resource is None:
            raise ResourceNotFoundError(f"the API server does not serve {manifest['apiVersion']} "
                                        f"{manifest['kind']}; install {INSTALL_HINTS.get(manifest['kind'], 'its CRD')}")
        meta = manifest["metadata"]
        resource.server_side_apply(body=manifest, name=meta["name"], namespace=meta.get("namespace"),
                                   field_manager=FIELD_MANAGER, force_conflicts=True)

    def prune(self, namespace: str, instance: str, keep: Iterable[Mapping[str, Any]]) -> list[str]:
        """Deletes objects this operator made for `instance` that `keep` (the current render) does not have."""
        wanted = {(m["kind"], m["metadata"]["name"]) for m in keep}
        removed = []
        for api_version, kind in MANAGED_KINDS:
            resource = self._resource(api_version, kind)
            if resource is None:
                continue
            found = resource.get(namespace=namespace, label_selector=f"{INSTANCE_LABEL}={instance}")
            for item in found.items:
                name = item.metadata.name
                if (kind, name) not in wanted:
                    try:
                        resource.delete(name=name, namespace=namespace)
                        removed.append(f"{kind}/{name}")
                    except NotFoundError:
                        pass
        return removed

    def create_if_absent(self, manifest: dict[str, Any]) -> bool:
        """Create the object unless one of its name exists (a Secret's token is made once and kept); True if made."""
        resource = self._resource(manifest["apiVersion"], manifest["kind"])
        if resource is None:
            raise ResourceNotFoundError(f"the API server does not serve {manifest['apiVersion']} {manifest['kind']}")
        try:
            resource.create(body=manifest, namespace=manifest["metadata"].get("namespace"))
        except client.ApiException as e:
            if e.status == 409:
                return False
            raise
        return True

    def get_inference_service(self, namespace: str, name: str) -> dict[str, Any] | None:
        return get_inference_service(self.custom, namespace, name)

    def update_status(self, namespace: str, name: str, change: Callable[[Mapping[str, Any]], Status | None],
                      read: Mapping[str, Any] | None = None) -> StatusUpdate | None:
        """The one status writer (module docstring)."""
        return update_status(self.custom, namespace, name, change, read=read)

    def engine_pods(self, namespace: str, selector: str) -> list[EnginePod]:
        """The engine pods (not being deleted) and whether each is Ready."""
        return engine_pods(self.core.list_namespaced_pod(namespace, label_selector=selector).items)


def engine_pods(pods: Iterable[client.V1Pod]) -> list[EnginePod]:
    """The engine pods not being deleted: readiness, address, and how their engine container last ended."""
    out: list[EnginePod] = []
    for meta, status, ready in live_pods(pods):
        pod_labels = meta.labels or {}
        restarts, terminated = engine_termination(status)
        out.append(EnginePod(str(meta.name), status.pod_ip, ready, serves_http=serves_http(pod_labels),
                             restarts=restarts, terminated=terminated, group=pod_labels.get(LWS_GROUP_INDEX_LABEL)))
    return out


def serves_http(pod_labels: Mapping[str, str]) -> bool:
    """A Deployment's pod, or a LeaderWorkerSet's leader (worker index 0): the pods that serve the engine's HTTP API;
    a worker pod serves /health and /ready only."""
    return pod_labels.get(LWS_WORKER_INDEX_LABEL) in (None, "0")


def live_pods(pods: Iterable[client.V1Pod]) -> Iterator[tuple[client.V1ObjectMeta, client.V1PodStatus, bool]]:
    """Each pod not being deleted: its metadata, its status and whether it is Ready."""
    for pod in pods:
        meta, status = pod.metadata, pod.status
        if meta is None or status is None or meta.deletion_timestamp is not None:
            continue
        yield meta, status, any(c.type == "Ready" and c.status == "True" for c in (status.conditions or []))


# --- autotune: the engines' admin API, Secrets, Jobs, scale, events -------------------------------------------------


def pod_states(pods: Iterable[client.V1Pod]) -> list[PodState]:
    """The engine pods (not being deleted) as the autotune loop compares them across a trial."""
    out: list[PodState] = []
    for meta, status, ready in live_pods(pods):
        restarts = sum(int(c.restart_count or 0) for c in (status.container_statuses or []))
        out.append(PodState(str(meta.name), str(meta.uid), status.pod_ip, ready, restarts,
                            leader=serves_http(meta.labels or {})))
    return sorted(out, key=lambda p: p.name)


def job_phase(job: client.V1Job | None) -> JobPhase:
    if job is None:
        return "missing"
    for cond in (job.status.conditions if job.status is not None else None) or []:
        if cond.status == "True" and cond.type in ("Complete", "SuccessCriteriaMet"):
            return "succeeded"
        if cond.status == "True" and cond.type in ("Failed", "FailureTarget"):
            return "failed"
    return "active"


class AutotuneKube:
    """The autotune loop's calls, beside `Kube`'s: one API client shared."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self.batch = client.BatchV1Api(kube.api_client)

    def pods(self, namespace: str, selector: str) -> list[PodState]:
        return pod_states(self.kube.core.list_namespaced_pod(namespace, label_selector=selector).items)

    def admin_token(self, namespace: str, secret: str, key: str) -> str | None:
        try:
            found = self.kube.core.read_namespaced_secret(secret, namespace)
        except client.ApiException as e:
            if e.status == 404:
                return None
            raise
        raw = (found.data or {}).get(key)
        return base64.b64decode(raw).decode() if raw else None

    def job_phase(self, namespace: str, name: str) -> JobPhase:
        try:
            return job_phase(self.batch.read_namespaced_job(name, namespace))
        except client.ApiException as e:
            if e.status == 404:
                return "missing"
            raise

    def delete_job(self, namespace: str, name: str) -> None:
        try:
            self.batch.delete_namespaced_job(name, namespace, propagation_policy="Background")
        except client.ApiException as e:
            if e.status != 404:
                raise

    def jobs(self, namespace: str, selector: str) -> list[tuple[str, str | None]]:
        """The Jobs the label selector matches, not being deleted: (name, uid of the controlling owner)."""
        out: list[tuple[str, str | None]] = []
        for job in self.batch.list_namespaced_job(namespace, label_selector=selector).items:
            meta = job.metadata
            if meta is not None and meta.name and meta.deletion_timestamp is None:
                out.append((meta.name, next((o.uid for o in meta.owner_references or [] if o.controller), None)))
        return out

    def scale(self, namespace: str, name: str, replicas: int) -> None:
        """Through the scale subresource, as `kubectl scale` and an HPA do."""
        self.kube.custom.patch_namespaced_custom_object_scale(
            GROUP, VERSION, namespace, PLURAL, name, {"spec": {"replicas": replicas}})

    def pods_per_node(self, resource: str | None, per_pod: float) -> list[int]:
        """How many pods asking `per_pod` of `resource` each schedulable node's allocatable holds."""
        name = resource or "cpu"
        held: list[int] = []
        for node in self.kube.core.list_node().items:
            spec, status = node.spec, node.status
            if (spec is not None and spec.unschedulable) or status is None:
                continue
            value = (status.allocatable or {}).get(name)
            if value:
                # Any quantity the API server writes: "7910m", and "1k" for a thousand (a shared device's count).
                quantity = parse_quantity(str(value))  # type: ignore[no-untyped-call]
                held.append(int(float(quantity) // per_pod))
        return held

    def post_event(self, obj: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
        """A core/v1 Event on the InferenceService (the autotune loop runs outside kopf's handlers, whose event
        queue it cannot use)."""
        meta = obj["metadata"]
        now = datetime.now(UTC)
        event = client.CoreV1Event(
            metadata=client.V1ObjectMeta(generate_name=f"{meta['name']}.", namespace=meta["namespace"]),
            involved_object=client.V1ObjectReference(api_version=obj["apiVersion"], kind=obj["kind"],
                                                     name=meta["name"], namespace=meta["namespace"],
                                                     uid=meta.get("uid"), resource_version=meta.get("resourceVersion")),
            reason=reason, message=message[:1024], type=type_, count=1, first_timestamp=now, last_timestamp=now,
            source=client.V1EventSource(component=FIELD_MANAGER), reporting_component=FIELD_MANAGER,
            reporting_instance=FIELD_MANAGER)
        try:
            self.kube.core.create_namespaced_event(meta["namespace"], event)
        except client.ApiException as e:
            log.warning("event %s on %s/%s not posted: %s %s", reason, meta["namespace"], meta["name"], e.status,
                        e.reason)
