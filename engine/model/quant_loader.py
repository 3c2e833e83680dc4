"""Loads a W8A8 checkpoint's tensors into the int8 modules (`int8.py`), whichever tool wrote it.

What each format writes per int8 linear module `M` (HF name; both tools keep `M.weight` as the int8 matrix, rows =
output channels):
- msModelSlim (`quant_model_description.json`): `M.weight_scale` and `M.weight_offset` (out, 1) per row, the weight
  offset zero (symmetric; a non-zero one is refused); static W8A8 adds `M.input_scale`, `M.input_offset` (1,),
  `M.deq_scale` (out,) = input_scale * weight_scale (float32, or its float32 bits in an int64 for fp16 models:
  vllm-ascend `quantization/w8a8.py` `get_perchannel_param`) and `M.quant_bias` (out,) int32, which cancels the
  activation offset: `-input_offset * sum_k W_q[n, k]` (plus the float bias / deq_scale, rounded, if any: then the
  float `M.bias` is not added again, as vllm-ascend's static W8A8 ignores it).
- compressed-tensors (llm-compressor): `M.weight_scale` (out, 1); static W8A8 adds `M.input_scale` (1,), symmetric
  (no offset, no quant_bias).

Fused modules (qkv_proj, gate_up_proj) take their pieces' rows in order. Their static activation scales must come to
one per tensor: compressed-tensors' may differ and the largest is taken (vLLM's rule: the pieces' rows keep their own
weight scales, so the weights are unchanged); msModelSlim's scale and offset must be equal (the pieces quantize the
same input; a difference is refused).

Tensor parallel: column-parallel pieces (q/k/v, gate/up, q_b, the experts' gate/up) slice their per-row tensors as
their weight rows; row-parallel ones (o_proj, down_proj) slice the weight's input columns and keep the per-row scales
whole. The offset correction in a row-parallel `quant_bias` is added once, on rank 0, the other ranks adding none
(vllm-ascend's `quant_bias if tp_rank == 0 else None`): the ranks' int32 partial sums are dequantized with the same
per-row scale and all-reduced, so the whole row's correction counts once, as with one rank.

Routed experts (`Int8Experts`): `mlp.experts.E.{gate,up,down}_proj.{weight,weight_scale,weight_offset}`; static
scales a checkpoint may carry for them are read and not used (the experts quantize their activations per token).
DeepSeek's `kv_b_proj` is dequantized here (`weight * weight_scale`) into its float weight (`quantize.py` says why).

Random weights (`loadFormat: dummy`, `dummy_tensors`): the float values drawn as for the float model, quantized per
output channel (`scale = max |row| / 127`) and written out as the format's tensors, then loaded like a checkpoint.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from npuserve.engine.model.errors import WeightLoadError
from npuserve.engine.model.int8 import Int8Experts, Int8Linear
from npuserve.engine.model.quantize import hf_method, hf_pieces, is_dequantized
from npuserve.engine.parallel.layout import TPLayout
from npuserve.modelspec import ModelSpec
from npuserve.quantization import QuantMethod

log = logging.getLogger(__name__)

PER_ROW = ("weight_scale", "weight_offset", "deq_scale", "quant_bias")
PER_TENSOR = ("input_scale", "input_offset")
_QUANT_LEAVES = ("weight", *PER_ROW, *PER_TENSOR)
_EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")

# Random static weights: one input scale per layer by what feeds it (a normed hidden state, the attention output,
# the SwiGLU product), and msModelSlim's offset: fixed numbers, not a calibration.
DUMMY_INPUT_RANGE = {"o_proj": 1.0, "down_proj": 0.25}
DUMMY_NORMED_RANGE = 4.0
DUMMY_INPUT_OFFSET = 2.0
DEQ_SCALE_RTOL = 1e-2  # deq_scale against input_scale * weight_scale: the tools round the scales to bf16/fp16


def _whole(tensor: Any) -> torch.Tensor:
    whole: torch.Tensor = tensor if isinstance(tensor, torch.Tensor) else tensor[:]
    return whole


def _is_int8(tensor: Any) -> bool:
    if isinstance(tensor, torch.Tensor):
        return tensor.dtype == torch.int8
    return str(tensor.get_dtype()) == "I8"


def _dtype_name(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.") if isinstance(tensor, torch.Tensor) else str(tensor.get_dtype())


def deq_scale_values(deq: torch.Tensor) -> torch.Tensor:
    """msModelSlim's deq_scale as float32: an int64 one holds the float32's bits in its low 32 (fp16 models)."""
    if deq.dtype == torch.int64:
        return (deq & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
    return deq.float()


class QuantLoader:
    """Takes the quantization tensors of a checkpoint (this rank's slice) as they stream past, and writes them into
    the int8 modules at the end (`finish`), when every piece of a fused module is there."""

    def __init__(self, spec: ModelSpec, layout: TPLayout) -> None:
        assert spec.quantization is not None
        self.spec, self.layout, self.format = spec, layout, spec.quantization.format
        self.aux: dict[str, dict[str, torch.Tensor]] = {}  # HF module (loader naming) -> leaf -> this rank's slice
        self._static_experts_said = False

    def take(self, name: str, tensor: Any) -> bool:
        """True: `name` (loader naming, whole or lazy) was kept here. False: the usual path loads it (int8 and float
        weights, biases). Raises on a tensor the scheme does not allow."""
        module, _, leaf = name.rpartition(".")
        if leaf not in _QUANT_LEAVES:
            return False
        method = hf_method(self.spec, module)
        if method is None:
            if leaf != "weight":
                raise WeightLoadError(f"unexpected tensor {name} in the checkpoint: its scheme keeps {module} in float")
            if _is_int8(tensor):
                raise WeightLoadError(f"{name} is int8, but the checkpoint's scheme keeps {module} in float")
            return False
        if leaf == "weight" and not _is_int8(tensor):
            raise WeightLoadError(f"{name} is {_dtype_name(tensor)}, but the checkpoint's scheme stores {module} as "
                                  f"int8 ({method})")
        if leaf == "weight" and not is_dequantized(module, self.spec):
            return False
        self.aux.setdefault(module, {})[leaf] = self._slice(module, leaf, tensor)
        return True

    def _slice(self, module: str, leaf: str, tensor: Any) -> torch.Tensor:
        """This rank's part of a per-row or per-tensor tensor ((out, 1) and (out,) alike) or of a dequantized
        module's weight."""
        whole = _whole(tensor)
        if leaf != "weight":
            whole = whole.reshape(-1)
        if leaf in PER_TENSOR or self.layout.world_size == 1:
            return whole
        cut = self.layout.hf_slice(f"{module}.weight")
        if cut is None or cut[0] == 1:  # replicated, or row-parallel: its rows are whole on every rank
            return whole
        _, start, length = cut
        return whole[start : start + length]

    def _leaves(self, module: str, method: QuantMethod | None, expert: bool) -> dict[str, torch.Tensor]:
        """The module's tensors, the required ones checked and the offsets zero."""
        found = self.aux.pop(module, {})
        required = ["weight_scale"]
        allowed = {"weight_scale", "weight_offset"}
        if method == "w8a8":
            static = ["input_scale", "input_offset", "deq_scale", "quant_bias"] if self.format == "msmodelslim" \
                else ["input_scale"]
            allowed |= set(static)
            if not expert:
                required += static
        missing = [f"{module}.{leaf}" for leaf in required if leaf not in found]
        if missing:
            raise WeightLoadError(f"tensors missing from the checkpoint: {', '.join(missing)}")
        extra = sorted(set(found) - allowed)
        if extra:
            raise WeightLoadError(f"unexpected tensor {module}.{extra[0]} in the checkpoint ({method})")
        offset = found.get("weight_offset")
        if offset is not None and bool((offset.float() != 0).any()):
            raise WeightLoadError(f"{module}.weight_offset is not zero: asymmetric int8 weights are not supported "
                                  "(W8A8 weights are symmetric)")
        return found

    def finish(self, model: nn.Module) -> set[str]:
        """Writes the kept tensors into the int8 modules (and dequantized weights); returns the parameters filled."""
        filled: set[str] = set()
        with torch.no_grad():
            for name, module in model.named_modules():
                if isinstance(module, Int8Linear):
                    self._finish_linear(name, module)
                    filled |= {f"{name}.{p}" for p, _ in module.named_parameters() if p not in ("weight", "bias")}
                elif isinstance(module, Int8Experts):
                    self._finish_experts(name, module)
                    filled |= {f"{name}.w13_scale", f"{name}.w2_scale"}
                elif isinstance(module, nn.Linear) and is_dequantized(name, self.spec) \
                        and hf_method(self.spec, name) is not None:
                    self._finish_dequantized(name, module)
                    filled.add(f"{name}.weight")
        if self.aux:
            raise WeightLoadError(f"unexpected tensors in the checkpoint: {', '.join(sorted(self.aux)[:8])} "
                                  "(quantization tensors of no int8 module)")
        return filled

    def _finish_linear(self, name: str, layer: Int8Linear) -> None:
        pieces = hf_pieces(name)
        leaves = [self._leaves(piece, layer.method, expert=False) for piece in pieces]
        scale = torch.cat([found["weight_scale"].float() for found in leaves])
        if scale.shape != layer.weight_scale.shape:
            raise WeightLoadError(f"{name}: weight_scale of {scale.numel()} rows, model wants "
                                  f"{layer.weight_scale.numel()}")
        layer.weight_scale.copy_(scale)
        if layer.method != "w8a8":
            return
        assert layer.input_scale is not None and layer.input_offset is not None and layer.quant_bias is not None
        in_scales = [found["input_scale"].float().reshape(1) for found in leaves]
        if self.format == "compressed-tensors":
            layer.input_scale.copy_(torch.stack(in_scales).amax(dim=0))  # vLLM: the largest of the fused pieces'
            layer.input_offset.zero_()
            layer.quant_bias.zero_()
            return
        in_offsets = [found["input_offset"].float().reshape(1) for found in leaves]
        if any(not torch.equal(s, in_scales[0]) or not torch.equal(o, in_offsets[0])
               for s, o in zip(in_scales, in_offsets, strict=True)):
            described = ", ".join(f"{p}: scale {s.item():.6g} offset {o.item():g}"
                                  for p, s, o in zip(pieces, in_scales, in_offsets, strict=True))
            raise WeightLoadError(f"{name} fuses pieces with different input scales/offsets ({described}); they "
                                  "quantize the same input, so msModelSlim writes them equal")
        for piece, found in zip(pieces, leaves, strict=True):
            deq, want = deq_scale_values(found["deq_scale"]), in_scales[0] * found["weight_scale"].float()
            if deq.shape != want.shape or not torch.allclose(deq, want, rtol=DEQ_SCALE_RTOL, atol=0.0):
                raise WeightLoadError(f"{piece}.deq_scale is not input_scale * weight_scale (max relative error "
                                      f"{((deq - want).abs() / want.abs()).max().item():.3g})")
        # the dequantisation takes deq_scale, as vllm-ascend's npu_quant_matmul does: msModelSlim computes it in float32
        # before it rounds the two scales to the model's dtype, so it is the more exact (docs/quantization.md)
        layer.weight_scale.copy_(torch.cat([deq_scale_values(found["deq_scale"]) for found in leaves]) / in_scales[0])
        bias = torch.cat([found["quant_bias"].to(torch.int64) for found in leaves])
        if bias.shape != layer.quant_bias.shape:
            raise WeightLoadError(f"{name}: quant_bias of {bias.numel()} rows, model wants {layer.quant_bias.numel()}")
        if self._row_parallel(pieces[0]):
            if self.layout.rank != 0:
                bias.zero_()  # the whole row's offset correction is rank 0's (see the module's docstring)
        elif layer.bias is not None:
            # msModelSlim folds a float bias into quant_bias (round(bias / deq_scale)) beside the offset correction;
            # vllm-ascend's static W8A8 then ignores the float `bias` tensor. Where quant_bias carries more than the
            # correction, so do we (else the bias would count twice).
            offset = int(in_offsets[0].item())
            rest = bias + offset * layer.weight.to(torch.int64).sum(dim=1)
            if bool(rest.any()):
                layer.bias.zero_()
        layer.input_scale.copy_(in_scales[0])
        layer.input_offset.copy_(in_offsets[0])
        layer.quant_bias.copy_(bias.to(torch.int32))

    def _row_parallel(self, module: str) -> bool:
        cut = self.layout.hf_slice(f"{module}.weight") if self.layout.world_size > 1 else None
        return cut is not None and cut[0] == 1

    def _finish_experts(self, name: str, experts: Int8Experts) -> None:
        inter = experts.w2.shape[2]
        method = hf_method(self.spec, f"{name}.0.gate_proj")
        if method == "w8a8" and not self._static_experts_said:
            # the checkpoint's static activation scales of the experts are not used: said once per load, not
            # silently (vLLM refuses such int8 MoE layers; both tools' MoE recipes quantize experts per token)
            self._static_experts_said = True
            log.warning("%s (and the other MoE layers): the checkpoint declares static activation scales for its "
                        "experts; npuserve quantizes "
                        "the experts' activations per token (docs/engine.md, Quantized weights)", name)
        for e in range(experts.w13.shape[0]):
            found = {proj: self._leaves(f"{name}.{e}.{proj}", method, expert=True)["weight_scale"].float()
                     for proj in _EXPERT_PROJS}
            for proj, dest in (("gate_proj", experts.w13_scale[e, :inter]), ("up_proj", experts.w13_scale[e, inter:]),
                               ("down_proj", experts.w2_scale[e])):
                if found[proj].shape != dest.shape:
                    raise WeightLoadError(f"{name}.{e}.{proj}.weight_scale: {found[proj].numel()} rows, model wants "
                                          f"{dest.numel()}")
                dest.copy_(found[proj])

    def _finish_dequantized(self, name: str, linear: nn.Linear) -> None:
        found = self.aux.get(name, {})
        if "weight" not in found:
            raise WeightLoadError(f"tensors missing from the checkpoint: {name}.weight")
        weight = found.pop("weight")
        scale = self._leaves(name, hf_method(self.spec, name), expert=True)["weight_scale"].float()
        if tuple(weight.shape) != tuple(linear.weight.shape) or scale.numel() != weight.shape[0]:
            raise WeightLoadError(f"{name}: int8 weight {tuple(weight.shape)} with {scale.numel()} scales, model "
                                  f"wants {tuple(linear.weight.shape)}")
        linear.weight.copy_(weight.float() * scale.unsqueeze(1))


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: (W_q int8, scale (out,) float32) with W ~ W_q * scale."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127
    return torch.round(w / scale.unsqueeze(1)).clamp(-128, 127).to(torch.int8), scale


def dummy_tensors(name: str, value: torch.Tensor, spec: ModelSpec) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors the scheme's format would store for the float tensor `name` (loader naming): itself when
    float, else the int8 weight and its scales (static: the fixed input scale and offset of `DUMMY_INPUT_RANGE`)."""
    module, _, leaf = name.rpartition(".")
    method = hf_method(spec, module)
    if leaf != "weight" or method is None:
        return [(name, value)]
    assert spec.quantization is not None
    fmt = spec.quantization.format
    w_q, scale = quantize_per_channel(value)
    out = [(name, w_q), (f"{module}.weight_scale", scale.unsqueeze(1))]
    if fmt == "msmodelslim":
        out.append((f"{module}.weight_offset", torch.zeros_like(scale).unsqueeze(1)))
    if method == "w8a8" and ".mlp.experts." not in module:
        kind = module.rsplit(".", 1)[-1]
        input_scale = torch.tensor([DUMMY_INPUT_RANGE.get(kind, DUMMY_NORMED_RANGE) / 127], dtype=torch.float32)
        out.append((f"{module}.input_scale", input_scale))
        if fmt == "msmodelslim":
            offset = torch.tensor([DUMMY_INPUT_OFFSET])
            out += [(f"{module}.input_offset", offset), (f"{module}.deq_scale", input_scale * scale),
                    (f"{module}.quant_bias", (-DUMMY_INPUT_OFFSET * w_q.to(torch.int64).sum(dim=1)).to(torch.int32))]
    return out
