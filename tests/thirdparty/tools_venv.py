"""The third-party clients the tests run against a real `npuserve serve`, installed pinned into a virtualenv of
their own, outside `.venv` (their dependencies cannot disturb the engine's), cached by their versions like the local
cluster's Kubernetes binaries (`e2e/cluster/binaries.py`): built once under a file lock, so parallel runs build it
once; progress lines on the first use. Standard library only.

    python tests/thirdparty/tools_venv.py              # the test suite's set (aiperf, guidellm, lm-eval)
    python tests/thirdparty/tools_venv.py conformance  # vLLM (`vllm bench serve`, multi-GB): `make conformance`
    python tests/thirdparty/tools_venv.py llmcompressor  # the quantizers (torch each, multi-GB): the checkpoints of
    python tests/thirdparty/tools_venv.py msmodelslim    #   tests/quant_checkpoints.py
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
    # the quantizers that write the W8A8 checkpoints of issue 31 (tests/quant_checkpoints.py), one set each: their pins
    # of torch/transformers/compressed-tensors are their own. llmcompressor 0.14.0.1 pins compressed-tensors==0.19.0
    # and torch<=2.14.0 (above .venv's), so neither set can borrow .venv's torch.
    "llmcompressor": ("llmcompressor==0.14.0.1", "compressed-tensors==0.19.0"),
    # msmodelslim declares neither torch nor transformers. Its model adapters read experts as per-expert nn.Linear
    # (transformers 4's layout, not 5's fused tensors) and ask for transformers 4.57.1-4.57.3 for the newest models;
    # its own tests pin numpy 1.26.4 (test/requirements.txt in the wheel). transformers 4.51 (those tests' pin) fails
    # on Qwen3-MoE: its MoE block calls every expert, the unrouted ones with 0 tokens, and msModelSlim's activation
    # statistics hook takes max() of the empty tensor; 4.57 calls only the experts hit. Its torch is the
    # llmcompressor set's (BORROWS).
    "msmodelslim": ("msmodelslim==26.1.0", "transformers==4.57.3", "numpy==1.26.4"),
}
# what each set provides, checked before the cache entry counts as complete: executables under bin/, or (for the
# libraries that have none) modules the venv's python must import
EXECUTABLES = {"clients": ("aiperf", "guidellm", "lm_eval"), "conformance": ("vllm",)}
IMPORTS = {"llmcompressor": ("llmcompressor", "compressed_tensors"), "msmodelslim": ("msmodelslim", "torch")}
# a set that borrows another set's packages through a .pth file in its site-packages: torch from PyPI is a CUDA build
# of about 6 GB installed, twice would not fit the machines that run the tests. A .pth's folders come after the
# set's own site-packages on sys.path, so the set's own pins (transformers 4 beside the lender's 5) win; pip sees the
# lender's packages as installed and does not fetch them again. (.venv cannot lend: it is per checkout, and its
# torch is newer than llmcompressor's pin.)
BORROWS = {"msmodelslim": "llmcompressor"}


def log(msg: str) -> None:
    print(f"[tools] {msg}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    """$NPUSERVE_CACHE_DIR, else $XDG_CACHE_HOME/npuserve, else ~/.cache/npuserve (as the cluster's binaries)."""
    explicit = os.environ.get("NPUSERVE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "npuserve"


def in_background(argv: Sequence[str], log_name: str) -> subprocess.Popen[bytes]:
    """`argv` at the lowest priority in a process group of its own, its output in `log_name` under `cache_dir()`: a
    test run's prewarm (tests/conftest.py). What it builds holds file locks, so the test that needs it waits."""
    logfile = cache_dir() / log_name
    logfile.parent.mkdir(parents=True, exist_ok=True)
    nice = ["nice", "-n", "19"] if shutil.which("nice") else []
    with logfile.open("wb") as out:
        return subprocess.Popen([*nice, *argv], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def venv_key(name: str, python: str = sys.executable) -> str:
    """The set's name and a hash of its pins and the interpreter's version: a change of either is a new venv."""
    version = subprocess.run([python, "-c", "import sys; print(sys.version.split()[0])"], capture_output=True,
                             text=True, check=True).stdout.strip()
    lender = [venv_key(BORROWS[name], python)] if name in BORROWS else []
    digest = hashlib.sha256(json.dumps([version, *TOOLS[name], *lender]).encode()).hexdigest()[:12]
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


def _missing(root: Path, name: str) -> list[str]:
    """What the set should provide and the venv lacks: executables by path, modules by a probe of the venv's python
    (`find_spec`: it finds the module, borrowed ones included, without importing it; one python start)."""
    missing = [exe for exe in EXECUTABLES.get(name, ()) if not (root / "bin" / exe).exists()]
    modules = IMPORTS.get(name, ())
    if missing or not modules:
        return missing
    python = root / "bin" / "python"
    if not python.exists():
        return list(modules)
    probe = ("import importlib.util, sys; "
             "print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))")
    found = subprocess.run([str(python), "-P", "-c", probe, *modules], capture_output=True, text=True)
    return found.stdout.split() if found.returncode == 0 else list(modules)


def _complete(root: Path, name: str) -> bool:
    return (root / ".complete").exists() and not _missing(root, name)


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


def _borrow(root: Path, lender: Path) -> None:
    """Put the lender venv's site-packages on the set's sys.path, after its own (a .pth file)."""
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    own, lent = (subprocess.run([str(r / "bin" / "python"), "-P", "-c", purelib], capture_output=True, text=True,
                                check=True).stdout.strip() for r in (root, lender))
    (Path(own) / "npuserve-borrowed.pth").write_text(lent + "\n")


def ensure_tools(name: str = "clients", python: str = sys.executable) -> Path:
    """The set's virtualenv, built on first use (a no-op afterwards). Returns its folder; `bin/` holds the tools."""
    lender = ensure_tools(BORROWS[name], python) if name in BORROWS else None
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
        if lender is not None:
            _borrow(root, lender)
        _pip(root, ["install", "--progress-bar", "off", *pins])
        missing = _missing(root, name)
        if missing:
            raise RuntimeError(f"the {name} virtualenv has no {', '.join(missing)} after installing {pins}")
        seconds = round(time.monotonic() - started)
        (root / ".complete").write_text(json.dumps({"pins": list(pins), "build_seconds": seconds}) + "\n")
        log(f"built the {name} virtualenv in {seconds}s")
    return root


if __name__ == "__main__":
    print(ensure_tools(sys.argv[1] if len(sys.argv) > 1 else "clients"))
