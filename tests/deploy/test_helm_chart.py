"""The Helm chart deploy/helm/npuserve: lint, render with every feature on and off, and check what it renders.

Every rendered object is validated against the Kubernetes OpenAPI schemas (kubernetes-validate, strict); the
Prometheus Operator kinds have no bundled schema, so their shape is checked here by hand. The RBAC rules must be
exactly the API calls of `npuserve operator`, the Deployment must run it with the flags from the values, the
PodMonitor/ServiceMonitor must select the engine pods operator/render.py makes, and the dashboard may only query
series the engine exports (engine/server/metrics.py).
"""

from __future__ import annotations

import copy
import filecmp
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "npuserve"
CRD = REPO / "deploy" / "crds" / "inferenceservices.npuserve.io.yaml"
RELEASE, NAMESPACE = "npuserve", "npuserve-system"
K8S_VERSIONS = ("1.30.0", "1.34.0")

ALL_ON: dict[str, Any] = {
    "image": {"repository": "registry.example.com/npuserve/operator", "tag": "0.1.0-rc1", "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "regcred"}],
    "prometheus": {"url": "http://prometheus-operated.monitoring.svc:9090"},
    "logLevel": "debug",
    "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}, "interval": "30s"},
    "grafanaDashboard": {"enabled": True, "annotations": {"grafana_folder": "npuserve"}},
    "extraEnv": [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"}],
    "nodeSelector": {"kubernetes.io/os": "linux"},
    "tolerations": [{"key": "CriticalAddonsOnly", "operator": "Exists"}],
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64", "arm64"]}]}]}}},
    "podAnnotations": {"example.com/team": "inference"},
    "podLabels": {"example.com/tier": "control-plane"},
    "priorityClassName": "system-cluster-critical",
    "serviceAccount": {"annotations": {"example.com/role": "npuserve"}},
}
NAMESPACED: dict[str, Any] = {
    "watchNamespaces": ["team-a", "team-b"],
    "serviceMonitor": {"enabled": True, "kind": "ServiceMonitor"},
    "grafanaDashboard": {"enabled": True, "namespace": "monitoring", "labels": {"team": "ml"}},
    "livenessProbe": {"port": 9090},
}
NO_RBAC: dict[str, Any] = {"rbac": {"create": False}, "serviceAccount": {"create": False, "name": "ops-managed"}}
VALUE_SETS = {"defaults": {}, "all-on": ALL_ON, "namespaced": NAMESPACED, "no-rbac": NO_RBAC}


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=120, cwd=REPO)


def values_file(tmp_path: Path, values: dict[str, Any]) -> Path:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def render(
    helm: Path, tmp_path: Path, values: dict[str, Any], *extra: str, chart: Path = CHART
) -> list[dict[str, Any]]:
    proc = run_helm(helm, "template", RELEASE, str(chart), "--namespace", NAMESPACE, "--kube-version", "1.30.0",
                    "-f", str(values_file(tmp_path, values)), *extra)
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(objects, kind)
    assert len(found) == 1, f"{len(found)} {kind} objects"
    return found[0]


def container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    containers = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["operator"]
    result: dict[str, Any] = containers[0]
    return result


# --- lint and schema validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", VALUE_SETS)
def test_helm_lint_is_clean(helm: Path, tmp_path: Path, name: str) -> None:
    proc = run_helm(helm, "lint", "--strict", str(CHART), "-f", str(values_file(tmp_path, VALUE_SETS[name])))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout
    assert "[WARNING]" not in proc.stdout and "[ERROR]" not in proc.stdout, proc.stdout


def _validate_monitor(obj: dict[str, Any], k8s_version: str) -> None:
    """PodMonitor/ServiceMonitor (monitoring.coreos.com/v1): no schema is bundled, so the fields used are checked."""
    assert obj["apiVersion"] == "monitoring.coreos.com/v1"
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj["metadata"]},
                                 k8s_version, strict=True)
    spec = obj["spec"]
    endpoints_key, target_labels_key = (
        ("podMetricsEndpoints", "podTargetLabels") if obj["kind"] == "PodMonitor" else ("endpoints", "targetLabels")
    )
    assert set(spec) == {"namespaceSelector", "selector", endpoints_key, target_labels_key}
    ns = spec["namespaceSelector"]
    assert ns == {"any": True} or (set(ns) == {"matchNames"} and all(isinstance(n, str) for n in ns["matchNames"]))
    assert set(spec["selector"]) == {"matchLabels"}
    assert all(isinstance(v, str) for v in spec["selector"]["matchLabels"].values())
    assert all(isinstance(label, str) for label in spec[target_labels_key])
    duration = re.compile(r"^(0|([0-9]+y)?([0-9]+w)?([0-9]+d)?([0-9]+h)?([0-9]+m)?([0-9]+s)?([0-9]+ms)?)$")
    for endpoint in spec[endpoints_key]:
        assert set(endpoint) <= {"port", "path", "scheme", "interval", "scrapeTimeout"}
        assert isinstance(endpoint["port"], str) and endpoint["path"].startswith("/")
        assert endpoint["scheme"] in ("http", "https")
        for key in ("interval", "scrapeTimeout"):
            assert duration.match(endpoint[key]), endpoint[key]


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_rendered_object_is_valid(helm: Path, tmp_path: Path, name: str) -> None:
    objects = render(helm, tmp_path, VALUE_SETS[name])
    assert objects
    for k8s_version in K8S_VERSIONS:
        for obj in objects:
            if obj["kind"] in ("PodMonitor", "ServiceMonitor"):
                _validate_monitor(obj, k8s_version)
            else:
                kubernetes_validate.validate(obj, k8s_version, strict=True)
    for obj in objects:
        namespaced = obj["kind"] not in ("ClusterRole", "ClusterRoleBinding")
        assert ("namespace" in obj["metadata"]) == namespaced, obj["metadata"]["name"]


