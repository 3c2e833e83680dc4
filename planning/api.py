"""The `InferenceService` API (group `npuserve.io`, version `v1alpha1`; docs/planning.md#the-inferenceservice-crd) as
pydantic models.

Field names are the API's camelCase names, so an object loads as `kubectl` shows it. These models are the single
source of the CRD: `crd.py` derives the OpenAPI schema from them, and each CEL rule that the API server enforces
(`x-kubernetes-validations`) sits beside the pydantic validator that enforces the same thing in Python, with the
same message. `tests/operator/` checks that both agree on every example and on a list of invalid objects.
"""

from __future__ import annotations

from typing import Any, Final, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from npuserve.catalog.accelerators import ACCELERATORS
from npuserve.catalog.models import MODEL_PRESETS
from npuserve.engine_contract import DType, QueuePolicy, schedule_field, schedule_generation_field
from npuserve.modelspec import MLA_MODEL_TYPES, MOE_MODEL_TYPES
from npuserve.quantization import QuantizationRequest

GROUP = "npuserve.io"
VERSION = "v1alpha1"
API_VERSION: Final = "npuserve.io/v1alpha1"
KIND: Final = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
SHORT_NAMES = ("nisvc",)

Objective = Literal["throughput", "decodeLatency", "firstTokenAndDecode"]
Statistic = Literal["mean", "p90", "p99"]
Phase = Literal["Pending", "Planned", "Deploying", "Tuning", "Ready", "Degraded", "Failed"]
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
NAME_MAX_LENGTH = 45
DURATION_PATTERN = r"^([0-9]+(\.[0-9]+)?(ms|s|m|h))+$"


def cel(
    rule: str,
    message: str,
    *,
    field_path: str | None = None,
    reason: str | None = None,
    message_expression: str | None = None,
) -> dict[str, str]:
    """One `x-kubernetes-validations` entry. `message` names the field, as `kubectl` shows it to the user."""
    entry = {"rule": rule, "message": message}
    if message_expression:
        entry["messageExpression"] = message_expression
    if field_path:
        entry["fieldPath"] = field_path
    if reason:
        entry["reason"] = reason
    return entry


def _rules(*entries: dict[str, str], default: Any = None) -> dict[str, Any]:
    extra: dict[str, Any] = {"x-kubernetes-validations": list(entries)} if entries else {}
    if default is not None:
        extra["default"] = default
    return extra


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _fail(message: str) -> None:
    raise ValueError(message)


# --- spec.model --------------------------------------------------------------------------------------------------

_MOE_TYPES = MOE_MODEL_TYPES
_MLA_TYPES = MLA_MODEL_TYPES


