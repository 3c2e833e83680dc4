"""The engine's TPOT controller as the tuner's inner loop (`spec.autotune.innerLoop`, operator/inner_loop.py,
docs/operator.md "The inner loop"), driven by test_autotune.py's harness: a fake engine, a virtual clock, the looks
as the driver runs them. What the engines are told (the PUT body), what the ConfigMap's config.json holds and what
status.tuning.applied records, at the verdict, during trials and capacity probes, and after.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
from test_autotune import CAPACITY_SLO, DECODE_SLO, Loop, settled

from npuserve.operator import autotune as at
from npuserve.operator import inner_loop
from npuserve.operator import tuning_schedule as ts
from npuserve.operator.render import CONFIG_KEY, render_configmap
from npuserve.planning.api import AppliedSchedule

ON_22 = {"dynamicBatchSizeEnable": True, "decodeExpectedTime": 22}  # tpotMs 25: floor(25 / 1.1) = 22 ms


def with_inner_loop(loop: Loop, on: bool = True) -> Loop:
    spec = loop.isvc.spec
    autotune = spec.autotune.model_copy(update={"innerLoop": on})
    loop.isvc = loop.isvc.model_copy(update={"spec": spec.model_copy(update={"autotune": autotune})})
    return loop


def start(slo: dict[str, Any] = DECODE_SLO, on: bool = True, **spec: Any) -> Loop:
    return with_inner_loop(Loop.start(slo, **spec), on)


def put_bodies(loop: Loop, since: int = 0) -> list[dict[str, Any]]:
    """What each apply PUTs on the engines (autotune_loop._apply: the applied schedule, unset fields left out)."""
    return [t.actions.apply.model_dump(exclude_none=True) for t in loop.ticks[since:] if t.actions.apply is not None]


def config_schedule(loop: Loop) -> dict[str, Any]:
    """The ScheduleConfig of the config.json the ConfigMap holds now (reconcile renders it from the status)."""
    schedule, generation = ts.configmap_schedule(loop.isvc, loop.plan, loop.status)
    configmap = render_configmap(loop.isvc, loop.plan, schedule, generation)
    found: dict[str, Any] = json.loads(configmap["data"][CONFIG_KEY])["BackendConfig"]["ScheduleConfig"]
    return found


def applied(loop: Loop) -> AppliedSchedule:
    tuning = loop.tuning()
    assert tuning.applied is not None
    return tuning.applied


@pytest.mark.parametrize(("bound", "target"), [(25, 22), (50, 45), (5.6, 5), (2.2, 2), (1.1, 1), (1.09, None),
                                               (0.5, None), (20000, 10000)])
def test_the_target_is_the_bound_less_ten_percent_in_whole_ms_within_mindies_range(bound: float,
                                                                                     target: int | None) -> None:
    assert inner_loop.expected_time_ms(bound) == target


def test_on_the_verdict_applies_the_controller_under_the_tuned_batch_and_trials_run_without_it() -> None:
    loop = start()
    loop.run_until(settled)
    t = loop.tuning()
    assert t.phase == "Converged" and t.verdict is not None and t.verdict.sloMet and t.best is not None
    bodies = put_bodies(loop)
    trials, verdict = bodies[:-1], bodies[-1]
    # Every trial measured one fixed schedule: the controller off, said explicitly.
    assert trials and all(b["dynamicBatchSizeEnable"] is False and "decodeExpectedTime" not in b for b in trials)
    # The verdict: its batch as the controller's ceiling, the target under the bound.
    assert {k: verdict[k] for k in ON_22} == ON_22 and verdict["maxBatchSize"] == t.verdict.maxBatchSize
    assert applied(loop).inner_loop() == ON_22 and applied(loop).knobs() == t.best.schedule
    # A restarted pod keeps it: the ConfigMap's config.json carries both fields, beside the tuned batch.
    schedule = config_schedule(loop)
    assert {k: schedule[k] for k in ON_22} == ON_22 and schedule["maxBatchSize"] == t.verdict.maxBatchSize
    assert "22 ms (decodeExpectedTime)" in t.message
    # Windows that meet the SLO change nothing: no apply, no new round.
    mark = len(loop.ticks)
    loop.run_until(lambda lp: sum(tk.due is not None for tk in lp.ticks[mark:]) == 3)
    assert put_bodies(loop, mark) == [] and loop.tuning().round == 1


def test_off_the_engines_are_told_nothing_of_the_controller() -> None:
    loop = start(on=False)
    loop.run_until(settled)
    assert all("dynamicBatchSizeEnable" not in b and "decodeExpectedTime" not in b for b in put_bodies(loop))
    assert applied(loop).inner_loop() == {}
    schedule = config_schedule(loop)  # the plan's config.json: MindIE's default, off
    assert schedule.get("dynamicBatchSizeEnable", False) is False


def test_windows_that_still_miss_start_a_round_whose_trials_run_without_the_controller() -> None:
    loop = start()
    loop.run_until(settled)
    first = loop.tuning()
    assert first.best is not None and applied(loop).dynamicBatchSizeEnable is True
    loop.engine = replace(loop.engine, tpot0=20.0)  # even the controller's lower bound would miss: a new round
    mark = len(loop.ticks)
    loop.run_until(lambda lp: lp.tuning().round == 2)
    assert applied(loop).dynamicBatchSizeEnable is False  # the new round's first trial: off
    loop.run_until(settled)
    bodies = put_bodies(loop, mark)
    assert all(b["dynamicBatchSizeEnable"] is False for b in bodies[:-1])
    t = loop.tuning()
    assert t.round == 2 and t.verdict is not None and t.verdict.sloMet
    assert bodies[-1]["dynamicBatchSizeEnable"] is True and bodies[-1]["decodeExpectedTime"] == 22
    assert bodies[-1]["maxBatchSize"] == t.verdict.maxBatchSize < first.best.schedule.maxBatchSize  # type: ignore[operator]


def test_a_verdict_that_does_not_meet_the_slo_leaves_the_controller_off() -> None:
    loop = start({"objective": "decodeLatency", "tpotMs": 5})  # TPOT >= 10 ms at every batch
    loop.run_until(settled)
    t = loop.tuning()
    assert t.verdict is not None and not t.verdict.sloMet
    assert applied(loop).inner_loop() == {"dynamicBatchSizeEnable": False}
    assert "the inner loop stays off: the verdict did not show the SLO met" in t.message


def test_turning_the_spec_field_on_or_off_after_the_verdict_takes_effect_at_the_next_look() -> None:
    loop = start(on=False)
    loop.run_until(settled)
    batch = applied(loop).maxBatchSize
    generation = applied(loop).scheduleGeneration
    with_inner_loop(loop, True)
    loop.tick()
    assert applied(loop).inner_loop() == ON_22 and applied(loop).maxBatchSize == batch
    assert applied(loop).scheduleGeneration > generation and ("Normal", "InnerLoop") in loop.events(len(loop.ticks) - 1)
    with_inner_loop(loop, False)
    loop.tick()
    assert applied(loop).inner_loop() == {"dynamicBatchSizeEnable": False} and applied(loop).maxBatchSize == batch
    assert config_schedule(loop)["dynamicBatchSizeEnable"] is False
    assert loop.tuning().round == 1


def test_capacity_probes_measure_the_fixed_schedule_then_the_controller_runs() -> None:
    loop = start(CAPACITY_SLO, mode="benchmark", capacity={"targetConcurrentUsers": 20000})
    loop.run_until(lambda lp: bool(lp.status.get("capacity")) and lp.capacity().phase == "Measured"
                   and lp.current() is None)
    probes = [t for t in loop.ticks if t.actions.apply is not None and (t.actions.status["tuning"].get("current")
                                                                       or {}).get("kind") == "capacity"]
    assert probes and all(t.actions.apply is not None and t.actions.apply.dynamicBatchSizeEnable is False
                          for t in probes)
    loop.tick()
    # tpotMs 40: floor(40 / 1.1) = 36 ms, under the tuned batch.
    assert applied(loop).inner_loop() == {"dynamicBatchSizeEnable": True, "decodeExpectedTime": 36}
    assert applied(loop).maxBatchSize == loop.tuning().verdict.maxBatchSize  # type: ignore[union-attr]


def test_a_new_round_started_by_missed_windows_is_what_at_does_today() -> None:
    """The drift check is unchanged: MISSED_WINDOWS windows in a row, after the cool-down."""
    loop = start()
    loop.run_until(settled)
    loop.engine = replace(loop.engine, tpot0=20.0)
    for missed in range(1, at.MISSED_WINDOWS):
        loop.run_until(lambda lp: lp.ticks[-1].due is not None)
        assert (loop.tuning().round, loop.tuning().missedWindows) == (1, missed)
        assert applied(loop).dynamicBatchSizeEnable is True
