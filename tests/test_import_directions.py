"""The dependency arrows between the parts (docs/architecture.md, "Parts and arrows"), read from the source:

    contracts (npuserve/) <- engine's torch-free core (scheduler, kvcache) <- engine
    contracts <- loadgen
    contracts <- planning (the pure planner and tuner) <- operator
    engine's torch-free core, loadgen, planning <- sim

Every arrow points down: the operator and the simulator both use the planning core and neither uses the other, so
no cycle can form between them. Every import in every .py file of npuserve/, engine/, planning/, operator/, loadgen/
and sim/ counts, function-level and TYPE_CHECKING ones included: a lazy import is still an arrow. A second check
imports every engine module in a fresh interpreter where the planning core, the operator, the simulator and the load
generator cannot be imported.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"npuserve": "npuserve", "engine": "npuserve.engine", "planning": "npuserve.planning",
           "operator": "npuserve.operator", "loadgen": "npuserve.loadgen", "sim": "npuserve.sim"}
PARTS = ("engine", "planning", "operator", "loadgen", "sim")  # npuserve.<part>; any other npuserve module is a contract

# What the simulator takes from the engine: the torch-free core it runs on a virtual clock, and nothing that touches
# a device (tests/engine/test_imports.py checks that these import no torch).
SIM_ENGINE_CORE = {
    "npuserve.engine.scheduler": "the scheduler the simulator drives, the real one",
    "npuserve.engine.kvcache": "the KV block manager the scheduler allocates from",
    "npuserve.engine.sequence": "the request state the scheduler schedules",
    "npuserve.engine.step_output": "request_metrics: a request's timings computed as the engine reports them",
}
# The operator's I/O modules read the cluster and Prometheus and return facts; the pure modules decide. These are
# all the operator and planning modules an I/O module may import: types, names and the other I/O, no decision logic.
OPERATOR_IO = ("npuserve.operator.kube", "npuserve.operator.status_writer", "npuserve.operator.engine_http",
               "npuserve.operator.prometheus")
OPERATOR_TYPES = ("npuserve.planning.api", "npuserve.operator.autotune_types", "npuserve.operator.names")


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [FOLDERS[rel.parts[0]], *rel.parts[1:]]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, Path]:
    return {_module_name(p): p for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))}


SOURCES = _sources()


def _imports(module: str, path: Path) -> set[str]:
    """The npuserve modules `module` imports anywhere in its file. `from a import b` counts as a.b when b is a module
    of ours (`from npuserve.operator import handlers`), else as a."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            for alias in node.names:
                found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in SOURCES else target)
    return {m for m in found if m == "npuserve" or m.startswith("npuserve.")}


def _part(module: str) -> str:
    """contracts, engine, operator, loadgen or sim."""
    segments = module.split(".")
    return segments[1] if len(segments) > 1 and segments[1] in PARTS else "contracts"


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _arrows() -> Iterator[tuple[str, str]]:
    for module, path in SOURCES.items():
        for target in sorted(_imports(module, path)):
            yield module, target


ARROWS = sorted(set(_arrows()))


def _wrong(allowed: dict[str, tuple[str, ...]]) -> list[str]:
    """Arrows from a part to a part it may not import: `allowed` maps a part to the parts it may besides itself and
    the contracts."""
    return [f"{m} -> {t}" for m, t in ARROWS
            if _part(m) in allowed and _part(t) not in (_part(m), "contracts", *allowed[_part(m)])]


def test_the_source_is_read() -> None:
    """The reader finds the arrows that exist, so an empty list of wrong ones means something."""
    assert {"npuserve.engine", "npuserve.operator", "npuserve.loadgen", "npuserve.sim"} <= set(SOURCES)
    for arrow in [("npuserve.sim.engine", "npuserve.engine.scheduler"),  # from ... import
                  ("npuserve.sim.runner", "npuserve.sim.cost_model"),  # relative
                  ("npuserve.engine.server.metrics", "npuserve.engine_contract"),  # from npuserve import module
                  ("npuserve.engine.sequence", "npuserve.engine.guided")]:  # under TYPE_CHECKING
        assert arrow in ARROWS, arrow


