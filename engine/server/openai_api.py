"""OpenAI routes: `/v1/completions`, `/v1/chat/completions` (SSE streaming or not) and `/v1/models`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from npuserve.engine.guided import CompiledGrammar, GuidedSpec
from npuserve.engine.output_processor import RequestOutput
from npuserve.engine.sequence import SamplingParams, TopLogprobs
from npuserve.engine.server import tool_calls
from npuserve.engine.server.admission import admitted
from npuserve.engine.server.async_engine import RequestStream
from npuserve.engine.server.chat_template import ChatTemplateError
from npuserve.engine.server.errors import APIError, error_body
from npuserve.engine.server.json_body import StrictJSONRoute
from npuserve.engine.server.logprobs import (
    best_of,
    chat_logprobs,
    completion_logprobs,
    echoed_prompt,
    prompt_logprobs_field,
)
from npuserve.engine.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChoiceLogprobs,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    InvalidField,
    ModelCard,
    ModelList,
    SamplingFields,
    ToolCall,
    Usage,
    new_id,
    now_seconds,
)
from npuserve.engine.server.state import (
    ServerState,
    State,
    cancel_on_disconnect,
    error_status,
    get_state,
    raise_for_error,
)
from npuserve.engine_contract import TIMINGS_FIELD, RequestTimings

router = APIRouter(route_class=StrictJSONRoute)
log = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sampling_params(state: ServerState, body: SamplingFields, max_tokens: int, logprobs: bool,
                    guided: CompiledGrammar | None = None) -> SamplingParams:
    if body.priority and state.engine.engine.extensions.policy != "priority":
        # as vLLM: a priority the scheduler would not look at is refused, not ignored
        raise APIError(400, f"priority is {body.priority}, but this server schedules by "
                       f"'{state.engine.engine.extensions.policy}' (npuserve.policy), not by priority",
                       param="priority")
    if body.user is not None:
        log.info("request from user %r", body.user)
    vocab = state.engine.engine.spec.vocab_size
    bias = body.logit_bias_pairs
    outside = [t for t, _ in bias if not 0 <= t < vocab]
    if outside:
        raise APIError(400, f"logit_bias names token {outside[0]}; this model's token ids are 0..{vocab - 1}",
                       param="logit_bias")
    if body.min_tokens > max_tokens:
        raise APIError(400, f"min_tokens ({body.min_tokens}) is above the output limit ({max_tokens})",
                       param="min_tokens")
    return SamplingParams(
        max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=max(0, body.top_k),
        seed=body.seed, stop=body.stop_list, stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos, logprobs=logprobs, priority=body.priority, guided=guided,
        repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, min_p=body.min_p, min_tokens=body.min_tokens, logit_bias=bias,
        skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
    )


def guided_of(body: SamplingFields) -> tuple[str, GuidedSpec] | None:
    """The request's structured-output constraint and the field that set it; two of them are a 400."""
    try:
        return body.guided_spec()
    except InvalidField as e:
        raise APIError(400, str(e), param=e.field) from e


# Characters JSON leaves as they are but Python's str.splitlines() breaks lines at: a client that splits the stream
# that way (guidellm) read half an event. Escaped, the event is the same JSON on one line whatever splits it.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(payload: BaseModel | dict[str, Any]) -> str:
    """One event. Fields given explicitly are sent, null included (a chunk's `finish_reason` and `logprobs`, as in
    OpenAI's schema); fields left at their default are not."""
    data = payload.model_dump_json(exclude_unset=True) if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data.translate(_LINE_BREAKS)}\n\n"


def _final_extras(output: RequestOutput, usage: Usage | None) -> dict[str, Any]:
    """A chunk's optional fields: usage (continuous_usage_stats) and, on the last, the request's timings."""
    extras: dict[str, Any] = {}
    if usage is not None:
        extras["usage"] = usage
    if output.finished:
        extras[TIMINGS_FIELD] = RequestTimings.from_engine(output.metrics)
    return extras


