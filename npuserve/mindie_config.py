"""The MindIE Service `config.json`: the file the operator renders and the engine reads (docs/mindie-config.md).

Field names are exactly MindIE's (the classes are named `...Section` because MindIE names its
fields after their sections), so a user's existing MindIE file loads as it is. Sections npuserve does not act on
(LogConfig, ServerConfig but its address, and the TLS fields of BackendConfig) are kept as given, so a file dumps
back unchanged. Ranges are MindIE's documented ones (the ScheduleConfig ones from the contract's field table); a
value out of range, or a setting this engine does not honour, is refused with the field's path in the message
(more refusals at engine start-up: `npuserve.engine.servable`). Extensions MindIE lacks live under the top-level
`npuserve` key, which MindIE ignores.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from npuserve.engine_contract import (
    DEFAULT_STEP_TIMEOUT_GRACE_S,
    DEFAULT_STEP_TIMEOUT_S,
    NPU_MEMORY_FRACTION_ENV,
    RECOMPUTE_THRESHOLD_ENVS,
    SCHEDULE_FIELD_BY_NAME,
    SCHEDULE_GENERATION_KEY,
    USE_MB_SWAPPER_ENV,
    DType,
    QueuePolicy,
    schedule_field,
    schedule_generation_field,
)
from npuserve.quantization import QuantizationRequest

# MindIE's shipped defaults (docs/mindie-config.md); the ScheduleConfig ones live in the contract's field table.
DEFAULT_MAX_BATCH_SIZE = int(SCHEDULE_FIELD_BY_NAME["maxBatchSize"].default)
DEFAULT_MAX_PREFILL_BATCH_SIZE = int(SCHEDULE_FIELD_BY_NAME["maxPrefillBatchSize"].default)
DEFAULT_MAX_PREFILL_TOKENS = int(SCHEDULE_FIELD_BY_NAME["maxPrefillTokens"].default)
DEFAULT_MAX_SEQ_LEN = 2560
DEFAULT_MAX_INPUT_TOKEN_LEN = 2048
# MindIE 2.3's TTFT target of its stageSelectPolicy 2; refused by name (the engine has no prefill-side controller).
PREFILL_EXPECTED_TIME = "prefillExpectedTime"


class _MindIEModel(BaseModel):
    # Unknown MindIE fields are kept (extra="allow") so files of newer MindIE releases still round-trip.
    model_config = ConfigDict(extra="allow", populate_by_name=True, validate_assignment=True)


class ModelSection(_MindIEModel):
    modelInstanceType: str = "Standard"
    modelName: str
    modelWeightPath: str
    worldSize: int = Field(default=1, ge=1, le=1024)
    cpuMemSize: int = Field(default=5, ge=0, description="GiB of host memory for swapped-out KV blocks")
    npuMemSize: int = Field(default=-1, description="GiB of KV cache per card; -1 = auto")
    backendType: str = "atb"
    trustRemoteCode: bool = False

    @field_validator("npuMemSize")
    @classmethod
    def _npu_mem_size(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError("npuMemSize must be -1 (auto) or a positive number of GiB")
        return value


class ModelDeploySection(_MindIEModel):
    maxSeqLen: int = Field(default=DEFAULT_MAX_SEQ_LEN, ge=1)
    maxInputTokenLen: int = Field(default=DEFAULT_MAX_INPUT_TOKEN_LEN, ge=1)
    truncation: bool = False
    ModelConfig: list[ModelSection] = Field(min_length=1)

    @model_validator(mode="after")
    def _input_fits_sequence(self) -> ModelDeploySection:
        if self.maxInputTokenLen > self.maxSeqLen:
            raise ValueError(
                f"maxInputTokenLen ({self.maxInputTokenLen}) must not exceed maxSeqLen ({self.maxSeqLen})"
            )
        return self


class ScheduleSection(_MindIEModel):
    """Batching and scheduling; the tuner's knobs. Ranges, defaults and which fields apply live (all but
    cacheBlockSize) come from the contract's field table (`npuserve.engine_contract.SCHEDULE_FIELDS`)."""

    templateType: str = "Standard"
    templateName: str = "Standard_LLM"
    cacheBlockSize: int = schedule_field("cacheBlockSize")
    maxPrefillBatchSize: int = schedule_field("maxPrefillBatchSize")
    maxPrefillTokens: int = schedule_field("maxPrefillTokens")
    prefillTimeMsPerReq: int = schedule_field("prefillTimeMsPerReq")
    prefillPolicyType: int = schedule_field("prefillPolicyType")
    decodeTimeMsPerReq: int = schedule_field("decodeTimeMsPerReq")
    decodePolicyType: int = schedule_field("decodePolicyType")
    maxBatchSize: int = schedule_field("maxBatchSize")
    maxIterTimes: int = schedule_field("maxIterTimes")
    maxPreemptCount: int = schedule_field("maxPreemptCount")
    supportSelectBatch: bool = schedule_field("supportSelectBatch")
    maxQueueDelayMicroseconds: int = schedule_field("maxQueueDelayMicroseconds")
    # MindIE 2.3's SLO scheduling: the TPOT controller (engine/scheduler/dynamic_batch.py).
    stageSelectPolicy: int = schedule_field("stageSelectPolicy")
    dynamicBatchSizeEnable: bool = schedule_field("dynamicBatchSizeEnable")
    decodeExpectedTime: int = schedule_field("decodeExpectedTime")

    @model_validator(mode="before")
    @classmethod
    def _no_prefill_slo(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and PREFILL_EXPECTED_TIME in data:
            raise ValueError(
                f"{PREFILL_EXPECTED_TIME} is not supported: it is the TTFT target of MindIE's stageSelectPolicy 2 "
                "(least-laxity-first prefill or decode choice from fitted TTFT/TPOT), which this engine does not "
                "run; remove it (the decode side, dynamicBatchSizeEnable with decodeExpectedTime, does run)")
        return data

    @field_validator("stageSelectPolicy", mode="before")
    @classmethod
    def _prefill_first(cls, value: Any) -> Any:
        # Before the range check, so the message says what is missing rather than "less than or equal to 0".
        if value != 0 and not isinstance(value, bool):
            raise ValueError(
                f"stageSelectPolicy {value!r} is not supported: only 0 (MindIE's default, prefill first) runs "
                "here; 1 (MindIE's throughput first) and 2 (the least-laxity-first choice from fitted TTFT/TPOT) "
                "are not built (this engine's throughput rule is supportSelectBatch)")
        return value

    @field_validator("templateType")
    @classmethod
    def _standard_template(cls, value: str) -> str:
        # MindIE's "Mix" template is SplitFuse (chunked prefill mixed into decode steps), not built yet.
        if value != "Standard":
            raise ValueError(f"templateType {value!r} is not supported: the engine runs MindIE's 'Standard' "
                             "template (a step is a prefill step or a decode step)")
        return value

    @model_validator(mode="after")
    def _batch_limits(self) -> ScheduleSection:
        if self.maxPrefillBatchSize > self.maxBatchSize:
            raise ValueError(
                f"maxPrefillBatchSize ({self.maxPrefillBatchSize}) must not exceed maxBatchSize ({self.maxBatchSize})"
            )
        if self.maxPreemptCount > self.maxBatchSize:
            raise ValueError(
                f"maxPreemptCount ({self.maxPreemptCount}) must not exceed maxBatchSize ({self.maxBatchSize})"
            )
        return self

    @property
    def effective_max_prefill_batch_size(self) -> int:
        return self.maxPrefillBatchSize or self.maxBatchSize


class BackendSection(_MindIEModel):
    backendName: str = "mindieservice_llm_engine"
    modelInstanceNumber: int = Field(default=1, ge=1)
    npuDeviceIds: list[list[int]] = Field(default_factory=lambda: [[0]])
    tokenizerProcessNumber: int = Field(default=8, ge=1)
    multiNodesInferEnabled: bool = False
    ModelDeployConfig: ModelDeploySection
    ScheduleConfig: ScheduleSection = Field(default_factory=lambda: ScheduleSection())

    @model_validator(mode="after")
    def _cross_limits(self) -> BackendSection:
        deploy, schedule = self.ModelDeployConfig, self.ScheduleConfig
        if schedule.maxIterTimes > deploy.maxSeqLen:
            raise ValueError(
                f"ScheduleConfig.maxIterTimes ({schedule.maxIterTimes}) must not exceed "
                f"ModelDeployConfig.maxSeqLen ({deploy.maxSeqLen})"
            )
        return self


LogprobsMode = Literal["processed_logprobs", "raw_logprobs"]  # vLLM's logprobs_mode values


class NpuserveExtensions(BaseModel):
    """What MindIE lacks; stored under the top-level `npuserve` key."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    device: Literal["auto", "npu", "cuda", "cpu"] = "auto"
    dtype: Literal["auto"] | DType = "auto"
    loadFormat: Literal["auto", "safetensors", "dummy"] = "auto"
    quantization: QuantizationRequest | None = Field(
        default=None, description="the quantized scheme to serve: must be what the checkpoint declares (refused "
        "otherwise); with loadFormat dummy, random int8 weights of it. Omitted: whatever the checkpoint declares")
    policy: QueuePolicy = "fcfs"
    enablePrefixCaching: bool = True
    chunkedPrefill: bool = Field(default=False, description="MindIE's SplitFuse: prompts split into chunks mixed "
                                 "into decode steps under maxPrefillTokens; turns supportSelectBatch off")
    maxWaitingRequests: int = Field(default=4096, ge=1, description="waiting queue bound; beyond it requests get 429")
    logprobsMode: LogprobsMode = Field(
        default="processed_logprobs", description="vLLM's logprobs_mode: logprobs of the distribution sampled from "
        "(after temperature, top-k, top-p), or the model's raw ones")
    servedModelName: str | None = None
    maxBatchSizeLimit: int | None = Field(
        default=None, ge=1, le=SCHEDULE_FIELD_BY_NAME["maxBatchSize"].le,
        description="the largest maxBatchSize a live schedule may set (the operator writes the plan's memory "
        "maximum); the KV pool's CPU cap and the decode graphs are sized for it at start-up. Omitted: the "
        "start-up maxBatchSize")
    scheduleGeneration: int | None = schedule_generation_field()
    stepTimeoutSeconds: float = Field(
        default=DEFAULT_STEP_TIMEOUT_S, gt=0, description="the step watchdog: with work pending and no step "
        "completed for this long, /health fails and the engine exits after stepTimeoutGraceSeconds; keep it well "
        "above the slowest legitimate step (a prefill of maxPrefillTokens)")
    stepTimeoutGraceSeconds: float = Field(
        default=DEFAULT_STEP_TIMEOUT_GRACE_S, ge=0, description="how long /health fails before the engine exits "
        "by itself; below the liveness probe's budget (periodSeconds x failureThreshold) so that its own message "
        "is the pod's termination message")


class MindIEConfig(_MindIEModel):
    Version: str = "1.0.0"
    LogConfig: dict[str, Any] = Field(default_factory=dict)
    ServerConfig: dict[str, Any] = Field(default_factory=dict)
    BackendConfig: BackendSection
    npuserve: NpuserveExtensions | None = None

    @model_validator(mode="after")
    def _long_prompts_can_prefill(self) -> MindIEConfig:
        schedule, deploy = self.schedule, self.deploy
        if schedule.maxPrefillTokens < deploy.maxInputTokenLen and not self.extensions.chunkedPrefill:
            raise ValueError(
                f"ScheduleConfig.maxPrefillTokens ({schedule.maxPrefillTokens}) must be at least "
                f"ModelDeployConfig.maxInputTokenLen ({deploy.maxInputTokenLen}), or no long prompt could prefill "
                "(unless npuserve.chunkedPrefill splits prompts into chunks)"
            )
        return self

    @model_validator(mode="after")
    def _dynamic_batch_without_splitfuse(self) -> MindIEConfig:
        # MindIE states the same limit ("PD-mixed only, not with SplitFuse"): a mixed step has no decode-only time.
        if self.schedule.dynamicBatchSizeEnable and self.extensions.chunkedPrefill:
            raise ValueError("ScheduleConfig.dynamicBatchSizeEnable does not run with npuserve.chunkedPrefill "
                             "(MindIE's SplitFuse), as in MindIE: turn one of them off")
        return self

    @model_validator(mode="after")
    def _batch_within_limit(self) -> MindIEConfig:
        limit = self.extensions.maxBatchSizeLimit
        if limit is not None and self.schedule.maxBatchSize > limit:
            raise ValueError(
                f"ScheduleConfig.maxBatchSize ({self.schedule.maxBatchSize}) exceeds npuserve.maxBatchSizeLimit "
                f"({limit}), the largest batch the engine's KV pool and decode graphs are sized for; raising it "
                "needs a restart with a larger npuserve.maxBatchSizeLimit"
            )
        return self

    # --- convenience -------------------------------------------------------------------------------------------

    @property
    def model(self) -> ModelSection:
        return self.BackendConfig.ModelDeployConfig.ModelConfig[0]

    @property
    def schedule(self) -> ScheduleSection:
        return self.BackendConfig.ScheduleConfig

    @property
    def deploy(self) -> ModelDeploySection:
        return self.BackendConfig.ModelDeployConfig

    @property
    def extensions(self) -> NpuserveExtensions:
        return self.npuserve or NpuserveExtensions()

    @property
    def batch_size_limit(self) -> int:
        """The largest maxBatchSize the engine is sized for: npuserve.maxBatchSizeLimit, else maxBatchSize."""
        limit = self.extensions.maxBatchSizeLimit
        return self.schedule.maxBatchSize if limit is None else limit

    # --- files -------------------------------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | Path) -> MindIEConfig:
        text = Path(path).read_text()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise MindIEConfigError(f"{path}: not valid JSON: {e}") from e
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "config") -> MindIEConfig:
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise MindIEConfigError(format_validation_error(e, source)) from e

    def to_dict(self) -> dict[str, Any]:
        """The file's content; fields never set stay out, so a loaded file dumps back as it was."""
        return self.model_dump(mode="json", exclude_unset=True, exclude_none=False)

    def dumps(self) -> str:
        return json.dumps(self.to_dict(), indent=4, ensure_ascii=False) + "\n"

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.dumps())

    def with_schedule(self, **changes: Any) -> MindIEConfig:
        """A copy with ScheduleConfig fields changed, validated as a whole (cross-field rules included)."""
        data = self.to_dict()
        data["BackendConfig"].setdefault("ScheduleConfig", {}).update(changes)
        return type(self).from_dict(data, source="ScheduleConfig update")

    def with_batch_size_limit(self) -> MindIEConfig:
        """A copy with npuserve.maxBatchSizeLimit set (to maxBatchSize when it is absent): the config a started
        engine runs, so that a live schedule past what it was sized for is refused by the rule above."""
        if self.extensions.maxBatchSizeLimit is not None:
            return self
        data = self.to_dict()
        data["npuserve"] = {**(data.get("npuserve") or {}), "maxBatchSizeLimit": self.schedule.maxBatchSize}
        return type(self).from_dict(data, source="npuserve.maxBatchSizeLimit")

    def with_schedule_generation(self, generation: int | None) -> MindIEConfig:
        """A copy whose `npuserve.scheduleGeneration` is `generation`."""
        data = self.to_dict()
        data["npuserve"] = {**(data.get("npuserve") or {}), SCHEDULE_GENERATION_KEY: generation}
        return type(self).from_dict(data, source="schedule generation")

    def with_world_size(self, world_size: int) -> MindIEConfig:
        """A copy with ModelConfig.worldSize set, and npuDeviceIds 0..N-1 when it lists fewer cards than that."""
        data = self.to_dict()
        data["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["worldSize"] = world_size
        ids = data["BackendConfig"].get("npuDeviceIds") or [[0]]
        if len(ids[0]) < world_size:
            data["BackendConfig"]["npuDeviceIds"] = [list(range(world_size))]
        return type(self).from_dict(data, source="--world-size")


class MindIEConfigError(ValueError):
    """A MindIE config.json that does not load; the message names each offending field by its path."""


def format_validation_error(error: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid MindIE configuration:"]
    for item in error.errors():
        path = ".".join(str(part) for part in item["loc"]) or "(root)"
        lines.append(f"  {path}: {item['msg']}")
    return "\n".join(lines)


# --- environment overrides ---------------------------------------------------------------------------------------


class EngineEnvironment(BaseModel):
    """The environment variables MindIE reads beside config.json."""

    model_config = ConfigDict(frozen=True)

    recompute_threshold: float = Field(default=0.5, ge=0.0, lt=1.0)
    use_mb_swapper: bool = False
    npu_memory_fraction: float = Field(default=0.8, gt=0.0, le=1.0)

    @field_validator("use_mb_swapper")
    @classmethod
    def _one_swapper(cls, value: bool) -> bool:
        # MindIE's multi-block swapper is a different swap implementation; ours copies a step's blocks in one call.
        if value:
            raise ValueError(f"{USE_MB_SWAPPER_ENV} is set, but the engine has one swapper (a step's swapped blocks "
                             "are copied together); unset it")
        return value

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> EngineEnvironment:
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name in RECOMPUTE_THRESHOLD_ENVS:  # the newer name first: it wins when both are set
            if name in env:
                values["recompute_threshold"] = _parse(name, env[name], float)
                break
        if USE_MB_SWAPPER_ENV in env:
            values["use_mb_swapper"] = env[USE_MB_SWAPPER_ENV].strip().lower() in ("1", "true", "yes", "on")
        if NPU_MEMORY_FRACTION_ENV in env:
            values["npu_memory_fraction"] = _parse(NPU_MEMORY_FRACTION_ENV, env[NPU_MEMORY_FRACTION_ENV], float)
        try:
            return cls.model_validate(values)
        except ValidationError as e:
            raise MindIEConfigError(format_validation_error(e, "environment")) from e


def _parse(name: str, raw: str, kind: type[float]) -> float:
    try:
        return kind(raw)
    except ValueError:
        raise MindIEConfigError(f"environment: {name}={raw!r} is not a number") from None


def minimal_config(
    model_dir: str | Path,
    *,
    max_seq_len: int | None = None,
    max_input_len: int | None = None,
    extensions: dict[str, Any] | None = None,
    model: dict[str, Any] | None = None,
    **schedule: Any,
) -> MindIEConfig:
    """A config for the model in `model_dir` (named after its folder) with MindIE's defaults; the keywords override
    its fields (validated): `model` ModelConfig's, `extensions` the `npuserve` section's, the rest ScheduleConfig's.
    The fields that must agree follow the ones given, unless given themselves: maxSeqLen brings maxInputTokenLen
    (at most 2048) and maxIterTimes (at most 512) under it, maxInputTokenLen lifts maxPrefillTokens to it, and
    maxBatchSize caps maxPrefillBatchSize."""
    deploy: dict[str, Any] = {
        "ModelConfig": [{"modelName": Path(model_dir).name, "modelWeightPath": str(model_dir), **(model or {})}]
    }
    if max_seq_len is not None:
        deploy["maxSeqLen"] = max_seq_len
        max_input_len = max_input_len or min(max_seq_len, DEFAULT_MAX_INPUT_TOKEN_LEN)
        schedule.setdefault("maxIterTimes", min(int(SCHEDULE_FIELD_BY_NAME["maxIterTimes"].default), max_seq_len))
    if max_input_len is not None:
        deploy["maxInputTokenLen"] = max_input_len
    if "maxPrefillTokens" not in schedule and max_input_len is not None:
        schedule["maxPrefillTokens"] = max(DEFAULT_MAX_PREFILL_TOKENS, max_input_len)
    max_batch = schedule.get("maxBatchSize")
    if max_batch is not None and "maxPrefillBatchSize" not in schedule:
        schedule["maxPrefillBatchSize"] = min(DEFAULT_MAX_PREFILL_BATCH_SIZE, int(max_batch))
    data: dict[str, Any] = {"BackendConfig": {"ModelDeployConfig": deploy, "ScheduleConfig": schedule}}
    if extensions:
        data["npuserve"] = extensions
    return MindIEConfig.from_dict(data)
