"""Multi-head latent attention (DeepSeek-V2/V3), over the backend's two MLA caches.

Projections, named as in the HF checkpoints: the query through `q_a_proj` -> `q_a_layernorm` -> `q_b_proj` (V3, or
a plain `q_proj` when `q_lora_rank` is None: V2-Lite); `kv_a_proj_with_mqa` gives the latent `c_kv`
(`kv_lora_rank`) and the shared rope key `k_pe` in one row; `kv_a_layernorm` normalises the latent; `kv_b_proj`
expands it, per head, into the no-rope key (`qk_nope_head_dim`) and the value (`v_head_dim`): its weight viewed as
`(heads, nope + v, kv_lora_rank)` is `[W_UK; W_UV]`; `o_proj`. The two latent norms use eps 1e-6, as transformers
builds them (not the config's rms_norm_eps).

Every step, `Backend.mla_write_cache` normalises the latent, rotates `k_pe` and writes both into this layer's
caches. Decode is absorbed: `q_latent = q_nope . W_UK` per head, attention over the latent and rope caches only
(`Backend.mla_decode_attention`, values = the latent), then `. W_UV^T` and `o_proj`. Prefill is expanded: the whole
context's latent (prefix-cache hits and earlier chunks read back from the cache) goes through `kv_b_proj`, then
causal attention with head dims nope + rope (keys) and v (values). A chunked-prefill step with decodes in front
runs both, each on its part of the batch.

The softmax scale is qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2; the rope tables carry YaRN's
attention factor (`RotaryEmbedding`).

Tensor parallel: the heads are split (this rank's rows of `q_b_proj`/`q_proj` and `kv_b_proj`, its input columns of
`o_proj`, one all-reduce after it); the latent path (`q_a_proj`, `q_a_layernorm`, `kv_a_proj_with_mqa`,
`kv_a_layernorm`) is replicated, so every rank writes the whole latent into its own caches.
"""

from __future__ import annotations

import torch
from torch import nn

from npuserve.engine.backends.base import AttentionMetadata, Backend, mla_host_lens
from npuserve.engine.model.int8 import Int8Linear
from npuserve.engine.model.layers import RMSNorm, RotaryEmbedding, mla_softmax_scale
from npuserve.engine.parallel.comm import TensorParallel
from npuserve.engine.parallel.layout import TPLayout
from npuserve.modelspec import ModelSpec

LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV2/V3RMSNorm default, used for q_a_layernorm and kv_a_layernorm


class MLAttention(nn.Module):
    def __init__(self, spec: ModelSpec, rotary: RotaryEmbedding, layout: TPLayout, tp: TensorParallel) -> None:
        super().__init__()
        mla = spec.mla
        assert mla is not None, "latent attention needs the spec's mla fields"
        self.num_heads = layout.heads
        self.nope, self.rope_dim, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.qk_dim, self.rank = mla.qk_head_dim, mla.kv_lora_rank
        self.interleaved = mla.rope_interleave
        h = spec.hidden_size
        self.q_lora = mla.q_lora_rank is not None
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(h, self.num_heads * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, mla.q_lora_rank, bias=spec.attention_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, self.num_heads * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.rank + self.rope_dim, bias=spec.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.rank, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, h, bias=spec.attention_bias)
        self.scale = mla_softmax_scale(self.qk_dim, spec.rope_scaling)
        self.rotary = rotary
        self.tp = tp
        # Set by the runner: the backend and this layer's (latent, rope) caches.
        self.backend: Backend | None = None
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def _absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK `(heads, nope, rank)` and W_UV `(heads, v, rank)`: views of kv_b_proj's weight."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        return w[:, : self.nope], w[:, self.nope :]

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        assert self.backend is not None and self.kv_cache is not None, "the runner binds the MLA caches first"
        backend, (latent, rope) = self.backend, self.kv_cache
        tokens = x.shape[0]
        q = self.q_proj(x) if not self.q_lora else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(tokens, self.num_heads, self.qk_dim)
        q_nope, q_pe = q[..., : self.nope], q[..., self.nope :]
        cos, sin = self.rotary.cos_sin(positions)
        c_kv, k_pe = backend.mla_write_cache(self.kv_a_proj_with_mqa(x), self.kv_a_layernorm.weight,
                                             self.kv_a_layernorm.eps, cos, sin, meta.slot_mapping, latent, rope,
                                             self.interleaved)
        q_pe = backend.mla_rotate_q(q_pe, cos, sin, self.interleaved)
        if meta.decode_part is not None and meta.prefill_part is not None:
            n = meta.decode_part.batch_size
            out = torch.cat([self._decode(q_nope[:n], q_pe[:n], meta.decode_part),
                             self._prefill(q_nope[n:], q_pe[n:], c_kv[n:], k_pe[n:], meta.prefill_part)])
        elif meta.is_prefill:
            out = self._prefill(q_nope, q_pe, c_kv, k_pe, meta)
        else:
            out = self._decode(q_nope, q_pe, meta)
        out = out.reshape(tokens, self.num_heads * self.v_dim)
        if self.o_proj.bias is None or self.tp.world_size == 1:
            return self.tp.all_reduce(self.o_proj(out))
        # the bias once, after the ranks' partial sums (an int8 o_proj adds its float bias itself: taken back off)
        if isinstance(self.o_proj, Int8Linear):
            return self.tp.all_reduce(self.o_proj(out) - self.o_proj.bias) + self.o_proj.bias
        return self.tp.all_reduce(nn.functional.linear(out, self.o_proj.weight)) + self.o_proj.bias

    def _decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        assert self.backend is not None and self.kv_cache is not None
        w_uk, w_uv = self._absorbed()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # (B, N, rank)
        out = self.backend.mla_decode_attention(q_latent, q_pe, self.kv_cache[0], self.kv_cache[1], meta,
                                                self.scale)
        return torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # (B, N, v)

    def _prefill(self, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        assert self.backend is not None and self.kv_cache is not None
        context_lens, query_lens = mla_host_lens(meta)
        if context_lens != query_lens:  # a cached prefix or earlier chunks
            c_kv, k_pe = self.backend.mla_gather_context(self.kv_cache[0], self.kv_cache[1], meta)
        length = c_kv.shape[0]
        kv = self.kv_b_proj(c_kv.to(self.kv_b_proj.weight.dtype)).view(length, self.num_heads, self.nope + self.v_dim)
        k = torch.cat([kv[..., : self.nope], k_pe.to(kv.dtype).unsqueeze(1).expand(length, self.num_heads, -1)], -1)
        v = kv[..., self.nope :]
        q = torch.cat([q_nope, q_pe], dim=-1)
        return self.backend.mla_prefill_attention(q, k, v, meta, self.scale)
