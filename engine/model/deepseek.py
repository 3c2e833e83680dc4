"""DeepSeek-V2/V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`): latent attention (`mla.py`) in every layer,
a dense SwiGLU MLP in the first `first_k_dense_replace` layers and the MoE block in the others.

The embedding, final norm, LM head and logits gather are the Llama family's (`LlamaForCausalLM`); the rope table
has the rope head size (`qk_rope_head_dim`) with the config's scaling (YaRN). The multi-token-prediction layer of
the V3/R1 checkpoints (`model.layers.{num_hidden_layers}`) is not built: speculative decoding with it is not served.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from npuserve.engine.backends.base import AttentionMetadata
from npuserve.engine.model.layers import RMSNorm, RotaryEmbedding
from npuserve.engine.model.llama import MLP, LlamaForCausalLM, LlamaModel
from npuserve.engine.model.mla import MLAttention
from npuserve.engine.parallel.comm import TensorParallel
from npuserve.engine.parallel.layout import TPLayout
from npuserve.modelspec import ModelSpec


def _mlp(spec: ModelSpec, index: int, layout: TPLayout, tp: TensorParallel) -> nn.Module:
    if spec.moe is None or not spec.moe.is_moe_layer(index):
        return MLP(spec, layout, tp)
    raise NotImplementedError("the DeepSeek MoE block is not built yet (engine/model/moe.py)")


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, index: int, rotary: RotaryEmbedding, layout: TPLayout,
                 tp: TensorParallel) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = MLAttention(spec, rotary, layout, tp)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = _mlp(spec, index, layout, tp)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), meta)
        out_: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out_


class DeepseekModel(LlamaModel):
    """The Llama decoder's embedding, forward and final norm, with DeepSeek's rope table and layers."""

    def make_rotary(self, spec: ModelSpec) -> RotaryEmbedding:
        assert spec.mla is not None
        return RotaryEmbedding(spec.mla.qk_rope_head_dim, spec.max_position_embeddings, spec.rope_theta,
                               spec.rope_scaling)

    def make_layer(self, spec: ModelSpec, index: int, rotary: RotaryEmbedding, layout: TPLayout,
                   tp: TensorParallel) -> nn.Module:
        return DeepseekDecoderLayer(spec, index, rotary, layout, tp)


class DeepseekForCausalLM(LlamaForCausalLM):
    """V2 and V3 alike: the spec's `mla` (q_lora or not, interleaved rope) and `moe` (routing) fields differ."""

    decoder_class = DeepseekModel

    def mla_layers(self) -> list[MLAttention]:
        return [cast(MLAttention, layer.self_attn) for layer in self.model.layers]
