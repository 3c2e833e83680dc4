"""A FAKE of torch_npu's mixture-of-experts operations, for tests: plain torch on the CPU, no NPU kernel.

Each op computes its documented semantics (in float32, rounded once to the output dtype) and refuses what its
contract refuses. Sources (shared/notes/moe-mla-lws.md, section A, which read them): Ascend/op-plugin
`op_plugin/config/op_plugin_functions.yaml` per release branch (the line that first has each schema) and the
`docs/zh/custom_APIs/torch_npu/torch_npu-<op>.md` pages; op-plugin `test/test_custom_ops/
test_npu_moe_token_permute_and_unpermute.py` for the unpermute index; vllm-project/vllm-ascend v0.11.0
`ops/moe/*.py` for the production calls.

- `npu_moe_gating_top_k_softmax(x, finished=None, k=1) -> (y, expert_idx, row_idx)` (6.0.rc2): softmax over the
  last axis then top-k, no renormalisation; y in x's dtype, expert_idx int32, row_idx int32 k-major
  (`row_idx[i, k] = k * N + i`). x 2D or 3D, k <= 1024.
- `npu_moe_gating_top_k(x, k, *, bias, k_group, group_count, group_select_mode, renorm, norm_type, out_flag,
  routed_scaling_factor, eps) -> (y, expert_idx, norm_out)` (7.0.0): x 2D, E <= 2048; bias is added for the choice
  only; groups scored by their max (mode 0) or the sum of their best two (mode 1), the top k_group kept, then top-k;
  weights are the un-biased scores; norm_type 1 (sigmoid) divides them by sum + eps and multiplies by
  routed_scaling_factor; renorm must be 0; norm_out float32. The fake implements norm_type 1 only (the doc's
  equivalent code is for the sigmoid form; what norm_type 0 does to the weights is not in the sources read).
- `npu_moe_init_routing_v2(x, expert_idx, *, ..., quant_mode) -> (expanded_x, expanded_row_idx, counts, scale)`
  (7.0.0): x (N, H); expert_idx (N, K) int32; the N*K (token, k) slots (token-major, slot i*K+k) sorted stably by
  expert; row_idx_type 0: `expanded_row_idx[sorted[j]] = j` (a gather index), int32; expert_tokens_num_type 1: the
  per-expert counts (int64), 0: their cumsum. quant_mode: -1 none, 0 static (needs `scale`), 1 dynamic. **Its
  default is 0 in 7.0.0-7.3.0 and -1 from 26.0.0**: a 7.x call that leaves it out asks for static quantization
  without a scale, which the op refuses; the fake of a 7.x line does the same. The fake implements quant_mode -1,
  dropless (drop_pad_mode 0) routing, expert_tokens_num_type 0 and 1, and no active_expert_range.
- `npu_grouped_matmul(x: list, weight: list, *, group_list, split_item, group_type, group_list_type, ...) -> list`
  (Tensor group_list since 7.0.0): group_type 0 splits x's rows into one group per expert; group_list int64, one
  entry per expert, counts (group_list_type 1) or a non-decreasing cumsum (0); each expert's weight is [K, N]
  (`x @ W`), so weight is (E, K, N); split_item 2/3: one concatenated output. The fake implements that grouped form
  only (one x, one 3D weight, no quantisation, bias or activation).
- `npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None)`
  (7.1.0): `out[t] = sum_k probs[t, k] * permuted[sorted_indices[t*K + k]]`, sorted_indices the gather index of
  init_routing_v2 (row_idx_type 0), int32.
- `npu_moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
  export_for_source_row, drop_pad_mode=0)` (7.0.0 form): `out[i] = skip1 + skip2 + sum_k scales[i, k] *
  (rows[src2dst[..]] + bias[expert[i, k]])`; drop_pad_mode 0 reads src2dst k-major (`i + k*N`, init_routing v1's
  layout), 2 token-major (`i*K + k`, v2's). The fake implements modes 0 and 2.

What it cannot check: the kernels' numerics and speed, the FRACTAL_NZ weight layout, limits the sources do not
state (e.g. whether probs must have the tokens' dtype: not enforced).
"""

from __future__ import annotations

from typing import Any

import torch

