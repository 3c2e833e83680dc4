"""The `cuda` backend (engine/backends/cuda.py) against the CPU backend and the eager model.

No GPU is here: `CUDABackend(torch.device("cpu"))` runs the backend's own code on CPU tensors, its Triton kernels
(paged decode attention, the fused RMSNorm / RoPE / SiLU-and-mul of `prepare_model`) under Triton's interpreter
(TRITON_INTERPRET=1) and its prefill on torch SDPA's CPU kernels. The variable must be set before triton is
imported, so those checks run in a worker process (this file run as a script, as in test_triton_paged_attention.py);
a second worker, at the same time and without it, has Triton's real compiler lower the fused kernels to an sm_90
cubin. Each check is reported as a test here.

What the interpreter tier proves: the cache write equals the CPU backend's bit for bit; decode over shuffled block
tables (GQA, contexts of 1, a block, a block and one, across the kernel's 64-token tiles) equals it, with and
without split-K, fp32 within 1e-5, fp16 and bf16 within their rounding; decode reads nothing but tensors and shapes
(the same result with bogus `max_context_len` / `max_query_len` and a wider block table, as a graph's static
metadata has); prefill without prefix hits (runs of equal lengths in one call), with hits (whole and partial
blocks), through `attention` and `prefill_attention`, and a mixed chunked step equal it; the fused kernels equal the
eager modules (strided q/k views, llama3-scaled RoPE tables, widths off the kernels' blocks) and `prepare_model`
swaps them in; the tiny model's greedy tokens through `ModelRunner`, with a prefix hit, with and without the fused
kernels, equal the CPU backend's. What only a GPU can show (the tests marked `skipif(not torch.cuda.is_available())`):
the compiled kernels' and FlashAttention's numerics and speed, CUDA graph capture, the blocking swap copy,
`mem_get_info`.
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from npuserve.catalog.models import get_model_preset
from npuserve.engine.backends import triton_fused_ops
from npuserve.engine.backends.base import AttentionMetadata, Backend
from npuserve.engine.backends.cpu import CPUBackend
from npuserve.engine.backends.cuda import (
    MAX_DECODE_SPLITS,
    CUDABackend,
    FusedRMSNorm,
    FusedRotary,
    cuda_int32_matmul,
    decode_splits,
)
from npuserve.engine.batch import build_decode, build_prefill
from npuserve.engine.model.layers import RMSNorm, RotaryEmbedding, silu_and_mul
from npuserve.engine.model.llama import MLP
from npuserve.engine.model.loader import load_model
from npuserve.engine.runner import KVPlan, ModelRunner
from npuserve.engine.sequence import Sequence
from npuserve.quantization import QuantScheme

sys.path.append(str(Path(__file__).resolve().parents[2]))  # a worker runs this file as a script: `tests` importable
from tests.kernel_workers import Check, run_workers, work
from tests.paged_inputs import (
    HEAD_DIM,
    KV_HEADS,
    assert_close,
    greedy_tokens,
    qkv,
    random_kv_cache,
    shuffled_sequences,
)

BLOCK_SIZE, NUM_BLOCKS = 8, 64
CPU = torch.device("cpu")
CHECKS: dict[str, Check] = {}  # run by the interpreter worker
COMPILED: dict[str, Check] = {}  # run by the compiler worker


# --- inputs ------------------------------------------------------------------------------------------------------


def _sequences(total: list[int], cached: list[int], seed: int) -> list[Sequence]:
    return shuffled_sequences(total, cached, seed, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)


def _cache(dtype: torch.dtype, seed: int) -> torch.Tensor:
    return random_kv_cache(dtype, seed, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, kv_heads=KV_HEADS,
                           head_dim=HEAD_DIM)


def _compare_step(backend: Backend, seqs: list[Sequence], dtype: torch.dtype, seed: int, *, decode: bool = False,
                  chunks: list[int] | None = None, entry: str = "attention", device: torch.device = CPU) -> None:
    """One layer's attention over a step of `seqs` (decode, prefill, or a chunked step of `chunks` tokens each):
    the backend's against the CPU backend's, the caches after it bit for bit."""
    build: Callable[[], AttentionMetadata] = (
        (lambda: build_decode(seqs, BLOCK_SIZE, device).meta) if decode
        else (lambda: build_prefill(seqs, BLOCK_SIZE, device, chunks).meta))
    tokens = len(seqs) if decode else sum(chunks or [s.num_tokens - s.num_cached_tokens for s in seqs])
    q, k, v = qkv(tokens, dtype, seed)
    expected_cache, cache = _cache(dtype, seed + 1), _cache(dtype, seed + 1)
    reference = build_decode(seqs, BLOCK_SIZE, CPU).meta if decode else build_prefill(seqs, BLOCK_SIZE, CPU,
                                                                                      chunks).meta
    expected = CPUBackend().attention(q, k, v, expected_cache, reference)
    meta = build()
    q, k, v, cache = (x.to(device) for x in (q, k, v, cache))
    if entry == "attention":
        actual = backend.attention(q, k, v, cache, meta)
    else:  # the separate entry points, over what the cache holds after the write
        backend.write_kv(cache, k, v, meta.slot_mapping)
        fn = backend.decode_attention if decode else backend.prefill_attention
        actual = fn(q, cache, meta)
    assert torch.equal(cache.cpu(), expected_cache)
    assert_close(actual.cpu(), expected, dtype)


def _interpreted(backend: CUDABackend | None = None, num_sms: int | None = None) -> CUDABackend:
    backend = backend or CUDABackend(CPU)
    if num_sms is not None:
        backend.num_sms = num_sms
    return backend


# --- decode ------------------------------------------------------------------------------------------------------

DECODE_LENGTHS = [1, 8, 9, 31, 64, 65, 17, 130]  # a block of 8 and one more, the kernel's 64-token tiles and past


def _decode(dtype: torch.dtype, num_sms: int, entry: str = "attention") -> None:
    seqs = _sequences(DECODE_LENGTHS, [n - 1 for n in DECODE_LENGTHS], seed=10)
    backend = _interpreted(num_sms=num_sms)
    splits = decode_splits(len(seqs), KV_HEADS, math.ceil(max(DECODE_LENGTHS) / BLOCK_SIZE) * BLOCK_SIZE, num_sms)
    assert (splits > 1) == (num_sms > len(seqs) * KV_HEADS)
    _compare_step(backend, seqs, dtype, seed=11, decode=True, entry=entry)


for _dtype, _name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"), (torch.float16, "fp16")):
    CHECKS[f"decode-{_name}"] = lambda dtype=_dtype: _decode(dtype, num_sms=1)
    CHECKS[f"decode-split-{_name}"] = lambda dtype=_dtype: _decode(dtype, num_sms=64)
CHECKS["decode-attention-entry-fp32"] = lambda: _decode(torch.float32, num_sms=64, entry="decode_attention")


def _decode_reads_only_tensors() -> None:
    """Bogus host values and a wider, padded block table (a graph's static metadata): the same result."""
    seqs = _sequences(DECODE_LENGTHS, [n - 1 for n in DECODE_LENGTHS], seed=12)
    q, _, _ = qkv(len(seqs), torch.float32, seed=13)
    cache = _cache(torch.float32, 14)
    backend = _interpreted(num_sms=64)
    meta = build_decode(seqs, BLOCK_SIZE, CPU).meta
    expected = backend.decode_attention(q, cache, meta)
    padding = torch.full((len(seqs), 7), 1 << 40, dtype=torch.long)  # never read: it would fault
    static = AttentionMetadata(
        is_prefill=False, slot_mapping=meta.slot_mapping, block_tables=torch.cat([meta.block_tables, padding], 1),
        context_lens=meta.context_lens, query_lens=meta.query_lens, query_start=meta.query_start,
        max_query_len=-1, max_context_len=-1, cache={},
    )
    torch.testing.assert_close(backend.decode_attention(q, cache, static), expected, atol=1e-6, rtol=1e-6)


CHECKS["decode-reads-only-tensors"] = _decode_reads_only_tensors


# --- prefill and mixed steps -------------------------------------------------------------------------------------


for _dtype, _name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
    # no prefix hits; three 16-token prompts in a row go in one SDPA call
    for _entry in ("attention", "prefill_attention"):
        CHECKS[f"prefill-{_entry}-{_name}"] = lambda dtype=_dtype, entry=_entry: _compare_step(
            _interpreted(), _sequences([7, 23, 1, 16, 16, 16, 40], [0] * 7, seed=4), dtype, seed=5, entry=entry)
    # hits of whole blocks and, as chunked prefill leaves them, of part of one; sequences without a hit between
    CHECKS[f"prefill-prefix-hits-{_name}"] = lambda dtype=_dtype: _compare_step(
        _interpreted(), _sequences([20, 33, 9, 9, 12, 5], [16, 8, 0, 0, 5, 0], seed=7), dtype, seed=8)
    # two decodes ride in front of prompt chunks (one continuing a prompt, two starting one)
    CHECKS[f"mixed-chunked-step-{_name}"] = lambda dtype=_dtype: _compare_step(
        _interpreted(), _sequences([12, 40, 30, 25, 7], [11, 39, 8, 0, 0], seed=13), dtype, seed=14,
        chunks=[1, 1, 10, 16, 7])


# --- fused kernels (prepare_model) --------------------------------------------------------------------------------

# Against the eager modules: fp32 and fp16 within a unit in the last place. The interpreter truncates fp32 -> bf16
# casts (compiled Triton rounds to nearest even, as torch does), so bf16 is held to two units (RMSNorm rounds twice:
# the normed value, then its product with the weight).
FUSED_TOL = {torch.float32: (1e-5, 1e-6), torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5)}


