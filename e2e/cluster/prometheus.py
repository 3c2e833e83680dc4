"""Prometheus of the local cluster: its scrape configuration, from the Helm chart's own PodMonitor translated the way
the Prometheus Operator translates one (`generatePodMonitorConfig` in its pkg/prometheus/promcfg.go), so what the
e2e tests scrape is what a Prometheus Operator user's Prometheus scrapes. Pure (dicts in, dicts out); standard
library only. `lifecycle.py` renders the chart, writes the file and runs Prometheus.

Each `podMetricsEndpoints` entry becomes one job `podMonitor/<namespace>/<name>/<index>`: Kubernetes pod discovery
through the API server, then relabelling that keeps the selected, running pods' named port and attaches the target
labels `namespace`, `container`, `pod`, `job` (`<namespace>/<name>`), `endpoint` (the port's name) and each of
`podTargetLabels` under its sanitized name (`npuserve.io/inferenceservice` -> `npuserve_io_inferenceservice`).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# The operator's defaults for the Prometheus object's global section.
GLOBAL_INTERVAL = "30s"

_INVALID_LABEL_CHAR = re.compile(r"[^a-zA-Z0-9_]")
# What the translation understands; anything else in a PodMonitor would change scraping in ways it does not model,
# so it refuses it rather than scrape something other than the operator would.
_SPEC_KEYS = {
    "selector", "namespaceSelector", "podMetricsEndpoints", "podTargetLabels", "jobLabel",
    "sampleLimit", "targetLimit", "labelLimit", "labelNameLengthLimit", "labelValueLengthLimit",
}  # fmt: skip
_ENDPOINT_KEYS = {
    "port", "portNumber", "targetPort", "path", "scheme", "params", "interval", "scrapeTimeout", "honorLabels",
    "honorTimestamps", "filterRunning", "relabelings", "metricRelabelings", "enableHttp2", "followRedirects",
}  # fmt: skip
_LIMITS = {
    "sampleLimit": "sample_limit",
    "targetLimit": "target_limit",
    "labelLimit": "label_limit",
    "labelNameLengthLimit": "label_name_length_limit",
    "labelValueLengthLimit": "label_value_length_limit",
}
_ENDPOINT_FIELDS = {
    "interval": "scrape_interval",
    "scrapeTimeout": "scrape_timeout",
    "path": "metrics_path",
    "params": "params",
    "scheme": "scheme",
}
_FINISHED = "(Failed|Succeeded)"
# Sharding: the operator ends every job with these, $(SHARD) filled in by its config reloader; with one shard (the
# default) that is 0, and they keep every target.
_SHARDING: list[dict[str, Any]] = [
    {
        "source_labels": ["__address__", "__tmp_hash"],
        "target_label": "__tmp_hash",
        "regex": "(.+);",
        "replacement": "$1",
        "action": "replace",
    },
    {"source_labels": ["__tmp_hash"], "target_label": "__tmp_hash", "modulus": 1, "action": "hashmod"},
    {"source_labels": ["__tmp_hash", "__tmp_disable_sharding"], "regex": "0;|.+;.+", "action": "keep"},
]


@dataclass(frozen=True)
class ApiServer:
    """How Prometheus reaches the API server (the Prometheus object's `apiserverConfig`): URL and client TLS files."""

    url: str
    ca_file: str
    cert_file: str
    key_file: str


def sanitize_label_name(name: str) -> str:
    """A Kubernetes label name as a Prometheus label name (the operator's sanitizeLabelName)."""
    return _INVALID_LABEL_CHAR.sub("_", name)


def find_podmonitor(objects: Iterable[Mapping[str, Any] | None]) -> dict[str, Any]:
    """The one PodMonitor among rendered manifests (`helm template` output, parsed)."""
    found = [dict(o) for o in objects if o and o.get("kind") == "PodMonitor"]
    if len(found) != 1:
        raise ValueError(f"expected exactly one PodMonitor among the rendered objects, found {len(found)}")
    return found[0]


def _namespaces(spec: Mapping[str, Any], own: str) -> list[str]:
    """namespaceSelector: any -> every namespace (no list), matchNames -> those, neither -> the monitor's own."""
    selector = spec.get("namespaceSelector") or {}
    if selector.get("any"):
        return []
    return list(selector.get("matchNames") or []) or [own]


def _label_pair(key: str) -> list[str]:
    name = sanitize_label_name(key)
    return [f"__meta_kubernetes_pod_label_{name}", f"__meta_kubernetes_pod_labelpresent_{name}"]


def _selector_relabelings(selector: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Exact matches first (sorted by key, as the operator does), then the set-based expressions."""
    out: list[dict[str, Any]] = []
    labels: Mapping[str, str] = selector.get("matchLabels") or {}
    for key in sorted(labels):
        out.append({"action": "keep", "source_labels": _label_pair(key), "regex": f"({labels[key]});true"})
    for exp in selector.get("matchExpressions") or []:
        key, op, values = exp["key"], exp["operator"], exp.get("values") or []
        if op in ("In", "NotIn"):
            action = "keep" if op == "In" else "drop"
            out.append({"action": action, "source_labels": _label_pair(key), "regex": f"({'|'.join(values)});true"})
        elif op in ("Exists", "DoesNotExist"):
            action = "keep" if op == "Exists" else "drop"
            out.append({"action": action, "source_labels": _label_pair(key)[1:], "regex": "true"})
        else:
            raise ValueError(f"selector operator {op!r} is not a label selector operator")
    return out


def _relabel_configs(configs: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A monitor's own (metric) relabelings in Prometheus' spelling (the operator's generateRelabelConfig)."""
    out = []
    for c in configs:
        r: dict[str, Any] = {}
        if c.get("sourceLabels"):
            r["source_labels"] = list(c["sourceLabels"])
        if c.get("separator") is not None:  # "" is a separator too
            r["separator"] = c["separator"]
        for src, dst in (("targetLabel", "target_label"), ("regex", "regex"), ("modulus", "modulus")):
            if c.get(src):
                r[dst] = c[src]
        if c.get("replacement") is not None:
            r["replacement"] = c["replacement"]
        if c.get("action"):
            r["action"] = str(c["action"]).lower()
        out.append(r)
    return out


def _keep(source: str, regex: str) -> dict[str, Any]:
    return {"action": "keep", "source_labels": [source], "regex": regex}


def _copy(source: str, target: str, *, nonempty: bool = False) -> dict[str, Any]:
    """Copy a discovery label onto the target; `nonempty`: only when it has a value (the operator's podTargetLabels
    and jobLabel rules)."""
    rule: dict[str, Any] = {"source_labels": [source], "target_label": target}
    return {**rule, "regex": "(.+)", "replacement": "${1}"} if nonempty else rule


def _port_rules(ep: Mapping[str, Any]) -> tuple[list[dict[str, Any]], str | None]:
    """The rule that keeps the endpoint's container port, and the `endpoint` label's value (none for a number)."""
    port, number, target = ep.get("port"), ep.get("portNumber"), ep.get("targetPort")
    if port:
        return [_keep("__meta_kubernetes_pod_container_port_name", str(port))], str(port)
    if number:
        return [_keep("__meta_kubernetes_pod_container_port_number", str(number))], None
    if isinstance(target, str) and target:  # deprecated targetPort, by name or number
        return [_keep("__meta_kubernetes_pod_container_port_name", target)], target
    if isinstance(target, int) and target:
        return [_keep("__meta_kubernetes_pod_container_port_number", str(target))], str(target)
    return [], None


def podmonitor_scrape_configs(podmonitor: Mapping[str, Any], api: ApiServer) -> list[dict[str, Any]]:
    """The `scrape_configs` entries the Prometheus Operator generates for `podmonitor` (one per endpoint)."""
    meta, spec = podmonitor["metadata"], podmonitor["spec"]
    ns, name = meta["namespace"], meta["name"]
    unknown = set(spec) - _SPEC_KEYS
    if unknown:
        raise ValueError(f"PodMonitor {ns}/{name}: fields not translated: {', '.join(sorted(unknown))}")
    sd: dict[str, Any] = {"role": "pod"}
    namespaces = _namespaces(spec, ns)
    if namespaces:
        sd["namespaces"] = {"names": namespaces}
    sd["api_server"] = api.url
    sd["tls_config"] = {"ca_file": api.ca_file, "cert_file": api.cert_file, "key_file": api.key_file}

    configs: list[dict[str, Any]] = []
    for i, ep in enumerate(spec.get("podMetricsEndpoints") or []):
        unknown = set(ep) - _ENDPOINT_KEYS
        if unknown:
            raise ValueError(f"PodMonitor {ns}/{name} endpoint {i}: not translated: {', '.join(sorted(unknown))}")
        cfg: dict[str, Any] = {"job_name": f"podMonitor/{ns}/{name}/{i}", "honor_labels": bool(ep.get("honorLabels"))}
        if "honorTimestamps" in ep:
            cfg["honor_timestamps"] = bool(ep["honorTimestamps"])
        cfg["kubernetes_sd_configs"] = [copy.deepcopy(sd)]
        for src, dst in _ENDPOINT_FIELDS.items():
            if ep.get(src):
                cfg[dst] = ep[src]
        for src, dst in (("enableHttp2", "enable_http2"), ("followRedirects", "follow_redirects")):
            if src in ep:
                cfg[dst] = bool(ep[src])

        relabel = [{"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"}]
        if ep.get("filterRunning", True):
            relabel.append({"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": _FINISHED})
        relabel += _selector_relabelings(spec.get("selector") or {})
        port_rules, endpoint = _port_rules(ep)
        relabel += port_rules
        relabel += [
            _copy("__meta_kubernetes_namespace", "namespace"),
            _copy("__meta_kubernetes_pod_container_name", "container"),
            _copy("__meta_kubernetes_pod_name", "pod"),
        ]
        for label in spec.get("podTargetLabels") or []:
            source = f"__meta_kubernetes_pod_label_{sanitize_label_name(label)}"
            relabel.append(_copy(source, sanitize_label_name(label), nonempty=True))
        relabel.append({"target_label": "job", "replacement": f"{ns}/{name}"})
        if spec.get("jobLabel"):
            source = f"__meta_kubernetes_pod_label_{sanitize_label_name(spec['jobLabel'])}"
            relabel.append(_copy(source, "job", nonempty=True))
        if endpoint is not None:
            relabel.append({"target_label": "endpoint", "replacement": endpoint})
        relabel += _relabel_configs(ep.get("relabelings") or [])
        relabel += [dict(rule) for rule in _SHARDING]
        cfg["relabel_configs"] = relabel
        for src, dst in _LIMITS.items():
            if spec.get(src):
                cfg[dst] = int(spec[src])
        if ep.get("metricRelabelings"):
            cfg["metric_relabel_configs"] = _relabel_configs(ep["metricRelabelings"])
        configs.append(cfg)
    if not configs:
        raise ValueError(f"PodMonitor {ns}/{name} has no podMetricsEndpoints")
    return configs


def prometheus_config(scrape_configs: list[dict[str, Any]]) -> dict[str, Any]:
    """The whole configuration file: the operator's global defaults and the given jobs."""
    return {
        "global": {"scrape_interval": GLOBAL_INTERVAL, "evaluation_interval": GLOBAL_INTERVAL},
        "scrape_configs": scrape_configs,
    }


def dump(config: Mapping[str, Any]) -> str:
    """The configuration as Prometheus reads it: JSON is YAML, and the standard library writes JSON."""
    return json.dumps(config, indent=2) + "\n"
