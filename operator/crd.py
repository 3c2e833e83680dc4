"""The InferenceService CustomResourceDefinition, derived from the pydantic models of `api.py`.

The models are the one source: their JSON schema is rewritten into a Kubernetes *structural* schema (every node
typed, `$ref`s inlined, no `anyOf` of types, no `additionalProperties: false`, OpenAPI v3.0 exclusive bounds),
and the CEL rules declared beside each model's validator travel as `x-kubernetes-validations`. The committed file
`deploy/crds/inferenceservices.npuserve.io.yaml` and its copy in the Helm chart (`deploy/helm/npuserve/crds/`, which
Helm installs before the templates) must equal `crd_yaml()`; tests check both, and
`NPUSERVE_UPDATE_CRD=1 pytest tests/operator/test_crd.py` rewrites both (`write_crd`) without checking.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from npuserve.planning import api

CRD_FILE = "deploy/crds/inferenceservices.npuserve.io.yaml"
HELM_CRD_FILE = "deploy/helm/npuserve/crds/inferenceservices.npuserve.io.yaml"

# Keys of a JSON schema node that Kubernetes' JSONSchemaProps accepts (plus our x-kubernetes-* ones).
_DROP = {"title"}
_KEY_ORDER = ("type", "description", "required", "properties", "additionalProperties", "items")


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        if "$ref" in node:
            name = node["$ref"].rsplit("/", 1)[-1]
            target = _resolve(copy.deepcopy(defs[name]), defs)
            rest = {k: v for k, v in node.items() if k != "$ref"}
            return {**target, **_resolve(rest, defs)}
        return {k: _resolve(v, defs) for k, v in node.items()}
    if isinstance(node, list):
        return [_resolve(v, defs) for v in node]
    return node


def _structural(node: dict[str, Any]) -> dict[str, Any]:
    """One schema node, rewritten to the structural subset."""
    node = dict(node)
    if "anyOf" in node:
        options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
        if node.get("default", ...) is None:
            node.pop("default")
        if len(options) == 1:
            node = {**options[0], **node}
        elif node.get("x-kubernetes-preserve-unknown-fields"):
            pass  # a scalar of several types (number or boolean): kept as is, untyped
        else:
            raise ValueError(f"a union of types has no structural form: {options}")
    if "const" in node:
        node["enum"] = [node.pop("const")]
    for bound, exclusive in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if bound in node and not isinstance(node[bound], bool):
            node[exclusive] = node.pop(bound)
            node[bound] = True
    if node.get("additionalProperties") is False:
        del node["additionalProperties"]
    if "properties" in node:
        node["properties"] = {k: _structural(v) for k, v in node["properties"].items()}
        node.setdefault("type", "object")
    if isinstance(node.get("additionalProperties"), dict):
        node["additionalProperties"] = _structural(node["additionalProperties"])
    if "items" in node:
        node["items"] = _structural(node["items"])
    if "enum" in node and "type" not in node:
        values = node["enum"]
        node["type"] = "string" if all(isinstance(v, str) for v in values) else "integer"
    for key in _DROP:
        node.pop(key, None)
    first = [k for k in _KEY_ORDER if k in node]
    return {k: node[k] for k in first + sorted(set(node) - set(first))}


def _complete_defaults(node: dict[str, Any]) -> dict[str, Any]:
    """Object defaults with their properties' own defaults filled in (bottom-up).

    The API server validates a default against the schema's CEL rules as written, without applying the nested
    defaults first: `slo: {default: {}}` fails `self.objective != 'decodeLatency' || ...` with "no such key:
    objective" and the CRD is refused. A default of `{objective: throughput, statistic: mean}` is what the API
    server stores anyway, so spelling it out changes no object."""
    for key in ("properties",):
        if key in node:
            node[key] = {k: _complete_defaults(v) for k, v in node[key].items()}
    if "items" in node:
        node["items"] = _complete_defaults(node["items"])
    if isinstance(node.get("default"), dict) and "properties" in node:
        filled = dict(node["default"])
        for name, prop in node["properties"].items():
            if name not in filled and "default" in prop:
                filled[name] = copy.deepcopy(prop["default"])
        node["default"] = filled
    return node


def openapi_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of one pydantic model."""
    raw = model.model_json_schema(mode="validation")
    defs = raw.pop("$defs", {})
    return _complete_defaults(_structural(_resolve(raw, defs)))


