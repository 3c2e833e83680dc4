"""`npuserve plan`: the golden command, the table, --from-file, and errors that name the field."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from isvc_helpers import REPO, load_yaml

from npuserve.cli import main
from npuserve.operator.api import InferenceService, Plan
from npuserve.operator.planner import plan

GOLDEN = ["plan", "--preset", "llama3-8b", "--cards", "2", "--card-memory-gib", "32", "--reserved-gib", "3",
          "--avg-input-tokens", "186", "--avg-output-tokens", "346", "--max-output-tokens", "512"]


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main([*argv, "--format", "json"]) == 0
    data: dict[str, Any] = json.loads(capsys.readouterr().out)
    return data


def test_golden_command(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, *GOLDEN)
    assert data["worldSize"] == 2
    assert data["npuMemSizeGiB"] == 17
    assert data["totalBlocks"] == 2176
    assert data["blocksPerRequest"] == {"min": 2, "avg": 5, "max": 6}
    assert data["maxBatchSize"] == {"min": 362, "avg": 435, "max": 1088}
    for key in ("blockBytesPerCard", "schedule", "replicas", "explain"):
        assert key in data
    assert data["schedule"]["maxBatchSize"] == 435 and data["schedule"]["maxPrefillBatchSize"] == 217


def test_json_is_exactly_the_status_plan_object(
    capsys: pytest.CaptureFixture[str], root_schema: dict[str, Any]
) -> None:
    data = run_json(capsys, *GOLDEN)
    assert Plan.model_validate(data).model_dump(mode="json") == data
    plan_schema = root_schema["properties"]["status"]["properties"]["plan"]
    jsonschema.Draft4Validator(plan_schema).validate(data)


def test_default_output_is_the_step_by_step_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(GOLDEN) == 0
    out = capsys.readouterr().out
    for text in ("npuMemSizeGiB", "17 GiB", "2176 blocks", "blocksPerRequest.avg", "maxBatchSize.min",
                 "362 requests", "1088 requests", "floor(totalBlocks / blocksPerRequest.max)",
                 "schedule.maxPrefillTokens",
                 "4 maxBatchSize range", "maxPrefillBatchSize 217"):
        assert text in out, text


@pytest.mark.parametrize("path", sorted((REPO / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_from_file_prints_the_plan_of_the_example(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "plan", "--from-file", str(path))
    assert data == plan(InferenceService.model_validate(load_yaml(path)).spec).model_dump(mode="json")


def test_flags_override_the_file(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(REPO / "examples" / "llama3-8b-throughput.yaml")
    data = run_json(capsys, "plan", "--from-file", path, "--cards", "4", "--objective", "firstTokenAndDecode",
                    "--ttft-ms", "1000", "--tpot-ms", "50", "--replicas", "2")
    assert data["worldSize"] == 4 and data["replicas"] == 2
    assert data["schedule"]["supportSelectBatch"] is False


def test_accelerator_and_auto_world_size(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "plan", "--preset", "llama3-70b", "--accelerator", "ascend-910b3",
                    "--avg-input-tokens", "186", "--avg-output-tokens", "346")
    assert data["worldSize"] == 4 and data["accelerator"] == "ascend-910b3"


@pytest.mark.parametrize(("argv", "message"), [
    (["--preset", "llama3-8b", "--avg-input-tokens", "10"], "--avg-output-tokens required"),
    (["--preset", "llama3-8b", "--avg-input-tokens", "10", "--avg-output-tokens", "10", "--cards", "3"],
     "spec.accelerator.cards (3) must divide the 32 attention heads"),
    (["--preset", "llama3-8b", "--avg-input-tokens", "10", "--avg-output-tokens", "10", "--objective",
      "decodeLatency"], "spec.slo.tpotMs is required"),
    (["--preset", "llama3-70b", "--avg-input-tokens", "10", "--avg-output-tokens", "10", "--cards", "1"],
     "leave no memory for the KV cache"),
])
def test_errors_exit_2_and_name_the_field(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert message in captured.err


def _modules_after(code: str) -> set[str]:
    code += "; import sys, json; print(json.dumps(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO / "tests")
    assert result.returncode == 0, result.stderr
    return set(json.loads(result.stdout.splitlines()[-1]))


def test_the_operator_never_imports_torch_or_the_engine() -> None:
    modules = _modules_after(
        "import argparse; from npuserve.operator import api, crd, planner, render, plan_cli; "
        "parser = argparse.ArgumentParser(); plan_cli.configure(parser); "
        f"assert plan_cli.run(parser.parse_args({GOLDEN[1:]!r} + ['--format', 'json'])) == 0"
    )
    assert not {m for m in modules if m == "torch" or m.startswith("npuserve.engine")}


def test_npuserve_plan_never_imports_torch() -> None:
    modules = _modules_after(f"from npuserve.cli import main; assert main({GOLDEN!r}) == 0")
    assert "torch" not in modules
