"""What the engine holds a request to before it queues it (vLLM's input processor): a prompt that is not empty and
fits maxInputTokenLen (or its tail, with truncation), token ids of this model's vocabulary, and sampling values in
range. Any thread; no state."""

from __future__ import annotations

from dataclasses import dataclass

from npuserve.engine.sampler import MAX_LOGPROBS
from npuserve.engine.sequence import SamplingParams


class RequestError(ValueError):
    """A request the engine refuses (empty or too long a prompt, a duplicate id); the server answers 400."""


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """The model's vocabulary and ModelDeployConfig's prompt limit, as the engine started with them."""

    vocab_size: int
    max_input_len: int  # maxInputTokenLen
    truncation: bool  # a longer prompt keeps its last max_input_len tokens instead of being refused

    def prompt_ids(self, ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt's ids the engine runs (the tail, with truncation); raises RequestError for a request it
        refuses."""
        if not ids:
            raise RequestError("the prompt is empty")
        if len(ids) > self.max_input_len:
            if not self.truncation:
                raise RequestError(f"the prompt has {len(ids)} tokens; maxInputTokenLen is {self.max_input_len}")
            ids = ids[-self.max_input_len :]
        if params.max_tokens < 0 or (params.max_tokens == 0 and params.prompt_logprobs is None):
            raise RequestError("max_tokens must be at least 1 (0 only with prompt logprobs)")
        if params.n < 1 or (params.n > 1 and params.max_tokens == 0):
            raise RequestError("n must be at least 1 (and 1 when max_tokens is 0)")
        if not 0 <= params.top_logprobs <= MAX_LOGPROBS or not 0 <= (params.prompt_logprobs or 0) <= MAX_LOGPROBS:
            raise RequestError(f"at most {MAX_LOGPROBS} logprobs per position")
        if any(t < 0 or t >= self.vocab_size for t in ids):
            raise RequestError(f"prompt token ids must be in [0, {self.vocab_size})")
        if any(not 0 <= t < self.vocab_size for t, _ in params.logit_bias):
            raise RequestError(f"logit_bias token ids must be in [0, {self.vocab_size})")
        if params.min_tokens > params.max_tokens:
            raise RequestError(f"min_tokens ({params.min_tokens}) is above max_tokens ({params.max_tokens})")
        return ids