def finish_reason(output: RequestOutput) -> str | None:
    if not output.finished or output.finish_reason is None:
        return None
    return output.finish_reason.value


@dataclass
class _Collected:
    """One choice's final output plus what its increments carried (for logprobs)."""

    final: RequestOutput | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[TopLogprobs] = field(default_factory=list)

    def add(self, output: RequestOutput) -> None:
        self.token_ids += output.new_token_ids
        self.logprobs += output.new_logprobs or []
        self.tops += output.new_top_logprobs or []
        if output.finished:
            self.final = output


def _check_choices(state: ServerState, n: int, best: int) -> None:
    """n and best_of: at most maxBatchSize sequences (they run at once), best_of at least n."""
    if best < n:
        raise APIError(400, f"best_of ({best}) must be at least n ({n})", param="best_of")
    max_batch = state.engine.engine.snapshot.schedule.maxBatchSize
    if best > max_batch:
        name = "n" if best == n else "best_of"
        raise APIError(400, f"{name} is {best}; this server runs at most {max_batch} sequences at once "
                       "(maxBatchSize)", param=name)


def _decode(state: ServerState, ids: list[int]) -> str:
    tokenizer = state.engine.engine.tokenizer
    return tokenizer.decode(ids) if tokenizer is not None else ""


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they arrive, tagged with the request's index."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput] | None] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        async for output in stream:
            await queue.put((index, output))
        await queue.put(None)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()


# --- /v1/models ----------------------------------------------------------------------------------------------------


@router.get("/v1/models", response_model=ModelList)
@router.head("/v1/models", response_model=ModelList, include_in_schema=False)
async def list_models(request: Request) -> ModelList:
    state = get_state(request)
    engine = state.engine.engine
    card = ModelCard(id=state.served_model_name, created=now_seconds(), root=str(engine.model_dir),
                     max_model_len=state.max_model_len())
    return ModelList(data=[card])


# --- /v1/completions -----------------------------------------------------------------------------------------------


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, request: Request,
                            state: State) -> CompletionResponse | StreamingResponse:
    state.check_model(body.model)
    sources = body.prompts()
    prompts = [await state.tokenize(p, "prompt", body.truncate_prompt_tokens) for p in sources]
    if any(not p for p in prompts):
        raise APIError(400, "prompt is empty", param="prompt")
    n, best = body.n, body.best_of or body.n
    _check_choices(state, n, best)
    if body.stream and best > n:
        raise APIError(400, "best_of above n cannot be streamed (the best are known only at the end)",
                       param="best_of")
    if body.max_tokens == 0 and not body.echo:
        raise APIError(400, "max_tokens is 0: that asks for no output, which only makes sense with echo",
                       param="max_tokens")
    if body.max_tokens == 0 and best > 1:
        raise APIError(400, "max_tokens 0 (echo only) gives one choice; n and best_of must be 1", param="n")
    want_logprobs = body.logprobs is not None
    k = body.logprobs or 0
    prompt_k = body.prompt_logprobs
    if prompt_k is None and body.echo and want_logprobs:
        prompt_k = k
    if prompt_k is None and body.max_tokens == 0:
        prompt_k = 0  # the prefill runs for the echo: its prompt logprobs are what it computes
    guided = await state.compile_grammar(guided_of(body))
    streams: list[RequestStream] = []
    try:
        for prompt in prompts:
            max_tokens = state.resolve_max_tokens(body.max_tokens, len(prompt), "max_tokens")
            params = sampling_params(state, body, max_tokens, want_logprobs or best > n, guided)
            params.top_logprobs, params.prompt_logprobs, params.n = k, prompt_k, best
            streams.append(state.submit(prompt, params, "prompt"))
    except BaseException:
        for s in streams:
            s.close()
        raise
    admitted(request.scope)
    echoes = [(src if isinstance(src, str) else _decode(state, ids)) if body.echo else ""
              for src, ids in zip(sources, prompts, strict=True)]
    rid, created, model = new_id("cmpl"), now_seconds(), state.served_model_name
    if body.stream:
        return StreamingResponse(_completion_events(state, body, streams, echoes, rid, created, model),
                                 media_type="text/event-stream", headers=SSE_HEADERS)

    async def collect() -> dict[tuple[int, int], _Collected]:
        results: dict[tuple[int, int], _Collected] = {}
        async for p_index, output in _merge(streams):
            results.setdefault((p_index, output.index), _Collected()).add(output)
        return results

    results = await cancel_on_disconnect(request, collect())
    choices, timings, finals = [], [], []
    for p_index in range(len(prompts)):
        collected = {r.final.index: r for (p, _), r in results.items() if p == p_index and r.final is not None}
        ended = [r.final for r in collected.values() if r.final is not None]
        for output in ended:
            raise_for_error(output)
        chosen = best_of(ended, n)
        for j, output in enumerate(chosen):
            choices.append(_completion_choice(state, body, p_index * n + j, echoes[p_index],
                                              collected[output.index]))
            finals.append(output)
        timings.append(RequestTimings.from_engine(chosen[0].metrics))
    return CompletionResponse(id=rid, created=created, model=model, choices=choices, usage=Usage.of(finals),
                              system_fingerprint=state.fingerprint,
                              npuserve=timings[0] if len(timings) == 1 else timings)