def _metadata_schema() -> dict[str, Any]:
    # Kubernetes allows restrictions on metadata.name only; ours keep derived names (Service, pods) legal.
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": api.NAME_MAX_LENGTH, "pattern": api.NAME_PATTERN},
        },
    }


PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Cards", "type": "integer", "jsonPath": ".status.plan.worldSize",
     "description": "cards per replica (worldSize)"},
    {"name": "Replicas", "type": "integer", "jsonPath": ".status.plan.replicas", "priority": 1},
    # The last window measured: its own maxBatchSize beside its figures (status.observed), not the schedule applied
    # since (a new trial's), which has no figures yet.
    {"name": "MaxBatchSize", "type": "integer", "jsonPath": ".status.observed.maxBatchSize",
     "description": "maxBatchSize of the last window measured (TTFT, TPOT and tok/s are that window's)"},
    {"name": "TTFT", "type": "number", "jsonPath": ".status.observed.ttftMs",
     "description": "TTFT of the last window measured, ms"},
    {"name": "TPOT", "type": "number", "jsonPath": ".status.observed.tpotMs",
     "description": "TPOT of the last window measured, ms"},
    {"name": "Tok/s", "type": "integer", "jsonPath": ".status.observed.outputTokensPerSecond",
     "description": "output tokens/s of the last window measured"},
    {"name": "SLO Met", "type": "string", "jsonPath": '.status.conditions[?(@.type=="SLOMet")].status'},
    {"name": "Tuning", "type": "string", "jsonPath": ".status.tuning.phase",
     "description": "the tuner: Running, Converged, Stopped or Failed"},
    {"name": "Trials", "type": "integer", "jsonPath": ".status.tuning.trial", "description": "trials measured"},
    {"name": "Applied", "type": "integer", "jsonPath": ".status.schedule.maxBatchSize", "priority": 1,
     "description": "maxBatchSize applied now (the plan's, then the tuner's: a trial's before its window is measured)"},
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def build_crd() -> dict[str, Any]:
    spec = openapi_schema(api.InferenceServiceSpec)
    status = openapi_schema(api.InferenceServiceStatus)
    spec["description"] = ("What to serve, on what, for which traffic and SLO "
                           "(docs/planning.md#the-inferenceservice-crd).")
    status["description"] = "What the operator planned, deployed, observed and tuned."
    root = {
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": _metadata_schema(),
            "spec": spec,
            "status": status,
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{api.PLURAL}.{api.GROUP}",
            "labels": {"app.kubernetes.io/part-of": "npuserve"},
        },
        "spec": {
            "group": api.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": api.KIND,
                "listKind": f"{api.KIND}List",
                "plural": api.PLURAL,
                "singular": api.SINGULAR,
                "shortNames": list(api.SHORT_NAMES),
                "categories": ["npuserve"],
            },
            "versions": [
                {
                    "name": api.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": root},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                }
            ],
        },
    }


def crd_yaml() -> str:
    header = (
        "# Generated from planning/api.py by operator/crd.py; do not edit by hand.\n"
        "# Regenerate: NPUSERVE_UPDATE_CRD=1 .venv/bin/pytest tests/operator/test_crd.py\n"
    )
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=120)


def write_crd(repo: Path) -> list[Path]:
    """Writes the generated CRD and the chart's copy under the repository root `repo`; returns their paths."""
    text = crd_yaml()
    paths = [repo / CRD_FILE, repo / HELM_CRD_FILE]
    for path in paths:
        path.write_text(text)
    return paths
