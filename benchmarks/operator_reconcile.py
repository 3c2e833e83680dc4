#!/usr/bin/env python3
"""Operator reconcile latency: 50 InferenceServices applied at once; seconds from each one's create to its Deployment.

    .venv/bin/python benchmarks/operator_reconcile.py [--count 50] [--example examples/tiny-cpu.yaml]

Against the local cluster (e2e/, started if needed and stopped afterwards unless `make cluster-up` started it), with
the chart's CRD (`helm upgrade --install`) and the operator run as the e2e tests run it: kopf's `KopfRunner` in this
process, `run --standalone -A -m npuserve.operator.handlers`.

The objects go to a namespace of their own labelled `npuserve.io/process-kubelet=ignore`: the process kubelet leaves
its pods alone, so no engine starts (the pods stay Running-not-Ready under KWOK). Each object's start time is taken
when its create call returns; the end is when a watch on Deployments in the namespace delivers the ADDED event of
its Deployment, both on this machine's monotonic clock. Prints p50, p99 and the maximum, and the time until the last
Deployment. The namespace is deleted at the end.

Run by path, never with `-m` from the repository root (its `operator/` folder shadows the standard library's).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "e2e" / "cluster"))

import kubernetes  # noqa: E402
import localk8s  # noqa: E402
import yaml  # noqa: E402
from kopf.testing import KopfRunner  # noqa: E402

IGNORE_LABEL = "npuserve.io/process-kubelet"
INSTANCE_LABEL = "npuserve.io/inferenceservice"


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 100))))
    return ordered[rank - 1]


def helm_install(cluster: localk8s.Cluster) -> None:
    helm = localk8s.ensure_binaries(with_helm=True).helm
    subprocess.run(
        [str(helm), "upgrade", "--install", "npuserve", str(REPO / "deploy" / "helm" / "npuserve"),
         "--namespace", "npuserve-system", "--create-namespace", "--wait", "--timeout", "120s",
         f"--kubeconfig={cluster.kubeconfig}"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip


def main() -> int:
    logging.basicConfig(level=os.environ.get("NPUSERVE_BENCH_LOG", "WARNING"), stream=sys.stderr)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=50)
    parser.add_argument("--example", type=Path, default=REPO / "examples" / "tiny-cpu.yaml",
                        help="an InferenceService with spec.replicas")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args()
    template: dict[str, Any] = yaml.safe_load(args.example.read_text())
    if "replicas" not in template["spec"]:
        parser.error(f"{args.example} has no spec.replicas")

    cluster = localk8s.acquire()
    try:
        helm_install(cluster)
        os.environ["KUBECONFIG"] = str(cluster.kubeconfig)
        kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION = str(cluster.kubeconfig)
        api_client = kubernetes.config.new_client_from_config(config_file=str(cluster.kubeconfig))
        core = kubernetes.client.CoreV1Api(api_client)
        custom = kubernetes.client.CustomObjectsApi(api_client)
        apps = kubernetes.client.AppsV1Api(api_client)
        ns = "bench-reconcile-" + uuid.uuid4().hex[:6]
        core.create_namespace({"metadata": {"name": ns, "labels": {IGNORE_LABEL: "ignore"}}})
        try:
            return run(args, template, ns, custom, apps)
        finally:
            core.delete_namespace(ns)
            # Pods hold node resources until KWOK deletes them; the namespace finishes in the background.
            cluster.kubectl("wait", "--for=delete", "pod", "--all", "-n", ns, "--timeout=120s", check=False,
                            timeout=130)  # fmt: skip
    finally:
        localk8s.release()


def run(args: argparse.Namespace, template: dict[str, Any], ns: str, custom: Any, apps: Any) -> int:
    created: dict[str, float] = {}
    deployed: dict[str, float] = {}
    watch = kubernetes.watch.Watch()
    watching = threading.Event()

    def watch_deployments() -> None:
        resource_version = apps.list_namespaced_deployment(ns).metadata.resource_version
        watching.set()
        for event in watch.stream(apps.list_namespaced_deployment, ns, resource_version=resource_version,
                                  timeout_seconds=int(args.timeout)):  # fmt: skip
            if event["type"] == "ADDED":
                name = event["object"].metadata.labels.get(INSTANCE_LABEL)
                deployed.setdefault(name, time.monotonic())
                if len(deployed) >= args.count:
                    watch.stop()

    watcher = threading.Thread(target=watch_deployments, daemon=True)
    with KopfRunner(["run", "--standalone", "-A", "-m", "npuserve.operator.handlers"], timeout=60):
        watcher.start()
        watching.wait(30)
        time.sleep(2)  # the operator's watch is up
        started = time.monotonic()
        for i in range(args.count):
            obj = copy.deepcopy(template)
            name = f"{template['metadata']['name']}-{i:03d}"
            obj["metadata"] = {"name": name, "namespace": ns}
            custom.create_namespaced_custom_object("npuserve.io", "v1alpha1", ns, "inferenceservices", obj)
            created[name] = time.monotonic()
        applied = time.monotonic() - started
        watcher.join(args.timeout)
        watch.stop()
    missing = sorted(set(created) - set(deployed))
    latencies = [deployed[n] - created[n] for n in created if n in deployed]
    result = {
        "count": args.count,
        "example": args.example.name,
        "create_calls_s": round(applied, 3),
        "deployments": len(latencies),
        "p50_s": round(statistics.median(latencies), 3) if latencies else None,
        "p99_s": round(percentile(latencies, 99), 3) if latencies else None,
        "max_s": round(max(latencies), 3) if latencies else None,
        "last_deployment_after_first_create_s": round(max(deployed.values()) - started, 3) if deployed else None,
        "missing": missing,
    }
    print(json.dumps(result, indent=2))
    print(f"apply -> Deployment created, {len(latencies)} InferenceServices: p50 {result['p50_s']} s, "
          f"p99 {result['p99_s']} s")  # fmt: skip
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
