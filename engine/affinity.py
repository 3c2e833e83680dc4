"""CPU binding of the engine process (`NPUSERVE_CPU_BINDING=numa`): the MindIE guide's `taskset`, automated.

`npuserve serve` calls `apply_cpu_binding` first thing, before torch starts its thread pools (they size themselves
from the affinity). The pod already has exclusive cores (integer CPU requests equal to limits under the static CPU
manager); this narrows the process to the cores of one NUMA node among them, so host-side work (tokenization,
scheduling, the copy engine's staging) stays next to the cards' memory controller. The node is
`NPUSERVE_NUMA_NODE` when set (a user who knows the card topology; the operator does not set it), else the node
holding most of the pod's cores: with the kubelet's Topology Manager (`single-numa-node` or `restricted`), the
exclusive cores and the cards are allocated on the same node, so that is the cards' node.
`NPUSERVE_NUMA_SYSFS_ROOT` points the NUMA topology at another folder than /sys/devices/system/node: the tests
use it to stand in a two-node machine, which this development box is not.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

from npuserve.engine_contract import CPU_BINDING_ENV, CPU_BINDINGS, NUMA_NODE_ENV

log = logging.getLogger(__name__)

NODE_ROOT = Path("/sys/devices/system/node")
SYSFS_ROOT_ENV = "NPUSERVE_NUMA_SYSFS_ROOT"


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


def choose_cpus(allowed: set[int], nodes: Mapping[int, set[int]], node: int | None) -> tuple[set[int], int | None]:
    """The cores to bind to: the chosen node's among the allowed ones; all allowed ones if that leaves none."""
    if not nodes:
        return allowed, None
    if node is None:
        node = max(nodes, key=lambda n: (len(nodes[n] & allowed), -n))
    chosen = nodes.get(node, set()) & allowed
    return (chosen, node) if chosen else (allowed, None)


class CPUBindingError(ValueError):
    """The binding variables are invalid; the message names the variable."""


def apply_cpu_binding(environ: Mapping[str, str] | None = None, root: Path | None = None) -> set[int] | None:
    """Binds this process when NPUSERVE_CPU_BINDING=numa; returns the cores, or None when binding is off."""
    env = os.environ if environ is None else environ
    mode = env.get(CPU_BINDING_ENV, "none")
    if mode not in CPU_BINDINGS:
        raise CPUBindingError(f"{CPU_BINDING_ENV}={mode!r}: expected one of {', '.join(CPU_BINDINGS)}")
    if mode != "numa":
        return None
    raw = env.get(NUMA_NODE_ENV, "")
    try:
        node = int(raw) if raw else None
    except ValueError:
        raise CPUBindingError(f"{NUMA_NODE_ENV}={raw!r} is not a NUMA node number") from None
    nodes = numa_nodes(root or Path(env.get(SYSFS_ROOT_ENV) or NODE_ROOT))
    if node is not None and node not in nodes:
        raise CPUBindingError(f"{NUMA_NODE_ENV}={node}: this machine has NUMA nodes {sorted(nodes)}")
    allowed = os.sched_getaffinity(0)
    cpus, chosen = choose_cpus(allowed, nodes, node)
    os.sched_setaffinity(0, cpus)
    log.info("CPU binding (%s=numa): NUMA node %s, cores %s", CPU_BINDING_ENV, chosen, _cpulist(cpus))
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
