"""A real server for the tests: the tiny dummy model, the engine on the CPU, uvicorn on a free loopback port."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from npuserve.engine.engine import LLMEngine
from npuserve.engine.server.app import build_app
from npuserve.engine.server.async_engine import AsyncEngine
from npuserve.mindie_config import minimal_config


@dataclass
class RunningServer:
    url: str
    engine: AsyncEngine
    server: uvicorn.Server
    exits: list[int]  # the exit codes a fatal error asked for: recorded, so the test process lives on

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, timeout=30)

    def metric(self, name: str) -> float:
        """The first sample whose name (and, when `name` has a `{`, label text) starts as given."""
        for line in self.get("/metrics").text.splitlines():
            head, _, value = line.rpartition(" ")
            if head == name or head.startswith(name + "{") or ("{" in name and head.startswith(name)):
                return float(value)
        raise KeyError(name)


@contextmanager
def running_server(model_dir: Path, *, admin_token: str | None = None, config_path: Path | None = None,
                   max_waiting: int | None = None, engine_kwargs: dict[str, Any] | None = None,
                   app_kwargs: dict[str, Any] | None = None, **config: Any) -> Iterator[RunningServer]:
    mindie = minimal_config(model_dir, **{"max_seq_len": 512, "maxIterTimes": 256, **config})
    if config_path is not None:
        mindie.save(config_path)
    exits: list[int] = []
    engine = AsyncEngine(LLMEngine(mindie, **(engine_kwargs or {})), max_waiting=max_waiting,
                         exit_process=exits.append)
    app = build_app(engine, admin_token=admin_token, config_path=config_path, drain_timeout=5, **(app_kwargs or {}))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not (server.started and server.servers):
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    if config_path is not None:
        app.state.config_watcher.interval = 0.1
    try:
        yield RunningServer(f"http://127.0.0.1:{port}", engine, server, exits)
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[RunningServer]:
    with running_server(tiny_model_dir, admin_token="s3cret") as s:
        yield s


ServerFactory = Callable[..., Any]


def wait_until(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)
