"""Qwen3-MoE and Qwen2-MoE: the Llama-family decoder (llama.py) with a mixture-of-experts MLP on the layers where
`MoESpec.is_moe_layer` (decoder_sparse_step, mlp_only_layers), the dense MLP (intermediate_size) elsewhere.

Qwen3-MoE's attention is Qwen3's (q/k norm); Qwen2-MoE's is Qwen2's (qkv bias) and its MoE block adds a shared
expert times a sigmoid gate. Both are the spec's flags; the block is moe.py's.
"""

from __future__ import annotations

from torch import nn

from npuserve.engine.model.llama import LlamaForCausalLM
from npuserve.engine.model.moe import SparseMoeBlock


class QwenMoeForCausalLM(LlamaForCausalLM):
    def layer_mlp(self, index: int) -> nn.Module | None:
        moe = self.spec.moe
        assert moe is not None, f"{self.spec.model_type} needs the moe fields"
        return SparseMoeBlock(self.spec, self.layout, self.tp) if moe.is_moe_layer(index) else None
