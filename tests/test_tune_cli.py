"""`npuserve tune --simulate`: one JSON line per trial and a last line with the verdict; knobs given with
--schedule are pinned; the flags it cannot honour are refused."""

from __future__ import annotations

import json

import pytest

from npuserve.cli import main

GUIDE = ["tune", "--simulate", "--preset", "llama3-8b", "--accelerator", "ascend-910b4", "--cards", "2",
         "--dataset-name", "random", "--random-input-len", "186", "--random-output-len", "346", "--num-prompts", "200"]


def _lines(capsys: pytest.CaptureFixture[str], *args: str) -> list[dict[str, object]]:
    assert main([*GUIDE, *args]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_prints_a_line_per_trial_and_the_verdict_last(capsys: pytest.CaptureFixture[str]) -> None:
    # The simulator is exact, so the run is too: from the plan's start (435, in [362, 1088]) the throughput search
    # steps out by 1.5x while tok/s still rises, and the budget of 3 ends it at the best measured, 978.
    lines = _lines(capsys, "--objective", "throughput", "--max-trials", "3")
    *trials, last = lines
    assert [t["trial"] for t in trials] == [0, 1, 2]
    assert [t["schedule"] for t in trials] == [  # type: ignore[index]
        {"maxBatchSize": b, "maxPrefillBatchSize": b // 2, "maxPrefillTokens": 8192, "supportSelectBatch": True}
        for b in (435, 652, 978)]
    for t in trials:
        assert {"trial", "schedule", "outcome", "metrics", "sloMet", "verdict"} <= set(t)
        assert (t["outcome"], t["sloMet"]) == ("measured", True)
    tps = [t["metrics"]["outputTokensPerSecond"] for t in trials]  # type: ignore[index]
    assert tps == sorted(tps) and tps[0] > 0  # still rising: why it stepped out
    verdict = last["verdict"]
    assert isinstance(verdict, dict)
    assert {k: verdict[k] for k in ("reason", "best", "evidence", "slo_met", "limit")} == {
        "reason": "maxTrials", "best": 2, "evidence": [2], "slo_met": True, "limit": "none"}
    assert verdict["schedule"] == trials[2]["schedule"]
    assert verdict["message"].startswith("3 trials spent (next: throughput still rising at 978 (")
    assert verdict["message"].endswith(f"best: maxBatchSize 978, {tps[2]:.0f} output tok/s, 1 window(s)")


def test_first_token_and_decode_searches_decode_first_while_ttft_holds(capsys: pytest.CaptureFixture[str]) -> None:
    # supportSelectBatch on (decode first) while no window misses the TTFT bound (docs/operator.md).
    *trials, last = _lines(capsys, "--objective", "firstTokenAndDecode", "--ttft-ms", "60000", "--tpot-ms", "200",
                           "--max-trials", "2")
    assert [(t["schedule"]["maxBatchSize"], t["schedule"]["supportSelectBatch"], t["sloMet"])  # type: ignore[index]
            for t in trials] == [(435, True, True), (870, True, True)]  # 2x up from a batch that meets
    verdict = last["verdict"]
    assert isinstance(verdict, dict)
    assert {k: verdict[k] for k in ("reason", "best", "evidence", "slo_met", "limit")} == {
        "reason": "maxTrials", "best": 1, "evidence": [1], "slo_met": True, "limit": "none"}


def test_a_knob_given_with_schedule_is_pinned(capsys: pytest.CaptureFixture[str]) -> None:
    lines = _lines(capsys, "--objective", "throughput", "--schedule", "maxBatchSize=400")
    assert lines[-1]["verdict"]["reason"] == "pinned"  # type: ignore[index]


def test_refusals_name_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*GUIDE, "--objective", "decodeLatency"]) == 2
    assert "tpot" in capsys.readouterr().err.lower()
    assert main([*GUIDE, "--noise-seed", "3"]) == 2  # a seed for noise that is not injected
    assert "--noise-seed needs --noise" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["tune", "--preset", "llama3-8b"])  # --simulate is the only mode outside a cluster
    assert "--simulate" in capsys.readouterr().err
