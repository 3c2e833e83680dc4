"""The `npu` backend: Ascend cards through torch_npu, called as the production callers call it (vllm-project/
vllm-ascend v0.9.1 to its 2026 head, sgl-project/sglang's Ascend backend) and within each kernel's documented
contract (docs/engine.md, "The npu backend's kernels", has the signatures, the limits and their sources).

At start-up (`NPUBackend(...)`): the torch_npu stack is detected (`npu_stack.detect`: its op-plugin release line,
the ops present, whether the scatter write takes `cache_mode`); a stack without an op the backend calls is refused
(BackendUnavailableError naming it); the first ATB call is made on one token, since torch_npu loads NNAL's libatb.so
only then, so a missing NNAL is refused here and not in the first request; the card is picked and made current.
`configure` (the runner, before it allocates the cache) refuses a block size the kernels cannot take
(`npuserve.npu_contract`) and fixes the longest sequence the prefill mask must cover.

Each step goes to one kernel whose contract allows it:
- a decode step: `_npu_paged_attention` (int32 block tables, int32 context lengths on the host);
- a prefill step whose every prefix (context - new tokens) is a multiple of 128, on a 128-token block and a head
  size the prefix encoder takes: `_npu_flash_attention_qlens` over the cache with the compressed [128, 128] mask (as
  sglang runs every prefill; vllm-ascend its prefix-cache hits);
- a prefill step without any prefix otherwise: `_npu_flash_attention` over the new tokens' own K and V, with the
  causal mask built once at the longest sequence (`configure`'s max_seq_len) and passed whole every step;
- anything else (a chunked-prefill step, whose decodes ride with prompt chunks at any prefix; a prefix hit the
  prefix encoder cannot take): `_npu_paged_attention_splitfuse` over the whole step, with a per-token mask.
The cache write: `npu_scatter_pa_kv_cache(..., cache_mode="Norm")` where the op takes `cache_mode` (op-plugin
26.0.0 on), else `_npu_reshape_and_cache` (every line from 7.0.0). Outputs are preallocated and written by the ops.
Per-step tensors (int32 tables, host lengths, the SplitFuse mask, the kernel chosen) are made once per step and
shared by every layer through `AttentionMetadata.cache`.

Int8 (W8A8) layers (`int8_linear`, `moe_experts_int8`): `npu_int8.py`. Mixture of experts (`moe_select_experts`,
`moe_experts`): `npu_moe.py`; multi-head latent attention
(`mla_write_cache`, `mla_decode_attention`): `npu_mla.py`. Their ops are required only by a model that has MoE
layers or MLA (`prepare_model` refuses a stack without them, naming them); a shape an op's contract excludes runs on
the torch reference, said once in the log.

Memory: `memory_info` empties torch_npu's caching allocator before `mem_get_info` (as vllm-ascend's worker does), and
`measure_peak` reports a warm-up's peak, which KV sizing sets aside. Tensor parallel: HCCL. Fused kernels:
`npu_fused.py`. Decode graphs: off (`new_decode_graph` says why).

torch_npu is imported only when an `NPUBackend` is built: it needs Ascend's CANN runtime, and importing this module
must work anywhere.
"""

from __future__ import annotations

import importlib
import logging
import math
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from typing import Any

import torch
from torch import nn

from npuserve.engine.backends import npu_stack
from npuserve.engine.backends.base import AttentionMetadata, Backend, BackendUnavailableError, MemoryInfo
from npuserve.engine.backends.int8_reference import Int8Experts, Int8Linear
from npuserve.engine.backends.npu_device import local_device_index
from npuserve.engine.backends.npu_fused import swap_fused_kernels
from npuserve.engine.backends.npu_int8 import NPUInt8
from npuserve.engine.backends.npu_masks import causal_mask, check_kernel_dtype, splitfuse_mask
from npuserve.engine.backends.npu_mla import NPUMLA, host_lengths
from npuserve.engine.backends.npu_moe import NPUMoE, lay_out_experts
from npuserve.engine.backends.npu_stack import DECODE_OP, FLASH_OP, PREFIX_OP, SPLITFUSE_OP, NPUStack
from npuserve.modelspec import MoESpec
from npuserve.npu_contract import (
    COMPRESSED_MASK_SIZE,
    PREFIX_ENCODER_PREFIX_MULTIPLE,
    npu_block_size_problem,
    npu_mla_block_size_problem,
    prefix_encoder_takes,
)

log = logging.getLogger(__name__)

