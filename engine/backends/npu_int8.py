"""The npu backend's int8 (W8A8) layers: `Int8Linear` and `Int8Experts` (engine/model/int8.py) through the ops
vllm-ascend runs for msModelSlim's W8A8 / W8A8_DYNAMIC and compressed-tensors' int8 schemes. docs/engine.md ("Int8
ops on Ascend") has the signatures, the line each appeared in and the dtype table each call stays inside.

- static (`w8a8`), as vllm-ascend `vllm_ascend/quantization/w8a8.py` (AscendW8A8LinearMethod):
  `npu_quantize(x, 1 / input_scale, input_offset, torch.qint8, -1, False)` (both repeated to K, as its
  process_weights_after_loading does), then `npu_quant_matmul(x_q, W (K, N), deq_scale, bias=quant_bias,
  output_dtype=dtype)` with `deq_scale = input_scale * weight_scale` (N,): float32 for a bfloat16 output, the int64
  of `npu_trans_quant_param` for float16 (msModelSlim writes deq_scale so, float32 for bf16 and int64 for fp16; the
  op's table takes float32 or bfloat16 scales for a bf16 output, int64 or float32 for fp16). The op takes one bias:
  the int32 quant_bias; a float bias (Qwen2's qkv) is added after, in float32.
- dynamic (`w8a8_dynamic`), as `w8a8_dynamic.py` (AscendW8A8DynamicLinearMethod): `npu_dynamic_quant(x)` -> (x_q,
  per-token scale), then `npu_quant_matmul(x_q, W (K, N), weight_scale float32, pertoken_scale=..., bias=float32
  bias, output_dtype=dtype)` (a float bias comes after the scales).
- experts, as `w8a8_dynamic.py`'s unfused `apply_mlp`: the float path's routing (`npu_moe_init_routing_v2`,
  quant_mode -1), `npu_dynamic_quant` of the sorted rows, `npu_grouped_matmul(x=[x_q], weight=[w13 (E, H, 2I)],
  scale=[w13_scale (E, 2I)], per_token_scale=[s], output_dtype=dtype)`, `npu_swiglu`, `npu_dynamic_quant`, the same
  for w2, and the float path's combine. The grouped matmul's table: scale bfloat16 for a bf16 output, float32 for
  fp16 (with per_token_scale float32).

`NPUInt8.prepare` (the backend's `prepare_model`, once after load) re-stores each int8 weight so that its memory is
the transposed (K, N) layout the kernels take while its shape stays the module's (as `npu_moe.lay_out_experts`), and
makes the per-dtype scales; a layer met at another dtype gets its scales then (logged once). Not done: the
FRACTAL_NZ cast (`npu_format_cast`, vllm-ascend's `is_enable_nz`), a layout the fake cannot check; the fused
`npu_dequant_swiglu_quant` / `npu_grouped_matmul_swiglu_quant` and init_routing's quant_mode 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from npuserve.engine.backends import int8_reference
from npuserve.engine.backends.base import BackendUnavailableError
from npuserve.engine.backends.npu_moe import NPUMoE
from npuserve.engine.backends.npu_stack import NPUStack
from npuserve.engine.model.int8 import Int8Experts, Int8Linear


@dataclass(frozen=True)
class LinearScales:
    """One Int8Linear's scales for one output dtype. static: `reciprocal` and `offset` (K,) float32, `deq_scale`
    (N,) float32 or int64; dynamic: `weight_scale` (N,) float32. `bias`: the float bias as float32, or None."""

    reciprocal: torch.Tensor | None
    offset: torch.Tensor | None
    deq_scale: torch.Tensor | None
    weight_scale: torch.Tensor | None
    bias: torch.Tensor | None


def kn_layout(param: nn.Parameter) -> bool:
    """Re-stores an (.., N, K) weight as the transposed view of a contiguous (.., K, N) tensor (shape and values
    unchanged). False if it already was."""
    if param.transpose(-2, -1).is_contiguous():
        return False
    param.data = param.data.transpose(-2, -1).contiguous().transpose(-2, -1)
    return True


def model_dtype(model: nn.Module) -> torch.dtype | None:
    """The 16-bit dtype the model runs in (that of its first float16/bfloat16 parameter), or None."""
    return next((p.dtype for p in model.parameters() if p.dtype in (torch.float16, torch.bfloat16)), None)


class NPUInt8:
    """The int8 ops of one stack (`ops`: the torch_npu module); scales per (module, dtype)."""

    def __init__(self, ops: Any, stack: NPUStack, moe: NPUMoE) -> None:
        self._ops, self.stack, self._moe = ops, stack, moe
        self._linear: dict[tuple[object, torch.dtype], LinearScales] = {}
        self._experts: dict[tuple[object, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def require(self, *, linear: bool, experts: bool) -> None:
        missing = self.stack.missing_int8(linear=linear, experts=experts)
        if missing:
            raise BackendUnavailableError(
                f"{self.stack.describe()} lacks {', '.join(missing)}, which the npu backend's int8 (W8A8) layers "
                "call (every supported line, op-plugin 7.0.0 on, has them)")

    def prepare(self, model: nn.Module) -> tuple[int, int]:
        """Lays out every int8 weight (K, N) and makes its scales for the model's dtype; (linears, experts)."""
        linears = [m for m in model.modules() if isinstance(m, Int8Linear)]
        experts = [m for m in model.modules() if isinstance(m, Int8Experts)]
        if not linears and not experts:
            return 0, 0
        self.require(linear=bool(linears), experts=bool(experts))
        dtype = model_dtype(model)
        for layer in linears:
            kn_layout(layer.weight)
            if dtype is not None:
                self._linear_scales(layer, dtype)
        for module in experts:
            kn_layout(module.w13)
            kn_layout(module.w2)
            if dtype is not None:
                self._expert_scales(module, dtype)
        return len(linears), len(experts)

    # --- scales -----------------------------------------------------------------------------------------------------

    def _linear_scales(self, layer: int8_reference.Int8Linear, dtype: torch.dtype) -> LinearScales:
        found = self._linear.get((layer, dtype))
        if found is not None:
            return found
        bias = None if layer.bias is None else layer.bias.detach().float()
        weight_scale = layer.weight_scale.detach().float().reshape(-1)
        if layer.method == "w8a8":
            assert layer.input_scale is not None and layer.input_offset is not None
            k = layer.in_features
            input_scale = layer.input_scale.detach().float().reshape(1)
            deq = (input_scale * weight_scale).contiguous()
            # fp16 out: the int64 form, as msModelSlim writes deq_scale for fp16 and the op's example prepares it
            deq_scale = self._ops.npu_trans_quant_param(deq) if dtype == torch.float16 else deq
            found = LinearScales(reciprocal=(1.0 / input_scale).repeat(k).contiguous(),
                                 offset=layer.input_offset.detach().float().reshape(1).repeat(k).contiguous(),
                                 deq_scale=deq_scale, weight_scale=None, bias=bias)
        else:
            found = LinearScales(reciprocal=None, offset=None, deq_scale=None, weight_scale=weight_scale.contiguous(),
                                 bias=bias)
        self._linear[(layer, dtype)] = found
        return found

    def _expert_scales(self, experts: int8_reference.Int8Experts,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        found = self._experts.get((experts, dtype))
        if found is None:
            # the grouped matmul's table: bfloat16 scales for a bf16 output, float32 for fp16
            scale_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
            found = (experts.w13_scale.detach().to(scale_dtype).contiguous(),
                     experts.w2_scale.detach().to(scale_dtype).contiguous())
            self._experts[(experts, dtype)] = found
        return found

    def _kn(self, w: torch.Tensor, name: str) -> torch.Tensor:
        t = w.transpose(-2, -1)
        if not t.is_contiguous():
            self._moe.warn_once("int8 %s is not laid out (K, N) by prepare_model: transposed at every call", name)
            t = t.contiguous()
        return t

    # --- the layers -------------------------------------------------------------------------------------------------

    def linear(self, x: torch.Tensor, layer: int8_reference.Int8Linear) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        rows = x.reshape(-1, shape[-1]).contiguous()
        scales = self._linear_scales(layer, dtype)
        weight = self._kn(layer.weight, "linear weight")
        if layer.method == "w8a8":
            x_q = self._ops.npu_quantize(rows, scales.reciprocal, scales.offset, torch.qint8, -1, False)
            out: torch.Tensor = self._ops.npu_quant_matmul(x_q, weight, scales.deq_scale, bias=layer.quant_bias,
                                                           output_dtype=dtype)
            if scales.bias is not None:
                out = (out.float() + scales.bias).to(dtype)
        else:
            x_q, token_scale = self._ops.npu_dynamic_quant(rows)
            out = self._ops.npu_quant_matmul(x_q, weight, scales.weight_scale, pertoken_scale=token_scale,
                                             bias=scales.bias, output_dtype=dtype)
        return out.reshape(*shape[:-1], layer.out_features)

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                experts: int8_reference.Int8Experts) -> torch.Tensor:
        dtype = x.dtype
        w13_scale, w2_scale = self._expert_scales(experts, dtype)
        routed = self._moe.route(x, ids, experts.w13.shape[0])
        x_q, s = self._ops.npu_dynamic_quant(routed.rows)
        h = self._ops.npu_grouped_matmul(
            x=[x_q], weight=[self._kn(experts.w13, "w13")], scale=[w13_scale], per_token_scale=[s],
            group_list=routed.counts, split_item=2, group_type=0, group_list_type=1, output_dtype=dtype)[0]
        act = self._ops.npu_swiglu(h.contiguous(), dim=-1)
        a_q, s2 = self._ops.npu_dynamic_quant(act)
        out = self._ops.npu_grouped_matmul(
            x=[a_q], weight=[self._kn(experts.w2, "w2")], scale=[w2_scale], per_token_scale=[s2],
            group_list=routed.counts, split_item=2, group_type=0, group_list_type=1, output_dtype=dtype)[0]
        return self._moe.combine(out, weights, routed)
