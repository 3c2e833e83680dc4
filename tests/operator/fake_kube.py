"""An in-memory API server for the operator's unit tests: the custom-objects calls of the status writer (with the
API server's optimistic concurrency: a write carrying a stale resourceVersion is answered 409) and the dynamic
client's get/delete/server-side apply, behind the real `Kube` methods."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from kubernetes import client

from npuserve.operator.kube import Kube

# A two-layer model on the CPU, one replica: what the bundled engine serves.
TINY: dict[str, Any] = {
    "apiVersion": "npuserve.io/v1alpha1", "kind": "InferenceService",
    "metadata": {"name": "tiny", "namespace": "team-a", "uid": "u-1", "generation": 1},
    "spec": {"model": {"name": "tiny", "preset": "tiny", "weights": {"loadFormat": "dummy"}},
             "accelerator": {"type": "cpu", "cards": 1, "memoryGiB": 2, "reservedGiB": 0}, "replicas": 1,
             "workload": {"avgInputTokens": 64, "avgOutputTokens": 32, "maxOutputTokens": 64,
                          "maxInputTokens": 256}},
}


def apply_merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386, as the API server applies `application/merge-patch+json`."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = apply_merge_patch(out.get(key), value)
    return out


class FakeStatusApi:
    """get_namespaced_custom_object and patch_namespaced_custom_object_status on one stored object."""

    def __init__(self, obj: dict[str, Any] | None) -> None:
        self.obj = copy.deepcopy(obj)
        if self.obj is not None:
            self.obj["metadata"].setdefault("resourceVersion", "1")
        self.patches: list[dict[str, Any]] = []
        self.conflicts = 0
        # Runs inside the next patch call, before the version check: another writer's update landing in between.
        self.before_next_patch: Callable[[], None] | None = None

    def get_namespaced_custom_object(self, group: str, version: str, namespace: str, plural: str,
                                     name: str) -> dict[str, Any]:
        if self.obj is None:
            raise client.ApiException(status=404, reason="Not Found")
        return copy.deepcopy(self.obj)

    def write(self, status_patch: dict[str, Any]) -> None:
        """A write without a precondition (what the API server does for a patch without a resourceVersion)."""
        assert self.obj is not None
        self.obj["status"] = apply_merge_patch(self.obj.get("status") or {}, status_patch)
        self.obj["metadata"]["resourceVersion"] = str(int(self.obj["metadata"]["resourceVersion"]) + 1)

    def patch_namespaced_custom_object_status(self, group: str, version: str, namespace: str, plural: str,
                                              name: str, body: dict[str, Any]) -> dict[str, Any]:
        hook, self.before_next_patch = self.before_next_patch, None
        if hook is not None:
            hook()
        if self.obj is None:
            raise client.ApiException(status=404, reason="Not Found")
        self.patches.append(copy.deepcopy(body))
        expected = (body.get("metadata") or {}).get("resourceVersion")
        if expected is not None and expected != self.obj["metadata"]["resourceVersion"]:
            self.conflicts += 1
            raise client.ApiException(status=409, reason="Conflict")
        self.write(body.get("status") or {})
        return copy.deepcopy(self.obj)


class FakeResource:
    def __init__(self, kube: FakeKube, kind: str) -> None:
        self.kube, self.kind = kube, kind

    def get(self, namespace: str, label_selector: str) -> SimpleNamespace:
        key, value = label_selector.split("=", 1)
        names = [name for (kind, ns, name), obj in self.kube.objects.items()
                 if kind == self.kind and ns == namespace and obj["metadata"].get("labels", {}).get(key) == value]
        return SimpleNamespace(items=[SimpleNamespace(metadata=SimpleNamespace(name=n)) for n in sorted(names)])

    def delete(self, name: str, namespace: str) -> None:
        del self.kube.objects[(self.kind, namespace, name)]
        self.kube.deleted.append(f"{self.kind}/{name}")

    def create(self, body: dict[str, Any], namespace: str | None) -> None:
        key = (self.kind, namespace or "default", body["metadata"]["name"])
        if key in self.kube.objects:
            raise client.ApiException(status=409, reason="AlreadyExists")
        self.kube.objects[key] = copy.deepcopy(body)
        self.kube.created.append(f"{self.kind}/{body['metadata']['name']}")

    def server_side_apply(self, body: dict[str, Any], name: str, namespace: str | None, field_manager: str,
                          force_conflicts: bool) -> None:
        self.kube.objects[(self.kind, namespace or "default", name)] = copy.deepcopy(body)
        self.kube.applied.append(f"{self.kind}/{name}")


class FakeKube(Kube):
    """The real `Kube` (apply, prune, serves, update_status) over the fakes; `served` lists the kinds whose API the
    fake server has."""

    def __init__(self, obj: dict[str, Any] | None, served: set[str] | None = None) -> None:
        self._discovery_lock = threading.Lock()
        self._resources = {}
        self.custom = FakeStatusApi(obj)  # type: ignore[assignment]
        self.served = served if served is not None else {"ConfigMap", "Service", "Deployment"}  # and Secret, always
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.applied: list[str] = []
        self.deleted: list[str] = []
        self.created: list[str] = []

    def _resource(self, api_version: str, kind: str) -> Any | None:
        return FakeResource(self, kind) if kind in self.served or kind == "Secret" else None

    @property
    def status(self) -> dict[str, Any]:
        obj = self.custom.obj  # type: ignore[attr-defined]
        return dict(obj.get("status") or {})

    def kinds(self) -> list[str]:
        """The rendered objects (the admin Secret, created once and not rendered, is in `created`)."""
        return sorted(f"{kind}/{name}" for kind, _, name in self.objects if kind != "Secret")
