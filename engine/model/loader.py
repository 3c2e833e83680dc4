"""Builds a model and fills its weights: from an HF folder of safetensors (one file, or shards listed in
`model.safetensors.index.json`), or random (`loadFormat: dummy`, no files read).

HF tensor names are mapped onto the fused parameters: `q_proj`, `k_proj`, `v_proj` into `qkv_proj` and
`gate_proj`, `up_proj` into `gate_up_proj`, each at its offset along the output dimension. Under tensor parallel
each rank reads only its slice of each tensor (`TPLayout.hf_slice`, through safetensors' lazy slices), so no rank
holds the whole model in memory; random weights are drawn whole, in the same order as with one rank, and sliced
the same way, so a model split over ranks is the same model.

Mixture of experts: the per-expert HF tensors `mlp.experts.E.{gate_proj,up_proj,down_proj}.weight` (what the
published checkpoints and transformers' `save_pretrained` write) go into expert E of the fused `w13` (gate rows,
then up rows) and `w2`; transformers' in-memory fused layout `mlp.experts.gate_up_proj` (E, 2I, H) and
`mlp.experts.down_proj` (E, H, I) is read too. DeepSeek's `shared_experts` is our `shared_expert`.

DeepSeek-V2/V3 (`deepseek.py`): the attention tensors keep their HF names (`q_a_proj`, `q_a_layernorm`, `q_b_proj` or
`q_proj`, `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`), each rank reading its heads' rows or
columns; the tensors of the multi-token-prediction layer (`model.layers.{num_hidden_layers}.*`, in the V3/R1
releases) are skipped, since that layer is not served.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from npuserve.engine.model.base import CausalLM
from npuserve.engine.model.errors import WeightLoadError
from npuserve.engine.model.quant_loader import QuantLoader, dummy_tensors
from npuserve.engine.model.quantize import quantize_modules
from npuserve.engine.model.registry import model_class
from npuserve.engine.parallel.comm import SINGLE_RANK, TensorParallel
from npuserve.engine.parallel.layout import TPLayout
from npuserve.engine_contract import DTYPE_BYTES
from npuserve.modelspec import ModelSpec

__all__ = ["WeightLoadError", "build_model", "load_model"]

# The contract's dtype table, as torch dtypes.
TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_BYTES}


def build_model(spec: ModelSpec, dtype: torch.dtype, device: torch.device, layout: TPLayout | None = None,
                tp: TensorParallel = SINGLE_RANK) -> CausalLM:
    """An uninitialised model (this rank's slice of it) on `device` (parameters allocated, not filled). A quantized
    spec's int8 modules are swapped in on the meta device, before the cast (`quantize.py`)."""
    with torch.device("meta"):
        model = model_class(spec)(spec, layout, tp)
        quantize_modules(model, spec)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.finish_build(device)
    model.eval()
    model.requires_grad_(False)
    return model


# HF projection -> (fused parameter, which piece of it: 0 = q / gate, 1 = k / up, 2 = v)
_FUSED_PIECES: dict[str, tuple[str, int]] = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.shared_expert.gate_proj": ("mlp.shared_expert.gate_up_proj", 0),
    "mlp.shared_expert.up_proj": ("mlp.shared_expert.gate_up_proj", 1),
}
# a routed expert's HF tensor: (the experts module, expert index, projection)
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# transformers' fused in-memory layout: gate_up_proj (E, 2I, H), gate rows first; down_proj (E, H, I)
_FUSED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def _piece_offset(layout: TPLayout, fused: str, rows: int, piece: int) -> int:
    """Row offset of a piece inside this rank's fused parameter of `rows` rows (gate-up: two equal halves)."""
    if ".qkv_proj." in fused:
        return (0, layout.q_size, layout.q_size + layout.kv_size)[piece]
    return piece * (rows // 2)


def hf_name(name: str) -> str:
    """The name we read a checkpoint tensor under (DeepSeek's `shared_experts` is our `shared_expert`)."""
    return name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")


def _take(layout: TPLayout, name: str, tensor: Any) -> torch.Tensor:
    """This rank's slice of an HF tensor (`tensor`: a torch tensor or a safetensors lazy slice)."""
    if _FUSED_EXPERTS.match(name) and layout.world_size > 1:
        inter, start = layout.moe_intermediate, layout.rank * layout.moe_intermediate
        if name.endswith("gate_up_proj"):  # this rank's gate rows and its up rows, each a run of `inter`
            whole_inter = tensor.get_shape()[1] // 2 if not isinstance(tensor, torch.Tensor) else tensor.shape[1] // 2
            return torch.cat([tensor[:, start : start + inter], tensor[:, whole_inter + start : whole_inter + start
                                                                          + inter]], dim=1)
        fused: torch.Tensor = tensor[:, :, start : start + inter]
        return fused
    cut = layout.hf_slice(name) if layout.world_size > 1 else None
    if cut is None:
        whole: torch.Tensor = tensor if isinstance(tensor, torch.Tensor) else tensor[:]
        return whole
    dim, start, length = cut
    part: torch.Tensor = tensor[start : start + length] if dim == 0 else tensor[:, start : start + length]
    return part


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


def iterate_hf_tensors(folder: Path) -> Iterator[tuple[str, Any]]:
    """(name, lazy slice) of every tensor in the folder's safetensors files; reading happens when it is sliced."""
    from safetensors import safe_open

    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_slice(name)


def _load_expert(params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor,
                 fused_rows: dict[str, int]) -> bool:
    """A routed expert's tensor (this rank's slice) into its place in `w13` / `w2`; False: not an expert's."""
    match = _EXPERT.match(name)
    if match is None:
        return False
    experts, index, proj = match.group(1), int(match.group(2)), match.group(3)
    target = f"{experts}.{'w2' if proj == 'down_proj' else 'w13'}"
    param = params.get(target)
    if param is None or index >= param.shape[0]:
        raise WeightLoadError(f"unexpected tensor {name} in the checkpoint")
    dest = param[index]
    if proj != "down_proj":
        half = param.shape[1] // 2
        dest = dest[half:] if proj == "up_proj" else dest[:half]
    if tuple(dest.shape) != tuple(tensor.shape):
        raise WeightLoadError(f"{name}: shape {tuple(tensor.shape)}, model wants {tuple(dest.shape)}")
    with torch.no_grad():
        dest.copy_(tensor)
    fused_rows[target] = fused_rows.get(target, 0) + tensor.numel()
    return True


def _load_tensor(params: dict[str, nn.Parameter], layout: TPLayout, name: str, tensor: torch.Tensor,
                 filled: set[str], fused_rows: dict[str, int]) -> None:
    """Copies one HF tensor (already this rank's slice) into its parameter, or its piece of a fused one."""
    if _load_expert(params, name, tensor, fused_rows):
        return
    fused = _FUSED_EXPERTS.match(name)
    if fused is not None:  # transformers' fused layout: our w13 / w2 as they are
        name = f"{fused.group(1)}.{'w13' if fused.group(2) == 'gate_up_proj' else 'w2'}"
    target, piece = name, None
    for hf, (ours, index) in _FUSED_PIECES.items():
        if f".{hf}." in name and not (layout.mla_v_dim and hf.startswith("self_attn.")):  # MLA: names as in HF
            target, piece = name.replace(hf, ours), index
            break
    param = params.get(target)
    if param is None:
        raise WeightLoadError(f"unexpected tensor {name} in the checkpoint")
    with torch.no_grad():
        if piece is None:
            if name in ("model.embed_tokens.weight", "lm_head.weight") and tensor.shape[0] < param.shape[0]:
                param[tensor.shape[0]:].zero_()  # the last rank's padding rows of the vocabulary
                param = param[: tensor.shape[0]]  # type: ignore[assignment]
            if tuple(param.shape) != tuple(tensor.shape):
                raise WeightLoadError(f"{name}: shape {tuple(tensor.shape)}, model wants {tuple(param.shape)}")
            param.copy_(tensor)
            filled.add(target)
            return
        offset, rows = _piece_offset(layout, target, param.shape[0], piece), tensor.shape[0]
        if offset + rows > param.shape[0] or tuple(tensor.shape[1:]) != tuple(param.shape[1:]):
            raise WeightLoadError(f"{name}: shape {tuple(tensor.shape)} does not fit {target}")
        param[offset : offset + rows].copy_(tensor)
        fused_rows[target] = fused_rows.get(target, 0) + tensor.numel()


def _check_filled(model: CausalLM, params: dict[str, nn.Parameter], filled: set[str],
                  fused_rows: dict[str, int]) -> None:
    """`fused_rows`: the elements copied into each fused parameter piece by piece (full when all are there)."""
    for target, elements in fused_rows.items():
        if elements == params[target].numel():
            filled.add(target)
    if model.spec.tie_word_embeddings:
        filled.add("lm_head.weight")
    missing = sorted(set(params) - filled)
    if missing:
        hint = ""
        if any(name.endswith(".mlp.gate.e_score_correction_bias") for name in missing):
            # msModelSlim 26.1.0 saves parameters only, and transformers 4.57 keeps this router bias as a buffer
            hint = (" (msModelSlim's DeepSeek-V3/R1 output lacks the routers' e_score_correction_bias: copy those "
                    "tensors from the bf16 checkpoint; a zero bias would route differently)")
        raise WeightLoadError(f"tensors missing from the checkpoint: {', '.join(missing[:8])}{hint}")


def load_hf_weights(model: CausalLM, folder: str | Path) -> None:
    spec, layout = model.spec, model.layout
    params = dict(model.named_parameters(remove_duplicate=False))
    filled: set[str] = set()
    fused_rows: dict[str, int] = {}
    quant = QuantLoader(spec, layout) if spec.quantization is not None else None
    mtp_prefix = f"model.layers.{spec.num_layers}."
    for name, lazy in iterate_hf_tensors(Path(folder)):
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if spec.mla is not None and _is_mtp(name, spec.num_layers, mtp_prefix):
            continue  # DeepSeek's multi-token-prediction layer: not served
        if name == "lm_head.weight" and spec.tie_word_embeddings:
            continue
        name = hf_name(name)
        if quant is not None and quant.take(name, lazy):
            continue
        _load_tensor(params, layout, name, _take(layout, name, lazy), filled, fused_rows)
    if quant is not None:
        filled |= quant.finish(model)
    _check_filled(model, params, filled, fused_rows)


def _is_mtp(name: str, num_layers: int, prefix: str) -> bool:
    """A tensor of a layer past the last decoder layer (DeepSeek's MTP layers, `num_nextn_predict_layers`)."""
    if name.startswith(prefix):
        return True
    parts = name.split(".")
    return len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= num_layers


def _hf_pieces(name: str, value: torch.Tensor, spec: ModelSpec) -> list[tuple[str, torch.Tensor]]:
    """A whole parameter's value as the HF tensors it stands for (fused ones split, experts one by one)."""
    if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
        q, k, v = torch.split(value, [spec.q_size, spec.kv_size, spec.kv_size])
        return [(name.replace("qkv_proj", p), t) for p, t in (("q_proj", q), ("k_proj", k), ("v_proj", v))]
    if name.endswith("gate_up_proj.weight"):
        gate, up = value.chunk(2)
        return [(name.replace("gate_up_proj", "gate_proj"), gate), (name.replace("gate_up_proj", "up_proj"), up)]
    if name.endswith(".experts.w13"):
        base = name.removesuffix(".w13")
        return [(f"{base}.{e}.{proj}.weight", half) for e in range(value.shape[0])
                for proj, half in zip(("gate_proj", "up_proj"), value[e].chunk(2), strict=True)]
    if name.endswith(".experts.w2"):
        base = name.removesuffix(".w2")
        return [(f"{base}.{e}.down_proj.weight", value[e]) for e in range(value.shape[0])]
    return [(name, value)]


def _dummy_value(name: str, shape: tuple[int, ...], gen: torch.Generator, std: float) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    return torch.randn(shape, generator=gen) * std


def init_dummy_weights(model: CausalLM, seed: int = 0, std: float = 0.02) -> None:
    """Random weights with no files (`loadFormat: dummy`): normal(0, std), norm scales near 1. The whole model's
    values are drawn in one order whatever the ranks; each rank keeps its slice (a fused parameter's pieces are
    sliced as the HF tensors they stand for). A quantized spec: the same float values, quantized per channel into
    the scheme's tensors (`quant_loader.dummy_tensors`) and loaded as a checkpoint's are."""
    gen = torch.Generator().manual_seed(seed)
    layout, spec = model.layout, model.spec
    if layout.world_size == 1 and spec.quantization is None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(_dummy_value(name, tuple(param.shape), gen, std))
        return
    float_spec = spec.model_copy(update={"quantization": None})
    with torch.device("meta"):
        whole = model_class(float_spec)(float_spec)
    params = dict(model.named_parameters(remove_duplicate=False))
    filled: set[str] = set()
    fused_rows: dict[str, int] = {}
    quant = QuantLoader(spec, layout) if spec.quantization is not None else None
    for name, meta in whole.named_parameters():
        value = _dummy_value(name, tuple(meta.shape), gen, std)
        for piece_name, piece in _hf_pieces(name, value, spec):
            stored = dummy_tensors(piece_name, piece, spec) if quant is not None else [(piece_name, piece)]
            for hf, tensor in stored:
                if quant is not None and quant.take(hf, tensor):
                    continue
                _load_tensor(params, layout, hf, _take(layout, hf, tensor), filled, fused_rows)
    if quant is not None:
        filled |= quant.finish(model)
    _check_filled(model, params, filled, fused_rows)


def load_model(
    spec: ModelSpec,
    folder: str | Path | None,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    seed: int = 0,
    layout: TPLayout | None = None,
    tp: TensorParallel = SINGLE_RANK,
) -> CausalLM:
    model = build_model(spec, dtype, device, layout, tp)
    if load_format == "dummy" or folder is None:
        init_dummy_weights(model, seed=seed)
    else:
        load_hf_weights(model, folder)
    return model
