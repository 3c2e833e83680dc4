"""The scheduler and the KV cache import no torch (docs/architecture.md): they run, and are tested, where torch is
absent.

Each check runs in a fresh interpreter, since this test process may have imported torch already.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

PACKAGES = ("npuserve.engine.scheduler", "npuserve.engine.kvcache", "npuserve.sim")


def _run(code: str) -> subprocess.CompletedProcess[str]:
    # -P: the repository root is the working directory, and its `operator/` folder must not shadow the stdlib.
    return subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("package", PACKAGES)
def test_importing_pulls_in_no_torch(package: str) -> None:
    result = _run(
        "import importlib, sys\n"
        f"importlib.import_module({package!r})\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("package", PACKAGES)
def test_works_where_torch_cannot_be_imported(package: str) -> None:
    # sys.modules['torch'] = None makes every `import torch` raise ImportError, as on a host without torch.
    result = _run(
        "import importlib, sys\n"
        "sys.modules['torch'] = None\n"
        f"module = importlib.import_module({package!r})\n"
        "print(sorted(module.__all__))\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith("[")


def test_a_scheduler_step_runs_without_torch() -> None:
    """Not only the import: a request is scheduled, stepped and finished with torch unimportable."""
    result = _run(
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "from npuserve.engine.kvcache import KVCacheManager\n"
        "from npuserve.engine.scheduler import Scheduler\n"
        "from npuserve.engine.sequence import SamplingParams, Sequence\n"
        "from npuserve.mindie_config import ScheduleSection\n"
        "kv = KVCacheManager(8, 0, 4)\n"
        "sched = Scheduler(ScheduleSection(), kv, clock=lambda: 0.0)\n"
        "seq = Sequence([1, 2, 3], SamplingParams(max_tokens=2), arrival_time=0.0)\n"
        "sched.add(seq)\n"
        "while sched.has_unfinished():\n"
        "    out = sched.schedule()\n"
        "    sched.update_from_output(out, [7] * len(out.seqs))\n"
        "print(seq.output_token_ids, seq.finish_reason.value, kv.usage)\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[7, 7] length 0.0"


@pytest.mark.parametrize("module", ["npuserve.engine.runner", "npuserve.engine.step_input"])
def test_the_runner_sees_no_sequence_and_no_grammar(module: str) -> None:
    # docs/engine.md: the runner takes a StepInput of tensors and plain values, built on the scheduler's side
    import ast
    import importlib
    import inspect

    tree = ast.parse(inspect.getsource(importlib.import_module(module)))
    imported = {(node.module, alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and (node.module or "").startswith("npuserve") for alias in node.names}
    assert not {name for _, name in imported} & {"Sequence", "Guide", "CompiledGrammar"}, imported
    assert not {m for m, _ in imported} & {"npuserve.engine.guided", "npuserve.engine.step_builder"}, imported