def test_contracts_import_no_part() -> None:
    assert _wrong({"contracts": ()}) == []


def test_the_engine_imports_only_contracts() -> None:
    """Not the operator, the simulator or the load generator: the engine image has none of them to run."""
    assert _wrong({"engine": ()}) == []


def test_the_load_generator_imports_only_contracts() -> None:
    """`npuserve bench` runs against any OpenAI server: it knows the engine only by the contracts."""
    assert _wrong({"loadgen": ()}) == []


def test_the_planning_core_imports_only_contracts() -> None:
    """Pure: the operator and the simulator both build on it, so it may reach neither (nor the engine or a device)."""
    assert _wrong({"planning": ()}) == []


# The simulator's capacity model is the one part of it the operator asks (status.capacity's model figure, `npuserve
# plan --target-users`): one-way, as the simulator never imports the operator (the test below).
OPERATOR_ASKS_SIM = {"npuserve.sim.capacity": "status.capacity.modelConcurrencyPerReplica (operator/capacity.py)",
                     "npuserve.sim.capacity_cli": "npuserve plan --target-users/--target-rate (operator/plan_cli.py)"}
# The CPU engine as a calibration source measures the real engine (and the CPU's memory, with torch), so these
# simulator modules import it or torch; no other simulator module imports them, so `npuserve simulate` stays
# torch-free.
SIM_MEASURES_ENGINE = {"npuserve.sim.cpu_profile", "npuserve.sim.cpu_validation", "npuserve.sim.cpu_memory"}


def test_the_operator_imports_only_the_planning_core() -> None:
    """Not the engine or the load generator (it renders their command lines from the contracts), nor the simulator
    but for its capacity model (OPERATOR_ASKS_SIM): the simulator never imports the operator."""
    wrong = _wrong({"operator": ("planning", "sim")})
    wrong += [f"{m} -> {t}" for m, t in ARROWS if _part(m) == "operator" and _part(t) == "sim"
              and t not in OPERATOR_ASKS_SIM]
    assert wrong == []
    assert {t for m, t in ARROWS if _part(m) == "operator" and _part(t) == "sim"} == set(OPERATOR_ASKS_SIM)


def test_the_simulator_imports_the_torch_free_core_the_load_generator_and_the_planning_core() -> None:
    """Never the operator: `npuserve simulate` and `npuserve tune --simulate` run the planner and tuner the operator
    runs, from the planning core, without a cluster."""
    wrong = _wrong({"sim": ("engine", "loadgen", "planning")})
    for module, target in ARROWS:
        if (_part(module) == "sim" and _part(target) == "engine" and module not in SIM_MEASURES_ENGINE
                and not any(_under(target, c) for c in SIM_ENGINE_CORE)):
            wrong.append(f"{module} -> {target} (not the engine's torch-free core)")
        if _part(module) == "sim" and module not in SIM_MEASURES_ENGINE and target in SIM_MEASURES_ENGINE:
            wrong.append(f"{module} -> {target} (a module that imports the engine)")
    assert wrong == []
    # The list names modules that exist and are used: a stale entry would allow an arrow nobody checks.
    used = {t for m, t in ARROWS if _part(m) == "sim"}
    assert all(any(_under(t, core) for t in used) for core in SIM_ENGINE_CORE)
    assert {t for t in used if _part(t) == "planning"} >= {"npuserve.planning.planner", "npuserve.planning.tuner"}


