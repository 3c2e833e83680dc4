"""Tensor parallel across pods (docs/engine.md#tensor-parallel-across-pods), with each pod a real `npuserve serve`
process on its own loopback address of this machine (the leader on 127.0.0.2, worker pod k on 127.0.0.(2+k)), gloo
between the ranks: the group generates what one rank does, /info names every rank's pod, a worker pod serves its
probes only, the group stops with its leader, a pod that dies or never comes takes the group down naming it, and
flags that make no group are refused naming the flag."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from npuserve.engine.parallel.group import GroupError, GroupLayout, LeaderGroup, WorkerLink, expected_worker_address
from npuserve.engine_contract import (
    FLAG_GROUP_CONNECT_TIMEOUT,
    FLAG_MASTER_ADDR,
    FLAG_MASTER_PORT,
    FLAG_NNODES,
    FLAG_NODE_RANK,
    HEALTH_PATH,
    LWS_LEADER_ADDRESS_ENV,
    READY_PATH,
    TERMINATION_LOG_ENV,
    EngineInfo,
)
from npuserve.modelspec import ModelSpec
from tests.serve_process import SERVE, free_port, wait_ready
from tests.world_size_2 import MAX_TOKENS, in_process

LEADER = "127.0.0.2"
TEXTS = ["the quick brown fox", "a", "tensor parallel over two pods", "hello world, again"]


def _spec() -> ModelSpec:
    """The correctness suite's small llama (tests/engine/test_correctness.py): float32 and init_std 0.3, so greedy
    argmax is not fragile when the ranks sum partial products in another order. 4 heads, 2 KV heads: worldSize 4
    splits it too."""
    return ModelSpec(
        model_type="llama", num_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, vocab_size=512, max_position_embeddings=512, dtype="float32", rms_norm_eps=1e-5,
        rope_theta=10000.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from npuserve.engine.model.dummy import write_dummy_model

    return write_dummy_model(_spec(), tmp_path_factory.mktemp("group-llama"), seed=3, init_std=0.3)


@dataclass
class Pod:
    node_rank: int
    host: str
    port: int
    proc: subprocess.Popen[str]
    log: Path

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def output(self) -> str:
        return self.log.read_text()


@dataclass
class Group:
    pods: list[Pod] = field(default_factory=list)
    master_port: int = 0

    @property
    def leader(self) -> Pod:
        return self.pods[0]


def pod_host(node_rank: int) -> str:
    return f"127.0.0.{2 + node_rank}"


def start_pod(model_dir: Path, tmp_path: Path, node_rank: int, nnodes: int, world_size: int, master_port: int,
              *extra: str, env: dict[str, str] | None = None) -> Pod:
    host, port = pod_host(node_rank), free_port()
    log = tmp_path / f"pod{node_rank}.log"
    out = log.open("w")
    proc = subprocess.Popen([*SERVE, "--model", str(model_dir), "--host", host, "--port", str(port), "--world-size",
                             str(world_size), FLAG_NNODES, str(nnodes), FLAG_NODE_RANK, str(node_rank),
                             FLAG_MASTER_ADDR, LEADER, FLAG_MASTER_PORT, str(master_port), *extra],
                            stdout=out, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, TERMINATION_LOG_ENV: str(tmp_path / f"termination-{node_rank}"),
                                 **(env or {})})
    out.close()
    return Pod(node_rank, host, port, proc, log)


@contextmanager
def group(model_dir: Path, tmp_path: Path, nnodes: int, world_size: int) -> Iterator[Group]:
    """Every pod of a group started (workers first: they wait for their leader), each one ready."""
    g = Group(master_port=free_port())
    try:
        for k in reversed(range(nnodes)):
            g.pods.insert(0, start_pod(model_dir, tmp_path, k, nnodes, world_size, g.master_port))
        for pod in g.pods:
            wait_ready(pod.url, pod.proc, timeout=240)  # type: ignore[arg-type]
        yield g
    finally:
        for pod in g.pods:
            if pod.proc.poll() is None:
                pod.proc.kill()
                pod.proc.wait(30)


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _completions(url: str, model: str) -> list[tuple[int | None, str]]:
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="none")
    served: list[tuple[int | None, str]] = []
    for text in TEXTS:
        out = client.completions.create(model=model, prompt=text, max_tokens=MAX_TOKENS, temperature=0.0,
                                        extra_body={"ignore_eos": True})
        served.append((out.usage.completion_tokens if out.usage else None, out.choices[0].text))
    return served


def _stop_with_the_leader(g: Group) -> None:
    """SIGTERM to the leader: it drains and stops the group; every pod exits 0, the workers saying why."""
    g.leader.proc.send_signal(signal.SIGTERM)
    for pod in g.pods:
        assert pod.proc.wait(60) == 0, pod.output()
    for pod in g.pods[1:]:
        assert f"tensor-parallel pod {pod.node_rank}: the group's leader stopped the group; this pod exits" \
            in pod.output()
        assert "CRITICAL" not in pod.output()
    assert "disconnected" not in g.leader.output()


@pytest.mark.parametrize(("nnodes", "world_size"), [(2, 2), (2, 4)])
def test_a_group_of_pods_generates_what_one_rank_does_and_stops_with_its_leader(
        model_dir: Path, tmp_path: Path, nnodes: int, world_size: int) -> None:
    expected = [(len(tokens), text) for tokens, text in in_process(model_dir, TEXTS)]
    per_pod = world_size // nnodes
    with group(model_dir, tmp_path, nnodes, world_size) as g:
        assert _completions(g.leader.url, model_dir.name) == expected
        info = EngineInfo.model_validate(httpx.get(g.leader.url + "/info", timeout=5).json())
        assert (info.worldSize, info.nodes) == (world_size, nnodes)
        assert [(r.rank, r.node_rank, r.host) for r in info.ranks] == [
            (rank, rank // per_pod, socket.gethostname()) for rank in range(world_size)]
        assert info.kv_blocks == min(r.kv_blocks for r in info.ranks)
        for pod in g.pods:  # each pod runs its own ranks: its first in the serving process, the rest its children
            assert len(_children(pod.proc.pid)) == per_pod - 1
        worker = g.pods[1]
        assert httpx.get(worker.url + READY_PATH, timeout=5).status_code == 200
        assert httpx.get(worker.url + HEALTH_PATH, timeout=5).status_code == 200
        assert httpx.get(worker.url + "/v1/models", timeout=5).status_code == 404  # headless: no API
        assert httpx.get(worker.url + "/metrics", timeout=5).status_code == 404
        leader_log = g.leader.output()
        assert "pod 1 (" in leader_log and "joined" in leader_log
        assert f"tensor-parallel group complete: {nnodes} pods, worldSize {world_size}" in leader_log
        _stop_with_the_leader(g)


def test_a_worker_pod_that_dies_takes_its_leader_down_naming_it(model_dir: Path, tmp_path: Path) -> None:
    with group(model_dir, tmp_path, 2, 2) as g:
        g.pods[1].proc.kill()  # kill -9: no last word from it
        t0 = time.monotonic()
        code = g.leader.proc.wait(30)
        took = time.monotonic() - t0
    message = f"tensor-parallel pod 1 ({socket.gethostname()}, rank 1) disconnected"
    assert code != 0 and took < 10, g.leader.output()
    assert message in g.leader.output()
    assert message in (tmp_path / "termination-0").read_text()


def test_a_worker_pod_whose_leader_dies_exits_naming_it(model_dir: Path, tmp_path: Path) -> None:
    with group(model_dir, tmp_path, 2, 2) as g:
        g.leader.proc.kill()
        code = g.pods[1].proc.wait(30)
    assert code == 1
    assert f"the group's leader at {LEADER}:{g.master_port} is gone" in g.pods[1].output()


def test_a_leader_whose_worker_pod_never_comes_exits_naming_it(model_dir: Path, tmp_path: Path) -> None:
    leader = start_pod(model_dir, tmp_path, 0, 4, 4, free_port(), FLAG_GROUP_CONNECT_TIMEOUT, "3",
                       env={LWS_LEADER_ADDRESS_ENV: "llama-0.llama.team-a"})
    try:
        code = leader.proc.wait(60)
    finally:
        if leader.proc.poll() is None:
            leader.proc.kill()
    out = leader.output()  # worldSize 4 over 4 pods, none of the other three came: nothing loads
    assert code == 1, out
    assert "no hello from node rank 1 (rank 1, expected at llama-0-1.llama.team-a), node rank 2 (rank 2, " \
        "expected at llama-0-2.llama.team-a), node rank 3 (rank 3, expected at llama-0-3.llama.team-a) within 3 s" \
        in out
    assert "no hello from node rank 1" in (tmp_path / "termination-0").read_text()


def test_a_worker_pod_whose_leader_never_comes_exits_naming_its_address(model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    worker = start_pod(model_dir, tmp_path, 1, 2, 2, port, FLAG_GROUP_CONNECT_TIMEOUT, "3")
    try:
        code = worker.proc.wait(60)
    finally:
        if worker.proc.poll() is None:
            worker.proc.kill()
    assert code == 1, worker.output()
    assert f"tensor-parallel pod 1 could not reach the group's leader at {LEADER}:{port} within 3 s" \
        in worker.output()


@pytest.mark.parametrize(("flags", "named"), [
    ([FLAG_NNODES, "3", FLAG_MASTER_ADDR, LEADER], "--nnodes 3 does not divide worldSize 2"),
    ([FLAG_NNODES, "2", FLAG_NODE_RANK, "2", FLAG_MASTER_ADDR, LEADER], "--node-rank 2 is outside 0..1"),
    ([FLAG_NNODES, "2", FLAG_NODE_RANK, "-1", FLAG_MASTER_ADDR, LEADER], "--node-rank -1 is outside 0..1"),
    ([FLAG_NNODES, "2"], "--nnodes 2 needs --master-addr"),
    ([FLAG_NNODES, "0"], "--nnodes 0"),
])
def test_flags_that_make_no_group_are_refused_naming_the_flag(model_dir: Path, flags: list[str],
                                                              named: str) -> None:
    proc = subprocess.run([*SERVE, "--model", str(model_dir), "--world-size", "2", *flags], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert named in proc.stderr


@pytest.mark.parametrize(("enabled", "nnodes", "named"), [
    (False, 2, "BackendConfig.multiNodesInferEnabled is false, but --nnodes 2"),
    (True, 1, "BackendConfig.multiNodesInferEnabled is true, but this engine runs all its ranks in one pod"),
])
def test_multi_nodes_infer_enabled_must_say_what_nnodes_does(model_dir: Path, tmp_path: Path, enabled: bool,
                                                             nnodes: int, named: str) -> None:
    from npuserve.mindie_config import minimal_config

    data = minimal_config(model_dir, model={"worldSize": 2}).to_dict()
    data["BackendConfig"]["multiNodesInferEnabled"] = enabled
    (tmp_path / "config.json").write_text(json.dumps(data))
    proc = subprocess.run([*SERVE, "--config", str(tmp_path / "config.json"), FLAG_NNODES, str(nnodes),
                           FLAG_MASTER_ADDR, LEADER], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert named in proc.stderr


# --- the link's protocol, in this process ----------------------------------------------------------------------


def test_the_worker_address_follows_the_leaderworkerset_naming() -> None:
    assert expected_worker_address(2, "llama-0.llama.team-a") == "llama-0-2.llama.team-a"
    assert expected_worker_address(1, "llama-3.llama-3.team-a") == "llama-3-1.llama-3.team-a"  # UniquePerReplica
    assert expected_worker_address(1, "llama.llama.team-a") is None
    assert expected_worker_address(1, "my-lws-13.my-lws.default.svc.cluster.local") == \
        "my-lws-13-1.my-lws.default.svc.cluster.local"
    assert expected_worker_address(1, "10.0.0.5") is None
    assert expected_worker_address(1, "") is None


@pytest.mark.parametrize(("node_rank", "world_size", "model", "refused"), [
    (3, 2, "m", "node rank 3 is outside 1..1 of a group of 2 pods"),
    (1, 4, "m", "worldSize 4 differs from the leader's 2"),
    (1, 2, "other", "model 'other' differs from the leader's 'm'"),
])
def test_the_leader_refuses_a_hello_that_does_not_fit(node_rank: int, world_size: int, model: str,
                                                      refused: str) -> None:
    import threading

    port = free_port()
    leader = LeaderGroup(GroupLayout(2, 2, 0), model="m", host=LEADER, port=port, timeout_s=3)
    leader.listen()
    waited: list[BaseException] = []

    def wait() -> None:
        try:
            leader.wait_for_pods()
        except GroupError as e:
            waited.append(e)

    thread = threading.Thread(target=wait)
    thread.start()
    link = WorkerLink(GroupLayout(world_size, 2, node_rank), model, LEADER, port, timeout_s=3)
    with pytest.raises(GroupError, match=f"the group's leader refused this pod: {refused}"):
        link.connect()
    thread.join()
    leader.close()
    assert waited and "no hello from node rank 1" in str(waited[0])  # the refused pod did not count


def test_two_pods_claiming_one_node_rank_are_refused() -> None:
    import threading

    port = free_port()
    leader = LeaderGroup(GroupLayout(3, 3, 0), model="m", host=LEADER, port=port, timeout_s=5)
    leader.listen()
    threading.Thread(target=lambda: _ignore(leader.wait_for_pods), daemon=True).start()
    first = WorkerLink(GroupLayout(3, 3, 1), "m", LEADER, port, timeout_s=5)
    threading.Thread(target=lambda: _ignore(first.connect), daemon=True).start()
    deadline = time.monotonic() + 5
    while 1 not in leader.pods and time.monotonic() < deadline:
        time.sleep(0.05)
    second = WorkerLink(GroupLayout(3, 3, 1), "m", LEADER, port, timeout_s=5)
    with pytest.raises(GroupError, match=r"node rank 1 already joined from .*: two pods claim one node rank"):
        second.connect()
    leader.close()


def _ignore(fn: object) -> None:
    with contextlib.suppress(Exception):
        fn()  # type: ignore[operator]


def test_a_leader_refuses_its_configuration_before_it_waits_for_the_other_pods(model_dir: Path) -> None:
    proc = subprocess.run([*SERVE, "--model", str(model_dir), "--world-size", "3", FLAG_NNODES, "3",
                           FLAG_MASTER_ADDR, LEADER, FLAG_MASTER_PORT, str(free_port())], capture_output=True,
                          text=True, timeout=60)  # not the 600 s the other pods would get
    assert proc.returncode == 2, proc.stderr
    assert "does not divide the model's num_attention_heads 4" in proc.stderr
