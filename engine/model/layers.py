"""Building blocks of the Llama family: RMSNorm, rotary embedding (with the config's scaling), SwiGLU."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Computed in float32 and cast back, as transformers does, so low-precision runs match it.
        if x.dtype == torch.float32:  # one fused op on the common CPU path
            return nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling (transformers `_compute_llama3_parameters`)."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction (transformers' `get_mscale` / `yarn_get_mscale`)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(dim: int, theta: float, max_positions: int, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN (transformers `_compute_yarn_parameters`): the frequencies blended between extrapolation (fast, kept)
    and interpolation (slow, divided by `factor`) over a linear ramp between the beta_fast/beta_slow correction
    dims, and the cos/sin attention factor `get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)` (or
    `get_mscale(factor)` when either is unset; the config's `attention_factor` wins)."""
    original = scaling.get("original_max_position_embeddings") or max_positions
    factor = float(scaling.get("factor") or max_positions / original)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, float(mscale)) / yarn_get_mscale(factor, float(mscale_all_dim))
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


def mla_softmax_scale(qk_head_dim: int, scaling: dict[str, Any] | None) -> float:
    """DeepSeek's attention scale: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN."""
    scale: float = qk_head_dim**-0.5
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind != "default" and scaling is not None:
        mscale_all_dim = scaling.get("mscale_all_dim") or 0
        if mscale_all_dim:
            m = yarn_get_mscale(float(scaling["factor"]), float(mscale_all_dim))
            scale = scale * m * m
    return scale


class RotaryEmbedding(nn.Module):
    cos: torch.Tensor  # buffers, declared for the type checker
    sin: torch.Tensor
    """Neox-style rotary embedding (rotate halves) with a precomputed cos/sin table indexed by position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self.reset()

    def reset(self, device: torch.device | None = None) -> None:
        """(Re)computes the cos/sin tables in float32 on the host, as transformers does (after the model was built
        on the meta device), and moves them to `device`: the model's, or the kernels read a host pointer."""
        head_dim, max_positions, theta, scaling = self.head_dim, self.max_positions, self.theta, self.scaling
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        attention_factor = 1.0
        kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
        if kind == "llama3":
            assert scaling is not None
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif kind == "linear":
            assert scaling is not None
            inv_freq = inv_freq / float(scaling["factor"])
        elif kind == "yarn":
            assert scaling is not None
            inv_freq, attention_factor = _yarn_inv_freq(head_dim, theta, max_positions, scaling)
        elif kind != "default":
            raise NotImplementedError(f"rope_scaling type {kind!r} is not supported")
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos", (freqs.cos() * attention_factor).to(device), persistent=False)
        self.register_buffer("sin", (freqs.sin() * attention_factor).to(device), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: (tokens, heads, head_dim), k: (tokens, kv_heads, head_dim)."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The table's rows at `positions` in the halves form, `(tokens, head_dim)` each (`Backend`'s MLA rope)."""
        cos, sin = self.cos[positions], self.sin[positions]
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    xf = x if dtype == torch.float32 else x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out if dtype == torch.float32 else out.to(dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up