def _completion_choice(state: ServerState, body: CompletionRequest, index: int, echo: str,
                       r: _Collected) -> CompletionChoice:
    final = r.final
    assert final is not None
    logprobs = None
    if body.logprobs is not None:
        ids, lps = list(r.token_ids), list[float | None](r.logprobs)
        tops: list[TopLogprobs | None] | None = list(r.tops) if body.logprobs else None
        if body.echo:
            prompt_lps, prompt_tops = echoed_prompt(final.prompt_token_ids, final.prompt_logprobs, bool(body.logprobs))
            ids, lps = final.prompt_token_ids + ids, prompt_lps + lps
            tops = None if tops is None else prompt_tops + tops
        logprobs = completion_logprobs(state.token_text, ids, lps, tops)
    choice = CompletionChoice(index=index, text=echo + final.text, logprobs=logprobs,
                              finish_reason=finish_reason(final))
    if body.prompt_logprobs is not None:
        choice.prompt_logprobs = prompt_logprobs_field(state.token_text, final.prompt_token_ids,
                                                       final.prompt_logprobs)
    return choice


async def _completion_events(state: ServerState, body: CompletionRequest, streams: list[RequestStream],
                             echoes: list[str], rid: str, created: int, model: str) -> AsyncIterator[str]:
    latest: dict[tuple[int, int], RequestOutput] = {}
    offsets: dict[tuple[int, int], int] = {}
    want_logprobs = body.logprobs is not None
    try:
        async for p_index, output in _merge(streams):
            status = error_status(output)
            if status is not None:
                yield sse(error_body(status, output.error or "the request failed"))
                break
            key = (p_index, output.index)
            first = key not in latest
            latest[key] = output
            text = output.new_text
            ids, lps = list(output.new_token_ids), list[float | None](output.new_logprobs or [])
            tops: list[TopLogprobs | None] | None = list(output.new_top_logprobs or []) if body.logprobs else None
            if first and body.echo:  # the prompt goes out with the choice's first chunk
                text = echoes[p_index] + text
                prompt_lps, prompt_tops = echoed_prompt(output.prompt_token_ids, output.prompt_logprobs,
                                                        bool(body.logprobs))
                ids, lps = output.prompt_token_ids + ids, prompt_lps + lps
                tops = None if tops is None else prompt_tops + tops
            logprobs = None
            if want_logprobs and ids:
                logprobs = completion_logprobs(state.token_text, ids, lps, tops, offsets.get(key, 0))
                offsets[key] = offsets.get(key, 0) + sum(len(t) for t in logprobs.tokens)
            if not text and not ids and not output.finished:
                continue  # nothing new (a token whose text is held back still gets its chunk, with text "")
            usage = Usage.of(list(latest.values())) if body.continuous_usage else None
            choice = CompletionChoice(index=p_index * body.n + output.index, text=text, logprobs=logprobs,
                                      finish_reason=finish_reason(output))
            if first and body.prompt_logprobs is not None:
                choice.prompt_logprobs = prompt_logprobs_field(state.token_text, output.prompt_token_ids,
                                                               output.prompt_logprobs)
            chunk = CompletionResponse(id=rid, created=created, model=model, choices=[choice],
                                       **_final_extras(output, usage))
            yield sse(chunk)
        else:
            if body.include_usage:
                usage = Usage.of(list(latest.values()))
                yield sse(CompletionResponse(id=rid, created=created, model=model, choices=[], usage=usage,
                                             system_fingerprint=state.fingerprint))
        yield "data: [DONE]\n\n"
    finally:
        for s in streams:
            s.close()


