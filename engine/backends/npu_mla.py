"""The npu backend's multi-head latent attention (DeepSeek-V2/V3), as vllm-ascend v0.11.0 `attention/mla_v1.py` runs
it (shared/notes/moe-mla-lws.md, section B; docs/engine.md, "The npu backend's kernels"):

- the cache write: one `npu_kv_rmsnorm_rope_cache(kv (T, 1, 1, kv_lora + rope), gamma, cos, sin, slots int64,
  rope_cache, latent_cache, epsilon=..., cache_mode="PA", is_output_kv=True)`, which RMS-normalises the latent,
  rotates the rope part and writes both caches, returning c_kv and k_pe. Its rope de-interleaves first (channel 2i
  pairs with 2i+1, the output in the halves order), which is DeepSeek's rope exactly as the reference
  (`Backend.mla_write_cache`, interleaved=True) computes it; a neox-rope model's k_pe is interleaved in torch before
  the op so that the op's de-interleave gives it back. cos and sin are the reference's halves-form rows.
- the decode: `npu_fused_infer_attention_score(q_latent (B, N, 1, kv_lora), latent (blocks, 1, bs, kv_lora) as key
  and value, query_rope=q_pe, key_rope=rope cache, num_heads=N, num_key_value_heads=1, input_layout="BNSD",
  scale, antiquant_mode=0, block_table int32, block_size, actual_seq_lengths_kv=host list)`.

The ops' MLA contracts (the torch_npu docs): the cache write normalises 512 channels and rotates 64; FIA's MLA takes
KV heads 1, query heads in {1, 2, 4, 8, 16, 32, 64, 128}, query D 512 (or 128), rope D 64, a block size that is a
multiple of 16 and at most 1024. DeepSeek-V2/V3 (kv_lora 512, rope 64, 16 or 128 heads and their power-of-two
tensor-parallel shares) fit. A model or a tensor-parallel split that does not (the tiny test presets' kv_lora 64 and
rope 16; heads per rank such as 128/3) falls back to the torch reference for that step, said once in the log with
the dimension that does not fit: the reference is plain torch and runs on the card too, slower.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from npuserve.engine.backends.base import AttentionMetadata, BackendUnavailableError
from npuserve.engine.backends.npu_stack import NPUStack

log = logging.getLogger(__name__)

CACHE_WRITE_LATENT = 512  # npu_kv_rmsnorm_rope_cache: gamma (512,)
FIA_LATENT = (512, 128)  # FIA MLA: query D 512 (or 128)
ROPE_DIM = 64  # both ops: rope D 64
FIA_QUERY_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
FIA_BLOCK_MULTIPLE, FIA_MAX_BLOCK = 16, 1024
KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def write_problem(kv_lora_rank: int, rope_dim: int, dtype: torch.dtype) -> str | None:
    """Why `npu_kv_rmsnorm_rope_cache` cannot write this layout, or None."""
    if kv_lora_rank != CACHE_WRITE_LATENT:
        return f"kv_lora_rank {kv_lora_rank} (npu_kv_rmsnorm_rope_cache normalises {CACHE_WRITE_LATENT})"
    if rope_dim != ROPE_DIM:
        return f"qk_rope_head_dim {rope_dim} (npu_kv_rmsnorm_rope_cache rotates {ROPE_DIM})"
    if dtype not in KERNEL_DTYPES:
        return f"dtype {dtype} (the MLA ops take float16 or bfloat16)"
    return None


def decode_problem(heads: int, kv_lora_rank: int, rope_dim: int, block_size: int, dtype: torch.dtype) -> str | None:
    """Why FIA's MLA decode cannot take this layout, or None."""
    if heads not in FIA_QUERY_HEADS:
        return f"{heads} query heads on this rank (FIA's MLA takes {', '.join(map(str, FIA_QUERY_HEADS))})"
    if kv_lora_rank not in FIA_LATENT:
        return f"kv_lora_rank {kv_lora_rank} (FIA's MLA query D is 512 or 128)"
    if rope_dim != ROPE_DIM:
        return f"qk_rope_head_dim {rope_dim} (FIA's MLA rope D is {ROPE_DIM})"
    if block_size % FIA_BLOCK_MULTIPLE or not 0 < block_size <= FIA_MAX_BLOCK:
        return f"block size {block_size} (FIA's paged attention: a multiple of 16, at most 1024)"
    if dtype not in KERNEL_DTYPES:
        return f"dtype {dtype} (the MLA ops take float16 or bfloat16)"
    return None


