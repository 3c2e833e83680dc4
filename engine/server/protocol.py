"""Request and response bodies of the HTTP API: OpenAI completions and chat, TGI-style generate.

Field names and defaults follow OpenAI's API (and vLLM's extensions `top_k`, `ignore_eos`, `priority`), so the
official `openai` client and existing benchmark scripts work unchanged. Validation errors name the field.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from npuserve.engine.guided import GuidedSpec
from npuserve.engine.output_processor import RequestOutput
from npuserve.engine_contract import RequestTimings, schedule_field, schedule_generation_field

# --- shared --------------------------------------------------------------------------------------------------------


class _Request(BaseModel):
    """A request body. Nothing is accepted and ignored: an unknown field is a 400 naming it, and a field of
    OpenAI's (or TGI's) schema that this server does not honour is declared in `UNSUPPORTED` and refused, with a
    400 naming it, whenever it is given a value other than its neutral one."""

    model_config = ConfigDict(extra="forbid")

    # field -> (the value that changes nothing, why it is refused otherwise)
    UNSUPPORTED: ClassVar[dict[str, tuple[Any, str]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, (neutral, why) in cls.UNSUPPORTED.items():
                if name in data and data[name] is not None and data[name] != neutral:
                    raise UnsupportedField(name, why)
        return data


class UnsupportedField(ValueError):
    """A request field this server does not honour, given a value that would need it; answered 400 naming it."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{field} is not supported by this server: {why}")
        self.field = field


