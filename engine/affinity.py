"""CPU binding of the engine process (`NPUSERVE_CPU_BINDING=numa`): the MindIE guide's `taskset`, automated.

The pod already has exclusive cores (integer CPU requests equal to limits under the static CPU manager); this
narrows the process to the cores of one NUMA node among them, so host-side work (tokenization, scheduling, the
copy engine's staging) stays next to the cards' memory controller. The node is `NPUSERVE_NUMA_NODE` when set
(the operator or a user who knows the card topology), else the node holding most of the pod's cores.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger(__name__)

NODE_ROOT = Path("/sys/devices/system/node")


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


def apply_cpu_binding(environ: Mapping[str, str] | None = None, root: Path = NODE_ROOT) -> set[int] | None:
    """Binds this process when NPUSERVE_CPU_BINDING=numa; returns the cores, or None when binding is off."""
    env = os.environ if environ is None else environ
    if env.get("NPUSERVE_CPU_BINDING", "none") != "numa":
        return None
    raw = env.get("NPUSERVE_NUMA_NODE")
    node = int(raw) if raw not in (None, "") else None
    allowed = os.sched_getaffinity(0)
    cpus, chosen = choose_cpus(allowed, numa_nodes(root), node)
    os.sched_setaffinity(0, cpus)
    log.info("CPU binding: NUMA node %s, cores %s", chosen, sorted(cpus))
    return cpus
