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
from npuserve.engine.sequence import SamplingParams, TopLogprobs
from npuserve.engine.server.async_engine import RequestStream
from npuserve.engine.server.chat_template import ChatTemplateError
from npuserve.engine.server.errors import APIError, error_body
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
    CompletionChoice,
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
                     max_model_len=engine.config.deploy.maxSeqLen)
    return ModelList(data=[card])


# --- /v1/completions -----------------------------------------------------------------------------------------------


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, request: Request,
                            state: State) -> CompletionResponse | StreamingResponse:
    state.check_model(body.model)
    sources = body.prompts()
    prompts = [state.tokenize(p, "prompt") for p in sources]
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
    streams: list[RequestStream] = []
    try:
        for prompt in prompts:
            max_tokens = state.resolve_max_tokens(body.max_tokens, len(prompt), "max_tokens")
            params = sampling_params(state, body, max_tokens, want_logprobs or best > n)
            params.top_logprobs, params.prompt_logprobs, params.n = k, prompt_k, best
            streams.append(state.submit(prompt, params, "prompt"))
    except BaseException:
        for s in streams:
            s.close()
        raise
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
            if not text and not output.finished and logprobs is None:
                continue  # a token whose text is held back (partial UTF-8 or a possible stop string)
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
    return ChatChoiceLogprobs(content=chat_logprobs(state.token_text, output.new_token_ids, output.new_logprobs or [],
                                                    output.new_top_logprobs))


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, request: Request,
                                 state: State) -> ChatCompletionResponse | StreamingResponse:
    state.check_model(body.model)
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    _check_choices(state, body.n, body.n)
    prompt = _chat_prompt(state, body)
    field_name = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    max_tokens = state.resolve_max_tokens(body.output_limit, len(prompt), field_name)
    params = sampling_params(state, body, max_tokens, body.logprobs)
    params.top_logprobs = (body.top_logprobs or 0) if body.logprobs else 0
    params.n = body.n
    stream = state.submit(prompt, params, "messages")
    rid, created, model = new_id("chatcmpl"), now_seconds(), state.served_model_name
    if body.stream:
        return StreamingResponse(_chat_events(state, body, stream, rid, created, model),
                                 media_type="text/event-stream", headers=SSE_HEADERS)

    async def collect() -> dict[int, _Collected]:
        results: dict[int, _Collected] = {}
        async for output in stream:
            results.setdefault(output.index, _Collected()).add(output)
        return results

    results = await cancel_on_disconnect(request, collect())
    choices, finals = [], []
    for index in sorted(results):
        final = results[index].final
        if final is None:
            raise RuntimeError("the request stream ended without a final output")
        raise_for_error(final)
        r = results[index]
        logprobs = None
        if body.logprobs:
            logprobs = ChatChoiceLogprobs(content=chat_logprobs(state.token_text, r.token_ids, r.logprobs,
                                                                r.tops if params.top_logprobs else None))
        choices.append(ChatChoice(index=index, message=AssistantMessage(content=final.text), logprobs=logprobs,
                                  finish_reason=finish_reason(final)))
        finals.append(final)
    return ChatCompletionResponse(id=rid, created=created, model=model, choices=choices, usage=Usage.of(finals),
                                  npuserve=RequestTimings.from_engine(finals[0].metrics))


async def _chat_events(state: ServerState, body: ChatCompletionRequest, stream: RequestStream, rid: str,
                       created: int, model: str) -> AsyncIterator[str]:
    with contextlib.closing(stream):
        latest: dict[int, RequestOutput] = {}
        async for output in stream:
            status = error_status(output)
            if status is not None:
                yield sse(error_body(status, output.error or "the request failed"))
                break
            first = output.index not in latest
            latest[output.index] = output
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
            if not output.new_text and not output.finished and logprobs is None:
                continue
            chunk = ChatCompletionChunk(
                id=rid, created=created, model=model,
                choices=[ChatChunkChoice(index=output.index, delta=ChatDelta(content=output.new_text or None),
                                         logprobs=logprobs, finish_reason=finish_reason(output))],
                **_final_extras(output, usage),
            )
            yield sse(chunk)
        else:
            if latest and body.include_usage:
                yield sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=[],
                                              usage=Usage.of(list(latest.values()))))
        yield "data: [DONE]\n\n"
