"""Inputs the backend tests share: sequences on shuffled blocks, and a cache already full of random K/V."""

from __future__ import annotations

import math
import random

import torch

from npuserve.engine.sequence import SamplingParams, Sequence


def shuffled_sequences(total: list[int], cached: list[int], seed: int, *, num_blocks: int,
                       block_size: int) -> list[Sequence]:
    """Sequences of `total` tokens, the first `cached` of them already in the cache, on blocks from a shuffled pool
    (no sequence's blocks contiguous or sorted)."""
    pool = list(range(num_blocks))
    random.Random(seed).shuffle(pool)
    seqs = []
    for n, c in zip(total, cached, strict=True):
        seq = Sequence(list(range(1, n + 1)), SamplingParams(temperature=0.0), arrival_time=0.0)
        blocks = math.ceil(n / block_size)
        seq.block_table, pool = pool[:blocks], pool[blocks:]
        seq.num_cached_tokens = c
        seqs.append(seq)
    return seqs


def random_kv_cache(dtype: torch.dtype, seed: int, *, num_blocks: int, block_size: int, kv_heads: int,
                    head_dim: int) -> torch.Tensor:
    """A layer's cache already holding random K/V everywhere (what earlier steps and prefix hits left there)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
