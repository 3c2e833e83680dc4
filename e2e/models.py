"""Model folders for the demo and the e2e tests: `npuserve model create-dummy` (random weights, its byte-level
tokenizer, the real HF format) with the architecture an InferenceService example declares inline, so the engine
loads through the real loader what the planner planned. Runs with the virtual environment's Python."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from npuserve.planning.api import InferenceServiceSpec
from npuserve.planning.planner import ARCHITECTURE_FIELDS, model_spec


def create_dummy_for(spec: dict[str, Any], out: Path, seed: int = 0) -> Path:
    """Write the model of `spec` (an InferenceService's spec with an inline architecture) to `out`, unless a folder
    with the same config.json is already there."""
    model = model_spec(InferenceServiceSpec.model_validate(spec))
    fields = [*ARCHITECTURE_FIELDS.values(), "head_dim"]
    sets = [f"{f}={json.dumps(getattr(model, f))}" for f in fields if f not in ("model_type", "dtype")]
    marker = out / ".create-dummy.json"  # what the folder was made with: made again only when that changes
    made_with = json.dumps({"sets": sets, "dtype": model.dtype, "seed": seed})
    if marker.is_file() and marker.read_text() == made_with:
        return out
    exe = Path(sys.executable).parent / "npuserve"
    cmd = [str(exe), "model", "create-dummy", "--preset", "tiny", "--out", str(out), "--seed", str(seed),
           "--dtype", model.dtype]
    for item in sets:
        cmd += ["--set", item]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    marker.write_text(made_with)
    return out
