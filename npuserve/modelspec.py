"""Model architecture read from a Hugging Face `config.json`: the Llama family, Qwen2/Qwen3-MoE (mixture of
experts) and DeepSeek-V2/V3 (multi-head latent attention plus mixture of experts).

The planner sizes memory from it, the engine builds its layers from it, and the dummy writer turns it back into
a `config.json` that `transformers` loads. What is not implemented (a model type, a quantization scheme, a rope
scaling kind, an MoE layer pattern) is refused here by name, at load, rather than served wrongly. A quantized
checkpoint's scheme (`npuserve/quantization.py`) is read from its own declaration: `config.json`'s
`quantization_config` (compressed-tensors) or msModelSlim's `quant_model_description.json` beside it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from npuserve.engine_contract import DTYPE_BYTES, DType, kv_bytes_per_block, mla_kv_bytes_per_block
from npuserve.quantization import QuantScheme, UnsupportedQuantizationError, read_scheme, scheme_of

ModelType = Literal["llama", "qwen2", "qwen3", "mistral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3"]
SUPPORTED_MODEL_TYPES: tuple[str, ...] = (
    "llama", "qwen2", "qwen3", "mistral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3")
MOE_MODEL_TYPES: tuple[str, ...] = ("qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3")
MLA_MODEL_TYPES: tuple[str, ...] = ("deepseek_v2", "deepseek_v3")
SUPPORTED_ROPE_SCALING: tuple[str, ...] = ("default", "llama3", "linear", "yarn")


_ARCHITECTURE_CLASS: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}


class MoESpec(BaseModel):
    """The mixture-of-experts part of a model: routed experts, the router's rule, shared experts, which layers.

    Names follow the HF configs (Qwen's `num_experts`, DeepSeek's `n_routed_experts` both land in `num_experts`).
    Routing, as transformers computes it:
    - `softmax` + `greedy` (Qwen2/3-MoE, DeepSeek-V2-Lite): softmax over all experts in float32, top-k, divided by
      the top-k sum when `norm_topk_prob`, times `routed_scaling_factor`.
    - `softmax` + `group_limited_greedy` (DeepSeek-V2): groups scored by their best expert, top `topk_group` groups
      kept, then top-k inside them.
    - `sigmoid` + `noaux_tc` (DeepSeek-V3/R1): sigmoid scores; `e_score_correction_bias` is added for the choice only;
      groups scored by the sum of their best two; top `topk_group` groups kept, then top-k; the weights are the
      un-biased scores, divided by their sum (+1e-20) when `norm_topk_prob`, times `routed_scaling_factor`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_experts: int = Field(gt=0)  # routed experts
    num_experts_per_tok: int = Field(gt=0)
    moe_intermediate_size: int = Field(gt=0)  # one routed expert's intermediate size
    # the shared expert(s) as one MLP of this width (DeepSeek: n_shared_experts x moe_intermediate_size); 0: none
    shared_expert_intermediate_size: int = Field(default=0, ge=0)
    shared_expert_gate: bool = False  # Qwen2-MoE: the shared expert's output times sigmoid(x . w_gate)
    norm_topk_prob: bool = False
    scoring_func: Literal["softmax", "sigmoid"] = "softmax"
    topk_method: Literal["greedy", "group_limited_greedy", "noaux_tc"] = "greedy"
    n_group: int = Field(default=1, gt=0)
    topk_group: int = Field(default=1, gt=0)
    routed_scaling_factor: float = Field(default=1.0, gt=0)
    # MoE layers: index >= first_k_dense_replace, not in mlp_only_layers, (index + 1) % decoder_sparse_step == 0
    first_k_dense_replace: int = Field(default=0, ge=0)
    decoder_sparse_step: int = Field(default=1, gt=0)
    mlp_only_layers: tuple[int, ...] = ()

    @model_validator(mode="after")
    def _routing_consistent(self) -> MoESpec:
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts "
                             f"({self.num_experts})")
        if self.num_experts % self.n_group:
            raise ValueError(f"n_group ({self.n_group}) must divide the routed experts ({self.num_experts})")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) exceeds n_group ({self.n_group})")
        if (self.scoring_func == "sigmoid") != (self.topk_method == "noaux_tc"):
            raise ValueError(f"scoring_func {self.scoring_func!r} with topk_method {self.topk_method!r} is not "
                             "a routing any supported model uses (sigmoid goes with noaux_tc)")
        return self

    @property
    def e_score_correction_bias(self) -> bool:
        """DeepSeek-V3's router has a per-expert bias used for the choice only."""
        return self.topk_method == "noaux_tc"

    @property
    def grouped(self) -> bool:
        return self.topk_method in ("group_limited_greedy", "noaux_tc")

    def is_moe_layer(self, index: int) -> bool:
        return (index >= self.first_k_dense_replace and index not in self.mlp_only_layers
                and (index + 1) % self.decoder_sparse_step == 0)

    def expert_params(self, hidden_size: int) -> int:
        """Gate, up and down of one routed expert."""
        return 3 * hidden_size * self.moe_intermediate_size

    def shared_params(self, hidden_size: int) -> int:
        return 3 * hidden_size * self.shared_expert_intermediate_size + (hidden_size if self.shared_expert_gate else 0)

    def router_params(self, hidden_size: int) -> int:
        return self.num_experts * hidden_size + (self.num_experts if self.e_score_correction_bias else 0)

    def layer_params(self, hidden_size: int) -> int:
        """Every parameter of one MoE block: the router, all routed experts, the shared ones."""
        return (self.router_params(hidden_size) + self.num_experts * self.expert_params(hidden_size)
                + self.shared_params(hidden_size))

    def active_layer_params(self, hidden_size: int) -> int:
        """The parameters one token computes with in an MoE block: the router, its top-k experts, the shared ones."""
        return (self.router_params(hidden_size) + self.num_experts_per_tok * self.expert_params(hidden_size)
                + self.shared_params(hidden_size))

    def experts_touched(self, tokens: int) -> float:
        """The expert-touch rule: the expected number of distinct routed experts that `tokens` tokens choose in one
        MoE layer, each token choosing `num_experts_per_tok` (k) of the `num_experts` (E) uniformly:
        `E x (1 - (1 - k/E)^tokens)`. One token misses a given expert with probability 1 - k/E, and tokens route
        independently; k at one token, E as the tokens grow. A step reads only these experts' weights (real
        routers are skewed, which touches fewer: the rule is the uniform, upper, case)."""
        if tokens <= 0:
            return 0.0
        e, k = self.num_experts, self.num_experts_per_tok
        return float(e * (1.0 - (1.0 - k / e) ** tokens))


