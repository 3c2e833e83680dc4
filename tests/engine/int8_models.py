"""Helpers of the int8 (W8A8) engine tests: a prompt's logits from a model on the CPU backend, the float copy of an
int8 model, and a W8A8 checkpoint folder in either tool's layout made from a float dummy one (the engine's own
per-channel quantization, `quant_loader.dummy_tensors`, written out as the tool's tensors and declaration).

The writer is for the loader's edge cases only (test_int8_loading.py): models and tensors the tools do not write
here (a Qwen2 model with attention biases, a non-zero weight_offset, (out,) shaped scales, a deq_scale or quant_bias
edited by hand, pieces of different schemes). Whole-model tests use the real tools' checkpoints
(tests/quant_checkpoints.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from npuserve.engine.backends.cpu import CPUBackend
from npuserve.engine.batch import build_prefill
from npuserve.engine.model.base import CausalLM
from npuserve.engine.model.quant_loader import dummy_tensors
from npuserve.engine.sequence import SamplingParams, Sequence
from npuserve.modelspec import ModelSpec
from npuserve.quantization import MSMODELSLIM_DESCRIPTION, QuantizationRequest

BLOCK_SIZE = 16


@torch.inference_mode()
def prompt_logits(model: CausalLM, tokens: list[int]) -> torch.Tensor:
    """Every position's logits `(len(tokens), vocab)` of one prefill on the CPU backend."""
    backend, spec = CPUBackend(), model.spec
    blocks = -(-len(tokens) // BLOCK_SIZE)
    model.bind_backend(backend)
    if spec.mla is not None:
        caches = backend.allocate_mla_cache(spec.num_layers, blocks, BLOCK_SIZE, spec.mla.kv_lora_rank,
                                            spec.mla.qk_rope_head_dim, torch.float32)
        for layer, mla_cache in zip(model.attention_layers(), caches, strict=True):
            layer.kv_cache = mla_cache
    else:
        kv = backend.allocate_kv_cache(spec.num_layers, blocks, BLOCK_SIZE, model.layout.kv_heads, spec.head_dim,
                                       torch.float32)
        for layer, cache in zip(model.attention_layers(), kv, strict=True):
            layer.kv_cache = cache
    seq = Sequence(tokens, SamplingParams(temperature=0.0), arrival_time=0.0)
    seq.block_table = list(range(blocks))
    batch = build_prefill([seq], BLOCK_SIZE, torch.device("cpu"))
    hidden = model(batch.input_ids, batch.positions, batch.meta)
    return model.compute_logits(hidden).float()


def write_quantized_checkpoint(float_folder: Path, out: Path, request: QuantizationRequest) -> Path:
    """`float_folder`'s model as a W8A8 checkpoint of `request`'s format and method (every decoder linear layer
    but the router int8, per-channel symmetric weights)."""
    shutil.copytree(float_folder, out)
    config = json.loads((out / "config.json").read_text())
    spec = ModelSpec.from_hf_config(config).model_copy(update={"quantization": request.scheme()})
    tensors: dict[str, torch.Tensor] = {}
    for name, value in load_file(str(out / "model.safetensors")).items():
        tensors.update(dummy_tensors(name, value.float(), spec))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    if request.format == "msmodelslim":
        kinds = {"w8a8": "W8A8", "w8a8_dynamic": "W8A8_DYNAMIC"}
        description: dict[str, str] = {"model_quant_type": kinds[request.method]}
        for name, value in tensors.items():
            module, _, leaf = name.rpartition(".")
            if leaf == "weight":
                description[name] = kinds[request.method] if value.dtype == torch.int8 else "FLOAT"
            else:
                description[name] = kinds[request.method] if f"{module}.weight" in tensors and \
                    tensors[f"{module}.weight"].dtype == torch.int8 else "FLOAT"
        (out / MSMODELSLIM_DESCRIPTION).write_text(json.dumps(description, indent=2))
    else:
        dynamic = request.method == "w8a8_dynamic"
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": dynamic,
                                      "strategy": "token" if dynamic else "tensor"}}}}
        (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def dequantized_copy(model: CausalLM) -> CausalLM:
    """The same model in float32: every int8 weight times its per-row scale (activations then stay float)."""
    from npuserve.engine.model.int8 import Int8Experts, Int8Linear
    from npuserve.engine.model.loader import build_model

    spec = model.spec.model_copy(update={"quantization": None})
    copy = build_model(spec, torch.float32, torch.device("cpu"), model.layout)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, param in copy.named_parameters():
            owner, _, leaf = name.rpartition(".")
            source = modules.get(owner)
            if isinstance(source, Int8Linear) and leaf == "weight":
                param.copy_(source.weight.float() * source.weight_scale.unsqueeze(1))
            elif isinstance(source, Int8Experts) and leaf in ("w13", "w2"):
                param.copy_(getattr(source, leaf).float() * getattr(source, f"{leaf}_scale").unsqueeze(-1))
            else:
                param.copy_(dict(model.named_parameters())[name])
    return copy
