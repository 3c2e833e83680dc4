"""What the npu backend's tests share (they run the backend against the FAKE torch_npu, tests/fake_torch_npu.py):
the layer's shapes, batches on shuffled blocks, a cache full of random K/V, q/k/v as the model makes them, and the
comparison with the CPU backend within float16/bfloat16 rounding."""

from __future__ import annotations

from pathlib import Path

import torch

from npuserve.engine.backends.base import Backend
from npuserve.engine.model.loader import load_model
from npuserve.engine.runner import KVPlan, ModelRunner
from npuserve.engine.sequence import Sequence
from npuserve.modelspec import ModelSpec
from tests.paged_inputs import HEAD_DIM, HEADS, KV_HEADS, assert_close, qkv, random_kv_cache, shuffled_sequences

__all__ = [
    "BLOCK",
    "CPU",
    "DTYPES",
    "HEADS",
    "HEAD_DIM",
    "KV_HEADS",
    "NUM_BLOCKS",
    "SMALL_BLOCK",
    "assert_close",
    "kv_cache",
    "qkv",
    "sequences",
]
SMALL_BLOCK = 16  # the paged kernels' smallest block (a multiple of 16): no prefix-encoder kernel
BLOCK = 128  # the prefix-encoder kernel's only block size
NUM_BLOCKS = 64
DTYPES = [torch.float16, torch.bfloat16]
CPU = torch.device("cpu")


def sequences(total: list[int], cached: list[int], seed: int, block_size: int = SMALL_BLOCK) -> list[Sequence]:
    return shuffled_sequences(total, cached, seed, num_blocks=NUM_BLOCKS, block_size=block_size)


def kv_cache(dtype: torch.dtype, seed: int, block_size: int = SMALL_BLOCK) -> torch.Tensor:
    return random_kv_cache(dtype, seed, num_blocks=NUM_BLOCKS, block_size=block_size, kv_heads=KV_HEADS,
                           head_dim=HEAD_DIM)


def runner_of(model_dir: Path, backend: Backend, dtype: torch.dtype, max_seq_len: int = 512) -> ModelRunner:
    """A model folder loaded on the host, prepared by `backend` (the fake npu's ops swapped in, or the CPU's), and a
    runner of 16 blocks of `BLOCK` tokens over it: the greedy tests' npu-versus-CPU pair."""
    model = load_model(ModelSpec.from_pretrained(model_dir), model_dir, dtype, CPU)
    backend.prepare_model(model)
    plan = KVPlan(num_blocks=16, num_host_blocks=0, block_size=BLOCK, bytes_per_block=0, source="test")
    return ModelRunner(model, backend, plan, dtype, max_seq_len=max_seq_len)
