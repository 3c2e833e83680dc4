"""Processes of the local cluster: started detached and recorded as "pid starttime", so that stopping ends exactly
those; waiting for a component's HTTP endpoint; port checks; the harness's log line. Standard library only."""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path


def log(msg: str) -> None:
    print(f"[cluster] {msg}", file=sys.stderr, flush=True)


# ---- pids ------------------------------------------------------------------------------------------------------
_children: dict[int, subprocess.Popen[bytes]] = {}


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks) of a live process, None if there is none."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return fields[0], int(fields[19])


def proc_starttime(pid: int) -> int | None:
    """The start time of a process that runs (not a zombie), None if there is none."""
    stat = proc_stat(pid)
    return None if stat is None or stat[0] in ("Z", "X") else stat[1]


def _reap(pid: int) -> None:
    proc = _children.pop(pid, None)
    if proc is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0)
        if proc.returncode is None:
            _children[pid] = proc
        return
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def alive(pid: int, starttime: int) -> bool:
    _reap(pid)
    return proc_starttime(pid) == starttime


def pid_file(cdir: Path, name: str) -> Path:
    return cdir / "pids" / f"{name}.pid"


def read_pid(cdir: Path, name: str) -> tuple[int, int] | None:
    try:
        pid, start = pid_file(cdir, name).read_text().split()
        return int(pid), int(start)
    except (OSError, ValueError):
        return None


# ---- components: spawn and stop ----------------------------------------------------------------------------------
def spawn(cdir: Path, name: str, cmd: Sequence[str], env: Mapping[str, str] | None = None) -> int:
    (cdir / "logs").mkdir(parents=True, exist_ok=True)
    (cdir / "pids").mkdir(parents=True, exist_ok=True)
    with (cdir / "logs" / f"{name}.log").open("ab") as logf:
        logf.write(("\n# " + " ".join(cmd) + "\n").encode())
        logf.flush()
        proc = subprocess.Popen(
            list(cmd),
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=subprocess.STDOUT,
            cwd=cdir,
            env=dict(env) if env is not None else None,
            start_new_session=True,  # outlives `cluster.py up`; not hit by the terminal's Ctrl-C
        )
    _children[proc.pid] = proc
    stat = proc_stat(proc.pid)
    if stat is None:
        raise RuntimeError(f"{name} exited at once; see {cdir / 'logs' / (name + '.log')}")
    pid_file(cdir, name).write_text(f"{proc.pid} {stat[1]}\n")
    return proc.pid


def stop_one(cdir: Path, name: str, grace: float = 15) -> bool:
    """End the process recorded for `name`, if it is still the one we started. True if one was ended."""
    rec = read_pid(cdir, name)
    pid_file(cdir, name).unlink(missing_ok=True)
    if rec is None or not alive(*rec):
        return False
    pid, start = rec
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not alive(pid, start):
            return True
        time.sleep(0.1)
    log(f"{name} (pid {pid}) did not stop in {grace:.0f}s; killing it")
    os.kill(pid, signal.SIGKILL)
    while alive(pid, start):
        time.sleep(0.05)
    return True


# ---- engine processes (the process kubelet's, one folder a pod) ----------------------------------------------------
def kill_recorded(pid_path: Path, grace: float = 10.0) -> bool:
    """End the process group recorded in `pid_path` ("pid starttime") if it is still that process. True if one was
    ended."""
    try:
        pid, start = (int(x) for x in pid_path.read_text().split())
    except (OSError, ValueError):
        return False
    pid_path.unlink(missing_ok=True)
    if proc_starttime(pid) != start:
        return False
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and proc_starttime(pid) == start:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.1)
    if proc_starttime(pid) == start:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    return True


def sweep(pods_dir: Path) -> list[str]:
    """End engine processes a previous kubelet left behind (it was killed). Returns the pod folders they ran in."""
    return [p.parent.name for p in sorted(pods_dir.glob("*/pid")) if kill_recorded(p)]


# ---- HTTP probes and ports -----------------------------------------------------------------------------------------
def https_get(host: str, port: int, path: str, ctx: ssl.SSLContext | None, timeout: float) -> tuple[int, str]:
    """GET over HTTPS with `ctx`, plain HTTP without one: (status, body)."""
    conn: http.client.HTTPConnection
    if ctx is None:
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
    else:
        conn = http.client.HTTPSConnection(host, port, context=ctx, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    finally:
        conn.close()


def insecure_ctx() -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def wait_http(
    what: str,
    port: int,
    path: str,
    ctx: ssl.SSLContext | None,
    cdir: Path,
    name: str,
    timeout: float = 120,
) -> None:
    """Wait until the component `name` answers 200 on 127.0.0.1:`port``path`; fail at once if it exited."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        rec = read_pid(cdir, name)
        if rec is None or not alive(*rec):
            log_file = cdir / "logs" / f"{name}.log"
            raise RuntimeError(f"{what} exited (log: {log_file}); last log lines:\n{tail(log_file)}")
        try:
            status, body = https_get("127.0.0.1", port, path, ctx, timeout=2)
            if status == 200:
                return
            last = f"HTTP {status}: {body[-500:]}"
        except OSError as exc:
            last = repr(exc)
        time.sleep(0.2)
    raise RuntimeError(f"{what} not ready after {timeout:.0f}s ({last}); log: {cdir / 'logs' / (name + '.log')}")


def tail(path: Path, lines: int = 30, missing: str = "(no log)") -> str:
    """The last `lines` lines of a log file, `missing` if it cannot be read."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return missing


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
