"""The real `npuserve serve` as a process of its own on a free loopback port, for tests that need it apart from the
test process (signals, probe latency, third-party clients)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import httpx

from npuserve.engine.parallel.ranks import free_port

SERVE = [str(Path(sys.executable).parent / "npuserve"), "serve"]


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


@contextmanager
def serve_process(*args: str, stdout: int | IO[str] | None = subprocess.DEVNULL,
                  ) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """`npuserve serve ARGS --host 127.0.0.1 --port P`, ready; yields (base URL, process); terminated after."""
    port = free_port()
    proc = subprocess.Popen([*SERVE, *args, "--host", "127.0.0.1", "--port", str(port)], stdout=stdout,
                            stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc)
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
