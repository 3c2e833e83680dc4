"""What rank 0 tells the other ranks before each runner operation, as two int64 tensors broadcast on the host's
gloo group: a fixed-size header (the operation and the length of each segment) and one payload (the segments
end to end). No Python object is pickled per step: the flat batch is tensors already, and it travels as them.

Operations: FORWARD (a flat batch, plus the hidden-state rows whose logits the prompt-logprob pass computes),
SWAP (device<->host block pairs), COPY (device block pairs), CAPTURE (decode graphs at warm-up), STOP.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from npuserve.engine.backends.base import AttentionMetadata
from npuserve.engine.batch import FlatBatch

HEADER_SIZE = 64  # ints: op, segment count, then each segment's length
_META_SEGMENTS = 6


class Op(enum.IntEnum):
    FORWARD = 1
    SWAP = 2
    COPY = 3
    CAPTURE = 4
    STOP = 5


@dataclass(slots=True)
class StepMessage:
    op: Op
    batch: FlatBatch | None = None
    logit_rows: list[tuple[int, int]] = field(default_factory=list)  # hidden rows [lo, hi) for prompt logprobs
    pairs: list[tuple[int, int]] = field(default_factory=list)  # SWAP: out pairs; COPY: the pairs
    pairs_in: list[tuple[int, int]] = field(default_factory=list)  # SWAP: in pairs


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).to("cpu", torch.int64)


def _ints(values: Seq[int] | Seq[tuple[int, int]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).reshape(-1)


def _meta_segments(meta: AttentionMetadata) -> list[torch.Tensor]:
    scalars = [int(meta.is_prefill), meta.max_query_len, meta.max_context_len, meta.block_tables.shape[1]]
    return [_ints(scalars), _host(meta.slot_mapping), _host(meta.block_tables), _host(meta.context_lens),
            _host(meta.query_lens), _ints(meta.query_start)]


def encode(msg: StepMessage) -> list[torch.Tensor]:
    if msg.op is Op.FORWARD:
        assert msg.batch is not None
        b = msg.batch
        segments = [_host(b.input_ids), _host(b.positions), _host(b.logits_indices), _ints(msg.logit_rows)]
        segments += _meta_segments(b.meta)
        if b.meta.decode_part is not None and b.meta.prefill_part is not None:
            segments += _meta_segments(b.meta.decode_part) + _meta_segments(b.meta.prefill_part)
        return segments
    if msg.op is Op.SWAP:
        return [_ints(msg.pairs), _ints(msg.pairs_in)]
    if msg.op is Op.COPY:
        return [_ints(msg.pairs)]
    return []


def _meta_from(segments: list[torch.Tensor], device: torch.device) -> AttentionMetadata:
    is_prefill, max_query_len, max_context_len, width = segments[0].tolist()
    return AttentionMetadata(
        is_prefill=bool(is_prefill),
        slot_mapping=segments[1].to(device),
        block_tables=segments[2].view(-1, width).to(device),
        context_lens=segments[3].to(device),
        query_lens=segments[4].to(device),
        query_start=segments[5].tolist(),
        max_query_len=max_query_len,
        max_context_len=max_context_len,
        cache={},
    )


def _pairs(t: torch.Tensor) -> list[tuple[int, int]]:
    flat = t.tolist()
    return list(zip(flat[0::2], flat[1::2], strict=True))


def decode(op: Op, segments: list[torch.Tensor], device: torch.device) -> StepMessage:
    if op is Op.FORWARD:
        meta = _meta_from(segments[4 : 4 + _META_SEGMENTS], device)
        if len(segments) > 4 + _META_SEGMENTS:
            meta.decode_part = _meta_from(segments[4 + _META_SEGMENTS : 4 + 2 * _META_SEGMENTS], device)
            meta.prefill_part = _meta_from(segments[4 + 2 * _META_SEGMENTS :], device)
        batch = FlatBatch(input_ids=segments[0].to(device), positions=segments[1].to(device), meta=meta,
                          logits_indices=segments[2].to(device))
        return StepMessage(op, batch=batch, logit_rows=_pairs(segments[3]))
    if op is Op.SWAP:
        return StepMessage(op, pairs=_pairs(segments[0]), pairs_in=_pairs(segments[1]))
    if op is Op.COPY:
        return StepMessage(op, pairs=_pairs(segments[0]))
    return StepMessage(op)


class StepChannel:
    """Rank 0's `send` and the other ranks' `receive` of step messages over the host group `control`."""

    def __init__(self, control: dist.ProcessGroup | None, device: torch.device) -> None:
        self.control = control
        self.device = device

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
        return decode(op, list(torch.split(payload, lengths)), self.device)
