"""The `cpu` backend: paged KV cache in host memory, attention on torch SDPA.

Both prefill and decode gather each sequence's blocks into one padded batch and run a single SDPA call for the
whole batch (no per-sequence loop). Grouped-query attention folds the query heads of a KV head into the query
axis, so K and V are never repeated: q `(B, kv_heads, group * q_len, d)` against k `(B, kv_heads, L, d)`.

Mixture of experts: the base's grouped reference, except that `prepare_model` hands each expert's weights to
oneDNN once, packed in its blocked layout (`torch.ops.mkldnn._reorder_linear_weight`), where this torch has it:
a routed expert's matmul has only a few rows (its tokens), and on those the packed matmul is 1.7x (one thread) to
2x (two) faster than `F.linear` (32 tokens, 64 experts top-8, hidden 512, intermediate 256; one row: F.linear,
which is then as fast or faster, is kept). The packed copy
doubles the expert weights' host memory; the parameters stay as they are (the loader's, the other ranks').
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from npuserve.engine.backends.base import AttentionMetadata, Backend, MemoryInfo, grouped_experts, linear_expert
from npuserve.engine.model.int8 import Int8Experts

log = logging.getLogger(__name__)


def _pack_experts(w13: torch.Tensor, w2: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """Each expert's weights in oneDNN's packed layout, or None where this torch has no such op (or it computes
    something else than `F.linear` on a probe)."""
    if w13.device.type != "cpu" or w13.dtype not in (torch.float32, torch.bfloat16) \
            or not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return None
    try:
        with torch.inference_mode():
            packed = [(torch.ops.mkldnn._reorder_linear_weight(w13[e]), torch.ops.mkldnn._reorder_linear_weight(w2[e]))
                      for e in range(w13.shape[0])]
            probe = torch.randn(3, w13.shape[2], generator=torch.Generator().manual_seed(0)).to(w13.dtype)
            got = torch.ops.mkldnn._linear_pointwise(probe, packed[0][0], None, "none", [], "")
            want = F.linear(probe, w13[0])
    except (RuntimeError, AttributeError) as e:
        log.info("no packed expert weights (%s): the experts run on F.linear", e)
        return None
    tolerance = 1e-4 if w13.dtype == torch.float32 else 2e-2
    if not torch.allclose(got.float(), want.float(), rtol=tolerance, atol=tolerance):
        log.warning("oneDNN's packed linear disagrees with F.linear on a probe: the experts run on F.linear")
        return None
    return packed


def _meminfo() -> dict[str, int]:
    values: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                values[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return values


class CPUBackend(Backend):
    name = "cpu"

    def __init__(self, device: torch.device | None = None) -> None:
        super().__init__(device or torch.device("cpu"))
        # w13's data pointer -> each expert's (packed w13, packed w2), from `prepare_model`
        self._packed_experts: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    # --- mixture of experts -------------------------------------------------------------------------------------

    def prepare_model(self, model: nn.Module) -> None:
        self._packed_experts.clear()
        for module in model.modules():
            if isinstance(module, Int8Experts):
                continue  # int8 experts run the int8 reference (moe_experts_int8): nothing to pack
            w13, w2 = getattr(module, "w13", None), getattr(module, "w2", None)
            if isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor):
                packed = _pack_experts(w13, w2)
                if packed is None:
                    return  # this torch cannot pack: every layer runs the reference
                self._packed_experts[w13.data_ptr()] = packed

    def moe_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                    w2: torch.Tensor) -> torch.Tensor:
        packed = self._packed_experts.get(w13.data_ptr())
        if packed is None or x.dtype != w13.dtype:
            return super().moe_experts(x, weights, ids, w13, w2)
        inter = w2.shape[2]

        def run(rows: torch.Tensor, expert: int) -> torch.Tensor:
            if rows.shape[0] == 1:  # one row: F.linear's matrix-vector product beats the packed matmul
                return linear_expert(rows, w13[expert], w2[expert])
            p13, p2 = packed[expert]
            h = torch.ops.mkldnn._linear_pointwise(rows, p13, None, "none", [], "")
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(F.silu(h[:, :inter]) * h[:, inter:], p2, None,
                                                                   "none", [], "")
            return out

        return grouped_experts(x, weights, ids, w13, w2, run)

    def memory_info(self) -> MemoryInfo:
        info = _meminfo()
        total = info.get("MemTotal", 0)
        return MemoryInfo(free_bytes=info.get("MemAvailable", total), total_bytes=total)

    # --- attention ----------------------------------------------------------------------------------------------

    def _gather(self, kv_cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's K and V, padded to the longest context: `(B, kv_heads, L, d)` each.

        Gathers token slots, not whole blocks: with MindIE's 128-token blocks a whole-block gather copies up to a
        block of padding per sequence, every layer (a third of a decode step on the CPU)."""
        _, num_blocks, block_size, heads, dim = kv_cache.shape
        batch = meta.block_tables.shape[0]
        length = meta.max_context_len
        assert meta.cache is not None
        slots = meta.cache.get("slots")
        if slots is None:  # the same for every layer: built once per step
            positions = torch.arange(length, device=meta.block_tables.device)
            blocks = meta.block_tables.index_select(1, positions // block_size)
            slots = (blocks * block_size + positions % block_size).reshape(-1)
            meta.cache["slots"] = slots
        flat = kv_cache.view(2, num_blocks * block_size, heads * dim)
        k = flat[0].index_select(0, slots).view(batch, length, heads, dim)
        v = flat[1].index_select(0, slots).view(batch, length, heads, dim)
        return k.transpose(1, 2), v.transpose(1, 2)

    def _mask(self, meta: AttentionMetadata, key: str, query_len: int) -> torch.Tensor:
        """Boolean `(B, 1, query_len, L)`: key j is visible to new token i of sequence b when it is in the
        context and not after the token (`j <= start_b + i`, start_b = context_len - query_len)."""
        assert meta.cache is not None
        mask = meta.cache.get(key)
        if mask is None:
            keys = torch.arange(meta.max_context_len, device=meta.context_lens.device)
            queries = torch.arange(query_len, device=meta.context_lens.device)
            start = (meta.context_lens - meta.query_lens).view(-1, 1, 1)
            visible = keys.view(1, 1, -1) <= start + queries.view(1, -1, 1)
            mask = (visible & (keys.view(1, 1, -1) < meta.context_lens.view(-1, 1, 1))).unsqueeze(1)
            meta.cache[key] = mask
        return mask

    def decode_attention(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if meta.cache is None:
            meta.cache = {}
        batch, heads, dim = q.shape
        kv_heads = kv_cache.shape[3]
        k, v = self._gather(kv_cache, meta)
        mask = self._mask(meta, "decode", 1)  # (B, 1, 1, L): broadcast over kv heads and the group axis
        qg = q.view(batch, kv_heads, heads // kv_heads, dim)
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask)
        return out.reshape(batch, heads, dim)

    def prefill_attention(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if meta.cache is None:
            meta.cache = {}
        _tokens, heads, dim = q.shape
        kv_heads = kv_cache.shape[3]
        group = heads // kv_heads
        batch, max_q = meta.batch_size, meta.max_query_len
        k, v = self._gather(kv_cache, meta)
        rows = meta.cache.get("rows")
        if rows is None:
            # Row of each new token in the padded (B * max_q) layout.
            rows = torch.cat([
                torch.arange(meta.query_start[b], meta.query_start[b + 1]) - meta.query_start[b] + b * max_q
                for b in range(batch)
            ]).to(q.device)
            meta.cache["rows"] = rows
        if batch == 1:
            padded = q.view(1, max_q, heads, dim)
        else:
            padded = q.new_zeros(batch * max_q, heads, dim)
            padded.index_copy_(0, rows, q)
            padded = padded.view(batch, max_q, heads, dim)
        # (B, max_q, kvh, group, d) -> (B, kvh, group * max_q, d)
        qg = padded.view(batch, max_q, kv_heads, group, dim).permute(0, 2, 3, 1, 4).reshape(
            batch, kv_heads, group * max_q, dim
        )
        mask = self._mask(meta, "prefill", max_q)  # (B, 1, max_q, L)
        gmask = meta.cache.get("prefill_group")
        if gmask is None:
            gmask = mask.unsqueeze(2).expand(batch, 1, group, max_q, mask.shape[-1]).reshape(
                batch, 1, group * max_q, mask.shape[-1]
            )
            meta.cache["prefill_group"] = gmask
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=gmask)
        # back to (B * max_q, heads, d), then the real rows
        out = out.view(batch, kv_heads, group, max_q, dim).permute(0, 3, 1, 2, 4).reshape(batch * max_q, heads, dim)
        if batch == 1:
            return out
        return out.index_select(0, rows)
