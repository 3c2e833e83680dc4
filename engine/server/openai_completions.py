"""`/v1/completions` (SSE streaming or not): several prompts, n and best_of choices, echo, logprobs of the
output and of the prompt."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from npuserve.engine.output_processor import RequestOutput
from npuserve.engine.sequence import TopLogprobs
from npuserve.engine.server.admission import admitted
from npuserve.engine.server.async_engine import RequestStream
from npuserve.engine.server.errors import APIError, error_body
from npuserve.engine.server.json_body import StrictJSONRoute
from npuserve.engine.server.logprobs import best_of, completion_logprobs, echoed_prompt, prompt_logprobs_field
from npuserve.engine.server.openai_shared import (
    Collected,
    check_choices,
    final_extras,
    finish_reason,
    guided_of,
    merge_streams,
    sampling_params,
)
from npuserve.engine.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Usage,
    new_id,
    now_seconds,
)
from npuserve.engine.server.sse import SSE_HEADERS, sse
from npuserve.engine.server.state import ServerState, State, cancel_on_disconnect, error_status, raise_for_error
from npuserve.engine_contract import RequestTimings

router = APIRouter(route_class=StrictJSONRoute)


def _decode(state: ServerState, ids: list[int]) -> str:
    tokenizer = state.engine.engine.tokenizer
    return tokenizer.decode(ids) if tokenizer is not None else ""


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, request: Request,
                            state: State) -> CompletionResponse | StreamingResponse:
    state.check_model(body.model)
    sources = body.prompts()
    prompts = [await state.tokenize(p, "prompt", body.truncate_prompt_tokens) for p in sources]
    if any(not p for p in prompts):
        raise APIError(400, "prompt is empty", param="prompt")
    n, best = body.n, body.best_of or body.n
    check_choices(state, n, best)
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

    async def collect() -> dict[tuple[int, int], Collected]:
        results: dict[tuple[int, int], Collected] = {}
        async for p_index, output in merge_streams(streams):
            results.setdefault((p_index, output.index), Collected()).add(output)
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
                       r: Collected) -> CompletionChoice:
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
        async for p_index, output in merge_streams(streams):
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
                                       **final_extras(output, usage))
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

