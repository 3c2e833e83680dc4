"""The `npu` backend: Ascend cards through torch_npu (DESIGN.md 3.3; the ops as ../shared/notes/torch-npu-ops.md has
them, called the way vllm-ascend calls them).

- Device: `local_device_index` picks the card from MindIE's `npuDeviceIds` (logical ids) and the rank, checked
  against `ASCEND_RT_VISIBLE_DEVICES`; `torch.npu.set_device` makes it current; memory from `torch.npu.mem_get_info`.
- Cache write: `torch_npu.npu_scatter_pa_kv_cache` (cache_mode "Norm"), slots int32, k and v contiguous
  `(tokens, kv_heads, head_dim)`, into `kv_cache[0]` / `kv_cache[1]` shaped `(blocks, block_size, kv_heads, head_dim)`.
- Prefill: `torch_npu._npu_flash_attention` over the new tokens' own K and V with an `[S, S]` causal mask; when a
  sequence has a prefix-cache hit (context longer than its new tokens), `torch_npu._npu_flash_attention_qlens`
  over the cache through the block tables, with the 128 x 128 compressed causal mask.
- Decode: `torch_npu._npu_paged_attention` over the block tables (int32), context lengths int32 on the host.
- Outputs are preallocated (`torch.empty_like`) and written by the ops (`out=`).
- Tensor parallel: HCCL (`dist_backend`).
- Fused kernels (`prepare_model`): RMSNorm through `torch_npu.npu_rms_norm`, the MLP's SwiGLU through
  `torch_npu.npu_swiglu`, neox RoPE through `torch_npu.npu_rotary_mul` (signatures from Ascend's torch_npu API
  reference, op-plugin docs/context; the notes do not cover them).
- Decode graphs: off (`new_decode_graph` says why).

torch_npu is imported only when an `NPUBackend` is built: it needs Ascend's CANN runtime, and importing this module
must work anywhere. The per-step tensors the ops want in other dtypes or on the host (int32 block tables, host
lengths, the mask) are made once per step and shared by every layer through `AttentionMetadata.cache`.

Not here (later work): `npu_fused_infer_attention_score` (the notes give its call, not its return or the lengths'
types), decode graphs, auto sizing after a warm-up.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from typing import Any

import torch
from torch import nn

from npuserve.engine.backends.base import AttentionMetadata, Backend, BackendUnavailableError, MemoryInfo
from npuserve.engine.model.layers import RMSNorm, RotaryEmbedding, silu_and_mul
from npuserve.engine.model.llama import MLP

log = logging.getLogger(__name__)

VISIBLE_DEVICES_ENV = "ASCEND_RT_VISIBLE_DEVICES"
# The dtypes the Ascend attention kernels take (ATB flash/paged attention: float16 and bfloat16).
KERNEL_DTYPES = (torch.float16, torch.bfloat16)
# `_npu_flash_attention_qlens` takes a compressed causal mask of this size, whatever the lengths (as sglang's Ascend
# backend builds it; to be confirmed on hardware).
COMPRESSED_MASK_SIZE = 128


def parse_visible_devices(value: str | None) -> list[int] | None:
    """`ASCEND_RT_VISIBLE_DEVICES` ("0,1,4") as physical card ids; None when unset or empty."""
    if value is None or not value.strip():
        return None
    cards: list[int] = []
    for part in value.split(","):
        part = part.strip()
        if not part.isdigit():
            raise ValueError(f"{VISIBLE_DEVICES_ENV}={value!r}: expected comma-separated card ids such as '0,1'")
        cards.append(int(part))
    if len(set(cards)) != len(cards):
        raise ValueError(f"{VISIBLE_DEVICES_ENV}={value!r} names a card twice")
    return cards


def local_device_index(npu_device_ids: Seq[int] | None = None, rank: int = 0,
                       environ: Mapping[str, str] | None = None) -> int:
    """The index this rank passes to `torch.npu.set_device`.

    `npu_device_ids` is one instance's list from MindIE's `BackendConfig.npuDeviceIds`: logical ids, i.e. the
    runtime's numbering. With `ASCEND_RT_VISIBLE_DEVICES` set, the runtime numbers the cards it lists 0..n-1 in the
    listed order (as CUDA_VISIBLE_DEVICES does), so the ids index into that list; unset, logical ids are the
    physical ones. Rank r takes the list's r-th id; without a list, card r.
    """
    if rank < 0:
        raise ValueError(f"rank {rank} is negative")
    ids = list(npu_device_ids) if npu_device_ids is not None else None
    if ids is not None:
        if len(set(ids)) != len(ids):
            raise ValueError(f"npuDeviceIds {ids} names a card twice")
        if any(i < 0 for i in ids):
            raise ValueError(f"npuDeviceIds {ids} has a negative id")
        if rank >= len(ids):
            raise ValueError(f"rank {rank} has no card: npuDeviceIds {ids} lists {len(ids)}")
        index = ids[rank]
    else:
        index = rank
    visible = parse_visible_devices((os.environ if environ is None else environ).get(VISIBLE_DEVICES_ENV))
    if visible is not None and index >= len(visible):
        hint = ""
        if index in visible:
            hint = (f"; physical card {index} is logical id {visible.index(index)} (npuDeviceIds are logical ids, "
                    f"counted within {VISIBLE_DEVICES_ENV})")
        listed = ",".join(map(str, visible))
        raise ValueError(f"card {index} for rank {rank} is not visible: {VISIBLE_DEVICES_ENV}={listed} makes "
                         f"{len(visible)} card(s) visible, ids 0..{len(visible) - 1}{hint}")
    return index


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


def causal_mask(size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`[size, size]`, the masked positions (above the diagonal) as the Ascend kernels read them: float16 holds the
    float32 minimum (-inf once in float16), bfloat16 holds 1 (vllm-ascend's mask builder)."""
    if dtype not in KERNEL_DTYPES:
        raise ValueError(f"the Ascend attention kernels take float16 or bfloat16, not {dtype}")
    above = torch.ones(size, size, dtype=torch.bool).triu_(1)
    fill = torch.finfo(torch.float32).min if dtype == torch.float16 else 1.0
    mask = torch.zeros(size, size, dtype=torch.float32).masked_fill_(above, fill)
    return mask.to(dtype=dtype).to(device).contiguous()


