"""Decode graphs: the model's decode forward captured once per bucketed batch size, then replayed
(docs/engine.md#decode-graphs).

Device-generic: the backend makes the graph (`Backend.new_decode_graph`: `torch.cuda.CUDAGraph`, later
`torch.npu.NPUGraph`) and the context it captures in (`Backend.graph_capture`); a backend without graphs (the CPU)
returns None and decode runs eagerly.

A graph replays fixed kernels over fixed memory, so everything a decode step changes lives in static buffers
allocated once (input ids, positions, slot mapping, block tables as wide as the longest sequence needs, context
and query lengths), and the `AttentionMetadata` of each bucket refers to slices of them. `run` copies the step's
tensors in, fills the rows past the batch (up to the bucket) as pad rows, replays, and returns the batch's rows of
the graph's output. A pad row is a one-token sequence whose only block is the runner's scratch block: it writes
its K/V into that block (never into a real one) and attends over that one token, so every value stays finite.

The metadata's `max_context_len` is the static table's width in tokens, its maximum: a graph-safe backend's decode
must not size anything from it (the cuda backend's kernel masks by `context_lens` inside). Its `cache` (the
backend's per-step tensors) is emptied before each capture, so what the backend derives from the metadata is
computed inside the graph and recomputed on each replay.

Buckets are captured largest first, sharing one memory pool (a smaller graph reuses the larger one's blocks), each
after one eager warm-up run (kernels compiled, libraries' lazy state set up outside the capture; with tensor
parallel, the collectives' first use too).
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Any

import torch
from torch import nn

from npuserve.engine.backends.base import AttentionMetadata, Backend
from npuserve.engine.batch import FlatBatch

log = logging.getLogger(__name__)

# The largest batch captured (vLLM's default is 512 too): past it, a step's weights are read once for so many tokens
# that launch overhead no longer matters, and each bucket costs capture time and pool memory.
MAX_CAPTURED_BATCH = 512


def decode_buckets(max_batch_size: int, largest: int = MAX_CAPTURED_BATCH) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, 16, 24, 32, then every 16 up to 256 and every 32 beyond, up to
    `max_batch_size` (itself included, so a full batch pads nothing) and at most `largest`."""
    limit = min(max_batch_size, largest)
    if limit < 1:
        return []
    sizes = [1, 2, 4, 8, 16, 24, 32, *range(48, 257, 16), *range(288, largest + 1, 32)]
    buckets = [n for n in sizes if n <= limit]
    if buckets[-1] != limit:
        buckets.append(limit)
    return buckets


class DecodeGraphs:
    """The runner's decode graphs. `capture()` once at warm-up; then `run(batch)` for each decode step."""

    def __init__(self, model: nn.Module, backend: Backend, *, max_batch_size: int, max_blocks_per_seq: int,
                 block_size: int, scratch_block: int) -> None:
        self.model = model
        self.backend = backend
        self.buckets = decode_buckets(max_batch_size)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        self.scratch_block = scratch_block
        size = self.buckets[-1] if self.buckets else 0
        device = backend.device

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        # Pad row i writes its K/V at offset i % block_size of the scratch block (distinct slots where they fit).
        self.pad_slots = scratch_block * block_size + torch.arange(size, device=device) % block_size
        self.input_ids = zeros(size)
        self.positions = zeros(size)
        self.slot_mapping = self.pad_slots.clone()
        self.block_tables = zeros(size, max_blocks_per_seq).fill_(scratch_block)
        self.context_lens = zeros(size).fill_(1)
        self.query_lens = zeros(size).fill_(1)
        self._metas = {n: self._static_meta(n) for n in self.buckets}
        self._graphs: dict[int, Any] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._pool: Any | None = None
        self._stale_end = 0  # rows at or past it hold pad values (all of them, as built)

    def _static_meta(self, n: int) -> AttentionMetadata:
        return AttentionMetadata(
            is_prefill=False, slot_mapping=self.slot_mapping[:n], block_tables=self.block_tables[:n],
            context_lens=self.context_lens[:n], query_lens=self.query_lens[:n], query_start=list(range(n + 1)),
            max_query_len=1, max_context_len=self.max_blocks_per_seq * self.block_size, cache={},
        )

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    @property
    def captured_sizes(self) -> list[int]:
        """The batch sizes whose graph was captured (a batch replays the smallest that holds it)."""
        return sorted(self._graphs)

    # --- capture ------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every bucket, largest first, in one memory pool. Nothing happens when the backend has no graphs
        (`run` then always answers None)."""
        if self._graphs or not self.buckets:
            return
        t0 = time.perf_counter()
        for n in reversed(self.buckets):
            graph = self.backend.new_decode_graph()
            if graph is None:
                log.info("the %s backend has no decode graphs: decode runs eagerly", self.backend.name)
                return
            self._pad_rows(0, n)
            self._stale_end = 0
            self._forward(n)  # warm-up, outside the capture
            self.backend.synchronize()
            with self.backend.graph_capture(graph, self._pool):
                output = self._forward(n)
            if self._pool is None:
                self._pool = graph.pool()  # the largest graph's pool, shared by the others
            self._graphs[n], self._outputs[n] = graph, output
        self.backend.synchronize()
        log.info("captured decode graphs for batch sizes %s in %.1f s", self.buckets, time.perf_counter() - t0)

    def _forward(self, n: int) -> torch.Tensor:
        meta = self._metas[n]
        meta.cache = {}  # the backend's per-step tensors: derived inside the capture, so recomputed on replay
        hidden: torch.Tensor = self.model(self.input_ids[:n], self.positions[:n], meta)
        return hidden

    def _pad_rows(self, start: int, end: int) -> None:
        if start >= end:
            return
        self.input_ids[start:end].zero_()
        self.positions[start:end].zero_()
        self.slot_mapping[start:end].copy_(self.pad_slots[start:end])
        self.context_lens[start:end].fill_(1)
        self.block_tables[start:end, 0].fill_(self.scratch_block)

    # --- replay -------------------------------------------------------------------------------------------------

    def bucket_for(self, batch_size: int) -> int | None:
        """The smallest captured bucket that holds `batch_size` sequences, or None."""
        i = bisect.bisect_left(self.buckets, batch_size)
        if i == len(self.buckets) or self.buckets[i] not in self._graphs:
            return None
        return self.buckets[i]

    def run(self, batch: FlatBatch) -> torch.Tensor | None:
        """The hidden states `(batch_size, hidden)` of a pure decode batch from its bucket's graph, or None when no
        graph fits it (a prefill or mixed step, more sequences than the largest bucket, a wider block table than
        the static one, nothing captured): the caller runs the model eagerly. The result is a view of the graph's
        output, valid until the next `run`."""
        meta = batch.meta
        if meta.is_prefill or meta.decode_part is not None or meta.prefill_part is not None:
            return None
        b, width = meta.batch_size, meta.block_tables.shape[1]
        n = self.bucket_for(b)
        if n is None or width > self.max_blocks_per_seq or batch.input_ids.shape[0] != b:
            return None
        self.input_ids[:b].copy_(batch.input_ids)
        self.positions[:b].copy_(batch.positions)
        self.slot_mapping[:b].copy_(meta.slot_mapping)
        self.context_lens[:b].copy_(meta.context_lens)
        self.block_tables[:b, :width].copy_(meta.block_tables)  # columns past `width` are never read
        # rows b..n-1 must be pad rows; only those an earlier, larger batch left real need resetting
        self._pad_rows(b, min(n, self._stale_end))
        self._stale_end = b if self._stale_end <= n else self._stale_end
        self._graphs[n].replay()
        return self._outputs[n][:b]
