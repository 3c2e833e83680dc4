"""The checks a request passes before the engine queues it: the prompt's length and ids, the sampling values."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("torch")  # the logprobs bound is the sampler's

from npuserve.engine.request_checks import RequestError, RequestLimits
from npuserve.engine.sequence import SamplingParams

LIMITS = RequestLimits(vocab_size=100, max_input_len=4, truncation=False)


def test_a_prompt_within_the_limits_is_taken_as_it_is() -> None:
    assert LIMITS.prompt_ids([1, 2, 3, 4], SamplingParams(max_tokens=2)) == [1, 2, 3, 4]


def test_truncation_keeps_the_prompts_tail() -> None:
    limits = RequestLimits(vocab_size=100, max_input_len=4, truncation=True)
    assert limits.prompt_ids([1, 2, 3, 4, 5, 6], SamplingParams()) == [3, 4, 5, 6]


@pytest.mark.parametrize(
    ("ids", "params", "message"),
    [
        ([], SamplingParams(), "the prompt is empty"),
        ([1] * 5, SamplingParams(), "maxInputTokenLen is 4"),
        ([1], SamplingParams(max_tokens=0), "max_tokens must be at least 1"),
        ([1], SamplingParams(max_tokens=0, prompt_logprobs=0, n=2), "n must be at least 1"),
        ([1], SamplingParams(top_logprobs=21), "at most 20 logprobs"),
        ([100], SamplingParams(), "prompt token ids must be in [0, 100)"),
        ([1], SamplingParams(logit_bias=((100, 1.0),)), "logit_bias token ids must be in [0, 100)"),
        ([1], SamplingParams(max_tokens=2, min_tokens=3), "min_tokens (3) is above max_tokens (2)"),
    ],
)
def test_refused(ids: list[int], params: SamplingParams, message: str) -> None:
    with pytest.raises(RequestError, match=re.escape(message)):
        LIMITS.prompt_ids(ids, params)