class MLASpec(BaseModel):
    """Multi-head latent attention (DeepSeek-V2/V3). The KV cache holds, per token and layer, the RMS-normed latent
    `c_kv` (`kv_lora_rank`) and the rotated shared rope key `k_pe` (`qk_rope_head_dim`), for all heads at once."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    q_lora_rank: int | None = Field(default=None, gt=0)  # None: a plain q_proj (DeepSeek-V2-Lite)
    kv_lora_rank: int = Field(gt=0)
    qk_nope_head_dim: int = Field(gt=0)
    qk_rope_head_dim: int = Field(gt=0)
    v_head_dim: int = Field(gt=0)
    rope_interleave: bool = True  # DeepSeek's rope pairs adjacent channels (transformers' rope_interleave)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Cache elements per token and layer: the latent and the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def attention_params(self, hidden_size: int, heads: int, bias: bool) -> int:
        q = (hidden_size * heads * self.qk_head_dim if self.q_lora_rank is None else
             hidden_size * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * self.qk_head_dim
             + (self.q_lora_rank if bias else 0))
        kv_a = hidden_size * self.cache_dim + (self.cache_dim if bias else 0)
        kv_norm = self.kv_lora_rank
        kv_b = self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        o = heads * self.v_head_dim * hidden_size + (hidden_size if bias else 0)
        return q + kv_a + kv_norm + kv_b + o


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
    moe: MoESpec | None = None  # the MoE families; `intermediate_size` is then the dense layers' MLP
    mla: MLASpec | None = None  # DeepSeek; `head_dim` is then the query/key head size (nope + rope)
    # a quantized checkpoint's scheme (npuserve/quantization.py): which linear layers are int8; None: all in `dtype`
    quantization: QuantScheme | None = None

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelSpec:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if (self.model_type in MOE_MODEL_TYPES) != (self.moe is not None):
            raise ValueError(f"model_type {self.model_type!r} " + (
                "needs the moe fields" if self.moe is None else "has no mixture of experts"))
        if (self.model_type in MLA_MODEL_TYPES) != (self.mla is not None):
            raise ValueError(f"model_type {self.model_type!r} " + (
                "needs the mla fields" if self.mla is None else "has no latent attention"))
        if self.mla is not None and self.head_dim != self.mla.qk_head_dim:
            raise ValueError(f"head_dim ({self.head_dim}) must be qk_nope_head_dim + qk_rope_head_dim "
                             f"({self.mla.qk_head_dim}) for latent attention")
        kind = (self.rope_scaling or {}).get("rope_type") or (self.rope_scaling or {}).get("type") or "default"
        if kind not in SUPPORTED_ROPE_SCALING:
            raise ValueError(f"rope_scaling type {kind!r} is not supported; npuserve implements "
                             f"{', '.join(SUPPORTED_ROPE_SCALING)}")
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
    def is_moe(self) -> bool:
        return self.moe is not None

    @property
    def is_mla(self) -> bool:
        return self.mla is not None

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the layers whose MLP is a mixture of experts (none for a dense model)."""
        return [i for i in range(self.num_layers) if self.moe is not None and self.moe.is_moe_layer(i)]

    @property
    def attention_params_per_layer(self) -> int:
        h = self.hidden_size
        if self.mla is not None:
            return self.mla.attention_params(h, self.num_attention_heads, self.attention_bias)
        attention = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        if self.attention_bias:
            attention += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attention += 2 * self.head_dim
        return attention

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size  # gate, up, down

    def _layer_params(self, index: int, active: bool) -> int:
        h, norms = self.hidden_size, 2 * self.hidden_size
        if self.moe is not None and self.moe.is_moe_layer(index):
            mlp = self.moe.active_layer_params(h) if active else self.moe.layer_params(h)
        else:
            mlp = self.dense_mlp_params
        return self.attention_params_per_layer + mlp + norms

    @property
    def params_per_layer(self) -> int:
        """Parameters of one decoder layer; for an MoE model, the mean over its layers (every expert counted)."""
        return sum(self._layer_params(i, active=False) for i in range(self.num_layers)) // self.num_layers

    @property
    def num_parameters(self) -> int:
        """Every parameter, all experts included: what the cards must hold."""
        return self._embeddings_and_head + sum(self._layer_params(i, active=False) for i in range(self.num_layers))

    @property
    def active_parameters(self) -> int:
        """The parameters one token computes with (its top-k experts and the shared ones, not the others), the
        embedding table excluded (a lookup) and the LM head included: 2 FLOPs each per token."""
        head = self.vocab_size * self.hidden_size
        return head + self.hidden_size + sum(self._layer_params(i, active=True) for i in range(self.num_layers))

    @property
    def _embeddings_and_head(self) -> int:
        embeddings = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return embeddings + head + self.hidden_size  # + the final norm

    @property
    def weight_bytes(self) -> int:
        """Bytes of every weight as stored: int8 (with its scales) where the quantization scheme says so."""
        return self.num_parameters * self.dtype_bytes - self.quantization_saving

    # --- linear layers and quantization ---------------------------------------------------------------------------

    def layer_linears(self, index: int) -> list[tuple[str, int, int]]:
        """The linear modules of decoder layer `index` as (HF module name, out_features, in_features); a routed
        expert's appear once, as expert 0's (`routed_expert_linears` has them all)."""
        h, p = self.hidden_size, f"model.layers.{index}."
        out: list[tuple[str, int, int]] = []
        heads = self.num_attention_heads
        if self.mla is not None:
            m = self.mla
            if m.q_lora_rank is None:
                out.append((p + "self_attn.q_proj", heads * m.qk_head_dim, h))
            else:
                out += [(p + "self_attn.q_a_proj", m.q_lora_rank, h),
                        (p + "self_attn.q_b_proj", heads * m.qk_head_dim, m.q_lora_rank)]
            out += [(p + "self_attn.kv_a_proj_with_mqa", m.cache_dim, h),
                    (p + "self_attn.kv_b_proj", heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
                    (p + "self_attn.o_proj", h, heads * m.v_head_dim)]
        else:
            out += [(p + "self_attn.q_proj", self.q_size, h), (p + "self_attn.k_proj", self.kv_size, h),
                    (p + "self_attn.v_proj", self.kv_size, h), (p + "self_attn.o_proj", h, self.q_size)]
        if self.moe is None or not self.moe.is_moe_layer(index):
            i = self.intermediate_size
            return [*out, (p + "mlp.gate_proj", i, h), (p + "mlp.up_proj", i, h), (p + "mlp.down_proj", h, i)]
        moe = self.moe
        out.append((p + "mlp.gate", moe.num_experts, h))
        out += self.routed_expert_linears(index, 0)
        if moe.shared_expert_intermediate_size:
            s = moe.shared_expert_intermediate_size
            shared = p + ("mlp.shared_experts." if self.mla is not None else "mlp.shared_expert.")
            out += [(shared + "gate_proj", s, h), (shared + "up_proj", s, h), (shared + "down_proj", h, s)]
            if moe.shared_expert_gate:
                out.append((p + "mlp.shared_expert_gate", 1, h))
        return out

    def routed_expert_linears(self, index: int, expert: int) -> list[tuple[str, int, int]]:
        """Routed expert `expert`'s gate, up and down projections in MoE layer `index`."""
        assert self.moe is not None
        h, i = self.hidden_size, self.moe.moe_intermediate_size
        p = f"model.layers.{index}.mlp.experts.{expert}."
        return [(p + "gate_proj", i, h), (p + "up_proj", i, h), (p + "down_proj", h, i)]

    def _saving(self, linears: list[tuple[str, int, int]]) -> int:
        """Bytes the quantization scheme saves on these linear modules against the model's dtype."""
        q = self.quantization
        if q is None:
            return 0
        full = self.dtype_bytes
        return sum(o * i * full - q.linear_bytes(name, o, i, full) for name, o, i in linears)

    def _expert_saving(self, index: int) -> int:
        """One routed expert's saving in layer `index` (expert 0's scheme stands for all: the tools quantize the
        experts of a layer alike)."""
        return self._saving(self.routed_expert_linears(index, 0)) if self.moe is not None else 0

    def _layer_saving(self, index: int) -> int:
        saving = self._saving(self.layer_linears(index))
        if self.moe is not None and self.moe.is_moe_layer(index):
            saving += (self.moe.num_experts - 1) * self._expert_saving(index)
        return saving

    @property
    def quantization_saving(self) -> int:
        """Bytes the quantization scheme saves over the whole model against storing every weight in `dtype`."""
        if self.quantization is None:
            return 0
        return sum(self._layer_saving(i) for i in range(self.num_layers))

    @property
    def quantized_parameters(self) -> int:
        """The parameters stored as int8 (every expert counted); 0 when not quantized."""
        q = self.quantization
        if q is None:
            return 0
        total = 0
        for index in range(self.num_layers):
            total += sum(o * i for name, o, i in self.layer_linears(index) if q.module_method(name))
            if self.moe is not None and self.moe.is_moe_layer(index):
                total += (self.moe.num_experts - 1) * sum(
                    o * i for name, o, i in self.routed_expert_linears(index, 0) if q.module_method(name))
        return total

    @property
    def layer_parameters(self) -> int:
        """Every decoder layer's parameters, all experts included (no embeddings, no LM head)."""
        return sum(self._layer_params(i, active=False) for i in range(self.num_layers))

    @property
    def active_layer_parameters(self) -> int:
        """The decoder layers' parameters one token computes with: 2 FLOPs each per token (`active_parameters` less
        the LM head and the final norm). A dense model's are all of them."""
        return sum(self._layer_params(i, active=True) for i in range(self.num_layers))

    def untouched_expert_bytes(self, tokens: int) -> float:
        """Bytes of the routed experts that no token of a step of `tokens` tokens chooses, over every MoE layer and
        all cards together (the expert-touch rule, `MoESpec.experts_touched`); 0 for a dense model."""
        if self.moe is None:
            return 0.0
        untouched = self.moe.num_experts - self.moe.experts_touched(tokens)
        expert_bytes = self.moe.expert_params(self.hidden_size) * self.dtype_bytes
        return sum(untouched * (expert_bytes - self._expert_saving(i)) for i in self.moe_layers)

    def step_weight_bytes(self, tokens: int) -> float:
        """Weight bytes a step of `tokens` routed tokens (one per decoding sequence, every prompt token of a
        prefill) reads, all cards together (under tensor parallel each card reads its 1/worldSize): every decoder
        layer and the LM head (the embedding table is a lookup), less the routed experts no token chose. Dense:
        the same at any batch; MoE: attention, dense layers, router and shared experts, plus the touched experts."""
        head = self.vocab_size * self.hidden_size
        return ((self.layer_parameters + head) * self.dtype_bytes - self.quantization_saving
                - self.untouched_expert_bytes(tokens))

    def kv_bytes_per_block(self, block_size: int, world_size: int = 1, dtype: str | None = None) -> int:
        """KV bytes of one block on one card (the contract's formulas); `dtype` defaults to the model's."""
        if self.mla is not None:
            return mla_kv_bytes_per_block(num_layers=self.num_layers, block_size=block_size,
                                          kv_lora_rank=self.mla.kv_lora_rank, rope_dim=self.mla.qk_rope_head_dim,
                                          dtype=dtype or self.dtype)
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
    def from_hf_config(cls, config: dict[str, Any], quant_description: dict[str, Any] | None = None) -> ModelSpec:
        """`quant_description`: msModelSlim's `quant_model_description.json`, when the folder has one."""
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; npuserve serves {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        try:
            quantization = scheme_of(config, quant_description)
        except UnsupportedQuantizationError as e:
            raise UnsupportedModelError(str(e)) from e
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        mla = _mla_of(config) if model_type in MLA_MODEL_TYPES else None
        head_dim = mla.qk_head_dim if mla is not None else (config.get("head_dim") or hidden // heads)
        dtype = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
        if dtype not in DTYPE_BYTES:
            raise UnsupportedModelError(f"torch_dtype {dtype!r} is not supported; use one of {sorted(DTYPE_BYTES)}")
        if model_type == "mistral" and config.get("sliding_window"):
            # Sliding-window attention is not implemented; serving such a model would silently attend too far.
            raise UnsupportedModelError("mistral with sliding_window is not supported; use a config with null")
        if model_type in ("qwen2_moe", "qwen3_moe") and config.get("use_sliding_window"):
            raise UnsupportedModelError(f"{model_type} with use_sliding_window is not supported")
        # transformers 5 writes `rope_parameters` (theta inside); the published configs `rope_theta`/`rope_scaling`
        rope = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
        theta = config.get("rope_theta") or rope.pop("rope_theta", None) or 10000.0
        rope.pop("rope_theta", None)
        kind = rope.get("rope_type") or rope.get("type") or "default"
        if kind not in SUPPORTED_ROPE_SCALING:
            raise UnsupportedModelError(f"rope_scaling type {kind!r} is not supported; npuserve implements "
                                        f"{', '.join(SUPPORTED_ROPE_SCALING)}")
        bias_default = model_type in ("qwen2", "qwen2_moe")
        try:
            return cls(
                model_type=model_type,
                num_layers=int(config["num_hidden_layers"]),
                hidden_size=hidden,
                num_attention_heads=heads,
                num_key_value_heads=heads if mla is not None else int(config.get("num_key_value_heads") or heads),
                head_dim=int(head_dim),
                intermediate_size=int(config["intermediate_size"]),
                vocab_size=int(config["vocab_size"]),
                max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
                dtype=dtype,
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope_theta=float(theta),
                rope_scaling=None if kind == "default" else rope,
                attention_bias=bool(config.get("attention_bias", config.get("qkv_bias", bias_default))),
                qk_norm=model_type in ("qwen3", "qwen3_moe"),
                bos_token_id=config.get("bos_token_id"),
                eos_token_id=config.get("eos_token_id"),
                moe=_moe_of(model_type, config) if model_type in MOE_MODEL_TYPES else None,
                mla=mla,
                quantization=quantization,
            )
        except ValidationError as e:
            raise UnsupportedModelError(f"config.json of a {model_type} model: {e}") from e

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> ModelSpec:
        path = Path(folder) / "config.json"
        try:
            config = json.loads(path.read_text())
        except FileNotFoundError as e:
            raise FileNotFoundError(f"no config.json in model folder {folder}") from e
        try:
            quantization = read_scheme(folder, config)
        except UnsupportedQuantizationError as e:
            raise UnsupportedModelError(str(e)) from e
        spec = cls.from_hf_config({k: v for k, v in config.items() if k != "quantization_config"})
        return spec.model_copy(update={"quantization": quantization})

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
        if self.moe is not None:
            config.update(_moe_hf_fields(self.model_type, self.moe))
        if self.mla is not None:
            config.update(self.mla.model_dump())
            config["qk_head_dim"] = self.mla.qk_head_dim
            config["head_dim"] = self.mla.qk_rope_head_dim  # transformers' DeepSeek configs call the rope size so
            config["attention_bias"] = self.attention_bias
            config["num_nextn_predict_layers"] = 0  # the MTP layer is not served nor written
        if self.model_type in ("qwen2_moe", "qwen3_moe"):
            config["use_sliding_window"] = False
            config["sliding_window"] = None
            config["max_window_layers"] = self.num_layers
            config["attention_bias"] = self.attention_bias
            if self.model_type == "qwen2_moe":
                config["qkv_bias"] = self.attention_bias
        return config


def _mla_of(config: dict[str, Any]) -> MLASpec:
    q_lora = config.get("q_lora_rank")
    return MLASpec(
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(config["kv_lora_rank"]),
        qk_nope_head_dim=int(config["qk_nope_head_dim"]),
        qk_rope_head_dim=int(config["qk_rope_head_dim"]),
        v_head_dim=int(config["v_head_dim"]),
        # DeepSeek-V2's transformers code always pairs adjacent channels; V3's follows the flag (default True)
        rope_interleave=True if config["model_type"] == "deepseek_v2" else bool(config.get("rope_interleave", True)),
    )


def _moe_of(model_type: str, config: dict[str, Any]) -> MoESpec:
    if model_type in ("qwen2_moe", "qwen3_moe"):
        experts = config.get("num_experts") or config.get("num_local_experts")
        return MoESpec(
            num_experts=int(experts or 0),
            num_experts_per_tok=int(config["num_experts_per_tok"]),
            moe_intermediate_size=int(config["moe_intermediate_size"]),
            shared_expert_intermediate_size=int(config.get("shared_expert_intermediate_size") or 0)
            if model_type == "qwen2_moe" else 0,
            shared_expert_gate=model_type == "qwen2_moe" and bool(config.get("shared_expert_intermediate_size")),
            norm_topk_prob=bool(config.get("norm_topk_prob", False)),
            decoder_sparse_step=int(config.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(int(i) for i in config.get("mlp_only_layers") or ()),
        )
    freq = int(config.get("moe_layer_freq") or 1)
    if freq != 1:
        raise UnsupportedModelError(f"{model_type} with moe_layer_freq {freq} is not supported (only 1)")
    scoring = config.get("scoring_func") or ("sigmoid" if model_type == "deepseek_v3" else "softmax")
    method = config.get("topk_method") or ("noaux_tc" if model_type == "deepseek_v3" else "greedy")
    if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise UnsupportedModelError(f"{model_type} with topk_method {method!r} is not supported")
    return MoESpec(
        num_experts=int(config["n_routed_experts"]),
        num_experts_per_tok=int(config["num_experts_per_tok"]),
        moe_intermediate_size=int(config["moe_intermediate_size"]),
        shared_expert_intermediate_size=int(config.get("n_shared_experts") or 0) * int(config["moe_intermediate_size"]),
        # transformers' DeepSeek-V2 never renormalises; V3 follows the flag
        norm_topk_prob=bool(config.get("norm_topk_prob", True)) if model_type == "deepseek_v3" else False,
        scoring_func=scoring,
        topk_method=method,
        n_group=int(config.get("n_group") or 1),
        topk_group=int(config.get("topk_group") or 1),
        routed_scaling_factor=float(config.get("routed_scaling_factor") or 1.0),
        first_k_dense_replace=int(config.get("first_k_dense_replace") or 0),
    )


def _moe_hf_fields(model_type: str, moe: MoESpec) -> dict[str, Any]:
    common = {"num_experts_per_tok": moe.num_experts_per_tok, "moe_intermediate_size": moe.moe_intermediate_size,
              "norm_topk_prob": moe.norm_topk_prob, "output_router_logits": False}
    if model_type in ("qwen2_moe", "qwen3_moe"):
        fields = {**common, "num_experts": moe.num_experts, "decoder_sparse_step": moe.decoder_sparse_step,
                  "mlp_only_layers": list(moe.mlp_only_layers), "router_aux_loss_coef": 0.001}
        if model_type == "qwen2_moe":
            fields["shared_expert_intermediate_size"] = moe.shared_expert_intermediate_size
        return fields
    shared, rest = divmod(moe.shared_expert_intermediate_size, moe.moe_intermediate_size)
    assert not rest, "DeepSeek's shared experts are whole experts"
    return {**common, "n_routed_experts": moe.num_experts, "n_shared_experts": shared,
            "scoring_func": moe.scoring_func, "topk_method": moe.topk_method, "n_group": moe.n_group,
            "topk_group": moe.topk_group, "routed_scaling_factor": moe.routed_scaling_factor,
            "first_k_dense_replace": moe.first_k_dense_replace, "moe_layer_freq": 1}
