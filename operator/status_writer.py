"""The one status writer of the InferenceService.

Status has one writer, `update_status`: it reads the InferenceService, applies a pure `status -> new status`
function (`status.py`) and sends the difference as a merge patch carrying the object's `metadata.resourceVersion`,
so the API server refuses (409) a write computed from a stale read; it then reads again and re-applies the function.
The reconcile handlers, the readiness handler and the autotune loop all write through it, so none loses another's
update.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, cast

from kubernetes import client

from npuserve.planning.api import GROUP, PLURAL, VERSION

from .autotune_types import Status

log = logging.getLogger(__name__)

STATUS_WRITE_ATTEMPTS = 5


class StatusConflict(RuntimeError):
    """The status write conflicted `STATUS_WRITE_ATTEMPTS` times in a row (kopf retries the handler)."""


class StatusApi(Protocol):
    """The two calls of `kubernetes.client.CustomObjectsApi` the status writer makes."""

    def get_namespaced_custom_object(self, group: str, version: str, namespace: str, plural: str,
                                     name: str) -> object: ...

    def patch_namespaced_custom_object_status(self, group: str, version: str, namespace: str, plural: str,
                                              name: str, body: dict[str, Any]) -> object: ...


@dataclass(frozen=True)
class StatusUpdate:
    """What one status write saw and wrote (`old` == `new` when nothing changed)."""

    old: Status
    new: Status
    attempts: int


def get_inference_service(api: StatusApi, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        return cast(dict[str, Any], api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name))
    except client.ApiException as e:
        if e.status == 404:
            return None
        raise


def merge_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON merge patch (RFC 7386) that turns `old` into `new`: changed keys, removed keys as null, maps
    recursively, lists whole (a merge patch replaces a list)."""
    patch: dict[str, Any] = {}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            sub = merge_patch(before, value)
            if sub:
                patch[key] = sub
        elif key not in old or before != value:
            patch[key] = copy.deepcopy(value)
    for key in old:
        if key not in new:
            patch[key] = None
    return patch


def update_status(api: StatusApi, namespace: str, name: str,
                  change: Callable[[Mapping[str, Any]], Status | None],
                  attempts: int = STATUS_WRITE_ATTEMPTS, read: Mapping[str, Any] | None = None,
                  ) -> StatusUpdate | None:
    """Read the InferenceService, `change` its status (the whole object is passed; it returns the new status, or
    None to leave it), and write the difference with the read's resourceVersion; on 409 Conflict read and apply
    again, at most `attempts` times. None when the object is gone. `read`: the object as the caller just read it,
    used for the first attempt instead of reading it again (a conflict reads it anew)."""
    for attempt in range(1, attempts + 1):
        obj = read if attempt == 1 and read is not None else get_inference_service(api, namespace, name)
        if obj is None:
            return None
        old: Status = obj.get("status") or {}
        new = change(obj)
        patch = merge_patch(old, new) if new is not None else {}
        if not patch:
            return StatusUpdate(old, old if new is None else new, attempt)
        body = {"metadata": {"resourceVersion": obj["metadata"]["resourceVersion"]}, "status": patch}
        try:
            api.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, name, body)
        except client.ApiException as e:
            if e.status == 409:
                log.debug("%s/%s: status write conflicted (attempt %d); reading again", namespace, name, attempt)
                continue
            if e.status == 404:
                return None
            raise
        return StatusUpdate(old, cast(Status, new), attempt)
    raise StatusConflict(f"{namespace}/{name}: the status write conflicted {attempts} times in a row")
