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


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    xf = x if dtype == torch.float32 else x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out if dtype == torch.float32 else out.to(dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up
