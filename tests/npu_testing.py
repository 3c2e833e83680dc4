"""What the npu backend's tests share (they run the backend against the FAKE torch_npu, tests/fake_torch_npu.py):
the layer's shapes, batches on shuffled blocks, a cache full of random K/V, q/k/v as the model makes them, and the
comparison with the CPU backend within float16/bfloat16 rounding."""

from __future__ import annotations

import torch

from npuserve.engine.sequence import Sequence
from tests.paged_inputs import random_kv_cache, shuffled_sequences

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 32  # GQA: 4 query heads per KV head
SMALL_BLOCK = 16  # the paged kernels' smallest block (a multiple of 16): no prefix-encoder kernel
BLOCK = 128  # the prefix-encoder kernel's only block size
NUM_BLOCKS = 64
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float16, torch.bfloat16]
CPU = torch.device("cpu")


def sequences(total: list[int], cached: list[int], seed: int, block_size: int = SMALL_BLOCK) -> list[Sequence]:
    return shuffled_sequences(total, cached, seed, num_blocks=NUM_BLOCKS, block_size=block_size)


def kv_cache(dtype: torch.dtype, seed: int, block_size: int = SMALL_BLOCK) -> torch.Tensor:
    return random_kv_cache(dtype, seed, num_blocks=NUM_BLOCKS, block_size=block_size, kv_heads=KV_HEADS,
                           head_dim=HEAD_DIM)


def qkv(tokens: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as the model makes them: views of one fused projection (k and v not contiguous)."""
    gen = torch.Generator().manual_seed(seed)
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    fused = torch.randn(tokens, width, generator=gen).to(dtype)
    q, k, v = torch.split(fused, [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    return (q.reshape(tokens, HEADS, HEAD_DIM), k.reshape(tokens, KV_HEADS, HEAD_DIM),
            v.reshape(tokens, KV_HEADS, HEAD_DIM))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