def _fused_ops(dtype: torch.dtype, device: torch.device = CPU) -> None:
    gen = torch.Generator().manual_seed(21)
    rtol, atol = FUSED_TOL[dtype]

    def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
        assert actual.shape == expected.shape and actual.dtype == expected.dtype
        torch.testing.assert_close(actual.cpu().float(), expected.float(), rtol=rtol, atol=atol)

    # RMSNorm: hidden rows, and the per-head q/k norm over strided views of a fused projection
    norm = RMSNorm(96, 1e-5)
    norm.weight.data = 1 + 0.1 * torch.randn(96, generator=gen)
    norm = norm.to(dtype)
    x = (3 * torch.randn(7, 96, generator=gen)).to(dtype)
    close(triton_fused_ops.rms_norm(x.to(device), norm.weight.to(device), norm.eps), norm(x))
    head_norm = RMSNorm(HEAD_DIM, 1e-6).to(dtype)
    q, k, _ = qkv(5, dtype, seed=22)
    close(triton_fused_ops.rms_norm(q.to(device), head_norm.weight.to(device), head_norm.eps), head_norm(q))
    # RoPE of strided q and k, unsorted positions, plain and llama3-scaled tables
    positions = torch.tensor([0, 9, 4095, 17, 17])
    for scaling in (None, {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 1024}):
        rope = RotaryEmbedding(HEAD_DIM, 4096, 500000.0, scaling)
        qa, ka = triton_fused_ops.rotary(positions.to(device), q.to(device), k.to(device), rope.cos.to(device),
                                         rope.sin.to(device))
        qb, kb = rope(positions, q, k)
        close(qa, qb)
        close(ka, kb)
    one_kv = k[:, :1]  # one KV head (MQA, or a KV head per tensor-parallel rank)
    close(triton_fused_ops.rotary(positions.to(device), q.to(device), one_kv.to(device), rope.cos.to(device),
                                  rope.sin.to(device))[1], rope(positions, q, one_kv)[1])
    # SiLU-and-mul over a batch of rows, and a width that is not a multiple of the kernel's block
    gate_up = (2 * torch.randn(3, 2, 2 * 1100, generator=gen)).to(dtype)
    close(triton_fused_ops.silu_and_mul(gate_up.to(device)), silu_and_mul(gate_up))