# --- fused kernels (swapped into the model by `NPUBackend.prepare_model`) ------------------------------------------


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


class NPUBackend(Backend):
    """One Ascend card. `device`: where tensors live, `npu:<index>` by default (tests against the fake torch_npu pass
    the CPU, since only the real torch_npu can make an `npu` torch device)."""

    name = "npu"
    dist_backend = "hccl"  # `import torch_npu` registers it with torch.distributed

    def __init__(self, npu_device_ids: Seq[int] | None = None, rank: int = 0, *,
                 device: torch.device | None = None, environ: Mapping[str, str] | None = None) -> None:
        self._ops = _import_torch_npu()
        self._npu = _torch_npu_namespace()
        index = local_device_index(npu_device_ids, rank, environ)
        count = int(self._npu.device_count())
        if index >= count:
            raise BackendUnavailableError(
                f"card {index} for rank {rank} does not exist: torch_npu sees {count} card(s)")
        self._npu.set_device(index)
        self.device_index = index
        super().__init__(device if device is not None else torch.device("npu", index))
        self._masks: dict[torch.dtype, torch.Tensor] = {}  # the largest [S, S] causal mask built so far, per dtype
        self._compressed_masks: dict[torch.dtype, torch.Tensor] = {}

    # --- device -------------------------------------------------------------------------------------------------

    def memory_info(self) -> MemoryInfo:
        free, total = self._npu.mem_get_info(self.device_index)
        return MemoryInfo(free_bytes=int(free), total_bytes=int(total))

    def synchronize(self) -> None:
        self._npu.synchronize()

    def allocate_kv_cache(
        self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: torch.device | None = None,
    ) -> list[torch.Tensor]:
        if dtype not in KERNEL_DTYPES:
            raise ValueError(f"the Ascend attention kernels take float16 or bfloat16, not {dtype}: set the model's "
                             "dtype (npuserve.dtype) to float16 or bfloat16 on the npu backend")
        return super().allocate_kv_cache(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)

    # --- the model: fused kernels, decode graphs ------------------------------------------------------------------

    def prepare_model(self, model: nn.Module) -> None:
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
                    module.forward = FusedRMSNorm(self._ops, module)  # type: ignore[method-assign]
                    swapped["rms_norm"] += 1
                else:
                    module.forward = FusedRotary(self._ops, module)  # type: ignore[method-assign]
                    swapped["rotary"] += 1
            elif isinstance(module, MLP):
                act = getattr(module, "act_fn", None)
                if act is silu_and_mul:
                    setattr(module, "act_fn", FusedSwiGLU(self._ops))  # noqa: B010 (a hook mypy may not know)
                    swapped["swiglu"] += 1
                elif not isinstance(act, FusedSwiGLU):
                    log.debug("npu: %s keeps its eager SwiGLU: no `act_fn` hook holding silu_and_mul (found %r)",
                              name or "MLP", act)
        log.info("npu: fused kernels swapped in: %d RMSNorm, %d RoPE, %d SwiGLU", swapped["rms_norm"],
                 swapped["rotary"], swapped["swiglu"])

    def new_decode_graph(self) -> Any | None:
        """None: decode runs eagerly. `_npu_paged_attention` takes the context lengths as a host tensor, read when
        the kernel is launched; a captured `torch.npu.NPUGraph` would replay every step with the lengths of the
        capture (and `npu_fused_infer_attention_score` takes its kv lengths from the host too). vllm-ascend makes
        such graphs correct by capturing each layer's attention in its own task group
        (`torch.npu.graph_task_group_begin/end`) and, before every replay, re-issuing it with the step's lengths
        (`graph_task_update_begin/end` on a side stream, `_npu_paged_attention_get_workspace`, ordered by
        `torch.npu.ExternalEvent`s): a per-replay hook the device-generic decode graphs do not have, over APIs the
        notes do not record and no card here can check."""
        return None

    # --- per-step tensors (built once, shared by every layer) -----------------------------------------------------

    @staticmethod
    def _per_step(meta: AttentionMetadata, key: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """`make()` once per step: the metadata's cache is shared by every layer of the step."""
        if meta.cache is None:
            meta.cache = {}
        found = meta.cache.get(key)
        if found is None:
            found = meta.cache[key] = make()
        return found

    def _block_tables(self, meta: AttentionMetadata) -> torch.Tensor:
        return self._per_step(meta, "npu_block_tables",
                              lambda: meta.block_tables.to(device=self.device, dtype=torch.int32).contiguous())

    def _host_context_lens(self, meta: AttentionMetadata) -> torch.Tensor:
        """int32 on the host, as the kernels take them (one device-to-host copy per step)."""
        return self._per_step(meta, "npu_context_lens",
                              lambda: meta.context_lens.to(device="cpu", dtype=torch.int32).contiguous())

    def _host_query_lens(self, meta: AttentionMetadata) -> torch.Tensor:
        starts = meta.query_start
        return self._per_step(meta, "npu_query_lens", lambda: torch.tensor(
            [starts[b + 1] - starts[b] for b in range(meta.batch_size)], dtype=torch.int32))

    def _has_prefix_hit(self, meta: AttentionMetadata) -> bool:
        return bool((self._host_context_lens(meta) > self._host_query_lens(meta)).any())

    def _prefill_mask(self, meta: AttentionMetadata, dtype: torch.dtype) -> torch.Tensor:
        """The `[S, S]` causal mask of the step's longest sequence, contiguous."""

        def make() -> torch.Tensor:
            size = meta.max_context_len
            full = self._masks.get(dtype)
            if full is None or full.shape[0] < size:
                full = causal_mask(size, dtype, self.device)
                self._masks[dtype] = full
            return full[:size, :size].contiguous()

        return self._per_step(meta, "npu_prefill_mask", make)

    def _compressed_mask(self, dtype: torch.dtype) -> torch.Tensor:
        mask = self._compressed_masks.get(dtype)
        if mask is None:
            mask = causal_mask(COMPRESSED_MASK_SIZE, dtype, self.device)
            self._compressed_masks[dtype] = mask
        return mask

    def _slot_mapping(self, meta: AttentionMetadata) -> torch.Tensor:
        return self._per_step(meta, "npu_slot_mapping",
                              lambda: meta.slot_mapping.to(dtype=torch.int32).contiguous())

    # --- attention ----------------------------------------------------------------------------------------------

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        self._ops.npu_scatter_pa_kv_cache(
            key=k.contiguous(), value=v.contiguous(), key_cache=kv_cache[0], value_cache=kv_cache[1],
            slot_mapping=slot_mapping.to(dtype=torch.int32).contiguous(), cache_mode="Norm",
        )

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """As the base class, but a prefill without prefix hits attends over the new K and V as they are (no read
        back from the cache), and a mixed step's two parts write into one preallocated output."""
        self.write_kv(kv_cache, k, v, self._slot_mapping(meta))  # int32 already: converted once per step
        q = q.contiguous()
        if meta.decode_part is not None and meta.prefill_part is not None:
            num_decodes = meta.decode_part.batch_size
            out = torch.empty_like(q)
            self._decode(q[:num_decodes], kv_cache, meta.decode_part, out[:num_decodes])
            self._prefill(q[num_decodes:], k[num_decodes:], v[num_decodes:], kv_cache, meta.prefill_part,
                          out[num_decodes:])
            return out
        if meta.is_prefill:
            return self._prefill(q, k, v, kv_cache, meta, torch.empty_like(q))
        return self._decode(q, kv_cache, meta, torch.empty_like(q))

    def prefill_attention(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q = q.contiguous()
        out = torch.empty_like(q)
        if self._has_prefix_hit(meta):
            return self._prefill(q, None, None, kv_cache, meta, out)
        # K and V are in the cache only: read the new tokens' rows back through their slots
        _, num_blocks, block_size, heads, dim = kv_cache.shape
        slots = meta.slot_mapping.to(dtype=torch.long)
        k = kv_cache[0].view(num_blocks * block_size, heads, dim).index_select(0, slots)
        v = kv_cache[1].view(num_blocks * block_size, heads, dim).index_select(0, slots)
        return self._prefill(q, k, v, kv_cache, meta, out)

    def decode_attention(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q = q.contiguous()
        return self._decode(q, kv_cache, meta, torch.empty_like(q))

    def _prefill(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, kv_cache: torch.Tensor,
                 meta: AttentionMetadata, out: torch.Tensor) -> torch.Tensor:
        heads, dim = q.shape[1], q.shape[2]
        kv_heads = kv_cache.shape[3]
        scale = 1.0 / math.sqrt(dim)
        if self._has_prefix_hit(meta):
            self._ops._npu_flash_attention_qlens(
                query=q, key_cache=kv_cache[0], value_cache=kv_cache[1], block_table=self._block_tables(meta),
                mask=self._compressed_mask(q.dtype), seq_len=self._host_query_lens(meta),
                context_lens=self._host_context_lens(meta), num_kv_heads=kv_heads, num_heads=heads,
                scale_value=scale, out=out,
            )
        else:
            assert k is not None and v is not None, "a prefill without prefix hits attends over its own K and V"
            self._ops._npu_flash_attention(
                query=q, key=k.contiguous(), value=v.contiguous(), mask=self._prefill_mask(meta, q.dtype),
                seq_len=self._host_query_lens(meta), scale_value=scale, num_heads=heads, num_kv_heads=kv_heads,
                out=out,
            )
        return out

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                out: torch.Tensor) -> torch.Tensor:
        heads, dim = q.shape[1], q.shape[2]
        self._ops._npu_paged_attention(
            query=q, key_cache=kv_cache[0], value_cache=kv_cache[1], num_kv_heads=kv_cache.shape[3],
            num_heads=heads, scale_value=1.0 / math.sqrt(dim), block_table=self._block_tables(meta),
            context_lens=self._host_context_lens(meta), out=out,
        )
        return out
