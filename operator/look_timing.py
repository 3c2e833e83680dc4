"""When the autotune driver looks at an InferenceService and which Prometheus window it reads then. Pure: from the
InferenceService and its status as they are, and the time now.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from npuserve.planning.api import InferenceService, Plan

from .autotune_types import WindowRequest, parse_duration, parse_rfc3339
from .tuning_schedule import problem_for, problem_key, tuning_of

SETTLE_FRACTION = 0.25  # of autotune.window: settles after a change and is not measured
# Windows end on multiples of this many seconds (unix time): the windows of many InferenceServices that end together
# and are as long are read with one Prometheus query per figure for them all (`PrometheusClient.read_windows`). The
# settling time before a trial's window grows by less than this.
WINDOW_GRID_S = 5.0
# How long the driver may leave an InferenceService without looking at it when nothing is due: while it waits (for
# engines, for Prometheus), and as a floor under every wait (`next_look`). Changes to the InferenceService and its
# engine workloads wake the driver sooner (the kopf handlers tell it).
RECHECK_S = 10.0
IDLE_LOOK_S = 60.0


def window_s(isvc: InferenceService) -> float:
    return parse_duration(isvc.spec.autotune.window)


def settle_s(isvc: InferenceService) -> float:
    return window_s(isvc) * SETTLE_FRACTION


def grid_after(t: float) -> float:
    """The first window end (a multiple of WINDOW_GRID_S) at or after `t`."""
    return math.ceil(round(t / WINDOW_GRID_S, 6)) * WINDOW_GRID_S


def grid_before(t: float) -> float:
    """The last window end at or before `t`."""
    return math.floor(round(t / WINDOW_GRID_S, 6)) * WINDOW_GRID_S


def window_due(isvc: InferenceService, status: Mapping[str, Any], now: float) -> WindowRequest | None:
    """The window the driver must read from Prometheus now, if any: the open trial's once it has closed (and its
    reading is not waiting for Prometheus to come back), or, after tuning, the last window each `window`, ending on
    the grid."""
    tuning = tuning_of(status)
    if not isvc.spec.autotune.enabled or tuning is None:
        return None
    current = tuning.current
    if current is not None:
        if current.inconclusiveReason == "PrometheusUnreachable":
            return None
        end = parse_rfc3339(current.measureUntil)
        if now < end:
            return None
        return WindowRequest(parse_rfc3339(current.measureFrom), end,
                             (current.target,) if current.target else None)
    if tuning.phase in ("Converged", "Stopped", "Failed"):
        window, end = window_s(isvc), grid_before(now)
        last = parse_rfc3339(tuning.lastCheckAt) if tuning.lastCheckAt else 0.0
        if end - last >= window:
            return WindowRequest(end - window, end, None)
    return None


def next_look(isvc: InferenceService, status: Mapping[str, Any], now: float) -> float:
    """When the driver must run `advance` again for this InferenceService if nothing about it changes meanwhile: the
    open trial's window end, the next window after tuning, a recheck while it waits (for engines, Prometheus, a
    capacity probe), and IDLE_LOOK_S at the latest."""
    tuning = tuning_of(status)
    latest = now + IDLE_LOOK_S
    if not isvc.spec.autotune.enabled:
        return latest
    if tuning is None:
        return now + RECHECK_S
    current = tuning.current
    if current is not None:
        if current.inconclusiveReason == "PrometheusUnreachable":
            return now + RECHECK_S
        # A benchmark Job that fails, or an engine that stops being ready, ends the trial early: the Job is looked
        # at every recheck; the engines' changes wake the driver.
        soonest = parse_rfc3339(current.measureUntil)
        return min(soonest, now + RECHECK_S) if current.job else min(soonest, latest)
    if tuning.phase in ("Converged", "Stopped", "Failed"):
        last = parse_rfc3339(tuning.lastCheckAt) if tuning.lastCheckAt else 0.0
        return min(grid_after(last + window_s(isvc)), latest)
    return now + RECHECK_S  # running, no trial open: it waits for engines or Prometheus


def waits_for_prometheus(status: Mapping[str, Any]) -> bool:
    """Whether the open trial waits for Prometheus to answer again (only then does the driver ask it)."""
    tuning = tuning_of(status)
    return tuning is not None and tuning.current is not None and \
        tuning.current.inconclusiveReason == "PrometheusUnreachable"


def needs_replica_limit(isvc: InferenceService, plan: Plan, status: Mapping[str, Any]) -> bool:
    """Whether this look may scale: capacity is asked for and not yet measured for this tuning problem (only then
    does the driver list the nodes)."""
    if isvc.spec.capacity is None:
        return False
    cap = status.get("capacity") or {}
    return not (cap.get("problem") == problem_key(problem_for(isvc, plan)) and cap.get("phase") in ("Measured",
                                                                                                  "Failed"))