for _dtype, _name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"), (torch.float16, "fp16")):
    CHECKS[f"fused-ops-{_name}"] = lambda dtype=_dtype: _fused_ops(dtype)


def _prepare_model_swaps_the_leaf_pieces() -> None:
    model = load_model(get_model_preset("tiny"), None, torch.float32, CPU, load_format="dummy", seed=3)
    backend = _interpreted()
    backend.prepare_model(model)
    backend.prepare_model(model)  # idempotent
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(isinstance(m.__dict__["forward"], FusedRMSNorm) for m in norms)
    ropes = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
    assert ropes and all(isinstance(m.__dict__["forward"], FusedRotary) for m in ropes)
    mlps = [m for m in model.modules() if isinstance(m, MLP)]
    assert mlps and all(m.act_fn is triton_fused_ops.silu_and_mul for m in mlps)


CHECKS["prepare-model-swaps-the-leaf-pieces"] = _prepare_model_swaps_the_leaf_pieces


def _compile_for_sm90() -> None:
    """The fused kernels with the argument types a bf16 Llama-3-8B-shaped model gives them, lowered for an H100
    by Triton's real compiler (no GPU needed): the interpreter accepts code the compiler refuses."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from npuserve.engine.backends.triton_paged_attention import interpreting

    assert not interpreting()
    assert "nvidia" in triton.backends.backends, "this triton build has no NVIDIA backend"
    norm, rope, silu = triton_fused_ops._kernels(False)
    cases = [
        (norm, triton_fused_ops._rms_norm_kernel, {"out_ptr": "*bf16", "x_ptr": "*bf16", "w_ptr": "*bf16",
                                                   "eps": "fp32"}, {"N": 4096, "BLOCK": 4096}, 8),
        (rope, triton_fused_ops._rotary_kernel, {"q_out_ptr": "*bf16", "k_out_ptr": "*bf16", "q_ptr": "*bf16",
                                                 "k_ptr": "*bf16", "pos_ptr": "*i64", "cos_ptr": "*fp32",
                                                 "sin_ptr": "*fp32"},
         {"HEADS": 32, "KV_HEADS": 8, "HEADS_PAD": 32, "KV_PAD": 8, "HALF": 64, "HALF_PAD": 64}, 4),
        (rope, triton_fused_ops._rotary_kernel, {"q_out_ptr": "*bf16", "k_out_ptr": "*bf16", "q_ptr": "*bf16",
                                                 "k_ptr": "*bf16", "pos_ptr": "*i64", "cos_ptr": "*fp32",
                                                 "sin_ptr": "*fp32"},  # Qwen2.5-7B over 4 ranks: 7 heads, 1 KV
         {"HEADS": 7, "KV_HEADS": 1, "HEADS_PAD": 8, "KV_PAD": 1, "HALF": 64, "HALF_PAD": 64}, 4),
        (silu, triton_fused_ops._silu_and_mul_kernel, {"out_ptr": "*bf16", "x_ptr": "*bf16"},
         {"N": 14336, "BLOCK": 1024}, 4),
    ]
    for jitted, fn, pointers, constants, warps in cases:
        signature = dict.fromkeys(inspect.signature(fn).parameters, "i32") | pointers
        source = ASTSource(jitted, signature | dict.fromkeys(constants, "constexpr"), constants)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        assert compiled.asm["cubin"], fn.__name__


COMPILED["fused-ops-sm90-cubin"] = _compile_for_sm90


# --- greedy generation through the model runner ------------------------------------------------------------------




def _greedy_equals_cpu(backend: Backend, device: torch.device, steps: int, fused: bool = False,
                       quantization: QuantScheme | None = None) -> None:
    """The tiny model's greedy tokens in fp32 (with the fused kernels swapped in when `fused`; with random int8
    weights of `quantization`'s scheme when given)."""
    spec = get_model_preset("tiny").model_copy(update={"quantization": quantization})
    plan = KVPlan(num_blocks=48, num_host_blocks=0, block_size=BLOCK_SIZE, bytes_per_block=0, source="test")
    gen = torch.Generator().manual_seed(17)
    prompts = [torch.randint(5, spec.vocab_size, (n,), generator=gen).tolist() for n in (3, 21, 9, 30, 6)]
    reference = load_model(spec, None, torch.float32, CPU, load_format="dummy", seed=3)
    expected = greedy_tokens(ModelRunner(reference, CPUBackend(), plan, torch.float32), prompts, steps, seed=18)
    model = load_model(spec, None, torch.float32, device, load_format="dummy", seed=3)
    if fused:
        backend.prepare_model(model)
    assert greedy_tokens(ModelRunner(model, backend, plan, torch.float32), prompts, steps, seed=18) == expected


