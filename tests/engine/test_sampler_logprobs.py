"""The sampler's logprobs: of the distribution sampled from (vLLM's processed_logprobs, the default) or the raw
one; the top k found on the device; per-choice seeds."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from npuserve.engine.sampler import LOGPROB_FLOOR, Sampler  # noqa: E402
from npuserve.engine.sequence import SamplingParams  # noqa: E402

LOGITS = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0]])


def test_processed_logprobs_are_those_of_the_distribution_sampled_from() -> None:
    params = SamplingParams(temperature=0.5, top_k=3, logprobs=True, top_logprobs=5)
    out = Sampler()(LOGITS, [params], [0])
    assert out.top_logprobs is not None
    top = out.top_logprobs[0]
    assert [i for i, _ in top[:3]] == [0, 1, 2] and {i for i, _ in top[3:]} <= {3, 4, 5, 6, 7}
    kept = [v for _, v in top[:3]]
    expected = torch.log_softmax(LOGITS[0, :3] / 0.5, dim=-1).tolist()  # temperature, then top-k
    assert kept == pytest.approx(expected, abs=1e-5)
    assert math.fsum(math.exp(v) for v in kept) == pytest.approx(1.0, abs=1e-5)
    assert [v for _, v in top[3:]] == [LOGPROB_FLOOR, LOGPROB_FLOOR]  # cut by top-k: -inf, sent as -9999
    assert out.logprobs is not None and out.token_ids[0] in (0, 1, 2)
    assert out.logprobs[0] == pytest.approx(dict(top)[out.token_ids[0]])


def test_top_p_cut_shows_in_processed_logprobs() -> None:
    params = SamplingParams(temperature=1.0, top_p=0.5, logprobs=True, top_logprobs=3)
    out = Sampler()(LOGITS, [params], [0])
    assert out.top_logprobs is not None
    # p(token 0) = 0.63 >= 0.5: only it is kept, with probability 1.
    assert out.top_logprobs[0][0] == (0, pytest.approx(0.0, abs=1e-6))
    assert [v for _, v in out.top_logprobs[0][1:]] == [LOGPROB_FLOOR, LOGPROB_FLOOR]


def test_raw_mode_and_greedy_rows_give_the_model_distribution() -> None:
    raw = torch.log_softmax(LOGITS[0], dim=-1)
    sampled = SamplingParams(temperature=0.5, top_k=3, logprobs=True, top_logprobs=4)
    out = Sampler("raw_logprobs")(LOGITS, [sampled], [0])
    assert out.top_logprobs is not None
    assert [v for _, v in out.top_logprobs[0]] == pytest.approx(raw[:4].tolist(), abs=1e-5)
    greedy = SamplingParams(temperature=0.0, top_k=3, logprobs=True, top_logprobs=4)
    both = Sampler()(LOGITS.repeat(2, 1), [greedy, sampled], [0, 0])  # a greedy row in a mixed batch
    assert both.token_ids[0] == 0 and both.top_logprobs is not None
    assert [v for _, v in both.top_logprobs[0]] == pytest.approx(raw[:4].tolist(), abs=1e-5)


def test_rows_without_top_logprobs_get_none_and_k_is_per_row() -> None:
    a = SamplingParams(temperature=0.0, logprobs=True)
    b = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2)
    out = Sampler()(LOGITS.repeat(2, 1), [a, b], [0, 0])
    assert out.top_logprobs is not None and out.top_logprobs[0] == [] and len(out.top_logprobs[1]) == 2
    assert Sampler()(LOGITS, [SamplingParams(temperature=0.0)], [0]).logprobs is None


def test_seeds_are_per_row() -> None:
    logits = torch.zeros(4, 1000)
    p = SamplingParams(temperature=1.0, seed=7)
    same = Sampler()(logits, [p] * 4, [5] * 4, seeds=[7, 7, 7, 7]).token_ids
    assert len(set(same)) == 1
    distinct = Sampler()(logits, [p] * 4, [5] * 4, seeds=[7, 8, 9, 10]).token_ids
    assert len(set(distinct)) > 1
    assert Sampler()(logits, [p] * 4, [5] * 4, seeds=[7, 8, 9, 10]).token_ids == distinct
