"""The model class of a spec: the one place that maps a model type to the engine's implementation."""

from __future__ import annotations

from npuserve.engine.model.base import CausalLM
from npuserve.engine.model.deepseek import DeepseekForCausalLM
from npuserve.engine.model.llama import LlamaForCausalLM
from npuserve.engine.model.qwen_moe import QwenMoeForCausalLM
from npuserve.modelspec import ModelSpec, UnsupportedModelError

_CLASSES: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2_moe": QwenMoeForCausalLM,
    "qwen3_moe": QwenMoeForCausalLM,
    "deepseek_v2": DeepseekForCausalLM,
    "deepseek_v3": DeepseekForCausalLM,
}


def model_class(spec: ModelSpec) -> type[CausalLM]:
    try:
        return _CLASSES[spec.model_type]
    except KeyError:
        raise UnsupportedModelError(
            f"model_type {spec.model_type!r} is not implemented in the engine yet; it serves "
            f"{', '.join(_CLASSES)}") from None
