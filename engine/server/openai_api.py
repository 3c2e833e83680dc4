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
from npuserve.engine.sequence import SamplingParams
from npuserve.engine.server import tool_calls
from npuserve.engine.server.async_engine import RequestStream
from npuserve.engine.server.chat_template import ChatTemplateError
from npuserve.engine.server.errors import APIError, error_body
from npuserve.engine.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChoiceLogprobs,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprob,
    ChatMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    InvalidField,
    ModelCard,
    ModelList,
    RequestTimings,
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

router = APIRouter()
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
    return SamplingParams(
        max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=max(0, body.top_k),
        seed=body.seed, stop=body.stop_list, stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos, logprobs=logprobs, priority=body.priority, guided=guided,
    )


def guided_of(body: SamplingFields) -> tuple[str, GuidedSpec] | None:
    """The request's structured-output constraint and the field that set it; two of them are a 400."""
    try:
        return body.guided_spec()
    except InvalidField as e:
        raise APIError(400, str(e), param=e.field) from e


def sse(payload: BaseModel | dict[str, Any]) -> str:
    """One event. Fields given explicitly are sent, null included (a chunk's `finish_reason` and `logprobs`, as in
    OpenAI's schema); fields left at their default are not."""
    data = payload.model_dump_json(exclude_unset=True) if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


def _final_extras(output: RequestOutput, usage: Usage | None) -> dict[str, Any]:
    """A chunk's optional fields: usage (continuous_usage_stats) and, on the last, the request's timings."""
    extras: dict[str, Any] = {}
    if usage is not None:
        extras["usage"] = usage
    if output.finished:
        extras["npuserve"] = RequestTimings.from_engine(output.metrics)
    return extras


def finish_reason(output: RequestOutput) -> str | None:
    if not output.finished or output.finish_reason is None:
        return None
    return output.finish_reason.value


@dataclass
class _Collected:
    """A request's final output plus what the increments carried (token texts for logprobs)."""

    final: RequestOutput | None = None
    token_texts: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


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
                     max_model_len=engine.config.deploy.maxSeqLen)
    return ModelList(data=[card])


# --- /v1/completions -----------------------------------------------------------------------------------------------


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, request: Request,
                            state: State) -> CompletionResponse | StreamingResponse:
    state.check_model(body.model)
    prompts = [state.tokenize(p, "prompt") for p in body.prompts()]
    if any(not p for p in prompts):
        raise APIError(400, "prompt is empty", param="prompt")
    want_logprobs = body.logprobs is not None
    guided = await state.compile_grammar(guided_of(body))
    streams: list[RequestStream] = []
    try:
        for prompt in prompts:
            max_tokens = state.resolve_max_tokens(body.max_tokens, len(prompt), "max_tokens")
            params = sampling_params(state, body, max_tokens, want_logprobs, guided)
            streams.append(state.submit(prompt, params, "prompt"))
    except BaseException:
        for s in streams:
            s.close()
        raise
    rid, created, model = new_id("cmpl"), now_seconds(), state.served_model_name
    if body.stream:
        return StreamingResponse(_completion_events(state, body, streams, rid, created, model),
                                 media_type="text/event-stream", headers=SSE_HEADERS)

    async def collect() -> list[_Collected]:
        results = [_Collected() for _ in streams]
        async for index, output in _merge(streams):
            r = results[index]
            if want_logprobs:
                r.token_texts += [state.token_text(t) for t in output.new_token_ids]
                r.logprobs += output.new_logprobs or []
            if output.finished:
                r.final = output
        return results

    results = await cancel_on_disconnect(request, collect())
    choices, timings, finals = [], [], []
    for index, r in enumerate(results):
        assert r.final is not None
        raise_for_error(r.final)
        logprobs = None
        if want_logprobs:
            offsets, pos = [], 0
            for text in r.token_texts:
                offsets.append(pos)
                pos += len(text)
            logprobs = CompletionLogprobs(tokens=r.token_texts, token_logprobs=r.logprobs, text_offset=offsets)
        choices.append(CompletionChoice(index=index, text=r.final.text, logprobs=logprobs,
                                        finish_reason=finish_reason(r.final)))
        timings.append(RequestTimings.from_engine(r.final.metrics))
        finals.append(r.final)
    return CompletionResponse(id=rid, created=created, model=model, choices=choices, usage=Usage.of(finals),
                              npuserve=timings[0] if len(timings) == 1 else timings)


