"""Token counts of simulated requests: prompt lengths where the dataset has no tokenizer count, and the "true" output
length of each request (when it would stop on its own).

Prompts: a request drawn with a tokenizer count (`prompt_len`: random prompts always have one) keeps it; otherwise
(GSM8K, ShareGPT and JSONL files read without a tokenizer: the simulator runs where `tokenizers` is not installed)
it is estimated as one token per 4 characters, the usual figure for English BPE text (the datasets module estimates
ShareGPT answers the same way). A prompt template the real client adds (MindIE's benchmark wraps GSM8K questions:
the tuning guide measures 186 tokens on average) is not in the file, so give such lengths explicitly.

Outputs: with ignore_eos every request runs to its max_tokens. Otherwise a dataset that carries the output length
(random: the drawn length; ShareGPT: the reference answer's length) runs to it; a dataset that gives only a cap (GSM8K,
JSONL) runs to its cap unless `OutputLengths.mean` is set, in which case the length is drawn from a normal
distribution of that spread (`cv` x mean), clipped to [1, cap], with its centre moved so that the mean after the
clipping is `mean` (the guide's GSM8K run: mean 346 under a cap of 512).
"""

from __future__ import annotations

import math
import random
from functools import lru_cache

from pydantic import BaseModel, ConfigDict, Field

from npuserve.loadgen.config import DatasetName
from npuserve.loadgen.records import BenchRequest

CHARS_PER_TOKEN = 4.0
# Datasets whose max_tokens is the request's real output length, not only a cap.
LENGTH_GIVING_DATASETS = frozenset({DatasetName.RANDOM, DatasetName.SHAREGPT})


class OutputLengths(BaseModel):
    """How long a request's answer is when the dataset gives only a cap."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mean: float | None = Field(default=None, gt=0, description="mean output tokens; None: run to the cap")
    cv: float = Field(default=0.5, ge=0, description="spread of the draw: standard deviation / mean")


def prompt_tokens(request: BenchRequest) -> int:
    if request.prompt_len is not None:
        return max(1, request.prompt_len)
    return max(1, math.ceil(len(request.prompt) / CHARS_PER_TOKEN))


def output_tokens(request: BenchRequest, dataset: DatasetName, lengths: OutputLengths, ignore_eos: bool,
                  rng: random.Random) -> int:
    cap = request.max_tokens
    if ignore_eos or dataset in LENGTH_GIVING_DATASETS or lengths.mean is None:
        return cap
    return draw_output(lengths.mean, lengths.cv, cap, rng)


def draw_output(mean: float, cv: float, cap: int, rng: random.Random) -> int:
    """An output length of mean `mean` after clipping to [1, cap] (see the module docstring)."""
    if cv == 0 or mean >= cap:
        return max(1, min(cap, round(mean)))
    sigma = cv * mean
    centre = _centre_for_clipped_mean(mean, sigma, cap)
    return max(1, min(cap, round(rng.gauss(centre, sigma))))


def _clipped_mean(mu: float, sigma: float, cap: float) -> float:
    """E[min(X, cap)] for X ~ N(mu, sigma) (the clip at 1 is negligible for the spreads used)."""
    z = (cap - mu) / sigma
    cdf = 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))
    pdf = math.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
    return mu * cdf - sigma * pdf + cap * (1.0 - cdf)


@lru_cache(maxsize=256)
def _centre_for_clipped_mean(mean: float, sigma: float, cap: float) -> float:
    """The centre whose draw, clipped at `cap`, has mean `mean` (bisection: the clipped mean rises with the centre)."""
    low, high = mean, mean + 10.0 * sigma + cap
    for _ in range(100):
        mid = 0.5 * (low + high)
        if _clipped_mean(mid, sigma, cap) < mean:
            low = mid
        else:
            high = mid
    return 0.5 * (low + high)
