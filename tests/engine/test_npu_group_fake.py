"""A tensor-parallel group of pods on Ascend, as far as the FAKE torch_npu and the FAKE hccl (tests/fake_hccl.py)
can tell without cards: each pod (a process on its own loopback address, its own stand-in machine) joins the world
with the npu backend's "hccl" through the group link, under the environment the operator renders for a multi-node
Ascend replica (npuserve.operator.render.rank_env, status.podIP resolved to the pod's address); without HCCL_IF_IP
the join fails with the fake's message and the group ends. What only hardware proves (HCCL over RoCE between real
nodes, HCCL_IF_IP routing) is listed in docs/engine.md#tensor-parallel-across-pods."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from tests.fake_hccl import CONNECT_TIMEOUT_RANGE_S, NODE_ENV, check_environment
from tests.fake_npu_attention import FakeNPUError
from tests.serve_process import free_port

POD = Path(__file__).with_name("fake_hccl_pod.py")
REPO = Path(__file__).resolve().parents[2]


def pod_address(node_rank: int) -> str:
    return f"127.0.0.{2 + node_rank}"


def rendered_environment(pod_ip: str) -> dict[str, str]:
    """The HCCL settings the operator renders into every pod of a multi-node Ascend replica (the example
    llama3-70b-multinode: two pods of 8 cards), with the downward API's status.podIP resolved to `pod_ip`."""
    import yaml

    from npuserve.operator import render
    from npuserve.planning.api import InferenceService
    from npuserve.planning.planner import plan

    isvc = InferenceService.model_validate(yaml.safe_load((REPO / "examples" / "llama3-70b-multinode.yaml")
                                                          .read_text()))
    p = plan(isvc.spec)
    assert p.nodes > 1
    env: dict[str, str] = {}
    for item in render.rank_env(isvc, p):
        source: dict[str, Any] = item.get("valueFrom", {})
        if "value" in item:
            env[item["name"]] = str(item["value"])
        elif source.get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[item["name"]] = pod_ip
        else:
            raise AssertionError(f"a rank variable this test cannot resolve: {item}")
    return env


def run_group(envs: list[dict[str, str]], timeout_s: float = 30) -> list[subprocess.CompletedProcess[str]]:
    """One process per pod (the workers first), each with `envs[k]` over a clean copy of this environment."""
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HCCL_", "GLOO_"))}
    procs = []
    for k in reversed(range(len(envs))):
        procs.insert(0, subprocess.Popen(
            [sys.executable, str(POD), str(k), str(len(envs)), pod_address(k), str(port), str(timeout_s)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**base, NODE_ENV: f"node-{k}", **envs[k]}))
    done = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


def test_the_fake_takes_canns_hccl_connect_timeout_range_as_the_operator_does() -> None:
    from npuserve.operator.render import HCCL_CONNECT_TIMEOUT_RANGE_S

    assert CONNECT_TIMEOUT_RANGE_S == HCCL_CONNECT_TIMEOUT_RANGE_S


def test_a_two_pod_group_joins_over_hccl_with_the_environment_the_operator_renders() -> None:
    envs = [rendered_environment(pod_address(k)) for k in range(2)]
    assert envs[1]["HCCL_IF_IP"] == "127.0.0.3"  # the renderer sets it for a replica spanning nodes
    runs = run_group(envs)
    for k, run in enumerate(runs):
        assert run.returncode == 0, run.stderr
        assert json.loads(run.stdout.splitlines()[-1]) == {"rank": k, "sum": 3.0, "backend": "hccl"}


def test_a_pod_without_hccl_if_ip_fails_with_the_fakes_message_and_the_group_ends() -> None:
    envs = [rendered_environment(pod_address(k)) for k in range(2)]
    del envs[1]["HCCL_IF_IP"]
    leader, worker = run_group(envs)
    assert worker.returncode == 1
    assert "HCCL_IF_IP is not set, and this HCCL world spans 2 nodes" in worker.stderr
    assert leader.returncode != 0  # its pod 1 went: the group cannot go on
    assert "tensor-parallel pod 1 (" in leader.stderr and "disconnected" in leader.stderr


@pytest.mark.parametrize(("env", "message"), [
    ({"HCCL_CONNECT_TIMEOUT": "60"}, "HCCL_CONNECT_TIMEOUT='60': HCCL takes whole seconds within 120..7200"),
    ({"HCCL_SOCKET_IFNAME": "nosuch"}, "HCCL_SOCKET_IFNAME='nosuch': this host has no network interface starting"),
    ({"GLOO_SOCKET_IFNAME": "l"}, "GLOO_SOCKET_IFNAME='l': this host has no network interface named 'l'"),
    ({"HCCL_IF_IP": "fe80::1"}, "HCCL_IF_IP='fe80::1' is not an IPv4 address"),
    ({"HCCL_IF_IP": "192.0.2.77"}, "HCCL_IF_IP='192.0.2.77' is not an address of this host"),
    ({}, "HCCL_IF_IP is not set, and this HCCL world spans 2 nodes"),
])
def test_the_fake_refuses_what_hccl_would_fail_with(monkeypatch: pytest.MonkeyPatch, env: dict[str, str],
                                                    message: str) -> None:
    for name in ("HCCL_CONNECT_TIMEOUT", "HCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "HCCL_IF_IP"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(FakeNPUError, match=message.replace("(", r"\(").replace(".", r"\.")):
        check_environment(nodes=2)


def test_the_fake_takes_what_hccl_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HCCL_CONNECT_TIMEOUT", "1800")
    monkeypatch.setenv("HCCL_SOCKET_IFNAME", "lo")  # a prefix
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.setenv("HCCL_IF_IP", "127.0.0.3")
    check_environment(nodes=2)
    monkeypatch.delenv("HCCL_IF_IP")
    check_environment(nodes=1)  # one node: HCCL finds its peers on the host
