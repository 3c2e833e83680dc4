"""The FAKE torch_npu (tests/fake_torch_npu.py) is as strict as its sources: each release line has exactly its ops
and arguments, and each op refuses what the documentation says the card refuses (block sizes, prefixes, head sizes,
masks, dtypes, layouts), so a backend that breaks a kernel's contract fails its tests here as it would on a card."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.fake_npu_releases import ATB_OPS
from tests.fake_torch_npu import RELEASES, ROTARY_MAX_HEAD_DIM, FakeNPUError, FakeTorchNPU, install_fake_torch_npu
from tests.npu_testing import BLOCK, HEAD_DIM, HEADS, KV_HEADS, NUM_BLOCKS, SMALL_BLOCK, kv_cache

F16 = torch.float16


def _i32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _causal(size: int, dtype: torch.dtype = F16) -> torch.Tensor:
    """The masks' convention in the production callers: float16 the float32 minimum, bfloat16 1 (masked)."""
    fill = torch.finfo(torch.float32).min if dtype == F16 else 1.0
    return torch.zeros(size, size).masked_fill_(torch.ones(size, size, dtype=torch.bool).triu(1), fill).to(dtype)


def _paged_args(dtype: torch.dtype = F16, block: int = SMALL_BLOCK, head: int = HEAD_DIM) -> dict[str, object]:
    cache = torch.randn(2, NUM_BLOCKS, block, KV_HEADS, head).to(dtype)
    q = torch.randn(2, HEADS, head).to(dtype)
    return dict(query=q, key_cache=cache[0], value_cache=cache[1], num_kv_heads=KV_HEADS, num_heads=HEADS,
                scale_value=head**-0.5, block_table=torch.tensor([[3, 1], [2, 0]], dtype=torch.int32),
                context_lens=_i32(min(2 * block, 19), 4), out=torch.empty_like(q))


def _write_args(slots_name: str = "slot_indices") -> dict[str, object]:
    cache = kv_cache(F16, 0)
    k = torch.randn(3, KV_HEADS, HEAD_DIM).half()
    return {"key": k, "value": k.clone(), "key_cache": cache[0], "value_cache": cache[1], slots_name: _i32(5, 17, 40)}


def _scatter_args() -> dict[str, object]:
    return {**_write_args("slot_mapping"), "cache_mode": "Norm"}


def _flash_args(dtype: torch.dtype = F16) -> dict[str, object]:
    q = torch.randn(6, HEADS, HEAD_DIM).to(dtype)
    k = torch.randn(6, KV_HEADS, HEAD_DIM).to(dtype)
    return dict(query=q, key=k, value=k.clone(), mask=_causal(4, dtype), seq_len=_i32(4, 2),
                scale_value=HEAD_DIM**-0.5, num_heads=HEADS, num_kv_heads=KV_HEADS, out=torch.empty_like(q))


def _qlens_args(block: int = BLOCK, head: int = HEAD_DIM, context: int = 2 * BLOCK + 5,
                query: int = 5) -> dict[str, object]:
    cache = torch.randn(2, 8, block, KV_HEADS, head).half()
    q = torch.randn(query, HEADS, head).half()
    return dict(query=q, key_cache=cache[0], value_cache=cache[1], block_table=torch.tensor([[4, 1, 6, 2]]).int(),
                mask=_causal(128), seq_len=_i32(query), context_lens=_i32(context), num_kv_heads=KV_HEADS,
                num_heads=HEADS, scale_value=head**-0.5, out=torch.empty_like(q))


def _splitfuse_mask(query_lens: list[int], context_lens: list[int], dtype: torch.dtype = F16) -> torch.Tensor:
    rows = []
    for qlen, ctx in zip(query_lens, context_lens, strict=True):
        positions = torch.arange(ctx - qlen, ctx).view(-1, 1)
        rows.append((torch.arange(max(context_lens)).view(1, -1) > positions).float() * -10000.0)
    return torch.cat(rows).to(dtype)


