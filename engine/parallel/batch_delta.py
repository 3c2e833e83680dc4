"""Tensor parallel's forward as a delta: every rank keeps a mirror of the batch's rows (each scheduled sequence's
tokens and block table, keyed by its id), rank 0 sends what changed since the last step, and every rank, rank 0
included, applies it and builds the flat batch from its mirror with the same builder (`batch.py`), so no rank can
build another batch than rank 0's.

What travels: a sequence the mirror lacks, whole (its tokens and block table); one it holds, as the tokens and the
blocks appended since (a decode: its one new token, and a block when it crosses into one); the ids of those no
longer running (finished, preempted, swapped out), to drop. Each row's cached-token count travels with prefill and
mixed steps (a decode's is its token count less one). Rank 0 checks what the mirror holds against the sequence
before it sends a delta: a block table that is not the mirror's plus new blocks (a swap-in, a recompute that got
other blocks) sends the row whole again, so a missed event costs bytes, never a wrong batch. A sequence's tokens
only grow (a fork is a new sequence), so the mirror's are always a prefix of its own.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from npuserve.engine.batch import BatchRow, FlatBatch, build_decode, build_prefill
from npuserve.engine.sequence import SequenceStatus


class BatchKind(enum.IntEnum):
    DECODE = 0
    PREFILL = 1  # whole prompts (from their cached tokens)
    MIXED = 2  # chunked prefill: `num_new_tokens` per row


@dataclass(slots=True)
class MirrorRow:
    """What a rank knows of one sequence (a `BatchRow`)."""

    seq_id: int
    token_ids: list[int]
    block_table: list[int]
    num_cached_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class BatchDelta:
    """One forward step as the changes to the mirror, then the rows to run, in batch order."""

    kind: BatchKind
    seq_ids: list[int]  # the batch's rows
    num_token_ids: list[int]  # per row: token ids appended (or, for a fresh row, all of them)
    num_block_ids: list[int]  # per row: blocks appended (or the whole table)
    token_ids: list[int]  # the rows' token ids, end to end
    block_ids: list[int]  # the rows' block ids, end to end
    fresh: list[int] = field(default_factory=list)  # rows (indices) sent whole: they replace the mirror's
    num_cached_tokens: list[int] = field(default_factory=list)  # per row; empty for a decode
    num_new_tokens: list[int] = field(default_factory=list)  # MIXED: per row tokens computed
    dropped: list[int] = field(default_factory=list)  # sequence ids the mirror forgets first


class BatchMirror:
    """Every rank's copy of the rows, and the one way a rank turns a delta into its flat batch."""

    def __init__(self) -> None:
        self.rows: dict[int, MirrorRow] = {}

    def apply(self, delta: BatchDelta) -> list[MirrorRow]:
        """The mirror after `delta`; returns the batch's rows in order."""
        for seq_id in delta.dropped:
            self.rows.pop(seq_id, None)
        fresh = set(delta.fresh)
        rows: list[MirrorRow] = []
        cached = delta.num_cached_tokens
        t = b = 0
        for i, seq_id in enumerate(delta.seq_ids):
            nt, nb = delta.num_token_ids[i], delta.num_block_ids[i]
            row = self.rows.get(seq_id)
            if i in fresh:
                row = self.rows[seq_id] = MirrorRow(seq_id, delta.token_ids[t : t + nt], delta.block_ids[b : b + nb])
            elif row is None:
                raise ValueError(f"step delta: sequence {seq_id} is not in this rank's mirror")
            else:
                row.token_ids += delta.token_ids[t : t + nt]
                if nb:
                    row.block_table += delta.block_ids[b : b + nb]
            t, b = t + nt, b + nb
            row.num_cached_tokens = cached[i] if cached else len(row.token_ids) - 1
            rows.append(row)
        return rows

    def build(self, delta: BatchDelta, block_size: int, device: torch.device) -> FlatBatch:
        """Applies `delta`, then builds the step's flat batch from the mirror's rows."""
        rows = self.apply(delta)
        if delta.kind is BatchKind.DECODE:
            return build_decode(rows, block_size, device)
        return build_prefill(rows, block_size, device, delta.num_new_tokens or None)


class DeltaSender:
    """Rank 0's side: the delta that brings the mirror (every rank's, its own included) to the scheduled rows."""

    def __init__(self) -> None:
        self.mirror = BatchMirror()
        self._sources: dict[int, BatchRow] = {}  # what each mirror row was last built from

    def delta(self, seqs: Seq[BatchRow], kind: BatchKind, num_new_tokens: Seq[int] | None = None) -> BatchDelta:
        seq_ids = [s.seq_id for s in seqs]
        scheduled = set(seq_ids)
        if len(scheduled) != len(seq_ids):
            raise ValueError(f"a step's rows must have distinct sequence ids, got {seq_ids}")
        # Those no longer running; rows without a status (the warm-up's scratch rows) go once unscheduled
        dropped = [seq_id for seq_id in self._sources.keys() - scheduled
                   if getattr(self._sources[seq_id], "status", None) is not SequenceStatus.RUNNING]
        for seq_id in dropped:
            del self._sources[seq_id]
        d = BatchDelta(kind, seq_ids, [], [], [], [], dropped=dropped, num_new_tokens=list(num_new_tokens or []))
        mirror, sources = self.mirror.rows, self._sources
        for i, seq in enumerate(seqs):
            sources[seq.seq_id] = seq
            row = mirror.get(seq.seq_id)
            table = seq.block_table
            if row is None or len(row.token_ids) > seq.num_tokens or \
                    table[: len(row.block_table)] != row.block_table:
                d.fresh.append(i)
                new_tokens, new_blocks = seq.token_ids, table
            else:
                new_tokens, new_blocks = seq.token_ids[len(row.token_ids) :], table[len(row.block_table) :]
            d.num_token_ids.append(len(new_tokens))
            d.num_block_ids.append(len(new_blocks))
            d.token_ids += new_tokens
            d.block_ids += new_blocks
        if kind is not BatchKind.DECODE:
            d.num_cached_tokens = [s.num_cached_tokens for s in seqs]
        return d

    def build(self, seqs: Seq[BatchRow], kind: BatchKind, block_size: int, device: torch.device,
              num_new_tokens: Seq[int] | None = None) -> tuple[BatchDelta, FlatBatch]:
        """The step's delta (to send) and rank 0's flat batch, built from its mirror as the other ranks build it."""
        delta = self.delta(seqs, kind, num_new_tokens)
        return delta, self.mirror.build(delta, block_size, device)
