"""The device and attention backend interface: what the model runner and the attention layers call.

A backend owns the device: it allocates the paged KV cache (one tensor per layer shaped
`(2, num_blocks, block_size, num_kv_heads, head_dim)`), writes the new tokens' K and V into their slots, runs
prefill attention (the new tokens over any prefix-cache hit plus themselves) and decode attention (one token
over its block table), copies blocks between device and host for swapping, synchronizes and reports memory.

Multi-head latent attention (DeepSeek-V2/V3, `mla_*` methods) keeps two caches per layer instead, as vllm-ascend does:
`latent` `(num_blocks, block_size, 1, kv_lora_rank)` with the RMS-normed `c_kv` and `rope`
`(num_blocks, block_size, 1, qk_rope_head_dim)` with the rotated shared key `k_pe`. Decode attends in the absorbed
form over both caches; prefill expands the gathered latent with `kv_b_proj` and runs ordinary causal attention.
The methods here are the torch reference; a device backend overrides them with its fused ops.
Mixture of experts: `moe_select_experts` (the router's rule: which experts each token goes to, with which weight)
and `moe_experts` (the routed experts' SwiGLU MLPs over the tokens sent to them, weighted and summed per token).
The torch reference here is the CPU's; a device backend overrides them with its fused kernels.
Int8 (W8A8) weights: `int8_linear` and `moe_experts_int8`, the reference in `int8_reference.py`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from npuserve.engine.backends import int8_reference
from npuserve.engine.backends.int8_reference import Int8Experts, Int8Linear
from npuserve.modelspec import MoESpec


@dataclass(slots=True)
class AttentionMetadata:
    """The flat batch's layout, built once per step and shared by every layer.

    Tokens of all sequences are concatenated (`num_tokens` rows). For sequence b, its new tokens are rows
    `query_start[b] .. query_start[b+1]-1`, at positions `context_lens[b] - query_lens[b] .. context_lens[b]-1`.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor  # (num_tokens,) int64: block * block_size + offset of each new token
    block_tables: torch.Tensor  # (batch, max_blocks) int64, padded with 0
    context_lens: torch.Tensor  # (batch,) int64: tokens in the cache after this step, new ones included
    query_lens: torch.Tensor  # (batch,) int64: new tokens per sequence (1 in decode)
    query_start: list[int]  # (batch + 1,) row offsets of each sequence's new tokens
    max_query_len: int
    max_context_len: int
    # Filled lazily by the backend and reused by every layer of the step (masks, gather indices, a kernel's choice).
    cache: dict[str, Any] | None = None
    # A chunked-prefill step whose first sequences decode: the two groups' own layouts (decodes first).
    decode_part: AttentionMetadata | None = None
    prefill_part: AttentionMetadata | None = None

    @property
    def batch_size(self) -> int:
        return len(self.query_start) - 1


class BackendUnavailableError(RuntimeError):
    """The device this backend drives is not here (no torch_npu / CANN, no CUDA GPU, too few cards); the commands
    print the message and exit 2 rather than a traceback."""


@dataclass(frozen=True, slots=True)
class MemoryInfo:
    free_bytes: int
    total_bytes: int


