"""What rank 0 tells the other ranks before each runner operation, as two int64 tensors broadcast on the host's
gloo group: a fixed-size header (the operation and the length of each segment) and one payload (the segments
end to end). No Python object is pickled per step: the segments are lists of ints.

Operations: FORWARD (the batch as a delta against every rank's mirror of the rows, `batch_delta.py`, plus the
hidden-state rows whose logits the prompt-logprob pass computes), SWAP (device<->host block pairs), COPY (device
block pairs), CAPTURE (decode graphs at warm-up), STOP.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from itertools import chain

import torch
import torch.distributed as dist

from npuserve.engine.parallel.batch_delta import BatchDelta, BatchKind

HEADER_SIZE = 16  # ints: op, segment count, then each segment's length (a forward has 11 segments)


class Op(enum.IntEnum):
    FORWARD = 1
    SWAP = 2
    COPY = 3
    CAPTURE = 4
    STOP = 5


@dataclass(slots=True)
class StepMessage:
    op: Op
    delta: BatchDelta | None = None  # FORWARD
    logit_rows: list[tuple[int, int]] = field(default_factory=list)  # hidden rows [lo, hi) for prompt logprobs
    pairs: list[tuple[int, int]] = field(default_factory=list)  # SWAP: out pairs; COPY: the pairs
    pairs_in: list[tuple[int, int]] = field(default_factory=list)  # SWAP: in pairs


def _flat_pairs(pairs: Seq[tuple[int, int]]) -> list[int]:
    return [i for pair in pairs for i in pair]


def segments(msg: StepMessage) -> list[list[int]]:
    """The message's payload, as lists of ints (the header carries their lengths)."""
    if msg.op is Op.FORWARD:
        assert msg.delta is not None
        d = msg.delta  # in BatchDelta's field order, which `decode` relies on
        return [[int(d.kind)], d.seq_ids, d.num_token_ids, d.num_block_ids, d.token_ids, d.block_ids, d.fresh,
                d.num_cached_tokens, d.num_new_tokens, d.dropped, _flat_pairs(msg.logit_rows)]
    if msg.op is Op.SWAP:
        return [_flat_pairs(msg.pairs), _flat_pairs(msg.pairs_in)]
    if msg.op is Op.COPY:
        return [_flat_pairs(msg.pairs)]
    return []


def encode(msg: StepMessage) -> tuple[list[int], torch.Tensor]:
    """The segments' lengths and the payload, one int64 tensor (one conversion, not one per segment)."""
    parts = segments(msg)
    return [len(p) for p in parts], torch.tensor(list(chain.from_iterable(parts)), dtype=torch.int64)


def _pairs(flat: list[int]) -> list[tuple[int, int]]:
    return list(zip(flat[0::2], flat[1::2], strict=True))


def decode(op: Op, lengths: Seq[int], payload: torch.Tensor) -> StepMessage:
    flat: list[int] = payload.tolist()
    parts: list[list[int]] = []
    start = 0
    for n in lengths:
        parts.append(flat[start : start + n])
        start += n
    if op is Op.FORWARD:
        kind, seq_ids, num_token_ids, num_block_ids, token_ids, block_ids, fresh, cached, chunks, dropped, rows = parts
        delta = BatchDelta(BatchKind(kind[0]), seq_ids, num_token_ids, num_block_ids, token_ids, block_ids, fresh,
                           cached, chunks, dropped)
        return StepMessage(op, delta=delta, logit_rows=_pairs(rows))
    if op is Op.SWAP:
        return StepMessage(op, pairs=_pairs(parts[0]), pairs_in=_pairs(parts[1]))
    if op is Op.COPY:
        return StepMessage(op, pairs=_pairs(parts[0]))
    return StepMessage(op)


class StepChannel:
    """Rank 0's `send` and the other ranks' `receive` of step messages over the host group `control`."""

    def __init__(self, control: dist.ProcessGroup | None) -> None:
        self.control = control

    def send(self, msg: StepMessage) -> None:
        lengths, payload = encode(msg)
        if len(lengths) + 2 > HEADER_SIZE:
            raise ValueError(f"a step message of {len(lengths)} segments does not fit the header")
        header = torch.tensor([int(msg.op), len(lengths), *lengths, *[0] * (HEADER_SIZE - 2 - len(lengths))],
                              dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.control)
        if payload.numel():
            dist.broadcast(payload, src=0, group=self.control)

    def receive(self) -> StepMessage:
        header = torch.zeros(HEADER_SIZE, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.control)
        op, count = Op(int(header[0])), int(header[1])
        lengths = header[2 : 2 + count].tolist()
        payload = torch.empty(sum(lengths), dtype=torch.int64)
        if payload.numel():
            dist.broadcast(payload, src=0, group=self.control)
        return decode(op, lengths, payload)
