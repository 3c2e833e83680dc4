"""The Ascend attention kernels' limits that decide the KV block size on npu, defined once: the engine refuses a
block size its kernels cannot take (engine/servable.py) and routes each step by them (engine/backends/npu.py); the
operator's plan refuses the same block size before it deploys (planning/planner.py). No torch here.

Sources (hiascend ATB operator documentation, CANN 8.0.RC2 to 9.1.0):
- PagedAttentionOperation (ascendtb_01_0198; ascendtb_01_0070): `block_size % 16 == 0`, `block_size x head_size <=
  128 x 128`, head size in (0, 256]; with parallel decoding (CALC_TYPE_SPEC, `_npu_paged_attention_splitfuse`)
  `block_size <= 128`. The decode kernel (`_npu_paged_attention`) and the chunked-prefill kernel use it.
- SelfAttention, calcType PREFIX_ENCODER (ascendtb_01_0266): block size exactly 128, the prefix (kvSeqLen - seqLen)
  128-aligned, K/V head size <= 128 and 16-aligned, the compressed [128, 128] causal mask
  (`_npu_flash_attention_qlens`).
- FusedInferAttentionScore, the MLA decode a model with latent attention runs instead of all of the above
  (torch_npu `npu_fused_infer_attention_score` doc): PageAttention block_size a multiple of 16, at most 1024.
vllm-project/vllm-ascend supports block size 128 only (attention/attention_v1.py: v0.11.0 get_supported_block_size,
2026 head get_supported_kernel_block_sizes, both [128]).
"""

from __future__ import annotations

NPU_BLOCK_SIZE = 128  # the default, and the only block size the prefix-encoder kernel takes
PAGED_BLOCK_MULTIPLE = 16
MAX_BLOCK_X_HEAD = 128 * 128
MAX_HEAD_SIZE = 256
SPLITFUSE_MAX_BLOCK_SIZE = 128
PREFIX_ENCODER_BLOCK_SIZE = 128
PREFIX_ENCODER_MAX_HEAD_SIZE = 128
PREFIX_ENCODER_HEAD_MULTIPLE = 16
PREFIX_ENCODER_PREFIX_MULTIPLE = 128
COMPRESSED_MASK_SIZE = 128  # the prefix-encoder kernel's NORM_COMPRESS mask
MLA_MAX_BLOCK_SIZE = 1024  # FIA's PageAttention (MLA decode)

NPU_BLOCK_RULE = (f"a multiple of {PAGED_BLOCK_MULTIPLE} up to {SPLITFUSE_MAX_BLOCK_SIZE} with cacheBlockSize x "
                  f"headDim <= {MAX_BLOCK_X_HEAD} (ATB PagedAttention); {NPU_BLOCK_SIZE} also lets the prefix-encoder "
                  "kernel take every prefill whose prefix is whole blocks")


NPU_MLA_BLOCK_RULE = (f"a multiple of {PAGED_BLOCK_MULTIPLE} up to {MLA_MAX_BLOCK_SIZE} for latent attention "
                      "(FIA's MLA decode)")


def npu_block_size_problem(block_size: int, head_dim: int) -> str | None:
    """Why the npu kernels cannot run a KV cache of `block_size` tokens per block and `head_dim`, or None."""
    if not 0 < head_dim <= MAX_HEAD_SIZE:
        return f"head size {head_dim}: the Ascend attention kernels take (0, {MAX_HEAD_SIZE}]"
    if block_size % PAGED_BLOCK_MULTIPLE or block_size <= 0:
        return f"cacheBlockSize {block_size} on npu: the paged-attention kernels take a multiple of " \
               f"{PAGED_BLOCK_MULTIPLE}; use {NPU_BLOCK_SIZE}"
    if block_size > SPLITFUSE_MAX_BLOCK_SIZE:
        return f"cacheBlockSize {block_size} on npu: the chunked-prefill kernel (paged attention with parallel " \
               f"decoding) takes at most {SPLITFUSE_MAX_BLOCK_SIZE}; use {NPU_BLOCK_SIZE}"
    if block_size * head_dim > MAX_BLOCK_X_HEAD:
        return f"cacheBlockSize {block_size} x head size {head_dim} = {block_size * head_dim} on npu: the " \
               f"paged-attention kernels take at most {MAX_BLOCK_X_HEAD} (128 x 128); use cacheBlockSize " \
               f"{MAX_BLOCK_X_HEAD // head_dim // PAGED_BLOCK_MULTIPLE * PAGED_BLOCK_MULTIPLE} or less"
    return None


def prefix_encoder_takes(block_size: int, head_dim: int) -> bool:
    """Whether the prefix-encoder kernel can run this cache at all (it then takes each prefill step whose every
    prefix is a multiple of 128)."""
    return (block_size == PREFIX_ENCODER_BLOCK_SIZE and head_dim <= PREFIX_ENCODER_MAX_HEAD_SIZE
            and head_dim % PREFIX_ENCODER_HEAD_MULTIPLE == 0)


def npu_mla_block_size_problem(block_size: int) -> str | None:
    """Why a model with latent attention (DeepSeek) cannot have `block_size` tokens per block on npu, or None: its
    cache goes to FIA's MLA decode only, never to the dense kernels above (whose block x head rule its qk head of
    192 would break at 128)."""
    if block_size % PAGED_BLOCK_MULTIPLE or not 0 < block_size <= MLA_MAX_BLOCK_SIZE:
        return (f"cacheBlockSize {block_size} on npu for latent attention: FIA's paged attention takes a multiple "
                f"of {PAGED_BLOCK_MULTIPLE} up to {MLA_MAX_BLOCK_SIZE}; use {NPU_BLOCK_SIZE}")
    return None


def block_size_problem(device: str, block_size: int, head_dim: int, *, latent_attention: bool = False) -> str | None:
    """Why the `device` backend cannot run this block size, or None (cpu and cuda take any). `latent_attention`:
    the model's attention is MLA (its own rule on npu)."""
    if device != "npu":
        return None
    return npu_mla_block_size_problem(block_size) if latent_attention else npu_block_size_problem(block_size, head_dim)
