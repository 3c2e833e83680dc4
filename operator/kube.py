"""The operator's only contact with the API server: server-side apply, pruning, and reading engine pods.

Server-side apply under one field manager makes every reconcile idempotent (a restarted operator re-applies the
same objects: no duplicates), and leaves fields owned by others (the HPA's replicas, a user's annotations) alone.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable
from typing import Any, cast

import httpx
from kubernetes import client, config
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import NotFoundError, ResourceNotFoundError

from .render import ENGINE_PORT, INSTANCE_LABEL
from .status import EngineReport

log = logging.getLogger(__name__)

FIELD_MANAGER = "npuserve-operator"
MISSING_KIND_TTL = 60.0
GROUP, VERSION, PLURAL = "npuserve.io", "v1alpha1", "inferenceservices"
# Every kind the renderer can produce: what prune looks at. Kinds whose API is not installed are skipped.
MANAGED_KINDS: tuple[tuple[str, str], ...] = (
    ("v1", "ConfigMap"),
    ("v1", "Service"),
    ("apps/v1", "Deployment"),
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
)


class Kube:
    def __init__(self, api_client: client.ApiClient | None = None) -> None:
        if api_client is None:
            try:
                config.load_incluster_config()  # type: ignore[no-untyped-call]
            except config.ConfigException:
                # KUBECONFIG as it is now: the client library's default is read once, when it is imported.
                config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))  # type: ignore[no-untyped-call]
            api_client = client.ApiClient()
        self.api_client = api_client
        self.dynamic = DynamicClient(api_client)  # type: ignore[no-untyped-call]
        self.core = client.CoreV1Api(api_client)
        self.apps = client.AppsV1Api(api_client)
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

    def apply(self, manifest: dict[str, Any]) -> None:
        resource = self._resource(manifest["apiVersion"], manifest["kind"])
        if resource is None:
            raise ResourceNotFoundError(f"the API server does not serve {manifest['apiVersion']} "
                                        f"{manifest['kind']}; install its CRD")
        meta = manifest["metadata"]
        resource.server_side_apply(body=manifest, name=meta["name"], namespace=meta.get("namespace"),
                                   field_manager=FIELD_MANAGER, force_conflicts=True)

    def prune(self, namespace: str, instance: str, keep: Iterable[dict[str, Any]]) -> list[str]:
        """Deletes objects this operator made for `instance` that the current render no longer has."""
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

    def get_inference_service(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            obj = cast(dict[str, Any],
                       self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name))
        except client.ApiException as e:
            if e.status == 404:
                return None
            raise
        return obj

    def patch_inference_service_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, name,
                                                          {"status": status})

    def ready_pods(self, namespace: str, selector: str) -> tuple[int, list[tuple[str, str | None, bool]]]:
        """(ready count, [(pod, podIP, ready)]) of the engine pods."""
        pods = self.core.list_namespaced_pod(namespace, label_selector=selector).items
        out: list[tuple[str, str | None, bool]] = []
        for pod in pods:
            meta, status = pod.metadata, pod.status
            if meta is None or status is None or meta.deletion_timestamp is not None:
                continue
            ready = any(c.type == "Ready" and c.status == "True" for c in (status.conditions or []))
            out.append((str(meta.name), status.pod_ip, ready))
        return sum(1 for _, _, r in out if r), out


def read_engines(pods: list[tuple[str, str | None, bool]], port: int = ENGINE_PORT,
                 timeout: float = 2.0) -> list[EngineReport]:
    """Each ready engine's /info (the KV blocks it actually allocated)."""
    reports = []
    for name, ip, ready in pods:
        if not ip:
            reports.append(EngineReport(name, False, error="no pod IP yet"))
            continue
        if not ready:
            reports.append(EngineReport(name, False, error="not ready"))
            continue
        try:
            info = httpx.get(f"http://{ip}:{port}/info", timeout=timeout).json()
            reports.append(EngineReport(name, True, kv_blocks=int(info["kv_blocks"])))
        except (httpx.HTTPError, ValueError, KeyError) as e:
            reports.append(EngineReport(name, True, error=f"/info unreadable: {e}"))
    return reports