class Backend(ABC):
    """One device kind. Instances are cheap; the runner holds one."""

    name: str = "base"
    # The torch.distributed backend of the all-reduces among tensor-parallel ranks on this device kind.
    dist_backend: str = "gloo"
    # Whether `moe_experts` can be captured in a decode graph; the reference reads the experts' token counts on
    # the host (one sync per layer), so an MoE model runs decode eagerly unless a backend says so.
    moe_in_decode_graphs: bool = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    # --- model preparation and decode graphs --------------------------------------------------------------------

    def prepare_model(self, model: nn.Module) -> None:
        """Called once after the weights are loaded: swaps in the device's fused kernels (RMSNorm, RoPE, SwiGLU)
        where it has them. None by default."""
        return None

    def new_decode_graph(self) -> Any | None:
        """A fresh device graph (`torch.cuda.CUDAGraph`, `torch.npu.NPUGraph`) to capture a decode step in, or
        None when this backend runs decode eagerly (the default; the CPU has no graphs)."""
        return None

    def graph_capture(self, graph: Any, pool: Any | None) -> AbstractContextManager[Any]:
        """The context in which `graph` captures (`torch.cuda.graph(graph, pool=pool)` and its npu twin);
        `pool` shares one memory pool across the captured batch sizes."""
        raise NotImplementedError(f"the {self.name} backend has no decode graphs")

    def configure(self, *, block_size: int, head_dim: int, max_seq_len: int) -> None:
        """Called by the runner before it allocates the KV cache (each runner of an engine with the same values): the
        layout the attention kernels will see and the longest sequence. A backend whose kernels cannot run the layout
        raises ValueError naming it; one that needs per-layout constants builds them from here (npu: the prefill
        mask's size). Nothing by default: the CPU and CUDA attention takes any block size."""
        return None

    # --- memory -------------------------------------------------------------------------------------------------

    @abstractmethod
    def memory_info(self) -> MemoryInfo: ...

    def measure_peak(self, run: Callable[[], None]) -> int:
        """Runs `run` (a warm-up) and returns the bytes the device's allocator held at its peak beyond what it held
        before, for KV sizing to set aside. 0 by default: a backend that does not measure leaves the warm-up's blocks
        in its allocator's cache, where its `memory_info` counts them as used."""
        run()
        return 0

    def allocate_kv_cache(
        self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: torch.device | None = None,
    ) -> list[torch.Tensor]:
        shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
        return [torch.zeros(shape, dtype=dtype, device=device or self.device) for _ in range(num_layers)]

    def copy_blocks(self, src: list[torch.Tensor], dst: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
        """Copies block `s` of every layer of `src` into block `d` of `dst` (swap out: device->host; in: back).

        A copy to the host is a blocking one: the host scatters the gathered blocks into place right away, and a
        non-blocking device-to-host copy into a fresh (unpinned) tensor may not have landed by then."""
        if not pairs:
            return
        src_idx = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=src[0].device)
        dst_idx = torch.tensor([d for _, d in pairs], dtype=torch.long, device=dst[0].device)
        to_host = dst[0].device.type == "cpu"
        for s, d in zip(src, dst, strict=True):
            d[:, dst_idx] = s[:, src_idx].to(d.device, non_blocking=not to_host)

    def allocate_mla_cache(
        self, num_layers: int, num_blocks: int, block_size: int, kv_lora_rank: int, rope_dim: int,
        dtype: torch.dtype, device: torch.device | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(latent, rope) per layer: `(num_blocks, block_size, 1, kv_lora_rank)` and `(num_blocks, block_size, 1,
        rope_dim)`, both contiguous. The runner copies their blocks with `copy_blocks`, given as `(1, num_blocks, ...)`
        views (block axis 1, like the dense cache's)."""
        where = device or self.device
        return [(torch.zeros((num_blocks, block_size, 1, kv_lora_rank), dtype=dtype, device=where),
                 torch.zeros((num_blocks, block_size, 1, rope_dim), dtype=dtype, device=where))
                for _ in range(num_layers)]

    def synchronize(self) -> None:
        return None

    # --- attention ----------------------------------------------------------------------------------------------

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Stores each new token's K and V (rows of k, v) at its slot."""
        _, num_blocks, block_size, heads, dim = kv_cache.shape
        flat = kv_cache.view(2, num_blocks * block_size, heads, dim)
        flat[0].index_copy_(0, slot_mapping, k)
        flat[1].index_copy_(0, slot_mapping, v)

    @abstractmethod
    def prefill_attention(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: (num_tokens, heads, head_dim) of the new tokens, whose K/V are already written. Returns the same shape."""

    @abstractmethod
    def decode_attention(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: (batch, heads, head_dim), one token per sequence, over its block table. Returns the same shape."""

    # --- multi-head latent attention (DeepSeek) ------------------------------------------------------------------
    #
    # Rope layout, shared by `mla_write_cache` (k_pe) and `mla_rotate_q` (q_pe): `cos`, `sin` are `(T, rope_dim)`,
    # the rotary table's rows at the tokens' positions in the "halves" form (`cos[:, i] == cos[:, i + rope_dim/2]`
    # = cos(position x inv_freq[i]) x YaRN's attention factor). `interleaved=False`: neox rope (channel i pairs with
    # i + rope_dim/2). `interleaved=True` (DeepSeek): channel 2i pairs with 2i+1; the input is first de-interleaved
    # (evens, then odds) and then rotated as neox, so the output is in the halves order, exactly as transformers'
    # `apply_rotary_pos_emb_interleave` leaves it. q_pe and k_pe only ever meet in a dot product, so any order that
    # the two methods share is right; a backend overriding one overrides both.

    def mla_rotate_q(self, q_pe: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
        """q_pe `(T, N, rope_dim)` rotated, in the same layout as `mla_write_cache`'s k_pe."""
        return rope_rotate(q_pe, cos.unsqueeze(1), sin.unsqueeze(1), interleaved)

    def mla_write_cache(
        self, kv_a: torch.Tensor, gamma: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
        slot_mapping: torch.Tensor, latent_cache: torch.Tensor, rope_cache: torch.Tensor, interleaved: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_a `(T, kv_lora_rank + rope_dim)` (kv_a_proj_with_mqa's output): the first `kv_lora_rank` channels
        RMS-normalised with `gamma`/`eps` (in float32, cast back), the rest rotated with `cos`/`sin` (layout above);
        both written at `slot_mapping` (block * block_size + offset). Returns (c_kv `(T, kv_lora_rank)`,
        k_pe `(T, rope_dim)`). On Ascend: one `npu_kv_rmsnorm_rope_cache`."""
        rank = latent_cache.shape[-1]
        c, pe = kv_a[..., :rank], kv_a[..., rank:]
        c_kv = rms_norm(c, gamma, eps)
        k_pe = rope_rotate(pe, cos, sin, interleaved)
        latent_cache.view(-1, rank).index_copy_(0, slot_mapping, c_kv.to(latent_cache.dtype))
        rope_cache.view(-1, rope_cache.shape[-1]).index_copy_(0, slot_mapping, k_pe.to(rope_cache.dtype))
        return c_kv, k_pe

    def mla_decode_attention(
        self, q_latent: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor, rope_cache: torch.Tensor,
        meta: AttentionMetadata, scale: float,
    ) -> torch.Tensor:
        """The absorbed decode: q_latent `(B, N, kv_lora_rank)` (q_nope times W_UK), q_pe `(B, N, rope_dim)`
        rotated; one query per sequence over its block table. scores = (q_latent . c_kv + q_pe . k_pe) x scale,
        values = c_kv. Returns `(B, N, kv_lora_rank)` (the layer applies W_UV, then o_proj). Reference: every
        sequence's cache rows gathered to the longest context, one SDPA with the heads on the query axis (MQA)."""
        if meta.cache is None:
            meta.cache = {}
        batch, heads, rank = q_latent.shape
        slots, length = mla_padded_slots(meta, latent_cache.shape[1])
        c_kv = latent_cache.view(-1, rank).index_select(0, slots).view(batch, 1, length, rank)
        k_pe = rope_cache.view(-1, rope_cache.shape[-1]).index_select(0, slots).view(batch, 1, length, -1)
        keys = torch.cat([c_kv, k_pe], dim=-1)
        query = torch.cat([q_latent, q_pe], dim=-1).unsqueeze(1)  # (B, 1, N, rank + rope)
        visible = torch.arange(length, device=slots.device).view(1, -1) < meta.context_lens.view(-1, 1)
        out = F.scaled_dot_product_attention(query, keys, c_kv, attn_mask=visible.view(batch, 1, 1, length),
                                             scale=scale)
        return out.view(batch, heads, rank)

    def mla_gather_context(
        self, latent_cache: torch.Tensor, rope_cache: torch.Tensor, meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every sequence's whole context (cached prefix and the new tokens, already written), concatenated in
        sequence order: (c_kv `(S, kv_lora_rank)`, k_pe `(S, rope_dim)`), S = sum(context_lens). The expanded
        prefill runs `kv_b_proj` over it (on Ascend: `npu_paged_cache_load`)."""
        if meta.cache is None:
            meta.cache = {}
        slots = meta.cache.get("mla_context_slots")
        if slots is None:
            block_size = latent_cache.shape[1]
            rows = []
            for b, length in enumerate(mla_host_lens(meta)[0]):
                pos = torch.arange(length, device=meta.block_tables.device)
                rows.append(meta.block_tables[b].index_select(0, pos // block_size) * block_size + pos % block_size)
            slots = torch.cat(rows)
            meta.cache["mla_context_slots"] = slots
        c_kv = latent_cache.view(-1, latent_cache.shape[-1]).index_select(0, slots)
        k_pe = rope_cache.view(-1, rope_cache.shape[-1]).index_select(0, slots)
        return c_kv, k_pe

    def mla_prefill_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, scale: float,
    ) -> torch.Tensor:
        """The expanded prefill: q `(T, N, qk_head_dim)` of the new tokens; k `(S, N, qk_head_dim)` and v
        `(S, N, v_head_dim)` of every sequence's whole context, laid out as `mla_gather_context` returns it. Causal:
        new token i of sequence b sees context rows 0 .. context_len - query_len + i. Returns `(T, N, v_head_dim)`."""
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        key_start = 0
        for b, (length, new) in enumerate(zip(*mla_host_lens(meta), strict=True)):
            lo = meta.query_start[b]
            qb = q[lo : lo + new].transpose(0, 1)  # (N, new, d)
            keys = slice(key_start, key_start + length)
            kb, vb = k[keys].transpose(0, 1), v[keys].transpose(0, 1)
            rows = torch.arange(new, device=q.device).view(-1, 1) + (length - new)
            mask = torch.arange(length, device=q.device).view(1, -1) <= rows
            out[lo : lo + new] = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale).transpose(0, 1)
            key_start += length
        return out

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        self.write_kv(kv_cache, k, v, meta.slot_mapping)
        if meta.decode_part is not None and meta.prefill_part is not None:
            # a mixed (chunked-prefill) step: the decodes as decodes, the chunks as prefills, then back in order
            num_decodes = meta.decode_part.batch_size
            return torch.cat([self.decode_attention(q[:num_decodes], kv_cache, meta.decode_part),
                              self.prefill_attention(q[num_decodes:], kv_cache, meta.prefill_part)])
        if meta.is_prefill:
            return self.prefill_attention(q, kv_cache, meta)
        return self.decode_attention(q, kv_cache, meta)

    # --- mixture of experts -------------------------------------------------------------------------------------

    def moe_select_experts(self, router_logits: torch.Tensor, moe: MoESpec,
                           correction_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's choice, as transformers computes it (the rules on `MoESpec`): router_logits `(T, E)` ->
        (weights `(T, K)` float32, routed_scaling_factor applied; expert ids `(T, K)` int32). `correction_bias`
        (E,): DeepSeek-V3's `e_score_correction_bias`, added to the scores for the choice only. The order of the K
        columns is not part of the contract (only the (id, weight) pairs of each row are)."""
        return select_experts(router_logits, moe, correction_bias)

    def moe_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                    w2: torch.Tensor) -> torch.Tensor:
        """The routed experts: x `(T, H)`, weights and ids `(T, K)` (from `moe_select_experts`), w13
        `(E, 2*I, H)` (each expert's gate rows, then its up rows: this rank's I), w2 `(E, H, I)` ->
        `(T, H)` in x's dtype, out[t] = sum_k weights[t, k] * w2[e] @ (silu(gate_e x[t]) * up_e x[t]) with
        e = ids[t, k]. Under tensor parallel this is this rank's partial sum; no all-reduce inside."""
        return grouped_experts(x, weights, ids, w13, w2)

    # --- int8 (W8A8) quantized weights --------------------------------------------------------------------------

    def int8_linear(self, x: torch.Tensor, layer: Int8Linear) -> torch.Tensor:
        """An int8 linear layer (`engine/model/int8.py` writes out the math of its scheme, `layer.method`): x
        `(..., K)` in the model's dtype -> `(..., N)` in x's dtype. The reference quantizes x, multiplies in int32
        and dequantizes in float32."""
        return int8_reference.int8_linear(x, layer)

    def moe_experts_int8(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                         experts: Int8Experts) -> torch.Tensor:
        """`moe_experts` over int8 experts (`Int8Experts`: per-row weight scales, activations quantized per token
        before each of the two matmuls)."""
        return grouped_experts(x, weights, ids, experts.w13, experts.w2,
                               lambda rows, e: int8_reference.int8_expert(rows, experts, e))


def select_experts(router_logits: torch.Tensor, moe: MoESpec,
                   correction_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of `Backend.moe_select_experts`, step for step as transformers' routers (float32)."""
    logits = router_logits.float()
    scores = logits.sigmoid() if moe.scoring_func == "sigmoid" else logits.softmax(dim=-1)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if moe.grouped:
        tokens, per_group = choice.shape[0], moe.num_experts // moe.n_group
        grouped = choice.view(tokens, moe.n_group, per_group)
        # DeepSeek-V3 (noaux_tc): a group's score is the sum of its best two; V2 (group_limited_greedy): its best
        group_scores = (grouped.topk(2, dim=-1).values.sum(dim=-1) if moe.topk_method == "noaux_tc"
                        else grouped.max(dim=-1).values)
        kept = group_scores.topk(moe.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        keep = keep.unsqueeze(-1).expand(-1, -1, per_group).reshape(tokens, moe.num_experts)
        # transformers masks with -inf for V3 (the biased scores may be negative) and 0.0 for V2 (softmax >= 0)
        choice = choice.masked_fill(~keep, float("-inf") if moe.topk_method == "noaux_tc" else 0.0)
    ids = choice.topk(moe.num_experts_per_tok, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)  # the un-biased scores (with no bias these are the top-k values themselves)
    if moe.norm_topk_prob:
        total = weights.sum(dim=-1, keepdim=True)
        weights = weights / (total + 1e-20 if moe.scoring_func == "sigmoid" else total)
    if moe.routed_scaling_factor != 1.0:
        weights = weights * moe.routed_scaling_factor
    return weights, ids.to(torch.int32)


# One expert's SwiGLU MLP over its rows: (rows (n, H), expert index) -> (n, H)
ExpertMLP = Callable[[torch.Tensor, int], torch.Tensor]


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                    w2: torch.Tensor, expert_mlp: ExpertMLP | None = None) -> torch.Tensor:
    """The torch reference of `Backend.moe_experts`: the (token, k) pairs sorted by expert, each selected expert's
    rows run as one contiguous group (only the experts the batch selects), weighted, summed back per token.
    `expert_mlp`: how one expert runs over its rows (default: `F.linear` on its slices of w13 and w2)."""
    top_k = ids.shape[1]
    flat = ids.reshape(-1).long()
    order = flat.argsort(stable=True)
    token_of = order // top_k  # the token of each sorted pair
    counts = torch.bincount(flat, minlength=w13.shape[0])
    rows = x.index_select(0, token_of)
    run = expert_mlp or (lambda r, e: linear_expert(r, w13[e], w2[e]))
    out = torch.empty_like(rows)
    start = 0
    for expert, n in enumerate(counts.tolist()):
        if n:
            out[start : start + n] = run(rows[start : start + n], expert)
            start += n
    scaled = (out.float() * weights.reshape(-1).index_select(0, order).unsqueeze(1).float()).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, token_of, scaled)


def linear_expert(rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert: w13 (2I, H) gate rows then up rows, w2 (H, I)."""
    h = nn.functional.linear(rows, w13)
    inter = w2.shape[1]
    return nn.functional.linear(nn.functional.silu(h[:, :inter]) * h[:, inter:], w2)


# --- helpers of the MLA reference ------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, cast back (as transformers' DeepseekV3RMSNorm)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return gamma * xf.to(x.dtype)


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x `(..., d)` rotated with `cos`/`sin` broadcastable to it (halves form, `Backend` MLA comment); an interleaved
    input is de-interleaved first, so the output is in the halves order."""
    if interleaved:
        x = x.reshape(*x.shape[:-1], -1, 2).transpose(-1, -2).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


def mla_host_lens(meta: AttentionMetadata) -> tuple[list[int], list[int]]:
    """The step's context and query lengths on the host, read once per step (one device sync, not one per layer)
    and shared by every latent-attention layer's prefill through `meta.cache`."""
    if meta.cache is None:
        meta.cache = {}
    lens: tuple[list[int], list[int]] | None = meta.cache.get("mla_host_lens")
    if lens is None:
        lens = meta.cache["mla_host_lens"] = (meta.context_lens.tolist(), meta.query_lens.tolist())
    return lens


def mla_padded_slots(meta: AttentionMetadata, block_size: int) -> tuple[torch.Tensor, int]:
    """The cache slots of every sequence's positions 0 .. max_context_len-1, `(B * L,)` (padding rows read slot
    garbage that the mask hides), and L; built once per step."""
    assert meta.cache is not None
    slots = meta.cache.get("mla_slots")
    length = meta.max_context_len
    if slots is None:
        positions = torch.arange(length, device=meta.block_tables.device)
        blocks = meta.block_tables.index_select(1, positions // block_size)
        slots = (blocks * block_size + positions % block_size).reshape(-1)
        meta.cache["mla_slots"] = slots
    return slots, length
