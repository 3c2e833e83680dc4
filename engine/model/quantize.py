"""Which modules of a model are int8, and the one place they become so: `quantize_modules` swaps them in on the
meta device, before the model is cast and allocated (`loader.build_model`).

The scheme (`npuserve/quantization.py`) speaks of HF module names; ours fuse some of them: `qkv_proj` is
`q_proj`/`k_proj`/`v_proj`, `gate_up_proj` is `gate_proj`/`up_proj`, and `mlp.experts` holds every routed expert's
`gate_proj`/`up_proj`/`down_proj`. A fused module is int8 when all its pieces are, with one method; pieces that
disagree are refused (`WeightLoadError` naming them), since one kernel runs the whole fused matmul.

DeepSeek's `kv_b_proj` stays a float `nn.Linear` even when the checkpoint quantizes it: latent attention uses its
weight as two views (W_UK, W_UV, absorbed into the query and the output, `mla.py`), not as a matmul of its input,
so the loader dequantizes it (`weight * weight_scale`) into the model's dtype.
"""

from __future__ import annotations

import re

from torch import nn

from npuserve.engine.model.errors import WeightLoadError
from npuserve.engine.model.int8 import Int8Experts, Int8Linear
from npuserve.engine.model.moe import FusedExperts
from npuserve.modelspec import ModelSpec
from npuserve.quantization import QuantMethod

# our fused module -> the HF modules it stands for
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")
# the decoder layers' linear projections, as the HF checkpoints name them (the router `mlp.gate` and
# `shared_expert_gate` are linear too but never int8: `standard_module_method`)
LINEAR_LEAVES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "q_a_proj",
                           "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "gate", "shared_expert_gate"})
_LAYER = re.compile(r"^model\.layers\.\d+\.")


def scheme_module(spec: ModelSpec, module: str) -> str:
    """The HF name the scheme knows a module by, from the name the loader reads it under (`loader.hf_name` turns
    DeepSeek's `shared_experts` into our `shared_expert`; its description file keeps the HF one)."""
    if spec.mla is not None:
        return module.replace(".mlp.shared_expert.", ".mlp.shared_experts.")
    return module


def hf_method(spec: ModelSpec, module: str) -> QuantMethod | None:
    """How the checkpoint stores the HF module `module` (loader naming): a method, or None (float; every module
    that is not a decoder layer's linear projection, e.g. a norm)."""
    if spec.quantization is None or module.rsplit(".", 1)[-1] not in LINEAR_LEAVES:
        return None
    return spec.quantization.module_method(scheme_module(spec, module))


def is_dequantized(module: str, spec: ModelSpec) -> bool:
    """A module the checkpoint may store int8 that we keep float (DeepSeek's kv_b_proj, a weight view)."""
    return spec.mla is not None and module.endswith(".self_attn.kv_b_proj")


def hf_pieces(name: str) -> list[str]:
    """The HF modules of our module `name` (a fused one: its pieces, in row order)."""
    parent, _, leaf = name.rpartition(".")
    return [f"{parent}.{piece}" for piece in _FUSED[leaf]] if leaf in _FUSED else [name]


def _one_method(spec: ModelSpec, ours: str, pieces: list[str]) -> QuantMethod | None:
    methods = {piece: hf_method(spec, piece) for piece in pieces}
    if len(set(methods.values())) > 1:
        described = ", ".join(f"{scheme_module(spec, p)}: {m or 'float'}" for p, m in methods.items())
        raise WeightLoadError(f"{ours} fuses modules the checkpoint stores differently ({described}); the pieces "
                              "of a fused module must all be int8 with one method, or all float")
    return next(iter(methods.values()))


def quantize_modules(model: nn.Module, spec: ModelSpec) -> int:
    """Swaps the int8 modules in (on the meta device: nothing is allocated); returns how many. A no-op without a
    scheme."""
    if spec.quantization is None:
        return 0
    swaps: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not _LAYER.match(name):
            continue
        if isinstance(module, nn.Linear) and not is_dequantized(name, spec):
            method = _one_method(spec, name, hf_pieces(name))
            if method is not None:
                swaps.append((name, Int8Linear(module.in_features, module.out_features, module.bias is not None,
                                               method)))
        elif isinstance(module, FusedExperts):
            experts, inter, hidden = module.w13.shape[0], module.w2.shape[2], module.w2.shape[1]
            pieces = [f"{name}.{e}.{proj}" for e in range(experts) for proj in _EXPERT_PROJS]
            # Both tools write the routed experts as dynamic (per-token) int8; a static scale in the checkpoint is
            # read and not used: the experts' activations are quantized per token (Int8Experts).
            if _one_method(spec, name, pieces) is not None:
                swaps.append((name, Int8Experts(experts, hidden, inter)))
    for name, new in swaps:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
    return len(swaps)