def test_no_part_has_a_cycle_with_another() -> None:
    """The arrows between parts, drawn as a graph of parts, have no cycle: every part reaches only parts below it."""
    below = {(_part(m), _part(t)) for m, t in ARROWS if _part(m) != _part(t)}
    reach = {p: {t for m, t in below if m == p} for p in (*PARTS, "contracts")}
    changed = True
    while changed:
        changed = False
        for targets in reach.values():
            more = set().union(*(reach[t] for t in targets)) - targets if targets else set()
            if more:
                targets |= more
                changed = True
    assert sorted(p for p, targets in reach.items() if p in targets) == []


@pytest.mark.parametrize("io_module", OPERATOR_IO)
def test_the_operators_io_modules_import_no_decision_logic(io_module: str) -> None:
    own = sorted(t for m, t in ARROWS if m == io_module and _part(t) in ("operator", "planning"))
    assert own and set(own) <= {*OPERATOR_TYPES, *OPERATOR_IO} - {io_module}, own


def _module_cycles(part: str) -> list[list[str]]:
    """The import cycles among `part`'s modules (each strongly connected set of two or more, sorted), every arrow
    counted, lazy ones included."""
    graph: dict[str, set[str]] = {}
    for m, t in ARROWS:
        if _part(m) == part and _part(t) == part and m != t:
            graph.setdefault(m, set()).add(t)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


# The engine's import cycles that remain, each only through type annotations (TYPE_CHECKING); none may be added.
ENGINE_TYPE_ONLY_CYCLES = [["npuserve.engine.guided", "npuserve.engine.sequence"]]  # a Sequence holds its Guide


def test_the_engine_has_no_module_cycle() -> None:
    """Not even a lazy import back: tensor parallel's rank processes (parallel/ranks.py) build a rank with
    rank_runner.py, which joins the world through parallel/comm.py and never imports ranks.py."""
    arrows = set(ARROWS)
    assert ("npuserve.engine.parallel.ranks", "npuserve.engine.rank_runner") in arrows  # the arrow that stays
    assert ("npuserve.engine.rank_runner", "npuserve.engine.parallel.ranks") not in arrows
    assert _module_cycles("engine") == ENGINE_TYPE_ONLY_CYCLES


def test_the_handlers_and_the_command_line_import_nothing_of_each_other() -> None:
    """`npuserve operator` loads the handlers by module name, as `kopf run -m` does; what both need is in names.py."""
    handlers, cli = "npuserve.operator.handlers", "npuserve.operator.operator_cli"
    assert [a for a in ARROWS if a in ((handlers, cli), (cli, handlers))] == []


# A fresh interpreter where the planning core, the operator, the simulator and the load generator cannot be
# imported: every engine module imports (the import hook of the editable install maps the folders, so the source
# alone cannot show that).
_BLOCKED_IMPORT = """
import importlib, importlib.abc, json, pkgutil, sys
BLOCKED = ("npuserve.planning", "npuserve.operator", "npuserve.sim", "npuserve.loadgen")
tried = []
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            tried.append(name)
            raise ImportError(f"{name} is not installed here")
        return None
sys.meta_path.insert(0, Blocker())
import npuserve.engine
names = sorted(m.name for m in pkgutil.walk_packages(npuserve.engine.__path__, "npuserve.engine."))
failed = {}
for name in names:
    try:
        importlib.import_module(name)
    except Exception as e:
        failed[name] = repr(e)
print(json.dumps({"modules": names, "blocked": sorted(set(tried)), "failed": failed}))
"""


def test_every_engine_module_imports_without_the_planning_core_operator_simulator_and_load_generator() -> None:
    # -P: the repository root is the working directory, and its `operator/` folder must not shadow the stdlib.
    out = subprocess.run([sys.executable, "-P", "-c", _BLOCKED_IMPORT], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["modules"] == sorted(m for m in SOURCES if _part(m) == "engine" and m != "npuserve.engine")
    assert (result["blocked"], result["failed"]) == ([], {})


@pytest.mark.parametrize("part", ["planning", "operator", "sim", "loadgen"])
def test_no_module_cycle_within(part: str) -> None:
    assert _module_cycles(part) == []