def _cel_list(values: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{v}'" for v in values) + "]"


ARCHITECTURE_RULES = (
    cel(
        "self.numAttentionHeads % self.numKeyValueHeads == 0",
        "spec.model.architecture.numAttentionHeads must be a multiple of numKeyValueHeads",
        field_path=".numKeyValueHeads",
    ),
    cel(
        "has(self.numExperts) == has(self.numExpertsPerToken) && has(self.numExperts) == has(self.moeIntermediateSize)",
        "spec.model.architecture: set numExperts, numExpertsPerToken and moeIntermediateSize together (a mixture "
        "of experts)",
        reason="FieldValueRequired",
    ),
    cel(
        f"has(self.numExperts) == (self.modelType in {_cel_list(_MOE_TYPES)})",
        "spec.model.architecture.numExperts (a mixture of experts) is required for modelType "
        f"{', '.join(_MOE_TYPES)} and refused for the others",
        field_path=".numExperts",
    ),
    cel(
        "!has(self.numExperts) || !has(self.numExpertsPerToken) || self.numExpertsPerToken <= self.numExperts",
        "spec.model.architecture.numExpertsPerToken must not exceed numExperts",
        field_path=".numExpertsPerToken",
    ),
    cel(
        "has(self.numExperts) || (!has(self.sharedExpertIntermediateSize) && !has(self.normTopkProb) && "
        "!has(self.firstDenseLayers))",
        "spec.model.architecture: sharedExpertIntermediateSize, normTopkProb and firstDenseLayers need a mixture of "
        "experts (numExperts)",
        reason="FieldValueForbidden",
    ),
    cel(
        "!has(self.numExperts) || !has(self.sharedExpertIntermediateSize) || self.sharedExpertIntermediateSize == 0"
        " || self.modelType == 'qwen2_moe' || (self.modelType != 'qwen3_moe' && has(self.moeIntermediateSize) && "
        "self.sharedExpertIntermediateSize % self.moeIntermediateSize == 0)",
        "spec.model.architecture.sharedExpertIntermediateSize: qwen3_moe has no shared expert, and DeepSeek's are "
        "whole experts (a multiple of moeIntermediateSize)",
        field_path=".sharedExpertIntermediateSize",
    ),
    cel(
        "self.modelType != 'deepseek_v2' || !has(self.normTopkProb) || !self.normTopkProb",
        "spec.model.architecture.normTopkProb: deepseek_v2 never renormalises the top-k weights (transformers' "
        "DeepseekV2); leave it unset or false",
        field_path=".normTopkProb",
    ),
    cel(
        "!has(self.firstDenseLayers) || self.firstDenseLayers < self.numLayers",
        "spec.model.architecture.firstDenseLayers must be less than numLayers (at least one layer is a mixture of "
        "experts)",
        field_path=".firstDenseLayers",
    ),
    cel(
        "has(self.kvLoraRank) == has(self.qkNopeHeadDim) && has(self.kvLoraRank) == has(self.qkRopeHeadDim) && "
        "has(self.kvLoraRank) == has(self.vHeadDim) && (!has(self.qLoraRank) || has(self.kvLoraRank))",
        "spec.model.architecture: set kvLoraRank, qkNopeHeadDim, qkRopeHeadDim and vHeadDim together (latent "
        "attention; qLoraRank only with them)",
        reason="FieldValueRequired",
    ),
    cel(
        f"has(self.kvLoraRank) == (self.modelType in {_cel_list(_MLA_TYPES)})",
        "spec.model.architecture.kvLoraRank (latent attention) is required for modelType "
        f"{', '.join(_MLA_TYPES)} and refused for the others",
        field_path=".kvLoraRank",
    ),
    cel(
        "!has(self.kvLoraRank) || self.numKeyValueHeads == self.numAttentionHeads",
        "spec.model.architecture.numKeyValueHeads must equal numAttentionHeads with latent attention (no key-value "
        "heads to group: every head reads the one latent)",
        field_path=".numKeyValueHeads",
    ),
    cel(
        "!has(self.headDim) || !has(self.qkNopeHeadDim) || !has(self.qkRopeHeadDim) || "
        "self.headDim == self.qkNopeHeadDim + self.qkRopeHeadDim",
        "spec.model.architecture.headDim must be qkNopeHeadDim + qkRopeHeadDim with latent attention (or omitted)",
        field_path=".headDim",
    ),
)


def _has(value: object) -> bool:
    return value is not None


class Architecture(_Model):
    """An inline architecture, for a model outside the catalog; the numbers of its HF `config.json`.

    A mixture of experts (`qwen2_moe`, `qwen3_moe`, `deepseek_v2`, `deepseek_v3`) adds numExperts,
    numExpertsPerToken, moeIntermediateSize and optionally the shared experts, normTopkProb and the leading dense
    layers; latent attention (`deepseek_v2`, `deepseek_v3`) adds the ranks and head sizes of MLA. The router's
    grouping and scaling (n_group, topk_group, routed_scaling_factor) are not fields: planning does not depend on
    them (docs/planning.md, "MoE and MLA")."""

    model_config = ConfigDict(json_schema_extra=_rules(*ARCHITECTURE_RULES))

    modelType: Literal["llama", "qwen2", "qwen3", "mistral", "qwen2_moe", "qwen3_moe", "deepseek_v2",
                       "deepseek_v3"] = Field(default="llama", description="HF model_type")
    numLayers: int = Field(ge=1, le=1024, description="num_hidden_layers")
    hiddenSize: int = Field(ge=1, description="hidden_size")
    numAttentionHeads: int = Field(ge=1, le=1024, description="num_attention_heads")
    numKeyValueHeads: int = Field(ge=1, le=1024, description="num_key_value_heads (latent attention: "
                                  "numAttentionHeads)")
    headDim: int | None = Field(default=None, ge=1, description="head_dim; omitted: hiddenSize / numAttentionHeads "
                                "(latent attention: qkNopeHeadDim + qkRopeHeadDim)")
    vocabSize: int = Field(ge=1, description="vocab_size")
    intermediateSize: int = Field(ge=1, description="intermediate_size (a mixture of experts: its dense layers')")
    maxPositionEmbeddings: int = Field(default=4096, ge=1, description="max_position_embeddings")
    dtype: DType = Field(default="bfloat16", description="weight and KV dtype")
    parameters: int | None = Field(
        default=None, ge=1, description="total parameter count; omitted: computed from the architecture"
    )
    numExperts: int | None = Field(default=None, ge=1, le=4096,
                                   description="routed experts per MoE layer (num_experts, n_routed_experts)")
    numExpertsPerToken: int | None = Field(default=None, ge=1, le=4096, description="num_experts_per_tok (top-k)")
    moeIntermediateSize: int | None = Field(default=None, ge=1,
                                            description="moe_intermediate_size: one routed expert's MLP width")
    sharedExpertIntermediateSize: int | None = Field(
        default=None, ge=0,
        description="the shared experts as one MLP of this width: qwen2_moe's shared_expert_intermediate_size, "
        "DeepSeek's n_shared_experts x moe_intermediate_size; omitted: none")
    normTopkProb: bool | None = Field(
        default=None, description="norm_topk_prob: the top-k weights divided by their sum; omitted: the model "
        "type's default (true for deepseek_v3, false otherwise)")
    firstDenseLayers: int | None = Field(
        default=None, ge=0, le=1024, description="the leading layers with a dense MLP (DeepSeek's "
        "first_k_dense_replace; Qwen's mlp_only_layers 0..n-1); omitted: 0")
    qLoraRank: int | None = Field(default=None, ge=1, description="q_lora_rank; omitted with latent attention: a "
                                  "plain q_proj (DeepSeek-V2-Lite)")
    kvLoraRank: int | None = Field(default=None, ge=1, description="kv_lora_rank: the latent the KV cache holds")
    qkNopeHeadDim: int | None = Field(default=None, ge=1, description="qk_nope_head_dim")
    qkRopeHeadDim: int | None = Field(default=None, ge=1, description="qk_rope_head_dim: the shared rope key")
    vHeadDim: int | None = Field(default=None, ge=1, description="v_head_dim")

    @model_validator(mode="after")
    def _check(self) -> Architecture:
        moe, mla = _has(self.numExperts), _has(self.kvLoraRank)
        checks = (
            self.numAttentionHeads % self.numKeyValueHeads == 0,
            moe == _has(self.numExpertsPerToken) == _has(self.moeIntermediateSize),
            moe == (self.modelType in _MOE_TYPES),
            not moe or self.numExpertsPerToken is None or self.numExperts is None
            or self.numExpertsPerToken <= self.numExperts,
            moe or not (_has(self.sharedExpertIntermediateSize) or _has(self.normTopkProb)
                        or _has(self.firstDenseLayers)),
            not moe or not self.sharedExpertIntermediateSize or self.modelType == "qwen2_moe"
            or (self.modelType != "qwen3_moe" and self.moeIntermediateSize is not None
                and self.sharedExpertIntermediateSize % self.moeIntermediateSize == 0),
            self.modelType != "deepseek_v2" or not self.normTopkProb,
            self.firstDenseLayers is None or self.firstDenseLayers < self.numLayers,
            mla == _has(self.qkNopeHeadDim) == _has(self.qkRopeHeadDim) == _has(self.vHeadDim)
            and (not _has(self.qLoraRank) or mla),
            mla == (self.modelType in _MLA_TYPES),
            not mla or self.numKeyValueHeads == self.numAttentionHeads,
            self.headDim is None or self.qkNopeHeadDim is None or self.qkRopeHeadDim is None
            or self.headDim == self.qkNopeHeadDim + self.qkRopeHeadDim,
        )
        for ok, rule in zip(checks, ARCHITECTURE_RULES, strict=True):
            if not ok:
                _fail(rule["message"])
        return self


class PVCWeights(_Model):
    claimName: str = Field(min_length=1, description="PersistentVolumeClaim holding the HF model folder")
    subPath: str | None = Field(default=None, description="folder of the model inside the volume")


class HostPathWeights(_Model):
    path: str = Field(min_length=1, pattern=r"^/", description="absolute path of the model folder on every node")


WEIGHTS_RULES = (
    cel(
        "(has(self.loadFormat) && self.loadFormat == 'dummy') ? !has(self.pvc) && !has(self.hostPath)"
        " : has(self.pvc) != has(self.hostPath)",
        "spec.model.weights: set exactly one of pvc or hostPath (none with loadFormat dummy)",
        reason="FieldValueInvalid",
    ),
)


class Weights(_Model):
    model_config = ConfigDict(json_schema_extra=_rules(*WEIGHTS_RULES))

    pvc: PVCWeights | None = None
    hostPath: HostPathWeights | None = None
    loadFormat: Literal["auto", "safetensors", "dummy"] = Field(
        default="auto", description="dummy: random weights of the architecture, no model files (tests, demos)"
    )

    @model_validator(mode="after")
    def _check(self) -> Weights:
        sources = (self.pvc is not None) + (self.hostPath is not None)
        if (self.loadFormat == "dummy" and sources) or (self.loadFormat != "dummy" and sources != 1):
            _fail(WEIGHTS_RULES[0]["message"])
        return self


MODEL_RULES = (
    cel(
        "has(self.preset) != has(self.architecture)",
        "spec.model: set exactly one of preset or architecture",
        reason="FieldValueInvalid",
    ),
)


class ModelSource(_Model):
    model_config = ConfigDict(json_schema_extra=_rules(*MODEL_RULES))

    name: str = Field(min_length=1, max_length=256, description="the served model name (OpenAI `model`)")
    # maxLength bounds the CEL cost estimate of the rules and messages that use the preset (the API server refuses
    # a CRD whose estimated rule cost is unbounded).
    preset: str | None = Field(
        default=None, description="architecture from the built-in catalog",
        max_length=max(len(p) for p in MODEL_PRESETS),
        json_schema_extra={"enum": list(MODEL_PRESETS)},
    )
    architecture: Architecture | None = None
    weights: Weights
    quantization: QuantizationRequest | None = Field(
        default=None, description="the W8A8 scheme the checkpoint declares (msModelSlim's "
        "quant_model_description.json or compressed-tensors' quantization_config): the planner sizes the weights by "
        "it and the engine refuses a checkpoint that declares another; with loadFormat dummy, random int8 weights "
        "of it. Omitted: 16-bit weights (the engine still serves what a checkpoint declares). The KV cache stays in "
        "the model's 16-bit dtype: KV cache quantization has no field and a checkpoint declaring it is refused")

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, value: str | None) -> str | None:
        if value is not None and value not in MODEL_PRESETS:
            _fail(f"spec.model.preset: unknown preset {value!r}; known: {', '.join(MODEL_PRESETS)}")
        return value

    @model_validator(mode="after")
    def _check(self) -> ModelSource:
        if (self.preset is None) == (self.architecture is None):
            _fail(MODEL_RULES[0]["message"])
        return self


