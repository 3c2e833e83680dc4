"""The request as the engine's parts see it: shared by the scheduler, the KV manager and the step builder.

No torch here. The scheduler owns a sequence's queue state and block table; the engine appends tokens through
`Scheduler.update`; the step builder reads token ids, block tables and cached-token counts to make tensors.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from npuserve.engine.guided import CompiledGrammar, Guide


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens, maxIterTimes or maxSeqLen
    ABORT = "abort"  # client gone or cancelled
    ERROR = "error"  # the request could not be served (e.g. longer than the whole KV cache)


# vLLM's: a temperature below 1e-5 is greedy, and one below 0.01 is sampled at 0.01 (logits over a smaller one
# overflow float32 and sample NaN)
GREEDY_TEMPERATURE = 1e-5
MIN_SAMPLED_TEMPERATURE = 1e-2


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # below GREEDY_TEMPERATURE = greedy (a fused argmax on the device)
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False  # the chosen token's logprob at each output position
    top_logprobs: int = 0  # and the k most likely tokens' (0..20), computed on the device
    prompt_logprobs: int | None = None  # None: off; k: each prompt token's logprob (and the top k) at prefill
    n: int = 1  # sequences sampled from one prefill (best_of when given): the prompt's KV blocks are shared
    priority: int = 0  # lower is served first under the `priority` policy
    guided: CompiledGrammar | None = None  # structured output: each sequence gets its own guide from it
    # vLLM's request extensions (logits_processors.py; the detokenizer for the last three)
    repetition_penalty: float = 1.0  # > 0; 1 = off: prompt and output tokens' logits divided (or multiplied) by it
    presence_penalty: float = 0.0  # OpenAI's: subtracted once for each token in the output
    frequency_penalty: float = 0.0  # OpenAI's: subtracted times each token's count in the output
    min_p: float = 0.0  # tokens below min_p x the most likely one's probability are cut
    min_tokens: int = 0  # no stop (EOS, stop_token_ids, stop strings) before this many output tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits
    eos_token_ids: tuple[int, ...] = ()  # the model's, set by the engine: what min_tokens holds back with stop ids
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def adjusts_logits(self) -> bool:
        """Whether a logits processor (bias, min_tokens, penalties) applies to this request's rows."""
        return bool(self.logit_bias or self.min_tokens or self.repetition_penalty != 1.0
                    or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0)

    @property
    def min_tokens_stop_ids(self) -> tuple[int, ...]:
        """The tokens min_tokens holds back: the model's EOS (unless ignore_eos) and stop_token_ids."""
        return (() if self.ignore_eos else self.eos_token_ids) + self.stop_token_ids


_ids = itertools.count()

# (token id, logprob) pairs, most likely first.
TopLogprobs = list[tuple[int, float]]


@dataclass(frozen=True, slots=True)
class PromptLogprob:
    """One prompt token's logprob given the tokens before it (raw model distribution), its rank (1 = most likely)
    and the k most likely tokens there."""

    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True, eq=False)
class Sequence:
    """One request's tokens and cache state. Identity is `seq_id`; two sequences are never equal otherwise."""

    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float
    seq_id: int = field(default_factory=lambda: next(_ids))
    token_ids: list[int] = field(default_factory=list)  # prompt + output; filled from the prompt
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)  # device blocks, in order
    host_block_table: list[int] = field(default_factory=list)  # host blocks while swapped out
    num_cached_tokens: int = 0  # tokens whose KV is already in the cache (prefix hits, or computed before)
    num_prompt_cached_tokens: int | None = None  # prompt tokens served by the prefix cache at its first prefill
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[TopLogprobs] = field(default_factory=list)  # when sampling.top_logprobs > 0
    cumulative_logprob: float = 0.0  # sum of output_logprobs (best_of ranks by it)
    prompt_logprobs: list[PromptLogprob] | None = None  # filled once, by the first prefill, when asked
    index: int = 0  # the choice this sequence is, within its request (n > 1)
    num_forks_pending: int = 0  # children still to fork from this one after its first prefill (n - 1)
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_preemptions: int = 0
    # timings (seconds, the engine clock): for TTFT, queue time and the per-request report
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    prefill_batch_size: int = 0
    decode_batch_size_sum: int = 0  # sum over decode steps, for the mean decode batch size
    num_decode_steps: int = 0
    guide: Guide | None = None  # the grammar's state (structured output); advanced on the step thread

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
            if self.index == 0:
                self.num_forks_pending = self.sampling.n - 1
        if self.guide is None and self.sampling.guided is not None:
            self.guide = self.sampling.guided.new_guide()

    @property
    def num_samples(self) -> int:
        """Tokens sampled for this sequence in its next step: one, or one per choice at the prefill that forks."""
        return 1 + self.num_forks_pending

    def sample_seed(self, index: int | None = None) -> int | None:
        """The seed of choice `index` (this sequence's by default): the request's seed for choice 0, a distinct
        one derived from it for the others, so each choice is reproducible and none repeats another."""
        seed = self.sampling.seed
        i = self.index if index is None else index
        if seed is None or i == 0:
            return seed
        return (seed + i * 0x9E3779B97F4A7C15) % (2**63)

    def fork(self, index: int) -> Sequence:
        """A child after the first prefill: the same prompt and parameters, its own outputs. The caller shares or
        copies the KV blocks (`KVCacheManager.fork`) and appends the child's first token."""
        child = Sequence(list(self.prompt_token_ids), self.sampling, self.arrival_time, index=index)
        child.status = self.status
        child.num_cached_tokens = self.num_cached_tokens
        child.num_prompt_cached_tokens = self.num_prompt_cached_tokens
        child.prompt_logprobs = self.prompt_logprobs
        child.first_scheduled_time = self.first_scheduled_time
        child.prefill_batch_size = self.prefill_batch_size
        return child

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def num_blocks(self, block_size: int) -> int:
        return (self.num_tokens + block_size - 1) // block_size
