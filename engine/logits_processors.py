"""vLLM's per-request logits processors, on the device, in vLLM's order (its v1 sampler):

1. `logit_bias`: each listed token's logit plus its bias (OpenAI's; transformers' `SequenceBiasLogitsProcessor` with
   one-token sequences).
2. `min_tokens`: while a sequence has fewer output tokens, its stop tokens (the model's EOS unless `ignore_eos`, and
   `stop_token_ids`) get -inf (transformers' `MinNewTokensLengthLogitsProcessor`).
3. Penalties: `repetition_penalty` over the tokens of the prompt and the output (a positive logit divided by it, a
   negative one multiplied: transformers' `RepetitionPenaltyLogitsProcessor`); then OpenAI's `frequency_penalty`
   (times each token's count in the output) and `presence_penalty` (once for each token in the output) subtracted.

Greedy rows take the argmax after these; sampled rows go on to temperature, then `min_p` (tokens less likely than
min_p times the most likely one are cut: transformers' `MinPLogitsWarper`), then top-k and top-p (`sampler.py`).
Rows that ask for none of this are not touched, and a batch where none asks costs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from npuserve.engine.sequence import SamplingParams

# (prompt token ids, output token ids) of the sequence each row samples for
History = tuple[Seq[int], Seq[int]]


def needs_history(params: Seq[SamplingParams]) -> bool:
    """Whether any row's processors read its tokens (the runner then passes them)."""
    return any(p.adjusts_logits for p in params)


def adjust(logits: torch.Tensor, params: Seq[SamplingParams], history: Seq[History] | None) -> torch.Tensor:
    """Steps 1-3 over float32 logits (rows, vocab); returns them (a new tensor when any row changed)."""
    rows = [r for r, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits
    if history is None:
        raise ValueError("logits processors need each row's prompt and output tokens")
    logits = logits.clone()
    device, vocab = logits.device, logits.shape[1]
    for r in rows:
        p = params[r]
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], device=device)
            logits[r].index_add_(0, ids, torch.tensor([b for _, b in p.logit_bias], device=device))
        if p.min_tokens and len(history[r][1]) < p.min_tokens:
            stops = [t for t in p.min_tokens_stop_ids if 0 <= t < vocab]
            if stops:
                logits[r, torch.tensor(stops, device=device)] = float("-inf")
    penalised = [r for r in rows if has_penalty(params[r])]
    if penalised:
        logits[penalised] = _penalties(logits[penalised], [params[r] for r in penalised],
                                       [history[r] for r in penalised])
    return logits


def has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _counts(token_lists: Seq[Seq[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """(rows, vocab) counts of each token in each list, by one scatter_add over a padded tensor."""
    width = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    if width:
        padded = torch.full((len(token_lists), width), vocab, dtype=torch.long)  # pad: a column past the vocab
        for i, tokens in enumerate(token_lists):
            if tokens:
                padded[i, : len(tokens)] = torch.as_tensor(list(tokens), dtype=torch.long)
        padded = padded.to(device)
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab]


def _penalties(logits: torch.Tensor, params: Seq[SamplingParams], history: Seq[History]) -> torch.Tensor:
    device, vocab = logits.device, logits.shape[1]
    output_counts = _counts([h[1] for h in history], vocab, device)
    seen_in_output = output_counts > 0
    repetition = torch.tensor([p.repetition_penalty for p in params], device=device).unsqueeze(1)
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = seen_in_output | (_counts([h[0] for h in history], vocab, device) > 0)
        # A penalty too small for float32 (the API takes any > 0) is its smallest normal, not 0, and what overflows
        # is its largest finite value: -inf * 0 and softmax over +inf are NaN, which no client can be sent.
        finfo = torch.finfo(logits.dtype)
        penalty = torch.where(seen, repetition.clamp(min=finfo.tiny), torch.ones_like(repetition))
        logits = torch.where(logits > 0, logits / penalty, logits * penalty).clamp(max=finfo.max)
    frequency = torch.tensor([p.frequency_penalty for p in params], device=device).unsqueeze(1)
    presence = torch.tensor([p.presence_penalty for p in params], device=device).unsqueeze(1)
    return logits - frequency * output_counts - presence * seen_in_output.to(logits.dtype)


def min_p_cut(scaled: torch.Tensor, params: Seq[SamplingParams]) -> torch.Tensor:
    """Sampled rows with min_p > 0: tokens whose probability is below min_p x the most likely one's get -inf."""
    if not any(p.min_p > 0.0 and not p.greedy for p in params):
        return scaled
    min_p = torch.tensor([p.min_p if not p.greedy else 0.0 for p in params], device=scaled.device).unsqueeze(1)
    probs = scaled.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p
    return scaled.masked_fill(probs < threshold, float("-inf"))