class NPUMLA:
    """The MLA ops of one stack (`ops`: the torch_npu module)."""

    def __init__(self, ops: Any, stack: NPUStack) -> None:
        self._ops, self.stack = ops, stack
        self._said: set[str] = set()

    def _fallback(self, what: str, problem: str) -> None:
        key = f"{what}: {problem}"
        if key not in self._said:
            self._said.add(key)
            log.warning("npu: MLA %s runs on the torch reference: %s", what, problem)

    def require(self) -> None:
        missing = self.stack.missing_mla()
        if missing:
            raise BackendUnavailableError(
                f"{self.stack.describe()} lacks {', '.join(missing)}, which the npu backend's multi-head latent "
                "attention calls (op-plugin 7.0.0 or later has them)")

    def write_cache(self, kv_a: torch.Tensor, gamma: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                    slot_mapping: torch.Tensor, latent_cache: torch.Tensor, rope_cache: torch.Tensor,
                    interleaved: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        rank, rope = latent_cache.shape[-1], rope_cache.shape[-1]
        problem = write_problem(rank, rope, latent_cache.dtype)
        if problem is not None:
            self._fallback("cache write", problem)
            return None
        self.require()
        tokens, dtype = kv_a.shape[0], latent_cache.dtype
        kv = kv_a.to(dtype)
        if not interleaved:  # neox pairs i with i + rope/2: interleave them, the op's de-interleave undoes it
            c, pe = kv[:, :rank], kv[:, rank:]
            kv = torch.cat([c, torch.stack(pe.chunk(2, dim=-1), dim=-1).flatten(-2)], dim=-1)
        _, _, k_pe, c_kv = self._ops.npu_kv_rmsnorm_rope_cache(
            kv.contiguous().view(tokens, 1, 1, rank + rope), gamma.to(dtype).contiguous(),
            cos.to(dtype).contiguous().view(tokens, 1, 1, rope), sin.to(dtype).contiguous().view(tokens, 1, 1, rope),
            slot_mapping.to(torch.int64).contiguous(), rope_cache, latent_cache,
            epsilon=float(eps), cache_mode="PA", is_output_kv=True)
        return c_kv.view(tokens, rank), k_pe.view(tokens, rope)

    def decode(self, q_latent: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor,
               rope_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: list[int],
               scale: float) -> torch.Tensor | None:
        batch, heads, rank = q_latent.shape
        blocks, block_size, _, rope = rope_cache.shape
        problem = decode_problem(heads, rank, rope, block_size, latent_cache.dtype)
        if problem is not None:
            self._fallback("decode", problem)
            return None
        self.require()
        dtype = latent_cache.dtype
        latent = latent_cache.view(blocks, 1, block_size, rank)
        out, _ = self._ops.npu_fused_infer_attention_score(
            q_latent.to(dtype).contiguous().view(batch, heads, 1, rank), latent, latent,
            query_rope=q_pe.to(dtype).contiguous().view(batch, heads, 1, rope),
            key_rope=rope_cache.view(blocks, 1, block_size, rope), num_heads=heads, num_key_value_heads=1,
            input_layout="BNSD", scale=float(scale), antiquant_mode=0, block_table=block_tables,
            block_size=block_size, actual_seq_lengths_kv=context_lens)
        result: torch.Tensor = out.view(batch, heads, rank)
        return result


def host_lengths(meta: AttentionMetadata) -> list[int]:
    """The context lengths as a host list (FIA's actual_seq_lengths_kv is an int[]), once per step."""
    if meta.cache is None:
        meta.cache = {}
    lens = meta.cache.get("npu_mla_lengths")
    if lens is None:
        lens = meta.cache["npu_mla_lengths"] = [int(n) for n in meta.context_lens.tolist()]
    result: list[int] = lens
    return result