# --- spec.accelerator, workload, slo, capacity ------------------------------------------------------------------

ACCELERATOR_RULES = (
    cel(
        "!has(self.memoryGiB) || !has(self.reservedGiB) || self.reservedGiB < self.memoryGiB",
        "spec.accelerator.reservedGiB must be less than spec.accelerator.memoryGiB",
        field_path=".reservedGiB",
    ),
    cel(
        "self.type != 'cpu' || has(self.memoryGiB)",
        "spec.accelerator.memoryGiB is required for type cpu (the memory the KV cache may use)",
        field_path=".memoryGiB",
        reason="FieldValueRequired",
    ),
    cel(
        "!has(self.cards) || !has(self.cardsPerNode) || self.cards <= self.cardsPerNode || "
        "self.cards % self.cardsPerNode == 0",
        "spec.accelerator.cards must be a multiple of spec.accelerator.cardsPerNode when it exceeds it (a replica "
        "spanning nodes takes whole nodes: cards / cardsPerNode pods of cardsPerNode cards)",
        field_path=".cards",
    ),
)


class AcceleratorSpec(_Model):
    model_config = ConfigDict(json_schema_extra=_rules(*ACCELERATOR_RULES))

    type: str = Field(
        description="accelerator from the built-in catalog", json_schema_extra={"enum": list(ACCELERATORS)}
    )
    cards: int | None = Field(
        default=None, ge=1, le=1024,
        description="cards per replica (worldSize); omitted: the smallest count that fits and divides the heads",
    )
    cardsPerNode: int | None = Field(
        default=None, ge=1, le=1024,
        description="cards one node gives a pod; a replica of more cards spans cards / cardsPerNode pods, one per "
        "node (a LeaderWorkerSet); omitted: the catalog's (none for cpu: one pod)",
    )
    memoryGiB: float | None = Field(default=None, gt=0, description="memory per card; omitted: the catalog's")
    reservedGiB: float | None = Field(
        default=None, ge=0, description="memory a card holds at idle (`npu-smi info`); omitted: the catalog's"
    )
    memoryFraction: float = Field(
        default=0.8, gt=0, le=1, description="share of free memory given to the KV cache (NPU_MEMORY_FRACTION)"
    )

    @field_validator("type")
    @classmethod
    def _known_accelerator(cls, value: str) -> str:
        if value not in ACCELERATORS:
            _fail(f"spec.accelerator.type: unknown accelerator {value!r}; known: {', '.join(ACCELERATORS)}")
        return value

    @model_validator(mode="after")
    def _check(self) -> AcceleratorSpec:
        if self.memoryGiB is not None and self.reservedGiB is not None and self.reservedGiB >= self.memoryGiB:
            _fail(ACCELERATOR_RULES[0]["message"])
        if self.type == "cpu" and self.memoryGiB is None:
            _fail(ACCELERATOR_RULES[1]["message"])
        if (self.cards is not None and self.cardsPerNode is not None and self.cards > self.cardsPerNode
                and self.cards % self.cardsPerNode):
            _fail(ACCELERATOR_RULES[2]["message"])
        return self


WORKLOAD_RULES = (
    cel(
        "self.avgOutputTokens <= self.maxOutputTokens",
        "spec.workload.avgOutputTokens must not exceed spec.workload.maxOutputTokens",
        field_path=".avgOutputTokens",
    ),
    cel(
        "self.avgInputTokens <= self.maxInputTokens",
        "spec.workload.avgInputTokens must not exceed spec.workload.maxInputTokens",
        field_path=".avgInputTokens",
    ),
)