# --- /v1/chat/completions ------------------------------------------------------------------------------------------


@dataclass
class _Tools:
    """How a chat request uses tools: the tools as the template sees them, and what to do with the output."""

    tools: list[dict[str, Any]] | None = None
    mode: str = "off"  # off (no tools) | none (tool_choice none) | parse (auto) | required | named
    name: str = ""  # the named function
    parallel: bool = True


def _tool_setup(state: ServerState, body: ChatCompletionRequest) -> tuple[_Tools, tuple[str, GuidedSpec] | None]:
    """The request's tool handling and its output constraint (response_format, guided_*, or the one that
    tool_choice "required" or a named function implies)."""
    given = guided_of(body)
    if not body.tools:
        if body.tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        if body.parallel_tool_calls is not None:
            raise APIError(400, "parallel_tool_calls needs tools", param="parallel_tool_calls")
        return _Tools(), given
    if state.chat_template is None or not state.chat_template.supports_tools:
        raise APIError(400, "tools: this model's chat template does not support tools (it never reads `tools`)",
                       param="tools")
    functions = [t.function.model_dump(exclude_none=True) for t in body.tools]
    setup = _Tools(tools=[t.model_dump(exclude_none=True) for t in body.tools],
                   parallel=body.parallel_tool_calls is not False)
    choice = body.tool_choice or "auto"
    if choice == "none":
        setup.mode = "none"
    elif choice == "auto":
        setup.mode = "parse"
        strict = next((i for i, t in enumerate(body.tools) if t.function.strict), None)
        if strict is not None:  # only a constrained choice holds the arguments to the schema
            raise APIError(400, f"tools.{strict}.function.strict: with tool_choice 'auto' the model's calls are "
                           "parsed, not held to the schema; use tool_choice 'required' or a named function",
                           param=f"tools.{strict}.function.strict")
    else:
        if given is not None:
            raise APIError(400, f"{given[0]} cannot be combined with tool_choice {choice!r}: that choice constrains "
                           "the output itself", param=given[0])
        if choice == "required":
            setup.mode = "required"
            given = ("tool_choice", GuidedSpec.json_schema(tool_calls.required_schema(functions, setup.parallel)))
        else:
            named = next((f for f in functions if f["name"] == choice.function.name), None)
            if named is None:
                raise APIError(400, f"tool_choice names the function {choice.function.name!r}, which is not in tools",
                               param="tool_choice")
            setup.mode, setup.name = "named", named["name"]
            given = ("tool_choice", GuidedSpec.json_schema(named.get("parameters") or {"type": "object"}))
    return setup, given


def _template_message(m: ChatMessage) -> dict[str, Any]:
    message: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.name:
        message["name"] = m.name
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        # HF templates write the arguments with tojson: give them the object, as vLLM does
        calls = []
        for call in m.tool_calls:
            try:
                arguments: Any = json.loads(call.function.arguments)
            except ValueError:
                arguments = call.function.arguments
            calls.append({"id": call.id, "type": call.type,
                          "function": {"name": call.function.name, "arguments": arguments}})
        message["tool_calls"] = calls
    return message


