"""Sampling on the device: only the chosen ids (and, when asked, logprobs) leave it.

An all-greedy batch is one fused argmax. A row asking for vLLM's logits processors (logit_bias, min_tokens,
penalties: `logits_processors.py`) has them applied first, greedy or not. Otherwise each row is scaled by its
temperature (vLLM's bounds: below 1e-5 greedy, below 0.01 raised to 0.01), cut by its min_p, top-k and top-p,
and drawn with the exponential-race trick (`argmax(p / E)`, E ~ Exp(1), is a draw from p) so the whole batch
samples in one pass; rows with a seed draw their noise from a
generator seeded by (seed, position), so a seeded request gives the same tokens whatever batch it runs in. Greedy
rows inside a mixed batch are still argmax.

Logprobs (vLLM's `logprobs_mode`): `processed_logprobs` (the default) are those of the distribution actually
sampled from: the logits after the logits processors, temperature, min_p, top-k and top-p, log-softmaxed (a token
cut has -inf, sent as -9999.0 as vLLM does); a greedy row has no temperature or cut, so its processed logprobs are
the raw ones, or those after its logits processors. `raw_logprobs` are the model's raw distribution. The top k of
them are found on the device with one `topk`: only k ids and values per row leave it.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from npuserve.engine import logits_processors
from npuserve.engine.logits_processors import History, needs_history
from npuserve.engine.sequence import MIN_SAMPLED_TEMPERATURE, PromptLogprob, SamplingParams, TopLogprobs
from npuserve.mindie_config import LogprobsMode

MAX_LOGPROBS = 20  # vLLM's default max_logprobs
LOGPROB_FLOOR = -9999.0  # what -inf is sent as (vLLM's serving layer does the same)


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float] | None  # None when no row asked for them
    top_logprobs: list[TopLogprobs] | None = None  # per row, best first; empty for rows that asked for none
    prompt_logprobs: dict[int, list[PromptLogprob]] = field(default_factory=dict)  # seq_id -> (set by the runner)


class Sampler:
    def __init__(self, logprobs_mode: LogprobsMode = "processed_logprobs") -> None:
        self.logprobs_mode = logprobs_mode

    def __call__(
        self, logits: torch.Tensor, params: Seq[SamplingParams], positions: Seq[int],
        seeds: Seq[int | None] | None = None, history: Seq[History] | None = None,
    ) -> SamplerOutput:
        """logits: (rows, vocab); positions: each row's token index and seeds its seed (for seeded noise; default:
        each row's `params.seed`); history: each row's prompt and output tokens, needed when a row asks for a
        logits processor (`logits_processors.needs_history`)."""
        seeds = [p.seed for p in params] if seeds is None else seeds
        raw = logits
        if needs_history(params):  # bias, min_tokens, penalties: greedy rows take the argmax after them
            logits = logits_processors.adjust(logits.float(), params, history)
        processed: torch.Tensor | None = None
        if all(p.greedy for p in params):
            chosen = logits.argmax(dim=-1)
            processed = None if logits is raw else logits
        else:
            processed = self._process(logits, params)
            chosen = self._sample(logits, processed, params, positions, seeds)
        if not any(p.wants_logprobs for p in params):
            return SamplerOutput(token_ids=chosen.tolist(), logprobs=None)
        source = raw if processed is None or self.logprobs_mode == "raw_logprobs" else processed
        lp = torch.log_softmax(source.float(), dim=-1).clamp_(min=LOGPROB_FLOOR)
        chosen_lp = lp.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
        k = max(p.top_logprobs for p in params)
        top: list[TopLogprobs] | None = None
        if k:
            values, ids = lp.topk(min(k, lp.shape[1]), dim=-1)
            vals, idl = values.tolist(), ids.tolist()
            top = [list(zip(idl[r][: p.top_logprobs], vals[r][: p.top_logprobs], strict=True))
                   for r, p in enumerate(params)]
        return SamplerOutput(token_ids=chosen.tolist(), logprobs=chosen_lp, top_logprobs=top)

    @staticmethod
    def _process(logits: torch.Tensor, params: Seq[SamplingParams]) -> torch.Tensor:
        """The logits each row samples from: scaled by temperature, cut by min_p, top-k and top-p (greedy rows: as
        given)."""
        device = logits.device
        logits = logits.float()
        temps = torch.tensor([max(p.temperature, MIN_SAMPLED_TEMPERATURE) if not p.greedy else 1.0 for p in params],
                             device=device)
        scaled = logits_processors.min_p_cut(logits / temps.unsqueeze(1), params)
        vocab = scaled.shape[1]
        top_ks = [p.top_k if 0 < p.top_k < vocab and not p.greedy else vocab for p in params]
        top_ps = [1.0 if p.greedy else p.top_p for p in params]
        if any(k < vocab for k in top_ks) or any(p < 1.0 for p in top_ps):
            sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True)
            ranks = torch.arange(vocab, device=device).unsqueeze(0)
            remove = ranks >= torch.tensor(top_ks, device=device).unsqueeze(1)
            probs_sorted = sorted_logits.softmax(dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
            mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
            remove |= mass_before >= torch.tensor(top_ps, device=device).unsqueeze(1)
            sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
            scaled = torch.full_like(scaled, float("-inf")).scatter(1, sorted_idx, sorted_logits)
        return scaled

    @staticmethod
    def _sample(logits: torch.Tensor, processed: torch.Tensor, params: Seq[SamplingParams], positions: Seq[int],
                seeds: Seq[int | None]) -> torch.Tensor:
        device = logits.device
        vocab = processed.shape[1]
        greedy_ids = logits.argmax(dim=-1)
        probs = processed.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_()
        for row, p in enumerate(params):
            seed = seeds[row]
            if seed is not None and not p.greedy:
                gen = torch.Generator(device=device).manual_seed((seed * 1_000_003 + positions[row]) % (2**63))
                noise[row] = torch.empty(vocab, device=device).exponential_(generator=gen)
        sampled = (probs / noise).argmax(dim=-1)
        is_greedy = torch.tensor([p.greedy for p in params], device=device)
        return torch.where(is_greedy, greedy_ids, sampled)
