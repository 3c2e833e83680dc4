"""Fixtures for the end-to-end tests: the local cluster of `e2e/cluster/localk8s.py`.

The first run builds the Kubernetes binaries (cached outside the repository). Set NPUSERVE_SKIP_E2E=1 to skip every
test marked `e2e`; nothing else skips them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# The harness lives outside the package; import it by its folder (never the repository root: `operator/`).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "e2e" / "cluster"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # operator_harness, shared by the operator's e2e tests
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "e2e"))  # models: the demo's model folders

import localk8s
import yaml
from models import create_dummy_for
from operator_harness import REPO, Operator, helm_install, running_operator


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("NPUSERVE_SKIP_E2E", "") not in ("", "0"):
        skip = pytest.mark.skip(reason="NPUSERVE_SKIP_E2E is set")
        for item in items:
            if "e2e" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def k8s_cluster() -> Iterator[localk8s.Cluster]:
    """The local cluster for the whole session. One started by `make cluster-up` is used and left running; one
    started here is stopped when the last test session using it (several may run in one checkout) ends."""
    cluster = localk8s.acquire()
    try:
        yield cluster
    finally:
        localk8s.release()


@pytest.fixture(scope="module")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's model: random weights and a tokenizer, the architecture examples/demo.yaml declares."""
    spec = yaml.safe_load((REPO / "examples" / "demo.yaml").read_text())["spec"]
    return create_dummy_for(spec, tmp_path_factory.mktemp("models") / "demo")


@pytest.fixture(scope="module")
def tuning_operator(k8s_cluster: localk8s.Cluster) -> Iterator[Operator]:
    """The chart installed and the operator running (its autotune loop reading the cluster's Prometheus)."""
    helm_install(k8s_cluster)
    with running_operator(k8s_cluster) as op:
        yield op