class WorkloadSpec(_Model):
    """The traffic shape, as the guide measures it (GSM8K: 186 tokens in, 346 out on average, at most 512)."""

    model_config = ConfigDict(json_schema_extra=_rules(*WORKLOAD_RULES))

    avgInputTokens: int = Field(ge=1, le=1_000_000)
    avgOutputTokens: int = Field(ge=1, le=1_000_000)
    maxOutputTokens: int = Field(default=512, ge=1, le=1_000_000, description="MindIE maxIterTimes")
    maxInputTokens: int = Field(default=2048, ge=1, le=1_000_000, description="MindIE maxInputTokenLen")

    @model_validator(mode="after")
    def _check(self) -> WorkloadSpec:
        if self.avgOutputTokens > self.maxOutputTokens:
            _fail(WORKLOAD_RULES[0]["message"])
        if self.avgInputTokens > self.maxInputTokens:
            _fail(WORKLOAD_RULES[1]["message"])
        return self


SLO_RULES = (
    cel(
        "self.objective != 'decodeLatency' || has(self.tpotMs)",
        "spec.slo.tpotMs is required when spec.slo.objective is decodeLatency",
        field_path=".tpotMs",
        reason="FieldValueRequired",
    ),
    cel(
        "self.objective != 'firstTokenAndDecode' || has(self.tpotMs)",
        "spec.slo.tpotMs is required when spec.slo.objective is firstTokenAndDecode",
        field_path=".tpotMs",
        reason="FieldValueRequired",
    ),
    cel(
        "self.objective != 'firstTokenAndDecode' || has(self.ttftMs)",
        "spec.slo.ttftMs is required when spec.slo.objective is firstTokenAndDecode",
        field_path=".ttftMs",
        reason="FieldValueRequired",
    ),
)


class SLOSpec(_Model):
    model_config = ConfigDict(json_schema_extra=_rules(*SLO_RULES))

    objective: Objective = Field(
        default="throughput",
        description="throughput: most output tokens/s; decodeLatency: most output tokens/s with TPOT under tpotMs; "
        "firstTokenAndDecode: most output tokens/s with TTFT under ttftMs and TPOT under tpotMs",
    )
    ttftMs: float | None = Field(default=None, gt=0, description="time to first token bound, milliseconds")
    tpotMs: float | None = Field(default=None, gt=0, description="time per output token bound, milliseconds")
    statistic: Statistic = Field(default="mean", description="which statistic of TTFT/TPOT the bounds apply to")

    @model_validator(mode="after")
    def _check(self) -> SLOSpec:
        if self.objective in ("decodeLatency", "firstTokenAndDecode") and self.tpotMs is None:
            _fail(SLO_RULES[0 if self.objective == "decodeLatency" else 1]["message"])
        if self.objective == "firstTokenAndDecode" and self.ttftMs is None:
            _fail(SLO_RULES[2]["message"])
        return self


CAPACITY_RULES = (
    cel(
        "!has(self.maxReplicas) || self.minReplicas <= self.maxReplicas",
        "spec.capacity.minReplicas must not exceed spec.capacity.maxReplicas",
        field_path=".minReplicas",
    ),
)


class CapacitySpec(_Model):
    model_config = ConfigDict(json_schema_extra=_rules(*CAPACITY_RULES))

    targetConcurrentUsers: int = Field(ge=1, description="users in flight at once; replicas are planned to hold them")
    concurrencyPerReplica: int | None = Field(
        default=None, ge=1,
        description="requests one replica holds under the SLO; omitted: the plan's maxBatchSize.min "
        "(every request at its maximum length, no preemption) until autotune measures it",
    )
    minReplicas: int = Field(default=1, ge=1, le=10000, description="the fewest replicas the measured capacity sets")
    maxReplicas: int | None = Field(
        default=None, ge=1, le=10000,
        description="the most replicas the measured capacity sets; omitted: as many as the nodes' cards hold",
    )

    @model_validator(mode="after")
    def _check(self) -> CapacitySpec:
        if self.maxReplicas is not None and self.minReplicas > self.maxReplicas:
            _fail(CAPACITY_RULES[0]["message"])
        return self


class AutotuneSpec(_Model):
    enabled: bool = Field(
        default=False,
        description="closed-loop tuning of the ScheduleConfig from the engines' TTFT/TPOT in Prometheus "
        "(the operator needs --prometheus-url)",
    )
    mode: Literal["online", "benchmark"] = Field(
        default="online",
        description="online: measure live traffic; benchmark: a load-generator Job per trial at the guide's "
        "client concurrency of maxBatchSize - 1",
    )
    maxTrials: int = Field(default=8, ge=1, le=100)
    window: str = Field(default="2m", pattern=DURATION_PATTERN,
                        description="measured window per trial (Go duration), after a settling time of a quarter "
                        "of it that is discarded")
    minSamples: int = Field(default=50, ge=1, le=1_000_000,
                            description="finished requests a window must hold to count; fewer: measured again")
    innerLoop: bool = Field(
        default=False,
        description="after a verdict that meets a TPOT bound, run the engine's TPOT controller (MindIE 2.3's "
        "dynamicBatchSizeEnable) under the tuned maxBatchSize with decodeExpectedTime just under spec.slo.tpotMs; "
        "off while trials run (needs spec.slo.tpotMs and statistic mean)",
    )


# The engine's controller holds the mean TPOT: a spec asking for it needs a TPOT bound on the mean. Checked on the
# spec (they read spec.slo); the engine also refuses it with chunked prefill, which is no spec field.
INNER_LOOP_RULES = (
    cel(
        "!self.autotune.innerLoop || has(self.slo.tpotMs)",
        "spec.autotune.innerLoop needs spec.slo.tpotMs: the engine's controller holds a TPOT target",
        field_path=".autotune.innerLoop",
    ),
    cel(
        "!self.autotune.innerLoop || self.slo.statistic == 'mean'",
        "spec.autotune.innerLoop needs spec.slo.statistic mean: the engine's controller holds the mean TPOT",
        field_path=".autotune.innerLoop",
    ),
)


# --- spec.engine, host, monitoring -------------------------------------------------------------------------------

SCHEDULE_RULES = (
    cel(
        "!has(self.maxPrefillBatchSize) || !has(self.maxBatchSize) || self.maxPrefillBatchSize <= self.maxBatchSize",
        "spec.engine.schedule.maxPrefillBatchSize must not exceed spec.engine.schedule.maxBatchSize",
        field_path=".maxPrefillBatchSize",
    ),
)


