"""What one scheduler step decides; the engine turns it into a model-runner call."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ..sequence import Sequence


class StepKind(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"  # chunked prefill: decodes and prompt chunks in one step (MindIE's SplitFuse)
    IDLE = "idle"  # nothing to run (empty, or waiting for maxQueueDelayMicroseconds)


@dataclass(slots=True)
class SchedulerOutput:
    """One step.

    PREFILL: for each sequence, compute tokens `num_cached_tokens .. num_tokens - 1` (prefix-cache hits are
    skipped); its `block_table` already covers all `num_tokens`. DECODE: each sequence computes its last token;
    its `block_table` covers `num_tokens`. MIXED: each sequence computes `num_new_tokens[i]` tokens from
    `num_cached_tokens` on (1 for a decode; a prompt chunk otherwise; a chunk that does not reach the last token
    samples nothing). Before running the model the engine copies `swap_out` (device block -> host block) and then
    `swap_in` (host block -> device block).
    """

    kind: StepKind
    seqs: list[Sequence] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)  # recomputed: back to waiting, blocks freed
    finished: list[Sequence] = field(default_factory=list)  # ended by this step's scheduling (aborts, errors)
    # Filled by `Scheduler.update` after a prefill that forked (n > 1): (parent, child) pairs, and the device
    # block copies (parent block -> child block) the engine runs before the next step.
    forked: list[tuple[Sequence, Sequence]] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Filled by `Scheduler.update`: per sampled row, the sequence that took its token (None: a prompt chunk short
    # of its end, or a request that ended meanwhile), so nothing downstream redoes the row accounting.
    sampled_by: list[Sequence | None] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # MIXED only: tokens each sequence computes
    num_prefill_seqs: int = 0  # MIXED only: sequences computing a prompt chunk (the rest decode)

    @property
    def num_batched_tokens(self) -> int:
        if self.kind is StepKind.MIXED:
            return sum(self.num_new_tokens)
        if self.kind is StepKind.PREFILL:
            return sum(s.num_tokens - s.num_cached_tokens for s in self.seqs)
        return len(self.seqs)
