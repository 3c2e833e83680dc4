"""Prometheus in the local cluster, and the load-generator Job pods the process kubelet runs (issue 13).

The scrape configuration is the Helm chart's PodMonitor translated as the Prometheus Operator translates one
(e2e/cluster/prometheus.py): first that translation alone, then the chart rendered by Helm and checked by promtool,
then, on the cluster, an engine pod rendered by the operator's own code discovered through the API server and
scraped on its pod IP with the operator's target labels. Prometheus is taken down and brought back with its data.
Last, `npuserve bench` Jobs: one that exits 0 completes, one that cannot reach its engine fails.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import localk8s
import pytest
import yaml
from operator_harness import wait_for

from npuserve.operator.render import render
from npuserve.planning.api import InferenceService
from npuserve.planning.planner import plan

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "tiny-cpu.yaml"
INSTANCE_LABEL = "npuserve.io/inferenceservice"
# The chart's engine selector (deploy/helm/npuserve/templates/_helpers.tpl, npuserve.engineSelectorLabels).
ENGINE_SELECTOR = {
    "app.kubernetes.io/name": "npuserve-engine",
    "app.kubernetes.io/component": "engine",
    "app.kubernetes.io/managed-by": "npuserve-operator",
}
API = localk8s.ApiServer("https://127.0.0.1:26443", "/pki/ca.crt", "/pki/admin.crt", "/pki/admin.key")



def podmonitor(**spec: Any) -> dict[str, Any]:
    """The PodMonitor as the chart renders it (serviceMonitor.enabled, interval and scrapeTimeout 1s), `spec` over."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": {"name": "npuserve-engines", "namespace": "npuserve-system"},
        "spec": {
            "namespaceSelector": {"any": True},
            "selector": {"matchLabels": dict(ENGINE_SELECTOR)},
            "podTargetLabels": [INSTANCE_LABEL],
            "podMetricsEndpoints": [
                {"port": "http", "path": "/metrics", "scheme": "http", "interval": "1s", "scrapeTimeout": "1s"}
            ],
            **spec,
        },
    }


# ---- the translation (no cluster) -------------------------------------------------------------------------------
def test_podmonitor_becomes_the_prometheus_operators_scrape_config() -> None:
    """Field for field what the Prometheus Operator's generatePodMonitorConfig writes for the chart's monitor."""
    [cfg] = localk8s.podmonitor_scrape_configs(podmonitor(), API)
    label = "__meta_kubernetes_pod_label_"
    present = "__meta_kubernetes_pod_labelpresent_"
    assert cfg == {
        "job_name": "podMonitor/npuserve-system/npuserve-engines/0",
        "honor_labels": False,
        "kubernetes_sd_configs": [
            {
                "role": "pod",  # namespaceSelector any: no namespaces, every one
                "api_server": "https://127.0.0.1:26443",
                "tls_config": {"ca_file": "/pki/ca.crt", "cert_file": "/pki/admin.crt", "key_file": "/pki/admin.key"},
            }
        ],
        "scrape_interval": "1s",
        "scrape_timeout": "1s",
        "metrics_path": "/metrics",
        "scheme": "http",
        "relabel_configs": [
            {"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"},
            {"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"},
            # matchLabels, sorted by key
            {
                "action": "keep",
                "source_labels": [f"{label}app_kubernetes_io_component", f"{present}app_kubernetes_io_component"],
                "regex": "(engine);true",
            },
            {
                "action": "keep",
                "source_labels": [f"{label}app_kubernetes_io_managed_by", f"{present}app_kubernetes_io_managed_by"],
                "regex": "(npuserve-operator);true",
            },
            {
                "action": "keep",
                "source_labels": [f"{label}app_kubernetes_io_name", f"{present}app_kubernetes_io_name"],
                "regex": "(npuserve-engine);true",
            },
            {"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": "http"},
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            {
                "source_labels": [f"{label}npuserve_io_inferenceservice"],
                "target_label": "npuserve_io_inferenceservice",
                "regex": "(.+)",
                "replacement": "${1}",
            },
            {"target_label": "job", "replacement": "npuserve-system/npuserve-engines"},
            {"target_label": "endpoint", "replacement": "http"},
            # sharding, one shard ($(SHARD) = 0)
            {
                "source_labels": ["__address__", "__tmp_hash"],
                "target_label": "__tmp_hash",
                "regex": "(.+);",
                "replacement": "$1",
                "action": "replace",
            },
            {"source_labels": ["__tmp_hash"], "target_label": "__tmp_hash", "modulus": 1, "action": "hashmod"},
            {"source_labels": ["__tmp_hash", "__tmp_disable_sharding"], "regex": "0;|.+;.+", "action": "keep"},
        ],
    }