async def _chat_prompt(state: ServerState, body: ChatCompletionRequest,
                       tools: list[dict[str, Any]] | None) -> list[int]:
    """The conversation through the chat template and the tokenizer, both off the asyncio loop."""
    template = state.chat_template
    if template is None:
        raise APIError(400, "this model has no chat template in tokenizer_config.json; use /v1/completions",
                       param="messages")
    messages = [_template_message(m) for m in body.messages]
    try:
        text = await state.off_loop(template.render, messages, add_generation_prompt=body.add_generation_prompt,
                                    tools=tools, extra=body.chat_template_kwargs)
    except ChatTemplateError as e:
        param = "chat_template_kwargs" if body.chat_template_kwargs and e.kwargs_at_fault else "messages"
        raise APIError(400, str(e), param=param) from e
    return await state.tokenize(text, "messages", body.truncate_prompt_tokens)


def _chat_logprobs(state: ServerState, output: RequestOutput) -> ChatChoiceLogprobs:
    return ChatChoiceLogprobs(content=chat_logprobs(state.token_text, output.new_token_ids, output.new_logprobs or [],
                                                    output.new_top_logprobs))


def _tool_call(call: tool_calls.ParsedCall) -> ToolCall:
    return ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))


def _message(setup: _Tools, final: RequestOutput) -> tuple[AssistantMessage, str | None]:
    """The assistant message and finish reason of a finished output, tool calls parsed out of it."""
    reason = finish_reason(final)
    text = final.text
    if setup.mode in ("off", "none"):
        return AssistantMessage(content=text), reason
    if setup.mode == "named":
        call = tool_calls.ParsedCall(setup.name, text)
        return AssistantMessage(content=None, tool_calls=[_tool_call(call)]), reason
    content: str | None
    if setup.mode == "required":
        content, calls = None, tool_calls.parse_required(text)
    else:
        content, calls = tool_calls.parse(text)
    if not setup.parallel:
        calls = calls[:1]
    if calls and reason == "stop":
        reason = "tool_calls"
    if not calls and setup.mode == "required":
        content = text
    return AssistantMessage(content=content, tool_calls=[_tool_call(c) for c in calls]), reason


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, request: Request,
                                 state: State) -> ChatCompletionResponse | StreamingResponse:
    state.check_model(body.model)
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    _check_choices(state, body.n, body.n)
    setup, given = _tool_setup(state, body)
    prompt = await _chat_prompt(state, body, setup.tools)
    field_name = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    max_tokens = state.resolve_max_tokens(body.output_limit, len(prompt), field_name)
    guided = await state.compile_grammar(given)
    params = sampling_params(state, body, max_tokens, body.logprobs, guided)
    params.top_logprobs = (body.top_logprobs or 0) if body.logprobs else 0
    params.n = body.n
    stream = state.submit(prompt, params, "messages")
    admitted(request.scope)
    rid, created, model = new_id("chatcmpl"), now_seconds(), state.served_model_name
    if body.stream:
        return StreamingResponse(_chat_events(state, body, setup, stream, rid, created, model),
                                 media_type="text/event-stream", headers=SSE_HEADERS)

    async def collect() -> dict[int, _Collected]:
        results: dict[int, _Collected] = {}
        async for output in stream:
            results.setdefault(output.index, _Collected()).add(output)
        return results

    results = await cancel_on_disconnect(request, collect())
    choices, finals = [], []
    for index in sorted(results):
        r = results[index]
        final = r.final
        if final is None:
            raise RuntimeError("the request stream ended without a final output")
        raise_for_error(final)
        logprobs = None
        if body.logprobs:
            logprobs = ChatChoiceLogprobs(content=chat_logprobs(state.token_text, r.token_ids, r.logprobs,
                                                                r.tops if params.top_logprobs else None))
        message, reason = _message(setup, final)
        choices.append(ChatChoice(index=index, message=message, logprobs=logprobs, finish_reason=reason))
        finals.append(final)
    return ChatCompletionResponse(id=rid, created=created, model=model, choices=choices, usage=Usage.of(finals),
                                  system_fingerprint=state.fingerprint,
                                  npuserve=RequestTimings.from_engine(finals[0].metrics))


