"""Paged decode attention in Triton, for the `cuda` backend (docs/engine.md#cuda-paged-decode-attention-triton; issue
14, part 3).

One query token per sequence attends over that sequence's KV, read straight from the per-layer paged cache
`(2, num_blocks, block_size, num_kv_heads, head_dim)` through its block table: no gather into a dense tensor.

One program per (sequence, KV head[, split]): it loads the `group` query heads that share the KV head as the rows
of one tile (padded to 16 rows for `tl.dot`), so GQA reads each K/V row once per group, not once per query head.
It walks the context in tiles of `BLOCK_N` token positions; each position finds its block in the block table and
its row in the block, so the tile size is independent of the cache's block size (any block size works, 1 included).
Softmax is online over the tiles (running max and sum, flash-decoding style), accumulated in fp32, scores in the
base-2 domain (`exp2`, the scale folded with log2 e). With `num_splits > 1` the tiles of a sequence are shared
between that many programs, each writing a partial output with its max and sum, and a second kernel merges them
(split-K, for small batches over long contexts). A sequence with context length 0 gets zeros (no NaN), so padded
rows of a bucketed batch are harmless.

Inputs may be fp32, fp16 or bf16 (q and the cache alike); fp32 inputs use IEEE fp32 products in `tl.dot` (never
TF32). Under Triton's interpreter (`TRITON_INTERPRET=1`) kernels run on CPU tensors. Set it before triton is
imported: each `triton.jit` reads it, and triton.language's own helpers used here (`tl.sum`, `tl.max`, `tl.cdiv`,
`tl.zeros`) are jitted when triton is imported; this module jits its kernels at first use, once per mode. The
interpreter does no bf16 arithmetic (its `tl.dot` multiplies bf16 operands as their raw uint16 bit patterns in
triton 3.9: triton-lang/triton#11584), so there, and only there, bf16 tiles are widened to fp32 before each
`tl.dot`: the same products (a bf16 x bf16 product is exact in fp32), the softmax weights still rounded to bf16.

Triton is imported behind a guard: importing this module never fails where triton is absent (the `cpu` backend
does not need it); calling the kernel there raises `RuntimeError`.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised by a test in a subprocess that hides triton
    triton = None
    tl = None

__all__ = ["HAS_TRITON", "interpreting", "paged_decode_attention"]

HAS_TRITON = triton is not None
DEFAULT_BLOCK_N = 64  # token positions per tile
_LOG2E = 1.4426950408889634
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _paged_decode_kernel(  # type: ignore[no-untyped-def]
    out_ptr, m_ptr, l_ptr, q_ptr, kv_ptr, block_tables_ptr, context_lens_ptr, qk_scale,
    stride_qb, stride_qh, stride_qd,
    stride_kv, stride_kblk, stride_ktok, stride_khead, stride_kdim,
    stride_bt,
    stride_ob, stride_oh, stride_os,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    FP32_DOT: tl.constexpr, WIDEN: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, DIM_PAD)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM

    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + dims[None, :] * stride_qd,
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if WIDEN:
        q = q.to(tl.float32)

    # this program's share of the sequence's tiles
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    num_tiles = tl.cdiv(context_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)

    k_base = kv_ptr + kv_head.to(tl.int64) * stride_khead
    v_base = k_base + stride_kv
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    offs_n = tl.arange(0, BLOCK_N)
    for tile in range(tile_lo, tile_hi):
        pos = tile * BLOCK_N + offs_n
        valid = pos < context_len  # the tile's first position always is: each row gets a finite max
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        token = block * stride_kblk + (pos % BLOCK_SIZE) * stride_ktok  # (BLOCK_N,) int64 offsets
        k = tl.load(k_base + token[None, :] + dims[:, None] * stride_kdim,
                    mask=valid[None, :] & dim_ok[:, None], other=0.0)  # (DIM_PAD, BLOCK_N): K transposed
        if WIDEN:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision="ieee") if FP32_DOT else tl.dot(q, k)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))  # (GROUP_PAD, BLOCK_N), log2 domain
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + token[:, None] + dims[None, :] * stride_kdim,
                    mask=valid[:, None] & dim_ok[None, :], other=0.0)  # (BLOCK_N, DIM_PAD)
        p_v = p.to(v.dtype)  # the weights in the cache's dtype, as a tensor-core product takes them
        if WIDEN:
            v = v.to(tl.float32)
            p_v = p_v.to(tl.float32)
        pv = tl.dot(p_v, v, input_precision="ieee") if FP32_DOT else tl.dot(p_v, v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_ptrs = out_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + split * stride_os + dims[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    if NUM_SPLITS > 1:
        stats = (seq.to(tl.int64) * num_heads + heads) * NUM_SPLITS + split
        tl.store(m_ptr + stats, m_i, mask=row_ok)
        tl.store(l_ptr + stats, l_i, mask=row_ok)


def _merge_splits_kernel(  # type: ignore[no-untyped-def]
    out_ptr, part_ptr, m_ptr, l_ptr,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLIT_PAD)
    dims = tl.arange(0, DIM_PAD)
    split_ok = splits < NUM_SPLITS
    dim_ok = dims < HEAD_DIM
    row = (seq.to(tl.int64) * tl.num_programs(1) + head) * NUM_SPLITS
    m = tl.load(m_ptr + row + splits, mask=split_ok, other=float("-inf"))
    l_s = tl.load(l_ptr + row + splits, mask=split_ok, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # every split empty (context 0): weights 0, output 0
    weight = tl.exp2(m - m_max) * l_s  # empty splits: exp2(-inf) * 0 = 0
    total = tl.sum(weight, 0)
    parts = tl.load(part_ptr + (row + splits)[:, None] * HEAD_DIM + dims[None, :],
                    mask=split_ok[:, None] & dim_ok[None, :], other=0.0)
    out = tl.sum(parts * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq.to(tl.int64) * stride_ob + head * stride_oh + dims,
             out.to(out_ptr.dtype.element_ty), mask=dim_ok)


def interpreting() -> bool:
    """Whether `triton.jit` would give the interpreter now (TRITON_INTERPRET, read as triton reads it)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on", "y")


