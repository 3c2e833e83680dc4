"""What a step hands the output side: each sequence's raw results as plain values (`SeqUpdate`), taken on the step
thread by the `SeqTracker`, which alone reads the sequences.

vLLM v1's split (EngineCoreOutput -> OutputProcessor): the step thread reports token ids, logprobs and finish
reasons; detokenizing, stop strings and `RequestOutput` assembly happen on the output side (`output_processor.py`),
on another thread in the server, so a slow detokenize never stretches a step. An update is never mutated after it
is made, and shares no list the step thread changes later.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from npuserve.engine.sequence import FinishReason, PromptLogprob, SamplingParams, Sequence, TopLogprobs


@dataclass(frozen=True, slots=True)
class SeqUpdate:
    """One sequence's step: the output tokens (and logprobs) it got since its last update, and its end if it
    ended. `time`: the engine clock after the step (a stop string found in these tokens ends the request then)."""

    request_id: str
    seq_id: int
    index: int  # the choice, within its request (n > 1)
    sampling: SamplingParams
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    new_logprobs: list[float] | None  # when sampling.wants_logprobs
    new_top_logprobs: list[TopLogprobs] | None  # when sampling.top_logprobs
    cumulative_logprob: float
    finish_reason: FinishReason | None
    error: str | None
    num_forks_pending: int  # choices still to fork from it (an end before its prefill takes them along)
    num_cached_prompt_tokens: int
    prompt_logprobs: list[PromptLogprob] | None
    metrics: dict[str, float]  # see `request_metrics`
    time: float


@dataclass(slots=True)
class _Reported:
    request_id: str
    seq: Sequence
    num_reported: int = 0  # output tokens already in an update


class SeqTracker:
    """The step thread's record of the unfinished sequences: the request of each, and how many of its output tokens
    have been reported. A sequence leaves it with the update that reports its end."""

    def __init__(self) -> None:
        self._by_seq: dict[int, _Reported] = {}
        self._by_request: dict[str, list[int]] = {}

    def __len__(self) -> int:
        return len(self._by_seq)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._by_request

    def request_seq_ids(self, request_id: str) -> list[int]:
        return list(self._by_request.get(request_id, []))

    def sequence(self, seq_id: int) -> Sequence | None:
        reported = self._by_seq.get(seq_id)
        return reported.seq if reported is not None else None

    def requests(self) -> list[str]:
        return list(self._by_request)

    def add(self, request_id: str, seq: Sequence) -> None:
        self._by_seq[seq.seq_id] = _Reported(request_id, seq)
        self._by_request.setdefault(request_id, []).append(seq.seq_id)

    def add_fork(self, parent: Sequence, child: Sequence) -> None:
        """A child forked from `parent`: another choice of its request."""
        reported = self._by_seq.get(parent.seq_id)
        if reported is not None:
            self.add(reported.request_id, child)

    def updates(self, ended: Iterable[Sequence], stepped: Iterable[Sequence], now: float) -> list[SeqUpdate]:
        """`ended`: sequences the scheduler ended outside the model (aborts, admission errors, stop strings);
        `stepped`: those the step ran, finished or not. An update for each one that got a token or ended."""
        updates = []
        for seq in ended:
            reported = self._by_seq.get(seq.seq_id)
            if reported is not None:
                updates.append(self._update(reported, now))
        for seq in stepped:
            reported = self._by_seq.get(seq.seq_id)
            if reported is not None and (seq.finish_reason is not None
                                         or seq.num_output_tokens > reported.num_reported):
                updates.append(self._update(reported, now))
        return updates

    def _update(self, reported: _Reported, now: float) -> SeqUpdate:
        seq, sp, done = reported.seq, reported.seq.sampling, reported.num_reported
        finished = seq.finish_reason is not None
        if finished:
            self._by_seq.pop(seq.seq_id, None)
            siblings = self._by_request.get(reported.request_id, [])
            if seq.seq_id in siblings:
                siblings.remove(seq.seq_id)
            if not siblings:
                self._by_request.pop(reported.request_id, None)
        reported.num_reported = seq.num_output_tokens
        return SeqUpdate(
            request_id=reported.request_id, seq_id=seq.seq_id, index=seq.index, sampling=sp,
            prompt_token_ids=seq.prompt_token_ids, new_token_ids=seq.token_ids[seq.num_prompt_tokens + done :],
            new_logprobs=seq.output_logprobs[done:] if sp.wants_logprobs else None,
            new_top_logprobs=seq.output_top_logprobs[done:] if sp.top_logprobs else None,
            cumulative_logprob=seq.cumulative_logprob, finish_reason=seq.finish_reason, error=seq.error,
            num_forks_pending=seq.num_forks_pending, num_cached_prompt_tokens=seq.num_prompt_cached_tokens or 0,
            prompt_logprobs=seq.prompt_logprobs, metrics=request_metrics(seq), time=now,
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
        end_metrics(m, seq.finished_time)
    m["prefill_batch_size"] = float(seq.prefill_batch_size)
    if seq.num_decode_steps:
        m["mean_decode_batch_size"] = seq.decode_batch_size_sum / seq.num_decode_steps
    m["num_preemptions"] = float(seq.num_preemptions)
    return m


def end_metrics(m: dict[str, float], finished_time: float) -> None:
    """Adds the timings of a request that ended at `finished_time` (engine clock) to its metrics."""
    if "ttft" in m:
        m["decode_time"] = finished_time - m["arrival_time"] - m["ttft"]
    m["e2e"] = finished_time - m["arrival_time"]
