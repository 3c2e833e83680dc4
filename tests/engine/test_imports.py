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
        "    sched.update(out, [7] * len(out.seqs))\n"
        "print(seq.output_token_ids, seq.finish_reason.value, kv.usage)\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[7, 7] length 0.0"
