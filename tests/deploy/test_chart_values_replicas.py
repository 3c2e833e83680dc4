"""`replicaCount: 0` installs the CRD and RBAC without an in-cluster operator; more than one needs leader
election."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "npuserve"


def _template(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helm), "template", "t", str(CHART), *args], capture_output=True, text=True)


def test_replica_count_zero_keeps_rbac_and_scales_the_operator_to_zero(helm: Path) -> None:
    result = _template(helm, "--set", "replicaCount=0")
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    assert deployment["spec"]["replicas"] == 0
    assert any(d["kind"] == "ClusterRole" for d in docs)


def test_more_than_one_operator_needs_leader_election(helm: Path) -> None:
    result = _template(helm, "--set", "replicaCount=3")
    assert result.returncode == 0, result.stderr
    assert any(d["kind"] == "Role" and d["metadata"]["name"].endswith("-leader-election")
               for d in yaml.safe_load_all(result.stdout) if d)
    result = _template(helm, "--set", "replicaCount=2", "--set", "leaderElection.enabled=false")
    assert result.returncode != 0 and "replicaCount" in result.stderr
    assert _template(helm, "--set", "replicaCount=-1").returncode != 0