class ScheduleKnobs(_Model):
    """MindIE ScheduleConfig values; each one set is pinned (the planner and the tuner leave it alone)."""

    model_config = ConfigDict(json_schema_extra=_rules(*SCHEDULE_RULES))

    # Ranges from the contract's field table, as in config.json and /admin/schedule (the tuner's knobs only).
    cacheBlockSize: int | None = schedule_field("cacheBlockSize", optional=True)
    maxBatchSize: int | None = schedule_field("maxBatchSize", optional=True)
    maxPrefillBatchSize: int | None = schedule_field("maxPrefillBatchSize", optional=True)
    maxPrefillTokens: int | None = schedule_field("maxPrefillTokens", optional=True)
    prefillTimeMsPerReq: int | None = schedule_field("prefillTimeMsPerReq", optional=True)
    decodeTimeMsPerReq: int | None = schedule_field("decodeTimeMsPerReq", optional=True)
    maxPreemptCount: int | None = schedule_field("maxPreemptCount", optional=True)
    supportSelectBatch: bool | None = schedule_field("supportSelectBatch", optional=True)
    maxQueueDelayMicroseconds: int | None = schedule_field("maxQueueDelayMicroseconds", optional=True)

    @model_validator(mode="after")
    def _check(self) -> ScheduleKnobs:
        if (
            self.maxPrefillBatchSize is not None
            and self.maxBatchSize is not None
            and self.maxPrefillBatchSize > self.maxBatchSize
        ):
            _fail(SCHEDULE_RULES[0]["message"])
        return self

    def pinned(self) -> dict[str, int | bool]:
        return {k: v for k, v in self.model_dump(exclude_none=True).items()}


# The ScheduleConfig fields of the engine's TPOT controller (engine_contract.SCHEDULE_FIELDS: hot, not tuner knobs).
INNER_LOOP_FIELDS: Final = ("dynamicBatchSizeEnable", "decodeExpectedTime")


class AppliedSchedule(ScheduleKnobs):
    """The knobs the operator has put on the engines, and their schedule generation: the one source of the tuned
    schedule. The generation rises with every schedule the tuner applies (and past the plan's own, which the
    ConfigMap holds at a spec change: `autotune.plan_generation`); the engines take a schedule only when its
    generation is newer than the one they run, and the ConfigMap and every PUT /admin/schedule carry it."""

    scheduleGeneration: int = schedule_generation_field(required=True)
    # The engine's TPOT controller (spec.autotune.innerLoop): on only after a verdict that met a TPOT bound; set false
    # explicitly while trials run, so an engine that ran it turns it off (unset: the engine's config.json's value).
    dynamicBatchSizeEnable: bool | None = schedule_field("dynamicBatchSizeEnable", optional=True)
    decodeExpectedTime: int | None = schedule_field("decodeExpectedTime", optional=True)

    def knobs(self) -> ScheduleKnobs:
        return ScheduleKnobs.model_validate(self.model_dump(exclude={"scheduleGeneration", *INNER_LOOP_FIELDS}))

    def inner_loop(self) -> dict[str, int | bool]:
        """The controller's fields that are set (none: the engines keep their own)."""
        return self.model_dump(include=set(INNER_LOOP_FIELDS), exclude_none=True)


class Toleration(_Model):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    tolerationSeconds: int | None = None


class EngineSpec(_Model):
    image: str = Field(default="npuserve/engine:0.1.0", min_length=1)
    imagePullPolicy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    schedule: ScheduleKnobs = Field(default_factory=ScheduleKnobs)
    policy: QueuePolicy = Field(default="fcfs", description="waiting-queue order")
    cpu: int | None = Field(
        default=None, ge=1, le=1024,
        description="whole CPUs per pod (requests = limits); omitted: 8 per card, at least 4",
    )
    memoryGiB: int | None = Field(
        default=None, ge=1, description="host memory per pod (requests = limits); omitted: weights + swap + 16 GiB"
    )
    nodeSelector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    socketInterface: str | None = Field(
        default=None, max_length=255, pattern=r"^[A-Za-z0-9_.-]{1,15}(,[A-Za-z0-9_.-]{1,15})*$",
        description="the pod's network interface(s) (comma-separated names, e.g. eth0) for the sockets between the "
        "pods of a replica spanning nodes: HCCL_SOCKET_IFNAME (Ascend; instead of HCCL_IF_IP = the pod's IP), "
        "NCCL_SOCKET_IFNAME (CUDA) and GLOO_SOCKET_IFNAME; omitted: the pod's IP on Ascend, the libraries' own "
        "choice elsewhere",
    )


class HostTuning(_Model):
    """Host tuning of the guide; each switchable. The two that change the node itself are opt-in."""

    cpuPinning: Literal["numa", "none"] = Field(
        default="numa",
        description="numa: integer CPU requests = limits (static CPU manager) and the engine bound to the NUMA "
        "node of its cards",
    )
    transparentHugePages: bool = Field(
        default=False, description="a privileged init container sets THP to `always` (node-wide)"
    )
    jemalloc: bool = Field(default=True, description="LD_PRELOAD the image's libjemalloc")
    cpuPerformanceGovernor: bool = Field(
        default=False, description="a privileged init container sets the CPU governor to performance (node-wide)"
    )


class MonitoringSpec(_Model):
    podMonitor: bool = Field(default=False, description="create a PodMonitor (Prometheus Operator)")
    interval: str = Field(default="15s", pattern=DURATION_PATTERN)


SPEC_RULES = (
    cel(
        "!has(self.replicas) || !has(self.capacity) || (self.replicas >= self.capacity.minReplicas && "
        "(!has(self.capacity.maxReplicas) || self.replicas <= self.capacity.maxReplicas))",
        "spec.replicas must lie within spec.capacity.minReplicas and maxReplicas (with spec.capacity set, the "
        "operator sets spec.replicas from the measured capacity through the scale subresource)",
        field_path=".replicas",
    ),
    cel(
        "!has(self.accelerator.cards) || !has(self.model.architecture) || "
        "self.model.architecture.numAttentionHeads % self.accelerator.cards == 0",
        "spec.accelerator.cards must divide spec.model.architecture.numAttentionHeads",
        field_path=".accelerator.cards",
    ),
)


def _preset_heads_rule() -> dict[str, str]:
    heads = ", ".join(f"'{name}': {spec.num_attention_heads}" for name, spec in MODEL_PRESETS.items())
    table = "{" + heads + "}"
    return cel(
        f"!has(self.accelerator.cards) || !has(self.model.preset) || {table}[self.model.preset] "
        "% self.accelerator.cards == 0",
        "spec.accelerator.cards must divide the attention heads of spec.model.preset",
        # format() rather than string(int) + ...: the API server estimates string(int) as unbounded and refuses the
        # CRD for its messageExpression cost; format's estimate is bounded.
        message_expression="'spec.accelerator.cards (%d) must divide the %d attention heads of spec.model.preset %s'"
        f".format([self.accelerator.cards, {table}[self.model.preset], self.model.preset])",
        field_path=".accelerator.cards",
    )


