"""Quantize a model folder with msModelSlim on the CPU (run by tests/quant_checkpoints.py with the msmodelslim
virtualenv's python, never imported by the tests): its documented PTQ API, `msmodelslim.pytorch.llm_ptq.
llm_ptq_tools` `QuantConfig(dev_type="cpu")` and `Calibrator`, calibrated on the given texts with the model's own
tokenizer, saved with `Calibrator.save(save_type=["ascendV1"])`: the layout its example scripts write by default
for vllm-ascend (`quant_model_description.json` with a version; `--mindie_format` writes `safe_tensor`, whose
description file is `quant_model_description_<type>.json`), under its default file names.

    python quantize_msmodelslim.py SOURCE OUT SCHEME CALIB_JSON

SCHEME: w8a8 (static: per-tensor activation scale and offset from calibration), w8a8_dynamic (activations per token),
moe (what msModelSlim's Qwen3-30B-A3B W8A8 practice, lab_practice/qwen3_moe/qwen3-30b-a3b-w8a8.yaml, does: W8A8
with mix_cfg `*.mlp.*` -> w8a8_dynamic, every `mlp.gate` (the router) disabled; its m4 anti-outlier step is left
out), w8a16 (weight-only int8), kv (w8a8 with `use_kvcache_quant`, the C8 KV cache). Weights per output channel
(`mm_tensor=False`), symmetric; the last linear (lm_head) stays float (`disable_last_linear`, the default). A
`-mindie` suffix (e.g. w8a8-mindie) saves in MindIE's layout instead (`save_type=["safe_tensor"]`:
`quant_model_description_<type>.json`), as its example scripts' `--mindie_format` does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from msmodelslim.pytorch.llm_ptq.llm_ptq_tools import Calibrator, QuantConfig
from transformers import AutoModelForCausalLM, AutoTokenizer

MAX_SEQ_LEN = 128


def config(scheme: str, routers: list[str]) -> tuple[QuantConfig, dict[str, str] | None]:
    common = dict(w_bit=8, dev_type="cpu", mm_tensor=False, w_sym=True, disable_names=routers)
    if scheme == "w8a8":
        return QuantConfig(a_bit=8, act_method=1, pr=1.0, **common), None
    if scheme == "w8a8_dynamic":
        return QuantConfig(a_bit=8, act_method=1, pr=1.0, is_dynamic=True, **common), None
    if scheme == "moe":
        return QuantConfig(a_bit=8, act_method=1, pr=1.0, **common), {"*.mlp.*": "w8a8_dynamic", "*": "w8a8"}
    if scheme == "w8a16":
        return QuantConfig(a_bit=16, **common).weight_quant(mm_tensor=False), None
    if scheme == "kv":
        return QuantConfig(a_bit=8, act_method=1, pr=1.0, use_kvcache_quant=True, **common), None
    raise SystemExit(f"unknown scheme {scheme!r}")


def main(source: str, out: str, scheme: str, calib_json: str) -> None:
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, torch_dtype="auto").eval()
    # the MoE routers stay float; msModelSlim takes only nn.Linear names (DeepSeek-V3's router is a module of its own)
    routers = [name for name, module in model.named_modules()
               if name.endswith(".mlp.gate") and isinstance(module, torch.nn.Linear)]
    texts = json.loads(Path(calib_json).read_text())
    calib = [[tokenizer(text, return_tensors="pt", truncation=True, max_length=MAX_SEQ_LEN,
                        add_special_tokens=False).input_ids] for text in texts]
    scheme, mindie, _ = scheme.partition("-mindie")
    cfg, mix_cfg = config(scheme, routers)
    calibrator = Calibrator(model, cfg, calib_data=calib, disable_level="L0", mix_cfg=mix_cfg)
    calibrator.run()
    calibrator.save(out, save_type=["safe_tensor" if mindie else "ascendV1"])


if __name__ == "__main__":
    main(*sys.argv[1:5])
