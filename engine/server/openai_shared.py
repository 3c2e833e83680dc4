"""What `/v1/completions` and `/v1/chat/completions` share: a request body's sampling parameters and output
constraint, the n/best_of bound, a choice's collected increments, several request streams merged, and a chunk's
usage and timings."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from npuserve.engine.guided import CompiledGrammar, GuidedSpec
from npuserve.engine.output_processor import RequestOutput
from npuserve.engine.sequence import SamplingParams, TopLogprobs
from npuserve.engine.server.async_engine import RequestStream
from npuserve.engine.server.errors import APIError
from npuserve.engine.server.protocol import InvalidField, SamplingFields, Usage
from npuserve.engine.server.state import ServerState
from npuserve.engine_contract import TIMINGS_FIELD, RequestTimings

log = logging.getLogger(__name__)


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


def final_extras(output: RequestOutput, usage: Usage | None) -> dict[str, Any]:
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
class Collected:
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


def check_choices(state: ServerState, n: int, best: int) -> None:
    """n and best_of: at most maxBatchSize sequences (they run at once), best_of at least n."""
    if best < n:
        raise APIError(400, f"best_of ({best}) must be at least n ({n})", param="best_of")
    max_batch = state.engine.engine.snapshot.schedule.maxBatchSize
    if best > max_batch:
        name = "n" if best == n else "best_of"
        raise APIError(400, f"{name} is {best}; this server runs at most {max_batch} sequences at once "
                       "(maxBatchSize)", param=name)


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
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
