"""What one scheduler step decides (`SchedulerOutput`, the step's input) and what the scheduler made of the step's
results (`StepOutcome`). The step goes one way: `schedule()` -> the runner -> `update_from_output()`; nothing
writes a SchedulerOutput after `schedule()` returns."""

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
class StepDraft:
    """The scheduler's step while `schedule()` builds it; frozen into a `SchedulerOutput` at its end."""

    kind: StepKind
    seqs: list[Sequence] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_prefill_seqs: int = 0

    def freeze(self) -> SchedulerOutput:
        return SchedulerOutput(self.kind, self.seqs, self.block_copies, self.swap_in, self.swap_out, self.preempted,
                               self.finished, self.num_new_tokens, self.num_prefill_seqs)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One step: the runner's input, never written after `schedule()` returns (frozen; the engine and the
    scheduler's `update_from_output` only read it).

    PREFILL: for each sequence, compute tokens `num_cached_tokens .. num_tokens - 1` (prefix-cache hits are
    skipped); its `block_table` already covers all `num_tokens`. DECODE: each sequence computes its last token;
    its `block_table` covers `num_tokens`. MIXED: each sequence computes `num_new_tokens[i]` tokens from
    `num_cached_tokens` on (1 for a decode; a prompt chunk otherwise; a chunk that does not reach the last token
    samples nothing). Before running the model the runner copies `block_copies` (device -> device: the forks of
    the previous step, copied before any swap or forward can reuse their blocks), then `swap_out` (device block ->
    host block) and then `swap_in` (host block -> device block).
    """

    kind: StepKind
    seqs: list[Sequence] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # forks of the last step: parent -> child
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)  # recomputed: back to waiting, blocks freed
    finished: list[Sequence] = field(default_factory=list)  # ended by this step's scheduling (aborts, errors)
    num_new_tokens: list[int] = field(default_factory=list)  # MIXED only: tokens each sequence computes
    num_prefill_seqs: int = 0  # MIXED only: sequences computing a prompt chunk (the rest decode)

    @property
    def num_batched_tokens(self) -> int:
        """The tokens the step computes (read before `update_from_output`, which marks them cached)."""
        if self.kind is StepKind.MIXED:
            return sum(self.num_new_tokens)
        if self.kind is StepKind.PREFILL:
            return sum(s.num_tokens - s.num_cached_tokens for s in self.seqs)
        return len(self.seqs)

    @property
    def has_device_work(self) -> bool:
        """Whether the runner has anything to do: a forward, or block copies and swaps on their own."""
        return bool(self.seqs or self.block_copies or self.swap_in or self.swap_out)


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """What `update_from_output` made of a step's results: the engine reports from it, and writes nothing."""

    stepped: list[Sequence]  # the step's sequences and the children forked from them, finished or not
    finished: list[Sequence]  # those that ended (a length, a stop token, a completed grammar)
    forked: list[tuple[Sequence, Sequence]]  # (parent, child): the children the step's prefills forked
    block_copies: list[tuple[int, int]]  # the forks' device block copies: they run first in the next step
    sampled_by: list[Sequence | None]  # per sampled row, the sequence that kept its token (None: not kept)
