"""Quantize a model folder with llm-compressor (run by tests/quant_checkpoints.py with the llmcompressor virtualenv's
python, never imported by the tests): simple PTQ (`QuantizationModifier`, no GPTQ) through `oneshot`, calibrated on
the given texts with the model's own tokenizer, saved compressed (`save_pretrained(save_compressed=True)`).

    python quantize_llmcompressor.py SOURCE OUT SCHEME CALIB_JSON

SCHEME: w8a8 (int8 weights per channel, int8 activations per tensor, static, calibrated: a config group of our own,
as llm-compressor's presets have no static int8 one), w8a8_dynamic (llm-compressor's "W8A8" preset: activations per
token, dynamic), int4 (the "W4A16" preset), kv (w8a8 plus llm-compressor's `kv_cache_scheme`, as its fp8 KV-cache
example writes it). lm_head and the MoE router (`re:.*mlp.gate$`) stay in float, as llm-compressor's MoE examples
ignore them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from transformers import AutoModelForCausalLM, AutoTokenizer

IGNORE = ["lm_head", "re:.*mlp.gate$"]
MAX_SEQ_LEN = 128


def static_int8_group() -> dict[str, QuantizationScheme]:
    return {"group_0": QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(num_bits=8, type="int", strategy="channel", symmetric=True, dynamic=False),
        input_activations=QuantizationArgs(num_bits=8, type="int", strategy="tensor", symmetric=True, dynamic=False),
    )}


def recipe(scheme: str) -> QuantizationModifier:
    if scheme == "w8a8":
        return QuantizationModifier(config_groups=static_int8_group(), ignore=IGNORE)
    if scheme == "w8a8_dynamic":
        return QuantizationModifier(targets="Linear", scheme="W8A8", ignore=IGNORE)
    if scheme == "int4":
        return QuantizationModifier(targets="Linear", scheme="W4A16", ignore=IGNORE)
    if scheme == "kv":
        kv = QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True, dynamic=False)
        return QuantizationModifier(config_groups=static_int8_group(), ignore=IGNORE, kv_cache_scheme=kv)
    raise SystemExit(f"unknown scheme {scheme!r}")


def main(source: str, out: str, scheme: str, calib_json: str) -> None:
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, torch_dtype="auto")
    texts = json.loads(Path(calib_json).read_text())
    dataset = Dataset.from_dict({"text": texts}).map(
        lambda row: tokenizer(row["text"], truncation=True, max_length=MAX_SEQ_LEN, add_special_tokens=False),
        remove_columns=["text"])
    oneshot(model=model, dataset=dataset, recipe=recipe(scheme), max_seq_length=MAX_SEQ_LEN,
            num_calibration_samples=len(texts))
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)


if __name__ == "__main__":
    main(*sys.argv[1:5])