def test_the_harness_copies_of_operator_names_agree() -> None:
    """The harness is standard library only, so it cannot import these from npuserve; it keeps copies, pinned here:
    the label name Prometheus gives the InferenceService label, and the operator's Prometheus URL variable."""
    import cluster

    from npuserve.operator.names import INSTANCE_LABEL, PROMETHEUS_URL_ENV
    from npuserve.operator.prometheus import INSTANCE_PROM_LABEL, prometheus_label_name

    assert localk8s.sanitize_label_name(INSTANCE_LABEL) == INSTANCE_PROM_LABEL == "npuserve_io_inferenceservice"
    for name in ("app.kubernetes.io/component", "a-b/c.d", "x_1"):
        assert localk8s.sanitize_label_name(name) == prometheus_label_name(name)
    assert cluster.PROMETHEUS_URL_ENV == PROMETHEUS_URL_ENV


def test_podmonitor_namespaces_expressions_and_refusals() -> None:
    # matchNames (the chart's watchNamespaces) and the monitor's own namespace when there is no selector
    [cfg] = localk8s.podmonitor_scrape_configs(podmonitor(namespaceSelector={"matchNames": ["a", "b"]}), API)
    assert cfg["kubernetes_sd_configs"][0]["namespaces"] == {"names": ["a", "b"]}
    [cfg] = localk8s.podmonitor_scrape_configs(podmonitor(namespaceSelector={}), API)
    assert cfg["kubernetes_sd_configs"][0]["namespaces"] == {"names": ["npuserve-system"]}
    # set-based selectors, a port by number (no endpoint label), two endpoints -> two jobs
    selector = {
        "matchExpressions": [
            {"key": "tier", "operator": "In", "values": ["a", "b"]},
            {"key": "canary", "operator": "DoesNotExist"},
        ]
    }
    endpoints = [{"portNumber": 9100}, {"port": "http", "filterRunning": False}]
    first, second = localk8s.podmonitor_scrape_configs(
        podmonitor(selector=selector, podMetricsEndpoints=endpoints), API
    )
    assert first["job_name"].endswith("/0") and second["job_name"].endswith("/1")
    rules = first["relabel_configs"]
    tier = ["__meta_kubernetes_pod_label_tier", "__meta_kubernetes_pod_labelpresent_tier"]
    assert {"action": "keep", "source_labels": tier, "regex": "(a|b);true"} in rules
    assert {"action": "drop", "source_labels": ["__meta_kubernetes_pod_labelpresent_canary"], "regex": "true"} in rules
    port = "__meta_kubernetes_pod_container_port_number"
    assert {"action": "keep", "source_labels": [port], "regex": "9100"} in rules
    assert not any(r.get("target_label") == "endpoint" for r in rules)
    assert not any(r.get("source_labels") == ["__meta_kubernetes_pod_phase"] for r in second["relabel_configs"])
    assert localk8s.sanitize_label_name("npuserve.io/inferenceservice") == "npuserve_io_inferenceservice"
    # what the translation does not model is refused, not silently scraped differently
    with pytest.raises(ValueError, match="attachMetadata"):
        localk8s.podmonitor_scrape_configs(podmonitor(attachMetadata={"node": True}), API)
    with pytest.raises(ValueError, match="basicAuth"):
        localk8s.podmonitor_scrape_configs(podmonitor(podMetricsEndpoints=[{"port": "http", "basicAuth": {}}]), API)