async def _completion_events(state: ServerState, body: CompletionRequest, streams: list[RequestStream], rid: str,
                             created: int, model: str) -> AsyncIterator[str]:
    latest: dict[int, RequestOutput] = {}
    want_logprobs = body.logprobs is not None
    try:
        async for index, output in _merge(streams):
            status = error_status(output)
            if status is not None:
                yield sse(error_body(status, output.error or "the request failed"))
                break
            latest[index] = output
            logprobs = None
            if want_logprobs and output.new_token_ids:
                logprobs = CompletionLogprobs(tokens=[state.token_text(t) for t in output.new_token_ids],
                                              token_logprobs=output.new_logprobs or [])
            if not output.new_text and not output.finished and logprobs is None:
                continue  # a token whose text is held back (partial UTF-8 or a possible stop string)
            usage = Usage.of(list(latest.values())) if body.continuous_usage else None
            chunk = CompletionResponse(
                id=rid, created=created, model=model,
                choices=[CompletionChoice(index=index, text=output.new_text, logprobs=logprobs,
                                          finish_reason=finish_reason(output))],
                **_final_extras(output, usage),
            )
            yield sse(chunk)
        else:
            if body.include_usage:
                usage = Usage.of(list(latest.values()))
                yield sse(CompletionResponse(id=rid, created=created, model=model, choices=[], usage=usage))
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


def _chat_prompt(state: ServerState, body: ChatCompletionRequest, tools: list[dict[str, Any]] | None) -> list[int]:
    if state.chat_template is None:
        raise APIError(400, "this model has no chat template in tokenizer_config.json; use /v1/completions",
                       param="messages")
    messages = [_template_message(m) for m in body.messages]
    try:
        text = state.chat_template.render(messages, add_generation_prompt=body.add_generation_prompt, tools=tools)
    except ChatTemplateError as e:
        raise APIError(400, str(e), param="messages") from e
    return state.tokenize(text, "messages")


def _chat_logprobs(state: ServerState, output: RequestOutput) -> ChatChoiceLogprobs:
    entries = []
    for token_id, logprob in zip(output.new_token_ids, output.new_logprobs or [], strict=False):
        text = state.token_text(token_id)
        entries.append(ChatLogprob(token=text, logprob=logprob, bytes=list(text.encode())))
    return ChatChoiceLogprobs(content=entries)


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
    setup, given = _tool_setup(state, body)
    prompt = _chat_prompt(state, body, setup.tools)
    field_name = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    max_tokens = state.resolve_max_tokens(body.output_limit, len(prompt), field_name)
    guided = await state.compile_grammar(given)
    stream = state.submit(prompt, sampling_params(state, body, max_tokens, body.logprobs, guided), "messages")
    rid, created, model = new_id("chatcmpl"), now_seconds(), state.served_model_name
    if body.stream:
        return StreamingResponse(_chat_events(state, body, setup, stream, rid, created, model),
                                 media_type="text/event-stream", headers=SSE_HEADERS)

    async def collect() -> tuple[RequestOutput, list[ChatLogprob]]:
        entries: list[ChatLogprob] = []
        async for output in stream:
            if body.logprobs:
                entries += _chat_logprobs(state, output).content or []
            if output.finished:
                return output, entries
        raise RuntimeError("the request stream ended without a final output")

    final, entries = await cancel_on_disconnect(request, collect())
    raise_for_error(final)
    usage = Usage.of([final])
    message, reason = _message(setup, final)
    choice = ChatChoice(index=0, message=message,
                        logprobs=ChatChoiceLogprobs(content=entries) if body.logprobs else None,
                        finish_reason=reason)
    return ChatCompletionResponse(id=rid, created=created, model=model, choices=[choice], usage=usage,
                                  npuserve=RequestTimings.from_engine(final.metrics))


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
            return ChatDelta(content=new_text or None)
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
    tools = _StreamedTools(setup)
    with contextlib.closing(stream):
        final: RequestOutput | None = None
        role_sent = False
        async for output in stream:
            status = error_status(output)
            if status is not None:
                yield sse(error_body(status, output.error or "the request failed"))
                break
            usage = Usage.of([output]) if body.continuous_usage else None
            if not role_sent:
                # As vLLM: the role goes out once the first token is computed, never before prefill, so a client's
                # time to the first chunk with choices is the time to the first token.
                role_sent = True
                yield sse(ChatCompletionChunk(
                    id=rid, created=created, model=model, choices=[ChatChunkChoice(
                        index=0, delta=ChatDelta(role="assistant", content=""), logprobs=None, finish_reason=None)],
                    **({"usage": Usage.of([output])} if usage is not None else {})))
            logprobs = _chat_logprobs(state, output) if body.logprobs and output.new_token_ids else None
            delta = tools.delta(output.new_text, output.finished)
            if delta.content is None and delta.tool_calls is None and not output.finished and logprobs is None:
                continue
            chunk = ChatCompletionChunk(
                id=rid, created=created, model=model,
                choices=[ChatChunkChoice(index=0, delta=delta, logprobs=logprobs,
                                         finish_reason=tools.finish_reason(output))],
                **_final_extras(output, usage),
            )
            yield sse(chunk)
            if output.finished:
                final = output
        if final is not None and body.include_usage:
            yield sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=[], usage=Usage.of([final])))
        yield "data: [DONE]\n\n"
