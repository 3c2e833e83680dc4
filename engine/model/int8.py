"""Int8 (W8A8) linear layers and routed experts: the weight layout a quantized checkpoint loads into
(`npuserve/quantization.py` says which modules), whatever the format it came in. The math is written out once, in
`backends/int8_reference.py`; a backend's `int8_linear` / `moe_experts_int8` run it with the device's kernels.

An `Int8Linear` computes `y = dequant(q(x) . W_q^T) + bias`:
- `w8a8` (static): `x_q = clamp(round(x / input_scale) + input_offset, -128, 127)` with one scale and offset per
  tensor found at calibration; `acc = x_q . W_q^T + quant_bias` in int32 (`quant_bias[n]`: msModelSlim's, which
  cancels the offset, `-input_offset * sum_k W_q[n, k]`, and may carry a rounded float bias; 0 for
  compressed-tensors); `y = acc * input_scale * weight_scale[n]`.
- `w8a8_dynamic`: per token `s_t = max_k |x[t, k]| / 127`, `x_q = round(x / s_t)`; `acc = x_q . W_q^T` in int32;
  `y = acc * s_t * weight_scale[n]`.
Weights are symmetric (no weight offset: a checkpoint with a non-zero one is refused at load).

`Int8Experts` holds every routed expert's int8 `w13` `(E, 2I, H)` and `w2` `(E, H, I)` with per-row scales
`w13_scale` `(E, 2I)` and `w2_scale` `(E, H)`; the activations are quantized per token (both tools write MoE
experts as W8A8_DYNAMIC / dynamic int8).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from npuserve.quantization import QuantMethod

if TYPE_CHECKING:
    from npuserve.engine.backends.base import Backend


def _frozen(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class Int8Linear(nn.Module):
    """A linear layer stored as int8 weights with float32 scales (`weight_scale` per output row; `input_scale`,
    `input_offset` per tensor for `w8a8`). `bias`: the float bias in the model's dtype (Qwen2's qkv), or None."""

    def __init__(self, in_features: int, out_features: int, bias: bool, method: QuantMethod) -> None:
        super().__init__()
        self.in_features, self.out_features, self.method = in_features, out_features, method
        self.weight = _frozen((out_features, in_features), torch.int8)
        self.weight_scale = _frozen((out_features,), torch.float32)
        self.input_scale: nn.Parameter | None = None
        self.input_offset: nn.Parameter | None = None
        self.quant_bias: nn.Parameter | None = None
        if method == "w8a8":
            self.input_scale = _frozen((1,), torch.float32)
            self.input_offset = _frozen((1,), torch.float32)
            self.quant_bias = _frozen((out_features,), torch.int32)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.backend: Backend | None = None  # bound by the runner (`CausalLM.bind_backend`)

    def keep_float32(self) -> None:
        """The scales stay float32 whatever the model's dtype (called after the model is cast and allocated)."""
        for name in ("weight_scale", "input_scale", "input_offset"):
            value = getattr(self, name)
            if value is not None and value.dtype != torch.float32:
                setattr(self, name, nn.Parameter(value.float(), requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.backend is not None, "the runner binds the backend first"
        return self.backend.int8_linear(x, self)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, method={self.method}"


class Int8Experts(nn.Module):
    """Every routed expert as int8, activations quantized per token: `w13` (E, 2I, H) gate rows then up rows, `w2`
    (E, H, I), their float32 per-row scales `w13_scale` (E, 2I) and `w2_scale` (E, H). I: this rank's slice."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate: int) -> None:
        super().__init__()
        self.w13 = _frozen((num_experts, 2 * intermediate, hidden_size), torch.int8)
        self.w2 = _frozen((num_experts, hidden_size, intermediate), torch.int8)
        self.w13_scale = _frozen((num_experts, 2 * intermediate), torch.float32)
        self.w2_scale = _frozen((num_experts, hidden_size), torch.float32)

    def keep_float32(self) -> None:
        for name in ("w13_scale", "w2_scale"):
            value = getattr(self, name)
            if value.dtype != torch.float32:
                setattr(self, name, nn.Parameter(value.float(), requires_grad=False))
