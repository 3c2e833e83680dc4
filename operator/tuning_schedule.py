"""The schedule status.tuning records (docs/operator.md, "The schedule generation"): which tuning problem the trials
belong to, the schedule the ConfigMap and the engines must hold and its generation, the Job an open trial runs, and
the schedule to roll back to. Pure: the trial machine (`autotune.py`) writes these records, the driver
(`autotune_loop.py`) carries out what they say, and reconcile (`handlers.py`) renders the ConfigMap from them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from npuserve.engine_contract import HOT_SCHEDULE_FIELDS, schedule_field
from npuserve.planning.api import (
    AppliedSchedule,
    InferenceService,
    Plan,
    PlanSchedule,
    ScheduleKnobs,
    TrialInProgress,
    TuningStatus,
    TuningTrial,
)
from npuserve.planning.engine_model import EngineShape
from npuserve.planning.problem import TuningProblem
from npuserve.planning.tuner import best_so_far
from npuserve.planning.tuning_status import trials_of

from .autotune_types import Intent, PodState, parse_rfc3339
from .render import render_bench_job

JOB_SLACK_S = 5.0  # a benchmark Job runs this much past the window's end


def problem_for(isvc: InferenceService, plan: Plan, start: int | None = None) -> TuningProblem:
    """The tuner's problem for this InferenceService; `start` (a new round's) replaces the plan's first batch."""
    a = isvc.spec.autotune
    problem = TuningProblem.from_plan(plan, isvc.spec.slo, max_trials=a.maxTrials, min_samples=a.minSamples,
                                      engine=EngineShape.of_service(isvc.spec, plan))
    if start is not None:
        problem = problem.model_copy(update={"batch_start": min(max(start, problem.floor), problem.batch_max)})
    return problem


def problem_key(problem: TuningProblem) -> str:
    """What makes trials comparable: the range, SLO, pinned knobs and base schedule (not the start or the budget)."""
    text = problem.model_dump_json(exclude={"batch_start", "max_trials", "min_samples"})
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def tuning_of(status: Mapping[str, Any]) -> TuningStatus | None:
    """status.tuning, or None without one (or one an older operator wrote in another shape: tuning starts over)."""
    data = status.get("tuning")
    if data is None:
        return None
    try:
        return TuningStatus.model_validate(data)
    except ValidationError:
        return None


def applied_schedule(isvc: InferenceService, plan: Plan, status: Mapping[str, Any]) -> PlanSchedule | None:
    """The schedule the ConfigMap must hold: the tuner's, while autotune is on and its trials are of this plan;
    None: the plan's."""
    tuning = tuning_of(status)
    if not isvc.spec.autotune.enabled or tuning is None or tuning.applied is None:
        return None
    if tuning.problem != problem_key(problem_for(isvc, plan)):
        return None
    schedule = with_knobs(plan.schedule, tuning.applied.knobs())
    inner = tuning.applied.inner_loop()
    return ConfigSchedule(**schedule.model_dump(), **inner) if inner else schedule


class ConfigSchedule(PlanSchedule):
    """The ScheduleConfig the ConfigMap holds while the tuner's schedule runs: the plan's with the tuner's knobs,
    and the engine's TPOT controller as the inner loop left it (unset: config.json leaves it out, the engine's
    default, off), so a restarted pod runs what the others run."""

    dynamicBatchSizeEnable: bool | None = schedule_field("dynamicBatchSizeEnable", optional=True)
    decodeExpectedTime: int | None = schedule_field("decodeExpectedTime", optional=True)


def plan_generation(applied: AppliedSchedule | None, spec_generation: int | None) -> int:
    """The schedule generation of the plan's own schedule, when the ConfigMap holds it (autotune off, or a spec
    change the tuner has not tuned yet): past every generation the tuner has applied, so engines that run the
    tuner's schedule take the plan's back, and rising with each spec change (metadata.generation)."""
    return (applied.scheduleGeneration if applied is not None else 0) + (spec_generation or 0)


def next_generation(applied: AppliedSchedule | None, spec_generation: int | None) -> int:
    """The generation of the next schedule the tuner applies: past its last one and past the plan's own."""
    return plan_generation(applied, spec_generation) + 1


def configmap_schedule(isvc: InferenceService, plan: Plan, status: Mapping[str, Any],
                       ) -> tuple[PlanSchedule | None, int]:
    """What the ConfigMap holds, from status.tuning.applied (the source): the tuner's schedule and its generation,
    or (None: the plan's schedule) at `plan_generation`."""
    schedule = applied_schedule(isvc, plan, status)
    tuning = tuning_of(status)
    applied = tuning.applied if tuning is not None else None
    if schedule is not None and applied is not None:
        return schedule, applied.scheduleGeneration
    return None, plan_generation(applied, isvc.metadata.generation)


def recorded_intent(isvc: InferenceService, plan: Plan, status: Mapping[str, Any], pods: Sequence[PodState],
                    now: float) -> Intent:
    """What `status` records the engines and the load Job must be now: the tuner's applied schedule (when the
    ConfigMap holds it, `applied_schedule`), and the open trial's Job while its window runs and its target pod has an
    address (`trial_job`, as the trial machine renders it when it opens the window: a Job recreated is the same Job)."""
    tuning = tuning_of(status)
    if tuning is None:
        return Intent()
    apply = tuning.applied if applied_schedule(isvc, plan, status) is not None else None
    current, job = tuning.current, None
    target = next((p for p in pods if current is not None and p.name == current.target and p.ip), None)
    if current is not None and current.job and target is not None and target.ip is not None \
            and now < parse_rfc3339(current.measureUntil):
        job = trial_job(isvc, current, target.ip, now)
    return Intent(apply=apply, job=job)


def trial_job(isvc: InferenceService, current: TrialInProgress, target_ip: str, now: float) -> dict[str, Any]:
    """The benchmark Job of the open window `current` (it names the Job), started at `now`: its users on the target
    pod until the window's end and JOB_SLACK_S past it."""
    assert current.job is not None
    return render_bench_job(isvc, name=current.job, target_ip=target_ip, concurrency=current.concurrency or 1,
                            duration_s=parse_rfc3339(current.measureUntil) - now + JOB_SLACK_S)


def with_knobs(schedule: PlanSchedule, knobs: ScheduleKnobs) -> PlanSchedule:
    return schedule.model_copy(update=knobs.pinned())


def best_known(problem: TuningProblem, history: Sequence[TuningTrial],
               earlier: Sequence[TuningTrial] = ()) -> ScheduleKnobs:
    """The schedule to roll back to: what the verdict would choose from the history now (certain to meet the SLO,
    else the closest measured); without any measurement, the plan's. `earlier`: status.tuning.earlier."""
    best = best_so_far(problem, trials_of(history), trials_of(earlier))
    if best is None:  # nothing measured well yet: the plan's own schedule (its hot knobs: what /admin/schedule takes)
        return ScheduleKnobs(**{k: v for k, v in problem.base.model_dump().items()
                                if k in ScheduleKnobs.model_fields and k in HOT_SCHEDULE_FIELDS})
    return problem.knobs(best)
