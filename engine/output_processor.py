"""From scheduled sequences to per-request outputs: incremental detokenization, stop strings, output assembly.

vLLM's front end keeps this apart from the core loop; so do we. The engine hands over, after each step, the
sequences that got a token or ended; the processor turns them into `RequestOutput`s (the increments since the last
output and the totals). A stop string found in the text ends its request through `Scheduler.finish`, the one way
back into the scheduler, so its blocks are freed in the same step. Runs on the step-loop thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from npuserve.engine.detokenizer import IncrementalDetokenizer, TokenizerLike
from npuserve.engine.sequence import FinishReason, PromptLogprob, Sequence, TopLogprobs


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
    request_id: str
    seq: Sequence
    detok: IncrementalDetokenizer | None
    group: _Group
    num_emitted: int = 0  # output tokens already reported


class OutputProcessor:
    def __init__(self, tokenizer: TokenizerLike | None, finish: Callable[[Sequence, FinishReason], None]) -> None:
        self.tokenizer = tokenizer
        self._finish = finish  # Scheduler.finish
        self._by_seq: dict[int, _Tracked] = {}

    def __len__(self) -> int:
        return len(self._by_seq)

    def sequence(self, seq_id: int) -> Sequence | None:
        tracked = self._by_seq.get(seq_id)
        return tracked.seq if tracked is not None else None

    def _detokenizer(self, seq: Sequence) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        sp = seq.sampling
        return IncrementalDetokenizer(self.tokenizer, sp.stop, skip_special_tokens=sp.skip_special_tokens,
                                      include_stop_str_in_output=sp.include_stop_str_in_output,
                                      min_tokens=sp.min_tokens)

    def track(self, request_id: str, seq: Sequence) -> None:
        self._by_seq[seq.seq_id] = _Tracked(request_id, seq, self._detokenizer(seq), _Group(seq.num_samples))

    def track_fork(self, parent: Sequence, child: Sequence) -> str | None:
        """Track a child forked from `parent` as another choice of its request; returns the request id."""
        tracked = self._by_seq.get(parent.seq_id)
        if tracked is None:
            return None
        self._by_seq[child.seq_id] = _Tracked(tracked.request_id, child, self._detokenizer(child), tracked.group)
        return tracked.request_id

    def process(self, ended: Iterable[Sequence], stepped: Iterable[Sequence]) -> list[RequestOutput]:
        """`ended`: sequences the scheduler ended outside the model (aborts, admission errors); `stepped`: those
        the step ran, finished or not. Returns an output for each one that got a token or ended."""
        outputs = [self._output(t, finished=True) for t in self._tracked(ended)]
        for tracked in self._tracked(stepped):
            seq = tracked.seq
            finished = seq.finish_reason is not None
            if finished or seq.num_output_tokens > tracked.num_emitted:
                outputs.append(self._output(tracked, finished))
        return outputs

    def _tracked(self, seqs: Iterable[Sequence]) -> list[_Tracked]:
        return [t for t in (self._by_seq.get(s.seq_id) for s in seqs) if t is not None]

    def _output(self, tracked: _Tracked, finished: bool) -> RequestOutput:
        seq = tracked.seq
        new_ids = seq.output_token_ids[tracked.num_emitted :]
        new_logprobs = seq.output_logprobs[tracked.num_emitted :] if seq.sampling.wants_logprobs else None
        new_top = seq.output_top_logprobs[tracked.num_emitted :] if seq.sampling.top_logprobs else None
        new_text = text = ""
        if tracked.detok is not None:
            new_text = tracked.detok.add(new_ids) if new_ids else ""
            if tracked.detok.stopped and not finished:
                self._finish(seq, FinishReason.STOP)  # its blocks are freed now
                finished = True
            if finished:
                new_text += tracked.detok.finish()
            text = tracked.detok.text
        tracked.num_emitted = seq.num_output_tokens
        group = tracked.group
        if finished:
            self._by_seq.pop(seq.seq_id, None)
            # A parent that ended before its prefill forked (abort, error) takes its unborn choices with it.
            group.remaining -= 1 + seq.num_forks_pending
        return RequestOutput(
            request_id=tracked.request_id, new_token_ids=new_ids, new_text=new_text, new_logprobs=new_logprobs,
            token_ids=seq.output_token_ids, text=text, num_prompt_tokens=seq.num_prompt_tokens, finished=finished,
            finish_reason=seq.finish_reason if finished else None, error=seq.error, metrics=request_metrics(seq),
            num_cached_prompt_tokens=seq.num_prompt_cached_tokens or 0, index=seq.index,
            last=finished and group.remaining <= 0, new_top_logprobs=new_top,
            cumulative_logprob=seq.cumulative_logprob, prompt_token_ids=seq.prompt_token_ids,
            prompt_logprobs=seq.prompt_logprobs,
        )


def request_metrics(seq: Sequence) -> dict[str, float]:
    """Per-request timings (seconds) and batch sizes: the `npuserve` field of responses, and the histograms."""
    m: dict[str, float] = {"arrival_time": seq.arrival_time}
    if seq.first_scheduled_time is not None:
        m["queue_time"] = seq.first_scheduled_time - seq.arrival_time
        if seq.first_token_time is not None:
            m["prefill_time"] = seq.first_token_time - seq.first_scheduled_time
    if seq.first_token_time is not None:
        m["ttft"] = seq.first_token_time - seq.arrival_time
        if seq.finished_time is not None:
            m["decode_time"] = seq.finished_time - seq.first_token_time
    if seq.finished_time is not None:
        m["e2e"] = seq.finished_time - seq.arrival_time
    m["prefill_batch_size"] = float(seq.prefill_batch_size)
    if seq.num_decode_steps:
        m["mean_decode_batch_size"] = seq.decode_batch_size_sum / seq.num_decode_steps
    m["num_preemptions"] = float(seq.num_preemptions)
    return m