class InvalidField(ValueError):
    """A field whose value this server cannot use as given; answered 400 naming it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(default=False, description="vLLM: usage in every chunk")


class SamplingFields(_Request):
    model: str | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, description="vLLM extension; 0 or -1 = off")
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = Field(default=False, description="vLLM extension: generate max_tokens whatever the model says")
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = Field(default=0, description="lower is served first under the `priority` policy")
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, description="OpenAI's: subtracted once for each "
                                    "token already in the output")
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, description="OpenAI's: subtracted times each "
                                     "token's count in the output")
    logit_bias: dict[str, float] | None = Field(default=None, description="token id -> bias in [-100, 100], added "
                                                "to its logit")
    # vLLM's sampling extensions (logits_processors.py) and its detokenization options
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=100.0, description="vLLM: logits of tokens in the "
                                      "prompt or output divided (positive) or multiplied (negative) by it; 1 = off")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, description="vLLM: cut tokens below min_p x the top one's "
                         "probability")
    min_tokens: int = Field(default=0, ge=0, description="vLLM: no EOS, stop token or stop string before this many "
                            "output tokens")
    skip_special_tokens: bool = Field(default=True, description="vLLM: leave special tokens out of the text")
    spaces_between_special_tokens: bool = Field(default=True, description="vLLM: the tokenizers here (fast, as "
                                                "transformers') put no spaces between special tokens either way")
    include_stop_str_in_output: bool = Field(default=False, description="vLLM: keep the stop string that ended the "
                                             "output")
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, description="vLLM: keep the prompt's last k "
                                               "tokens (-1: as many as the server takes, maxInputTokenLen)")
    user: str | None = Field(default=None, max_length=256, description="the end user; written to the request log")
    # vLLM's structured output (one of them at most): the output is held to it by a token mask before sampling
    guided_json: str | dict[str, Any] | None = Field(default=None, description="vLLM: a JSON schema")
    guided_regex: str | None = Field(default=None, description="vLLM: a regular expression")
    guided_choice: list[str] | None = Field(default=None, min_length=1, description="vLLM: one of these strings")
    guided_grammar: str | None = Field(default=None, description="vLLM: a context-free grammar (Lark or GBNF)")

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.strip().lstrip("-").isdigit():
                raise InvalidField("logit_bias", f"logit_bias keys are token ids; {key!r} is not one")
            if not -100.0 <= bias <= 100.0:
                raise InvalidField("logit_bias", f"logit_bias[{key}] is {bias}; biases are within [-100, 100]")
        return value

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items())

    def guided_spec(self) -> tuple[str, GuidedSpec] | None:
        """The output constraint and the field that set it (None: unconstrained). More than one is a 400."""
        given: list[tuple[str, GuidedSpec]] = []
        if self.guided_json is not None:
            given.append(("guided_json", GuidedSpec.json_schema(self.guided_json)))
        if self.guided_regex is not None:
            given.append(("guided_regex", GuidedSpec("regex", self.guided_regex)))
        if self.guided_choice is not None:
            given.append(("guided_choice", GuidedSpec.choice(self.guided_choice)))
        if self.guided_grammar is not None:
            given.append(("guided_grammar", GuidedSpec("grammar", self.guided_grammar)))
        fmt = getattr(self, "response_format", None)
        if isinstance(fmt, ResponseFormat) and fmt.type != "text":
            given.append(("response_format", fmt.spec()))
        if len(given) > 1:
            names = ", ".join(name for name, _ in given)
            raise InvalidField(given[1][0], f"only one kind of structured output per request; got {names}")
        return given[0] if given else None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 16 or any(not s for s in stops):
            raise ValueError("stop takes up to 16 non-empty strings")
        return value

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(min_length=1)
    max_tokens: int | None = Field(default=16, ge=0, description="0 only with echo (prompt logprobs only)")
    logprobs: int | None = Field(default=None, ge=0, le=20, description="the chosen token's and the top k (<= 20)")
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, description="sample best_of, return the n of highest "
                                "cumulative logprob")
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20, description="vLLM extension: each prompt "
                                        "token's logprob and the top k")

    UNSUPPORTED: ClassVar[dict[str, tuple[Any, str]]] = {
        "suffix": ("", "the models served here have no fill-in-the-middle template"),
    }

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of single prompts (OpenAI accepts one prompt or a batch)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        ints = [x for x in p if isinstance(x, int)]
        if len(ints) == len(p):
            return [ints]
        return [x for x in p if not isinstance(x, int)]


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: "text" (no constraint), "json_object" (any JSON object) or "json_schema"."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise InvalidField("json_schema", "response_format of type json_schema needs json_schema")
        return self

    def spec(self) -> GuidedSpec:
        if self.type == "json_schema" and self.json_schema is not None:
            return GuidedSpec.json_schema(self.json_schema.json_schema or {})
        return GuidedSpec("json_object")


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class TextContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = Field(default=True, description="vLLM: end the prompt with the template's "
                                        "assistant header")
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, description="vLLM: extra variables for the "
                                                        "chat template (e.g. enable_thinking)")
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    UNSUPPORTED: ClassVar[dict[str, tuple[Any, str]]] = {
        "functions": ([], "the deprecated functions API is not implemented; use tools"),
        "function_call": ("none", "the deprecated functions API is not implemented"),
        "modalities": (["text"], "the models served here produce text only"),
        "audio": ({}, "the models served here produce text only"),
        "prediction": ({}, "predicted outputs are not implemented"),
        "reasoning_effort": ("", "the models served here have no reasoning-effort control"),
        "verbosity": ("", "the models served here have no verbosity control"),
        "web_search_options": ({}, "this server does not search the web"),
        "store": (False, "this server stores no completions"),
        "metadata": ({}, "this server stores no completions, so it keeps no metadata"),
        "service_tier": ("auto", "this server has one service tier"),
        "prompt_cache_key": ("", "the prefix cache needs no key: it matches prompts by their tokens"),
        "safety_identifier": ("", "this server runs no safety monitoring"),
    }

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens whose KV came from the prefix cache")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, outputs: list[RequestOutput]) -> Usage:
        """Usage of one or more requests (the choices of one response), from their latest outputs: a request's
        prompt counts once however many choices it has (n > 1), each choice's tokens count."""
        firsts = {o.request_id: o for o in outputs}.values()
        prompt = sum(o.num_prompt_tokens for o in firsts)
        completion = sum(len(o.token_ids) for o in outputs)
        cached = sum(o.num_cached_prompt_tokens for o in firsts)
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


class _Typed(BaseModel):
    """A response object whose `object` field names its type. Streams are serialised with exclude_unset (a chunk
    carries only what it was given), so `object` is marked as given here: every chunk and response carries it, as
    OpenAI and vLLM send them (aiperf drops chunks without it; the `openai` client reads it as `chunk.object`)."""

    def model_post_init(self, context: Any, /) -> None:
        self.__pydantic_fields_set__.add("object")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_seconds() -> int:
    return int(time.time())


# --- completions -----------------------------------------------------------------------------------------------


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)  # null for an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprobEntry(BaseModel):
    """vLLM's `prompt_logprobs` entries: token id -> this."""

    logprob: float
    rank: int
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: list[dict[str, PromptLogprobEntry] | None] | None = None  # vLLM extension, when asked


class CompletionResponse(_Typed):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None  # as vLLM: responses and a stream's usage chunk
    npuserve: RequestTimings | list[RequestTimings] | None = None


