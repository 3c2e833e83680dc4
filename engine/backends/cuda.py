"""The `cuda` backend: NVIDIA GPUs (docs/engine.md#the-cuda-backend).

- Device: `cuda:<local rank>` (the Kubernetes device plugin sets CUDA_VISIBLE_DEVICES, so a pod's GPUs are numbered
  from 0), made current with `torch.cuda.set_device`; tensor-parallel all-reduces go over NCCL.
- Cache write: `Backend.write_kv` (`index_copy_` at the slot mapping): no host sync, so it captures in a graph.
- Prefill: torch SDPA (FlashAttention for fp16/bf16), GQA without repeating K/V (`enable_gqa`). A sequence without
  a prefix-cache hit attends causally over its own new K and V; consecutive such sequences of one length go in one
  call. A sequence with a hit attends over its context gathered from the cache by slot, the causal mask aligned to
  the bottom right (its new tokens are the context's last ones). One device-to-host copy per step: the context
  lengths, which decide that per sequence.
- Decode: the Triton paged kernel (`triton_paged_attention.py`) reading the block tables directly. Its grid and
  split count depend only on the batch size and the block table's width, never on `meta.max_context_len` or any
  other per-step host value, and it makes no host sync: a decode step captures in a CUDA graph
  (`engine/decode_graphs.py`) whose static block table is as wide as the longest sequence needs.
- Graphs: `torch.cuda.CUDAGraph`, captured under `torch.cuda.graph` with one memory pool shared by all batch sizes.
- Fused kernels (`prepare_model`): RMSNorm, neox RoPE and the MLP's SiLU-and-mul as one Triton kernel each
  (`triton_fused_ops.py`), in place of the eager modules' dozens of small kernels per layer.
- Swap: a device-to-host block copy completes before the host reads it (`copy_blocks`).
- Int8 (W8A8) weights: the reference's math (`int8_reference.py`) with the int32 product on `torch._int_mm`
  (cuBLAS int8 GEMM), whose CUDA kernel wants more than 16 rows and K, N multiples of 8: the rows are padded with
  zeros (`int_mm_rows`); a K or N that is not a multiple of 8 (tiny test models only) multiplies the int8 values in
  float32 instead, exact while |acc| < 2^24 (K below ~1000).

With a CPU device (the tests) the same code runs: the kernel under Triton's interpreter (TRITON_INTERPRET=1, set
before triton is imported), no graphs, memory figures from the host.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from npuserve.engine.backends import int8_reference, triton_fused_ops
from npuserve.engine.backends.base import (
    AttentionMetadata,
    Backend,
    BackendUnavailableError,
    MemoryInfo,
    grouped_experts,
)
from npuserve.engine.backends.int8_reference import Int8Experts, Int8Linear, int_mm_takes
from npuserve.engine.backends.triton_paged_attention import DEFAULT_BLOCK_N, paged_decode_attention
from npuserve.engine.model.layers import RMSNorm, RotaryEmbedding, silu_and_mul
from npuserve.engine.model.llama import MLP

log = logging.getLogger(__name__)

# Split-K: a decode step's programs (sequences x KV heads) are spread over up to this many splits so that a small
# batch still fills the GPU's multiprocessors; each split past the first costs a partial result and a merge.
MAX_DECODE_SPLITS = 16
# The multiprocessor count assumed off the GPU (the interpreter tier): small, so the tests' batches get split.
INTERPRETER_SMS = 8


INT_MM_MIN_ROWS = 17  # torch._int_mm on CUDA: M > 16, and M, K, N multiples of 8


def int_mm_rows(rows: int) -> int:
    """The row count `torch._int_mm` takes on CUDA for `rows` rows: above 16 and a multiple of 8."""
    return -(-max(rows, INT_MM_MIN_ROWS) // 8) * 8


def cuda_int32_matmul(x_q: torch.Tensor, w_q: torch.Tensor) -> torch.Tensor:
    """`int8_reference.int32_matmul` for CUDA: x_q (T, K) int8 . w_q (N, K)^T -> (T, N) int32."""
    rows, k = x_q.shape
    n = w_q.shape[0]
    if not int_mm_takes(k, n):  # exact while |acc| < 2^24 (K * 127 * 128): the tiny test models
        return torch.round(x_q.float() @ w_q.float().t()).to(torch.int32)
    padded = int_mm_rows(rows)
    if padded != rows:
        x_q = torch.cat([x_q, x_q.new_zeros((padded - rows, k))])
    return torch._int_mm(x_q.contiguous(), w_q.t())[:rows]


def decode_splits(batch: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Splits per sequence of a decode step: enough programs for every multiprocessor, no more splits than the
    widest context has tiles. `max_context` is the block table's width in tokens (a shape: fixed under a graph)."""
    wanted = -(-num_sms // max(1, batch * num_kv_heads))
    tiles = max(1, -(-max_context // DEFAULT_BLOCK_N))
    return max(1, min(MAX_DECODE_SPLITS, wanted, tiles))


class FusedRMSNorm:
    """An `RMSNorm`'s forward as one kernel; an input of another dtype than the weight takes the module's own
    forward (its type promotion)."""

    def __init__(self, norm: RMSNorm) -> None:
        self.norm = norm
        self.eager = norm.forward  # the class's method, bound before the swap

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.norm.weight.dtype:
            return self.eager(x)
        return triton_fused_ops.rms_norm(x, self.norm.weight, self.norm.eps)


class FusedRotary:
    """A `RotaryEmbedding`'s forward as one kernel for q and k, from the module's own fp32 tables."""

    def __init__(self, rotary: RotaryEmbedding) -> None:
        self.rotary = rotary

    def __call__(self, positions: torch.Tensor, q: torch.Tensor,
                 k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return triton_fused_ops.rotary(positions, q, k, self.rotary.cos, self.rotary.sin)


class CUDABackend(Backend):
    name = "cuda"
    dist_backend = "nccl"

    def __init__(self, device: torch.device | None = None) -> None:
        device = device if device is not None else torch.device("cuda", 0)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise BackendUnavailableError("the cuda backend needs a CUDA GPU, and torch sees none")
            if (device.index or 0) >= torch.cuda.device_count():
                raise BackendUnavailableError(f"GPU {device.index} does not exist: torch sees "
                                              f"{torch.cuda.device_count()} (CUDA_VISIBLE_DEVICES numbers them from 0)")
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(device)
            self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        else:  # the interpreter tier: the same attention code over CPU tensors
            self.num_sms = INTERPRETER_SMS
        super().__init__(device)

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    # --- the model ----------------------------------------------------------------------------------------------

    def prepare_model(self, model: nn.Module) -> None:
        """Swaps the fused kernels into the model's leaf pieces, leaving every parameter, module and the collectives
        around them as they are: each `RMSNorm`'s and `RotaryEmbedding`'s forward (an instance attribute over the
        class's method) and each `MLP`'s `act_fn` hook when it holds `silu_and_mul`. Idempotent."""
        swapped = {"rms_norm": 0, "rotary": 0, "silu_and_mul": 0}
        for module in model.modules():
            if isinstance(module, RMSNorm) and not isinstance(module.__dict__.get("forward"), FusedRMSNorm):
                module.forward = FusedRMSNorm(module)  # type: ignore[method-assign]
                swapped["rms_norm"] += 1
            elif isinstance(module, RotaryEmbedding) and not isinstance(module.__dict__.get("forward"), FusedRotary):
                module.forward = FusedRotary(module)  # type: ignore[method-assign]
                swapped["rotary"] += 1
            elif isinstance(module, MLP) and getattr(module, "act_fn", None) is silu_and_mul:
                setattr(module, "act_fn", triton_fused_ops.silu_and_mul)  # noqa: B010 (a hook mypy may not know)
                swapped["silu_and_mul"] += 1
        log.info("cuda: fused kernels swapped in: %s", swapped)

    # --- int8 (W8A8) weights ---------------------------------------------------------------------------------

    def int8_linear(self, x: torch.Tensor, layer: Int8Linear) -> torch.Tensor:
        return int8_reference.int8_linear(x, layer, cuda_int32_matmul)

    def moe_experts_int8(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                         experts: Int8Experts) -> torch.Tensor:
        return grouped_experts(x, weights, ids, experts.w13, experts.w2,
                               lambda rows, e: int8_reference.int8_expert(rows, experts, e, cuda_int32_matmul))

    # --- device -------------------------------------------------------------------------------------------------

    def memory_info(self) -> MemoryInfo:
        if not self.on_gpu:
            from npuserve.engine.backends.cpu import CPUBackend

            return CPUBackend().memory_info()
        free, total = torch.cuda.mem_get_info(self.device)
        return MemoryInfo(free_bytes=int(free), total_bytes=int(total))

    def synchronize(self) -> None:
        if self.on_gpu:
            torch.cuda.synchronize(self.device)

    def new_decode_graph(self) -> Any | None:
        return torch.cuda.CUDAGraph() if self.on_gpu else None

    def graph_capture(self, graph: Any, pool: Any | None) -> AbstractContextManager[Any]:
        if not self.on_gpu:
            return super().graph_capture(graph, pool)
        return torch.cuda.graph(graph, pool=pool)

    # --- attention ----------------------------------------------------------------------------------------------

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """As the base class, but prefills attend over the new K and V where they can (no read back from the cache)
        and a mixed step's two parts write into one output."""
        self.write_kv(kv_cache, k, v, meta.slot_mapping)
        if meta.decode_part is not None and meta.prefill_part is not None:
            num_decodes = meta.decode_part.batch_size
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            self._decode(q[:num_decodes], kv_cache, meta.decode_part, out[:num_decodes])
            self._prefill(q[num_decodes:], k[num_decodes:], v[num_decodes:], kv_cache, meta.prefill_part,
                          out[num_decodes:])
            return out
        if meta.is_prefill:
            return self._prefill(q, k, v, kv_cache, meta, torch.empty(q.shape, dtype=q.dtype, device=q.device))
        return self._decode(q, kv_cache, meta, None)

    def prefill_attention(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self._prefill(q, None, None, kv_cache, meta, torch.empty(q.shape, dtype=q.dtype, device=q.device))

    def decode_attention(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self._decode(q, kv_cache, meta, None)

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                out: torch.Tensor | None) -> torch.Tensor:
        batch, _, dim = q.shape
        block_size, kv_heads = kv_cache.shape[2], kv_cache.shape[3]
        splits = decode_splits(batch, kv_heads, meta.block_tables.shape[1] * block_size, self.num_sms)
        return paged_decode_attention(q, kv_cache, meta.block_tables, meta.context_lens, dim**-0.5,
                                      num_splits=splits, out=out)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, kv_cache: torch.Tensor,
                 meta: AttentionMetadata, out: torch.Tensor) -> torch.Tensor:
        """Into `out` (q's shape): each sequence's new tokens over its context. Without `k`/`v`, every sequence's
        K and V are read from the cache (they were written there first)."""
        heads, dim = q.shape[1], q.shape[2]
        starts = meta.query_start
        context_lens = self._host_context_lens(meta)
        b = 0
        while b < meta.batch_size:
            lo, length = starts[b], starts[b + 1] - starts[b]
            if k is not None and v is not None and context_lens[b] == length:
                end = b + 1  # the run of sequences of this length without a prefix hit: one call
                while end < meta.batch_size and starts[end + 1] - starts[end] == length == context_lens[end]:
                    end += 1
                hi, n = starts[end], end - b
                # (n * L, heads, d) -> (n, heads, L, d); k and v are views of the fused projection (strided rows)
                qs, ks, vs = (x[lo:hi].view(n, length, x.shape[1], dim).transpose(1, 2) for x in (q, k, v))
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
                out[lo:hi].view(n, length, heads, dim).copy_(o.transpose(1, 2))
                b = end
                continue
            context = context_lens[b]
            ks, vs = self._context_kv(kv_cache, meta, b, context)  # (1, kv_heads, context, d) each
            qs = q[lo : lo + length].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=causal_lower_right(length, context),
                                               enable_gqa=True)
            out[lo : lo + length].copy_(o[0].transpose(0, 1))
            b += 1
        return out

    @staticmethod
    def _host_context_lens(meta: AttentionMetadata) -> list[int]:
        """The context lengths on the host: one copy per step, shared by every layer (prefill only)."""
        if meta.cache is None:
            meta.cache = {}
        lens = meta.cache.get("cuda_host_context_lens")
        if lens is None:
            lens = meta.cache["cuda_host_context_lens"] = meta.context_lens.cpu()
        return [int(n) for n in lens.tolist()]

    @staticmethod
    def _context_kv(kv_cache: torch.Tensor, meta: AttentionMetadata, b: int,
                    context: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence b's K and V at positions 0..context-1, gathered by slot: `(1, kv_heads, context, d)` each."""
        _, num_blocks, block_size, heads, dim = kv_cache.shape
        assert meta.cache is not None
        positions = meta.cache.get("cuda_positions")
        if positions is None:  # shared by every sequence and layer of the step
            positions = meta.cache["cuda_positions"] = torch.arange(meta.max_context_len,
                                                                    device=meta.block_tables.device)
        pos = positions[:context]
        slots = meta.block_tables[b].index_select(0, pos // block_size) * block_size + pos % block_size
        flat = kv_cache.view(2, num_blocks * block_size, heads, dim)
        k = flat[0].index_select(0, slots).transpose(0, 1).unsqueeze(0)
        v = flat[1].index_select(0, slots).transpose(0, 1).unsqueeze(0)
        return k, v
