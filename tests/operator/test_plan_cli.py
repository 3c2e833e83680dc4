"""`npuserve plan`: the golden command, the table, --from-file, and errors that name the field."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from isvc_helpers import REPO

from npuserve.cli import main
from npuserve.planning.api import Plan

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


# Each example's numbers, worked out by hand from the published model sizes (HF parameter counts, bf16) and the
# cards' memory (910B4 32 GiB with 3 GiB idle, 910B3 64 GiB with 3.4 GiB idle), with the guide's formulas:
# npuMemSize = floor((memory - idle - weights / worldSize) x 0.8); blocks = floor(npuMemSize / block bytes);
# maxBatchSize = floor(blocks / blocks per request) at the max, average and min request.
EXAMPLE_PLANS: dict[str, dict[str, Any]] = {
    # 8.03e9 x 2 B = 14.96 GiB over 2 cards: floor(21.52 x 0.8) = 17; 2 x 32 x 128 x 4 x 128 x 2 B = 8 MiB blocks;
    # 10000 users / min(435, 362) per replica = 28 replicas.
    "llama3-8b-throughput.yaml": {"worldSize": 2, "nodes": 1, "npuMemSizeGiB": 17, "totalBlocks": 2176,
                                  "blocksPerRequest": {"min": 2, "avg": 5, "max": 6},
                                  "maxBatchSize": {"min": 362, "avg": 435, "max": 1088}, "replicas": 28},
    # 7.62e9 x 2 B = 14.19 GiB fit one 910B3: floor(46.41 x 0.8) = 37; 2 x 28 x 128 x 4 x 128 x 2 B = 7 MiB blocks;
    # prompts of 512 tokens are 4 blocks, +2 on average, +8 at most.
    "qwen2.5-7b-decode-latency.yaml": {"worldSize": 1, "nodes": 1, "npuMemSizeGiB": 37, "totalBlocks": 5412,
                                       "blocksPerRequest": {"min": 4, "avg": 6, "max": 12},
                                       "maxBatchSize": {"min": 451, "avg": 902, "max": 1353}, "replicas": 2},
    # 32.76e9 x 2 B = 61.03 GiB over 4 cards: floor(45.34 x 0.8) = 36; 2 KV heads per card: 8 MiB blocks.
    "qwq-32b-first-token.yaml": {"worldSize": 4, "nodes": 1, "npuMemSizeGiB": 36, "totalBlocks": 4608,
                                 "blocksPerRequest": {"min": 8, "avg": 24, "max": 72},
                                 "maxBatchSize": {"min": 64, "avg": 192, "max": 576}, "replicas": 1},
    # 70.55e9 x 2 B = 131.4 GiB over 16 cards (two nodes of 8): floor(20.79 x 0.8) = 16; one KV head per card
    # (8 heads replicated over 16): 2 x 80 x 128 x 1 x 128 x 2 B = 5 MiB blocks.
    "llama3-70b-multinode.yaml": {"worldSize": 16, "nodes": 2, "npuMemSizeGiB": 16, "totalBlocks": 3276,
                                  "blocksPerRequest": {"min": 2, "avg": 5, "max": 6},
                                  "maxBatchSize": {"min": 546, "avg": 655, "max": 1638}, "replicas": 1},
    # DeepSeek-V3's architecture inline (tests/planning/test_moe_mla_plans.py derives it by hand): 671,026,419,200
    # parameters x 2 B = 1249.88 GiB; 8 and 16 cards hold 156.2 and 78.1 GiB each, more than 64; 32 cards (4 nodes of
    # 8): floor((64 - 3.4 - 39.06) x 0.8) = 17; MLA blocks 61 x 128 x (512 + 64) x 2 B = 8,994,816, whole on each card.
    "deepseek-r1-multinode.yaml": {"worldSize": 32, "nodes": 4, "npuMemSizeGiB": 17, "totalBlocks": 2029,
                                   "blocksPerRequest": {"min": 2, "avg": 5, "max": 6},
                                   "maxBatchSize": {"min": 338, "avg": 405, "max": 1014}, "replicas": 1},
    # The same model as msModelSlim W8A8 (tests/planning/test_quant_plans.py derives it by hand): 675,052,397,312 B =
    # 628.69 GiB; 8 cards hold 78.6 GiB each; 16 (2 nodes of 8, MindIE's W8A8 layout): floor((64 - 3.4 - 39.29) x
    # 0.8) = 17 GiB of 8,994,816-byte blocks = 2029 (2029 / 5 = 405, / 6 = 338, / 2 = 1014).
    "deepseek-r1-w8a8-multinode.yaml": {"worldSize": 16, "nodes": 2, "npuMemSizeGiB": 17, "totalBlocks": 2029,
                                        "blocksPerRequest": {"min": 2, "avg": 5, "max": 6},
                                        "maxBatchSize": {"min": 338, "avg": 405, "max": 1014}, "replicas": 1},
    # The two-layer float32 model in 2 GiB of host memory: 1 GiB of KV, 128 KiB blocks.
    "tiny-cpu.yaml": {"worldSize": 1, "nodes": 1, "npuMemSizeGiB": 1, "totalBlocks": 8192,
                      "blocksPerRequest": {"min": 1, "avg": 2, "max": 2},
                      "maxBatchSize": {"min": 4096, "avg": 4096, "max": 8192}, "replicas": 1},
    # make demo's model: 8 KV heads of 512 in float32 over 4 layers: 2 x 4 x 128 x 8 x 512 x 4 B = 16 MiB blocks, so
    # 1 GiB holds 64; a 64-token prompt is one block, +1 on average, +2 at most (192 tokens). replicas: the spec's 1.
    "demo.yaml": {"worldSize": 1, "nodes": 1, "npuMemSizeGiB": 1, "totalBlocks": 64,
                  "blocksPerRequest": {"min": 1, "avg": 2, "max": 3},
                  "maxBatchSize": {"min": 21, "avg": 32, "max": 64}, "replicas": 1},
}


def test_every_example_has_its_worked_numbers() -> None:
    assert sorted(EXAMPLE_PLANS) == sorted(p.name for p in (REPO / "examples").glob("*.yaml"))


@pytest.mark.parametrize("name", sorted(EXAMPLE_PLANS))
def test_from_file_prints_the_plan_of_the_example(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "plan", "--from-file", str(REPO / "examples" / name))
    assert {k: data[k] for k in EXAMPLE_PLANS[name]} == EXAMPLE_PLANS[name]
    assert data["schedule"]["maxBatchSize"] == EXAMPLE_PLANS[name]["maxBatchSize"]["avg"]
    # The bundled engine serves every example, those whose replica spans nodes too (a LeaderWorkerSet group).
    assert not any(w.startswith("engine:") for w in data["warnings"])


def test_the_table_says_where_a_replica_spanning_nodes_runs_and_warns_of_nothing(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(GOLDEN) == 0
    assert "cannot serve" not in capsys.readouterr().out  # two cards on one node: served
    assert main([*GOLDEN[:4], "16", *GOLDEN[5:]]) == 0  # 16 cards of 8-card nodes
    out = " ".join(capsys.readouterr().out.split())
    assert ("Replica: 16 cards span 2 nodes of 8 cards (a LeaderWorkerSet of 2 pods x 8 cards, tensor parallel "
            "16)") in out
    assert "cannot serve" not in out and "EngineCannotServe" not in out


def test_cards_per_node_splits_a_replica_and_its_error_names_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "plan", "--preset", "tiny", "--accelerator", "cpu", "--card-memory-gib", "2",
                    "--reserved-gib", "0", "--cards", "2", "--cards-per-node", "1", "--avg-input-tokens", "64",
                    "--avg-output-tokens", "32", "--max-input-tokens", "256", "--max-output-tokens", "64")
    assert (data["worldSize"], data["nodes"], data["cardsPerPod"]) == (2, 2, 1)
    assert main(["plan", "--preset", "llama3-70b", "--cards", "12", "--cards-per-node", "8", "--avg-input-tokens",
                 "186", "--avg-output-tokens", "346"]) != 0
    err = capsys.readouterr().err
    assert "--cards must be a multiple of --cards-per-node when it exceeds it" in err, err


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
    (["--preset", "llama3-8b", "--avg-input-tokens", "10"], "--avg-output-tokens is required"),
    (["--preset", "llama3-8b", "--avg-input-tokens", "10", "--avg-output-tokens", "10", "--cards", "3"],
     "--cards (3) must divide the 32 attention heads"),
    (["--preset", "llama3-8b", "--avg-input-tokens", "10", "--avg-output-tokens", "10", "--objective",
      "decodeLatency"], "--tpot-ms is required"),
    # the flags the user typed, not the spec paths nor a planned value (maxPrefillTokens) they never set
    (["--preset", "llama3-8b", "--avg-input-tokens", "5000", "--avg-output-tokens", "10"],
     "--avg-input-tokens must not exceed --max-input-tokens"),
    (["--preset", "llama3-8b", "--avg-input-tokens", "10", "--avg-output-tokens", "10", "--max-input-tokens",
      "500000"], "npuserve plan: --max-input-tokens (maxPrefillTokens is raised to the longest prompt)"),
    (["--preset", "llama3-70b", "--avg-input-tokens", "10", "--avg-output-tokens", "10", "--cards", "1"],
     "leave no memory for the KV cache"),
])
def test_errors_exit_2_and_name_the_field(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert message in captured.err


def test_a_file_spec_keeps_its_paths_and_a_flag_beside_it_is_named(capsys: pytest.CaptureFixture[str],
                                                                   tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text("model: {preset: llama3-8b, name: m, weights: {loadFormat: dummy}}\n"
                    "accelerator: {type: ascend-910b4}\nworkload: {avgInputTokens: 10, avgOutputTokens: 10}\n")
    assert main(["plan", "--from-file", str(spec), "--cards", "3"]) == 2
    assert "--cards (3) must divide" in capsys.readouterr().err
    spec.write_text(spec.read_text().replace("ascend-910b4}", "ascend-910b4, cards: 3}"))
    assert main(["plan", "--from-file", str(spec)]) == 2
    assert "spec.accelerator.cards (3) must divide" in capsys.readouterr().err


def test_slos_too_small_to_be_physical_get_a_warning(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["plan", "--preset", "llama3-8b", "--avg-input-tokens", "186", "--avg-output-tokens", "346",
            "--objective", "firstTokenAndDecode"]
    assert main([*base, "--tpot-ms", "0.5", "--ttft-ms", "1"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "warning: --tpot-ms 0.5 ms is below" in out and "no batch size can meet it" in out
    assert "warning: --ttft-ms 1 ms is below" in out
    assert main([*base, "--tpot-ms", "50", "--ttft-ms", "2000"]) == 0
    assert "is below" not in capsys.readouterr().out
    data = run_json(capsys, *base, "--tpot-ms", "0.5", "--ttft-ms", "2000", "--format", "json")
    assert [w for w in data["warnings"] if "spec.slo.tpotMs 0.5 ms is below" in w]  # the status keeps spec paths


def test_help_marks_the_flags_required_without_a_file(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for flag, what in (("--preset", "model architecture from the catalog"), ("--avg-input-tokens", "mean prompt "
                       "length"), ("--avg-output-tokens", "mean output length")):
        assert f"{flag.upper().lstrip('-').replace('-', '_')} {what} (required without --from-file)" in help_text \
            or f"}} {what} (required without --from-file)" in help_text, flag


def test_the_maximum_length_note_counts_the_maximum_input(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "plan", "--preset", "llama3-8b", "--avg-input-tokens", "186", "--avg-output-tokens",
                    "346", "--max-input-tokens", "2048", "--max-output-tokens", "512")
    entry = next(e for e in data["explain"] if e["name"] == "maxBatchSize.min")
    longest = -(-2048 // 128) + -(-512 // 128)
    assert f"2048 + 512 tokens: {data['totalBlocks'] // longest})" in entry["note"]
    assert "average input" in entry["note"]


def _modules_after(code: str) -> set[str]:
    code += "; import sys, json; print(json.dumps(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO / "tests")
    assert result.returncode == 0, result.stderr
    return set(json.loads(result.stdout.splitlines()[-1]))


def test_the_operator_never_imports_torch_or_the_engine() -> None:
    modules = _modules_after(
        "import argparse; from npuserve.planning import api, planner; "
        "from npuserve.operator import crd, render, plan_cli; "
        "parser = argparse.ArgumentParser(); plan_cli.configure(parser); "
        f"assert plan_cli.run(parser.parse_args({GOLDEN[1:]!r} + ['--format', 'json'])) == 0"
    )
    assert not {m for m in modules if m in ("torch", "npuserve.engine") or m.startswith("npuserve.engine.")}


def test_npuserve_plan_never_imports_torch() -> None:
    modules = _modules_after(f"from npuserve.cli import main; assert main({GOLDEN!r}) == 0")
    assert "torch" not in modules


# The [engine] and [loadgen] extras' own packages and the test-only ones: `npuserve plan` must run without any of
# them (the operator image installs only the [operator] extra).
ENGINE_ONLY = ("torch", "transformers", "safetensors", "tokenizers", "fastapi", "uvicorn", "prometheus_client",
               "numpy", "jinja2", "llguidance", "matplotlib", "openai")


def _plan_without_the_engine(*argv: str) -> subprocess.CompletedProcess[str]:
    prelude = (
        "import sys\n"
        f"for name in {ENGINE_ONLY!r}:\n"
        "    sys.modules[name] = None  # import raises ImportError\n"
        "from npuserve.cli import main\n"
        f"sys.exit(main({list(argv)!r}))\n"
    )
    return subprocess.run([sys.executable, "-P", "-c", prelude], capture_output=True, text=True, cwd=REPO / "tests",
                          timeout=120)


def test_npuserve_plan_runs_with_only_the_operator_extra() -> None:
    result = _plan_without_the_engine(*GOLDEN, "--format", "json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert (data["worldSize"], data["npuMemSizeGiB"], data["totalBlocks"]) == (2, 17, 2176)
    assert data["blocksPerRequest"] == {"min": 2, "avg": 5, "max": 6}
    assert data["schedule"]["maxBatchSize"] == 435

    table = _plan_without_the_engine(*GOLDEN)
    assert table.returncode == 0, table.stderr
    assert "2176 blocks" in table.stdout and "maxPrefillBatchSize 217" in table.stdout
    # The prelude really blocks: the same prelude cannot import torch.
    blocked = subprocess.run([sys.executable, "-P", "-c", "import sys; sys.modules['torch'] = None; import torch"],
                             capture_output=True, text=True)
    assert blocked.returncode != 0 and "import of torch halted" in blocked.stderr
