"""TGI-style routes: `POST /generate` (timing headers in milliseconds) and `POST /generate_stream` (SSE).

Clients of the seeds' perf scheme read `x-queue-time` + `x-prefill-time` as first-token latency, and
`x-time-per-token` as decode latency; the values come from the engine's own clock for this request.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from npuserve import engine_contract as contract
from npuserve.engine.guided import CompiledGrammar
from npuserve.engine.output_processor import RequestOutput
from npuserve.engine.sequence import SamplingParams
from npuserve.engine.server.admission import admitted
from npuserve.engine.server.async_engine import RequestStream
from npuserve.engine.server.errors import APIError, error_body
from npuserve.engine.server.json_body import StrictJSONRoute
from npuserve.engine.server.protocol import GenerateDetails, GenerateRequest, GenerateResponse, InvalidField
from npuserve.engine.server.sse import SSE_HEADERS, sse
from npuserve.engine.server.state import ServerState, State, cancel_on_disconnect, error_status, raise_for_error

router = APIRouter(route_class=StrictJSONRoute)


def _params(body: GenerateRequest, max_tokens: int, guided: CompiledGrammar | None = None) -> SamplingParams:
    p = body.parameters
    greedy = not p.do_sample and p.temperature is None and p.top_p is None and p.top_k is None
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0 if greedy else (p.temperature or 1.0),
        top_p=p.top_p or 1.0, top_k=p.top_k or 0, seed=p.seed, stop=tuple(p.stop), ignore_eos=p.ignore_eos,
        logprobs=p.details, guided=guided, repetition_penalty=p.repetition_penalty or 1.0,
    )


async def _start(state: ServerState, body: GenerateRequest) -> RequestStream:
    prompt = await state.tokenize(body.inputs, "inputs")
    max_tokens = state.resolve_max_tokens(body.parameters.max_new_tokens, len(prompt), "parameters.max_new_tokens")
    grammar = body.parameters.grammar
    guided = None
    if grammar is not None:
        try:
            spec = grammar.spec()
        except InvalidField as e:
            raise APIError(400, str(e), param="parameters.grammar.value") from e
        guided = await state.compile_grammar(("parameters.grammar", spec))
    return state.submit(prompt, _params(body, max_tokens, guided), "inputs")


def _tgi_finish_reason(state: ServerState, output: RequestOutput, ignore_eos: bool) -> str:
    """TGI's spelling: "length", "eos_token" or "stop_sequence". A STOP ends on an end-of-sequence token unless
    ignore_eos is set (then that token ends nothing); otherwise a stop string ended it (this route takes no stop
    token ids)."""
    reason = output.finish_reason.value if output.finish_reason else "length"
    if reason == "stop":
        eos = state.engine.engine.eos_token_ids
        ended_on_eos = not ignore_eos and bool(output.token_ids) and output.token_ids[-1] in eos
        return "eos_token" if ended_on_eos else "stop_sequence"
    return reason


def timing_headers(output: RequestOutput) -> dict[str, str]:
    m = output.metrics
    n = len(output.token_ids)
    queue = m.get("queue_time", 0.0) * 1000
    prefill = m.get("prefill_time", 0.0) * 1000
    decode = m.get("decode_time", 0.0) * 1000
    per_token = decode / (n - 1) if n > 1 else 0.0
    return {
        contract.HEADER_PROMPT_TOKENS: str(output.num_prompt_tokens),
        contract.HEADER_GENERATED_TOKENS: str(n),
        contract.HEADER_QUEUE_TIME: f"{queue:.3f}",
        contract.HEADER_PREFILL_TIME: f"{prefill:.3f}",
        contract.HEADER_INFERENCE_TIME: f"{prefill + decode:.3f}",
        contract.HEADER_TIME_PER_TOKEN: f"{per_token:.3f}",
    }


@router.post("/generate", response_model=GenerateResponse)
async def generate(body: GenerateRequest, request: Request, state: State) -> JSONResponse:
    stream = await _start(state, body)
    admitted(request.scope)
    tokens: list[dict[str, Any]] = []

    async def collect() -> RequestOutput:
        async for output in stream:
            if body.parameters.details:
                for token_id, logprob in zip(output.new_token_ids, output.new_logprobs or [], strict=False):
                    tokens.append({"id": token_id, "text": state.token_text(token_id), "logprob": logprob,
                                   "special": False})
            if output.finished:
                return output
        raise RuntimeError("the request stream ended without a final output")

    final = await cancel_on_disconnect(request, collect())
    raise_for_error(final)
    details = None
    if body.parameters.details:
        details = GenerateDetails(finish_reason=_tgi_finish_reason(state, final, body.parameters.ignore_eos),
                                  generated_tokens=len(final.token_ids),
                                  seed=body.parameters.seed, tokens=tokens)
    response = GenerateResponse(generated_text=final.text, details=details)
    return JSONResponse(response.model_dump(exclude_none=True), headers=timing_headers(final))


@router.post("/generate_stream")
async def generate_stream(body: GenerateRequest, request: Request, state: State) -> StreamingResponse:
    stream = await _start(state, body)
    admitted(request.scope)
    return StreamingResponse(_events(state, body, stream), media_type="text/event-stream", headers=SSE_HEADERS)


async def _events(state: ServerState, body: GenerateRequest, stream: RequestStream) -> AsyncIterator[str]:
    index = 0
    with contextlib.closing(stream):
        async for output in stream:
            status = error_status(output)
            if status is not None:
                yield sse(error_body(status, output.error or "the request failed"))
                return
            ids = output.new_token_ids or ([] if not output.finished else [-1])
            logprobs = output.new_logprobs or [0.0] * len(ids)
            for k, token_id in enumerate(ids):
                last = k == len(ids) - 1
                index += 1
                event: dict[str, Any] = {
                    "index": index,
                    "token": {"id": token_id, "text": output.new_text if last else "", "logprob": logprobs[k],
                              "special": False},
                    "generated_text": output.text if (last and output.finished) else None,
                    "details": None,
                }
                if last and output.finished:
                    reason = _tgi_finish_reason(state, output, body.parameters.ignore_eos)
                    event["details"] = {"finish_reason": reason,
                                        "generated_tokens": len(output.token_ids), "seed": body.parameters.seed,
                                        **timing_headers(output)}
                yield sse(event)