PRESET_HEADS_RULE = _preset_heads_rule()


class InferenceServiceSpec(_Model):
    model_config = ConfigDict(json_schema_extra=_rules(*SPEC_RULES, PRESET_HEADS_RULE, *INNER_LOOP_RULES))

    model: ModelSource
    accelerator: AcceleratorSpec
    replicas: int | None = Field(
        default=None, ge=0, le=10000,
        description="replica count; with capacity set, written by the operator from the measured capacity; "
        "omitted: 1, or the plan's estimate from capacity"
    )
    workload: WorkloadSpec
    slo: SLOSpec = Field(default_factory=SLOSpec, json_schema_extra={"default": {}})
    capacity: CapacitySpec | None = None
    autotune: AutotuneSpec = Field(default_factory=AutotuneSpec, json_schema_extra={"default": {}})
    engine: EngineSpec = Field(default_factory=EngineSpec, json_schema_extra={"default": {}})
    host: HostTuning = Field(default_factory=HostTuning, json_schema_extra={"default": {}})
    monitoring: MonitoringSpec = Field(default_factory=MonitoringSpec, json_schema_extra={"default": {}})

    @model_validator(mode="after")
    def _check(self) -> InferenceServiceSpec:
        cap = self.capacity
        if self.replicas is not None and cap is not None and not (
                cap.minReplicas <= self.replicas <= (cap.maxReplicas or self.replicas)):
            _fail(SPEC_RULES[0]["message"])
        cards = self.accelerator.cards
        if cards is not None:
            heads = (
                self.model.architecture.numAttentionHeads
                if self.model.architecture is not None
                else MODEL_PRESETS[str(self.model.preset)].num_attention_heads
            )
            if heads % cards and self.model.architecture is not None:
                _fail(SPEC_RULES[1]["message"])
            if heads % cards:  # the same words as the CEL rule's messageExpression
                _fail(
                    f"spec.accelerator.cards ({cards}) must divide the {heads} attention heads of "
                    f"spec.model.preset {self.model.preset}"
                )
        if self.autotune.innerLoop and self.slo.tpotMs is None:
            _fail(INNER_LOOP_RULES[0]["message"])
        if self.autotune.innerLoop and self.slo.statistic != "mean":
            _fail(INNER_LOOP_RULES[1]["message"])
        return self


# --- status ------------------------------------------------------------------------------------------------------


class Range(_Model):
    min: int
    avg: int
    max: int


class ExplainEntry(_Model):
    """One number of the plan: what it is, its value, the formula and the inputs that gave it."""

    step: int = Field(ge=0, description="step of the tuning guide (docs/planning.md#the-steps); 0: inputs")
    name: str = Field(description="JSON path of the number in the plan")
    value: float | int | bool = Field(json_schema_extra={"x-kubernetes-preserve-unknown-fields": True})
    unit: str = ""
    formula: str
    inputs: dict[str, float] = Field(default_factory=dict)
    note: str = ""


class PlanSchedule(_Model):
    """The MindIE ScheduleConfig values the plan chose (names exactly MindIE's; ranges from the contract)."""

    cacheBlockSize: int = schedule_field("cacheBlockSize", required=True)
    maxBatchSize: int = schedule_field("maxBatchSize", required=True)
    maxPrefillBatchSize: int = schedule_field("maxPrefillBatchSize", required=True)
    maxPrefillTokens: int = schedule_field("maxPrefillTokens", required=True)
    prefillTimeMsPerReq: int = schedule_field("prefillTimeMsPerReq", required=True)
    decodeTimeMsPerReq: int = schedule_field("decodeTimeMsPerReq", required=True)
    maxIterTimes: int = schedule_field("maxIterTimes", required=True)
    maxPreemptCount: int = schedule_field("maxPreemptCount", required=True)
    supportSelectBatch: bool = schedule_field("supportSelectBatch", required=True)
    maxQueueDelayMicroseconds: int = schedule_field("maxQueueDelayMicroseconds", required=True)


NOT_QUANTIZED = "none"  # Plan.quantization of a model served in its own dtype


class Plan(_Model):
    """`npuserve plan --format json`, and `status.plan`: every number of the tuning guide, each explained."""

    model: str
    preset: str | None = None
    accelerator: str
    objective: Objective
    worldSize: int
    nodes: int = Field(description="pods per replica: 1, or worldSize / cardsPerNode when the cards span nodes")
    cardsPerPod: int
    cardMemoryGiB: float
    reservedGiB: float
    memoryFraction: float
    weightsGiB: float
    # a string, never null: the status keeps every plan field (a null would fail the CRD's schema)
    quantization: str = Field(default=NOT_QUANTIZED, description="the quantized scheme served (`msmodelslim "
                              "W8A8_DYNAMIC`, `compressed-tensors W8A8 (static)`...), or `none`: weights in the "
                              "model's dtype; the KV cache stays in the model's dtype either way")
    npuMemSizeGiB: int
    cpuMemSizeGiB: int
    blockBytesPerCard: int
    totalBlocks: int
    blocksPerRequest: Range
    maxBatchSize: Range
    maxSeqLen: int
    maxInputTokenLen: int
    memoryBound: bool
    schedule: PlanSchedule
    pinned: list[str] = Field(default_factory=list, description="schedule fields set in spec.engine.schedule")
    concurrencyPerReplica: int
    replicas: int
    explain: list[ExplainEntry]
    warnings: list[str] = Field(default_factory=list)

    def explained(self, name: str) -> ExplainEntry:
        for entry in self.explain:
            if entry.name == name:
                return entry
        raise KeyError(name)


# status.observed: the last window measured, for people (the printer columns show it): the maxBatchSize it ran and its
# figures, rounded as people read them; status.tuning.history keeps each trial's figures unrounded.
class Observed(_Model):
    maxBatchSize: int | None = Field(default=None, description="the maxBatchSize the last window ran")
    ttftMs: float | None = Field(default=None, description="TTFT over the last window, at the SLO's statistic "
                                 "(whole ms; one decimal under 10 ms)")
    tpotMs: float | None = Field(default=None, description="TPOT over the last window, at the SLO's statistic "
                                 "(whole ms; one decimal under 10 ms)")
    outputTokensPerSecond: float | None = Field(default=None, description="output tokens/s over the last window, "
                                                "whole")
    errorRate: float | None = None
    window: str | None = Field(default=None, description="the window measured, as its length (Go duration)")
    samples: int | None = Field(default=None, ge=0, description="requests that finished in the window")
    measuredAt: str | None = Field(default=None, description="RFC 3339 time at the end of the window")
    sloMet: bool | None = Field(default=None, description="the window met every SLO bound and failed no check "
                                "(the tuner's judge)")
    failing: list[str] = Field(default_factory=list, max_length=16,
                               description="what the judge found wrong with the window: a figure over its bound "
                               "(tpotMs.mean) or a failed check (errorRate, kvExhausted)")
    kvBlocksAllocated: int | None = Field(default=None, description="blocks the engine allocated (its /info)")


