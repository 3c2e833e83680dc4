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
    lines = _lines(capsys, "--objective", "throughput", "--max-trials", "3")
    *trials, last = lines
    assert 1 <= len(trials) <= 3
    assert [t["trial"] for t in trials] == list(range(len(trials)))
    for t in trials:
        assert {"trial", "schedule", "outcome", "metrics", "sloMet", "verdict"} <= set(t)
        assert t["outcome"] == "measured"
        schedule = t["schedule"]
        assert isinstance(schedule, dict) and schedule["maxPrefillBatchSize"] == schedule["maxBatchSize"] // 2
        assert isinstance(t["metrics"], dict) and t["metrics"]["outputTokensPerSecond"] > 0
    verdict = last["verdict"]
    assert isinstance(verdict, dict) and verdict["reason"] in ("converged", "maxTrials")


def test_first_token_and_decode_turns_select_batch_off(capsys: pytest.CaptureFixture[str]) -> None:
    *trials, _ = _lines(capsys, "--objective", "firstTokenAndDecode", "--ttft-ms", "60000", "--tpot-ms", "200",
                        "--max-trials", "2")
    assert trials and all(t["schedule"]["supportSelectBatch"] is False for t in trials)  # type: ignore[index]


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
