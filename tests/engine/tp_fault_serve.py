"""`npuserve serve` (the arguments after the first) with a fault injected in tensor parallel
(tests/engine/test_tensor_parallel.py). The first argument says where:

- `rank0`: rank 0 raises in its first FORWARD once it serves, after sending it to the other ranks (a step that fails
  between the broadcast and the collectives);
- `rank1`: rank 1 raises when rank 0 sends it the FORWARD of a prompt of `FAULT_PROMPT` (inside the operation, before
  its collectives). The other ranks are fresh interpreters: rank 0 starts them with this module's patch first.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from npuserve import cli
from npuserve.engine.parallel import ranks
from npuserve.engine.parallel.step_message import Op, StepMessage
from npuserve.engine.runner import ModelRunner
from npuserve.engine.server.async_engine import AsyncEngine

FAULT = "injected fault"
FAULT_PROMPT = [7] * 11  # token ids no warm-up sends
_serving = False
_start, _forward, _follow = AsyncEngine.start, ModelRunner._forward, ModelRunner.follow


def _start_serving(self: AsyncEngine) -> None:
    global _serving
    _serving = True  # after the warm-up, whose forwards run as usual
    _start(self)


def _failing_forward(self: ModelRunner, batch: Any) -> Any:
    if _serving and self.channel is not None:
        raise RuntimeError(f"{FAULT} on rank 0 after the broadcast")
    return _forward(self, batch)


def _failing_follow(self: ModelRunner, msg: StepMessage) -> None:
    if msg.op is Op.FORWARD and msg.delta is not None and msg.delta.token_ids == FAULT_PROMPT:  # its prompt, whole
        raise RuntimeError(f"{FAULT} on rank 1 inside the forward")
    _follow(self, msg)


def fail_on_rank_1() -> None:
    """Called in the worker's interpreter, before it starts."""
    ModelRunner.follow = _failing_follow  # type: ignore[method-assign]


if __name__ == "__main__":
    where, args = sys.argv[1], sys.argv[2:]
    if where == "rank0":
        AsyncEngine.start = _start_serving  # type: ignore[method-assign]
        ModelRunner._forward = _failing_forward  # type: ignore[method-assign]
    else:
        ranks._WORKER_ENTRY = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                               f"import tp_fault_serve; tp_fault_serve.fail_on_rank_1(); {ranks._WORKER_ENTRY}")
    sys.exit(cli.main(args))