# --- status.tuning ---------------------------------------------------------------------------------------------------


class LatencyStats(_Model):
    mean: float = Field(ge=0)
    p90: float = Field(ge=0)
    p99: float = Field(ge=0)

    def of(self, statistic: Statistic) -> float:
        value: float = getattr(self, statistic)
        return value


class TrialMetrics(_Model):
    """What one settled window measured (from Prometheus, or from the simulator), as the tuner judges it."""

    outputTokensPerSecond: float = Field(ge=0)
    ttftMs: LatencyStats
    tpotMs: LatencyStats
    errorRate: float = Field(default=0, ge=0, le=1)
    samples: int = Field(ge=0, description="requests that finished in the window")
    preemptions: int = Field(default=0, ge=0)
    kvUsageMax: float | None = Field(default=None, ge=0,
                                     description="the highest KV cache usage (0-1) any engine reached in the window")
    kvExhausted: bool = Field(default=False, description="the judge's finding: the KV cache ran full (kvUsageMax) "
                              "and requests were preempted")
    inFlightPerPod: float | None = Field(default=None, ge=0,
                                         description="mean requests in flight per engine pod (Little's law)")
    e2eMeanMs: float | None = Field(default=None, ge=0, description="mean request latency, first byte to last")


TrialOutcome = Literal["measured", "failed", "inconclusive"]
# Why a trial failed (the search stays below its batch): from the window's figures, or from what the engines and the
# load did during the window.
FailureReasonName = Literal["ErrorRate", "KVCacheExhausted", "NoOutputTokens", "PreemptionStorm",
                            "EngineRestarted", "EngineGone", "EngineNotReady", "LoadJobFailed"]
# Why a window said nothing (it is measured again; the tuner never sees it). ScheduleNotRun: a measured pod did not
# run the trial's schedule generation for the whole window (the engines' generation gauge), so the window measured
# something else.
InconclusiveReasonName = Literal["PrometheusUnreachable", "NoRequestFinished", "ScheduleNotRun"]
SCHEDULE_NOT_RUN: Final[InconclusiveReasonName] = "ScheduleNotRun"
TrialReason = Literal[FailureReasonName, InconclusiveReasonName]
FAILURE_REASONS: Final = get_args(FailureReasonName)
INCONCLUSIVE_REASONS: Final = get_args(InconclusiveReasonName)


class TuningTrial(_Model):
    """One entry of status.tuning.history: what was applied, what was measured and what the judge made of it."""

    trial: int = Field(ge=0)
    schedule: ScheduleKnobs
    outcome: TrialOutcome
    reason: TrialReason | None = Field(default=None, description="failed or inconclusive: why")
    failing: list[str] = Field(default_factory=list, max_length=16,
                               description="the figures that failed the trial or missed a bound (tpotMs.mean)")
    sloMet: bool | None = Field(default=None, description="measured: this window met every bound (the judge)")
    metrics: TrialMetrics | None = None
    verdict: str = Field(default="", description="the judgement in one line, for people")
    window: str | None = Field(default=None, description="RFC 3339 start/end of the measured window")

    @model_validator(mode="after")
    def _check(self) -> TuningTrial:
        if self.outcome == "measured" and (self.metrics is None or self.reason is not None):
            raise ValueError("a measured trial has metrics and no failure reason")
        if self.outcome == "failed" and self.reason not in FAILURE_REASONS:
            raise ValueError(f"a failed trial needs a failure reason ({', '.join(FAILURE_REASONS)})")
        if self.outcome == "inconclusive" and self.reason not in INCONCLUSIVE_REASONS:
            raise ValueError(f"an inconclusive trial needs a reason ({', '.join(INCONCLUSIVE_REASONS)})")
        return self


class TrialInProgress(_Model):
    """The trial (or capacity probe) whose window is open: what the operator applied and when it measures."""

    kind: Literal["trial", "capacity"] = "trial"
    trial: int = Field(ge=0, description="its number in status.tuning.history (trials) or status.capacity.probes")
    schedule: ScheduleKnobs
    concurrency: int | None = Field(default=None, ge=1, description="benchmark mode: the Job's client concurrency")
    appliedAt: str
    measureFrom: str = Field(description="RFC 3339: the window opens (what came before it settles and is dropped)")
    measureUntil: str
    pods: list[str] = Field(default_factory=list, max_length=10000,
                            description="name/uid/restarts of each engine pod when the trial began")
    target: str | None = Field(default=None, description="benchmark mode: the one pod the Job loads and is measured")
    job: str | None = Field(default=None, description="benchmark mode: the load-generator Job")
    inconclusive: str | None = Field(default=None, description="why the last reading of this window was unusable")
    inconclusiveReason: InconclusiveReasonName | None = Field(
        default=None, description="the kind of `inconclusive`: Prometheus down waits for it to answer again")
    attempts: int = Field(default=0, ge=0, description="windows read without a usable measurement")


StopReason = Literal["converged", "maxTrials", "pinned", "sloUnreachable", "allFailed"]
BatchLimit = Literal["memory", "slo", "failure", "throughputPeak", "pinned", "none"]
# What makes the verdict's claim that its schedule meets the SLO: its own windows; a larger batch's windows
# (latency never falls as the batch grows); or the calibrated model, while it passes its adequacy test.
ClaimBasis = Literal["windows", "monotone", "model"]


class TuningVerdict(_Model):
    """How a tuning round ended, and the evidence behind it: the windows measured at the chosen schedule."""

    reason: StopReason
    sloMet: bool | None = Field(default=None, description="the chosen schedule is proven to meet every bound with the "
                                "noise measured (claimBasis says by what; None: nothing was measured)")
    maxBatchSize: int | None = None
    limit: BatchLimit = Field(default="none", description="what stops maxBatchSize from going higher: memory (the "
                              "plan's maximum, what the KV cache holds), slo (a larger batch missed a bound), "
                              "failure (a larger batch failed), throughputPeak (throughput falls beyond it)")
    trials: list[int] = Field(default_factory=list, max_length=100,
                              description="the history's trials measured at the chosen schedule")
    claimBasis: ClaimBasis | None = Field(default=None, description="what proves sloMet: the chosen schedule's own "
                                          "windows, a larger batch's windows (monotone: latency never falls as the "
                                          "batch grows), or the calibrated model while it passes its adequacy test")
    proofTrials: list[int] = Field(default_factory=list, max_length=100,
                                   description="the history's trials whose windows prove sloMet")
    pooled: TrialMetrics | None = Field(default=None, description="those trials' windows pooled (by requests)")
    noise: float | None = Field(default=None, ge=0, description="relative noise of one window, as estimated")
    message: str = ""


