"""vLLM's logits processors in the sampler, each equal to its reference: transformers' LogitsProcessor classes
(repetition penalty, min_p, min new tokens, sequence bias) or, for OpenAI's presence and frequency penalties, which
transformers has not, vLLM's documented formula. Rows that ask for nothing are untouched; the order is vLLM's."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from npuserve.engine.logits_processors import adjust, min_p_cut  # noqa: E402
from npuserve.engine.sampler import LOGPROB_FLOOR, Sampler  # noqa: E402
from npuserve.engine.sequence import SamplingParams  # noqa: E402

VOCAB = 50
PROMPT = [3, 7, 7, 11, 20, 3]
OUTPUT = [7, 25, 25, 25, 4, 30]


def _logits(rows: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _ids() -> torch.Tensor:
    return torch.tensor([PROMPT + OUTPUT])


def _processed(params: SamplingParams, logits: torch.Tensor) -> torch.Tensor:
    """The distribution the sampler samples from for one row, read back through its processed logprobs (all of
    them: top_logprobs over the whole vocabulary is wider than the API's 20, which the sampler does not limit)."""
    params.logprobs, params.top_logprobs = True, VOCAB
    out = Sampler()(logits, [params], [len(PROMPT) + len(OUTPUT)], history=[(PROMPT, OUTPUT)])
    assert out.top_logprobs is not None
    dense = torch.full((VOCAB,), LOGPROB_FLOOR)
    for token, value in out.top_logprobs[0]:
        dense[token] = value
    return dense


def _as_logprobs(scores: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(scores.float(), dim=-1).clamp(min=LOGPROB_FLOOR)[0]


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_equals_transformers(penalty: float) -> None:
    logits = _logits()
    expected = transformers.RepetitionPenaltyLogitsProcessor(penalty)(_ids(), logits.clone())
    ours = adjust(logits, [SamplingParams(repetition_penalty=penalty)], [(PROMPT, OUTPUT)])
    assert torch.allclose(ours, expected, atol=1e-6)
    # through the sampler, greedy: the argmax of the penalised logits, and their logprobs as the processed ones
    assert torch.allclose(_processed(SamplingParams(temperature=0.0, repetition_penalty=penalty), logits),
                          _as_logprobs(expected), atol=1e-5)


@pytest.mark.parametrize("min_p", [0.05, 0.3, 1.0])
def test_min_p_equals_transformers_after_temperature(min_p: float) -> None:
    logits = _logits(seed=1)
    scores = transformers.TemperatureLogitsWarper(0.7)(_ids(), logits.clone())
    expected = transformers.MinPLogitsWarper(min_p)(_ids(), scores)
    assert torch.equal(torch.isinf(min_p_cut(logits / 0.7, [SamplingParams(temperature=0.7, min_p=min_p)])),
                       torch.isinf(expected))
    assert torch.allclose(_processed(SamplingParams(temperature=0.7, min_p=min_p), logits), _as_logprobs(expected),
                          atol=1e-5)


@pytest.mark.parametrize("min_tokens", [3, 6, 7])
def test_min_tokens_equals_transformers_min_new_tokens(min_tokens: int) -> None:
    """transformers holds back EOS while fewer than min_new_tokens are new; vLLM also the stop_token_ids."""
    logits = _logits(seed=2)
    eos = [2, 9]
    expected = transformers.MinNewTokensLengthLogitsProcessor(len(PROMPT), min_tokens, eos)(_ids(), logits.clone())
    params = SamplingParams(min_tokens=min_tokens, eos_token_ids=(2,), stop_token_ids=(9,))
    assert torch.equal(adjust(logits, [params], [(PROMPT, OUTPUT)]), expected)
    ignoring = SamplingParams(min_tokens=min_tokens, eos_token_ids=(2,), stop_token_ids=(9,), ignore_eos=True)
    held = adjust(logits, [ignoring], [(PROMPT, OUTPUT)])
    assert bool(torch.isinf(held[0, 9])) == (len(OUTPUT) < min_tokens) and held[0, 2] == logits[0, 2]


def test_logit_bias_equals_transformers_sequence_bias() -> None:
    logits = _logits(seed=3)
    bias = ((5, 100.0), (17, -100.0), (30, 2.5))
    expected = transformers.SequenceBiasLogitsProcessor([[[t], b] for t, b in bias])(_ids(), logits.clone())
    assert torch.allclose(adjust(logits, [SamplingParams(logit_bias=bias)], [(PROMPT, OUTPUT)]), expected)
    out = Sampler()(logits, [SamplingParams(temperature=0.0, logit_bias=bias)], [12], history=[(PROMPT, OUTPUT)])
    assert out.token_ids == [5]


@pytest.mark.parametrize(("presence", "frequency"), [(0.5, 0.0), (0.0, 0.7), (-1.0, 2.0)])
def test_presence_and_frequency_penalties_follow_the_openai_formula(presence: float, frequency: float) -> None:
    """vLLM's documented semantics (OpenAI's): logit[t] -= frequency * count(t in output) + presence * [t in output];
    the prompt does not count."""
    logits = _logits(seed=4)
    expected = logits.clone()
    for t in set(OUTPUT):
        expected[0, t] -= frequency * OUTPUT.count(t) + presence
    params = SamplingParams(presence_penalty=presence, frequency_penalty=frequency)
    assert torch.allclose(adjust(logits, [params], [(PROMPT, OUTPUT)]), expected, atol=1e-6)


def test_rows_are_processed_alone_and_in_vllms_order() -> None:
    """A batch mixing a plain row with one asking for everything: the plain row is untouched; the other is
    bias -> min_tokens -> repetition -> frequency/presence, as transformers' processors chained in that order."""
    logits = _logits(rows=2, seed=5)
    full = SamplingParams(logit_bias=((7, 3.0),), min_tokens=10, eos_token_ids=(2,), repetition_penalty=1.5,
                          frequency_penalty=0.3, presence_penalty=0.2)
    ours = adjust(logits, [SamplingParams(), full], [(PROMPT, OUTPUT), (PROMPT, OUTPUT)])
    assert torch.equal(ours[0], logits[0])
    row = logits[1:].clone()
    row = transformers.SequenceBiasLogitsProcessor([[[7], 3.0]])(_ids(), row)
    row = transformers.MinNewTokensLengthLogitsProcessor(len(PROMPT), 10, [2])(_ids(), row)
    row = transformers.RepetitionPenaltyLogitsProcessor(1.5)(_ids(), row)
    for t in set(OUTPUT):
        row[0, t] -= 0.3 * OUTPUT.count(t) + 0.2
    assert torch.allclose(ours[1:], row, atol=1e-6)


def test_a_batch_without_processors_needs_no_history() -> None:
    logits = _logits(rows=2)
    out = Sampler()(logits, [SamplingParams(temperature=0.0)] * 2, [0, 0])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert adjust(logits, [SamplingParams()] * 2, None) is logits


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, repetition_penalty=5e-324),  # schemathesis' find: float32 reads it as 0
    SamplingParams(temperature=1.0, repetition_penalty=5e-324),
    SamplingParams(temperature=1e-300, seed=1),  # greedy below 1e-5, as vLLM
    SamplingParams(temperature=1e-4, seed=1),  # sampled at 0.01, as vLLM
    SamplingParams(temperature=2.0, repetition_penalty=100.0, min_tokens=5, eos_token_ids=(2,)),
])
def test_extreme_accepted_values_sample_finite_logprobs(params: SamplingParams) -> None:
    """Values the API accepts at the edges of their ranges: every logprob sent is finite (JSON cannot carry NaN or
    inf) and the token chosen is one the distribution allows."""
    logits = _logits(seed=9) * 10
    params.logprobs, params.top_logprobs = True, 5
    out = Sampler()(logits, [params], [len(PROMPT) + len(OUTPUT)], history=[(PROMPT, OUTPUT)])
    assert out.logprobs is not None and out.top_logprobs is not None
    values = out.logprobs + [v for _, v in out.top_logprobs[0]]
    assert all(LOGPROB_FLOOR <= v <= 0.0 for v in values), values
    assert out.logprobs[0] > LOGPROB_FLOOR  # the chosen token was not one cut to -inf
    if params.temperature < 1e-5:
        assert SamplingParams(temperature=params.temperature).greedy
