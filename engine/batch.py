"""Flat batch builder: a scheduler step's sequences -> the tensors the model runner feeds the model.

Prefill: each sequence contributes tokens `num_cached_tokens .. num_tokens - 1` (prefix-cache hits skipped), or a
chunk of them (chunked prefill, where decodes ride along as one-token chunks).
Decode: each sequence contributes its last token. Every token gets its position and its KV slot
(`block * block_size + offset`); each sequence its padded block table and context length.

The builders read rows through `BatchRow` (what a `Sequence` has), so the step builder passes sequences and the
runner's warm-up passes a `ScratchRow` of plain values.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from npuserve.engine.backends.base import AttentionMetadata


class BatchRow(Protocol):
    """What the builders read of a sequence: its tokens, its blocks and how many tokens already have their KV."""

    @property
    def seq_id(self) -> int: ...

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def block_table(self) -> list[int]: ...

    @property
    def num_cached_tokens(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...


@dataclass(slots=True)
class ScratchRow:
    """A row of plain values (the warm-up's, over scratch blocks)."""

    token_ids: list[int]
    block_table: list[int]
    num_cached_tokens: int = 0
    seq_id: int = -1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class FlatBatch:
    input_ids: torch.Tensor  # (num_tokens,)
    positions: torch.Tensor  # (num_tokens,)
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # (batch,) row of each sequence's last token


def _block_tables(seqs: Seq[BatchRow], max_blocks: int) -> np.ndarray:
    tables = np.zeros((len(seqs), max(1, max_blocks)), dtype=np.int64)
    for i, seq in enumerate(seqs):
        table = seq.block_table[:max_blocks]
        tables[i, : len(table)] = table
    return tables


def build_prefill(seqs: Seq[BatchRow], block_size: int, device: torch.device,
                  num_new_tokens: Seq[int] | None = None) -> FlatBatch:
    """`num_new_tokens` (chunked prefill): compute only that many tokens of each sequence from its cached ones (a
    decode is 1); the sequence's logits row is its last computed token. Decodes leading such a batch get their
    own attention metadata (`meta.decode_part`), so the backend runs them as decodes, not as padded prefills."""
    ids: list[int] = []
    positions: list[np.ndarray] = []
    slots: list[np.ndarray] = []
    query_lens: list[int] = []
    context_lens: list[int] = []
    for i, seq in enumerate(seqs):
        start = seq.num_cached_tokens
        end = seq.num_tokens if num_new_tokens is None else min(seq.num_tokens, start + num_new_tokens[i])
        if start >= end:
            raise ValueError(f"sequence {seq.seq_id}: nothing to prefill (cached {start} of {end} tokens)")
        if len(seq.block_table) * block_size < end:
            raise ValueError(f"sequence {seq.seq_id}: block table covers fewer than its {end} tokens")
        ids.extend(seq.token_ids[start:end])
        pos = np.arange(start, end, dtype=np.int64)
        table = np.asarray(seq.block_table, dtype=np.int64)
        positions.append(pos)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
        query_lens.append(end - start)
        context_lens.append(end)
    slot_mapping = torch.from_numpy(np.concatenate(slots)).to(device)
    meta = _meta(True, seqs, query_lens, context_lens, slot_mapping, block_size, device)
    num_decodes = 0
    if num_new_tokens is not None:
        while num_decodes < len(seqs) and query_lens[num_decodes] == 1 and context_lens[num_decodes] == \
                seqs[num_decodes].num_tokens:
            num_decodes += 1
    if 0 < num_decodes < len(seqs):
        meta.decode_part = _meta(False, seqs[:num_decodes], query_lens[:num_decodes], context_lens[:num_decodes],
                                 slot_mapping[:num_decodes], block_size, device)
        meta.prefill_part = _meta(True, seqs[num_decodes:], query_lens[num_decodes:], context_lens[num_decodes:],
                                  slot_mapping[num_decodes:], block_size, device)
    return FlatBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.from_numpy(np.concatenate(positions)).to(device),
        meta=meta,
        logits_indices=torch.tensor(np.cumsum(query_lens) - 1, dtype=torch.long, device=device),
    )


def _meta(is_prefill: bool, seqs: Seq[BatchRow], query_lens: list[int], context_lens: list[int],
          slot_mapping: torch.Tensor, block_size: int, device: torch.device) -> AttentionMetadata:
    max_blocks = (max(context_lens) + block_size - 1) // block_size
    return AttentionMetadata(
        is_prefill=is_prefill,
        slot_mapping=slot_mapping,
        block_tables=torch.from_numpy(_block_tables(seqs, max_blocks)).to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.long, device=device),
        query_lens=torch.tensor(query_lens, dtype=torch.long, device=device),
        query_start=[0, *np.cumsum(query_lens).tolist()],
        max_query_len=max(query_lens),
        max_context_len=max(context_lens),
        cache={},
    )


def build_decode(seqs: Seq[BatchRow], block_size: int, device: torch.device) -> FlatBatch:
    """One token per sequence. The step's integers travel to the device in one copy (ids, positions, slots,
    context lengths, block tables end to end), not one per tensor: on an accelerator each copy is a launch and a
    wait on the host, and a small batch's decode step is short enough for them to count."""
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
    tables = _block_tables(seqs, max_blocks)
    host = np.concatenate([np.array(ids + positions + slots + context_lens, dtype=np.int64), tables.reshape(-1)])
    flat = torch.from_numpy(host).to(device)
    ids_t, positions_t, slots_t, context_t = flat[: 4 * n].view(4, n)
    meta = AttentionMetadata(
        is_prefill=False,
        slot_mapping=slots_t,
        block_tables=flat[4 * n :].view(n, tables.shape[1]),
        context_lens=context_t,
        query_lens=torch.ones(n, dtype=torch.long, device=device),
        query_start=list(range(n + 1)),
        max_query_len=1,
        max_context_len=max_context,
        cache={},
    )
    return FlatBatch(
        input_ids=ids_t,
        positions=positions_t,
        meta=meta,
        logits_indices=torch.arange(n, dtype=torch.long, device=device),
    )