def test_default_objects(helm: Path, tmp_path: Path) -> None:
    kinds = sorted(o["kind"] for o in render(helm, tmp_path, {}))
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "Deployment", "Role", "RoleBinding", "ServiceAccount"]


def test_values_schema_refuses_bad_values(helm: Path, tmp_path: Path) -> None:
    for bad in ({"logLevel": "verbose"}, {"watchNamespaces": ["Team_A"]}, {"serviceMonitor": {"kind": "Probe"}},
                {"prometheus": {"url": "prometheus:9090"}}, {"imageTag": "x"}):
        proc = run_helm(helm, "template", RELEASE, str(CHART), "-f", str(values_file(tmp_path, bad)))
        assert proc.returncode != 0, bad
        assert "values don't meet the specifications of the schema" in proc.stderr, proc.stderr


# --- the CRD ----------------------------------------------------------------------------------------------------


def test_chart_crd_is_an_identical_copy_of_the_generated_crd() -> None:
    """Refresh: cp deploy/crds/inferenceservices.npuserve.io.yaml deploy/helm/npuserve/crds/"""
    copy_ = CHART / "crds" / CRD.name
    assert sorted(p.name for p in (CHART / "crds").iterdir()) == [CRD.name]
    assert filecmp.cmp(CRD, copy_, shallow=False), (
        f"{copy_.relative_to(REPO)} differs from {CRD.relative_to(REPO)}; refresh it with: "
        f"cp {CRD.relative_to(REPO)} {copy_.relative_to(REPO)}"
    )


def test_crd_is_rendered_with_include_crds(helm: Path, tmp_path: Path) -> None:
    crds = by_kind(render(helm, tmp_path, {}, "--include-crds"), "CustomResourceDefinition")
    assert [c["metadata"]["name"] for c in crds] == ["inferenceservices.npuserve.io"]
    assert crds[0] == yaml.safe_load(CRD.read_text())


# --- RBAC -------------------------------------------------------------------------------------------------------

NAMESPACED_GRANTS = {
    ("npuserve.io", "inferenceservices"): {"get", "list", "watch", "patch"},
    ("npuserve.io", "inferenceservices/status"): {"get", "patch", "update"},
    ("", "configmaps"): {"get", "list", "watch", "create", "update", "patch", "delete"},
    ("", "services"): {"get", "list", "watch", "create", "update", "patch", "delete"},
    ("apps", "deployments"): {"get", "list", "watch", "create", "update", "patch", "delete"},
    ("leaderworkerset.x-k8s.io", "leaderworkersets"): {"get", "list", "watch", "create", "update", "patch", "delete"},
    ("monitoring.coreos.com", "podmonitors"): {"get", "list", "watch", "create", "update", "patch", "delete"},
    ("", "pods"): {"get", "list", "watch"},
    ("", "events"): {"create", "patch"},
    ("events.k8s.io", "events"): {"create", "patch"},
    ("npuserve.io", "inferenceservices/scale"): {"get", "patch", "update"},
    ("", "secrets"): {"get", "create"},
    ("batch", "jobs"): {"get", "list", "create", "delete"},
}
LEASE_GRANTS = {("coordination.k8s.io", "leases"): {"get", "create", "update"}}
LEASE_ROLE = f"{RELEASE}-leader-election"
CLUSTER_GRANTS = {
    ("", "namespaces"): {"list", "watch"},
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"get", "list", "watch"},
    ("", "nodes"): {"list"},
}


