"""The Llama-family decoder: Llama 2/3 (incl. llama3 rope scaling), Qwen2 (qkv bias), Qwen3 (q/k norm), Mistral.

QKV and gate-up are fused into one projection each (the loader fuses the HF tensors). The model sees a flat
batch of tokens and an `AttentionMetadata`; attention goes through the backend, which owns the paged KV cache.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from npuserve.engine.backends.base import AttentionMetadata, Backend
from npuserve.engine.model.layers import RMSNorm, RotaryEmbedding, silu_and_mul
from npuserve.modelspec import ModelSpec


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = spec.num_attention_heads
        self.num_kv_heads = spec.num_key_value_heads
        self.head_dim = spec.head_dim
        self.q_size, self.kv_size = spec.q_size, spec.kv_size
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.attention_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.rotary = rotary
        # Set by the runner: the backend and this layer's KV tensor (2, blocks, block_size, kv_heads, head_dim).
        self.backend: Backend | None = None
        self.kv_cache: torch.Tensor | None = None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(tokens, self.num_heads, self.head_dim)
        k = k.reshape(tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        assert self.backend is not None and self.kv_cache is not None, "the runner binds the KV cache first"
        out = self.backend.attention(q, k, v, self.kv_cache, meta)
        result: torch.Tensor = self.o_proj(out.reshape(tokens, self.q_size))
        return result


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out_: torch.Tensor = self.down_proj(silu_and_mul(self.gate_up_proj(x)))
        return out_


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, rotary)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), meta)
        out_: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out_


class LlamaModel(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        rotary = RotaryEmbedding(spec.head_dim, spec.max_position_embeddings, spec.rope_theta, spec.rope_scaling)
        self.rotary = rotary
        self.layers = nn.ModuleList([DecoderLayer(spec, rotary) for _ in range(spec.num_layers)])
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(positions, x, meta)
        out_: torch.Tensor = self.norm(x)
        return out_


class LlamaForCausalLM(nn.Module):
    """One class for the whole family; the spec's flags select qkv bias, q/k norm and tied embeddings."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.model = LlamaModel(spec)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states of every token, `(num_tokens, hidden)`."""
        return self.model(input_ids, positions, meta)  # type: ignore[no-any-return]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # type: ignore[no-any-return]

    def attention_layers(self) -> list[Attention]:
        return [cast(Attention, layer.self_attn) for layer in self.model.layers]
