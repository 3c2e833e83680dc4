"""Model architecture read from a Hugging Face `config.json` (Llama family).

The planner sizes memory from it, the engine builds its layers from it, and the dummy writer turns it back into
a `config.json` that `transformers` loads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from npuserve.engine_contract import DTYPE_BYTES, DType, kv_bytes_per_block

ModelType = Literal["llama", "qwen2", "qwen3", "mistral"]
SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "mistral")


_ARCHITECTURE_CLASS: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}


class UnsupportedModelError(ValueError):
    """The config names an architecture npuserve does not implement."""


class ModelSpec(BaseModel):
    """The numbers of a decoder-only Llama-family model that serving needs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_type: ModelType
    num_layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    max_position_embeddings: int = Field(gt=0)
    dtype: DType = "bfloat16"
    tie_word_embeddings: bool = False
    rms_norm_eps: float = Field(default=1e-6, gt=0)
    rope_theta: float = Field(default=10000.0, gt=0)
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False  # qwen2: bias on q, k and v
    qk_norm: bool = False  # qwen3: RMSNorm on each head of q and k
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelSpec:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        return self

    # --- sizes -------------------------------------------------------------------------------------------------

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def params_per_layer(self) -> int:
        h = self.hidden_size
        attention = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        if self.attention_bias:
            attention += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attention += 2 * self.head_dim
        mlp = 3 * h * self.intermediate_size  # gate, up, down
        norms = 2 * h
        return attention + mlp + norms

    @property
    def num_parameters(self) -> int:
        embeddings = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return embeddings + self.num_layers * self.params_per_layer + self.hidden_size + head

    @property
    def weight_bytes(self) -> int:
        return self.num_parameters * self.dtype_bytes

    def kv_bytes_per_block(self, block_size: int, world_size: int = 1, dtype: str | None = None) -> int:
        """KV bytes of one block on one card (the contract's formula); `dtype` defaults to the model's."""
        return kv_bytes_per_block(num_layers=self.num_layers, block_size=block_size,
                                  num_kv_heads=self.num_key_value_heads, head_dim=self.head_dim,
                                  dtype=dtype or self.dtype, world_size=world_size)

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)

    # --- HF config.json ----------------------------------------------------------------------------------------

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelSpec:
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; npuserve serves {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        head_dim = config.get("head_dim") or hidden // heads
        dtype = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
        if dtype not in DTYPE_BYTES:
            raise UnsupportedModelError(f"torch_dtype {dtype!r} is not supported; use one of {sorted(DTYPE_BYTES)}")
        if model_type == "mistral" and config.get("sliding_window"):
            # Sliding-window attention is not implemented; serving such a model would silently attend too far.
            raise UnsupportedModelError("mistral with sliding_window is not supported; use a config with null")
        return cls(
            model_type=model_type,
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            intermediate_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            dtype=dtype,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(config.get("rope_theta", 10000.0)),
            rope_scaling=config.get("rope_scaling"),
            attention_bias=bool(config.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
            bos_token_id=config.get("bos_token_id"),
            eos_token_id=config.get("eos_token_id"),
        )

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> ModelSpec:
        path = Path(folder) / "config.json"
        try:
            config = json.loads(path.read_text())
        except FileNotFoundError as e:
            raise FileNotFoundError(f"no config.json in model folder {folder}") from e
        return cls.from_hf_config(config)

    def to_hf_config(self) -> dict[str, Any]:
        """A `config.json` that `transformers` loads into the matching *ForCausalLM class."""
        config: dict[str, Any] = {
            "architectures": [_ARCHITECTURE_CLASS[self.model_type]],
            "model_type": self.model_type,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.dtype,
            "vocab_size": self.vocab_size,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "use_cache": True,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
        }
        if self.model_type == "llama":
            config["attention_bias"] = False
            config["mlp_bias"] = False
        elif self.model_type in ("qwen2", "qwen3"):
            config["use_sliding_window"] = False
            config["sliding_window"] = None
            config["max_window_layers"] = self.num_layers
            if self.model_type == "qwen3":
                config["attention_bias"] = False
        elif self.model_type == "mistral":
            config["sliding_window"] = None
        return config