def grants(rules: list[dict[str, Any]]) -> dict[tuple[str, str], set[str]]:
    """(apiGroup, resource) -> verbs; refuses wildcards, resourceNames and nonResourceURLs."""
    out: dict[tuple[str, str], set[str]] = {}
    for rule in rules:
        assert set(rule) == {"apiGroups", "resources", "verbs"}, rule
        for value in (*rule["apiGroups"], *rule["resources"], *rule["verbs"]):
            assert "*" not in value, rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


def _check_binding(binding: dict[str, Any], role: dict[str, Any], sa_name: str) -> None:
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": role["kind"],
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa_name, "namespace": NAMESPACE}]
    assert binding["metadata"].get("namespace") == role["metadata"].get("namespace")


def test_cluster_role_grants_exactly_the_operators_api_calls(helm: Path, tmp_path: Path) -> None:
    objects = render(helm, tmp_path, {})
    role = one(objects, "ClusterRole")
    assert grants(role["rules"]) == {**NAMESPACED_GRANTS, **CLUSTER_GRANTS}
    # The one Role is leader election's, in the release namespace.
    assert [r["metadata"]["name"] for r in by_kind(objects, "Role")] == [LEASE_ROLE]
    sa = one(objects, "ServiceAccount")
    _check_binding(one(objects, "ClusterRoleBinding"), role, sa["metadata"]["name"])
    assert one(objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]


def test_watched_namespaces_get_roles_and_only_cluster_scoped_rules_stay_cluster_wide(
    helm: Path, tmp_path: Path
) -> None:
    objects = render(helm, tmp_path, NAMESPACED)
    cluster_role = one(objects, "ClusterRole")
    assert grants(cluster_role["rules"]) == CLUSTER_GRANTS
    sa_name = one(objects, "ServiceAccount")["metadata"]["name"]
    _check_binding(one(objects, "ClusterRoleBinding"), cluster_role, sa_name)
    roles = {r["metadata"]["namespace"]: r for r in by_kind(objects, "Role") if r["metadata"]["name"] != LEASE_ROLE}
    bindings = {b["metadata"]["namespace"]: b for b in by_kind(objects, "RoleBinding")
                if b["metadata"]["name"] != LEASE_ROLE}
    assert sorted(roles) == sorted(bindings) == ["team-a", "team-b"]
    for ns, role in roles.items():
        assert grants(role["rules"]) == NAMESPACED_GRANTS
        _check_binding(bindings[ns], role, sa_name)


def _lease_role(objects: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]] | None:
    roles = [r for r in by_kind(objects, "Role") if r["metadata"]["name"] == LEASE_ROLE]
    bindings = [b for b in by_kind(objects, "RoleBinding") if b["metadata"]["name"] == LEASE_ROLE]
    assert len(roles) == len(bindings) <= 1
    return (roles[0], bindings[0]) if roles else None


@pytest.mark.parametrize("name", ["defaults", "namespaced"])
def test_leader_election_gets_a_role_for_leases_in_the_release_namespace_only(
        helm: Path, tmp_path: Path, name: str) -> None:
    objects = render(helm, tmp_path, VALUE_SETS[name])
    found = _lease_role(objects)
    assert found is not None
    role, binding = found
    assert role["metadata"]["namespace"] == NAMESPACE and grants(role["rules"]) == LEASE_GRANTS
    _check_binding(binding, role, one(objects, "ServiceAccount")["metadata"]["name"])
    # Leases are granted nowhere else.
    for other in [*by_kind(objects, "ClusterRole"), *by_kind(objects, "Role")]:
        if other is not role:
            assert ("coordination.k8s.io", "leases") not in grants(other["rules"])


