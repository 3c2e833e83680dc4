"""The real `npuserve serve` as a process of its own on a free loopback port, for tests that need it apart from the
test process (signals, probe latency, third-party clients)."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import httpx

SERVE = [str(Path(sys.executable).parent / "npuserve"), "serve"]


def free_port() -> int:
    """A port free now; the process given it binds it later, so another may take it first (rare; serve_process then
    starts again on another)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(base_url: str, proc: subprocess.Popen[str], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(base_url + "/ready", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
        time.sleep(0.2)


def _tail(log: IO[str], lines: int = 40) -> str:
    log.seek(0)
    return "".join(log.readlines()[-lines:])


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


class PortTaken(AssertionError):
    """The server could not bind the port it was given: another process took it after `free_port` found it free."""


def _start(args: tuple[str, ...], stdout: int | IO[str] | None,
           ) -> tuple[str, subprocess.Popen[str], IO[str] | None]:
    """One start on a fresh port, ready: (base URL, process, the file its output goes to when `stdout` is None). A
    start that fails raises with the output's last lines (CI keeps nothing else of it); PortTaken when the port was
    taken."""
    port = free_port()
    log = tempfile.TemporaryFile("w+") if stdout is None else None  # noqa: SIM115 (closed by the caller)
    proc = subprocess.Popen([*SERVE, *args, "--host", "127.0.0.1", "--port", str(port)],
                            stdout=stdout if log is None else log, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc)
    except AssertionError as e:
        _stop(proc)
        if log is None:
            raise
        tail = _tail(log)
        log.close()
        failed = PortTaken if "address already in use" in tail else AssertionError
        raise failed(f"{e} (exit code {proc.returncode}); its output ends:\n{tail}") from None
    return base, proc, log


@contextmanager
def serve_process(*args: str, stdout: int | IO[str] | None = None,
                  ) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """`npuserve serve ARGS --host 127.0.0.1 --port P`, ready; yields (base URL, process); terminated after. Without
    `stdout`, its output goes to a file whose last lines a start that fails shows, and a start whose port another
    process took first is made again, once, on another port."""
    try:
        base, proc, log = _start(args, stdout)
    except PortTaken:
        base, proc, log = _start(args, stdout)
    try:
        yield base, proc
    finally:
        _stop(proc)
        if log is not None:
            log.close()
