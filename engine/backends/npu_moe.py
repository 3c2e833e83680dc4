"""The npu backend's mixture of experts: vllm-ascend's simple ALLGATHER path (v0.11.0 `ops/moe/*`), op for op
(shared/notes/moe-mla-lws.md, section A, steps 3-6; docs/engine.md, "The npu backend's kernels").

Routing (`select`):
- softmax, not grouped (Qwen2/3-MoE, DeepSeek-V2-Lite): `npu_moe_gating_top_k_softmax` (k-major row_idx unused),
  then in torch the division by the top-k sum when `norm_topk_prob` and the routed_scaling_factor. The logits go in
  float32 (a dtype the op takes), as transformers' router computes the softmax.
- sigmoid with the correction bias, grouped by the sum of each group's best two (DeepSeek-V3, noaux_tc):
  `npu_moe_gating_top_k(..., group_select_mode=1, renorm=0, norm_type=1, routed_scaling_factor=1)`, the scaling
  applied afterwards in torch (as vllm-ascend's model applies it). The op always divides by the sum (+eps), so it
  serves only `norm_topk_prob=True`; it takes at most 2048 experts.
- anything else (DeepSeek-V2's softmax group_limited_greedy: what norm_type 0 does to the weights is not in the
  sources read; sigmoid without norm_topk_prob): the torch reference (`Backend.moe_select_experts`), said once in
  the log.

Experts (`experts`): `npu_moe_init_routing_v2` (count mode, int32 ids, quant_mode=-1 passed explicitly: its default
is 0, static quantization, on 7.0.0-7.3.0) -> `npu_grouped_matmul` over w13 laid out (E, H, 2I) -> `npu_swiglu` ->
`npu_grouped_matmul` over w2 laid out (E, I, H) -> the combine: `npu_moe_token_unpermute` (7.1.0 on) with
init_routing_v2's gather index as it is; on 7.0.0, which lacks it, `npu_moe_finalize_routing` with drop_pad_mode 0,
which reads the index k-major, so the token-major index is transposed first (as sglang's NPU w4a8 path does).

The grouped matmul takes each expert's weight as [K, N] (x @ W); the model holds w13 (E, 2I, H) and w2 (E, H, I).
`lay_out_experts` (the backend's `prepare_model`) re-stores each such parameter so that its memory is the
transposed layout while its shape stays the model's (a transposed view of a contiguous (E, H, 2I) tensor): the
reference and the loader see what they expect and the kernel gets `w.transpose(1, 2)` without a copy. A weight not
laid out so is transposed at each call (logged once).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from npuserve.engine.backends.base import BackendUnavailableError
from npuserve.engine.backends.npu_stack import UNPERMUTE_OP, NPUStack
from npuserve.modelspec import MoESpec

log = logging.getLogger(__name__)

GATING_TOP_K_MAX_EXPERTS = 2048  # npu_moe_gating_top_k: E <= 2048
GATING_SOFTMAX_MAX_K = 1024  # npu_moe_gating_top_k_softmax: k <= 1024
EXPERT_WEIGHTS = ("w13", "w2")  # the fused expert parameters of engine/model/moe.py


def gating_op(moe: MoESpec) -> tuple[str | None, str]:
    """The gating op that computes `moe`'s rule (None: the torch reference), and why."""
    if moe.scoring_func == "softmax" and not moe.grouped:
        if moe.num_experts_per_tok > GATING_SOFTMAX_MAX_K:
            return None, f"top-{moe.num_experts_per_tok} is above the softmax gating op's k <= 1024"
        return "npu_moe_gating_top_k_softmax", "softmax top-k"
    if moe.scoring_func == "sigmoid" and moe.topk_method in ("noaux_tc", "greedy"):
        per_group = moe.num_experts // moe.n_group
        if not moe.norm_topk_prob:
            return None, "sigmoid routing without norm_topk_prob (npu_moe_gating_top_k always renormalises)"
        if moe.num_experts > GATING_TOP_K_MAX_EXPERTS:
            return None, f"{moe.num_experts} experts (npu_moe_gating_top_k takes at most 2048)"
        if moe.n_group > 1 and per_group < 2:
            return None, "groups of one expert (a group's score is the sum of its best two)"
        return "npu_moe_gating_top_k", "sigmoid grouped top-k"
    return None, (f"{moe.scoring_func} {moe.topk_method} routing (no gating op computes it as transformers does: "
                  "the softmax grouped weights of norm_type 0 are not documented)")


def lay_out_experts(model: nn.Module) -> int:
    """Re-stores every fused expert weight (a 3D `w13`/`w2` parameter) as a transposed view of a contiguous
    (E, K, N) tensor, the grouped matmul's layout; its shape and values are unchanged. Returns how many."""
    count = 0
    for name, param in model.named_parameters():
        if name.rsplit(".", 1)[-1] in EXPERT_WEIGHTS and param.dim() == 3:
            if not param.transpose(1, 2).is_contiguous():
                param.data = param.data.transpose(1, 2).contiguous().transpose(1, 2)
            count += 1
    return count


