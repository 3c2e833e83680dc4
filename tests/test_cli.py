import json
import subprocess
import sys
from pathlib import Path

import pytest

from npuserve.cli import COMMANDS, main

DESIGN_SUBCOMMANDS = {"serve", "generate", "plan", "bench", "simulate", "operator", "tune", "model", "doctor"}


def test_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as excinfo:
        main(["--help"])
    assert excinfo.value.code == 0
    out = capsys.readouterr().out
    for name in DESIGN_SUBCOMMANDS:
        assert name in out
    assert {c.name for c in COMMANDS} == DESIGN_SUBCOMMANDS


def test_console_script_runs() -> None:
    script = Path(sys.executable).parent / "npuserve"
    result = subprocess.run([str(script), "--version"], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "0.1.0"


def test_create_dummy_unknown_preset_fails_clearly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model", "create-dummy", "--preset", "nope", "--out", str(tmp_path / "m")]) == 2
    assert "unknown model preset 'nope'" in capsys.readouterr().err


def test_create_dummy_bad_override(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["model", "create-dummy", "--preset", "tiny", "--out", str(tmp_path / "m"), "--set", "layers=3"]
    assert main(args) == 2
    assert "--set 'layers=3'" in capsys.readouterr().err


def test_create_dummy_prints_what_it_wrote(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "m"
    args = ["model", "create-dummy", "--preset", "tiny", "--out", str(out), "--set", "num_layers=3", "--dtype",
            "bfloat16"]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["dtype"] == "bfloat16"
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 3 and config["torch_dtype"] == "bfloat16"
