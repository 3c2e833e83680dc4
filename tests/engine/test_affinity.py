import os
from pathlib import Path

from npuserve.engine.affinity import apply_cpu_binding, choose_cpus, parse_cpulist


def _fake_nodes(root: Path, nodes: dict[int, str]) -> Path:
    for n, cpulist in nodes.items():
        (root / f"node{n}").mkdir(parents=True)
        (root / f"node{n}" / "cpulist").write_text(cpulist + "\n")
    return root


def test_parse_cpulist() -> None:
    assert parse_cpulist("0-3,8,10-11") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpulist("") == set()


def test_choose_the_node_with_most_allowed_cores_or_the_named_one() -> None:
    nodes = {0: {0, 1, 2, 3}, 1: {4, 5, 6, 7}}
    assert choose_cpus({2, 3, 4, 5, 6}, nodes, None) == ({4, 5, 6}, 1)
    assert choose_cpus({2, 3, 4, 5, 6}, nodes, 0) == ({2, 3}, 0)
    # a named node with none of the pod's cores: keep the pod's cores rather than bind to nothing
    assert choose_cpus({4, 5}, nodes, 0) == ({4, 5}, None)


def test_binding_is_off_unless_asked(tmp_path: Path) -> None:
    assert apply_cpu_binding({"NPUSERVE_CPU_BINDING": "none"}, _fake_nodes(tmp_path, {0: "0"})) is None


def test_binding_narrows_this_process(tmp_path: Path) -> None:
    before = os.sched_getaffinity(0)
    one = min(before)
    root = _fake_nodes(tmp_path, {0: str(one), 1: "100000"})
    try:
        assert apply_cpu_binding({"NPUSERVE_CPU_BINDING": "numa"}, root) == {one}
        assert os.sched_getaffinity(0) == {one}
    finally:
        os.sched_setaffinity(0, before)
