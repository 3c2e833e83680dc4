"""`npuserve doctor`: a preflight of an Ascend host or the engine image (checks.py runs the checks, smoke.py the
numeric tests of each op on the card, report.py says what was found); the engine runs the op checks and the smoke
tests at start-up on npu (`preflight`)."""

from __future__ import annotations

from npuserve.engine.doctor.checks import DoctorOptions, Probes, diagnose, preflight
from npuserve.engine.doctor.report import DoctorCheck, DoctorReport

__all__ = ["DoctorCheck", "DoctorOptions", "DoctorReport", "Probes", "diagnose", "preflight"]
