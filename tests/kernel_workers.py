"""Kernel checks run in worker processes: Triton's interpreter needs TRITON_INTERPRET=1 before triton is imported,
so a test file runs itself as a script (`python -P <file> interpret|compile`) and reports each check on stdout;
`run_workers` collects the reports, and a worker that dies fails the check it was running and those after it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

RUNNING, RESULT = "RUNNING ", "RESULT "  # a worker's lines: a check's name; then {check: "ok" or its traceback}

Check = Callable[[], None]


def work(checks: dict[str, Check]) -> None:
    """The worker's side: runs each check and prints its outcome."""
    for name, check in checks.items():
        print(RUNNING + name, flush=True)
        try:
            check()
            outcome = "ok"
        except Exception:
            outcome = traceback.format_exc()
        print(RESULT + json.dumps({name: outcome}), flush=True)


def run_workers(script: str, checks: dict[str, list[str]], cache_dir: Path, timeout: float) -> dict[str, str]:
    """Runs `script` once per mode of `checks` ("interpret": under TRITON_INTERPRET=1; any other: without), side by
    side, each with its own Triton cache; {check: "ok", or what went wrong}."""
    procs = {}
    for mode in checks:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["TRITON_CACHE_DIR"] = str(cache_dir / mode)
        if mode == "interpret":
            env["TRITON_INTERPRET"] = "1"
        # -P: the repository root may be the working directory, and its `operator/` must not shadow the stdlib.
        procs[mode] = subprocess.Popen([sys.executable, "-P", "-X", "faulthandler", script, mode], env=env,
                                       text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    results: dict[str, str] = {}
    for mode, proc in procs.items():
        out, err = proc.communicate(timeout=timeout)
        running = None
        for line in out.splitlines():
            if line.startswith(RUNNING):
                running = line.removeprefix(RUNNING)
            elif line.startswith(RESULT):
                results.update(json.loads(line.removeprefix(RESULT)))
        for check in checks[mode]:
            if check not in results:
                where = "while running it" if check == running else f"before it, in {running}"
                results[check] = f"the {mode} worker died (rc {proc.returncode}) {where}:\n{err[-6000:]}"
    return results