class _StreamedTools:
    """A stream's text turned into content and tool-call deltas, by the request's tool mode."""

    def __init__(self, setup: _Tools) -> None:
        self.setup = setup
        self.parser = tool_calls.ToolCallStream()
        self.text = ""
        self.num_calls = 0
        self.named_id = f"call_{uuid.uuid4().hex[:24]}"

    def delta(self, new_text: str, finished: bool) -> ChatDelta:
        mode = self.setup.mode
        if mode in ("off", "none"):
            # one chunk per token, as vLLM: "" while a partial UTF-8 character or a possible stop string is held
            return ChatDelta(content=new_text)
        if mode == "named":
            first = self.num_calls == 0
            self.num_calls = 1
            if not new_text and not first:
                return ChatDelta()
            call = DeltaToolCall(index=0, id=self.named_id if first else None, type="function" if first else None,
                                 function=DeltaFunctionCall(name=self.setup.name if first else None,
                                                            arguments=new_text))
            return ChatDelta(tool_calls=[call])
        if mode == "required":
            self.text += new_text
            if not finished:
                return ChatDelta()
            calls = tool_calls.parse_required(self.text)
            if not calls:
                return ChatDelta(content=self.text or None)
            return ChatDelta(tool_calls=self._deltas(calls[: None if self.setup.parallel else 1]))
        content, calls = self.parser.feed(new_text, final=finished)
        if not self.setup.parallel:
            calls = calls[: max(0, 1 - self.num_calls)]
        return ChatDelta(content=content or None, tool_calls=self._deltas(calls) or None)

    def _deltas(self, calls: list[tool_calls.ParsedCall]) -> list[DeltaToolCall]:
        out = []
        for call in calls:
            out.append(DeltaToolCall(index=self.num_calls, id=call.id, type="function",
                                     function=DeltaFunctionCall(name=call.name, arguments=call.arguments)))
            self.num_calls += 1
        return out

    def finish_reason(self, output: RequestOutput) -> str | None:
        reason = finish_reason(output)
        if reason == "stop" and self.num_calls and self.setup.mode in ("parse", "required"):
            return "tool_calls"
        return reason


async def _chat_events(state: ServerState, body: ChatCompletionRequest, setup: _Tools, stream: RequestStream,
                       rid: str, created: int, model: str) -> AsyncIterator[str]:
    tools: dict[int, _StreamedTools] = {}  # per choice
    with contextlib.closing(stream):
        latest: dict[int, RequestOutput] = {}
        async for output in stream:
            status = error_status(output)
            if status is not None:
                yield sse(error_body(status, output.error or "the request failed"))
                break
            first = output.index not in latest
            latest[output.index] = output
            streamed = tools.setdefault(output.index, _StreamedTools(setup))
            usage = Usage.of(list(latest.values())) if body.continuous_usage else None
            if first:
                # As vLLM: the role goes out once the first token is computed, never before prefill, so a client's
                # time to the first chunk with choices is the time to the first token. One per choice.
                yield sse(ChatCompletionChunk(
                    id=rid, created=created, model=model, choices=[ChatChunkChoice(
                        index=output.index, delta=ChatDelta(role="assistant", content=""), logprobs=None,
                        finish_reason=None)],
                    **({"usage": usage} if usage is not None else {})))
            logprobs = _chat_logprobs(state, output) if body.logprobs and output.new_token_ids else None
            delta = streamed.delta(output.new_text, output.finished)
            if delta.content is None and delta.tool_calls is None and not output.finished and logprobs is None:
                continue
            chunk = ChatCompletionChunk(
                id=rid, created=created, model=model,
                choices=[ChatChunkChoice(index=output.index, delta=delta, logprobs=logprobs,
                                         finish_reason=streamed.finish_reason(output))],
                **_final_extras(output, usage),
            )
            yield sse(chunk)
        else:
            if latest and body.include_usage:
                yield sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=[],
                                              usage=Usage.of(list(latest.values())),
                                              system_fingerprint=state.fingerprint))
        yield "data: [DONE]\n\n"