@functools.cache
def _kernels(interpret: bool) -> tuple[Any, Any]:
    """The jitted kernels for one mode. `triton.jit` picks compiled or interpreted when it runs, from
    TRITON_INTERPRET, so they are jitted here (once per mode) rather than at import."""
    assert interpret == interpreting()
    return triton.jit(_paged_decode_kernel), triton.jit(_merge_splits_kernel)


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


def paged_decode_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
    scale: float, *, num_splits: int = 1, block_n: int = DEFAULT_BLOCK_N, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of one token per sequence over its paged KV.

    q: `(batch, heads, head_dim)`; kv_cache: `(2, num_blocks, block_size, kv_heads, head_dim)`, same dtype;
    block_tables: `(batch, max_blocks)` integers (entries past a sequence's blocks are never read);
    context_lens: `(batch,)` tokens of each sequence in the cache, the current one included (0 gives zeros);
    scale: the softmax scale (1/sqrt(head_dim) for the usual attention). Returns `(batch, heads, head_dim)` in
    q's dtype (into `out` when given). `num_splits` > 1 shares each sequence's tiles between that many programs.
    """
    if not HAS_TRITON:
        raise RuntimeError("paged_decode_attention needs triton, which is not installed")
    if q.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"expected q (batch, heads, dim) and kv_cache (2, blocks, block_size, kv_heads, dim); "
                         f"got {tuple(q.shape)} and {tuple(kv_cache.shape)}")
    batch, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, cache_dim = kv_cache.shape
    if cache_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads of dim {head_dim} do not fit {num_kv_heads} KV heads of dim "
                         f"{cache_dim}")
    if q.dtype != kv_cache.dtype or q.dtype not in _DTYPES:
        raise ValueError(f"q ({q.dtype}) and the cache ({kv_cache.dtype}) must share one of fp32, fp16, bf16")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or tuple(context_lens.shape) != (batch,):
        raise ValueError(f"block_tables {tuple(block_tables.shape)} and context_lens {tuple(context_lens.shape)} "
                         f"do not match a batch of {batch}")
    if block_n < 16 or block_n & (block_n - 1) or num_splits < 1:
        raise ValueError(f"block_n must be a power of two >= 16 (got {block_n}), num_splits >= 1 (got {num_splits})")
    interpret = interpreting()
    if not interpret and q.device.type != "cuda":
        raise ValueError(f"compiled Triton runs on CUDA tensors (got {q.device}); set TRITON_INTERPRET=1 to "
                         "interpret it on the CPU")
    result = out if out is not None else torch.empty_like(q, memory_format=torch.contiguous_format)
    if result.shape != q.shape or result.dtype != q.dtype or result.stride(-1) != 1:
        raise ValueError("out must be shaped and typed like q, with a contiguous last dimension")
    if batch == 0:
        return result
    decode_kernel, merge_kernel = _kernels(interpret)
    widen = interpret and q.dtype == torch.bfloat16

    group = num_heads // num_kv_heads
    dim_pad = _pow2(head_dim, 16)
    stride_kv, stride_kblk, stride_ktok, stride_khead, stride_kdim = kv_cache.stride()
    if num_splits == 1:
        target, m_buf, l_buf = result, result, result  # m and l are not written with one split
        stride_ob, stride_oh, stride_os = result.stride(0), result.stride(1), 0
    else:
        target = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        m_buf = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
        l_buf = torch.empty_like(m_buf)
        stride_ob, stride_oh, stride_os = target.stride(0), target.stride(1), target.stride(2)
    decode_kernel[(batch, num_kv_heads, num_splits)](
        target, m_buf, l_buf, q, kv_cache, block_tables, context_lens, scale * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        stride_kv, stride_kblk, stride_ktok, stride_khead, stride_kdim,
        block_tables.stride(0),
        stride_ob, stride_oh, stride_os,
        GROUP=group, GROUP_PAD=_pow2(group, 16), HEAD_DIM=head_dim, DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        FP32_DOT=q.dtype == torch.float32 or widen, WIDEN=widen,
        num_warps=4,
    )
    if num_splits > 1:
        merge_kernel[(batch, num_heads)](
            result, target, m_buf, l_buf, result.stride(0), result.stride(1),
            HEAD_DIM=head_dim, DIM_PAD=dim_pad, NUM_SPLITS=num_splits, SPLIT_PAD=_pow2(num_splits),
            num_warps=4,
        )
    return result
