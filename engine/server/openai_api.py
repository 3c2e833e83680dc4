"""OpenAI routes: `/v1/completions`, `/v1/chat/completions` (SSE streaming or not) and `/v1/models`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from npuserve.engine.output_processor import RequestOutput
from npuserve.engine.sequence import SamplingParams
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
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    RequestTimings,
    SamplingFields,
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


def sampling_params(state: ServerState, body: SamplingFields, max_tokens: int, logprobs: bool) -> SamplingParams:
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
        ignore_eos=body.ignore_eos, logprobs=logprobs, priority=body.priority,
    )


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
    streams: list[RequestStream] = []
    try:
        for prompt in prompts:
            max_tokens = state.resolve_max_tokens(body.max_tokens, len(prompt), "max_tokens")
            streams.append(state.submit(prompt, sampling_params(state, body, max_tokens, want_logprobs), "prompt"))
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


def _chat_prompt(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    if state.chat_template is None:
        raise APIError(400, "this model has no chat template in tokenizer_config.json; use /v1/completions",
                       param="messages")
    messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                for m in body.messages]
    try:
        text = state.chat_template.render(messages, add_generation_prompt=body.add_generation_prompt)
    except ChatTemplateError as e:
        raise APIError(400, str(e), param="messages") from e
    return state.tokenize(text, "messages")


def _chat_logprobs(state: ServerState, output: RequestOutput) -> ChatChoiceLogprobs:
    entries = []
    for token_id, logprob in zip(output.new_token_ids, output.new_logprobs or [], strict=False):
        text = state.token_text(token_id)
        entries.append(ChatLogprob(token=text, logprob=logprob, bytes=list(text.encode())))
    return ChatChoiceLogprobs(content=entries)


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, request: Request,
                                 state: State) -> ChatCompletionResponse | StreamingResponse:
    state.check_model(body.model)
    prompt = _chat_prompt(state, body)
    field_name = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    max_tokens = state.resolve_max_tokens(body.output_limit, len(prompt), field_name)
    stream = state.submit(prompt, sampling_params(state, body, max_tokens, body.logprobs), "messages")
    rid, created, model = new_id("chatcmpl"), now_seconds(), state.served_model_name
    if body.stream:
        return StreamingResponse(_chat_events(state, body, stream, rid, created, model),
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
    choice = ChatChoice(index=0, message=AssistantMessage(content=final.text),
                        logprobs=ChatChoiceLogprobs(content=entries) if body.logprobs else None,
                        finish_reason=finish_reason(final))
    return ChatCompletionResponse(id=rid, created=created, model=model, choices=[choice], usage=usage,
                                  npuserve=RequestTimings.from_engine(final.metrics))


async def _chat_events(state: ServerState, body: ChatCompletionRequest, stream: RequestStream, rid: str,
                       created: int, model: str) -> AsyncIterator[str]:
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
            if not output.new_text and not output.finished and logprobs is None:
                continue
            chunk = ChatCompletionChunk(
                id=rid, created=created, model=model,
                choices=[ChatChunkChoice(index=0, delta=ChatDelta(content=output.new_text or None),
                                         logprobs=logprobs, finish_reason=finish_reason(output))],
                **_final_extras(output, usage),
            )
            yield sse(chunk)
            if output.finished:
                final = output
        if final is not None and body.include_usage:
            yield sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=[], usage=Usage.of([final])))
        yield "data: [DONE]\n\n"
