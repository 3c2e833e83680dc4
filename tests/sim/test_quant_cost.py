"""The simulator on W8A8 (int8) weights (docs/simulator.md, "Quantized weights"): a decode step reads the int8 bytes
with their per-row scales, so at batch 1 its time drops by the ratio of the weight bytes; the FLOPs stay the
parameters' at the card's 16-bit rate. Expected numbers by hand from Llama-3-8B's config; `npuserve simulate` takes
the scheme from --quantization or from the model folder's own declaration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from npuserve.catalog.accelerators import Efficiency, efficiency_of, get_accelerator
from npuserve.catalog.models import MODEL_PRESETS
from npuserve.cli import main
from npuserve.quantization import QuantScheme
from npuserve.sim.cost_model import CostModel, CostParams, Hardware, StepShape

# the 910B3's datasheet figures with written-out achieved fractions (the fitted ones move with each fit)
HW = Hardware.of(get_accelerator("ascend-910b3"), Efficiency(bandwidth=0.85, compute=0.6, link=0.7, source="test"))
NO_OVERHEAD = CostParams()  # no launches, no host work, no all-reduce latency

# Llama-3-8B: 32 layers, hidden 4096, 32 heads and 8 KV heads of 128, intermediate 14336, vocab 128256.
# linear modules of one layer: q and o 4096x4096 (16,777,216 each), k and v 1024x4096 (4,194,304 each), gate, up
# 14336x4096 and down 4096x14336 (58,720,256 each) = 218,103,808 parameters;
# rows: 4096 + 1024 + 1024 + 4096 + 14336 + 14336 + 4096 = 43,008. Norms 2 x 4096 = 8,192 a layer. LM head
# 128256 x 4096 = 525,336,576 (the embedding table is a lookup: a decode step does not read it).
BF16_STEP_BYTES = 2 * (32 * (218_103_808 + 8_192) + 525_336_576)  # 15,009,841,152
# msModelSlim W8A8_DYNAMIC: 1 byte a linear parameter + 4 bytes a row (bf16 weight_scale and weight_offset); the
# norms and the LM head stay bf16.
W8A8_DYNAMIC_STEP_BYTES = 32 * (218_103_808 + 4 * 43_008 + 2 * 8_192) + 2 * 525_336_576  # 8,036,024,320


def test_decode_at_batch_one_drops_by_the_weight_byte_ratio() -> None:
    assert BF16_STEP_BYTES == 15_009_841_152 and W8A8_DYNAMIC_STEP_BYTES == 8_036_024_320
    bf16_model = MODEL_PRESETS["llama3-8b"]
    w8a8_model = bf16_model.model_copy(
        update={"quantization": QuantScheme(format="msmodelslim", method="w8a8_dynamic")})
    bf16, w8a8 = CostModel(bf16_model, HW, 1, NO_OVERHEAD), CostModel(w8a8_model, HW, 1, NO_OVERHEAD)
    bandwidth = HW.bandwidth_gbps * 1e9 * 0.85
    assert bf16.weights_s(1) == pytest.approx(BF16_STEP_BYTES / bandwidth, rel=1e-12)
    assert w8a8.weights_s(1) == pytest.approx(W8A8_DYNAMIC_STEP_BYTES / bandwidth, rel=1e-12)
    # one sequence, one new token over a 1-token context: the step is the weights' read (the KV is 16-bit in both)
    one = StepShape(num_seqs=1, new_tokens=1, context_tokens=1, attended_pairs=1, sampled_rows=1)
    a, b = bf16.step(one), w8a8.step(one)
    assert a.kv_s == b.kv_s and a.compute_s == b.compute_s  # bf16 FLOPs: no int8 TOPS figure in the catalog
    assert b.total_s / a.total_s == pytest.approx(
        (W8A8_DYNAMIC_STEP_BYTES + a.kv_s * bandwidth) / (BF16_STEP_BYTES + a.kv_s * bandwidth), rel=1e-9)
    assert b.total_s / a.total_s == pytest.approx(0.5354, abs=1e-4)
    # tensor parallel: each of 2 cards reads half
    assert CostModel(w8a8_model, HW, 2, NO_OVERHEAD).weights_s(1) == pytest.approx(w8a8.weights_s(1) / 2)


FAST = ["--accelerator", "ascend-910b3", "--cards", "1", "--num-prompts", "8", "--random-input-len", "100",
        "--random-output-len", "32", "--max-concurrency", "1", "--format", "json"]


def _simulate(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, object]:
    assert main(["simulate", *args, *FAST]) == 0
    document: dict[str, object] = json.loads(capsys.readouterr().out)
    return document


def _tpot(doc: dict[str, object]) -> float:
    metrics = doc["metrics"]
    assert isinstance(metrics, dict)
    return float(metrics["tpot_ms"]["mean"])


def test_simulate_serves_the_scheme_of_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    bf16 = _simulate(capsys, "--preset", "llama3-8b")
    w8a8 = _simulate(capsys, "--preset", "llama3-8b", "--quantization", "msmodelslim:w8a8_dynamic")
    assert "weights msmodelslim W8A8_DYNAMIC" in w8a8["simulation"]["notes"][0]  # type: ignore[index]
    assert "weights bfloat16" in bf16["simulation"]["notes"][0]  # type: ignore[index]
    # one request at a time: each decode step is the engine's launches plus the weights' read (the rest is the same
    # in both), so TPOT drops by exactly the bytes saved over the effective bandwidth: the 910B3's datasheet
    # 1759.2 GB/s times the family's fitted fraction (the CLI's card); the launches dilute the 0.536 byte ratio
    fitted = get_accelerator("ascend-910b3")
    saved_ms = 6_973_816_832 / (1759.2e9 * efficiency_of(fitted).bandwidth) * 1000
    assert BF16_STEP_BYTES - W8A8_DYNAMIC_STEP_BYTES == 6_973_816_832
    assert _tpot(bf16) - _tpot(w8a8) == pytest.approx(saved_ms, rel=1e-6)


def test_simulate_reads_the_model_folders_declaration(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "llama-w8a8"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(MODEL_PRESETS["llama3-8b"].to_hf_config()))
    (folder / "quant_model_description.json").write_text(json.dumps({"model_quant_type": "W8A8_DYNAMIC"}))
    config = str(folder / "config.json")
    doc = _simulate(capsys, "--model-config", config)
    assert "weights msmodelslim W8A8_DYNAMIC" in doc["simulation"]["notes"][0]  # type: ignore[index]
    # a flag that disagrees with the folder is refused naming it
    assert main(["simulate", "--model-config", config, "--quantization", "compressed-tensors:w8a8", *FAST]) == 2
    assert "--quantization compressed-tensors:w8a8" in capsys.readouterr().err


def test_a_bad_scheme_is_refused_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--preset", "llama3-8b", "--quantization", "msmodelslim:w4a8", *FAST]) == 2
    assert "--quantization 'msmodelslim:w4a8'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--preset", "llama3-8b", "--avg-input-tokens", "100", "--avg-output-tokens", "100",
              "--quantization", "int4"])
    assert "--quantization 'int4'" in capsys.readouterr().err
