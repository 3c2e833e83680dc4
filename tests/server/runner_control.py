"""Test control over a served engine's model runner: hold steps until requests have arrived, make steps crash,
make a forward pass hang.

Wraps `LLMEngine.add_request` (to count arrivals), `LLMEngine.runner.execute` (the model call of each step) and the
runner's `_forward` (inside the operation the runner has started) with pytest's monkeypatch; nothing else of the
engine is touched, so the server runs its real paths. Also reads histograms from `/metrics`.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from npuserve.engine.engine import LLMEngine
from tests.server.conftest import RunningServer

HOLD_TIMEOUT_SECONDS = 30.0


class RunnerFailure(RuntimeError):
    """What the broken runner raises."""


class RunnerControl:
    def __init__(self, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.engine = engine
        self._cond = threading.Condition()
        self._added = 0
        self._hold_until = 0  # steps wait inside the runner until this many requests have arrived
        self._crash_at_full_batch: int | None = None
        self._full_batch_steps = 0
        self.broken = False
        self.kv_usage_at_crash: float | None = None
        self.hanging = False
        self._released = threading.Event()
        add_request, execute, forward = engine.add_request, engine.runner.execute, engine.runner._forward

        def counting_add_request(*args: Any, **kwargs: Any) -> Any:
            result = add_request(*args, **kwargs)
            with self._cond:
                self._added += 1
                self._cond.notify_all()
            return result

        def controlled_execute(*args: Any, **kwargs: Any) -> Any:
            with self._cond:
                self._cond.wait_for(lambda: self._added >= self._hold_until, timeout=HOLD_TIMEOUT_SECONDS)
            self._maybe_break()
            if self.broken:
                self.kv_usage_at_crash = engine.kv.usage
                raise RunnerFailure("injected runner failure")
            return execute(*args, **kwargs)

        def hanging_forward(*args: Any, **kwargs: Any) -> Any:
            if self.hanging:
                self._released.wait()
            return forward(*args, **kwargs)

        monkeypatch.setattr(engine, "add_request", counting_add_request)
        monkeypatch.setattr(engine.runner, "execute", controlled_execute)
        monkeypatch.setattr(engine.runner, "_forward", hanging_forward)

    def hang(self) -> None:
        """The next forward pass never returns, until `release()`."""
        self._released.clear()
        self.hanging = True

    def release(self) -> None:
        self.hanging = False
        self._released.set()

    def hold_until(self, num_more_requests: int) -> None:
        """Steps from now on wait in the runner until `num_more_requests` more requests reached the engine, so
        that they are all queued when scheduling goes on."""
        with self._cond:
            self._hold_until = self._added + num_more_requests

    def crash_once_running(self, num_running: int) -> None:
        """Break the runner at the second step that finds `num_running` requests running: by then each of them
        has had a step of its own and produced a token. It stays broken until `repair()`."""
        self._crash_at_full_batch = num_running
        self._full_batch_steps = 0

    def _maybe_break(self) -> None:  # on the step thread, which alone may read the scheduler
        target = self._crash_at_full_batch
        if target is None or self.broken or self.engine.scheduler.num_running < target:
            return
        self._full_batch_steps += 1
        if self._full_batch_steps >= 2:
            self.broken = True

    def repair(self) -> None:
        self._crash_at_full_batch = None
        self.broken = False


def histogram(server: RunningServer, name: str) -> dict[float, float]:
    """A histogram from /metrics: cumulative count per upper bound (`float('inf')` is the total)."""
    text = server.get("/metrics").text
    for family in text_string_to_metric_families(text):
        if family.name == name:
            return {float(s.labels["le"]): s.value for s in family.samples if s.name == name + "_bucket"}
    raise KeyError(name)


def histogram_delta(before: dict[float, float], after: dict[float, float]) -> dict[float, float]:
    return {le: after[le] - before.get(le, 0.0) for le in after}
