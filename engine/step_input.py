"""What the model runner takes for one step: tensors and plain per-row values, built on the scheduler's side
(`step_builder.py`) from the scheduled sequences. The runner never sees a `Sequence` or a grammar.

Rows: the batch has one logits row per scheduled sequence (its last computed token); a sequence that forks at this
prefill (n > 1) is sampled once per choice from that row (`sample_rows`), so the per-row sampling values have one
entry per sampled row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from npuserve.engine.batch import FlatBatch
from npuserve.engine.logits_processors import History
from npuserve.engine.parallel.batch_delta import BatchDelta
from npuserve.engine.sequence import SamplingParams


@dataclass(frozen=True, slots=True)
class PromptLogprobChunk:
    """Hidden rows `row_lo..row_hi-1` of sequence `seq_id`, whose logits predict the prompt tokens `targets`; the
    `top_k` most likely tokens are reported at each."""

    seq_id: int
    top_k: int
    targets: list[int]
    row_lo: int
    row_hi: int


@dataclass(slots=True)
class StepInput:
    batch: FlatBatch
    params: list[SamplingParams]  # per sampled row
    positions: list[int]  # per sampled row: the index of the token it samples (seeded noise)
    seeds: list[int | None]  # per sampled row
    sample_rows: list[int] | None = None  # the logits row of each sampled row; None: row i samples logits row i
    history: list[History] | None = None  # per sampled row, when a logits processor reads its tokens
    guided_rows: list[int] = field(default_factory=list)  # logits rows a grammar masks
    guided_bitmask: torch.Tensor | None = None  # (len(guided_rows), ceil(vocab / 32)) int32: the allowed tokens
    prompt_logprob_chunks: list[PromptLogprobChunk] = field(default_factory=list)
    prompt_logprob_seq_ids: list[int] = field(default_factory=list)  # those that get prompt logprobs (maybe none)
    # Block moves before the forward, in this order: the last step's fork copies (device -> device), then the swaps
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # device block -> host block
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # host block -> device block
    delta: BatchDelta | None = None  # tensor parallel: `batch` as the other ranks rebuild it (parallel/batch_delta.py)

    @property
    def computes_prompt(self) -> bool:
        """Whether any sequence asked for prompt logprobs this step."""
        return bool(self.prompt_logprob_seq_ids)
