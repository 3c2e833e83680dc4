"""Flat batch builder: a scheduler step's sequences -> the tensors the model runner feeds the model.

Prefill: each sequence contributes tokens `num_cached_tokens .. num_tokens - 1` (prefix-cache hits skipped).
Decode: each sequence contributes its last token. Every token gets its position and its KV slot
(`block * block_size + offset`); each sequence its padded block table and context length.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np
import torch

from npuserve.engine.backends.base import AttentionMetadata
from npuserve.engine.sequence import Sequence


@dataclass(slots=True)
class FlatBatch:
    input_ids: torch.Tensor  # (num_tokens,)
    positions: torch.Tensor  # (num_tokens,)
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # (batch,) row of each sequence's last token


def _block_tables(seqs: Seq[Sequence], max_blocks: int) -> np.ndarray:
    tables = np.zeros((len(seqs), max(1, max_blocks)), dtype=np.int64)
    for i, seq in enumerate(seqs):
        table = seq.block_table[:max_blocks]
        tables[i, : len(table)] = table
    return tables


def build_prefill(seqs: Seq[Sequence], block_size: int, device: torch.device) -> FlatBatch:
    ids: list[int] = []
    positions: list[np.ndarray] = []
    slots: list[np.ndarray] = []
    query_start = [0]
    context_lens: list[int] = []
    for seq in seqs:
        start, end = seq.num_cached_tokens, seq.num_tokens
        if start >= end:
            raise ValueError(f"sequence {seq.seq_id}: nothing to prefill (cached {start} of {end} tokens)")
        if len(seq.block_table) * block_size < end:
            raise ValueError(f"sequence {seq.seq_id}: block table covers fewer than its {end} tokens")
        ids.extend(seq.token_ids[start:end])
        pos = np.arange(start, end, dtype=np.int64)
        table = np.asarray(seq.block_table, dtype=np.int64)
        positions.append(pos)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
        query_start.append(query_start[-1] + end - start)
        context_lens.append(end)
    max_blocks = (max(context_lens) + block_size - 1) // block_size
    query_lens = [query_start[i + 1] - query_start[i] for i in range(len(seqs))]
    meta = AttentionMetadata(
        is_prefill=True,
        slot_mapping=torch.from_numpy(np.concatenate(slots)).to(device),
        block_tables=torch.from_numpy(_block_tables(seqs, max_blocks)).to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.long, device=device),
        query_lens=torch.tensor(query_lens, dtype=torch.long, device=device),
        query_start=query_start,
        max_query_len=max(query_lens),
        max_context_len=max(context_lens),
        cache={},
    )
    return FlatBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.from_numpy(np.concatenate(positions)).to(device),
        meta=meta,
        logits_indices=torch.tensor([q - 1 for q in query_start[1:]], dtype=torch.long, device=device),
    )


def build_decode(seqs: Seq[Sequence], block_size: int, device: torch.device) -> FlatBatch:
    n = len(seqs)
    ids = [0] * n
    positions = [0] * n
    slots = [0] * n
    context_lens = [0] * n
    for i, seq in enumerate(seqs):
        pos = seq.num_tokens - 1
        ids[i] = seq.token_ids[-1]
        positions[i] = pos
        slots[i] = seq.block_table[pos // block_size] * block_size + pos % block_size
        context_lens[i] = pos + 1
    max_context = max(context_lens)
    max_blocks = (max_context + block_size - 1) // block_size
    meta = AttentionMetadata(
        is_prefill=False,
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        block_tables=torch.from_numpy(_block_tables(seqs, max_blocks)).to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.long, device=device),
        query_lens=torch.ones(n, dtype=torch.long, device=device),
        query_start=list(range(n + 1)),
        max_query_len=1,
        max_context_len=max_context,
        cache={},
    )
    return FlatBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        meta=meta,
        logits_indices=torch.arange(n, dtype=torch.long, device=device),
    )
