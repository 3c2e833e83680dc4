"""DeepSeek-V2/V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`): latent attention (`mla.py`) in every layer,
a dense SwiGLU MLP in the first `first_k_dense_replace` layers and the MoE block in the others.

The embedding, final norm, LM head and logits gather are the Llama family's (`LlamaForCausalLM`); the rope table
has the rope head size (`qk_rope_head_dim`) with the config's scaling (YaRN). The multi-token-prediction layer of
the V3/R1 checkpoints (`model.layers.{num_hidden_layers}`) is not built: speculative decoding with it is not served.
"""

from __future__ import annotations

from typing import cast

from torch import nn

from npuserve.engine.model.layers import RotaryEmbedding
from npuserve.engine.model.llama import DecoderLayer, LlamaForCausalLM, LlamaModel
from npuserve.engine.model.mla import MLAttention
from npuserve.engine.model.moe import SparseMoeBlock
from npuserve.engine.parallel.comm import TensorParallel
from npuserve.engine.parallel.layout import TPLayout
from npuserve.modelspec import ModelSpec


class DeepseekModel(LlamaModel):
    """The Llama decoder's embedding, forward and final norm, with DeepSeek's rope table and layers."""

    def make_rotary(self, spec: ModelSpec) -> RotaryEmbedding:
        assert spec.mla is not None
        return RotaryEmbedding(spec.mla.qk_rope_head_dim, spec.max_position_embeddings, spec.rope_theta,
                               spec.rope_scaling)

    def make_layer(self, spec: ModelSpec, index: int, rotary: RotaryEmbedding, layout: TPLayout,
                   tp: TensorParallel, mlp: nn.Module | None) -> nn.Module:
        return DecoderLayer(spec, rotary, layout, tp, mlp, attention=MLAttention(spec, rotary, layout, tp))


class DeepseekForCausalLM(LlamaForCausalLM):
    """V2 and V3 alike: the spec's `mla` (q_lora or not, interleaved rope) and `moe` (routing) fields differ."""

    decoder_class = DeepseekModel

    def layer_mlp(self, index: int) -> nn.Module | None:
        """The MoE block (float32 router, DeepSeek's routing rule from the spec, the shared experts) on the layers
        past `first_k_dense_replace`; the dense MLP (intermediate_size) before."""
        moe = self.spec.moe
        if moe is None or not moe.is_moe_layer(index):
            return None
        return SparseMoeBlock(self.spec, self.layout, self.tp, float32_router=True)

    def mla_layers(self) -> list[MLAttention]:
        return [cast(MLAttention, layer.self_attn) for layer in self.model.layers]