CHECKS["tiny-model-greedy-through-the-runner"] = lambda: _greedy_equals_cpu(_interpreted(num_sms=64), CPU, steps=8)
CHECKS["tiny-model-greedy-fused-kernels"] = lambda: _greedy_equals_cpu(_interpreted(), CPU, steps=6, fused=True)


# --- the tests: each reads its check's outcome from the worker ----------------------------------------------------


@pytest.fixture(scope="module")
def worker_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Runs the interpreter worker and the compiler worker side by side; {check: "ok", or what went wrong}. A worker
    that dies fails the check it was running and those after it."""
    modes = {"interpret": list(CHECKS), "compile": list(COMPILED)}
    return run_workers(__file__, modes, tmp_path_factory.mktemp("triton-cache"), timeout=600)


@pytest.mark.parametrize("check", [*CHECKS, *COMPILED])
def test_worker_check(check: str, worker_results: dict[str, str]) -> None:
    outcome = worker_results[check]
    if outcome != "ok":
        pytest.fail(f"{check}:\n{outcome}", pytrace=False)


# --- in this process: no kernel runs -----------------------------------------------------------------------------


def test_the_backend_on_the_cpu() -> None:
    backend = CUDABackend(CPU)
    assert (backend.name, backend.dist_backend, backend.device) == ("cuda", "nccl", CPU)
    assert backend.new_decode_graph() is None  # no graphs off the GPU: DecodeGraphs then leaves decode eager
    with pytest.raises(NotImplementedError):
        backend.graph_capture(object(), None)
    info = backend.memory_info()
    assert 0 < info.free_bytes <= info.total_bytes
    backend.synchronize()


@pytest.mark.parametrize(("batch", "kv_heads", "context", "sms", "expected"), [
    (1, 8, 2560, 132, MAX_DECODE_SPLITS),  # batch 1 of Llama-3-8B on an H100: as many splits as allowed
    (1, 8, 64, 132, 1),  # one tile: nothing to split
    (1, 8, 200, 132, 4),  # four tiles
    (4, 8, 4096, 132, 5),  # 32 programs -> 5 splits fill 132 multiprocessors
    (32, 8, 4096, 132, 1),  # 256 programs already fill them
    (256, 8, 4096, 132, 1),
])
def test_decode_splits(batch: int, kv_heads: int, context: int, sms: int, expected: int) -> None:
    assert decode_splits(batch, kv_heads, context, sms) == expected


# --- on a GPU ------------------------------------------------------------------------------------------------------

gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPU = torch.device("cuda", 0)


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_sms", [1, 64, None])
def test_gpu_decode_matches_the_cpu_backend(dtype: torch.dtype, num_sms: int | None) -> None:
    seqs = _sequences(DECODE_LENGTHS, [n - 1 for n in DECODE_LENGTHS], seed=10)
    _compare_step(_interpreted(CUDABackend(GPU), num_sms), seqs, dtype, seed=11, decode=True, device=GPU)


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_prefill_and_mixed_steps_match_the_cpu_backend(dtype: torch.dtype) -> None:
    backend = CUDABackend(GPU)
    _compare_step(backend, _sequences([7, 23, 1, 16, 16, 16, 40], [0] * 7, seed=4), dtype, seed=5, device=GPU)
    _compare_step(backend, _sequences([20, 33, 9, 9, 12, 5], [16, 8, 0, 0, 5, 0], seed=7), dtype, seed=8,
                  device=GPU)
    _compare_step(backend, _sequences([12, 40, 30, 25, 7], [11, 39, 8, 0, 0], seed=13), dtype, seed=14,
                  chunks=[1, 1, 10, 16, 7], device=GPU)


@gpu_only
@pytest.mark.parametrize("fused", [False, True])
def test_gpu_greedy_generation_equals_the_cpu_backend(fused: bool) -> None:
    _greedy_equals_cpu(CUDABackend(GPU), GPU, steps=12, fused=fused)


@gpu_only
@pytest.mark.parametrize(("rows", "k", "n"), [(1, 4096, 4096), (17, 128, 256), (64, 4096, 14336), (3, 12, 10)])
def test_gpu_int32_matmul_is_exact(rows: int, k: int, n: int) -> None:
    """cuBLAS's int8 GEMM (`torch._int_mm`, rows padded) and the odd-shape fallback against int64 on the host."""
    gen = torch.Generator().manual_seed(rows + k + n)
    x_q = torch.randint(-128, 128, (rows, k), generator=gen, dtype=torch.int8)
    w_q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    exact = (x_q.to(torch.int64) @ w_q.to(torch.int64).t()).to(torch.int32)
    got = cuda_int32_matmul(x_q.to(GPU), w_q.to(GPU))
    assert got.device.type == "cuda" and torch.equal(got.cpu(), exact)


