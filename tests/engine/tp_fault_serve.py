"""`npuserve serve` (the arguments as given) whose rank 0 raises in its first FORWARD once it serves, after sending
it to the other ranks: a step that fails between the broadcast and the collectives (tests/engine/
test_tensor_parallel.py). The other ranks are fresh interpreters, so only rank 0 is patched."""

from __future__ import annotations

import sys
from typing import Any

from npuserve import cli
from npuserve.engine.runner import ModelRunner
from npuserve.engine.server.async_engine import AsyncEngine

FAULT = "injected fault on rank 0 after the broadcast"
_serving = False
_start, _forward = AsyncEngine.start, ModelRunner._forward


def _start_serving(self: AsyncEngine) -> None:
    global _serving
    _serving = True  # after the warm-up, whose forwards run as usual
    _start(self)


def _failing_forward(self: ModelRunner, batch: Any) -> Any:
    if _serving and self.channel is not None:
        raise RuntimeError(FAULT)
    return _forward(self, batch)


if __name__ == "__main__":
    AsyncEngine.start = _start_serving  # type: ignore[method-assign]
    ModelRunner._forward = _failing_forward  # type: ignore[method-assign]
    sys.exit(cli.main(sys.argv[1:]))
