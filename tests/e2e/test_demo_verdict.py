"""`make demo`'s last check (e2e/demo.py `verdict_contradiction`): the demo exits non-zero when the final status
claims SLOMet while the windows measured at the best schedule, pooled by requests, miss a bound. Pure: statuses
written out by hand, no cluster."""

from __future__ import annotations

from typing import Any

import demo

SLO = {"objective": "decodeLatency", "tpotMs": 200}
BEST = {"maxBatchSize": 21, "maxPrefillBatchSize": 10}


def window(trial: int, tpot: float, samples: int, schedule: dict[str, Any] = BEST, outcome: str = "measured"
           ) -> dict[str, Any]:
    stats = {"mean": tpot, "p90": tpot * 1.2, "p99": tpot * 1.5}
    return {"trial": trial, "schedule": schedule, "outcome": outcome, "sloMet": tpot <= 200,
            "metrics": {"outputTokensPerSecond": 10.0, "ttftMs": {"mean": 1.0, "p90": 1.0, "p99": 1.0},
                        "tpotMs": stats, "samples": samples}}


def status(history: list[dict[str, Any]], slo_met: bool) -> dict[str, Any]:
    return {"conditions": [{"type": "SLOMet", "status": "True" if slo_met else "False"}],
            "tuning": {"best": {"schedule": BEST}, "history": history}}


def test_slo_met_over_windows_that_miss_is_a_contradiction() -> None:
    # The demo: SLOMet=True at maxBatchSize 64 with TPOT 511 ms against a 200 ms bound.
    history = [window(0, 104.0, 50, {"maxBatchSize": 21}), window(1, 511.4, 50, BEST)]
    said = demo.verdict_contradiction(status(history, True), SLO)
    assert said is not None and "tpotMs mean 511.4 ms, over the bound 200" in said


def test_windows_pool_by_requests_and_other_schedules_do_not_count() -> None:
    history = [window(0, 150.0, 90), window(1, 260.0, 10), window(2, 900.0, 50, {"maxBatchSize": 64})]
    assert demo.verdict_contradiction(status(history, True), SLO) is None  # (150 x 90 + 260 x 10) / 100 = 161
    history[1] = window(1, 260.0, 200)  # (150 x 90 + 260 x 200) / 290 = 226
    assert demo.verdict_contradiction(status(history, True), SLO) is not None


def test_no_claim_no_contradiction_and_a_claim_without_windows_is_one() -> None:
    assert demo.verdict_contradiction(status([window(0, 511.0, 50)], False), SLO) is None
    failed = window(0, 100.0, 50, outcome="failed")
    said = demo.verdict_contradiction(status([failed], True), SLO)
    assert said is not None and "no window was measured at the best schedule" in said


def test_the_statistic_is_the_slos() -> None:
    history = [window(0, 180.0, 50)]  # p90 216
    assert demo.verdict_contradiction(status(history, True), SLO) is None
    assert demo.verdict_contradiction(status(history, True), {**SLO, "statistic": "p90"}) is not None
