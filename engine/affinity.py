"""CPU binding of the engine's processes (`NPUSERVE_CPU_BINDING=numa`): the MindIE guide's `taskset`, automated.

Each rank's process calls `apply_cpu_binding(rank=r, world_size=n)` (`npuserve serve` alone: `apply_cpu_binding()`,
rank 0 of 1) before torch starts its thread pools (they size themselves from the affinity). The pod already has
exclusive cores (integer CPU requests equal to limits under the static CPU manager); this narrows each rank's process
to cores of one NUMA node among them, so host-side work (tokenization, scheduling, the copy engine's staging, the
kernel launches for its card) stays next to its card's memory controller.

One process (worldSize 1): the node is `NPUSERVE_NUMA_NODE` when set (a user who knows the card topology; the
operator does not set it), else the node holding most of the pod's cores: with the kubelet's Topology Manager
(`single-numa-node` or `restricted`), the exclusive cores and the cards are allocated on the same node, so that is
the cards' node.

Several ranks in one pod (worldSize n > 1, rank r drives the r-th of the pod's cards): rank r's node is the r-th
entry of `NPUSERVE_RANK_NUMA_NODES` ("0,0,1,1") when set, else `NPUSERVE_NUMA_NODE` for every rank when that is set,
else the node of index `r x k / n` among the k NUMA nodes holding the pod's cores (in node order). That last rule
follows the cards when the Topology Manager aligned the pod's cores with its cards and the cards are numbered in the
order of their nodes (cards 0-3 on the first socket of an 8-card server, 4-7 on the second); a user who knows
otherwise sets the list. Ranks on one node split that node's cores among the pod's evenly, by whole physical cores
(hyperthread siblings stay with one rank), into disjoint sets; when a node holds fewer cores than ranks, ranks share
cores (with a warning) rather than fail.

The pod's cores are this process's affinity at the first binding; that binding records them in the environment
(`NPUSERVE_POD_CPUS`), so a worker started after its parent narrowed itself (children inherit the narrowed affinity)
still splits the pod's cores, and a second call (rank 0 once it has read worldSize from config.json) re-binds.

`NPUSERVE_NUMA_SYSFS_ROOT` points the NUMA topology at another folder than /sys/devices/system/node: the tests use it
to stand in a two-node machine, which this development box is not. The hyperthread siblings are read through the
node folders' `cpuN` links (`nodeN/cpuM/topology/thread_siblings_list`); without them every CPU is its own core.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, MutableMapping, Sequence
from pathlib import Path

from npuserve.engine_contract import CPU_BINDING_ENV, CPU_BINDINGS, NUMA_NODE_ENV, RANK_NUMA_NODES_ENV

log = logging.getLogger(__name__)

NODE_ROOT = Path("/sys/devices/system/node")
SYSFS_ROOT_ENV = "NPUSERVE_NUMA_SYSFS_ROOT"
# The pod's cores as the first binding found them (the kernel's cpulist format), written into this process's
# environment before it narrows itself: a worker started later inherits the narrowed affinity of its parent, and
# splits the pod's cores from this instead. Engine-internal: written and read only here.
POD_CPUS_ENV = "NPUSERVE_POD_CPUS"


def parse_cpulist(text: str) -> set[int]:
    """`0-3,8,10-11` -> {0, 1, 2, 3, 8, 10, 11} (the kernel's cpulist format)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def numa_nodes(root: Path = NODE_ROOT) -> dict[int, set[int]]:
    nodes: dict[int, set[int]] = {}
    for path in sorted(root.glob("node[0-9]*")):
        cpulist = path / "cpulist"
        if cpulist.exists():
            nodes[int(path.name.removeprefix("node"))] = parse_cpulist(cpulist.read_text())
    return nodes


def thread_siblings(root: Path, nodes: Mapping[int, set[int]], cpus: set[int]) -> dict[int, frozenset[int]]:
    """Each of `cpus` -> the CPUs of its physical core (itself and its hyperthread siblings), read through the node
    folders' cpu links; a CPU whose topology cannot be read is a core of its own."""
    siblings: dict[int, frozenset[int]] = {}
    for node, node_cpus in nodes.items():
        for cpu in node_cpus & cpus:
            path = root / f"node{node}" / f"cpu{cpu}" / "topology" / "thread_siblings_list"
            try:
                siblings[cpu] = frozenset(parse_cpulist(path.read_text()) | {cpu})
            except (OSError, ValueError):
                siblings[cpu] = frozenset({cpu})
    return siblings


def choose_cpus(allowed: set[int], nodes: Mapping[int, set[int]], node: int | None) -> tuple[set[int], int | None]:
    """The cores to bind to: the chosen node's among the allowed ones; all allowed ones if that leaves none."""
    if not nodes:
        return allowed, None
    if node is None:
        node = max(nodes, key=lambda n: (len(nodes[n] & allowed), -n))
    chosen = nodes.get(node, set()) & allowed
    return (chosen, node) if chosen else (allowed, None)


def rank_node_list(allowed: set[int], nodes: Mapping[int, set[int]], world_size: int,
                   rank_nodes: Sequence[int] | None = None) -> list[int | None]:
    """Each rank's NUMA node: `rank_nodes` when given (one per rank), else node index `r x k / world_size` among the
    k nodes holding allowed cores. None where the node holds none of the allowed cores (or there is no topology):
    that rank shares all the allowed cores with the other such ranks."""
    if world_size < 1:
        raise ValueError(f"world_size {world_size} must be at least 1")
    if rank_nodes is not None:
        if len(rank_nodes) != world_size:
            raise ValueError(f"{len(rank_nodes)} NUMA nodes for {world_size} ranks")
        return [n if nodes.get(n, set()) & allowed else None for n in rank_nodes]
    candidates = sorted(n for n in nodes if nodes[n] & allowed)
    if not candidates:
        return [None] * world_size
    return [candidates[r * len(candidates) // world_size] for r in range(world_size)]


def _physical_cores(cpus: set[int], siblings: Mapping[int, frozenset[int]] | None) -> list[list[int]]:
    """`cpus` grouped by physical core (the siblings that are among `cpus`), ordered by their lowest CPU."""
    seen: set[int] = set()
    cores: list[list[int]] = []
    for cpu in sorted(cpus):
        if cpu in seen:
            continue
        core = sorted((set((siblings or {}).get(cpu, frozenset())) | {cpu}) & cpus)
        seen.update(core)
        cores.append(core)
    return cores


def split_cpus(cpus: set[int], parts: int, index: int,
               siblings: Mapping[int, frozenset[int]] | None = None) -> set[int]:
    """Part `index` of `parts` near-equal, disjoint, non-empty shares of `cpus`, by whole physical cores; when there
    are fewer cores than parts, part i takes core `i x cores / parts` (shared with its neighbours), then CPUs of it."""
    if not 0 <= index < parts:
        raise ValueError(f"part {index} of {parts}")
    cores = _physical_cores(cpus, siblings)
    if not cores:
        return set()
    if len(cores) >= parts:
        lo, hi = index * len(cores) // parts, (index + 1) * len(cores) // parts
        return {cpu for core in cores[lo:hi] for cpu in core}
    # Fewer physical cores than parts: split the hyperthreads when there are enough CPUs, else share CPUs.
    flat = [cpu for core in cores for cpu in core]
    if len(flat) >= parts:
        return set(flat[index * len(flat) // parts:(index + 1) * len(flat) // parts])
    return {flat[index * len(flat) // parts]}


def rank_cpus(allowed: set[int], nodes: Mapping[int, set[int]], rank: int, world_size: int,
              rank_nodes: Sequence[int] | None = None,
              siblings: Mapping[int, frozenset[int]] | None = None) -> set[int]:
    """The cores rank `rank` of `world_size` binds to: its node's allowed cores (`rank_node_list`), split evenly
    among the ranks on that node; ranks whose node holds none of the allowed cores split all the allowed ones."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    assignment = rank_node_list(allowed, nodes, world_size, rank_nodes)
    node = assignment[rank]
    pool = nodes[node] & allowed if node is not None else set(allowed)
    peers = [r for r, n in enumerate(assignment) if n == node]
    return split_cpus(pool, len(peers), peers.index(rank), siblings)


class CPUBindingError(ValueError):
    """The binding variables are invalid; the message names the variable."""


def _node_env(env: Mapping[str, str], nodes: Mapping[int, set[int]]) -> int | None:
    raw = env.get(NUMA_NODE_ENV, "")
    try:
        node = int(raw) if raw else None
    except ValueError:
        raise CPUBindingError(f"{NUMA_NODE_ENV}={raw!r} is not a NUMA node number") from None
    if node is not None and node not in nodes:
        raise CPUBindingError(f"{NUMA_NODE_ENV}={node}: this machine has NUMA nodes {sorted(nodes)}")
    return node


def _rank_nodes_env(env: Mapping[str, str], nodes: Mapping[int, set[int]], world_size: int) -> list[int] | None:
    raw = env.get(RANK_NUMA_NODES_ENV, "").strip()
    if not raw:
        return None
    try:
        listed = [int(part) for part in raw.split(",")]
    except ValueError:
        raise CPUBindingError(f"{RANK_NUMA_NODES_ENV}={raw!r} is not a comma-separated list of NUMA node numbers"
                              ) from None
    if len(listed) != world_size:
        raise CPUBindingError(f"{RANK_NUMA_NODES_ENV}={raw!r} names {len(listed)} NUMA node(s) for {world_size} "
                              "rank(s): give one per rank")
    unknown = sorted(set(listed) - set(nodes))
    if unknown:
        raise CPUBindingError(f"{RANK_NUMA_NODES_ENV}={raw!r}: no NUMA node {unknown}; this machine has "
                              f"{sorted(nodes)}")
    return listed


def _pod_cpus(env: Mapping[str, str]) -> set[int]:
    """The pod's cores: as the first binding in this process or an ancestor recorded them, else this process's
    affinity (recorded now, for the next call and the workers it starts)."""
    recorded = env.get(POD_CPUS_ENV, "")
    try:
        cpus = parse_cpulist(recorded)
    except ValueError:
        raise CPUBindingError(f"{POD_CPUS_ENV}={recorded!r} is not a CPU list") from None
    if cpus:
        return cpus
    cpus = os.sched_getaffinity(0)
    if isinstance(env, MutableMapping):
        env[POD_CPUS_ENV] = _cpulist(cpus)
    return cpus


def apply_cpu_binding(environ: Mapping[str, str] | None = None, root: Path | None = None, *, rank: int = 0,
                      world_size: int = 1) -> set[int] | None:
    """Binds this process (rank `rank` of `world_size` in the pod) when NPUSERVE_CPU_BINDING=numa; returns the
    cores, or None when binding is off. With no arguments: the one engine process, as before tensor parallel."""
    env = os.environ if environ is None else environ
    mode = env.get(CPU_BINDING_ENV, "none")
    if mode not in CPU_BINDINGS:
        raise CPUBindingError(f"{CPU_BINDING_ENV}={mode!r}: expected one of {', '.join(CPU_BINDINGS)}")
    if not 0 <= rank < world_size:
        raise CPUBindingError(f"rank {rank} is outside worldSize {world_size}")
    if mode != "numa":
        return None
    sysfs = root or Path(env.get(SYSFS_ROOT_ENV) or NODE_ROOT)
    nodes = numa_nodes(sysfs)
    node = _node_env(env, nodes)
    rank_nodes = _rank_nodes_env(env, nodes, world_size)
    allowed = _pod_cpus(env)
    if world_size == 1 and rank_nodes is None:
        cpus, chosen = choose_cpus(allowed, nodes, node)
    else:
        if rank_nodes is None and node is not None:
            rank_nodes = [node] * world_size
        chosen = rank_node_list(allowed, nodes, world_size, rank_nodes)[rank]
        siblings = thread_siblings(sysfs, nodes, allowed)
        cpus = rank_cpus(allowed, nodes, rank, world_size, rank_nodes, siblings)
        sharing = sum(1 for r in range(world_size) if r != rank
                      and cpus & rank_cpus(allowed, nodes, r, world_size, rank_nodes, siblings))
        if sharing:
            log.warning("CPU binding: rank %d shares cores %s with %d other rank(s): NUMA node %s holds fewer "
                        "of the pod's cores than ranks; request more CPUs (spec.engine.cpu)", rank, _cpulist(cpus),
                        sharing, chosen)
    os.sched_setaffinity(0, cpus)
    log.info("CPU binding (%s=numa): rank %d of %d, NUMA node %s, cores %s", CPU_BINDING_ENV, rank, world_size,
             chosen, _cpulist(cpus))
    return cpus


def _cpulist(cpus: set[int]) -> str:
    """{0, 1, 2, 3, 8} -> `0-3,8` (the kernel's cpulist format, as `taskset -c` takes it)."""
    ranges: list[str] = []
    for cpu in sorted(cpus):
        if ranges and cpu == int(ranges[-1].rpartition("-")[2]) + 1:
            ranges[-1] = f"{ranges[-1].partition('-')[0]}-{cpu}"
        else:
            ranges.append(str(cpu))
    return ",".join(ranges)


def rank_threads(world_size: int, environ: Mapping[str, str] | None = None) -> int:
    """Torch threads of one of `world_size` tensor-parallel ranks in the pod (the one definition; the operator sets
    none). Bound (`NPUSERVE_CPU_BINDING=numa`), a rank has cores of its own and uses them all; unbound, the ranks
    share the process's cores, or `OMP_NUM_THREADS` (the container's CPU budget) when set, and each takes its share."""
    env = os.environ if environ is None else environ
    cores = len(os.sched_getaffinity(0))
    if env.get(CPU_BINDING_ENV) == "numa":
        return cores
    omp = env.get("OMP_NUM_THREADS", "")
    budget = int(omp) if omp.isdigit() and int(omp) > 0 else cores
    return max(1, budget // world_size)