# --- chat ------------------------------------------------------------------------------------------------------


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Typed):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None  # as vLLM: responses and a stream's usage chunk
    npuserve: RequestTimings | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _only_set(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # OpenAI's deltas carry only what changed: {"role": ..., "content": ...} first, {"content": ...}, then {}.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None  # null, not absent, as in OpenAI's chunk schema
    finish_reason: str | None = None  # likewise


class ChatCompletionChunk(_Typed):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None  # as vLLM: responses and a stream's usage chunk
    npuserve: RequestTimings | None = None


# --- models ----------------------------------------------------------------------------------------------------


class ModelCard(_Typed):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "npuserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(_Typed):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# --- TGI style -------------------------------------------------------------------------------------------------


class TGIGrammar(BaseModel):
    """TGI's grammar parameter: {"type": "json", "value": schema} or {"type": "regex", "value": pattern}."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["json", "json_schema", "regex"]
    value: dict[str, Any] | str

    def spec(self) -> GuidedSpec:
        if self.type == "regex":
            if not isinstance(self.value, str):
                raise InvalidField("value", "a regex grammar's value is a string")
            return GuidedSpec("regex", self.value)
        return GuidedSpec.json_schema(self.value)


class GenerateParameters(_Request):
    max_new_tokens: int = Field(default=100, ge=1)
    do_sample: bool = False
    temperature: float | None = Field(default=None, gt=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=1)
    seed: int | None = Field(default=None, ge=0)
    stop: list[str] = Field(default_factory=list, max_length=16)
    details: bool = False
    decoder_input_details: bool = False
    ignore_eos: bool = False
    best_of: int | None = None
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0, description="transformers' (as TGI): "
                                             "prompt and output tokens' logits divided (or multiplied) by it")
    frequency_penalty: float | None = None
    return_full_text: bool | None = None
    top_n_tokens: int | None = None
    truncate: int | None = None
    typical_p: float | None = None
    watermark: bool | None = None
    grammar: TGIGrammar | None = None
    adapter_id: str | None = None

    UNSUPPORTED: ClassVar[dict[str, tuple[Any, str]]] = {
        "decoder_input_details": (False, "prompt token details are not implemented"),
        "best_of": (1, "best_of is not implemented"),
        "frequency_penalty": (0.0, "TGI's frequency penalty (counts over prompt and output, divided by their "
                              "length) is not implemented; /v1/completions takes OpenAI's"),
        "return_full_text": (False, "the response holds the generated text only"),
        "top_n_tokens": (0, "top-n token logprobs are not implemented"),
        "truncate": (0, "set ModelDeployConfig.truncation in the server's config instead"),
        "typical_p": (1.0, "typical sampling is not implemented"),
        "watermark": (False, "watermarking is not implemented"),
        "adapter_id": ("", "adapters (LoRA) are not implemented"),
    }


class GenerateRequest(_Request):
    inputs: str = Field(min_length=1)
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)
    stream: bool = False


class GenerateDetails(BaseModel):
    finish_reason: str
    generated_tokens: int
    seed: int | None = None
    prefill: list[dict[str, Any]] = Field(default_factory=list)
    tokens: list[dict[str, Any]] = Field(default_factory=list)


class GenerateResponse(BaseModel):
    generated_text: str
    details: GenerateDetails | None = None


class ScheduleUpdate(BaseModel):
    """PUT /admin/schedule: any of the hot ScheduleConfig fields; the rest stay as they are. Ranges are the
    contract's; a restart-only field (cacheBlockSize) is refused by name."""

    model_config = ConfigDict(extra="forbid")

    maxPrefillBatchSize: int | None = schedule_field("maxPrefillBatchSize", optional=True)
    maxPrefillTokens: int | None = schedule_field("maxPrefillTokens", optional=True)
    prefillTimeMsPerReq: int | None = schedule_field("prefillTimeMsPerReq", optional=True)
    decodeTimeMsPerReq: int | None = schedule_field("decodeTimeMsPerReq", optional=True)
    maxBatchSize: int | None = schedule_field("maxBatchSize", optional=True)
    maxIterTimes: int | None = schedule_field("maxIterTimes", optional=True)
    maxPreemptCount: int | None = schedule_field("maxPreemptCount", optional=True)
    supportSelectBatch: bool | None = schedule_field("supportSelectBatch", optional=True)
    maxQueueDelayMicroseconds: int | None = schedule_field("maxQueueDelayMicroseconds", optional=True)
    prefillPolicyType: int | None = schedule_field("prefillPolicyType", optional=True)
    decodePolicyType: int | None = schedule_field("decodePolicyType", optional=True)
    stageSelectPolicy: int | None = schedule_field("stageSelectPolicy", optional=True)
    dynamicBatchSizeEnable: bool | None = schedule_field("dynamicBatchSizeEnable", optional=True)
    decodeExpectedTime: int | None = schedule_field("decodeExpectedTime", optional=True)
    scheduleGeneration: int | None = schedule_generation_field()
