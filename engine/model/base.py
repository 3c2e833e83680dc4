"""What the runner, the loader and the decode graphs need of a model, whatever its family: `CausalLM`.

A model is built from its spec, this rank's `TPLayout` and its `TensorParallel`; it maps a flat batch of tokens to
hidden states (`forward`), hidden states to logits (`compute_logits`), and names its attention layers (the runner
binds each one's KV cache). `bind_backend` hands the backend to every module that calls it (attention, MoE).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from npuserve.engine.backends.base import AttentionMetadata, Backend
from npuserve.engine.parallel.comm import SINGLE_RANK, TensorParallel
from npuserve.engine.parallel.layout import TPLayout
from npuserve.modelspec import ModelSpec


class CausalLM(nn.Module):
    """The base of every model class (`registry.model_class` picks one from the spec)."""

    def __init__(self, spec: ModelSpec, layout: TPLayout | None = None, tp: TensorParallel = SINGLE_RANK) -> None:
        super().__init__()
        self.spec = spec
        self.layout = layout or TPLayout.of(spec)
        self.tp = tp

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states of every token, `(num_tokens, hidden)`."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The whole vocabulary's logits on rank 0 (the other ranks get their slice back, unused)."""
        raise NotImplementedError

    def attention_layers(self) -> list[Any]:
        """The layers that own a KV cache, in layer order: each has `backend` and `kv_cache` attributes."""
        raise NotImplementedError

    def finish_build(self, device: torch.device) -> None:
        """After the parameters were allocated on `device` (built on the meta device): re-tie what `to_empty`
        untied and recompute the non-persistent tables. Nothing by default."""
        return None

    def bind_backend(self, backend: Backend) -> None:
        """Sets `backend` on every submodule that has the attribute (attention layers, MoE blocks)."""
        for module in self.modules():
            if module is not self and hasattr(module, "backend"):
                setattr(module, "backend", backend)  # noqa: B010 (any module's attribute, not a declared one)
