"""Fused Triton kernels for the `cuda` backend's `prepare_model`: RMSNorm, neox RoPE, SiLU-and-mul.

At batch 1 a decode step is bound by reading the weights, and every small elementwise kernel between the matrix
products costs a few microseconds on top: the model's eager RMSNorm is seven kernels, its rotary embedding about
twenty (two gathers, casts, four products, a cat, for q and for k), its SwiGLU two. Each is one kernel here, with
the eager modules' arithmetic and roundings: fp32 inside, rounded to the input dtype where they round.

- `rms_norm(x, weight, eps)`: `weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)`, one program per row.
- `rotary(positions, q, k, cos, sin)`: rotate-half (neox) RoPE of q and k from the fp32 half-width tables, one
  program per token over all its heads; q and k may be strided views of the fused QKV projection; new outputs.
- `silu_and_mul(x)`: `silu(x[:, :n]).to(dtype) * x[:, n:]`.

No host syncs and no shapes from host values: they capture in a CUDA graph. Under Triton's interpreter
(TRITON_INTERPRET=1) they run on CPU tensors, as triton_paged_attention.py does (triton imported behind a guard).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from npuserve.engine.backends.triton_paged_attention import HAS_TRITON, interpreting

if HAS_TRITON:
    import triton
    import triton.language as tl
else:  # pragma: no cover - the cpu backend never imports this module's kernels
    triton = None
    tl = None

__all__ = ["rms_norm", "rotary", "silu_and_mul"]

_SILU_BLOCK = 1024


def _rms_norm_kernel(  # type: ignore[no-untyped-def]
    out_ptr, x_ptr, w_ptr, stride_x, stride_o, eps, N: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / N + eps)
    normed = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded as the module rounds it
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=ok)


def _rotary_kernel(  # type: ignore[no-untyped-def]
    q_out_ptr, k_out_ptr, q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_table,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, KV_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    d = tl.arange(0, HALF_PAD)
    d_ok = d < HALF
    cos = tl.load(cos_ptr + pos * stride_table + d, mask=d_ok, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * stride_table + d, mask=d_ok, other=0.0)[None, :]

    h = tl.arange(0, HEADS_PAD)
    ok = (h < HEADS)[:, None] & d_ok[None, :]
    src = q_ptr + token * stride_qt + h[:, None] * stride_qh + d[None, :]
    x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
    dst = q_out_ptr + token * (HEADS * 2 * HALF) + h[:, None] * (2 * HALF) + d[None, :]
    tl.store(dst, (x1 * cos - x2 * sin).to(q_out_ptr.dtype.element_ty), mask=ok)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(q_out_ptr.dtype.element_ty), mask=ok)

    h = tl.arange(0, KV_PAD)
    ok = (h < KV_HEADS)[:, None] & d_ok[None, :]
    src = k_ptr + token * stride_kt + h[:, None] * stride_kh + d[None, :]
    x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
    dst = k_out_ptr + token * (KV_HEADS * 2 * HALF) + h[:, None] * (2 * HALF) + d[None, :]
    tl.store(dst, (x1 * cos - x2 * sin).to(k_out_ptr.dtype.element_ty), mask=ok)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(k_out_ptr.dtype.element_ty), mask=ok)


def _silu_and_mul_kernel(  # type: ignore[no-untyped-def]
    out_ptr, x_ptr, stride_x, stride_o, N: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + N + cols, mask=ok, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)  # torch rounds silu's output
    tl.store(out_ptr + row * stride_o + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=ok)


@functools.cache
def _kernels(interpret: bool) -> tuple[Any, Any, Any]:
    """Jitted once per mode (TRITON_INTERPRET is read when `triton.jit` runs)."""
    assert interpret == interpreting()
    return triton.jit(_rms_norm_kernel), triton.jit(_rotary_kernel), triton.jit(_silu_and_mul_kernel)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _check(*tensors: torch.Tensor) -> tuple[Any, Any, Any]:
    if not HAS_TRITON:
        raise RuntimeError("the fused kernels need triton, which is not installed")
    interpret = interpreting()
    if not interpret and any(t.device.type != "cuda" for t in tensors):
        raise ValueError("compiled Triton runs on CUDA tensors; set TRITON_INTERPRET=1 to interpret it on the CPU")
    return _kernels(interpret)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, as `layers.RMSNorm` computes it; a new tensor shaped like x."""
    kernel, _, _ = _check(x)
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = _pow2(n)
        kernel[(rows.shape[0],)](out, rows, weight, rows.stride(0), out.stride(0), eps, N=n, BLOCK=block,
                                 num_warps=max(1, min(16, block // 512)))
    return out.view(x.shape)


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of q `(tokens, heads, d)` and k `(tokens, kv_heads, d)` at `positions`, from fp32 tables
    `(max_positions, d / 2)`; new contiguous tensors, as `layers.RotaryEmbedding` returns."""
    _, kernel, _ = _check(q, k)
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    half = dim // 2
    if dim % 2 or q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1 or cos.stride() != sin.stride():
        raise ValueError("rotary wants an even head dim, unit-stride heads and matching contiguous tables")
    q_out = torch.empty((tokens, heads, dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((tokens, kv_heads, dim), dtype=k.dtype, device=k.device)
    if tokens:
        kernel[(tokens,)](q_out, k_out, q, k, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0),
                          k.stride(1), cos.stride(0), HEADS=heads, KV_HEADS=kv_heads, HEADS_PAD=_pow2(heads),
                          KV_PAD=_pow2(kv_heads), HALF=half, HALF_PAD=_pow2(half), num_warps=4)
    return q_out, k_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of x `(..., 2n)` = [gate | up], as `layers.silu_and_mul` computes it; `(..., n)`."""
    _, _, kernel = _check(x)
    n = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], n), dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        kernel[(rows.shape[0], triton.cdiv(n, _SILU_BLOCK))](out, rows, rows.stride(0), out.stride(0), N=n,
                                                             BLOCK=_SILU_BLOCK, num_warps=4)
    return out.view(*x.shape[:-1], n)
