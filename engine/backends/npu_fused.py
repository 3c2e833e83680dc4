"""torch_npu's fused kernels swapped into a loaded model (`NPUBackend.prepare_model`): RMSNorm through
`npu_rms_norm`, neox RoPE through `npu_rotary_mul`, the MLP's SwiGLU through `npu_swiglu`. Signatures, formulas and
limits from Ascend's torch_npu API reference (op-plugin docs/context); their schemas are the same in every supported
op-plugin line (`op_plugin/config/op_plugin_functions.yaml`, 7.0.0 to 26.1.0)."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from npuserve.engine.model.layers import RMSNorm, RotaryEmbedding, silu_and_mul
from npuserve.engine.model.llama import MLP

log = logging.getLogger(__name__)


class FusedRMSNorm:
    """An `RMSNorm`'s forward through `torch_npu.npu_rms_norm(x, gamma, epsilon)`, which returns (y, 1/rms) and
    wants gamma in x's dtype; any other input takes the module's own eager forward."""

    def __init__(self, ops: Any, norm: RMSNorm) -> None:
        self.ops, self.norm = ops, norm
        self.eager = norm.forward  # the class's method, bound before the swap

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.norm.weight.dtype:
            return self.eager(x)
        y: torch.Tensor = self.ops.npu_rms_norm(x, self.norm.weight, epsilon=self.norm.eps)[0]
        return y


class FusedRotary:
    """A `RotaryEmbedding`'s forward through `torch_npu.npu_rotary_mul(x, cos, sin)` in its "half" mode (the neox
    rotate-half the model uses): `x * cos + cat(-x2, x1) * sin` over the full head, so the half-width tables are
    doubled (once per dtype). q and k go in as `(1, tokens, heads, head_dim)` (layout BSND) with cos and sin
    `(1, tokens, 1, head_dim)` (1S1D), one of the kernel's documented layout pairs."""

    def __init__(self, ops: Any, rotary: RotaryEmbedding) -> None:
        self.ops, self.rotary = ops, rotary
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def _table(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        found = self._tables.get(dtype)
        if found is None:
            cos, sin = (torch.cat([t, t], dim=-1).to(dtype) for t in (self.rotary.cos, self.rotary.sin))
            found = self._tables[dtype] = (cos, sin)
        return found

    def __call__(self, positions: torch.Tensor, q: torch.Tensor,
                 k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos_table, sin_table = self._table(q.dtype)
        tokens, dim = q.shape[0], q.shape[-1]
        cos = cos_table.index_select(0, positions).view(1, tokens, 1, dim)
        sin = sin_table.index_select(0, positions).view(1, tokens, 1, dim)
        q_out = self.ops.npu_rotary_mul(q.contiguous().unsqueeze(0), cos, sin).squeeze(0)
        k_out = self.ops.npu_rotary_mul(k.contiguous().unsqueeze(0), cos, sin).squeeze(0)
        return q_out, k_out


class FusedSwiGLU(nn.Module):
    """The MLP's `silu_and_mul` as one kernel: `torch_npu.npu_swiglu(x, dim=-1)` is `silu(A) * B` with A the first
    half of the last dimension, the gate in the fused gate-up projection. The kernel takes contiguous input only."""

    def __init__(self, ops: Any) -> None:
        super().__init__()
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.ops.npu_swiglu(x.contiguous(), dim=-1)
        return y


def swap_fused_kernels(ops: Any, model: nn.Module) -> None:
    """Swaps torch_npu's fused kernels into the model's leaf pieces, leaving every parameter, module and the
    collectives around them as they are: each `RMSNorm`'s and `RotaryEmbedding`'s forward (an instance
    attribute over the class's method), and each `MLP`'s `act_fn` hook when it holds `silu_and_mul`. Idempotent;
    a model without the hook keeps its eager SwiGLU."""
    swapped = {"rms_norm": 0, "rotary": 0, "swiglu": 0}
    for name, module in list(model.named_modules()):  # a list: swapping `act_fn` adds a submodule
        if isinstance(module, RMSNorm | RotaryEmbedding):
            if isinstance(module.__dict__.get("forward"), FusedRMSNorm | FusedRotary):
                continue
            if isinstance(module, RMSNorm):
                module.forward = FusedRMSNorm(ops, module)  # type: ignore[method-assign]
                swapped["rms_norm"] += 1
            else:
                module.forward = FusedRotary(ops, module)  # type: ignore[method-assign]
                swapped["rotary"] += 1
        elif isinstance(module, MLP):
            act = getattr(module, "act_fn", None)
            if act is silu_and_mul:
                setattr(module, "act_fn", FusedSwiGLU(ops))  # noqa: B010 (a hook mypy may not know)
                swapped["swiglu"] += 1
            elif not isinstance(act, FusedSwiGLU):
                log.debug("npu: %s keeps its eager SwiGLU: no `act_fn` hook holding silu_and_mul (found %r)",
                          name or "MLP", act)
    log.info("npu: fused kernels swapped in: %d RMSNorm, %d RoPE, %d SwiGLU", swapped["rms_norm"],
             swapped["rotary"], swapped["swiglu"])

