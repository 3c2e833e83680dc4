"""The engine step goes one way (docs/engine.md#one-step): `schedule()` -> one runner call -> the scheduler's
`update_from_output`, which alone writes the step's results into the sequences. The SchedulerOutput is never
written after `schedule()`, and a fork's block copies reach the runner in the next step's input."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from npuserve.engine.engine import LLMEngine
from npuserve.engine.model.dummy import write_dummy_model
from npuserve.engine.scheduler import SchedulerOutput
from npuserve.engine.sequence import SamplingParams, Sequence
from npuserve.engine.step_input import StepInput
from tests.engine.test_correctness import make_engine, small_spec

PROMPT = [11, 12, 13, 14, 15, 16]  # 6 tokens over 4-token blocks: the forks copy the partial last block


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dummy_model(small_spec("qwen2"), tmp_path_factory.mktemp("qwen2"), seed=3, init_std=0.3)


def _contents(out: SchedulerOutput) -> dict[str, Any]:
    """What a SchedulerOutput says, by value (sequences by id), to compare before and after the run."""
    values = {f.name: getattr(out, f.name) for f in dataclasses.fields(out)}
    return {name: [s.seq_id if isinstance(s, Sequence) else s for s in v] if isinstance(v, list) else v
            for name, v in values.items()}


def test_one_runner_call_per_step_and_fork_copies_arrive_next_step(model_dir: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    engine: LLMEngine = make_engine(model_dir)
    runner, scheduler = engine.runner, engine.scheduler
    calls: list[tuple[str, Any]] = []  # every runner entry, in order
    for name in ("execute", "move_blocks"):
        real = getattr(runner, name)

        def record(*args: Any, _name: str = name, _real: Any = real) -> Any:
            calls.append((_name, args[0]))
            return _real(*args)

        monkeypatch.setattr(runner, name, record)
    outputs: list[tuple[SchedulerOutput, dict[str, Any]]] = []
    real_schedule, real_update = scheduler.schedule, scheduler.update_from_output

    def schedule() -> SchedulerOutput:
        out = real_schedule()
        outputs.append((out, _contents(out)))
        return out

    copies_by_step: list[list[tuple[int, int]]] = []

    def update_from_output(out: SchedulerOutput, *args: Any) -> Any:
        outcome = real_update(out, *args)
        copies_by_step.append(list(outcome.block_copies))
        return outcome

    monkeypatch.setattr(scheduler, "schedule", schedule)
    monkeypatch.setattr(scheduler, "update_from_output", update_from_output)
    # Who writes a sequence's fields during a step: the engine's own module must not.
    writers: set[str] = set()
    real_setattr = Sequence.__setattr__

    def watched_setattr(seq: Sequence, name: str, value: Any) -> None:
        writers.add(sys._getframe(1).f_globals["__name__"])
        real_setattr(seq, name, value)

    engine.add_request("r", None, SamplingParams(n=3, temperature=0.0, max_tokens=4, ignore_eos=True,
                                                 prompt_logprobs=1), prompt_token_ids=PROMPT)
    monkeypatch.setattr(Sequence, "__setattr__", watched_setattr)
    steps = 0
    while engine.has_unfinished():
        before = len(calls)
        engine.run_step()
        monkeypatch.setattr(Sequence, "__setattr__", real_setattr)  # the test's own reads and writes stay unseen
        out, contents = outputs[-1]
        assert _contents(out) == contents, "the SchedulerOutput was written after schedule()"
        assert len(calls) - before == (1 if out.has_device_work else 0), calls[before:]
        monkeypatch.setattr(Sequence, "__setattr__", watched_setattr)
        steps += 1
        assert steps < 20
    monkeypatch.setattr(Sequence, "__setattr__", real_setattr)
    assert "npuserve.engine.engine" not in writers, "the engine wrote a Sequence field itself"
    # The prefill forked two children, each with a copy of the prompt's partial last block; the runner got those
    # copies with the next step's input, and only then.
    assert [len(c) for c in copies_by_step[:2]] == [2, 0]
    executed = [arg for name, arg in calls if name == "execute"]
    assert all(isinstance(step, StepInput) for step in executed)
    assert executed[0].block_copies == [] and executed[1].block_copies == copies_by_step[0]
    assert all(step.block_copies == [] for step in executed[2:])
    with pytest.raises(dataclasses.FrozenInstanceError):
        outputs[0][0].block_copies = []  # type: ignore[misc]
    assert engine.kv.num_used_blocks == 0
