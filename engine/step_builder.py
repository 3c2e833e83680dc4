"""The scheduler's side of a step: the scheduled sequences -> the runner's `StepInput` (tensors and plain values).

Reads each sequence's tokens, block table and cached-token count (the flat batch, `batch.py`), its sampling
parameters, seeds and, when a logits processor needs them, its tokens; fills the grammar's bitmask rows of the
guided sequences (`guided_mask.py`; a prompt chunk short of its last token samples nothing, so it gets none); and
lays out the prompt-logprob chunks. Runs on the step thread, which alone touches the sequences.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from npuserve.engine.batch import FlatBatch, build_decode, build_prefill
from npuserve.engine.guided import Guide
from npuserve.engine.guided_mask import GuidedMasker
from npuserve.engine.logits_processors import needs_history
from npuserve.engine.parallel.batch_delta import BatchDelta, BatchKind, DeltaSender
from npuserve.engine.sequence import SamplingParams, Sequence
from npuserve.engine.step_input import PromptLogprobChunk, StepInput

PROMPT_LOGITS_CHUNK = 512  # prompt positions whose logits are materialised at once (rows x vocab floats)


class StepBuilder:
    def __init__(self, block_size: int, device: torch.device, vocab_size: int,
                 delta_sender: DeltaSender | None = None) -> None:
        """`delta_sender` (tensor parallel's rank 0): the batch is built from the ranks' mirror, with its delta."""
        self.block_size = block_size
        self.device = device
        self.delta_sender = delta_sender
        self.vocab_size = vocab_size
        self.guided_masker = GuidedMasker()

    def build(self, seqs: Seq[Sequence], *, is_prefill: bool, num_new_tokens: Seq[int] | None = None,
              block_copies: Seq[tuple[int, int]] = (), swap_out: Seq[tuple[int, int]] = (),
              swap_in: Seq[tuple[int, int]] = ()) -> StepInput:
        """`is_prefill`: the sequences compute their prompts (whole); `num_new_tokens`: a chunked step's tokens per
        sequence (decodes and prompt chunks); neither: a decode step. `block_copies`, `swap_out`, `swap_in`: the
        block moves the runner makes first, in that order (the scheduler's output)."""
        delta: BatchDelta | None = None
        if self.delta_sender is not None:
            kind = BatchKind.MIXED if num_new_tokens is not None else BatchKind.PREFILL if is_prefill else \
                BatchKind.DECODE
            delta, batch = self.delta_sender.build(seqs, kind, self.block_size, self.device, num_new_tokens)
        elif num_new_tokens is not None:
            batch = build_prefill(seqs, self.block_size, self.device, num_new_tokens)
        elif is_prefill:
            batch = build_prefill(seqs, self.block_size, self.device)
        else:
            batch = build_decode(seqs, self.block_size, self.device)
        rows = [i for i, s in enumerate(seqs) for _ in range(s.num_samples)]
        params: list[SamplingParams] = []
        positions: list[int] = []
        seeds: list[int | None] = []
        for s in seqs:
            for j in range(s.num_samples):
                params.append(s.sampling)
                positions.append(s.num_tokens)
                seeds.append(s.sample_seed(s.index + j))
        step = StepInput(batch, params, positions, seeds, sample_rows=rows if len(rows) != len(seqs) else None,
                         block_copies=list(block_copies), swap_out=list(swap_out), swap_in=list(swap_in), delta=delta)
        if needs_history(params):  # penalties, min_tokens, logit_bias read each row's tokens
            step.history = [(seqs[i].prompt_token_ids, seqs[i].output_token_ids) for i in rows]
        guided: list[tuple[int, Guide]] = [
            (i, s.guide) for i, s in enumerate(seqs) if s.guide is not None
            and (num_new_tokens is None or s.num_cached_tokens + num_new_tokens[i] >= s.num_tokens)]
        if guided:
            step.guided_rows = [i for i, _ in guided]
            step.guided_bitmask = self.guided_masker.fill([g for _, g in guided], self.vocab_size)
        if is_prefill or num_new_tokens is not None:
            _add_prompt_logprobs(step, seqs, batch, num_new_tokens)
        return step


def _add_prompt_logprobs(step: StepInput, seqs: Seq[Sequence], batch: FlatBatch,
                         num_new_tokens: Seq[int] | None) -> None:
    """The prompt positions this step computes logprobs for, in chunks of at most `PROMPT_LOGITS_CHUNK`: of each
    sequence that asks, the positions of this step's rows after those it already has (a recompute keeps them)."""
    for i, s in enumerate(seqs):
        k = s.sampling.prompt_logprobs
        if k is None:
            continue
        first = s.num_cached_tokens  # the position of this step's first row
        known = len(s.prompt_logprobs or [])  # positions 0..known-1 are done
        if known < first:
            continue  # cannot happen: prompt logprobs turn prefix-cache hits off
        step.prompt_logprob_seq_ids.append(s.seq_id)
        end = first + (num_new_tokens[i] if num_new_tokens is not None else s.num_tokens - first)
        lo_pos, hi_pos = max(first, known), min(end, s.num_prompt_tokens - 1)
        start = batch.meta.query_start[i] - first
        for lo in range(lo_pos, hi_pos, PROMPT_LOGITS_CHUNK):
            hi = min(hi_pos, lo + PROMPT_LOGITS_CHUNK)
            step.prompt_logprob_chunks.append(PromptLogprobChunk(
                s.seq_id, k, s.prompt_token_ids[lo + 1 : hi + 1], start + lo, start + hi))