def _splitfuse_args(block: int = SMALL_BLOCK) -> dict[str, object]:
    cache = torch.randn(2, NUM_BLOCKS, block, KV_HEADS, HEAD_DIM).half()
    q = torch.randn(1 + 7, HEADS, HEAD_DIM).half()  # a decode and a chunk of 7 after a 13-token prefix
    return dict(query=q, key_cache=cache[0], value_cache=cache[1],
                block_table=torch.tensor([[3, 1], [2, 0]], dtype=torch.int32), context_lens=_i32(19, 20),
                mask=_splitfuse_mask([1, 7], [19, 20]), seq_len=_i32(1, 7), num_kv_heads=KV_HEADS, num_heads=HEADS,
                scale_value=HEAD_DIM**-0.5, out=torch.empty_like(q))


def test_the_fake_ops_run_when_called_right(fake: FakeTorchNPU) -> None:
    ops = fake.module
    ops._npu_reshape_and_cache(**_write_args())
    paged = _paged_args()
    assert ops._npu_paged_attention(**paged) is None  # the result is in `out`, nowhere else
    out = paged["out"]
    assert isinstance(out, torch.Tensor) and bool(torch.isfinite(out).all())
    ops._npu_flash_attention(**_flash_args())
    ops._npu_flash_attention(**_flash_args(torch.bfloat16))
    ops._npu_flash_attention_qlens(**_qlens_args())
    ops._npu_flash_attention_qlens(**_qlens_args(context=5))  # no prefix at all is 128-aligned too
    ops._npu_paged_attention_splitfuse(**_splitfuse_args())
    assert fake.calls == {"_npu_reshape_and_cache": 1, "_npu_paged_attention": 1, "_npu_flash_attention": 2,
                          "_npu_flash_attention_qlens": 2, "_npu_paged_attention_splitfuse": 1}


def _rms_args(dtype: torch.dtype = F16) -> dict[str, object]:
    return {"self": torch.randn(5, HEAD_DIM).to(dtype), "gamma": torch.rand(HEAD_DIM).to(dtype), "epsilon": 1e-5}


def _swiglu_args() -> dict[str, object]:
    return {"input": torch.randn(5, 2 * HEAD_DIM).half(), "dim": -1}


def _rotary_args(shape: tuple[int, int, int, int] = (1, 6, HEADS, HEAD_DIM),
                 table: tuple[int, int, int, int] = (1, 6, 1, HEAD_DIM)) -> dict[str, object]:
    angles = torch.rand(table) * 6.0
    return {"input": torch.randn(shape).half(), "r1": angles.cos().half(), "r2": angles.sin().half()}


