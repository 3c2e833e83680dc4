"""Tensor parallel's step message at a decode batch, before and after issue 28 (item 1), side by side: the bytes rank 0
broadcasts per step, the step thread's host time to build the batch and encode the message, and the other ranks'
host time to decode it into their flat batch (on --device: the copies to and from it count), for --batch sequences
of --context tokens in --block-size blocks.

Before: the whole flat batch every step (ids, positions, slot mapping, every sequence's whole block table, lengths),
copied to the host and encoded as the engine did until then (kept here, as `_full_batch_segments`, for this
comparison only); the other ranks decode it into tensors. After (engine/parallel/batch_delta.py): a delta against
every rank's mirror of the rows (a running sequence: its id, its new token, its new blocks); every rank applies it
and builds the flat batch from its mirror. The first step of "after" is the batch joining (every row whole): it is
printed on its own line and left out of the per-step figures. Both run on the same rows, step after step.

    .venv/bin/python -P benchmarks/step_message.py [--batch 64] [--context 1024] [--block-size 128] [--steps 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from npuserve.engine.backends.base import AttentionMetadata
from npuserve.engine.batch import FlatBatch, ScratchRow, build_decode
from npuserve.engine.parallel.batch_delta import BatchKind, DeltaSender
from npuserve.engine.parallel.step_message import HEADER_SIZE, Op, StepMessage, decode, encode

# --- before: the full-batch message (the engine's until issue 28) --------------------------------------------------

def _host(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).to("cpu", torch.int64)


def _meta_segments(meta: AttentionMetadata) -> list[torch.Tensor]:
    scalars = [int(meta.is_prefill), meta.max_query_len, meta.max_context_len, meta.block_tables.shape[1]]
    return [torch.tensor(scalars, dtype=torch.int64), _host(meta.slot_mapping), _host(meta.block_tables),
            _host(meta.context_lens), _host(meta.query_lens), torch.tensor(meta.query_start, dtype=torch.int64)]


def _full_batch_segments(batch: FlatBatch) -> list[torch.Tensor]:
    return [_host(batch.input_ids), _host(batch.positions), _host(batch.logits_indices),
            torch.zeros(0, dtype=torch.int64), *_meta_segments(batch.meta)]


def _full_batch_decode(segments: list[torch.Tensor], device: torch.device) -> FlatBatch:
    is_prefill, max_query_len, max_context_len, width = segments[4].tolist()
    meta = AttentionMetadata(is_prefill=bool(is_prefill), slot_mapping=segments[5].to(device),
                             block_tables=segments[6].view(-1, width).to(device), context_lens=segments[7].to(device),
                             query_lens=segments[8].to(device), query_start=segments[9].tolist(),
                             max_query_len=max_query_len, max_context_len=max_context_len, cache={})
    return FlatBatch(segments[0].to(device), segments[1].to(device), meta, segments[2].to(device))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- one step each way ------------------------------------------------------------------------------------------

FULL_BATCH_HEADER_SIZE = 64  # the full batch's header: up to 22 segments (a mixed step)


def _wire(lengths: list[int], header: int = HEADER_SIZE) -> int:
    """The message's bytes: the int64 header and payload."""
    return (header + sum(lengths)) * 8


def _before(rows: list[ScratchRow], block_size: int, device: torch.device) -> tuple[int, float, float]:
    t0 = time.perf_counter()
    segments = _full_batch_segments(build_decode(rows, block_size, device))
    lengths = [s.numel() for s in segments]
    payload = torch.cat(segments)  # as the engine sent it
    _sync(device)
    t1 = time.perf_counter()
    _full_batch_decode(list(torch.split(payload, lengths)), device)  # as the other ranks received it
    _sync(device)
    return _wire(lengths, FULL_BATCH_HEADER_SIZE), t1 - t0, time.perf_counter() - t1


def _after(rows: list[ScratchRow], block_size: int, device: torch.device, sender: DeltaSender,
           peer: DeltaSender) -> tuple[int, float, float]:
    t0 = time.perf_counter()
    delta, _ = sender.build(rows, BatchKind.DECODE, block_size, device)
    lengths, payload = encode(StepMessage(Op.FORWARD, delta=delta))
    _sync(device)
    t1 = time.perf_counter()
    msg = decode(Op.FORWARD, lengths, payload)
    assert msg.delta is not None
    peer.mirror.build(msg.delta, block_size, device)
    _sync(device)
    return _wire(lengths), t1 - t0, time.perf_counter() - t1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--device", default="cpu", help="where the batch's tensors go (cpu, cuda)")
    args = p.parse_args()
    device = torch.device(args.device)
    blocks_per_seq = -(-(args.context + args.steps) // args.block_size)
    rows = [ScratchRow(list(range(args.context)), list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
                       num_cached_tokens=args.context - 1, seq_id=i) for i in range(args.batch)]
    sender, peer = DeltaSender(), DeltaSender()  # the peer uses only its mirror
    before: list[tuple[int, float, float]] = []
    after: list[tuple[int, float, float]] = []
    _before(rows, args.block_size, device)  # warm-up: torch's first calls, then the batch joining
    _after(rows, args.block_size, device, DeltaSender(), DeltaSender())
    join = _after(rows, args.block_size, device, sender, peer)
    for _ in range(args.steps):
        for row in rows:  # the next decode: one more token
            row.token_ids.append(1)
            row.num_cached_tokens += 1
        before.append(_before(rows, args.block_size, device))
        after.append(_after(rows, args.block_size, device, sender, peer))

    def figures(samples: list[tuple[int, float, float]]) -> tuple[float, float, float]:
        return (statistics.mean(s[0] for s in samples), statistics.median(s[1] for s in samples) * 1e6,
                statistics.median(s[2] for s in samples) * 1e6)

    b, a = figures(before), figures(after)
    print(f"step message, decode batch {args.batch}, context {args.context}, block {args.block_size}, "
          f"{args.steps} steps, batch on {device} (host times: medians)")
    print(f"{'':44}{'before':>12}{'after':>12}{'before/after':>14}")
    for name, unit, i in (("bytes per step", "", 0), ("rank 0 build + encode", " us", 1),
                          ("other ranks decode (+ rebuild, after)", " us", 2)):
        print(f"{name:44}{b[i]:>9.0f}{unit:3}{a[i]:>9.0f}{unit:3}{b[i] / a[i]:>13.2f}x")
    print(f"the batch joining (every row whole, after's first step): {join[0]} bytes, rank 0 "
          f"{join[1] * 1e6:.0f} us, other ranks {join[2] * 1e6:.0f} us")


if __name__ == "__main__":
    main()