NNAL_SET_ENV = "/usr/local/Ascend/nnal/atb/set_env.sh"  # NNAL's default install (vllm-ascend's install guide)


def _import_torch_npu() -> Any:
    try:
        return importlib.import_module("torch_npu")
    except (ImportError, OSError) as e:  # OSError: torch_npu is installed but CANN's libraries are missing
        raise BackendUnavailableError(
            f"the npu backend needs torch_npu and Ascend's CANN runtime, and importing torch_npu failed: {e}"
        ) from e


def _torch_npu_namespace() -> Any:
    """`torch.npu`, which `import torch_npu` registers (absent from torch's own type stubs)."""
    return torch.npu  # type: ignore[attr-defined]


def refuse_unusable(stack: NPUStack) -> None:
    """BackendUnavailableError when the stack lacks an op the backend calls; a warning when it is untested."""
    missing = stack.missing()
    if missing:
        raise BackendUnavailableError(
            f"{stack.describe()} lacks {', '.join(missing)}, which the npu backend calls; supported: "
            + "; ".join(npu_stack.matrix_lines()))
    if stack.release is None:
        log.warning("npu: %s is not in the tested matrix (%s); its ops are present, so the engine goes on",
                    stack.describe(), "; ".join(npu_stack.matrix_lines()))
    mismatch = stack.torch_mismatch()
    if mismatch:
        log.warning("npu: %s", mismatch)