from tests.fake_npu_attention import integer, require

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
GATING_MAX_K = 1024  # npu_moe_gating_top_k_softmax: k <= 1024
GATING_MAX_EXPERTS = 2048  # npu_moe_gating_top_k: E <= 2048


def _float_tensor(name: str, t: object, ndims: tuple[int, ...]) -> torch.Tensor:
    require(isinstance(t, torch.Tensor), f"{name}: expected a tensor, got {type(t).__name__}")
    assert isinstance(t, torch.Tensor)
    require(t.dim() in ndims, f"{name}: {t.dim()} dimensions, shape {tuple(t.shape)} (takes {ndims})")
    require(t.dtype in FLOAT_DTYPES, f"{name}: dtype {t.dtype} not supported (takes float16, bfloat16, float32)")
    return t


def _index_tensor(name: str, t: object, ndim: int, dtype: torch.dtype) -> torch.Tensor:
    require(isinstance(t, torch.Tensor), f"{name}: expected a tensor, got {type(t).__name__}")
    assert isinstance(t, torch.Tensor)
    require(t.dim() == ndim, f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    require(t.dtype == dtype, f"{name}: dtype {t.dtype}, the op takes {dtype}")
    return t


# --- gating ------------------------------------------------------------------------------------------------------


def npu_moe_gating_top_k_softmax(x: torch.Tensor, finished: torch.Tensor | None = None,
                                 k: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """softmax(x) then top-k (no renormalisation): (y in x's dtype, expert_idx int32, row_idx int32 k-major)."""
    t = _float_tensor("x", x, (2, 3))
    top = integer("k", k)
    experts = t.shape[-1]
    require(0 < top <= min(GATING_MAX_K, experts), f"k {top}: takes 1..min(1024, experts={experts})")
    require(finished is None, "finished: the fake implements finished=None only")
    rows = t.reshape(-1, experts)
    values, ids = torch.softmax(rows.float(), dim=-1).topk(top, dim=-1)
    n = rows.shape[0]
    row_idx = torch.arange(n * top, dtype=torch.int32).view(top, n).t().contiguous()
    shape = (*t.shape[:-1], top)
    return values.to(t.dtype).view(shape), ids.to(torch.int32).view(shape), row_idx.view(shape)


def npu_moe_gating_top_k(x: torch.Tensor, k: int, *, bias: torch.Tensor | None = None, k_group: int = 1,
                         group_count: int = 1, group_select_mode: int = 0, renorm: int = 0, norm_type: int = 0,
                         out_flag: bool = False, routed_scaling_factor: float = 1.0,
                         eps: float = 1e-20) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Grouped top-k routing (module docstring): (y in x's dtype, expert_idx int32, norm_out float32)."""
    t = _float_tensor("x", x, (2,))
    tokens, experts = t.shape
    top, groups, kept = integer("k", k), integer("group_count", group_count), integer("k_group", k_group)
    require(experts <= GATING_MAX_EXPERTS, f"x: {experts} experts, the op takes at most {GATING_MAX_EXPERTS}")
    require(integer("renorm", renorm) == 0, f"renorm {renorm}: only 0 is supported")
    require(integer("norm_type", norm_type) in (0, 1), f"norm_type {norm_type}: 0 (softmax) or 1 (sigmoid)")
    require(norm_type == 1, "norm_type 0: the fake implements norm_type 1 (sigmoid) only")
    require(integer("group_select_mode", group_select_mode) in (0, 1),
            f"group_select_mode {group_select_mode}: 0 (group max) or 1 (sum of the best two)")
    require(groups > 0 and experts % groups == 0, f"group_count {groups} does not divide {experts} experts")
    require(0 < kept <= groups, f"k_group {kept}: takes 1..group_count={groups}")
    per_group = experts // groups
    require(group_select_mode == 0 or per_group >= 2, "group_select_mode 1 needs at least 2 experts per group")
    require(0 < top <= kept * per_group, f"k {top}: more than the {kept * per_group} experts of the kept groups")
    require(isinstance(routed_scaling_factor, float | int), "routed_scaling_factor: expected a float")
    require(isinstance(eps, float), "eps: expected a float")
    scores = torch.sigmoid(t.float())
    choice = scores
    if bias is not None:
        b = _float_tensor("bias", bias, (1,))
        require(b.shape[0] == experts, f"bias: {b.shape[0]} entries for {experts} experts")
        choice = scores + b.float()
    grouped = choice.view(tokens, groups, per_group)
    group_score = grouped.max(dim=-1).values if group_select_mode == 0 else grouped.topk(2, dim=-1).values.sum(-1)
    keep = torch.zeros(tokens, groups, dtype=torch.bool)
    keep.scatter_(1, group_score.topk(kept, dim=-1).indices, True)
    masked = choice.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
    ids = masked.topk(top, dim=-1).indices
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(-1, keepdim=True) + eps) * float(routed_scaling_factor)
    return weights.to(t.dtype), ids.to(torch.int32), scores


# --- dispatch and combine ----------------------------------------------------------------------------------------


def _init_routing_v2(x: Any, expert_idx: Any, *, scale: Any, offset: Any, active_num: int, expert_capacity: int,
                     expert_num: int, drop_pad_mode: int, expert_tokens_num_type: int, expert_tokens_num_flag: bool,
                     quant_mode: int, active_expert_range: Any,
                     row_idx_type: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    xs = _float_tensor("x", x, (2,))
    ids = _index_tensor("expert_idx", expert_idx, 2, torch.int32)
    tokens, top = ids.shape
    require(tokens == xs.shape[0], f"expert_idx has {tokens} rows, x {xs.shape[0]}")
    mode = integer("quant_mode", quant_mode)
    require(mode in (-1, 0, 1), f"quant_mode {mode}: -1 (none), 0 (static) or 1 (dynamic)")
    require(mode != 0 or scale is not None, "quant_mode 0 (static quantization) needs scale")
    require(mode == -1, f"quant_mode {mode}: the fake implements -1 (no quantization) only")
    require(scale is None and offset is None, "scale/offset: only with quantization")
    require(integer("drop_pad_mode", drop_pad_mode) == 0, "drop_pad_mode: the fake implements 0 (dropless) only")
    require(integer("expert_capacity", expert_capacity) == -1 or drop_pad_mode == 1,
            "expert_capacity: only with drop_pad_mode 1")
    count_type = integer("expert_tokens_num_type", expert_tokens_num_type)
    require(count_type in (0, 1, 2), f"expert_tokens_num_type {count_type}: 0 cumsum, 1 count, 2 key_value")
    require(count_type != 2, "expert_tokens_num_type 2: the fake implements 0 and 1")
    require(integer("row_idx_type", row_idx_type) in (0, 1), f"row_idx_type {row_idx_type}: 0 gather, 1 scatter")
    require(not active_expert_range, "active_expert_range: the fake implements the whole range (left out) only")
    num = integer("expert_num", expert_num)
    require(num > 0 or not expert_tokens_num_flag, "expert_num: needed for the per-expert token counts")
    bound = num if num > 0 else int(ids.max()) + 1
    require(bool(((ids >= 0) & (ids < bound)).all()), f"expert_idx: values outside [0, {bound})")
    active = integer("active_num", active_num)
    rows = tokens * top if active <= 0 else min(active, tokens * top)
    flat = ids.reshape(-1).long()
    sorted_slots = torch.sort(flat, stable=True).indices  # sorted position j holds slot sorted_slots[j] (= i*K+k)
    gather = torch.full((tokens * top,), -1, dtype=torch.int32)
    gather[sorted_slots[:rows]] = torch.arange(rows, dtype=torch.int32)
    row_idx = gather if row_idx_type == 0 else sorted_slots.to(torch.int32)
    expanded_x = xs.index_select(0, sorted_slots[:rows] // top)
    counts = torch.bincount(flat, minlength=bound).to(torch.int64)
    tokens_out = (counts if count_type == 1 else counts.cumsum(0)) if expert_tokens_num_flag else counts[:0]
    return expanded_x, row_idx, tokens_out, torch.empty(0, dtype=torch.float32)


def npu_moe_init_routing_v2_quant0(x: torch.Tensor, expert_idx: torch.Tensor, *, scale: Any = None,
                                   offset: Any = None, active_num: int = -1, expert_capacity: int = -1,
                                   expert_num: int = -1, drop_pad_mode: int = 0, expert_tokens_num_type: int = 0,
                                   expert_tokens_num_flag: bool = False, quant_mode: int = 0,
                                   active_expert_range: Any = (), row_idx_type: int = 0) -> Any:
    """7.0.0-7.3.0: quant_mode defaults to 0 (static quantization), so it must be passed as -1."""
    return _init_routing_v2(x, expert_idx, scale=scale, offset=offset, active_num=active_num,
                            expert_capacity=expert_capacity, expert_num=expert_num, drop_pad_mode=drop_pad_mode,
                            expert_tokens_num_type=expert_tokens_num_type,
                            expert_tokens_num_flag=expert_tokens_num_flag, quant_mode=quant_mode,
                            active_expert_range=active_expert_range, row_idx_type=row_idx_type)


def npu_moe_init_routing_v2(x: torch.Tensor, expert_idx: torch.Tensor, *, scale: Any = None, offset: Any = None,
                            active_num: int = -1, expert_capacity: int = -1, expert_num: int = -1,
                            drop_pad_mode: int = 0, expert_tokens_num_type: int = 0,
                            expert_tokens_num_flag: bool = False, quant_mode: int = -1,
                            active_expert_range: Any = (), row_idx_type: int = 0, x_dtype: int | None = None) -> Any:
    """26.0.0 on: quant_mode defaults to -1 (none), and `x_dtype` exists."""
    require(x_dtype is None, "x_dtype: the fake implements None only")
    return _init_routing_v2(x, expert_idx, scale=scale, offset=offset, active_num=active_num,
                            expert_capacity=expert_capacity, expert_num=expert_num, drop_pad_mode=drop_pad_mode,
                            expert_tokens_num_type=expert_tokens_num_type,
                            expert_tokens_num_flag=expert_tokens_num_flag, quant_mode=quant_mode,
                            active_expert_range=active_expert_range, row_idx_type=row_idx_type)


def npu_grouped_matmul(x: list[torch.Tensor], weight: list[torch.Tensor], *, bias: Any = None, scale: Any = None,
                       offset: Any = None, antiquant_scale: Any = None, antiquant_offset: Any = None,
                       per_token_scale: Any = None, group_list: torch.Tensor | None = None,
                       activation_input: Any = None, activation_quant_scale: Any = None,
                       activation_quant_offset: Any = None, split_item: int = 0, group_type: int | None = None,
                       group_list_type: int = 0, act_type: int = 0, tuning_config: Any = None,
                       output_dtype: Any = None) -> list[torch.Tensor]:
    """The grouped form (module docstring): one output, group g's rows times weight[g] ([K, N], x @ W)."""
    require(isinstance(x, list | tuple) and isinstance(weight, list | tuple), "x, weight: lists of tensors")
    require(len(x) == 1 and len(weight) == 1, "x, weight: the fake implements one x and one (E, K, N) weight")
    require(all(a is None for a in (bias, scale, offset, antiquant_scale, antiquant_offset, per_token_scale,
                                    activation_input, activation_quant_scale, activation_quant_offset,
                                    output_dtype)), "quantisation, bias, activation: the fake implements none")
    require(integer("act_type", act_type) == 0, "act_type: the fake implements 0 (none)")
    a = _float_tensor("x[0]", x[0], (2,))
    w = _float_tensor("weight[0]", weight[0], (3,))
    require(w.dtype == a.dtype, f"weight[0]: dtype {w.dtype}, x's is {a.dtype}")
    require(group_type is not None and integer("group_type", group_type) in (-1, 0, 2),
            f"group_type {group_type}: -1, 0 or 2")
    require(group_type == 0, "group_type: the fake implements 0 (groups along x's rows)")
    require(integer("split_item", split_item) in (0, 1, 2, 3), f"split_item {split_item}: 0-3")
    require(split_item in (2, 3), "split_item: with one x split into groups, 2 or 3 (one concatenated output)")
    experts, k, n = w.shape
    require(a.shape[1] == k, f"x[0] is (M, {a.shape[1]}) but each expert's weight is [K={k}, N={n}] (x @ W): "
                             "a weight laid out (E, N, K) must be transposed")
    require(isinstance(group_list, torch.Tensor), "group_list: a Tensor (int64) on this line")
    assert isinstance(group_list, torch.Tensor)
    groups = _index_tensor("group_list", group_list, 1, torch.int64)
    require(groups.shape[0] == experts, f"group_list: {groups.shape[0]} entries for {experts} weights")
    kind = integer("group_list_type", group_list_type)
    require(kind in (0, 1), f"group_list_type {kind}: 0 cumsum or 1 counts (2 is int8 only)")
    counts = groups if kind == 1 else torch.diff(groups, prepend=groups.new_zeros(1))
    require(bool((counts >= 0).all()), f"group_list: {'counts' if kind else 'cumsum'} must not decrease")
    require(int(counts.sum()) <= a.shape[0], f"group_list: {int(counts.sum())} rows, x has {a.shape[0]}")
    out = torch.zeros(a.shape[0], n, dtype=torch.float32)
    start = 0
    for g, c in enumerate(counts.tolist()):
        out[start:start + c] = a[start:start + c].float() @ w[g].float()
        start += c
    return [out.to(a.dtype)]


def npu_moe_token_unpermute(permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor,
                            probs: torch.Tensor | None = None, padded_mode: bool = False,
                            restore_shape: Any = None) -> torch.Tensor:
    """`out[t] = sum_k probs[t, k] * permuted[sorted_indices[t*K + k]]` (token-major gather index)."""
    rows = _float_tensor("permuted_tokens", permuted_tokens, (2,))
    index = _index_tensor("sorted_indices", sorted_indices, 1, torch.int32)
    require(not padded_mode and restore_shape is None, "padded_mode: the fake implements False only")
    if probs is None:
        tokens, top = index.shape[0], 1
        weights = torch.ones(tokens, 1)
    else:
        p = _float_tensor("probs", probs, (2,))
        tokens, top = p.shape
        weights = p.float()
    require(index.shape[0] == tokens * top, f"sorted_indices: {index.shape[0]} entries for {tokens}x{top} slots")
    require(bool(((index >= 0) & (index < rows.shape[0])).all()),
            f"sorted_indices: values outside [0, {rows.shape[0]})")
    gathered = rows.float().index_select(0, index.long()).view(tokens, top, -1)
    return (gathered * weights.unsqueeze(-1)).sum(1).to(rows.dtype)


def npu_moe_finalize_routing(expanded_permuted_rows: torch.Tensor, skip1: torch.Tensor | None,
                             skip2: torch.Tensor | None, bias: torch.Tensor | None, scales: torch.Tensor | None,
                             expanded_src_to_dst_row: torch.Tensor, export_for_source_row: torch.Tensor | None,
                             drop_pad_mode: int = 0) -> torch.Tensor:
    """The combine of the v1 chain (module docstring); modes 0 (k-major index) and 2 (token-major)."""
    rows = _float_tensor("expanded_permuted_rows", expanded_permuted_rows, (2,))
    index = _index_tensor("expanded_src_to_dst_row", expanded_src_to_dst_row, 1, torch.int32)
    mode = integer("drop_pad_mode", drop_pad_mode)
    require(mode in (0, 1, 2, 3), f"drop_pad_mode {mode}: 0-3")
    require(mode in (0, 2), "drop_pad_mode: the fake implements 0 (k-major) and 2 (token-major)")
    require(scales is not None, "scales: the fake needs them")
    assert scales is not None
    s = _float_tensor("scales", scales, (2,))
    tokens, top = s.shape
    require(index.shape[0] == tokens * top, f"expanded_src_to_dst_row: {index.shape[0]} entries for "
                                            f"{tokens}x{top}")
    require(bool(((index >= 0) & (index < rows.shape[0])).all()), "expanded_src_to_dst_row: values out of range")
    by_slot = index.view(top, tokens).t() if mode == 0 else index.view(tokens, top)
    gathered = rows.float().index_select(0, by_slot.reshape(-1).long()).view(tokens, top, -1)
    if bias is not None:
        require(export_for_source_row is not None, "bias: needs export_for_source_row")
        assert export_for_source_row is not None
        gathered = gathered + bias.float().index_select(0, export_for_source_row.reshape(-1).long()).view(
            tokens, top, -1)
    out = (gathered * s.float().unsqueeze(-1)).sum(1)
    for skip in (skip1, skip2):
        if skip is not None:
            out = out + skip.float()
    return out.to(rows.dtype)
