"""Sampling on the device: only the chosen ids (and, when asked, their logprobs) leave it.

An all-greedy batch is one fused argmax. Otherwise each row is scaled by its temperature, cut by its top-k and
top-p, and drawn with the exponential-race trick (`argmax(p / E)`, E ~ Exp(1), is a draw from p) so the whole
batch samples in one pass; rows with a per-request seed draw their noise from a generator seeded by
(seed, position), so a seeded request gives the same tokens whatever batch it runs in. Greedy rows inside a mixed
batch are still argmax. Logprobs are those of the chosen token under the model's raw distribution (as vLLM).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from npuserve.engine.sequence import SamplingParams


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float] | None  # None when no request of the batch asked for them


class Sampler:
    def __call__(
        self, logits: torch.Tensor, params: Seq[SamplingParams], positions: Seq[int]
    ) -> SamplerOutput:
        """logits: (batch, vocab); positions: each row's token index (for seeded noise)."""
        chosen = logits.argmax(dim=-1) if all(p.greedy for p in params) else self._sample(logits, params, positions)
        logprobs: list[float] | None = None
        if any(p.logprobs for p in params):
            lp = torch.log_softmax(logits.float(), dim=-1).gather(1, chosen.unsqueeze(1)).squeeze(1)
            logprobs = lp.tolist()
        return SamplerOutput(token_ids=chosen.tolist(), logprobs=logprobs)

    @staticmethod
    def _sample(logits: torch.Tensor, params: Seq[SamplingParams], positions: Seq[int]) -> torch.Tensor:
        device = logits.device
        logits = logits.float()
        greedy_ids = logits.argmax(dim=-1)
        temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=device)
        scaled = logits / temps.unsqueeze(1)
        vocab = scaled.shape[1]
        top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_ps = [p.top_p for p in params]
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
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_()
        for row, p in enumerate(params):
            if p.seed is not None and not p.greedy:
                gen = torch.Generator(device=device).manual_seed((p.seed * 1_000_003 + positions[row]) % (2**63))
                noise[row] = torch.empty(vocab, device=device).exponential_(generator=gen)
        sampled = (probs / noise).argmax(dim=-1)
        is_greedy = torch.tensor([p.greedy for p in params], device=device)
        return torch.where(is_greedy, greedy_ids, sampled)