@pytest.mark.parametrize(("op", "make", "change", "error"), [
    # dtypes
    ("_npu_reshape_and_cache", _write_args, {"slot_indices": torch.tensor([5, 17, 40])}, "slot_indices: dtype"),
    ("_npu_paged_attention", _paged_args, {"context_lens": torch.tensor([9, 4])}, "context_lens: dtype"),
    ("_npu_paged_attention", _paged_args, {"block_table": torch.tensor([[3, 1], [2, 0]])}, "block_table: dtype"),
    ("_npu_flash_attention", _flash_args, {"seq_len": torch.tensor([4, 2])}, "seq_len: dtype"),
    ("_npu_flash_attention", lambda: {**_flash_args(), "query": torch.randn(6, HEADS, HEAD_DIM)}, {},
     "query: dtype"),
    # shapes, layouts, values
    ("_npu_paged_attention", _paged_args, {"num_kv_heads": HEADS}, "num_kv_heads"),
    ("_npu_paged_attention", _paged_args, {"context_lens": _i32(33, 4)}, "cannot hold 33 tokens"),
    ("_npu_paged_attention", _paged_args, {"block_table": torch.tensor([[3, 99], [2, 0]], dtype=torch.int32)},
     "outside"),
    ("_npu_paged_attention", _paged_args, {"out": torch.empty(2, HEADS, HEAD_DIM + 1).half()}, "out: shape"),
    ("_npu_reshape_and_cache", _write_args, {"slot_indices": _i32(5, 5, 40)}, "twice"),
    ("_npu_reshape_and_cache", _write_args, {"slot_indices": _i32(5, 17, NUM_BLOCKS * SMALL_BLOCK)}, ">="),
    ("_npu_reshape_and_cache", _write_args, {"key": torch.randn(KV_HEADS, 3, HEAD_DIM).half().transpose(0, 1)},
     "contiguous"),
    ("_npu_flash_attention", _flash_args, {"seq_len": _i32(4, 3)}, "sums to 7"),
    ("_npu_flash_attention", _flash_args, {"mask": torch.zeros(3, 3).half()}, "S >= 4"),
    ("_npu_flash_attention", lambda: _flash_args(torch.bfloat16),
     {"mask": torch.full((4, 4), float("-inf")).triu(1).bfloat16()}, "bfloat16 mask holds 0 or 1"),
    # the paged kernels' block and head sizes (ATB PagedAttention)
    ("_npu_paged_attention", lambda: _paged_args(block=8), {}, "multiple of 16"),
    ("_npu_paged_attention", lambda: _paged_args(block=256, head=128), {}, "exceeds 16384"),
    ("_npu_paged_attention", lambda: _paged_args(block=16, head=288), {}, "head size 288"),
    ("_npu_paged_attention_splitfuse", lambda: _splitfuse_args(block=8), {}, "multiple of 16"),
    ("_npu_paged_attention_splitfuse", lambda: _splitfuse_args(block=256), {}, "at most 128"),
    ("_npu_paged_attention_splitfuse", _splitfuse_args,
     {"mask": _splitfuse_mask([1, 7], [19, 20])[:, :19].contiguous()},
     r"expected \[query tokens, longest context\] = \[8, 20\]"),
    ("_npu_paged_attention_splitfuse", _splitfuse_args, {"mask": torch.ones(8, 20).half()}, "additive mask"),
    ("_npu_paged_attention_splitfuse", _splitfuse_args, {"seq_len": _i32(1, 6)}, "sums to 7"),
    # the prefix-encoder kernel (ATB SelfAttention PREFIX_ENCODER)
    ("_npu_flash_attention_qlens", lambda: _qlens_args(block=SMALL_BLOCK, context=21), {}, "exactly 128"),
    ("_npu_flash_attention_qlens", lambda: _qlens_args(context=2 * BLOCK + 5, query=4), {},
     r"prefix lengths \[257\]"),
    ("_npu_flash_attention_qlens", lambda: _qlens_args(head=136), {}, "head size 136"),
    ("_npu_flash_attention_qlens", lambda: _qlens_args(head=40), {}, "head size 40"),
    ("_npu_flash_attention_qlens", _qlens_args, {"mask": _causal(20)}, "compressed"),
    # the cache write's layout
    ("npu_scatter_pa_kv_cache", lambda: {k: v for k, v in _scatter_args().items() if k != "cache_mode"}, {},
     "cache_mode 'PA_NZ' \\(the default\\)"),
    ("npu_scatter_pa_kv_cache", _scatter_args, {"cache_mode": "ND"}, "takes 'Norm' or 'PA_NZ'"),
    # the fused kernels
    ("npu_rms_norm", _rms_args, {"gamma": torch.rand(HEAD_DIM)}, "gamma: dtype"),
    ("npu_rms_norm", _rms_args, {"gamma": torch.rand(HEAD_DIM + 2).half()}, "trailing dimensions"),
    ("npu_rms_norm", _rms_args, {"self": torch.randn(HEAD_DIM).half()}, "1 dimensions"),
    ("npu_rms_norm", _rms_args, {"epsilon": 0}, "epsilon"),
    ("npu_swiglu", _swiglu_args, {"input": torch.randn(2 * HEAD_DIM, 5).half().t()}, "contiguous"),
    ("npu_swiglu", _swiglu_args, {"input": torch.randn(5, 7).half()}, "does not halve"),
    ("npu_swiglu", _swiglu_args, {"input": torch.ones(5, 4, dtype=torch.int32)}, "dtype"),
    ("npu_rotary_mul", _rotary_args, {"input": torch.randn(6, HEADS, HEAD_DIM).half()}, "3 dimensions"),
    ("npu_rotary_mul", _rotary_args, {"r2": torch.zeros(1, 6, 1, HEAD_DIM)}, "r2: dtype"),
    ("npu_rotary_mul", _rotary_args, {"r1": torch.full((1, 6, 1, HEAD_DIM), 1.5).half()}, r"\[-1, 1\]"),
    ("npu_rotary_mul", lambda: _rotary_args((2, 6, HEADS, HEAD_DIM), (1, 1, 1, HEAD_DIM)), {},
     "documented layouts"),
    ("npu_rotary_mul", lambda: _rotary_args((1, 6, HEADS, 2 * ROTARY_MAX_HEAD_DIM), (1, 6, 1, 2 * ROTARY_MAX_HEAD_DIM)),
     {}, "even D below 896"),
    ("npu_rotary_mul", _rotary_args, {"rotary_mode": "interleave"}, "'half' only"),
])
def test_the_fake_refuses_what_hardware_refuses(monkeypatch: pytest.MonkeyPatch, op: str,
                                                make: Callable[[], dict[str, object]], change: dict[str, object],
                                                error: str) -> None:
    fake = install_fake_torch_npu(monkeypatch, release="26.0.0")  # the line with every op
    args = {**make(), **change}
    with pytest.raises(FakeNPUError, match=error):
        getattr(fake.module, op)(**args)
    assert not fake.calls


