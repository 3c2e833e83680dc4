"""The engine's TPOT controller as the tuner's inner loop (`spec.autotune.innerLoop`, docs/operator.md, "The inner
loop"): which controller fields the engines must run now. Pure; the trial machine (`autotune.py`) applies them with
the schedule.

The outer search finds the batch and proves the SLO with windows; the controller (MindIE 2.3's
`dynamicBatchSizeEnable`, engine/scheduler/dynamic_batch.py) then holds the mean TPOT between windows as the load
moves, with the verdict's maxBatchSize as its ceiling, so it never runs a batch the outer loop did not prove. It is
on only after a verdict that met an SLO with a TPOT bound, and off while any trial or capacity probe runs (each
measures one fixed schedule).
"""

from __future__ import annotations

import math

from npuserve.engine_contract import SCHEDULE_FIELD_BY_NAME
from npuserve.planning.api import AppliedSchedule, InferenceService, TuningVerdict

# decodeExpectedTime = floor(tpotMs / (1 + MARGIN)). The controller settles where the mean TPOT equals its target,
# within about 5% over minutes (the engine's target; measured within 1%, docs/engine.md "Dynamic batch size"); one
# window's mean spreads a few percent more around that. A 10% margin covers both, so the windows the drift check
# judges stay under the bound; the floor to whole ms (MindIE's unit) only adds to it.
MARGIN = 0.10
_TARGET = SCHEDULE_FIELD_BY_NAME["decodeExpectedTime"]
ENABLE, TARGET = SCHEDULE_FIELD_BY_NAME["dynamicBatchSizeEnable"].name, _TARGET.name


def expected_time_ms(tpot_bound_ms: float) -> int | None:
    """The controller's target for a TPOT bound: under it by MARGIN, whole ms within the field's range; None when
    the bound is too tight for a whole-ms target under it (the controller cannot be asked for it)."""
    target = math.floor(tpot_bound_ms / (1 + MARGIN))
    if _TARGET.ge is not None and target < _TARGET.ge:
        return None
    return min(target, _TARGET.le) if _TARGET.le is not None else target


def wanted(isvc: InferenceService, verdict: TuningVerdict | None, applied: AppliedSchedule | None,
           ) -> dict[str, int | bool]:
    """The controller's fields once a round has ended with `verdict`: on, with its target, when the spec asks for
    the inner loop and the verdict met a TPOT bound; else `off`."""
    bound = isvc.spec.slo.tpotMs
    target = expected_time_ms(bound) if bound is not None else None
    if isvc.spec.autotune.innerLoop and verdict is not None and verdict.sloMet and target is not None:
        return {ENABLE: True, TARGET: target}
    return off(isvc, applied)


def off(isvc: InferenceService, applied: AppliedSchedule | None) -> dict[str, int | bool]:
    """The controller off: said explicitly when the spec asks for the inner loop or the engines were told of it
    before (an engine keeps a controller it was told to run); otherwise nothing, as before the inner loop existed."""
    if isvc.spec.autotune.innerLoop or (applied is not None and applied.dynamicBatchSizeEnable is not None):
        return {ENABLE: False}
    return {}


def why_not(isvc: InferenceService, verdict: TuningVerdict | None) -> str | None:
    """Why the spec's inner loop stays off after this verdict, for people; None when it runs or is not asked for."""
    if not isvc.spec.autotune.innerLoop:
        return None
    bound = isvc.spec.slo.tpotMs
    if bound is None:  # the API server refuses this spec; an object read before the rule existed may have it
        return "the inner loop stays off: spec.slo.tpotMs is not set"
    if expected_time_ms(bound) is None:
        return (f"the inner loop stays off: the TPOT bound {bound:g} ms leaves no whole-ms decodeExpectedTime "
                f"{MARGIN:.0%} under it")
    if verdict is None or not verdict.sloMet:
        return "the inner loop stays off: the verdict did not show the SLO met"
    return None
