"""The third-party clients the tests run against a real `npuserve serve`, installed pinned into a virtualenv of
their own, outside `.venv` (their dependencies cannot disturb the engine's), cached by their versions like the local
cluster's Kubernetes binaries (`e2e/cluster/binaries.py`): built once under a file lock, so parallel runs build it
once; progress lines on the first use. Standard library only.

    python tests/thirdparty/tools_venv.py              # the test suite's set (aiperf, guidellm, lm-eval)
    python tests/thirdparty/tools_venv.py conformance  # vLLM (`vllm bench serve`, multi-GB): `make conformance`
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

# ---- pinned versions -------------------------------------------------------------------------------------------
# The releases the engine was checked against (issue 21); a new pin gets a new virtualenv (the key is the pins).
TOOLS = {
    "clients": ("aiperf==0.13.0", "guidellm==0.8.1", "lm-eval[api]==0.4.13"),
    "conformance": ("vllm==0.33.0",),
}
# the executables each set provides, checked before the cache entry counts as complete
EXECUTABLES = {"clients": ("aiperf", "guidellm", "lm_eval"), "conformance": ("vllm",)}


def log(msg: str) -> None:
    print(f"[tools] {msg}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    """$NPUSERVE_CACHE_DIR, else $XDG_CACHE_HOME/npuserve, else ~/.cache/npuserve (as the cluster's binaries)."""
    explicit = os.environ.get("NPUSERVE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "npuserve"


def venv_key(name: str, python: str = sys.executable) -> str:
    """The set's name and a hash of its pins and the interpreter's version: a change of either is a new venv."""
    version = subprocess.run([python, "-c", "import sys; print(sys.version.split()[0])"], capture_output=True,
                             text=True, check=True).stdout.strip()
    digest = hashlib.sha256(json.dumps([version, *TOOLS[name]]).encode()).hexdigest()[:12]
    return f"{name}-py{version}-{digest}"


def venv_dir(name: str, python: str = sys.executable) -> Path:
    return cache_dir() / "tools-venv" / venv_key(name, python)


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive flock: one builder per cache entry (parallel test runs wait for it, then find it built)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _complete(root: Path, name: str) -> bool:
    return (root / ".complete").exists() and all((root / "bin" / exe).exists() for exe in EXECUTABLES[name])


def _pip(root: Path, args: Sequence[str]) -> None:
    """pip inside the venv, its Collecting/Downloading/Installing lines passed on as progress (nice 19: the
    machines that run the tests are shared)."""
    nice = ["nice", "-n", "19"] if shutil.which("nice") else []
    cmd = [*nice, str(root / "bin" / "python"), "-P", "-m", "pip", "--disable-pip-version-check", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    tail: list[str] = []
    for line in proc.stdout:
        line = line.rstrip()
        tail = [*tail[-40:], line]
        if line.startswith(("Collecting ", "Installing collected", "Successfully installed")):
            log("  " + (line if len(line) < 160 else line[:157] + "..."))
    if proc.wait() != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n" + "\n".join(tail))


def ensure_tools(name: str = "clients", python: str = sys.executable) -> Path:
    """The set's virtualenv, built on first use (a no-op afterwards). Returns its folder; `bin/` holds the tools."""
    root = venv_dir(name, python)
    if _complete(root, name):
        return root
    with file_lock(root.with_suffix(".lock")):
        if _complete(root, name):
            return root
        started = time.monotonic()
        pins = TOOLS[name]
        log(f"building the {name} virtualenv ({', '.join(pins)}) in {root} (first use; minutes)")
        shutil.rmtree(root, ignore_errors=True)
        subprocess.run([python, "-P", "-m", "venv", str(root)], check=True)
        _pip(root, ["install", "--quiet", "--upgrade", "pip"])
        _pip(root, ["install", "--progress-bar", "off", *pins])
        missing = [exe for exe in EXECUTABLES[name] if not (root / "bin" / exe).exists()]
        if missing:
            raise RuntimeError(f"the {name} virtualenv has no {', '.join(missing)} after installing {pins}")
        seconds = round(time.monotonic() - started)
        (root / ".complete").write_text(json.dumps({"pins": list(pins), "build_seconds": seconds}) + "\n")
        log(f"built the {name} virtualenv in {seconds}s")
    return root


if __name__ == "__main__":
    print(ensure_tools(sys.argv[1] if len(sys.argv) > 1 else "clients"))
