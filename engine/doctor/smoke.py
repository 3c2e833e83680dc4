"""Numeric smoke tests of every op the npu backend calls, run through the backend itself on the card and compared
with a CPU reference (the CPU backend's attention, the eager layers): the cache write, prefill (the flash kernel),
prefix prefill (the prefix encoder), decode (paged attention), a chunked-prefill step (SplitFuse), and the fused
RMSNorm, RoPE and SwiGLU, the MoE chain (both gating ops, init_routing_v2, the grouped matmuls, swiglu, the combine)
and the MLA cache write and decode against the torch reference (`Backend`'s), in float16 and bfloat16; the MoE and
MLA tests are skipped where the stack lacks their ops (only a MoE or MLA model needs them).
Each test checks that the step went to the kernel it names, so a
routing change cannot make a test pass on another kernel. A few tokens each: milliseconds on a card, which is why the
engine runs them at start-up too (`checks.preflight`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from npuserve.engine.backends.base import AttentionMetadata, grouped_experts, select_experts
from npuserve.engine.backends.cpu import CPUBackend
from npuserve.engine.backends.npu import NPUBackend
from npuserve.engine.backends.npu_fused import FusedRMSNorm, FusedRotary, FusedSwiGLU
from npuserve.engine.backends.npu_moe import lay_out_experts
from npuserve.engine.backends.npu_stack import (
    DECODE_OP,
    FIA_OP,
    FLASH_OP,
    KV_RMSNORM_ROPE_CACHE_OP,
    PREFIX_OP,
    SPLITFUSE_OP,
)
from npuserve.engine.batch import build_decode, build_prefill
from npuserve.engine.doctor.report import DoctorCheck
from npuserve.engine.model.layers import RMSNorm, RotaryEmbedding, silu_and_mul
from npuserve.engine.sequence import SamplingParams, Sequence
from npuserve.modelspec import MoESpec

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 128  # GQA, the head size of the Llama-family models served
NUM_BLOCKS = 8
DTYPES = (torch.float16, torch.bfloat16)
# Relative to the reference's largest value: the kernels accumulate in float32 and round once more or less.
TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 4e-2}
CPU = torch.device("cpu")
# Qwen3-MoE's routing (128 experts, 8 per token) and DeepSeek-V3's exactly (256 experts in 8 groups, 4 kept, 8 per
# token: an older vllm-ascend calls npu_moe_gating_top_k for that pattern only), at a small hidden and intermediate
MOE_SPECS = (MoESpec(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=96, norm_topk_prob=True),
             MoESpec(num_experts=256, num_experts_per_tok=8, moe_intermediate_size=96, norm_topk_prob=True,
                     scoring_func="sigmoid", topk_method="noaux_tc", n_group=8, topk_group=4,
                     routed_scaling_factor=2.5))
MOE_HIDDEN = 128
MLA_HEADS, KV_LORA, ROPE = 16, 512, 64  # DeepSeek-V3's latent and rope widths, its 128 heads over 8 ranks


class SmokeSkipped(Exception):
    """The stack lacks the ops a smoke test exercises (fine for a model that does not need them)."""


@contextmanager
def _must_call(backend: NPUBackend, op: str) -> Iterator[None]:
    """The block must call `op` on the card (not fall back to the torch reference)."""
    ops = backend._ops
    real = getattr(ops, op)
    called = []

    def spy(*args: object, **kwargs: object) -> object:
        called.append(op)
        return real(*args, **kwargs)

    setattr(ops, op, spy)
    try:
        yield
    finally:
        setattr(ops, op, real)
    if not called:
        raise AssertionError(f"the step did not go to {op}")


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


def _moe(backend: NPUBackend) -> str:
    missing = backend.stack.missing_moe()
    if missing:
        raise SmokeSkipped(f"{', '.join(missing)} absent: MoE models are refused on this stack")
    dev, errors = backend.device, []
    for dtype in DTYPES:
        for moe in MOE_SPECS:
            gen = torch.Generator().manual_seed(3)
            logits = torch.randn(7, moe.num_experts, generator=gen).to(dtype)
            bias = 0.1 * torch.randn(moe.num_experts, generator=gen) if moe.scoring_func == "sigmoid" else None
            x = torch.randn(7, MOE_HIDDEN, generator=gen).to(dtype)
            inter = moe.moe_intermediate_size
            w13 = (0.1 * torch.randn(moe.num_experts, 2 * inter, MOE_HIDDEN, generator=gen)).to(dtype)
            w2 = (0.1 * torch.randn(moe.num_experts, MOE_HIDDEN, inter, generator=gen)).to(dtype)
            weights, ids = select_experts(logits, moe, bias)
            expected = grouped_experts(x, weights, ids, w13, w2)
            gating = "npu_moe_gating_top_k" if moe.scoring_func == "sigmoid" else "npu_moe_gating_top_k_softmax"
            npu_bias = bias.to(dev) if bias is not None else None
            with _must_call(backend, gating):
                got_w, got_ids = backend.moe_select_experts(logits.to(dev), moe, npu_bias)
            chosen = {(t, int(e)): float(w) for t in range(7) for e, w in zip(got_ids[t], got_w[t], strict=True)}
            wanted = {(t, int(e)): float(w) for t in range(7) for e, w in zip(ids[t], weights[t], strict=True)}
            if chosen.keys() != wanted.keys() or max(abs(chosen[k] - wanted[k]) for k in chosen) > 1e-2:
                raise AssertionError(f"{gating} in {dtype}: a different choice of experts than the reference")
            holder = torch.nn.Module()
            holder.w13, holder.w2 = torch.nn.Parameter(w13.to(dev)), torch.nn.Parameter(w2.to(dev))
            lay_out_experts(holder)
            with _must_call(backend, "npu_grouped_matmul"):
                actual = backend.moe_experts(x.to(dev), weights.to(dev), ids.to(dev), holder.w13.data,
                                             holder.w2.data)
            error = _error(actual, expected)
            if error > TOLERANCE[dtype]:
                raise AssertionError(f"the MoE chain in {dtype}: off the reference by {error:.1e} (relative)")
            errors.append(error)
    return (f"gating, init_routing_v2, grouped matmul, swiglu, {backend.stack.moe_combine_op} equal the reference "
            f"(worst {max(errors):.0e})")


def _mla(backend: NPUBackend) -> str:
    missing = backend.stack.missing_mla()
    if missing:
        raise SmokeSkipped(f"{', '.join(missing)} absent: MLA models are refused on this stack")
    dev, block, errors = backend.device, 128, []
    seqs = _sequences([1, 130, 257], [0, 129, 256], block)
    for dtype in DTYPES:
        gen = torch.Generator().manual_seed(4)
        tokens = 5
        angles = torch.rand(tokens, ROPE // 2, generator=gen) * 6
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
        kv_a = torch.randn(tokens, KV_LORA + ROPE, generator=gen).to(dtype)
        gamma = (1 + 0.1 * torch.randn(KV_LORA, generator=gen)).to(dtype)
        slots = torch.tensor([3, 400, 170, 990, 64])
        latent = torch.randn(NUM_BLOCKS, block, 1, KV_LORA, generator=gen).to(dtype)
        rope = torch.randn(NUM_BLOCKS, block, 1, ROPE, generator=gen).to(dtype)
        ref_latent, ref_rope = latent.clone(), rope.clone()
        expected = CPUBackend().mla_write_cache(kv_a, gamma, 1e-6, cos, sin, slots, ref_latent, ref_rope, True)
        npu_latent, npu_rope = latent.to(dev), rope.to(dev)
        with _must_call(backend, KV_RMSNORM_ROPE_CACHE_OP):
            actual = torch.cat(backend.mla_write_cache(kv_a.to(dev), gamma.to(dev), 1e-6, cos.to(dev), sin.to(dev),
                                                       slots.to(dev), npu_latent, npu_rope, True), dim=-1)
        write_error = max(_error(actual, torch.cat(expected, dim=-1)), _error(npu_latent, ref_latent),
                          _error(npu_rope, ref_rope))
        q_latent = (0.05 * torch.randn(3, MLA_HEADS, KV_LORA, generator=gen)).to(dtype)
        q_pe = (0.05 * torch.randn(3, MLA_HEADS, ROPE, generator=gen)).to(dtype)
        reference = CPUBackend().mla_decode_attention(q_latent, q_pe, ref_latent, ref_rope,
                                                      build_decode(seqs, block, CPU).meta, 0.07)
        with _must_call(backend, FIA_OP):
            out = backend.mla_decode_attention(q_latent.to(dev), q_pe.to(dev), npu_latent, npu_rope,
                                               build_decode(seqs, block, dev).meta, 0.07)
        error = max(write_error, _error(out, reference))
        if error > TOLERANCE[dtype]:
            raise AssertionError(f"the MLA cache write or decode in {dtype}: off the reference by {error:.1e}")
        errors.append(error)
    return f"{KV_RMSNORM_ROPE_CACHE_OP} and {FIA_OP} (MLA decode) equal the reference (worst {max(errors):.0e})"


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
    "smoke: moe": _moe,
    "smoke: mla": _mla,
}


def smoke_checks(backend: NPUBackend) -> list[DoctorCheck]:
    checks = []
    for name, test in SMOKE_TESTS.items():
        try:
            with torch.inference_mode():
                detail = test(backend)
            checks.append(DoctorCheck(name=name, status="ok", detail=detail))
        except SmokeSkipped as e:
            checks.append(DoctorCheck(name=name, status="skip", detail=str(e)))
        except Exception as e:  # any failure of an op on the card is the check's finding
            checks.append(DoctorCheck(name=name, status="fail", detail=f"{type(e).__name__}: {e}"))
    return checks
