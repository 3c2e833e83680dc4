"""The torch reference of the int8 (W8A8) ops (`Backend.int8_linear`, `Backend.moe_experts_int8`): the schemes'
math step for step (`engine/model/int8.py` writes it out), the product in int32 (`torch._int_mm`, exact), the
dequantisation in float32. The CPU runs it; a device backend overrides it with its kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

INT8_MAX = 127


class Int8Linear(Protocol):
    """What the ops read of an int8 linear layer (`engine/model/int8.py`'s `Int8Linear`; a protocol, so the
    backends' interface does not import the model's modules)."""

    @property
    def method(self) -> str: ...
    @property
    def in_features(self) -> int: ...
    @property
    def out_features(self) -> int: ...
    @property
    def weight(self) -> torch.Tensor: ...
    @property
    def weight_scale(self) -> torch.Tensor: ...
    @property
    def input_scale(self) -> torch.Tensor | None: ...
    @property
    def input_offset(self) -> torch.Tensor | None: ...
    @property
    def quant_bias(self) -> torch.Tensor | None: ...
    @property
    def bias(self) -> torch.Tensor | None: ...


class Int8Experts(Protocol):
    """What the ops read of int8 routed experts (`engine/model/int8.py`'s `Int8Experts`)."""

    @property
    def w13(self) -> torch.Tensor: ...
    @property
    def w2(self) -> torch.Tensor: ...
    @property
    def w13_scale(self) -> torch.Tensor: ...
    @property
    def w2_scale(self) -> torch.Tensor: ...

# `x_q (T, K) int8 . w_q (N, K)^T` -> (T, N) int32, exactly: `int32_matmul`, or a device's (cuda.py)
Int32Matmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def quantize_static(x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """`clamp(round(x / scale) + offset, -128, 127)` as int8; round half to even, as the cards' round does."""
    # a 16-bit x / a float32 scale with a dimension is float32 (a 0-dim scale would keep x's dtype): the division
    # makes the one new tensor, without a float32 copy of x first; the rest in place
    q = torch.div(x, scale.float().reshape(-1))
    return q.round_().add_(offset).clamp_(-128, 127).to(torch.int8)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: `s = max |x| / 127` (a zero row gets s = 1), `x_q = round(x / s)`. Returns (x_q int8, s (T,)
    float32)."""
    # max |x| in x's dtype (exact), then float32 as the scale is; not torch.aminmax: 10x slower on bf16 rows here
    scale = x.abs().amax(dim=-1).float().div_(INT8_MAX)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.div(x, scale.unsqueeze(-1))  # float32 whatever x's dtype: a new tensor, rounded and clamped in place
    return q.round_().clamp_(-128, 127).to(torch.int8), scale


def int_mm_takes(k: int, n: int) -> bool:
    """Whether `torch._int_mm` is trusted with a (., k) x (k, n) product: K and N multiples of 8 (CUDA's kernel
    wants them; torch 2.11's CPU kernel returned wrong values, not an error, for a K = 1 product)."""
    return k % 8 == 0 and n % 8 == 0


def int32_matmul(x_q: torch.Tensor, w_q: torch.Tensor) -> torch.Tensor:
    """`x_q (T, K) . w_q (N, K)^T` in int32, exactly: `torch._int_mm` where `int_mm_takes` the shape (every real
    model's), else int64 accumulation (tiny test models)."""
    if int_mm_takes(x_q.shape[1], w_q.shape[0]):
        return torch._int_mm(x_q.contiguous(), w_q.t())
    return (x_q.to(torch.int64) @ w_q.t().to(torch.int64)).to(torch.int32)


def dequantize(acc: torch.Tensor, token_scale: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """`acc (T, N) int32 * s_t * weight_scale[n]` in float32: the int32 -> float32 cast inside the first multiply,
    the second in place (one (T, N) float32 tensor, not three)."""
    return torch.mul(acc, token_scale.unsqueeze(-1)).mul_(weight_scale)


def int8_linear(x: torch.Tensor, layer: Int8Linear, matmul: Int32Matmul = int32_matmul) -> torch.Tensor:
    """`Backend.int8_linear`'s reference: x (..., K) in the model's dtype -> (..., N) in x's dtype. `matmul`: the
    int32 product (a device's own; the rest of the math stays this one)."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    if layer.method == "w8a8":
        assert layer.input_scale is not None and layer.input_offset is not None and layer.quant_bias is not None
        x_q = quantize_static(rows, layer.input_scale, layer.input_offset)
        acc = matmul(x_q, layer.weight).add_(layer.quant_bias)
        y = torch.mul(acc, layer.input_scale * layer.weight_scale)  # int32 x float32: the cast in the multiply
    else:
        x_q, token_scale = quantize_per_token(rows)
        y = dequantize(matmul(x_q, layer.weight), token_scale, layer.weight_scale)
    if layer.bias is not None:
        y = y.add_(layer.bias)
    return y.to(x.dtype).reshape(*shape[:-1], layer.out_features)


def int8_expert(rows: torch.Tensor, experts: Int8Experts, expert: int,
                matmul: Int32Matmul = int32_matmul) -> torch.Tensor:
    """One routed expert over its rows: both matmuls with per-token dynamic activations, SwiGLU in float32."""
    x_q, s = quantize_per_token(rows)
    h = dequantize(matmul(x_q, experts.w13[expert]), s, experts.w13_scale[expert])
    inter = experts.w2.shape[2]
    act = F.silu(h[:, :inter]) * h[:, inter:]
    a_q, s2 = quantize_per_token(act)
    out = dequantize(matmul(a_q, experts.w2[expert]), s2, experts.w2_scale[expert])
    return out.to(rows.dtype)
