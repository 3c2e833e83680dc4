"""What the operator's e2e tests share: polling with a deadline, the operator in this process (kopf's KopfRunner,
the local cluster's kubeconfig and Prometheus), and `helm install` of the chart."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import kubernetes
import localk8s
import pytest
from kopf.testing import KopfRunner

from npuserve.operator.names import PROMETHEUS_URL_ENV
from npuserve.operator.operator_cli import HANDLERS_MODULE

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "npuserve"
RELEASE, RELEASE_NAMESPACE = "npuserve", "npuserve-system"
KOPF_ARGS = ["run", "--standalone", "-A", "-m", HANDLERS_MODULE]

T = TypeVar("T")


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = 180, interval: float = 0.5) -> T:
    """Poll `probe` until it returns something truthy; fail naming `what` (and the last value) after `timeout`."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = probe()
        except (RuntimeError, httpx.HTTPError, OSError) as e:
            last = e
        if last:
            return last
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")


def events(cluster: localk8s.Cluster, namespace: str, name: str, reason: str) -> list[dict[str, Any]]:
    """The Events about object `name` in `namespace` with `reason`."""
    found: list[dict[str, Any]] = cluster.kubectl_json(
        "get", "events", "-n", namespace, f"--field-selector=involvedObject.name={name},reason={reason}")["items"]  # type: ignore[assignment]
    return found


class Operator:
    """The kopf operator in a thread of this process, KUBECONFIG pointing at the local cluster, its autotune loop
    reading the cluster's Prometheus."""

    def __init__(self, cluster: localk8s.Cluster) -> None:
        self.cluster = cluster
        self.runner: KopfRunner | None = None

    def start(self) -> None:
        os.environ["KUBECONFIG"] = str(self.cluster.kubeconfig)
        os.environ[PROMETHEUS_URL_ENV] = self.cluster.prometheus_url
        # kopf's own login calls load_kube_config() without a file: the client library took its default from
        # KUBECONFIG when it was first imported, maybe before this test set it.
        kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION = str(self.cluster.kubeconfig)
        self.runner = KopfRunner(KOPF_ARGS, timeout=60)
        self.runner.__enter__()

    def stop(self) -> None:
        if self.runner is not None:
            runner, self.runner = self.runner, None
            runner.__exit__(None, None, None)
            assert runner.exit_code == 0, runner.output[-3000:]


def helm_install(cluster: localk8s.Cluster) -> str:
    """`helm upgrade --install` of the chart (idempotent: each module that needs it calls it)."""
    helm = localk8s.ensure_binaries(with_helm=True).helm
    proc = subprocess.run(
        [str(helm), "upgrade", "--install", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE,
         "--create-namespace", "--wait", "--timeout", "120s", f"--kubeconfig={cluster.kubeconfig}"],
        text=True, capture_output=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@contextlib.contextmanager
def running_operator(cluster: localk8s.Cluster) -> Iterator[Operator]:
    op = Operator(cluster)
    op.start()
    try:
        yield op
    finally:
        op.stop()


@contextlib.contextmanager
def scratch_namespace(cluster: localk8s.Cluster, prefix: str) -> Iterator[str]:
    """A new namespace; afterwards its InferenceServices and Deployments are deleted, their pods awaited (so no engine
    process outlives the test) and the namespace deleted."""
    ns = prefix + uuid.uuid4().hex[:6]
    cluster.kubectl("create", "namespace", ns)
    try:
        yield ns
    finally:
        cluster.kubectl("delete", "inferenceservices", "--all", "-n", ns, "--wait=true", check=False, timeout=90)
        cluster.kubectl("delete", "deployments", "--all", "-n", ns, "--wait=true", check=False, timeout=90)
        cluster.kubectl("wait", "--for=delete", "pod", "--all", "-n", ns, "--timeout=90s", check=False, timeout=100)
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def say(*args: object) -> None:
    """print() to the real stdout: kopf's runner (click's CliRunner) swaps sys.stdout while the operator runs."""
    print(*args, sep="\n", file=sys.__stdout__, flush=True)
