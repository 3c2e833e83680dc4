"""Tensor parallel's step message at a decode batch: the bytes rank 0 broadcasts per step and the step thread's
host time to build the batch and encode it (device-to-host copies included), for --batch sequences of --context
tokens in --block-size blocks.

Today's message is the whole flat batch every step (engine/parallel/step_message.py): ids, positions, slot mapping,
every sequence's whole block table, lengths. This prints that baseline; issue 28 (item 1) asks for deltas (new
requests whole, running ones as their new token and new blocks, finished ones as ids) and the ratio against it.

    .venv/bin/python -P benchmarks/step_message.py [--batch 64] [--context 1024] [--block-size 128] [--steps 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from npuserve.engine.batch import ScratchRow, build_decode
from npuserve.engine.parallel.step_message import HEADER_SIZE, Op, StepMessage, encode


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    blocks_per_seq = -(-(args.context + args.steps) // args.block_size)
    rows = [ScratchRow(list(range(args.context)), list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
                       num_cached_tokens=args.context - 1) for i in range(args.batch)]
    device = torch.device("cpu")
    sizes, times = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        batch = build_decode(rows, args.block_size, device)
        segments = encode(StepMessage(Op.FORWARD, batch=batch))
        times.append(time.perf_counter() - t0)
        sizes.append((HEADER_SIZE + sum(s.numel() for s in segments)) * 8)  # int64 header + payload
        for row in rows:  # the next decode: one more token
            row.token_ids.append(1)
            row.num_cached_tokens += 1
    print(f"full-batch step message, decode batch {args.batch}, context {args.context}, block {args.block_size}: "
          f"{statistics.mean(sizes):.0f} bytes per step, host build+encode {statistics.median(times) * 1e6:.0f} us "
          f"median over {args.steps} steps")


if __name__ == "__main__":
    main()
