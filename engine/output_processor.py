"""The output side of a step: `SeqUpdate`s (raw token ids, logprobs, finish reasons) -> per-request outputs, with
incremental detokenization and stop strings.

vLLM v1's output processor: it never touches a sequence, the scheduler or the runner, so it may run on any one
thread (the server's output thread; the caller's, offline). A stop string found in the text ends its request at
once in the outputs; the engine is told (`stop`: it ends the sequence at its next step, freeing its blocks then),
and the updates that sequence still gets meanwhile (a token sampled by a step already running) are dropped, as vLLM
v1 drops them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from npuserve.engine.detokenizer import IncrementalDetokenizer, TokenizerLike
from npuserve.engine.sequence import FinishReason, PromptLogprob, TopLogprobs
from npuserve.engine.step_output import SeqUpdate, end_metrics


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one sequence of a request (choice `index`). `new_*` are the increments; the rest
    is cumulative. `finished`: this choice ended; `last`: every choice of the request has (the request's end)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[float] | None
    token_ids: list[int]  # all output tokens so far
    text: str  # all output text so far (stop string excluded)
    num_prompt_tokens: int
    finished: bool
    finish_reason: FinishReason | None = None
    num_cached_prompt_tokens: int = 0  # prompt tokens served by the prefix cache
    index: int = 0
    last: bool | None = None  # None: as `finished` (one choice)
    new_top_logprobs: list[TopLogprobs] | None = None  # when sampling.top_logprobs > 0
    cumulative_logprob: float = 0.0  # of all output tokens (when logprobs were computed)
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprob] | None = None  # prompt tokens 1..L-1, once the prefill computed them
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # see `request_metrics`


    def __post_init__(self) -> None:
        if self.last is None:
            self.last = self.finished


@dataclass(slots=True)
class _Group:
    remaining: int  # choices of the request not finished yet (forked or still to be)


@dataclass(slots=True)
class _Tracked:
    detok: IncrementalDetokenizer | None
    group: _Group
    token_ids: list[int] = field(default_factory=list)  # all output tokens reported so far


class OutputProcessor:
    def __init__(self, tokenizer: TokenizerLike | None, stop: Callable[[int], None]) -> None:
        """`stop(seq_id)`: a stop string ended that sequence (thread-safe: `LLMEngine.stop_sequence`)."""
        self.tokenizer = tokenizer
        self._stop = stop
        self._by_seq: dict[int, _Tracked] = {}
        self._groups: dict[str, _Group] = {}
        self._stopped: set[int] = set()  # ended here by a stop string; the engine has not reported their end yet

    def __len__(self) -> int:
        return len(self._by_seq)

    def _detokenizer(self, update: SeqUpdate) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        sp = update.sampling
        return IncrementalDetokenizer(self.tokenizer, sp.stop, skip_special_tokens=sp.skip_special_tokens,
                                      include_stop_str_in_output=sp.include_stop_str_in_output,
                                      min_tokens=sp.min_tokens)

    def process(self, updates: Iterable[SeqUpdate]) -> list[RequestOutput]:
        """An output for each update, in order, except those of a sequence a stop string already ended."""
        outputs = []
        for update in updates:
            if update.seq_id in self._stopped:
                if update.finish_reason is not None:
                    self._stopped.discard(update.seq_id)
                continue
            tracked = self._by_seq.get(update.seq_id)
            if tracked is None:  # its first update: a new request, or a choice forked from one
                group = self._groups.get(update.request_id)
                if group is None:
                    group = self._groups[update.request_id] = _Group(update.sampling.n)
                tracked = self._by_seq[update.seq_id] = _Tracked(self._detokenizer(update), group)
            outputs.append(self._output(update, tracked))
        return outputs

    def _output(self, update: SeqUpdate, tracked: _Tracked) -> RequestOutput:
        new_ids = update.new_token_ids
        tracked.token_ids.extend(new_ids)
        finished = update.finish_reason is not None
        reason, metrics = update.finish_reason, update.metrics
        new_text = text = ""
        if tracked.detok is not None:
            new_text = tracked.detok.add(new_ids) if new_ids else ""
            if tracked.detok.stopped and not finished:
                self._stop(update.seq_id)  # the engine frees its blocks at its next step
                self._stopped.add(update.seq_id)
                finished, reason = True, FinishReason.STOP
                metrics = dict(metrics)
                end_metrics(metrics, update.time)
            if finished:
                new_text += tracked.detok.finish()
            text = tracked.detok.text
        group = tracked.group
        if finished:
            self._by_seq.pop(update.seq_id, None)
            # A parent that ended before its prefill forked (abort, error) takes its unborn choices with it.
            group.remaining -= 1 + update.num_forks_pending
            if group.remaining <= 0:
                self._groups.pop(update.request_id, None)
        return RequestOutput(
            request_id=update.request_id, new_token_ids=new_ids, new_text=new_text,
            new_logprobs=update.new_logprobs, token_ids=list(tracked.token_ids), text=text,
            num_prompt_tokens=len(update.prompt_token_ids), finished=finished, finish_reason=reason,
            error=update.error, metrics=metrics, num_cached_prompt_tokens=update.num_cached_prompt_tokens,
            index=update.index, last=finished and group.remaining <= 0, new_top_logprobs=update.new_top_logprobs,
            cumulative_logprob=update.cumulative_logprob, prompt_token_ids=update.prompt_token_ids,
            prompt_logprobs=update.prompt_logprobs,
        )