@pytest.mark.e2e
def test_chart_podmonitor_selects_the_operators_engine_pods(tmp_path: Path) -> None:
    """The chart rendered by Helm: its PodMonitor selects the labels operator/render.py puts on engine pods, and
    Prometheus' own promtool accepts the configuration written from it."""
    bins = localk8s.ensure_binaries(with_helm=True)
    monitor: dict[str, Any] = localk8s.chart_podmonitor(bins.helm)
    assert (monitor["metadata"]["namespace"], monitor["metadata"]["name"]) == ("npuserve-system", "npuserve-engines")
    isvc = tiny("default")
    [deployment] = [o for o in render(isvc, plan(isvc.spec)) if o["kind"] == "Deployment"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    spec = monitor["spec"]
    assert spec["selector"]["matchLabels"].items() <= pod_labels.items()
    assert spec["podTargetLabels"] == [INSTANCE_LABEL]
    assert spec["podMetricsEndpoints"][0]["interval"] == "1s"
    for name in ("ca.crt", "admin.crt", "admin.key"):
        (tmp_path / name).write_text("")
    api = localk8s.ApiServer("https://127.0.0.1:1", *(str(tmp_path / n) for n in ("ca.crt", "admin.crt", "admin.key")))
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps(localk8s.prometheus_config(localk8s.podmonitor_scrape_configs(monitor, api))))
    promtool = bins.prometheus.with_name("promtool")
    check = subprocess.run([str(promtool), "check", "config", str(config)], text=True, capture_output=True)
    assert check.returncode == 0, check.stdout + check.stderr


# ---- on the cluster ---------------------------------------------------------------------------------------------


def tiny(namespace: str) -> InferenceService:
    obj: dict[str, Any] = yaml.safe_load(TINY.read_text())
    obj["metadata"]["namespace"] = namespace
    return InferenceService.model_validate(obj)


@pytest.fixture
def namespace(k8s_cluster: localk8s.Cluster) -> Iterator[str]:
    ns = "e2e-prom-" + uuid.uuid4().hex[:6]
    k8s_cluster.kubectl("create", "namespace", ns)
    try:
        yield ns
    finally:
        for kind in ("jobs", "deployments"):
            k8s_cluster.kubectl("delete", kind, "--all", "-n", ns, "--wait=true", check=False, timeout=90)
        k8s_cluster.kubectl("wait", "--for=delete", "pod", "--all", "-n", ns, "--timeout=60s", check=False, timeout=70)
        k8s_cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def prom(cluster: localk8s.Cluster, path: str, **params: str) -> Any:
    resp = httpx.get(cluster.prometheus_url + path, params=params, timeout=10)
    resp.raise_for_status()
    body = resp.json()
    assert body["status"] == "success", body
    return body["data"]


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_prometheus_scrapes_engine_pods_with_operator_labels(k8s_cluster: localk8s.Cluster, namespace: str) -> None:
    url = k8s_cluster.prometheus_url
    assert httpx.get(url + "/-/ready", timeout=5).status_code == 200
    assert (k8s_cluster.dir / "prometheus-url").read_text().strip() == url
    assert localk8s.status()["prometheus_url"] == url

    isvc = tiny(namespace)
    objects = [o for o in render(isvc, plan(isvc.spec)) if o["kind"] in ("ConfigMap", "Deployment")]
    k8s_cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))

    def target() -> dict[str, Any] | None:
        active = prom(k8s_cluster, "/api/v1/targets", state="active")["activeTargets"]
        up = [t for t in active if t["labels"].get("namespace") == namespace and t["health"] == "up"]
        return up[0] if up else None

    found = wait_for("Prometheus to scrape the engine pod", target, timeout=300, interval=1)
    pod = k8s_cluster.kubectl_json("get", "pod", found["labels"]["pod"], "-n", namespace)
    assert found["scrapePool"] == "podMonitor/npuserve-system/npuserve-engines/0"
    assert found["scrapeUrl"] == f"http://{pod['status']['podIP']}:8000/metrics"  # type: ignore[index]
    assert found["labels"] == {
        "container": "engine",
        "endpoint": "http",
        "instance": f"{pod['status']['podIP']}:8000",  # type: ignore[index]
        "job": "npuserve-system/npuserve-engines",
        "namespace": namespace,
        "npuserve_io_inferenceservice": "tiny",
        "pod": found["labels"]["pod"],
    }

    query = f'npuserve:kv_cache_blocks_total{{namespace="{namespace}", npuserve_io_inferenceservice="tiny"}}'

    def series() -> list[dict[str, Any]] | None:
        result: list[dict[str, Any]] = prom(k8s_cluster, "/api/v1/query", query=query)["result"]
        return result or None

    [sample] = wait_for("the KV cache gauge in Prometheus", series, timeout=60)
    labels = sample["metric"]
    assert labels["pod"] == found["labels"]["pod"] and labels["container"] == "engine"
    assert labels["endpoint"] == "http" and labels["job"] == "npuserve-system/npuserve-engines"
    assert float(sample["value"][1]) > 0
    scraped_at = float(sample["value"][0])

    # Down and back, as the autotune test does mid-tuning: the rest of the cluster stays up, the data stays.
    assert localk8s.stop_prometheus(k8s_cluster)
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/-/ready", timeout=5)
    assert localk8s.current(k8s_cluster.dir) is not None
    assert localk8s.status()["components"]["prometheus"] is False  # type: ignore[index]
    assert localk8s.start_prometheus(k8s_cluster) == url
    before = prom(k8s_cluster, "/api/v1/query", query=query, time=str(scraped_at))["result"]
    assert [s["metric"] for s in before] == [labels]
    wait_for("scraping after the restart", lambda: target() and series(), timeout=60)