class ModelParameter(_Model):
    """One fitted parameter of the engine model: its value and standard deviation (None where not finite)."""

    name: str
    value: float | None = None
    sd: float | None = None


# The previous round's windows a new round's engine model reads (status.tuning.earlier): as many as its adequacy test
# looks at (engine_model.ADEQUACY_WINDOWS).
EARLIER_WINDOWS = 8


class OnlineModelStatus(_Model):
    """status.tuning.model: the engine model calibrated on this round's windows (docs/operator.md, "The online
    model"): what it says of the engine, how sure it is, and whether it passes its adequacy test (only then does it
    propose trials or prove claims)."""

    windows: int = Field(ge=0, description="windows it is fitted to")
    earlierWindows: int = Field(default=0, ge=0, description="of them, the previous round's (status.tuning.earlier): "
                                                             "read only while the model passes its adequacy test "
                                                             "with them")
    parameters: list[ModelParameter] = Field(default_factory=list, max_length=8)
    noise: float = Field(ge=0, description="one window's relative TPOT noise, from its residuals")
    adequate: bool
    adequacy: str = Field(description="the adequacy test, for people")
    lastErrors: list[float] = Field(default_factory=list, max_length=8,
                                    description="the last windows' one-step-ahead relative TPOT prediction errors "
                                                "((predicted - measured) / measured), oldest first")


class TuningStatus(_Model):
    phase: Literal["Idle", "Running", "Converged", "Stopped", "Failed"] = "Idle"
    trial: int = 0
    best: TuningTrial | None = None
    verdict: TuningVerdict | None = None
    # At most spec.autotune.maxTrials (<= 100) trials; maxItems bounds the CEL cost of the rule on each schedule.
    history: list[TuningTrial] = Field(default_factory=list, max_length=100)
    round: int = Field(default=0, ge=0, description="tuning rounds started (a new one when the SLO is missed again)")
    problem: str | None = Field(default=None, description="hash of what is tuned (plan range, SLO, pinned knobs)")
    current: TrialInProgress | None = None
    applied: AppliedSchedule | None = Field(default=None, description="the knobs the tuner has put on the engines, "
                                            "and their schedule generation (the ConfigMap is written from it)")
    message: str = ""
    roundStartedAt: str | None = None
    lastCheckAt: str | None = Field(default=None, description="after tuning: the last window checked against the SLO")
    missedWindows: int = Field(default=0, ge=0, description="after tuning: consecutive windows that missed the SLO")
    model: OnlineModelStatus | None = Field(default=None, description="the engine model calibrated on this round's "
                                            "windows (and the previous round's last ones, while it passes its "
                                            "adequacy test with them)")
    earlier: list[TuningTrial] = Field(default_factory=list, max_length=EARLIER_WINDOWS,
                                       description="the previous round's last windows of this problem, which only "
                                                   "the engine model reads")


class CapacityProbe(_Model):
    concurrency: int = Field(ge=1)
    passed: bool
    verdict: str = ""


class CapacityStatus(_Model):
    """Replicas from what one instance was measured to hold (benchmark) or derived to hold (online), beside the
    plan's static estimate."""

    phase: Literal["Pending", "Measuring", "Measured", "Failed"] = "Pending"
    problem: str | None = Field(default=None, description="the tuning problem the measurement belongs to")
    targetConcurrentUsers: int = Field(ge=1)
    staticConcurrencyPerReplica: int = Field(ge=1, description="the plan's estimate (status.plan)")
    staticReplicas: int = Field(ge=0, description="ceil(targetConcurrentUsers / staticConcurrencyPerReplica)")
    measuredConcurrencyPerReplica: int | None = Field(default=None, ge=1)
    modelConcurrencyPerReplica: int | None = Field(
        default=None, ge=0, description="what the simulator predicts one instance holds under the SLO with the tuned "
        "schedule, beside the measured figure (0: not even one user)")
    modelSource: str = Field(default="", description="where the model's figure comes from (engine profile, card "
                                                     "figures, fitted efficiencies), or why there is none")
    method: str = Field(default="", description="how the concurrency was measured or derived")
    measuredAt: str | None = None
    replicas: int | None = Field(default=None, ge=0, description="set through the scale subresource")
    bound: str | None = Field(default=None, description="what bounded the replicas, when something did")
    probes: list[CapacityProbe] = Field(default_factory=list, max_length=64)
    message: str = ""


class Condition(_Model):
    """metav1.Condition."""

    type: str = Field(min_length=1, max_length=316)
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(min_length=1, max_length=1024)
    message: str = Field(default="", max_length=32768)
    lastTransitionTime: str = Field(description="RFC 3339 time")
    observedGeneration: int | None = Field(default=None, ge=0)


class InferenceServiceStatus(_Model):
    phase: Phase = "Pending"
    observedGeneration: int | None = None
    plan: Plan | None = None
    schedule: ScheduleKnobs | None = Field(
        default=None, description="the ScheduleConfig now applied to the pods: the plan's, then the tuner's best"
    )
    replicas: int | None = Field(default=None, description="replicas running (scale subresource)")
    selector: str | None = Field(default=None, description="label selector of the engine pods (scale subresource)")
    observed: Observed | None = None
    tuning: TuningStatus | None = None
    capacity: CapacityStatus | None = None
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )


class ObjectMeta(_Model):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(
        min_length=1, max_length=NAME_MAX_LENGTH, pattern=NAME_PATTERN,
        description="a DNS-1035 label short enough for the names derived from it (Service, LeaderWorkerSet pods)",
    )
    namespace: str = "default"
    uid: str | None = None
    generation: int | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class InferenceService(_Model):
    model_config = ConfigDict(extra="ignore")

    apiVersion: Literal["npuserve.io/v1alpha1"] = API_VERSION
    kind: Literal["InferenceService"] = KIND
    metadata: ObjectMeta
    spec: InferenceServiceSpec
    status: InferenceServiceStatus | None = None
