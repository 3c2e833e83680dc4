"""The step watchdog on a hand-moved clock: a step past the timeout is stuck (on_stuck), one still stuck after the
grace expires (on_expired, once); a step that completes in the grace clears it; an idle engine is never stuck."""

from __future__ import annotations

from npuserve.engine.server.watchdog import StepWatchdog


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _watchdog(clock: Clock, stuck: list[str], expired: list[str]) -> StepWatchdog:
    return StepWatchdog(10, 5, lambda now: "rank 0 last started FORWARD #7", stuck.append, expired.append,
                        clock=clock)


def test_a_step_past_the_timeout_is_stuck_then_expires_after_the_grace() -> None:
    clock, stuck, expired = Clock(), list[str](), list[str]()
    dog = _watchdog(clock, stuck, expired)
    dog.step_started()
    clock.now += 9.9
    assert not dog.check() and dog.stuck is None
    clock.now += 0.2
    assert not dog.check()
    assert stuck == [dog.stuck] and dog.stuck is not None
    assert dog.stuck == ("no engine step has completed for 10.1 s (npuserve.stepTimeoutSeconds 10): rank 0 last "
                         "started FORWARD #7")
    clock.now += 4.9
    assert not dog.check() and expired == []
    clock.now += 0.2
    assert dog.check()
    assert expired == [f"{stuck[0]}; it was still stuck 5 s later (npuserve.stepTimeoutGraceSeconds), so the engine "
                       "exits"]
    assert len(stuck) == 1


def test_a_step_that_completes_in_the_grace_clears_it_and_idle_is_never_stuck() -> None:
    clock, stuck, expired = Clock(), list[str](), list[str]()
    dog = _watchdog(clock, stuck, expired)
    clock.now += 1000  # idle: no step in progress
    assert not dog.check() and dog.stuck is None
    dog.step_started()
    clock.now += 11
    dog.check()
    assert dog.stuck is not None
    dog.step_finished()  # it completed after all
    assert dog.stuck is None
    dog.step_started()  # the next step is judged from its own start
    clock.now += 6
    assert not dog.check() and dog.stuck is None and expired == []
    dog.step_finished()
    clock.now += 100
    assert not dog.check() and expired == [] and len(stuck) == 1
