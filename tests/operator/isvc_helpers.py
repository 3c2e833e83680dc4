"""Helpers of the operator tests: the examples, the CRD schema, defaulting, pruning and a CEL evaluator."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p for p in (REPO / "examples").glob("*.yaml"))


def load_yaml(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict)
    return data


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """What the API server does before validation: fill defaults, recursively; numbers of `number` become floats."""
    kind = schema.get("type")
    if kind == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind == "object" and isinstance(value, dict):
        out = dict(value)
        props = schema.get("properties", {})
        for key, sub in props.items():
            if key not in out and "default" in sub:
                out[key] = copy.deepcopy(sub["default"])
            if key in out:
                out[key] = apply_defaults(sub, out[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in out:
                if key not in props:
                    out[key] = apply_defaults(extra, out[key])
        return out
    if kind == "array" and isinstance(value, list):
        return [apply_defaults(schema.get("items", {}), v) for v in value]
    return value


def unknown_fields(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """Fields the API server would prune (a typo in an example would vanish silently)."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    found: list[str] = []
    if isinstance(value, dict) and schema.get("type") == "object":
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, sub in value.items():
            if props is not None and key in props:
                found += unknown_fields(props[key], sub, f"{path}.{key}")
            elif isinstance(extra, dict):
                found += unknown_fields(extra, sub, f"{path}.{key}")
            elif props is not None and path != ".metadata":
                found.append(f"{path}.{key}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            found += unknown_fields(schema["items"], item, f"{path}[{i}]")
    return found


def cel_failures(schema: dict[str, Any], value: Any) -> list[str]:
    """Messages of the x-kubernetes-validations rules that `value` breaks, evaluated with a CEL interpreter."""
    import celpy

    env = celpy.Environment()
    failed: list[str] = []

    def walk(node: dict[str, Any], v: Any) -> None:
        for rule in node.get("x-kubernetes-validations", []):
            result = env.program(env.compile(rule["rule"])).evaluate({"self": celpy.json_to_cel(v)})
            if isinstance(result, Exception):
                raise result
            if not bool(result):
                failed.append(cel_message(rule, v))
        if isinstance(v, dict):
            for key, sub in node.get("properties", {}).items():
                if key in v:
                    walk(sub, v[key])
        if isinstance(v, list) and "items" in node:
            for item in v:
                walk(node["items"], item)

    walk(schema, value)
    return failed


def cel_message(rule: dict[str, str], value: Any) -> str:
    """The message the API server would show: messageExpression when it evaluates, else message."""
    import celpy

    if "messageExpression" not in rule:
        return rule["message"]
    env = celpy.Environment()
    program = env.program(env.compile(rule["messageExpression"]), functions={"format": _cel_format})
    return str(program.evaluate({"self": celpy.json_to_cel(value)}))


def _cel_format(template: Any, args: Any) -> Any:
    """Kubernetes' CEL strings extension `'...'.format([...])` for %d and %s (celpy lacks it)."""
    import celpy

    return celpy.celtypes.StringType(str(template) % tuple(int(a) if isinstance(a, int) else str(a) for a in args))
