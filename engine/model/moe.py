"""The mixture-of-experts block, shared by the MoE families (Qwen2/3-MoE here; DeepSeek reuses it).

route (the replicated router, then `Backend.moe_select_experts`) -> the routed experts (`Backend.moe_experts`
over the fused `w13`/`w2`) -> + the shared expert (Qwen2-MoE: times a sigmoid gate) -> one tensor-parallel
all-reduce. Under tensor parallel each rank holds every expert's slice of the intermediate rows (`TPLayout`), so
both the routed and the shared outputs are partial sums until that one all-reduce. An int8 checkpoint's routed
experts (`Int8Experts`) go through `Backend.moe_experts_int8` instead.
"""

from __future__ import annotations

import torch
from torch import nn

from npuserve.engine.backends.base import Backend
from npuserve.engine.model.int8 import Int8Experts
from npuserve.engine.model.layers import silu_and_mul
from npuserve.engine.parallel.comm import TensorParallel
from npuserve.engine.parallel.layout import TPLayout
from npuserve.modelspec import ModelSpec


class Router(nn.Module):
    """The gate: hidden -> one logit per routed expert (HF `mlp.gate.weight`), replicated on every rank. DeepSeek-V3
    adds `e_score_correction_bias` (HF `mlp.gate.e_score_correction_bias`), used for the choice only."""

    def __init__(self, spec: ModelSpec, float32_logits: bool = False) -> None:
        super().__init__()
        assert spec.moe is not None
        self.weight = nn.Parameter(torch.empty(spec.moe.num_experts, spec.hidden_size))
        self.e_score_correction_bias = (nn.Parameter(torch.empty(spec.moe.num_experts), requires_grad=False)
                                        if spec.moe.e_score_correction_bias else None)
        # DeepSeek's routers compute the logits in float32; Qwen's in the model's dtype
        self.float32_logits = float32_logits

    def keep_float32(self) -> None:
        """DeepSeek's router weight and bias stay float32 whatever the model's dtype (transformers'
        `_keep_in_fp32_modules_strict`); called after the model is cast and allocated, before it is filled."""
        if self.float32_logits:
            self.weight = nn.Parameter(self.weight.float(), requires_grad=False)
        if self.e_score_correction_bias is not None:
            self.e_score_correction_bias = nn.Parameter(self.e_score_correction_bias.float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.float32_logits:
            return nn.functional.linear(x.float(), self.weight.float())
        return nn.functional.linear(x, self.weight)


class FusedExperts(nn.Module):
    """Every routed expert's weights in two tensors: `w13` (E, 2*I, H), each expert's gate rows then its up rows,
    and `w2` (E, H, I); I is this rank's slice of moe_intermediate_size."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate: int) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate))


class GatedMLP(nn.Module):
    """A SwiGLU MLP whose output is this rank's partial sum (the block all-reduces): the shared expert."""

    def __init__(self, hidden_size: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(silu_and_mul(self.gate_up_proj(x)))
        return out


class SparseMoeBlock(nn.Module):
    """One MoE layer's MLP. `float32_router`: DeepSeek's float32 router logits and weights; otherwise (Qwen) the
    logits are in the model's dtype and the weights are rounded to it, as transformers does."""

    def __init__(self, spec: ModelSpec, layout: TPLayout, tp: TensorParallel, float32_router: bool = False) -> None:
        super().__init__()
        assert spec.moe is not None, "an MoE block needs the spec's moe fields"
        self.moe = spec.moe
        self.gate = Router(spec, float32_logits=float32_router)
        # an int8 checkpoint's experts: `Int8Experts`, swapped in by `quantize.quantize_modules`
        self.experts: FusedExperts | Int8Experts = FusedExperts(spec.moe.num_experts, spec.hidden_size,
                                                                layout.moe_intermediate)
        self.shared_expert = (GatedMLP(spec.hidden_size, layout.shared_intermediate)
                              if spec.moe.shared_expert_intermediate_size else None)
        self.shared_expert_gate = (nn.Linear(spec.hidden_size, 1, bias=False)
                                   if spec.moe.shared_expert_gate and self.shared_expert is not None else None)
        self.tp = tp
        self.float32_router = float32_router
        self.backend: Backend | None = None  # bound by the runner (`CausalLM.bind_backend`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.backend is not None, "the runner binds the backend first"
        logits = self.gate(x)
        weights, ids = self.backend.moe_select_experts(logits, self.moe, self.gate.e_score_correction_bias)
        if not self.float32_router and logits.dtype != torch.float32:
            weights = weights.to(logits.dtype).float()  # transformers' Qwen routers hand the experts these values
        if isinstance(self.experts, Int8Experts):
            out = self.backend.moe_experts_int8(x, weights, ids, self.experts)
        else:
            out = self.backend.moe_experts(x, weights, ids, self.experts.w13, self.experts.w2)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return self.tp.all_reduce(out)
