"""CPU binding: one process bound to its cards' NUMA node, and each tensor-parallel rank to its share of the pod's
cores (disjoint, by whole physical cores, following the ranks' nodes)."""

import os
from pathlib import Path

import pytest

from npuserve.engine.affinity import (
    CPUBindingError,
    apply_cpu_binding,
    choose_cpus,
    parse_cpulist,
    rank_cpus,
    rank_node_list,
    split_cpus,
    thread_siblings,
)


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


# --- several ranks in one pod ---------------------------------------------------------------------------------------

TWO_NODES = {0: set(range(0, 8)), 1: set(range(8, 16))}


def test_rank_cpus_spread_ranks_over_the_pods_nodes_in_node_order() -> None:
    allowed = {2, 3, 4, 5, 10, 11, 12, 13}  # four exclusive cores on each node
    assert rank_node_list(allowed, TWO_NODES, 4) == [0, 0, 1, 1]
    assert [rank_cpus(allowed, TWO_NODES, r, 4) for r in range(4)] == [{2, 3}, {4, 5}, {10, 11}, {12, 13}]
    # two ranks: one per node, each with all of its node's cores
    assert [rank_cpus(allowed, TWO_NODES, r, 2) for r in range(2)] == [{2, 3, 4, 5}, {10, 11, 12, 13}]
    # world size 1 through rank_cpus: the first node holding the pod's cores
    assert rank_cpus(allowed, TWO_NODES, 0, 1) == {2, 3, 4, 5}


def test_ranks_on_one_node_split_its_cores_evenly_and_disjointly() -> None:
    allowed = set(range(0, 7))  # seven cores, all on node 0 (Topology Manager single-numa-node)
    parts = [rank_cpus(allowed, TWO_NODES, r, 3) for r in range(3)]
    assert parts == [{0, 1}, {2, 3}, {4, 5, 6}]
    assert set().union(*parts) == allowed and sum(map(len, parts)) == len(allowed)


def test_the_per_rank_list_names_each_ranks_node() -> None:
    allowed = {2, 3, 4, 5, 10, 11, 12, 13}
    assert [rank_cpus(allowed, TWO_NODES, r, 4, [1, 1, 0, 0]) for r in range(4)] == [
        {10, 11}, {12, 13}, {2, 3}, {4, 5}]
    assert [rank_cpus(allowed, TWO_NODES, r, 3, [0, 1, 0]) for r in range(3)] == [
        {2, 3}, {10, 11, 12, 13}, {4, 5}]
    # a listed node holding none of the pod's cores: that rank falls back to all of the pod's cores
    assert rank_node_list({2, 3}, TWO_NODES, 2, [0, 1]) == [0, None]
    assert rank_cpus({2, 3}, TWO_NODES, 1, 2, [0, 1]) == {2, 3}
    with pytest.raises(ValueError, match="3 NUMA nodes for 2 ranks"):
        rank_node_list(allowed, TWO_NODES, 2, [0, 0, 1])


def test_fewer_cores_than_ranks_share_rather_than_fail() -> None:
    parts = [rank_cpus({4, 5}, TWO_NODES, r, 4) for r in range(4)]
    assert parts == [{4}, {4}, {5}, {5}]
    assert all(parts)


def test_hyperthread_siblings_stay_with_one_rank() -> None:
    # x86 numbering: core c is CPUs c and c + 8; the pod holds the two threads of cores 2 to 5
    allowed = {2, 3, 4, 5, 10, 11, 12, 13}
    nodes = {0: set(range(16))}
    siblings = {c: frozenset({c % 8, c % 8 + 8}) for c in allowed}
    assert [rank_cpus(allowed, nodes, r, 2, siblings=siblings) for r in range(2)] == [
        {2, 10, 3, 11}, {4, 12, 5, 13}]
    # without the topology the two ranks would take a thread of every core each
    assert [rank_cpus(allowed, nodes, r, 2) for r in range(2)] == [{2, 3, 4, 5}, {10, 11, 12, 13}]
    # more ranks than physical cores: the threads are split, siblings adjacent
    assert [split_cpus({2, 10}, 2, r, siblings) for r in range(2)] == [{2}, {10}]