def test_leader_election_off_runs_one_operator_with_recreate_and_no_lease_role(helm: Path, tmp_path: Path) -> None:
    objects = render(helm, tmp_path, {"leaderElection": {"enabled": False}, "replicaCount": 1})
    deployment = one(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert _lease_role(objects) is None
    assert not [f for f, _ in flags(container(objects)["args"]) if f.startswith("--leader-")]
    proc = run_helm(helm, "template", RELEASE, str(CHART), "--set", "leaderElection.enabled=false")
    assert proc.returncode != 0 and "needs leaderElection.enabled" in proc.stderr  # the default 2 replicas


def test_rbac_and_service_account_can_be_left_to_the_cluster_admin(helm: Path, tmp_path: Path) -> None:
    objects = render(helm, tmp_path, NO_RBAC)
    assert sorted(o["kind"] for o in objects) == ["Deployment"]
    assert one(objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "ops-managed"
    proc = run_helm(helm, "template", RELEASE, str(CHART), "--set", "serviceAccount.create=false")
    assert proc.returncode != 0 and "serviceAccount.name is required" in proc.stderr


# --- the operator Deployment ------------------------------------------------------------------------------------


def flags(args: list[str]) -> list[tuple[str, str | None]]:
    """["--a", "x", "--b"] -> [("--a", "x"), ("--b", None)]"""
    out: list[tuple[str, str | None]] = []
    for arg in args:
        if arg.startswith("--"):
            out.append((arg, None))
        else:
            assert out and out[-1][1] is None, args
            out[-1] = (out[-1][0], arg)
    return out


def test_deployment_runs_the_operator_with_the_default_flags(helm: Path, tmp_path: Path) -> None:
    objects = render(helm, tmp_path, {})
    deployment = one(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 2  # one leader, one standby
    assert deployment["spec"]["strategy"] == {"type": "RollingUpdate"}  # a new pod starts as a standby
    c = container(objects)
    assert c["command"] == ["npuserve", "operator"]
    assert flags(c["args"]) == [("--all-namespaces", None), ("--log-level", "info"),
                                ("--liveness-endpoint", "http://0.0.0.0:8080/healthz"), *LEADER_FLAGS]
    env = {e["name"]: e.get("valueFrom") for e in c["env"]}
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    appversion = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert c["image"] == f"npuserve/operator:{appversion}"
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert c["ports"] == [{"name": "health", "containerPort": 8080, "protocol": "TCP"}]


LEADER_FLAGS = [("--leader-elect", None), ("--leader-election-id", RELEASE),
                ("--leader-election-namespace", NAMESPACE)]


def test_deployment_flags_follow_the_values(helm: Path, tmp_path: Path) -> None:
    c = container(render(helm, tmp_path, ALL_ON))
    assert flags(c["args"]) == [("--all-namespaces", None),
                                ("--prometheus-url", "http://prometheus-operated.monitoring.svc:9090"),
                                ("--log-level", "debug"), ("--liveness-endpoint", "http://0.0.0.0:8080/healthz"),
                                *LEADER_FLAGS]
    assert c["image"] == "registry.example.com/npuserve/operator:0.1.0-rc1" and c["imagePullPolicy"] == "Always"
    assert {"name": "HTTPS_PROXY", "value": "http://proxy:3128"} in c["env"]

    c = container(render(helm, tmp_path, NAMESPACED))
    assert flags(c["args"]) == [("--namespace", "team-a"), ("--namespace", "team-b"), ("--log-level", "info"),
                                ("--liveness-endpoint", "http://0.0.0.0:9090/healthz"), *LEADER_FLAGS]
    assert c["ports"][0]["containerPort"] == 9090 and c["livenessProbe"]["httpGet"]["port"] == "health"


def test_operator_cli_parses_the_rendered_command(helm: Path, tmp_path: Path) -> None:
    """The rendered command line through the real `npuserve operator` parser gives back the values."""
    from npuserve import cli

    parser = cli.build_parser(every=True)
    parsed = {}
    for name, values in VALUE_SETS.items():
        c = container(render(helm, tmp_path, values))
        parsed[name] = parser.parse_args([*c["command"][1:], *c["args"]])
        assert parsed[name].command == "operator"
    assert parsed["defaults"].all_namespaces and parsed["defaults"].namespace == []
    assert parsed["defaults"].prometheus_url is None and parsed["defaults"].log_level == "info"
    assert parsed["defaults"].liveness_endpoint == "http://0.0.0.0:8080/healthz"
    assert parsed["all-on"].prometheus_url == ALL_ON["prometheus"]["url"] and parsed["all-on"].log_level == "debug"
    assert not parsed["namespaced"].all_namespaces and parsed["namespaced"].namespace == ["team-a", "team-b"]
    assert parsed["namespaced"].liveness_endpoint == "http://0.0.0.0:9090/healthz"
    for args in parsed.values():
        assert args.leader_elect and args.leader_election_id == RELEASE
        assert args.leader_election_namespace == NAMESPACE
        assert (args.leader_elect_lease_duration, args.leader_elect_renew_deadline,
                args.leader_elect_retry_period) == (15, 10, 2)


def test_pod_placement_and_pull_secrets_follow_the_values(helm: Path, tmp_path: Path) -> None:
    pod = one(render(helm, tmp_path, ALL_ON), "Deployment")["spec"]["template"]
    spec = pod["spec"]
    for key in ("nodeSelector", "tolerations", "affinity", "imagePullSecrets", "priorityClassName"):
        assert spec[key] == ALL_ON[key], key
    assert pod["metadata"]["annotations"] == ALL_ON["podAnnotations"]
    assert pod["metadata"]["labels"]["example.com/tier"] == "control-plane"
    spec = one(render(helm, tmp_path, {}), "Deployment")["spec"]["template"]["spec"]
    assert not {"nodeSelector", "tolerations", "affinity", "imagePullSecrets", "priorityClassName"} & set(spec)


def test_operator_is_locked_down(helm: Path, tmp_path: Path) -> None:
    objects = render(helm, tmp_path, {})
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 1000
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container(objects)["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["runAsNonRoot"] is True
    assert {"name": "tmp", "mountPath": "/tmp"} in container(objects)["volumeMounts"]  # the only writable path
    assert "privileged" not in sc


# --- scraping the engines ---------------------------------------------------------------------------------------


def _engine_objects() -> list[dict[str, Any]]:
    """What the operator renders for every example InferenceService (single- and multi-node)."""
    from npuserve.operator import render as r
    from npuserve.planning.api import InferenceService
    from npuserve.planning.planner import plan

    objects: list[dict[str, Any]] = []
    for path in sorted((REPO / "examples").glob("*.yaml")):
        isvc = InferenceService.model_validate(yaml.safe_load(path.read_text()))
        objects += r.render(isvc, plan(isvc.spec))
    return objects


def _pod_templates(workload: dict[str, Any]) -> list[dict[str, Any]]:
    if workload["kind"] == "Deployment":
        return [workload["spec"]["template"]]
    lwt = workload["spec"]["leaderWorkerTemplate"]
    return [lwt["leaderTemplate"], lwt["workerTemplate"]]


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_podmonitor_selects_every_engine_pod_that_serves_metrics(helm: Path, tmp_path: Path) -> None:
    from npuserve.operator import render as r

    monitor = one(render(helm, tmp_path, ALL_ON), "PodMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    endpoint = monitor["spec"]["podMetricsEndpoints"][0]
    assert (endpoint["port"], endpoint["path"], endpoint["interval"]) == (r.PORT_NAME, "/metrics", "30s")
    assert monitor["spec"]["podTargetLabels"] == [r.INSTANCE_LABEL]
    selector = monitor["spec"]["selector"]["matchLabels"]
    workloads = [o for o in _engine_objects() if o["kind"] in ("Deployment", "LeaderWorkerSet")]
    assert {w["kind"] for w in workloads} == {"Deployment", "LeaderWorkerSet"}
    scraped = 0
    for workload in workloads:
        for template in _pod_templates(workload):
            assert _matches(selector, template["metadata"]["labels"])
            ports = [p["name"] for c in template["spec"]["containers"] for p in c.get("ports", [])]
            scraped += r.PORT_NAME in ports  # LWS workers have no http port: no target, as intended
    assert scraped == len(workloads)
    operator_pod = one(render(helm, tmp_path, {}), "Deployment")["spec"]["template"]
    assert not _matches(selector, operator_pod["metadata"]["labels"])


def test_servicemonitor_selects_the_engine_services(helm: Path, tmp_path: Path) -> None:
    from npuserve.operator import render as r

    monitor = one(render(helm, tmp_path, NAMESPACED), "ServiceMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    assert monitor["spec"]["endpoints"][0]["port"] == r.PORT_NAME
    services = [o for o in _engine_objects() if o["kind"] == "Service"]
    assert services
    for service in services:
        assert _matches(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
        assert r.PORT_NAME in [p["name"] for p in service["spec"]["ports"]]


def test_monitor_and_dashboard_are_off_by_default(helm: Path, tmp_path: Path) -> None:
    kinds = {o["kind"] for o in render(helm, tmp_path, {})}
    assert not kinds & {"PodMonitor", "ServiceMonitor", "ConfigMap"}


# --- the Grafana dashboard --------------------------------------------------------------------------------------


def exported_series() -> set[str]:
    """Every series name an engine's /metrics exposes (histogram _bucket/_sum/_count, counter _total, ...)."""
    from npuserve.engine.server.metrics import EngineMetrics

    text = EngineMetrics("probe").render().decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def dashboard_from(objects: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    configmap = one(objects, "ConfigMap")
    assert list(configmap["data"]) == ["npuserve.json"]
    return configmap, json.loads(configmap["data"]["npuserve.json"])


def test_dashboard_configmap_is_labelled_for_the_grafana_sidecar(helm: Path, tmp_path: Path) -> None:
    configmap, dashboard = dashboard_from(render(helm, tmp_path, ALL_ON))
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["namespace"] == NAMESPACE
    assert configmap["metadata"]["annotations"] == {"grafana_folder": "npuserve"}
    assert dashboard == json.loads((CHART / "dashboards" / "npuserve.json").read_text())
    configmap, _ = dashboard_from(render(helm, tmp_path, NAMESPACED))
    assert configmap["metadata"]["namespace"] == "monitoring" and configmap["metadata"]["labels"]["team"] == "ml"


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def test_dashboard_queries_only_series_the_engine_exports() -> None:
    dashboard = json.loads((CHART / "dashboards" / "npuserve.json").read_text())
    exported = exported_series()
    exprs = [t["expr"] for p in _panels(dashboard) for t in p["targets"]]
    assert exprs
    used: set[str] = set()
    for expr in exprs:
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
        names = set(re.findall(r"npuserve:[A-Za-z0-9_:]+", expr))
        assert names, expr
        used |= names
        assert 'model_name=~"$model_name"' in expr, expr
    assert used <= exported, sorted(used - exported)
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            assert set(re.findall(r"npuserve:[A-Za-z0-9_:]+", var["definition"])) <= exported


def test_dashboard_shows_what_the_tuning_guide_watches() -> None:
    dashboard = json.loads((CHART / "dashboards" / "npuserve.json").read_text())
    panels = _panels(dashboard)
    exprs = " ".join(t["expr"] for p in panels for t in p["targets"])
    for histogram in ("time_to_first_token_seconds", "time_per_output_token_seconds"):
        for q in ("0.5", "0.9", "0.99"):
            assert f"histogram_quantile({q}, sum by (model_name, le) (rate(npuserve:{histogram}_bucket" in exprs
    for series in ("generation_tokens_total", "num_requests_running", "num_requests_waiting", "num_requests_swapped",
                   "kv_cache_usage_perc", "decode_batch_size_sum", "prefill_batch_size_sum",
                   "num_preemptions_total"):
        assert f"npuserve:{series}" in exprs, series
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    assert dashboard["uid"] == "npuserve-engines"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus" and "model_name" in variables
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"]
        legends = [t["legendFormat"] for t in panel["targets"]]
        assert all("{{model_name}}" in legend for legend in legends), panel["title"]
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])


# --- NOTES.txt --------------------------------------------------------------------------------------------------


def render_notes(helm: Path, tmp_path: Path, values: dict[str, Any]) -> str:
    """`helm template` skips NOTES.txt; render it through a probe template in a copy of the chart."""
    chart = Path(tempfile.mkdtemp(dir=tmp_path)) / "npuserve"
    shutil.copytree(CHART, chart)
    shutil.copy(CHART / "templates" / "NOTES.txt", chart / "notes-probe.txt")
    (chart / "templates" / "notes-probe.yaml").write_text(
        'apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\n'
        'data:\n  notes: {{ tpl (.Files.Get "notes-probe.txt") . | quote }}\n'
    )
    objects = render(helm, tmp_path, values, "--show-only", "templates/notes-probe.yaml", chart=chart)
    notes: str = objects[0]["data"]["notes"]
    return notes


def test_notes_tell_what_to_apply_next(helm: Path, tmp_path: Path) -> None:
    notes = render_notes(helm, tmp_path, {})
    applied = re.findall(r"kubectl apply -f (examples/\S+)", notes)
    assert applied and all((REPO / path).is_file() for path in applied)
    assert f"rollout status deployment/{RELEASE}" in notes
    assert "every namespace" in notes and "prometheus.url is empty" in notes
    assert "kubectl apply --server-side --force-conflicts -f deploy/crds/inferenceservices.npuserve.io.yaml" in notes
    notes = render_notes(helm, tmp_path, copy.deepcopy(NAMESPACED))
    assert "team-a, team-b" in notes and "ServiceMonitor" in notes and "prometheus.url is empty" in notes