def test_the_fake_takes_keywords_only_under_their_documented_names(fake: FakeTorchNPU) -> None:
    args = _paged_args()
    with pytest.raises(TypeError):  # positional
        fake.module._npu_paged_attention(*args.values())
    with pytest.raises(TypeError):  # a keyword missing
        fake.module._npu_paged_attention(**{k: v for k, v in args.items() if k != "context_lens"})
    with pytest.raises(TypeError):  # the scatter op's name for the slots, not this op's
        write = _write_args()
        write["slot_mapping"] = write.pop("slot_indices")
        fake.module._npu_reshape_and_cache(**write)
    assert not fake.calls


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_each_release_has_its_own_ops_and_arguments(monkeypatch: pytest.MonkeyPatch, release: str) -> None:
    fake = install_fake_torch_npu(monkeypatch, release=release)
    ops = fake.module
    common = {"_npu_reshape_and_cache", "_npu_flash_attention", "_npu_flash_attention_qlens", "_npu_paged_attention",
              "_npu_paged_attention_splitfuse", "npu_rms_norm", "npu_swiglu", "npu_rotary_mul"}
    assert common <= set(vars(ops))
    if release in ("7.0.0", "7.1.0"):  # the scatter op arrives in 7.2.0
        assert not hasattr(ops, "npu_scatter_pa_kv_cache")
    elif release in ("7.2.0", "7.3.0"):  # without cache_mode: PA_NZ hard-coded
        with pytest.raises(TypeError, match="cache_mode"):
            ops.npu_scatter_pa_kv_cache(**_scatter_args())
        with pytest.raises(FakeNPUError, match="hard-codes cache_mode 'PA_NZ'"):
            ops.npu_scatter_pa_kv_cache(**{k: v for k, v in _scatter_args().items() if k != "cache_mode"})
    else:
        ops.npu_scatter_pa_kv_cache(**_scatter_args())
        assert "cache_mode" in [a.name for a in ops.npu_scatter_pa_kv_cache.default._schema.arguments]
    paged = _paged_args()
    if release in ("7.0.0", "7.1.0"):  # `workspace=` arrives in 7.2.0
        with pytest.raises(TypeError, match="workspace"):
            ops._npu_paged_attention(**paged, workspace=None)
    else:
        ops._npu_paged_attention(**paged, workspace=None)
    assert ops.__version__ == RELEASES[release].torch_npu


def test_without_nnal_every_atb_op_raises_what_torch_npu_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = install_fake_torch_npu(monkeypatch, nnal=False)
    for name in sorted(ATB_OPS):
        with pytest.raises(OSError, match="nnal package is installed"):
            getattr(fake.module, name)()
    fake.module.npu_swiglu(torch.randn(2, 4).half())  # the torch_npu ops outside ATB still run


def test_the_fake_allocator_cache_counts_as_used_until_emptied(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = install_fake_torch_npu(monkeypatch, free_bytes=10, cached_bytes=6, total_bytes=64)
    assert fake.npu.mem_get_info() == (10, 64)
    fake.npu.empty_cache()
    assert fake.npu.mem_get_info() == (16, 64) and fake.npu.empty_cache_calls == 1
