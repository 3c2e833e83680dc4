"""The Llama-family decoder: Llama 2/3 (incl. llama3 rope scaling), Qwen2 (qkv bias), Qwen3 (q/k norm), Mistral.

QKV and gate-up are fused into one projection each (the loader fuses the HF tensors). The model sees a flat
batch of tokens and an `AttentionMetadata`; attention goes through the backend, which owns the paged KV cache.

Tensor parallel (`TPLayout`, `TensorParallel`): each rank builds only its slice: its query and KV heads in
`qkv_proj`, its intermediate rows in `gate_up_proj` (column-parallel), the matching input columns of `o_proj` and
`down_proj` (row-parallel, one all-reduce after each), its vocabulary rows of the embedding (masked, all-reduced)
and of the LM head (logits gathered to rank 0). With one rank every collective is the identity.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from npuserve.engine.backends.base import AttentionMetadata, Backend
from npuserve.engine.model.base import CausalLM
from npuserve.engine.model.layers import RMSNorm, RotaryEmbedding, silu_and_mul
from npuserve.engine.parallel.comm import SINGLE_RANK, TensorParallel
from npuserve.engine.parallel.layout import TPLayout
from npuserve.modelspec import ModelSpec


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, rotary: RotaryEmbedding, layout: TPLayout, tp: TensorParallel) -> None:
        super().__init__()
        self.num_heads = layout.heads
        self.num_kv_heads = layout.kv_heads
        self.head_dim = spec.head_dim
        self.q_size, self.kv_size = layout.q_size, layout.kv_size
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.attention_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=False)
        self.tp = tp
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
        return self.tp.all_reduce(self.o_proj(out.reshape(tokens, self.q_size)))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, layout: TPLayout, tp: TensorParallel) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * layout.intermediate, bias=False)
        self.down_proj = nn.Linear(layout.intermediate, spec.hidden_size, bias=False)
        self.act_fn = silu_and_mul  # a backend may swap in its fused SwiGLU (`Backend.prepare_model`)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(self.act_fn(self.gate_up_proj(x))))


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding; ids of other ranks' rows give zeros, and the all-reduce sums the ranks."""

    def __init__(self, layout: TPLayout, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(layout.vocab_rows, hidden_size))
        self.layout, self.tp = layout, tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return nn.functional.embedding(input_ids, self.weight)
        local = input_ids - self.layout.vocab_start
        inside = (local >= 0) & (local < self.layout.vocab_real_rows)
        out = nn.functional.embedding(torch.where(inside, local, 0), self.weight)
        return self.tp.all_reduce(out * inside.unsqueeze(-1).to(out.dtype))


# A layer's MLP by its index (a mixture-of-experts model puts its MoE block on some layers); None: the dense MLP.
MLPFactory = Callable[[int], nn.Module | None]


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each added to the residual. `mlp`: an MoE block instead of the dense MLP;
    `attention`: latent attention (DeepSeek) instead of the Llama family's."""

    def __init__(self, spec: ModelSpec, rotary: RotaryEmbedding, layout: TPLayout, tp: TensorParallel,
                 mlp: nn.Module | None = None, attention: nn.Module | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = attention if attention is not None else Attention(spec, rotary, layout, tp)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = mlp if mlp is not None else MLP(spec, layout, tp)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), meta)
        out_: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out_


class LlamaModel(nn.Module):
    def __init__(self, spec: ModelSpec, layout: TPLayout, tp: TensorParallel,
                 mlp_for: MLPFactory | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(layout, spec.hidden_size, tp)
        rotary = self.make_rotary(spec)
        self.rotary = rotary
        self.layers = nn.ModuleList([self.make_layer(spec, i, rotary, layout, tp, mlp_for(i) if mlp_for else None)
                                     for i in range(spec.num_layers)])
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def make_rotary(self, spec: ModelSpec) -> RotaryEmbedding:
        return RotaryEmbedding(spec.head_dim, spec.max_position_embeddings, spec.rope_theta, spec.rope_scaling)

    def make_layer(self, spec: ModelSpec, index: int, rotary: RotaryEmbedding, layout: TPLayout,
                   tp: TensorParallel, mlp: nn.Module | None) -> nn.Module:
        """Layer `index` (`mlp`: its MLP when not the dense one)."""
        return DecoderLayer(spec, rotary, layout, tp, mlp)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(positions, x, meta)
        out_: torch.Tensor = self.norm(x)
        return out_


class LlamaForCausalLM(CausalLM):
    """One class for the whole family; the spec's flags select qkv bias, q/k norm and tied embeddings. A subclass
    changes some layers' MLP through `layer_mlp` (qwen_moe.py); another family with the same embedding, head and
    logits (DeepSeek) brings its own `decoder_class`."""

    decoder_class: type[LlamaModel] = LlamaModel

    def __init__(self, spec: ModelSpec, layout: TPLayout | None = None, tp: TensorParallel = SINGLE_RANK) -> None:
        super().__init__(spec, layout, tp)
        self.model = self.decoder_class(spec, self.layout, tp, lambda i: self.layer_mlp(i))
        self.lm_head = nn.Linear(spec.hidden_size, self.layout.vocab_rows, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def layer_mlp(self, index: int) -> nn.Module | None:
        """Layer `index`'s MLP; None: the dense one. Called while the model is built (self.spec, layout, tp set)."""
        return None

    def finish_build(self, device: torch.device) -> None:
        super().finish_build(device)
        if self.spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.model.rotary.reset(device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states of every token, `(num_tokens, hidden)`."""
        return self.model(input_ids, positions, meta)  # type: ignore[no-any-return]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The whole vocabulary's logits on rank 0; the other ranks take part in the gather and get their own
        slice back (which they do not use)."""
        local: torch.Tensor = self.lm_head(hidden)
        whole = self.tp.gather_logits(local, self.layout)
        return local if whole is None else whole

    def attention_layers(self) -> list[Attention]:
        return [cast(Attention, layer.self_attn) for layer in self.model.layers]