class NPUBackend(Backend):
    """One Ascend card. `device`: where tensors live, `npu:<index>` by default (tests against the fake torch_npu pass
    the CPU, since only the real torch_npu can make an `npu` torch device)."""

    name = "npu"
    dist_backend = "hccl"  # `import torch_npu` registers it with torch.distributed

    def __init__(self, npu_device_ids: Seq[int] | None = None, rank: int = 0, *,
                 device: torch.device | None = None, environ: Mapping[str, str] | None = None) -> None:
        self._ops = _import_torch_npu()
        self._npu = _torch_npu_namespace()
        self.stack = npu_stack.detect(self._ops, torch.__version__)
        refuse_unusable(self.stack)
        index = local_device_index(npu_device_ids, rank, environ)
        count = int(self._npu.device_count())
        if index >= count:
            raise BackendUnavailableError(
                f"card {index} for rank {rank} does not exist: torch_npu sees {count} card(s)")
        self._npu.set_device(index)
        self.device_index = index
        super().__init__(device if device is not None else torch.device("npu", index))
        self._check_nnal()
        self._max_seq_len: int | None = None  # set by `configure`: the prefill mask's size
        self._flash_masks: dict[torch.dtype, torch.Tensor] = {}
        self._compressed_masks: dict[torch.dtype, torch.Tensor] = {}
        self._mla_model = False  # set by `prepare_model`: every layer attends through the MLA methods
        self._moe = NPUMoE(self._ops, self.stack)
        self._mla = NPUMLA(self._ops, self.stack)
        self._int8 = NPUInt8(self._ops, self.stack, self._moe)

    def _check_nnal(self) -> None:
        """torch_npu loads NNAL's libatb.so at the first ATB call (op-plugin `op_plugin/python/atb/_atb_ops.py`) and
        raises OSError there; that call is made here, one token into a one-block cache."""
        key = torch.zeros(1, 1, 16, dtype=torch.float16, device=self.device)
        cache = torch.zeros(1, 16, 1, 16, dtype=torch.float16, device=self.device)
        slot = torch.zeros(1, dtype=torch.int32, device=self.device)
        try:
            self._ops._npu_reshape_and_cache(key=key, value=key, key_cache=cache, value_cache=cache.clone(),
                                             slot_indices=slot)
        except OSError as e:
            cann = self.stack.release.cann if self.stack.release else "matching CANN"
            raise BackendUnavailableError(
                f"NNAL (libatb.so, the ATB operators the npu backend calls) is not usable with {self.stack.describe()}:"
                f" {e}. Install NNAL {cann} and source {NNAL_SET_ENV} (it sets ATB_HOME_PATH and LD_LIBRARY_PATH)"
            ) from e

    # --- device -------------------------------------------------------------------------------------------------

    def memory_info(self) -> MemoryInfo:
        """Free memory once the caching allocator has returned what it holds (a warm-up's activations would count as
        used otherwise); `measure_peak` is what sets the activations aside."""
        self._npu.empty_cache()
        free, total = self._npu.mem_get_info(self.device_index)
        return MemoryInfo(free_bytes=int(free), total_bytes=int(total))

    def measure_peak(self, run: Callable[[], None]) -> int:
        self._npu.reset_peak_memory_stats(self.device_index)
        before = int(self._npu.memory_allocated(self.device_index))
        run()
        self.synchronize()
        return max(0, int(self._npu.max_memory_allocated(self.device_index)) - before)

    def synchronize(self) -> None:
        self._npu.synchronize()

    def configure(self, *, block_size: int, head_dim: int, max_seq_len: int) -> None:
        """The dense kernels' block-size rule; a model with latent attention (seen by `prepare_model`) calls none of
        them, so its cache takes FIA's rule instead (a multiple of 16 up to 1024; outside it, the reference)."""
        problem = (npu_block_size_problem(block_size, head_dim) if not self._mla_model
                   else npu_mla_block_size_problem(block_size))
        if problem is not None:
            raise ValueError(problem)
        if max_seq_len != self._max_seq_len:
            self._flash_masks.clear()
        self._max_seq_len = max_seq_len

    def allocate_kv_cache(
        self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: torch.device | None = None,
    ) -> list[torch.Tensor]:
        try:
            check_kernel_dtype(dtype)
        except ValueError as e:
            raise ValueError(f"{e}: set the model's dtype (npuserve.dtype) to float16 or bfloat16 on the npu "
                             "backend") from None
        return super().allocate_kv_cache(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)

    # --- the model: fused kernels, decode graphs ------------------------------------------------------------------

    def prepare_model(self, model: nn.Module) -> None:
        """The fused kernels; for a MoE or MLA model, its ops (BackendUnavailableError naming any the stack lacks)
        and, for MoE, the expert weights laid out for the grouped matmul (`npu_moe.lay_out_experts`); for int8
        layers, their ops, their weights laid out (K, N) and their scales (`npu_int8.NPUInt8.prepare`)."""
        spec = getattr(model, "spec", None)
        if getattr(spec, "moe", None) is not None:
            self._moe.require()
            log.info("npu: %d MoE expert weights laid out (E, K, N) for npu_grouped_matmul", lay_out_experts(model))
        if getattr(spec, "mla", None) is not None:
            self._mla.require()
            self._mla_model = True
        linears, experts = self._int8.prepare(model)
        if linears or experts:
            log.info("npu: %d int8 linear layers and %d int8 expert sets laid out (K, N) with their scales",
                     linears, experts)
        swap_fused_kernels(self._ops, model)

    def new_decode_graph(self) -> Any | None:
        """None: decode runs eagerly. `_npu_paged_attention` takes the context lengths as a host tensor, read when
        the kernel is launched; a captured `torch.npu.NPUGraph` would replay every step with the lengths of the
        capture. vllm-ascend makes such graphs correct by capturing each layer's attention in its own task group
        (`torch.npu.graph_task_group_begin/end`) and, before every replay, re-issuing it with the step's lengths
        (`graph_task_update_begin/end` on a side stream, `_npu_paged_attention_get_workspace`, ordered by
        `torch.npu.ExternalEvent`s): a per-replay hook the device-generic decode graphs do not have, over APIs no
        card here can check."""
        return None

    # --- mixture of experts, multi-head latent attention (npu_moe.py, npu_mla.py) ----------------------------------

    def moe_select_experts(self, router_logits: torch.Tensor, moe: MoESpec,
                           correction_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        chosen = self._moe.select(router_logits, moe, correction_bias)
        return chosen if chosen is not None else super().moe_select_experts(router_logits, moe, correction_bias)

    def moe_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                    w2: torch.Tensor) -> torch.Tensor:
        return self._moe.experts(x, weights, ids, w13, w2)

    # --- int8 (W8A8) layers (npu_int8.py) ----------------------------------------------------------------------------

    def int8_linear(self, x: torch.Tensor, layer: Int8Linear) -> torch.Tensor:
        return self._int8.linear(x, layer)

    def moe_experts_int8(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                         experts: Int8Experts) -> torch.Tensor:
        return self._int8.experts(x, weights, ids, experts)

    def allocate_mla_cache(
        self, num_layers: int, num_blocks: int, block_size: int, kv_lora_rank: int, rope_dim: int,
        dtype: torch.dtype, device: torch.device | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        try:
            check_kernel_dtype(dtype)
        except ValueError as e:
            raise ValueError(f"{e}: set the model's dtype (npuserve.dtype) to float16 or bfloat16 on the npu "
                             "backend") from None
        return super().allocate_mla_cache(num_layers, num_blocks, block_size, kv_lora_rank, rope_dim, dtype, device)

    def mla_write_cache(
        self, kv_a: torch.Tensor, gamma: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
        slot_mapping: torch.Tensor, latent_cache: torch.Tensor, rope_cache: torch.Tensor, interleaved: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        written = self._mla.write_cache(kv_a, gamma, eps, cos, sin, slot_mapping, latent_cache, rope_cache,
                                        interleaved)
        if written is not None:
            return written
        return super().mla_write_cache(kv_a, gamma, eps, cos, sin, slot_mapping, latent_cache, rope_cache,
                                       interleaved)

    def mla_decode_attention(
        self, q_latent: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor, rope_cache: torch.Tensor,
        meta: AttentionMetadata, scale: float,
    ) -> torch.Tensor:
        out = self._mla.decode(q_latent, q_pe, latent_cache, rope_cache, self._block_tables(meta),
                               host_lengths(meta), scale)
        if out is not None:
            return out
        return super().mla_decode_attention(q_latent, q_pe, latent_cache, rope_cache, meta, scale)

    # --- per-step tensors (built once, shared by every layer) -----------------------------------------------------

    @staticmethod
    def _per_step(meta: AttentionMetadata, key: str, make: Callable[[], Any]) -> Any:
        """`make()` once per step: the metadata's cache is shared by every layer of the step."""
        if meta.cache is None:
            meta.cache = {}
        found = meta.cache.get(key)
        if found is None:
            found = meta.cache[key] = make()
        return found

    def _block_tables(self, meta: AttentionMetadata) -> torch.Tensor:
        tables: torch.Tensor = self._per_step(
            meta, "npu_block_tables", lambda: meta.block_tables.to(device=self.device, dtype=torch.int32).contiguous())
        return tables

    def _host_context_lens(self, meta: AttentionMetadata) -> torch.Tensor:
        """int32 on the host, as the kernels take them (one device-to-host copy per step)."""
        lens: torch.Tensor = self._per_step(
            meta, "npu_context_lens", lambda: meta.context_lens.to(device="cpu", dtype=torch.int32).contiguous())
        return lens

    def _host_query_lens(self, meta: AttentionMetadata) -> torch.Tensor:
        starts = meta.query_start
        lens: torch.Tensor = self._per_step(meta, "npu_query_lens", lambda: torch.tensor(
            [starts[b + 1] - starts[b] for b in range(meta.batch_size)], dtype=torch.int32))
        return lens

    def _slot_mapping(self, meta: AttentionMetadata) -> torch.Tensor:
        slots: torch.Tensor = self._per_step(meta, "npu_slot_mapping",
                                             lambda: meta.slot_mapping.to(dtype=torch.int32).contiguous())
        return slots

    def kernel(self, meta: AttentionMetadata, kv_cache: torch.Tensor) -> str:
        """The op this step's attention runs on (the module docstring has the rule)."""

        def choose() -> str:
            if not meta.is_prefill:
                return DECODE_OP
            if meta.decode_part is not None:
                return SPLITFUSE_OP
            prefixes = self._host_context_lens(meta) - self._host_query_lens(meta)
            if (prefix_encoder_takes(kv_cache.shape[2], kv_cache.shape[4])
                    and bool((prefixes % PREFIX_ENCODER_PREFIX_MULTIPLE == 0).all())):
                return PREFIX_OP
            if not bool(prefixes.any()):
                return FLASH_OP
            return SPLITFUSE_OP

        chosen: str = self._per_step(meta, "npu_kernel", choose)
        return chosen

    def _flash_mask(self, meta: AttentionMetadata, dtype: torch.dtype) -> torch.Tensor:
        """The causal mask at the longest sequence, built once per dtype and passed whole (the kernel reads its
        top-left [S, S]). Without `configure` it is built at the longest step seen so far."""
        needed = meta.max_context_len
        mask = self._flash_masks.get(dtype)
        if mask is None or mask.shape[0] < needed:
            size = self._max_seq_len if self._max_seq_len is not None else needed
            if needed > size:
                raise ValueError(f"a prefill of {needed} tokens is longer than the {size} tokens (maxSeqLen) the "
                                 "prefill mask was built for")
            mask = self._flash_masks[dtype] = causal_mask(size, dtype, self.device)
        return mask

    def _compressed_mask(self, dtype: torch.dtype) -> torch.Tensor:
        mask = self._compressed_masks.get(dtype)
        if mask is None:
            mask = self._compressed_masks[dtype] = causal_mask(COMPRESSED_MASK_SIZE, dtype, self.device)
        return mask

    def _splitfuse_mask(self, meta: AttentionMetadata, dtype: torch.dtype) -> torch.Tensor:
        """`[tokens, longest context]`, each query token masked past its own position (once per step)."""

        def make() -> torch.Tensor:
            qlens = self._host_query_lens(meta).long()
            firsts = self._host_context_lens(meta).long() - qlens  # each sequence's first new position
            starts = torch.tensor(meta.query_start[:-1], dtype=torch.long)
            rows = torch.arange(int(qlens.sum()), dtype=torch.long)
            positions = torch.repeat_interleave(firsts - starts, qlens) + rows
            return splitfuse_mask(positions.to(self.device), meta.max_context_len, dtype)

        mask: torch.Tensor = self._per_step(meta, f"npu_splitfuse_mask_{dtype}", make)
        return mask

    # --- attention ----------------------------------------------------------------------------------------------

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        slots = slot_mapping.to(dtype=torch.int32).contiguous()
        if self.stack.scatter_cache_mode:
            self._ops.npu_scatter_pa_kv_cache(key=k.contiguous(), value=v.contiguous(), key_cache=kv_cache[0],
                                              value_cache=kv_cache[1], slot_mapping=slots, cache_mode="Norm")
        else:
            self._ops._npu_reshape_and_cache(key=k.contiguous(), value=v.contiguous(), key_cache=kv_cache[0],
                                             value_cache=kv_cache[1], slot_indices=slots)

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """As the base class, but the whole step (a chunked one's decodes and chunks together) runs on one kernel,
        and a prefill without a prefix on the flash kernel attends over the new K and V as they are."""
        self.write_kv(kv_cache, k, v, self._slot_mapping(meta))  # int32 already: converted once per step
        return self._attend(q.contiguous(), k, v, kv_cache, meta)

    def prefill_attention(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self._attend(q.contiguous(), None, None, kv_cache, meta)

    def decode_attention(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self._attend(q.contiguous(), None, None, kv_cache, meta)

    def _attend(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        out = torch.empty_like(q)
        heads, dim, kv_heads = q.shape[1], q.shape[2], kv_cache.shape[3]
        scale = 1.0 / math.sqrt(dim)
        kernel = self.kernel(meta, kv_cache)
        if kernel == DECODE_OP:
            self._ops._npu_paged_attention(
                query=q, key_cache=kv_cache[0], value_cache=kv_cache[1], num_kv_heads=kv_heads, num_heads=heads,
                scale_value=scale, block_table=self._block_tables(meta), context_lens=self._host_context_lens(meta),
                out=out)
        elif kernel == PREFIX_OP:
            self._ops._npu_flash_attention_qlens(
                query=q, key_cache=kv_cache[0], value_cache=kv_cache[1], block_table=self._block_tables(meta),
                mask=self._compressed_mask(q.dtype), seq_len=self._host_query_lens(meta),
                context_lens=self._host_context_lens(meta), num_kv_heads=kv_heads, num_heads=heads,
                scale_value=scale, out=out)
        elif kernel == FLASH_OP:
            if k is None or v is None:  # K and V are in the cache only: read the new tokens' rows back by slot
                _, num_blocks, block_size, _, _ = kv_cache.shape
                slots = meta.slot_mapping.to(dtype=torch.long)
                k = kv_cache[0].view(num_blocks * block_size, kv_heads, dim).index_select(0, slots)
                v = kv_cache[1].view(num_blocks * block_size, kv_heads, dim).index_select(0, slots)
            self._ops._npu_flash_attention(
                query=q, key=k.contiguous(), value=v.contiguous(), mask=self._flash_mask(meta, q.dtype),
                seq_len=self._host_query_lens(meta), scale_value=scale, num_heads=heads, num_kv_heads=kv_heads,
                out=out)
        else:
            self._ops._npu_paged_attention_splitfuse(
                query=q, key_cache=kv_cache[0], value_cache=kv_cache[1], block_table=self._block_tables(meta),
                context_lens=self._host_context_lens(meta), mask=self._splitfuse_mask(meta, q.dtype),
                seq_len=self._host_query_lens(meta), num_kv_heads=kv_heads, num_heads=heads, scale_value=scale,
                out=out)
        return out
