"""Builds a model and fills its weights: from an HF folder of safetensors (one file, or shards listed in
`model.safetensors.index.json`), or random (`loadFormat: dummy`, no files read).

HF tensor names are mapped onto the fused parameters: `q_proj`, `k_proj`, `v_proj` into `qkv_proj` and
`gate_proj`, `up_proj` into `gate_up_proj`, each at its offset along the output dimension.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from npuserve.engine.model.llama import LlamaForCausalLM
from npuserve.engine_contract import DTYPE_BYTES
from npuserve.modelspec import ModelSpec

# The contract's dtype table, as torch dtypes.
TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_BYTES}


class WeightLoadError(RuntimeError):
    """The checkpoint does not match the model (missing, unexpected or misshapen tensors)."""


def build_model(spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """An uninitialised model on `device` (parameters allocated, not filled)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(spec)
    model = model.to(dtype=dtype).to_empty(device=device)
    if spec.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary.reset()
    model.eval()
    model.requires_grad_(False)
    return model


def _shard_offsets(spec: ModelSpec) -> dict[str, tuple[str, int]]:
    """HF projection name -> (fused parameter name, row offset)."""
    q, kv, inter = spec.q_size, spec.kv_size, spec.intermediate_size
    return {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0),
        "self_attn.k_proj": ("self_attn.qkv_proj", q),
        "self_attn.v_proj": ("self_attn.qkv_proj", q + kv),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0),
        "mlp.up_proj": ("mlp.gate_up_proj", inter),
    }


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    single = folder / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {folder}")
    return files


def iterate_hf_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


def load_hf_weights(model: LlamaForCausalLM, folder: str | Path) -> None:
    spec = model.spec
    params = dict(model.named_parameters(remove_duplicate=False))
    fused = _shard_offsets(spec)
    filled: set[str] = set()
    fused_rows: dict[str, int] = {}
    for name, tensor in iterate_hf_tensors(Path(folder)):
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name == "lm_head.weight" and spec.tie_word_embeddings:
            continue
        target, offset = name, None
        for hf, (ours, row) in fused.items():
            if f".{hf}." in name:
                target, offset = name.replace(hf, ours), row
                break
        param = params.get(target)
        if param is None:
            raise WeightLoadError(f"unexpected tensor {name} in the checkpoint")
        with torch.no_grad():
            if offset is None:
                if tuple(param.shape) != tuple(tensor.shape):
                    raise WeightLoadError(f"{name}: shape {tuple(tensor.shape)}, model wants {tuple(param.shape)}")
                param.copy_(tensor)
                filled.add(target)
            else:
                rows = tensor.shape[0]
                if offset + rows > param.shape[0] or tuple(tensor.shape[1:]) != tuple(param.shape[1:]):
                    raise WeightLoadError(f"{name}: shape {tuple(tensor.shape)} does not fit {target}")
                param[offset : offset + rows].copy_(tensor)
                fused_rows[target] = fused_rows.get(target, 0) + rows
    for target, rows in fused_rows.items():
        if rows == params[target].shape[0]:
            filled.add(target)
    if spec.tie_word_embeddings:
        filled.add("lm_head.weight")
    missing = sorted(set(params) - filled)
    if missing:
        raise WeightLoadError(f"tensors missing from the checkpoint: {', '.join(missing[:8])}")


def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights with no files (`loadFormat: dummy`): normal(0, std), norm scales near 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                values = 1.0 + 0.1 * torch.randn(param.shape, generator=gen)
            else:
                values = torch.randn(param.shape, generator=gen) * std
            param.copy_(values)


def load_model(
    spec: ModelSpec,
    folder: str | Path | None,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    seed: int = 0,
) -> LlamaForCausalLM:
    model = build_model(spec, dtype, device)
    if load_format == "dummy" or folder is None:
        init_dummy_weights(model, seed=seed)
    else:
        load_hf_weights(model, folder)
    return model