@dataclass(frozen=True)
class Routed:
    """`npu_moe_init_routing_v2`'s result: the rows sorted by expert, the gather index back to (token, k) slots, the
    rows per expert (int64, the grouped matmul's group_list) and the ids it sorted by (int32)."""

    rows: torch.Tensor
    row_idx: torch.Tensor
    counts: torch.Tensor
    expert_ids: torch.Tensor


class NPUMoE:
    """The MoE ops of one stack (`ops`: the torch_npu module)."""

    def __init__(self, ops: Any, stack: NPUStack) -> None:
        self._ops, self.stack = ops, stack
        self._said: set[str] = set()

    def warn_once(self, message: str, *args: object) -> None:
        """A warning logged once per distinct message (the int8 ops' too)."""
        key = message % args
        if key not in self._said:
            self._said.add(key)
            log.warning("npu: " + message, *args)

    def require(self) -> None:
        missing = self.stack.missing_moe()
        if missing:
            raise BackendUnavailableError(
                f"{self.stack.describe()} lacks {', '.join(missing)}, which the npu backend's mixture of experts "
                "calls (op-plugin 7.0.0 or later has them)")

    def select(self, router_logits: torch.Tensor, moe: MoESpec,
               correction_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(weights float32, ids int32) through the gating op, or None where the reference must route."""
        op, why = gating_op(moe)
        if op is None:
            self.warn_once("MoE routing runs on the torch reference: %s", why)
            return None
        self.require()
        logits = router_logits.float().contiguous()
        k = moe.num_experts_per_tok
        if op == "npu_moe_gating_top_k_softmax":
            y, ids, _ = self._ops.npu_moe_gating_top_k_softmax(x=logits, finished=None, k=k)
            weights = y.float()
            if moe.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        else:
            bias = None if correction_bias is None else correction_bias.float().contiguous()
            y, ids, _ = self._ops.npu_moe_gating_top_k(
                x=logits, k=k, bias=bias, k_group=moe.topk_group, group_count=moe.n_group, group_select_mode=1,
                renorm=0, norm_type=1, routed_scaling_factor=1.0, eps=1e-20)
            weights = y.float()
        if moe.routed_scaling_factor != 1.0:
            weights = weights * moe.routed_scaling_factor
        return weights, ids.to(torch.int32)

    def kn(self, w: torch.Tensor, name: str) -> torch.Tensor:
        """(E, N, K) -> the (E, K, N) the grouped matmul takes: a free view when `lay_out_experts` ran."""
        t = w.transpose(1, 2)
        if not t.is_contiguous():
            self.warn_once("MoE %s is not laid out for the grouped matmul: transposed at every call", name)
            t = t.contiguous()
        return t

    def route(self, x: torch.Tensor, ids: torch.Tensor, num_experts: int) -> Routed:
        """x's rows, one per (token, k) slot, sorted by expert (`npu_moe_init_routing_v2`, unquantized)."""
        self.require()
        tokens, top = ids.shape
        expert_ids = ids.to(torch.int32).contiguous()
        expanded_x, row_idx, counts, _ = self._ops.npu_moe_init_routing_v2(
            x=x.contiguous(), expert_idx=expert_ids, active_num=tokens * top, expert_num=num_experts,
            expert_tokens_num_type=1, expert_tokens_num_flag=True, quant_mode=-1)
        return Routed(expanded_x, row_idx, counts.to(torch.int64), expert_ids)

    def combine(self, out: torch.Tensor, weights: torch.Tensor, routed: Routed) -> torch.Tensor:
        """Each token's expert rows weighted and summed (token_unpermute, or finalize_routing on 7.0.0)."""
        tokens, top = routed.expert_ids.shape
        probs = weights.to(out.dtype).contiguous()
        if self.stack.moe_combine_op == UNPERMUTE_OP:
            combined: torch.Tensor = self._ops.npu_moe_token_unpermute(permuted_tokens=out,
                                                                       sorted_indices=routed.row_idx, probs=probs)
            return combined
        k_major = routed.row_idx.view(tokens, top).t().contiguous().view(-1)  # finalize mode 0 reads slot i + k*N
        finalized: torch.Tensor = self._ops.npu_moe_finalize_routing(
            expanded_permuted_rows=out, skip1=None, skip2=None, bias=None, scales=probs,
            expanded_src_to_dst_row=k_major, export_for_source_row=routed.expert_ids, drop_pad_mode=0)
        return finalized

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                w2: torch.Tensor) -> torch.Tensor:
        routed = self.route(x, ids, w13.shape[0])
        h = self._ops.npu_grouped_matmul(x=[routed.rows], weight=[self.kn(w13, "w13")], group_list=routed.counts,
                                         split_item=2, group_type=0, group_list_type=1)[0]
        h = self._ops.npu_swiglu(h.contiguous(), dim=-1)
        out = self._ops.npu_grouped_matmul(x=[h], weight=[self.kn(w2, "w2")], group_list=routed.counts,
                                           split_item=2, group_type=0, group_list_type=1)[0]
        return self.combine(out, weights, routed)
