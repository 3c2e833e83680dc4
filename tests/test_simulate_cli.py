"""`npuserve simulate`: the plan's defaults, MindIE names for the schedule, the bench flags and reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from npuserve.cli import main
from npuserve.mindie_config import minimal_config

FAST = ["--preset", "llama3-8b", "--accelerator", "ascend-910b4", "--cards", "2", "--num-prompts", "40",
        "--random-input-len", "200", "--random-output-len", "40"]


def run_json(capsys: pytest.CaptureFixture[str], *extra: str) -> dict[str, object]:
    assert main(["simulate", *FAST, "--format", "json", *extra]) == 0
    document: dict[str, object] = json.loads(capsys.readouterr().out)
    return document


def test_runs_with_only_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--preset", "llama3-8b", "--accelerator", "ascend-910b3", "--cards", "2"]) == 0
    out = capsys.readouterr().out
    assert "engine config from the plan" in out and "KV blocks" in out
    assert "Successful requests:                     1000" in out
    # the 910B3's datasheet figures (Ascend/msmodeling's 313T tier) and the family's fitted fractions, said as such
    assert "ascend-910b3 1759.2 GB/s x " in out and "294.9 TFLOPS x " in out and "hccs 196 GB/s" in out
    assert "(datasheet figures; achieved fractions fitted: " in out


def test_json_report_is_the_bench_one_marked_simulated(capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(capsys)
    assert doc["simulated"] is True and doc["token_source"] == "simulated"
    metrics = doc["metrics"]
    assert isinstance(metrics, dict) and metrics["completed"] == 40
    simulation = doc["simulation"]
    assert isinstance(simulation, dict)
    assert simulation["kv_blocks"] == 2176  # the plan's totalBlocks for 2 x 910B4 (docs/planning.md#the-steps)
    assert set(simulation["cost_totals_s"]) >= {"weights_s", "kv_s", "compute_s", "comm_s", "host_s", "launch_s"}


def test_schedule_overrides_by_mindie_names(capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(capsys, "--schedule", "maxBatchSize=8", "supportSelectBatch=false")
    notes = doc["simulation"]["notes"]  # type: ignore[index]
    assert "maxBatchSize 8, maxPrefillBatchSize 4" in notes[0] and "supportSelectBatch false" in notes[0]
    records = doc["records"]
    assert isinstance(records, list)
    assert max(r["server"]["mean_decode_batch_size"] for r in records) <= 8


def test_an_unknown_schedule_key_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", *FAST, "--schedule", "maxBatchSize=8", "maxBatchSise=9"]) == 2
    err = capsys.readouterr().err
    assert "maxBatchSise" in err and "unknown ScheduleConfig field" in err


def test_an_out_of_range_schedule_value_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", *FAST, "--schedule", "maxQueueDelayMicroseconds=10"]) == 2
    assert "maxQueueDelayMicroseconds" in capsys.readouterr().err


def test_a_mindie_config_file_replaces_the_plans(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = minimal_config("/models/m", maxBatchSize=16, maxPrefillBatchSize=8)
    data = config.to_dict()
    data["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0].update({"worldSize": 2, "npuMemSize": 4})
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    doc = run_json(capsys, "--config", str(path))
    simulation = doc["simulation"]
    assert isinstance(simulation, dict)
    assert simulation["kv_blocks"] == 4 * 1024 // 8  # npuMemSize 4 GiB of 8 MiB blocks per card
    assert "maxBatchSize 16" in simulation["notes"][0]


def test_a_config_file_disagreeing_with_cards_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.json"
    path.write_text(minimal_config("/models/m").dumps())  # worldSize 1
    assert main(["simulate", *FAST, "--config", str(path)]) == 2
    assert "worldSize 1" in capsys.readouterr().err


def test_mindie_format_prints_the_benchmark_tables(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", *FAST, "--format", "mindie", "--max-concurrency", "10"]) == 0
    out = capsys.readouterr().out
    assert "The BenchMark test performance metric result is:" in out and "DecoderBatchsize" in out


def test_sweep_prints_the_sweep_csv(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", *FAST, "--sweep", "maxBatchSize=4,16"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("tp,data_type,batch,") and len(lines) == 3
    assert lines[1].startswith("2,bfloat16,4,") and lines[2].startswith("2,bfloat16,16,")


def test_a_report_format_with_a_sweep_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", *FAST, "--sweep", "maxBatchSize=4,16", "--format", "mindie"]) == 2
    assert "--format" in capsys.readouterr().err


def test_slo_flags_pick_the_plans_objective(capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(capsys, "--slo-ttft-ms", "2000", "--slo-tpot-ms", "80")
    assert "supportSelectBatch false" in doc["simulation"]["notes"][0]  # type: ignore[index]
    slo = doc["metrics"]["slo"]  # type: ignore[index]
    assert slo is not None and len(slo["objectives"]) == 2


def test_model_config_json_is_accepted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from npuserve.catalog.models import get_model_preset

    path = tmp_path / "mymodel" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(get_model_preset("qwen2.5-7b").to_hf_config()))
    args = ["simulate", "--model-config", str(path), "--accelerator", "nvidia-h100-80gb", "--num-prompts", "10",
            "--format", "json"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "mymodel"


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-deepseek-v3", "qwen3-30b-a3b"])
def test_moe_and_mla_model_configs_are_planned_inline(preset: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A config.json of a mixture of experts (and MLA) becomes an inline spec.model.architecture the planner takes."""
    from npuserve.catalog.models import get_model_preset

    path = tmp_path / preset / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(get_model_preset(preset).to_hf_config()))
    args = ["simulate", "--model-config", str(path), "--accelerator", "nvidia-h100-80gb", "--num-prompts", "10",
            "--format", "json"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["model"] == preset


def test_runs_where_only_the_operator_extra_is_installed() -> None:
    code = (
        "import sys\n"
        "for name in ('torch', 'tokenizers', 'numpy', 'scipy', 'matplotlib', 'safetensors', 'fastapi'):\n"
        "    sys.modules[name] = None\n"
        "from npuserve.cli import main\n"
        f"sys.exit(main(['simulate', *{FAST!r}]))\n"
    )
    result = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "Serving Benchmark Result" in result.stdout


def test_mindie_23s_tpot_controller_runs_in_the_simulator(capsys: pytest.CaptureFixture[str]) -> None:
    """The simulator drives the engine's own scheduler, so dynamicBatchSizeEnable caps the simulated running batch as
    it caps the engine's: the guide's closed loop at maxBatchSize 200 decodes at about 64 ms a token; with
    decodeExpectedTime 45 the controller holds the mean TPOT within 5% of 45 ms, and throughput falls with the
    batch."""
    load = ["--preset", "llama3-8b", "--accelerator", "ascend-910b4", "--cards", "2", "--num-prompts", "800",
            "--random-input-len", "186", "--random-output-len", "346", "--max-concurrency", "199", "--format", "json"]
    runs = []
    for schedule in (["maxBatchSize=200"], ["maxBatchSize=200", "dynamicBatchSizeEnable=true",
                                            "decodeExpectedTime=45"]):
        assert main(["simulate", *load, "--schedule", *schedule]) == 0
        metrics = json.loads(capsys.readouterr().out)["metrics"]
        runs.append((metrics["tpot_ms"]["mean"], metrics["output_throughput"]))
    (free_tpot, free_tps), (held_tpot, held_tps) = runs
    assert free_tpot > 55
    assert abs(held_tpot / 45 - 1) <= 0.05, held_tpot
    assert held_tps < free_tps
