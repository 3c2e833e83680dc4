"""`npuserve serve` as the operator starts it: CPU binding from the contract's variables, refusals at start-up."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import httpx
import pytest

from npuserve.engine_contract import CPU_BINDING_ENV, NUMA_NODE_ENV
from tests import serve_process as harness
from tests.serve_process import SERVE, free_port, wait_ready


def _allowed_cpus(pid: int) -> set[int]:
    from npuserve.engine.affinity import parse_cpulist

    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return parse_cpulist(line.split(":", 1)[1])
    raise AssertionError("no Cpus_allowed_list")


def _two_node_sysfs(root: Path, cpus: list[int]) -> Path:
    """A stand-in for a two-NUMA-node machine (this box has one node): node 0 gets the first core, node 1 the rest."""
    for node, members in ((0, cpus[:1]), (1, cpus[1:])):
        (root / f"node{node}").mkdir(parents=True)
        (root / f"node{node}" / "cpulist").write_text(",".join(map(str, members)) + "\n")
    return root


def _serve_and_read_affinity(model: Path, env: dict[str, str]) -> tuple[set[int], set[int], str]:
    """Starts `npuserve serve`, waits for /ready, answers one request; (process cores, union of thread cores, log)."""
    port = free_port()
    proc = subprocess.Popen([*SERVE, "--model", str(model), "--host", "127.0.0.1", "--port", str(port)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc)
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                            json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert answer.status_code == 200
        process = _allowed_cpus(proc.pid)
        threads = set().union(*(_allowed_cpus(int(t.name)) for t in Path(f"/proc/{proc.pid}/task").iterdir()))
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    return process, threads, out


def test_serve_binds_itself_to_the_numa_node_before_serving(tiny_model_dir: Path, tmp_path: Path) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two usable cores to tell a binding from none")
    env = os.environ | {CPU_BINDING_ENV: "numa", NUMA_NODE_ENV: "1",
                        "NPUSERVE_NUMA_SYSFS_ROOT": str(_two_node_sysfs(tmp_path / "node", cpus))}
    process, threads, log = _serve_and_read_affinity(tiny_model_dir, env)
    assert process == set(cpus[1:])
    assert threads == set(cpus[1:])  # torch's threads started inside the binding
    assert f"CPU binding ({CPU_BINDING_ENV}=numa): rank 0 of 1, NUMA node 1, cores {cpus[1]}" in log

    # the control: the same server without the variable keeps every core it was given
    env = {k: v for k, v in env.items() if k != CPU_BINDING_ENV}
    process, threads, log = _serve_and_read_affinity(tiny_model_dir, env)
    assert process == threads == set(cpus)
    assert "CPU binding" not in log


@pytest.mark.parametrize(("env", "message"), [
    ({CPU_BINDING_ENV: "taskset"}, f"{CPU_BINDING_ENV}='taskset'"),
    ({CPU_BINDING_ENV: "numa", NUMA_NODE_ENV: "x"}, f"{NUMA_NODE_ENV}='x'"),
    ({CPU_BINDING_ENV: "numa", NUMA_NODE_ENV: "7"}, f"{NUMA_NODE_ENV}=7"),
    ({"MIES_USE_MB_SWAPPER": "1"}, "MIES_USE_MB_SWAPPER"),
])
def test_serve_refuses_bad_binding_and_unsupported_environment(tiny_model_dir: Path, env: dict[str, str],
                                                                message: str) -> None:
    proc = subprocess.run([*SERVE, "--model", str(tiny_model_dir)], env=os.environ | env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert message in proc.stderr


@pytest.mark.parametrize(("change", "named"), [
    ({"ModelConfig": {"worldSize": 3}}, "does not divide the model's num_attention_heads 4"),
    ({"npuserve": {"device": "npu"}}, "the npu backend needs torch_npu"),
    ({"npuserve": {"device": "cuda"}, "ModelConfig": {"worldSize": 2}}, "lists 1 card(s) for worldSize 2"),
    ({"Backend": {"multiNodesInferEnabled": True}}, "multiNodesInferEnabled"),
    ({"ModelConfig": {"trustRemoteCode": True}}, "trustRemoteCode"),
    ({"ServerConfig": {"httpsEnabled": True}}, "ServerConfig.httpsEnabled"),
])
def test_serve_refuses_what_it_cannot_serve_before_loading(tiny_model_dir: Path, tmp_path: Path,
                                                           change: dict[str, dict[str, object]], named: str) -> None:
    from npuserve.mindie_config import minimal_config

    data = minimal_config(tiny_model_dir).to_dict()
    data["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0].update(change.get("ModelConfig", {}))
    data["BackendConfig"].update(change.get("Backend", {}))
    data["ServerConfig"] = change.get("ServerConfig", {})
    data["npuserve"] = change.get("npuserve", {})
    config = tmp_path / "config.json"
    config.write_text(json.dumps(data))
    proc = subprocess.run([*SERVE, "--config", str(config)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert named in proc.stderr


def test_the_harness_shows_a_failed_starts_output(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match=r"(?s)exit code 1\).*no config.json in model folder"), \
            harness.serve_process("--model", str(tmp_path / "missing")):
        pass


def test_the_harness_starts_again_on_another_port_when_its_port_was_taken(tiny_model_dir: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # The race serve_process answers: a port found free, then taken before the server binds it.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports = iter([port, free_port()])
        monkeypatch.setattr(harness, "free_port", lambda: next(ports))
        with harness.serve_process("--model", str(tiny_model_dir), "--log-level", "warning") as (base, _):
            assert not base.endswith(f":{port}")
            assert httpx.get(base + "/ready", timeout=5).status_code == 200
