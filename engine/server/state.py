"""What every route needs: the async engine, the served name, the chat template, and request admission limits."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request

from npuserve.engine.guided import CompiledGrammar, GrammarError, GuidedSpec
from npuserve.engine.output_processor import RequestOutput
from npuserve.engine.request_checks import RequestError
from npuserve.engine.sequence import FinishReason, SamplingParams
from npuserve.engine.server.async_engine import (
    AsyncEngine,
    EngineDraining,
    EngineOverloaded,
    RequestStream,
    is_engine_failure,
    is_shutdown_cut,
)
from npuserve.engine.server.chat_template import ChatTemplate
from npuserve.engine.server.errors import APIError

T = TypeVar("T")

RETRY_AFTER_SECONDS = 1

# Where each request limit is set in the server's MindIE config.json (named in the refusals).
CONFIG_FIELDS = {
    "maxSeqLen": "BackendConfig.ModelDeployConfig.maxSeqLen in the server's config.json",
    "maxInputTokenLen": "BackendConfig.ModelDeployConfig.maxInputTokenLen in the server's config.json",
    "maxIterTimes": "BackendConfig.ScheduleConfig.maxIterTimes in the server's config.json, or PUT /admin/schedule",
}


# Tokenization, chat templating and grammar compilation run in this many threads, never on the asyncio loop: a
# 15 MB prompt takes seconds to tokenize, and on the loop it held every other request and the probes for as long.
PREPROCESS_THREADS = 4


@dataclass
class ServerState:
    engine: AsyncEngine
    served_model_name: str
    chat_template: ChatTemplate | None
    admin_token: str | None
    preprocess: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        PREPROCESS_THREADS, thread_name_prefix="npuserve-preprocess"))
    fingerprint: str = ""  # system_fingerprint: the server's version and configuration, as vLLM sends it

    async def off_loop(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn` in the bounded preprocessing pool (the asyncio loop stays free for other requests and probes)."""
        return await asyncio.get_running_loop().run_in_executor(self.preprocess, partial(fn, *args, **kwargs))

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.served_model_name}`.",
                           param="model", code="model_not_found")

    async def tokenize(self, prompt: str | list[int], field: str, truncate: int | None = None) -> list[int]:
        """The prompt's token ids (text tokenized off the loop); `truncate` (vLLM's truncate_prompt_tokens) keeps
        the last k, -1 as many as the server takes (maxInputTokenLen). A prompt over maxInputTokenLen without
        truncation is refused here with its length (only the ids that can be used come back from the tokenizer)."""
        deploy = self.engine.engine.config.deploy
        max_input = deploy.maxInputTokenLen
        keep = max_input if truncate == -1 else truncate
        if isinstance(prompt, str):
            limit = keep if keep is not None else max_input if deploy.truncation else max_input + 1
            try:
                ids, total = await self.off_loop(self.engine.engine.encode_tail, prompt, limit)
            except RequestError as e:
                raise APIError(400, str(e), param=field) from e
        else:
            ids, total = prompt, len(prompt)
        if keep is not None:
            return ids[len(ids) - keep :] if keep > 0 else []
        if total > max_input and not deploy.truncation:
            raise APIError(400, f"the prompt has {total} tokens; this server takes at most {max_input} "
                           f"(maxInputTokenLen, {CONFIG_FIELDS['maxInputTokenLen']})", param=field)
        return ids

    def max_model_len(self) -> int:
        """The longest context (prompt + output) a request can have here, which `/v1/models` reports: maxSeqLen,
        within maxInputTokenLen + maxIterTimes (live) and the whole KV cache (a longer request can never run)."""
        engine = self.engine.engine
        deploy = engine.config.deploy
        kv_tokens = engine.kv_plan.num_blocks * engine.kv_plan.block_size
        return min(deploy.maxSeqLen, deploy.maxInputTokenLen + engine.snapshot.schedule.maxIterTimes, kv_tokens)

    def resolve_max_tokens(self, requested: int | None, prompt_len: int, field: str) -> int:
        """The output limit: at most maxIterTimes (the live value: it is hot), and the prompt plus output within
        maxSeqLen. A request over a limit is refused naming the limit and the config field that sets it."""
        config = self.engine.engine.config
        max_seq_len = config.deploy.maxSeqLen
        max_iter = self.engine.engine.snapshot.schedule.maxIterTimes
        max_input = config.deploy.maxInputTokenLen
        if prompt_len > max_input:
            if not config.deploy.truncation:
                raise APIError(400, f"the prompt has {prompt_len} tokens; this server takes at most {max_input} "
                               f"(maxInputTokenLen, {CONFIG_FIELDS['maxInputTokenLen']})",
                               param="prompt" if field == "max_tokens" else "messages")
            prompt_len = max_input  # the engine keeps the last maxInputTokenLen tokens
        room = max_seq_len - prompt_len
        if requested is None:
            return max(1, min(max_iter, room))
        if requested > max_iter:
            raise APIError(400, f"{field} is {requested}; this server generates at most {max_iter} tokens per "
                           f"request (maxIterTimes, {CONFIG_FIELDS['maxIterTimes']}; its context is "
                           f"{self.max_model_len()} tokens, max_model_len in /v1/models)", param=field)
        if requested > room:
            raise APIError(400, f"this model's maximum context length is {max_seq_len} tokens (maxSeqLen, "
                           f"{CONFIG_FIELDS['maxSeqLen']}); the prompt has {prompt_len} and {field} asks for "
                           f"{requested}", param=field)
        return requested

    async def compile_grammar(self, given: tuple[str, GuidedSpec] | None) -> CompiledGrammar | None:
        """A request's output constraint (field, spec) compiled off the asyncio loop (cached by the engine); an
        invalid one is a 400 naming its field."""
        if given is None:
            return None
        field, spec = given
        try:
            return await self.off_loop(self.engine.engine.compile_grammar, spec)
        except GrammarError as e:
            raise APIError(400, f"{field}: {e}", param=field) from e

    def token_text(self, token_id: int) -> str:
        tokenizer = self.engine.engine.tokenizer
        return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)

    def submit(self, prompt: list[int], params: SamplingParams, field: str) -> RequestStream:
        try:
            return self.engine.submit(prompt, params)
        except EngineOverloaded as e:
            raise APIError(429, f"the server is overloaded: {e}; retry later",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from e
        except EngineDraining as e:
            raise APIError(503, str(e), headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from e
        except RequestError as e:
            raise APIError(400, str(e), param=field) from e


def error_status(output: RequestOutput) -> int | None:
    """None for a normal ending; 500 when a step crashed; 503 when the drain at shutdown cut it; 400 when the
    request itself could not be served (e.g. longer than the whole KV cache)."""
    if output.finish_reason is not FinishReason.ERROR or not output.error:
        return None
    if is_shutdown_cut(output):
        return 503
    return 500 if is_engine_failure(output) else 400


def raise_for_error(output: RequestOutput) -> None:
    status = error_status(output)
    if status is not None:
        raise APIError(status, output.error or "the request failed")


def get_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    return state


State = Annotated[ServerState, Depends(get_state)]


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Runs `work`; if the client goes away first, cancels it (which aborts its requests and frees their blocks).

    The disconnect is awaited, not polled: once the body is read, the server's next ASGI message for the request is
    `http.disconnect`. (Polling every 0.2 s cost the loop 20,000 wake-ups a second with 4,000 requests waiting.)"""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        # 499 (nginx's "client closed request"): nobody reads it, but it keeps the log free of tracebacks.
        raise APIError(499, "client disconnected")
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