def test_no_numa_topology_still_splits_the_pods_cores() -> None:
    assert rank_node_list({0, 1, 2, 3}, {}, 2) == [None, None]
    assert [rank_cpus({0, 1, 2, 3}, {}, r, 2) for r in range(2)] == [{0, 1}, {2, 3}]


def test_the_siblings_are_read_through_the_node_folders(tmp_path: Path) -> None:
    root = _fake_nodes(tmp_path, {0: "0-3"})
    for cpu, sibling_list in {0: "0,2", 2: "0,2", 1: "1,3"}.items():  # cpu 3's topology is missing
        (root / "node0" / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (root / "node0" / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(sibling_list + "\n")
    assert thread_siblings(root, {0: {0, 1, 2, 3}}, {0, 1, 3}) == {
        0: frozenset({0, 2}), 1: frozenset({1, 3}), 3: frozenset({3})}


def _rank_binding(tmp_path: Path, environ: dict[str, str], rank: int, world_size: int) -> set[int] | None:
    before = os.sched_getaffinity(0)
    try:
        return apply_cpu_binding(environ, tmp_path, rank=rank, world_size=world_size)
    finally:
        os.sched_setaffinity(0, before)


def test_each_rank_binds_to_its_share_of_the_pods_cores(tmp_path: Path) -> None:
    pod = sorted(os.sched_getaffinity(0))
    _fake_nodes(tmp_path, {0: ",".join(map(str, pod)), 1: "100000"})
    env = {"NPUSERVE_CPU_BINDING": "numa"}
    got = [_rank_binding(tmp_path, dict(env), r, len(pod)) for r in range(len(pod))]
    assert got == [{cpu} for cpu in pod]  # one core each, disjoint
    # the recorded pod cores are what a worker splits, whatever affinity it inherited
    env["NPUSERVE_POD_CPUS"] = str(pod[-1])
    assert _rank_binding(tmp_path, env, 0, 2) == _rank_binding(tmp_path, env, 1, 2) == {pod[-1]}


def test_the_first_binding_records_the_pods_cores_for_the_workers(tmp_path: Path) -> None:
    pod = os.sched_getaffinity(0)
    _fake_nodes(tmp_path, {0: ",".join(map(str, sorted(pod)))})
    env = {"NPUSERVE_CPU_BINDING": "numa"}
    _rank_binding(tmp_path, env, 0, 1)
    assert parse_cpulist(env["NPUSERVE_POD_CPUS"]) == pod


def test_rank_binding_variables_are_checked(tmp_path: Path) -> None:
    _fake_nodes(tmp_path, {0: "0", 1: "1"})
    numa = {"NPUSERVE_CPU_BINDING": "numa"}
    with pytest.raises(CPUBindingError, match="NPUSERVE_RANK_NUMA_NODES='0,1,1' names 3 NUMA node"):
        _rank_binding(tmp_path, {**numa, "NPUSERVE_RANK_NUMA_NODES": "0,1,1"}, 0, 2)
    with pytest.raises(CPUBindingError, match=r"no NUMA node \[7\]"):
        _rank_binding(tmp_path, {**numa, "NPUSERVE_RANK_NUMA_NODES": "0,7"}, 0, 2)
    with pytest.raises(CPUBindingError, match="not a comma-separated list"):
        _rank_binding(tmp_path, {**numa, "NPUSERVE_RANK_NUMA_NODES": "a,b"}, 0, 2)
    with pytest.raises(CPUBindingError, match="rank 2 is outside worldSize 2"):
        _rank_binding(tmp_path, numa, 2, 2)
    # binding off: the rank list is not read
    assert _rank_binding(tmp_path, {"NPUSERVE_RANK_NUMA_NODES": "junk"}, 1, 2) is None


def test_each_rank_takes_its_own_cores_when_bound_and_its_share_when_not() -> None:
    from npuserve.engine.affinity import rank_threads
    from npuserve.engine_contract import CPU_BINDING_ENV

    cores = len(os.sched_getaffinity(0))
    assert rank_threads(2, {CPU_BINDING_ENV: "numa"}) == cores  # bound: the rank's own cores, all of them
    assert rank_threads(2, {CPU_BINDING_ENV: "none", "OMP_NUM_THREADS": "16"}) == 8  # the container's budget, shared
    assert rank_threads(4, {}) == max(1, cores // 4)
    assert rank_threads(64, {"OMP_NUM_THREADS": "x"}) == 1  # never none
