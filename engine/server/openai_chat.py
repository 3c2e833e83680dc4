"""`/v1/chat/completions` (SSE streaming or not): the conversation through the chat template, n choices,
logprobs, and tools (a call parsed out of the text, or the output held to the tools' schema)."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from npuserve.engine.guided import GuidedSpec
from npuserve.engine.output_processor import RequestOutput
from npuserve.engine.server import tool_calls
from npuserve.engine.server.admission import admitted
from npuserve.engine.server.async_engine import RequestStream
from npuserve.engine.server.chat_template import ChatTemplateError
from npuserve.engine.server.errors import APIError, error_body
from npuserve.engine.server.json_body import StrictJSONRoute
from npuserve.engine.server.logprobs import chat_logprobs
from npuserve.engine.server.openai_shared import (
    Collected,
    check_choices,
    final_extras,
    finish_reason,
    guided_of,
    sampling_params,
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
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    Usage,
    new_id,
    now_seconds,
)
from npuserve.engine.server.sse import SSE_HEADERS, sse
from npuserve.engine.server.state import ServerState, State, cancel_on_disconnect, error_status, raise_for_error
from npuserve.engine_contract import RequestTimings

router = APIRouter(route_class=StrictJSONRoute)


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
        raise APIError(400, "this model has no chat template (chat_template.jinja or tokenizer_config.json); "
                       "use /v1/completions", param="messages")
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
    check_choices(state, body.n, body.n)
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

    async def collect() -> dict[int, Collected]:
        results: dict[int, Collected] = {}
        async for output in stream:
            results.setdefault(output.index, Collected()).add(output)
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
                **final_extras(output, usage),
            )
            yield sse(chunk)
        else:
            if latest and body.include_usage:
                yield sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=[],
                                              usage=Usage.of(list(latest.values())),
                                              system_fingerprint=state.fingerprint))
        yield "data: [DONE]\n\n"