def bench_job(name: str, namespace: str, *args: str) -> dict[str, Any]:
    """A Job as the operator's benchmark makes one: one `npuserve bench` pod, never restarted, no retries."""
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [
                        {"name": "bench", "image": "npuserve/engine:0.1.0", "command": ["npuserve", "bench", *args]}
                    ],
                },
            },
        },
    }


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_bench_jobs_complete_or_fail_with_their_process(k8s_cluster: localk8s.Cluster, namespace: str) -> None:
    jobs = [
        bench_job("ok", namespace, "--help"),
        bench_job("unreachable", namespace, "--base-url", "http://127.0.0.1:1"),
    ]
    k8s_cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": jobs}))
    for job, condition in (("ok", "Complete"), ("unreachable", "Failed")):
        k8s_cluster.kubectl(
            "wait", f"--for=condition={condition}", f"job/{job}", "-n", namespace, "--timeout=60s", timeout=70
        )
    items: list[dict[str, Any]] = k8s_cluster.kubectl_json("get", "pods", "-n", namespace)["items"]  # type: ignore[assignment]
    pods = {p["metadata"]["labels"]["app"]: p for p in items}
    ok, bad = pods["ok"], pods["unreachable"]
    assert ok["status"]["phase"] == "Succeeded" and bad["status"]["phase"] == "Failed"
    done = ok["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (done["exitCode"], done["reason"]) == (0, "Completed")
    failed = bad["status"]["containerStatuses"][0]["state"]["terminated"]
    assert failed["exitCode"] != 0 and failed["reason"] == "Error"
    assert "http://127.0.0.1:1" in failed["message"]  # the log's last lines: bench saying what it cannot reach
    for pod in (ok, bad):
        assert pod["status"]["containerStatuses"][0]["restartCount"] == 0
        ready = [c for c in pod["status"]["conditions"] if c["type"] == "Ready"]
        assert ready and (ready[0]["status"], ready[0]["reason"]) == ("False", "PodCompleted")
    log = k8s_cluster.dir / "pods" / f"{namespace}_{ok['metadata']['name']}" / "container.log"
    assert "usage: npuserve bench" in log.read_text()
