"""Numeric smoke tests of every op the npu backend calls, run through the backend itself on the card and compared
with a CPU reference (the CPU backend's attention, the eager layers): the cache write, prefill (the flash kernel),
prefix prefill (the prefix encoder), decode (paged attention), a chunked-prefill step (SplitFuse), and the fused
RMSNorm, RoPE and SwiGLU, in float16 and bfloat16. Each test checks that the step went to the kernel it names, so a
routing change cannot make a test pass on another kernel. A few tokens each: milliseconds on a card, which is why the
engine runs them at start-up too (`checks.preflight`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from npuserve.engine.backends.base import AttentionMetadata
from npuserve.engine.backends.cpu import CPUBackend
from npuserve.engine.backends.npu import NPUBackend
from npuserve.engine.backends.npu_fused import FusedRMSNorm, FusedRotary, FusedSwiGLU
from npuserve.engine.backends.npu_stack import DECODE_OP, FLASH_OP, PREFIX_OP, SPLITFUSE_OP
from npuserve.engine.batch import build_decode, build_prefill
from npuserve.engine.doctor.report import DoctorCheck
from npuserve.engine.model.layers import RMSNorm, RotaryEmbedding, silu_and_mul
from npuserve.engine.sequence import SamplingParams, Sequence

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 128  # GQA, the head size of the Llama-family models served
NUM_BLOCKS = 8
DTYPES = (torch.float16, torch.bfloat16)
# Relative to the reference's largest value: the kernels accumulate in float32 and round once more or less.
TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 4e-2}
CPU = torch.device("cpu")


def _sequences(total: list[int], cached: list[int], block_size: int) -> list[Sequence]:
    seqs, next_block = [], 0
    for n, c in zip(total, cached, strict=True):
        seq = Sequence(list(range(1, n + 1)), SamplingParams(temperature=0.0), arrival_time=0.0)
        blocks = -(-n // block_size)
        seq.block_table = list(range(next_block, next_block + blocks))[::-1]  # not in order
        next_block += blocks
        seq.num_cached_tokens = c
        seqs.append(seq)
    return seqs


def _error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = max(float(expected.float().abs().max()), 1.0)
    return float((actual.cpu().float() - expected.float()).abs().max()) / scale


def _attention(backend: NPUBackend, kernel: str, block_size: int, seqs: list[Sequence], new: list[int] | None,
               decode: bool = False) -> str:
    """The backend's attention on the card against the CPU backend's, per dtype; the step must take `kernel`."""
    backend.configure(block_size=block_size, head_dim=HEAD_DIM, max_seq_len=NUM_BLOCKS * block_size)
    errors = []
    for dtype in DTYPES:
        def meta(device: torch.device) -> AttentionMetadata:
            if decode:
                return build_decode(seqs, block_size, device).meta
            return build_prefill(seqs, block_size, device, new).meta

        cpu_meta, npu_meta = meta(CPU), meta(backend.device)
        tokens = cpu_meta.query_start[-1]
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(tokens, HEADS, HEAD_DIM, generator=gen).to(dtype)
        k, v = (torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
        cache = torch.randn(2, NUM_BLOCKS, block_size, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        npu_cache = cache.to(backend.device)
        chosen = backend.kernel(npu_meta, npu_cache)
        if chosen != kernel:
            raise AssertionError(f"the step went to {chosen}, not {kernel}")
        expected = CPUBackend().attention(q, k, v, cache, cpu_meta)
        actual = backend.attention(q.to(backend.device), k.to(backend.device), v.to(backend.device), npu_cache,
                                   npu_meta)
        error = _error(actual, expected)
        if error > TOLERANCE[dtype]:
            raise AssertionError(f"{kernel} in {dtype}: off the CPU reference by {error:.1e} (relative)")
        errors.append(f"{str(dtype).removeprefix('torch.')} {error:.0e}")
    return f"{kernel} equals the CPU reference ({', '.join(errors)})"


def _cache_write(backend: NPUBackend) -> str:
    op = backend.stack.cache_write_op
    for dtype in DTYPES:
        gen = torch.Generator().manual_seed(1)
        k, v = (torch.randn(5, KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
        cache = torch.randn(2, NUM_BLOCKS, 16, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        slots = torch.tensor([3, 40, 17, 99, 64])
        expected = cache.clone()
        CPUBackend().write_kv(expected, k, v, slots)
        actual = cache.to(backend.device)
        backend.write_kv(actual, k.to(backend.device), v.to(backend.device), slots.to(backend.device))
        if not torch.equal(actual.cpu(), expected):
            raise AssertionError(f"{op} in {dtype}: the cache differs from the CPU backend's write")
    return f"{op} writes the CPU backend's slots exactly"


def _fused(backend: NPUBackend, name: str) -> str:
    ops = backend._ops
    for dtype in DTYPES:
        gen = torch.Generator().manual_seed(2)
        if name == "npu_rms_norm":
            norm = RMSNorm(HEAD_DIM, 1e-6).to(dtype)
            with torch.no_grad():
                norm.weight.copy_(1 + 0.1 * torch.randn(HEAD_DIM, generator=gen))
            x = torch.randn(5, HEAD_DIM, generator=gen).to(dtype)
            expected = norm(x)
            actual = FusedRMSNorm(ops, norm.to(backend.device))(x.to(backend.device))
        elif name == "npu_rotary_mul":
            rotary = RotaryEmbedding(HEAD_DIM, 256, 10000.0, None)
            positions = torch.tensor([0, 3, 77, 255])
            q, k = (torch.randn(4, HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
            expected = torch.cat(rotary(positions, q, k))
            on_card = rotary.to(backend.device)
            dev = backend.device
            actual = torch.cat(FusedRotary(ops, on_card)(positions.to(dev), q.to(dev), k.to(dev)))
        else:
            x = torch.randn(5, 2 * HEAD_DIM, generator=gen).to(dtype)
            expected = silu_and_mul(x)
            actual = FusedSwiGLU(ops)(x.to(backend.device))
        error = _error(actual, expected)
        if error > TOLERANCE[dtype]:
            raise AssertionError(f"{name} in {dtype}: off the eager layer by {error:.1e} (relative)")
    return f"{name} equals the eager layer"


SMOKE_TESTS: dict[str, Callable[[NPUBackend], str]] = {
    "smoke: cache write": _cache_write,
    "smoke: prefill": lambda b: _attention(b, FLASH_OP, 16, _sequences([7, 33], [0, 0], 16), None),
    "smoke: prefix prefill": lambda b: _attention(b, PREFIX_OP, 128, _sequences([150, 20], [128, 0], 128), None),
    "smoke: decode": lambda b: _attention(b, DECODE_OP, 128, _sequences([1, 130, 257], [0, 129, 256], 128), None,
                                          decode=True),
    "smoke: chunked prefill": lambda b: _attention(b, SPLITFUSE_OP, 128, _sequences([130, 57], [129, 37], 128),
                                                   [1, 20]),
    "smoke: rms_norm": lambda b: _fused(b, "npu_rms_norm"),
    "smoke: rope": lambda b: _fused(b, "npu_rotary_mul"),
    "smoke: swiglu": lambda b: _fused(b, "npu_swiglu"),
}


def smoke_checks(backend: NPUBackend) -> list[DoctorCheck]:
    checks = []
    for name, test in SMOKE_TESTS.items():
        try:
            with torch.inference_mode():
                detail = test(backend)
            checks.append(DoctorCheck(name=name, status="ok", detail=detail))
        except Exception as e:  # any failure of an op on the card is the check's finding
            checks.append(DoctorCheck(name=name, status="fail", detail=f"{type(e).__name__}: {e}"))
    return checks
