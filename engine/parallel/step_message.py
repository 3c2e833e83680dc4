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

import torch
import torch.distributed as dist

from npuserve.engine.parallel.batch_delta import BatchDelta, BatchKind

HEADER_SIZE = 64  # ints: op, segment count, then each segment's length


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


def _ints(values: Seq[int] | Seq[tuple[int, int]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).reshape(-1)


def encode(msg: StepMessage) -> list[torch.Tensor]:
    if msg.op is Op.FORWARD:
        assert msg.delta is not None
        d = msg.delta
        return [_ints([int(d.kind)]), _ints(d.seq_ids), _ints(d.num_token_ids), _ints(d.num_block_ids),
                _ints(d.token_ids), _ints(d.block_ids), _ints(d.fresh), _ints(d.num_cached_tokens),
                _ints(d.num_new_tokens), _ints(d.dropped), _ints(msg.logit_rows)]
    if msg.op is Op.SWAP:
        return [_ints(msg.pairs), _ints(msg.pairs_in)]
    if msg.op is Op.COPY:
        return [_ints(msg.pairs)]
    return []


def _pairs(t: torch.Tensor) -> list[tuple[int, int]]:
    flat = t.tolist()
    return list(zip(flat[0::2], flat[1::2], strict=True))


def decode(op: Op, segments: list[torch.Tensor]) -> StepMessage:
    if op is Op.FORWARD:
        kind, *lists = (s.tolist() for s in segments[:-1])
        delta = BatchDelta(BatchKind(kind[0]), *lists)
        return StepMessage(op, delta=delta, logit_rows=_pairs(segments[-1]))
    if op is Op.SWAP:
        return StepMessage(op, pairs=_pairs(segments[0]), pairs_in=_pairs(segments[1]))
    if op is Op.COPY:
        return StepMessage(op, pairs=_pairs(segments[0]))
    return StepMessage(op)


class StepChannel:
    """Rank 0's `send` and the other ranks' `receive` of step messages over the host group `control`."""

    def __init__(self, control: dist.ProcessGroup | None) -> None:
        self.control = control

    def send(self, msg: StepMessage) -> None:
        segments = encode(msg)
        if len(segments) + 2 > HEADER_SIZE:
            raise ValueError(f"a step message of {len(segments)} segments does not fit the header")
        header = torch.zeros(HEADER_SIZE, dtype=torch.int64)
        header[0], header[1] = int(msg.op), len(segments)
        header[2 : 2 + len(segments)] = torch.tensor([s.numel() for s in segments], dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.control)
        if segments and header[2 : 2 + len(segments)].sum() > 0:
            dist.broadcast(torch.cat(segments), src=0, group=self.control)

    def receive(self) -> StepMessage:
        header = torch.zeros(HEADER_SIZE, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.control)
        op, count = Op(int(header[0])), int(header[1])
        lengths = header[2 : 2 + count].tolist()
        payload = torch.empty(sum(lengths), dtype=torch.int64)
        if sum(lengths) > 0:
            dist.broadcast(payload, src=0, group=self.control)
        return decode(op, list(torch.split(payload, lengths)))