@gpu_only
@pytest.mark.parametrize("method", ["w8a8", "w8a8_dynamic"])
def test_gpu_int8_greedy_generation_equals_the_cpu_backend(method: str) -> None:
    _greedy_equals_cpu(CUDABackend(GPU), GPU, steps=12, quantization=QuantScheme(format="msmodelslim", method=method))


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_fused_ops_match_the_eager_modules(dtype: torch.dtype) -> None:
    CUDABackend(GPU)
    _fused_ops(dtype, GPU)


@gpu_only
def test_gpu_device_memory_graphs_and_swap() -> None:
    backend = CUDABackend(GPU)
    info = backend.memory_info()
    assert 0 < info.free_bytes <= info.total_bytes
    assert isinstance(backend.new_decode_graph(), torch.cuda.CUDAGraph)
    (device_cache,) = backend.allocate_kv_cache(1, 8, BLOCK_SIZE, KV_HEADS, HEAD_DIM, torch.bfloat16)
    device_cache.copy_(torch.randn_like(device_cache, dtype=torch.float32).to(torch.bfloat16))
    (host_cache,) = backend.allocate_kv_cache(1, 4, BLOCK_SIZE, KV_HEADS, HEAD_DIM, torch.bfloat16, device=CPU)
    backend.copy_blocks([device_cache], [host_cache], [(5, 0), (2, 3)])  # swap out, then read on the host at once
    assert torch.equal(host_cache[:, 0], device_cache[:, 5].cpu()) and torch.equal(host_cache[:, 3],
                                                                                   device_cache[:, 2].cpu())
    backend.copy_blocks([host_cache], [device_cache], [(3, 7)])  # and back in
    assert torch.equal(device_cache[:, 7], device_cache[:, 2])


# --- the worker ----------------------------------------------------------------------------------------------------


if __name__ == "__main__":  # a worker: `python -P <this file> interpret|compile` (interpret: TRITON_INTERPRET=1)
    work(CHECKS if sys.argv[1] == "interpret" else COMPILED)
