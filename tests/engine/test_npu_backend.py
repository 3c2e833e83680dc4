"""The `npu` backend's code, run against the FAKE torch_npu (tests/fake_torch_npu.py): no NPU is here.

What this proves: the backend calls the ops with the documented keywords, dtypes (int32 slots, lengths and block
tables), shapes, layouts and contiguity, its slot mappings and block tables address the right cache rows, and its
results equal the CPU backend's (the cache write exactly, attention within float16/bfloat16 rounding, greedy tokens
of the tiny model exactly, with and without the fused RMSNorm/RoPE/SwiGLU kernels swapped in). What it cannot
prove: the real kernels' numerics and speed, host-versus-device placement, HCCL, graphs, memory (docs/engine.md,
"The npu backend and its fake").
"""

from __future__ import annotations

import logging
import math
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")

import torch
from torch import nn

from npuserve.engine.backends.cpu import CPUBackend
from npuserve.engine.backends.npu import (
    FusedRMSNorm,
    FusedRotary,
    FusedSwiGLU,
    NPUBackend,
    causal_mask,
    local_device_index,
    parse_visible_devices,
)
from npuserve.engine.batch import build_decode, build_prefill
from npuserve.engine.model.layers import RMSNorm, RotaryEmbedding, silu_and_mul
from npuserve.engine.model.llama import MLP, LlamaForCausalLM
from npuserve.engine.model.loader import load_model
from npuserve.engine.runner import KVPlan, ModelRunner
from npuserve.engine.sequence import Sequence
from npuserve.modelspec import ModelSpec
from tests.fake_torch_npu import ROTARY_MAX_HEAD_DIM, FakeNPUError, FakeTorchNPU, install_fake_torch_npu
from tests.paged_inputs import greedy_tokens, random_kv_cache, shuffled_sequences

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 32  # GQA: 4 query heads per KV head
BLOCK_SIZE, NUM_BLOCKS = 8, 64
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 2e-2}
CPU = torch.device("cpu")


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeTorchNPU]:
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    yield install_fake_torch_npu(monkeypatch)


@pytest.fixture
def npu(fake: FakeTorchNPU) -> NPUBackend:
    return NPUBackend(device=fake.device)


# --- device selection ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("ids", "rank", "visible", "expected"), [
    (None, 0, None, 0),
    (None, 3, None, 3),
    ([2, 3], 1, None, 3),
    ([0, 1, 2, 3], 2, "4,5,6,7", 2),  # logical ids within the visible cards
    ([1], 0, " 6, 7 ", 1),
    ([5], 0, "", 5),  # empty: unset
])
def test_local_device_index(ids: list[int] | None, rank: int, visible: str | None, expected: int) -> None:
    environ = {} if visible is None else {"ASCEND_RT_VISIBLE_DEVICES": visible}
    assert local_device_index(ids, rank, environ) == expected


@pytest.mark.parametrize(("ids", "rank", "visible", "error"), [
    ([0, 1], 2, None, "rank 2 has no card"),
    ([0, 0], 0, None, "twice"),
    ([-1], 0, None, "negative"),
    ([4], 0, "4,5", "physical card 4 is logical id 0"),  # a physical id where a logical one belongs
    ([3], 0, "0,1", "2 card\\(s\\) visible"),
    ([0], 0, "0,x", "comma-separated"),
    ([0], 0, "1,1", "twice"),
])
def test_local_device_index_refuses(ids: list[int], rank: int, visible: str | None, error: str) -> None:
    environ = {} if visible is None else {"ASCEND_RT_VISIBLE_DEVICES": visible}
    with pytest.raises(ValueError, match=error):
        local_device_index(ids, rank, environ)


def test_parse_visible_devices() -> None:
    assert parse_visible_devices(None) is None
    assert parse_visible_devices(" ") is None
    assert parse_visible_devices("3,1") == [3, 1]


def test_backend_takes_its_card_memory_and_synchronize_from_torch_npu(fake: FakeTorchNPU,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "4,5,6,7")
    backend = NPUBackend([0, 1, 2, 3], rank=2, device=fake.device)
    assert backend.name == "npu"
    assert backend.device_index == 2 and fake.npu.set_device_calls == [2]
    assert backend.memory_info().free_bytes == fake.npu.free_bytes
    assert backend.memory_info().total_bytes == fake.npu.total_bytes
    backend.synchronize()
    assert fake.npu.synchronize_calls == 1


def test_backend_refuses_a_card_torch_npu_does_not_see(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    fake = install_fake_torch_npu(monkeypatch, physical_cards=2)
    with pytest.raises(RuntimeError, match="sees 2 card"):
        NPUBackend([0, 1, 2, 3], rank=3, device=fake.device)


def test_backend_refuses_float32_caches(npu: NPUBackend) -> None:
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        npu.allocate_kv_cache(1, 4, BLOCK_SIZE, KV_HEADS, HEAD_DIM, torch.float32)
    (cache,) = npu.allocate_kv_cache(1, 4, BLOCK_SIZE, KV_HEADS, HEAD_DIM, torch.float16)
    assert cache.shape == (2, 4, BLOCK_SIZE, KV_HEADS, HEAD_DIM)


def test_importing_the_module_needs_no_torch_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    # in a fresh interpreter: the import alone must not pull torch_npu in (it needs Ascend's CANN runtime)
    code = ("import sys\nimport npuserve.engine.backends.npu\n"
            "print('torch_npu' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
    # and building the backend where torch_npu cannot be imported says so
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    with pytest.raises(RuntimeError, match="needs torch_npu"):
        NPUBackend(device=CPU)


# --- batches -----------------------------------------------------------------------------------------------------


def _sequences(total: list[int], cached: list[int], seed: int) -> list[Sequence]:
    return shuffled_sequences(total, cached, seed, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)


def _cache(dtype: torch.dtype, seed: int) -> torch.Tensor:
    return random_kv_cache(dtype, seed, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, kv_heads=KV_HEADS,
                           head_dim=HEAD_DIM)


def _qkv(tokens: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as the model makes them: views of one fused projection (k and v not contiguous)."""
    gen = torch.Generator().manual_seed(seed)
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    qkv = torch.randn(tokens, width, generator=gen).to(dtype)
    q, k, v = torch.split(qkv, [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    return (q.reshape(tokens, HEADS, HEAD_DIM), k.reshape(tokens, KV_HEADS, HEAD_DIM),
            v.reshape(tokens, KV_HEADS, HEAD_DIM))


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


DTYPES = [torch.float16, torch.bfloat16]


# --- the cache write ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_fills_the_same_slots_as_the_cpu_backend(npu: NPUBackend, dtype: torch.dtype) -> None:
    seqs = _sequences([5, 17, 1, 30], [0, 0, 0, 0], seed=1)
    batch = build_prefill(seqs, BLOCK_SIZE, CPU)
    _, k, v = _qkv(batch.input_ids.shape[0], dtype, seed=2)
    expected, actual = _cache(dtype, 3), _cache(dtype, 3)
    CPUBackend().write_kv(expected, k, v, batch.meta.slot_mapping)
    npu.write_kv(actual, k, v, batch.meta.slot_mapping)
    assert torch.equal(actual, expected)


# --- prefill -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("entry", ["attention", "prefill_attention"])
def test_prefill_matches_the_cpu_backend(fake: FakeTorchNPU, npu: NPUBackend, dtype: torch.dtype,
                                         entry: str) -> None:
    seqs = _sequences([7, 23, 1, 16, 40], [0] * 5, seed=4)
    cpu_meta, npu_meta = (build_prefill(seqs, BLOCK_SIZE, CPU).meta for _ in range(2))  # one per backend
    tokens = sum(s.num_tokens for s in seqs)
    q, k, v = _qkv(tokens, dtype, seed=5)
    cpu_cache, npu_cache = _cache(dtype, 6), _cache(dtype, 6)
    expected = CPUBackend().attention(q, k, v, cpu_cache, cpu_meta)
    if entry == "attention":
        actual = npu.attention(q, k, v, npu_cache, npu_meta)
    else:
        npu.write_kv(npu_cache, k, v, npu_meta.slot_mapping)
        actual = npu.prefill_attention(q, npu_cache, npu_meta)
    assert torch.equal(npu_cache, cpu_cache)
    _assert_close(actual, expected, dtype)
    assert fake.calls["_npu_flash_attention"] == 1 and fake.calls["_npu_flash_attention_qlens"] == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_with_prefix_cache_hits_matches_the_cpu_backend(fake: FakeTorchNPU, npu: NPUBackend,
                                                                dtype: torch.dtype) -> None:
    # hits of whole blocks and, as chunked prefill leaves them, of part of one; one sequence without a hit
    seqs = _sequences([20, 33, 9, 12], [16, 8, 0, 5], seed=7)
    cpu_meta, npu_meta = (build_prefill(seqs, BLOCK_SIZE, CPU).meta for _ in range(2))  # one per backend
    tokens = sum(s.num_tokens - s.num_cached_tokens for s in seqs)
    q, k, v = _qkv(tokens, dtype, seed=8)
    cpu_cache, npu_cache = _cache(dtype, 9), _cache(dtype, 9)
    expected = CPUBackend().attention(q, k, v, cpu_cache, cpu_meta)
    actual = npu.attention(q, k, v, npu_cache, npu_meta)
    assert torch.equal(npu_cache, cpu_cache)
    _assert_close(actual, expected, dtype)
    assert fake.calls["_npu_flash_attention_qlens"] == 1 and fake.calls["_npu_flash_attention"] == 0


# --- decode ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_matches_the_cpu_backend(fake: FakeTorchNPU, npu: NPUBackend, dtype: torch.dtype) -> None:
    lengths = [1, 8, 9, 31, 64, 17]
    seqs = _sequences(lengths, [n - 1 for n in lengths], seed=10)
    cpu_meta, npu_meta = (build_decode(seqs, BLOCK_SIZE, CPU).meta for _ in range(2))
    q, k, v = _qkv(len(seqs), dtype, seed=11)
    cpu_cache, npu_cache = _cache(dtype, 12), _cache(dtype, 12)
    expected = CPUBackend().attention(q, k, v, cpu_cache, cpu_meta)
    actual = npu.attention(q, k, v, npu_cache, npu_meta)
    assert torch.equal(npu_cache, cpu_cache)
    _assert_close(actual, expected, dtype)
    # decode_attention alone, over the cache as it now is
    _assert_close(npu.decode_attention(q, npu_cache, npu_meta), expected, dtype)
    assert fake.calls["_npu_paged_attention"] == 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_chunked_prefill_step_matches_the_cpu_backend(fake: FakeTorchNPU, npu: NPUBackend,
                                                        dtype: torch.dtype) -> None:
    # two decodes ride in front of two prompt chunks (one continuing a prompt, one starting one)
    seqs = _sequences([12, 40, 30, 25], [11, 39, 8, 0], seed=13)
    new = [1, 1, 10, 16]
    cpu_meta, npu_meta = (build_prefill(seqs, BLOCK_SIZE, CPU, new).meta for _ in range(2))
    assert npu_meta.decode_part is not None and npu_meta.prefill_part is not None
    q, k, v = _qkv(sum(new), dtype, seed=14)
    cpu_cache, npu_cache = _cache(dtype, 15), _cache(dtype, 15)
    expected = CPUBackend().attention(q, k, v, cpu_cache, cpu_meta)
    actual = npu.attention(q, k, v, npu_cache, npu_meta)
    assert torch.equal(npu_cache, cpu_cache)
    _assert_close(actual, expected, dtype)
    assert fake.calls["_npu_paged_attention"] == 1 and fake.calls["_npu_flash_attention_qlens"] == 1


# --- the fake is strict --------------------------------------------------------------------------------------------


def _paged_args(dtype: torch.dtype = torch.float16) -> dict[str, object]:
    cache = _cache(dtype, 0)
    q = torch.randn(2, HEADS, HEAD_DIM).to(dtype)
    return dict(query=q, key_cache=cache[0], value_cache=cache[1], num_kv_heads=KV_HEADS, num_heads=HEADS,
                scale_value=HEAD_DIM**-0.5, block_table=torch.tensor([[3, 1], [2, 0]], dtype=torch.int32),
                context_lens=torch.tensor([9, 4], dtype=torch.int32), out=torch.empty_like(q))


def _scatter_args() -> dict[str, object]:
    cache = _cache(torch.float16, 0)
    k = torch.randn(3, KV_HEADS, HEAD_DIM).half()
    return dict(key=k, value=k.clone(), key_cache=cache[0], value_cache=cache[1],
                slot_mapping=torch.tensor([5, 17, 40], dtype=torch.int32), cache_mode="Norm")


def _flash_args(dtype: torch.dtype = torch.float16) -> dict[str, object]:
    q = torch.randn(6, HEADS, HEAD_DIM).to(dtype)
    k = torch.randn(6, KV_HEADS, HEAD_DIM).to(dtype)
    return dict(query=q, key=k, value=k.clone(), mask=causal_mask(4, dtype, CPU),
                seq_len=torch.tensor([4, 2], dtype=torch.int32), scale_value=HEAD_DIM**-0.5, num_heads=HEADS,
                num_kv_heads=KV_HEADS, out=torch.empty_like(q))


def test_the_fake_ops_run_when_called_right(fake: FakeTorchNPU) -> None:
    ops = fake.module
    ops.npu_scatter_pa_kv_cache(**_scatter_args())
    paged = _paged_args()
    assert ops._npu_paged_attention(**paged) is None  # the result is in `out`, nowhere else
    out = paged["out"]
    assert isinstance(out, torch.Tensor) and bool(torch.isfinite(out).all())
    ops._npu_flash_attention(**_flash_args())
    ops._npu_flash_attention(**_flash_args(torch.bfloat16))
    assert fake.calls == {"npu_scatter_pa_kv_cache": 1, "_npu_paged_attention": 1, "_npu_flash_attention": 2}


def _rms_args(dtype: torch.dtype = torch.float16) -> dict[str, object]:
    return {"self": torch.randn(5, HEAD_DIM).to(dtype), "gamma": torch.rand(HEAD_DIM).to(dtype), "epsilon": 1e-5}


def _swiglu_args() -> dict[str, object]:
    return {"input": torch.randn(5, 2 * HEAD_DIM).half(), "dim": -1}


def _rotary_args(shape: tuple[int, int, int, int] = (1, 6, HEADS, HEAD_DIM),
                 table: tuple[int, int, int, int] = (1, 6, 1, HEAD_DIM)) -> dict[str, object]:
    angles = torch.rand(table) * 6.0
    return {"input": torch.randn(shape).half(), "r1": angles.cos().half(), "r2": angles.sin().half()}


@pytest.mark.parametrize(("op", "make", "change", "error"), [
    # dtypes
    ("npu_scatter_pa_kv_cache", _scatter_args, {"slot_mapping": torch.tensor([5, 17, 40])}, "slot_mapping: dtype"),
    ("_npu_paged_attention", _paged_args, {"context_lens": torch.tensor([9, 4])}, "context_lens: dtype"),
    ("_npu_paged_attention", _paged_args, {"block_table": torch.tensor([[3, 1], [2, 0]])}, "block_table: dtype"),
    ("_npu_flash_attention", _flash_args, {"seq_len": torch.tensor([4, 2])}, "seq_len: dtype"),
    ("_npu_flash_attention", lambda: {**_flash_args(), "query": torch.randn(6, HEADS, HEAD_DIM)}, {},
     "query: dtype"),
    # shapes, layouts, values
    ("_npu_paged_attention", _paged_args, {"num_kv_heads": HEADS}, "num_kv_heads"),
    ("_npu_paged_attention", _paged_args, {"context_lens": torch.tensor([17, 4], dtype=torch.int32)},
     "cannot hold 17 tokens"),
    ("_npu_paged_attention", _paged_args, {"block_table": torch.tensor([[3, 99], [2, 0]], dtype=torch.int32)},
     "outside"),
    ("_npu_paged_attention", _paged_args, {"out": torch.empty(2, HEADS, HEAD_DIM + 1).half()}, "out: shape"),
    ("npu_scatter_pa_kv_cache", _scatter_args, {"slot_mapping": torch.tensor([5, 5, 40], dtype=torch.int32)},
     "twice"),
    ("npu_scatter_pa_kv_cache", _scatter_args,
     {"slot_mapping": torch.tensor([5, 17, NUM_BLOCKS * BLOCK_SIZE], dtype=torch.int32)}, ">="),
    ("npu_scatter_pa_kv_cache", _scatter_args,
     {"key": torch.randn(KV_HEADS, 3, HEAD_DIM).half().transpose(0, 1)}, "contiguous"),
    ("_npu_flash_attention", _flash_args, {"seq_len": torch.tensor([4, 3], dtype=torch.int32)}, "sums to 7"),
    ("_npu_flash_attention", _flash_args, {"mask": torch.zeros(3, 3).half()}, "S >= 4"),
    ("_npu_flash_attention", lambda: _flash_args(torch.bfloat16),
     {"mask": torch.full((4, 4), float("-inf")).triu(1).bfloat16()}, "bfloat16 mask holds 0 or 1"),
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
def test_the_fake_refuses_what_hardware_refuses(fake: FakeTorchNPU, op: str, make: Callable[[], dict[str, object]],
                                                change: dict[str, object], error: str) -> None:
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
    with pytest.raises(TypeError):  # `_npu_reshape_and_cache`'s name for the slots, not this op's
        scatter = _scatter_args()
        scatter["slot_indices"] = scatter.pop("slot_mapping")
        fake.module.npu_scatter_pa_kv_cache(**scatter)
    assert not fake.calls


def test_the_fake_qlens_op_wants_the_compressed_mask(fake: FakeTorchNPU) -> None:
    seqs = _sequences([20], [8], seed=16)
    meta = build_prefill(seqs, BLOCK_SIZE, CPU).meta
    cache = _cache(torch.float16, 0)
    q = torch.randn(12, HEADS, HEAD_DIM).half()
    args: dict[str, object] = dict(
        query=q, key_cache=cache[0], value_cache=cache[1], block_table=meta.block_tables.int(),
        mask=causal_mask(20, torch.float16, CPU), seq_len=torch.tensor([12], dtype=torch.int32),
        context_lens=torch.tensor([20], dtype=torch.int32), num_kv_heads=KV_HEADS, num_heads=HEADS,
        scale_value=HEAD_DIM**-0.5, out=torch.empty_like(q))
    with pytest.raises(FakeNPUError, match="compressed"):
        fake.module._npu_flash_attention_qlens(**args)
    args["mask"] = causal_mask(128, torch.float16, CPU)
    fake.module._npu_flash_attention_qlens(**args)


# --- greedy generation through the model runner ----------------------------------------------------------------




@pytest.mark.parametrize("fused", [False, True], ids=["eager-layers", "fused-kernels"])
def test_greedy_generation_equals_the_cpu_backend(fake: FakeTorchNPU, npu: NPUBackend, tiny_model_dir: Path,
                                                  monkeypatch: pytest.MonkeyPatch, fused: bool) -> None:
    dtype = torch.float16  # the Ascend kernels take float16 or bfloat16, not the preset's float32
    spec = ModelSpec.from_pretrained(tiny_model_dir)
    cpu_model, npu_model = (load_model(spec, tiny_model_dir, dtype, CPU) for _ in range(2))
    if fused:
        npu.prepare_model(npu_model)
    else:
        monkeypatch.setattr(npu, "prepare_model", lambda model: None)  # should the runner call it
    plan = KVPlan(num_blocks=48, num_host_blocks=0, block_size=BLOCK_SIZE, bytes_per_block=0, source="test")
    gen = torch.Generator().manual_seed(17)
    prompts = [torch.randint(5, spec.vocab_size, (n,), generator=gen).tolist() for n in (3, 21, 9, 30, 6)]
    expected = greedy_tokens(ModelRunner(cpu_model, CPUBackend(), plan, dtype), prompts, steps=12, seed=18)
    actual = greedy_tokens(ModelRunner(npu_model, npu, plan, dtype), prompts, steps=12, seed=18)
    assert actual == expected
    assert fake.calls["_npu_flash_attention"] > 0 and fake.calls["_npu_flash_attention_qlens"] > 0
    assert fake.calls["_npu_paged_attention"] > 0
    fused_calls = [fake.calls[op] for op in ("npu_rms_norm", "npu_rotary_mul", "npu_swiglu")]
    assert all(fused_calls) if fused else not any(fused_calls)


# --- tensor parallel and decode graphs ---------------------------------------------------------------------------


def test_tensor_parallel_runs_over_hccl(npu: NPUBackend) -> None:
    assert NPUBackend.dist_backend == "hccl" and npu.dist_backend == "hccl"


def test_decode_graphs_are_off(npu: NPUBackend) -> None:
    # `_npu_paged_attention` reads its host lengths at launch: a graph would replay the capture's (new_decode_graph)
    assert npu.new_decode_graph() is None
    with pytest.raises(NotImplementedError):
        npu.graph_capture(object(), None)


# --- fused kernels -------------------------------------------------------------------------------------------------


def test_the_fake_fused_kernels_compute_their_documented_formulas(fake: FakeTorchNPU) -> None:
    ops = fake.module
    y, rstd = ops.npu_rms_norm(torch.tensor([[3.0, 4.0]]), torch.tensor([1.0, 2.0]), epsilon=0.0)
    torch.testing.assert_close(y, torch.tensor([[3.0, 8.0]]) / math.sqrt(12.5))
    torch.testing.assert_close(rstd, torch.tensor([[1 / math.sqrt(12.5)]]))
    torch.testing.assert_close(ops.npu_swiglu(torch.tensor([[2.0, -1.0, 3.0, 5.0]])),
                               torch.tensor([[2.0 * torch.sigmoid(torch.tensor(2.0)).item() * 3.0,
                                              -1.0 * torch.sigmoid(torch.tensor(-1.0)).item() * 5.0]]))
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 1, 1, 4)
    one, zero = torch.ones(1, 1, 1, 4), torch.zeros(1, 1, 1, 4)
    torch.testing.assert_close(ops.npu_rotary_mul(x, one, zero), x)  # cos 1: unchanged
    torch.testing.assert_close(ops.npu_rotary_mul(x, zero, one), torch.tensor([-3.0, -4.0, 1.0, 2.0]).view(1, 1, 1, 4))
    assert fake.calls == {"npu_rms_norm": 1, "npu_swiglu": 1, "npu_rotary_mul": 2}


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_rms_norm_matches_the_eager_one(fake: FakeTorchNPU, npu: NPUBackend, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(20)
    hidden = RMSNorm(HEADS * HEAD_DIM, 1e-5).to(dtype)
    per_head = RMSNorm(HEAD_DIM, 1e-6).to(dtype)  # qwen3's q/k norm
    mixed = RMSNorm(HEAD_DIM, 1e-6)  # float32 weights: the kernel wants gamma in the input's dtype
    with torch.no_grad():
        for norm in (hidden, per_head, mixed):
            norm.weight.copy_(1 + 0.1 * torch.randn(norm.weight.shape, generator=gen))
    x = (3 * torch.randn(7, HEADS * HEAD_DIM, generator=gen)).to(dtype)
    q, _, _ = _qkv(7, dtype, seed=21)  # a view of the fused projection, not contiguous
    expected = hidden(x), per_head(q), mixed(q)
    npu.prepare_model(nn.ModuleList([hidden, per_head, mixed]))
    assert all(isinstance(vars(m).get("forward"), FusedRMSNorm) for m in (hidden, per_head, mixed))
    actual = hidden(x), per_head(q), mixed(q)
    for a, e in zip(actual[:2], expected[:2], strict=True):
        _assert_close(a, e, dtype)
    assert torch.equal(actual[2], expected[2])  # left to the eager forward
    assert fake.calls["npu_rms_norm"] == 2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0,
                                             "original_max_position_embeddings": 1024}])
def test_fused_rope_matches_the_eager_one(fake: FakeTorchNPU, npu: NPUBackend, dtype: torch.dtype,
                                          scaling: dict[str, object] | None) -> None:
    rotary = RotaryEmbedding(HEAD_DIM, 4096, 10000.0, scaling)
    positions = torch.tensor([0, 1, 2, 37, 1000, 4095, 5])
    q, k, _ = _qkv(len(positions), dtype, seed=22)  # views of the fused projection, as the model makes them
    expected = rotary(positions, q, k)
    npu.prepare_model(rotary)
    assert isinstance(rotary.forward, FusedRotary)
    actual = rotary(positions, q, k)
    for a, e in zip(actual, expected, strict=True):
        _assert_close(a, e, dtype)
    assert fake.calls["npu_rotary_mul"] == 2  # q and k


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_swiglu_matches_silu_and_mul(fake: FakeTorchNPU, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(23)
    x = (3 * torch.randn(7, 2 * 96, generator=gen)).to(dtype)
    _assert_close(FusedSwiGLU(fake.module)(x), silu_and_mul(x), dtype)
    assert fake.calls["npu_swiglu"] == 1


def _model(tiny_model_dir: Path, dtype: torch.dtype, qk_norm: bool = False) -> LlamaForCausalLM:
    spec = ModelSpec.from_pretrained(tiny_model_dir).model_copy(update={"qk_norm": qk_norm})
    return load_model(spec, None, dtype, CPU)  # random weights


def test_prepare_model_swaps_exactly_the_leaf_kernels(fake: FakeTorchNPU, npu: NPUBackend, tiny_model_dir: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(tiny_model_dir, torch.float16, qk_norm=True)
    layers = model.spec.num_layers
    state = {name: t.clone() for name, t in model.state_dict().items()}
    kinds = {name: type(m) for name, m in model.named_modules() if not name.endswith(".act_fn")}
    npu.prepare_model(model)

    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 4 * layers + 1  # input, post-attention, q and k norms per layer; the final norm
    assert all(isinstance(vars(m).get("forward"), FusedRMSNorm) for m in norms)
    rotaries = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
    assert len(rotaries) == 1 and isinstance(vars(rotaries[0]).get("forward"), FusedRotary)  # shared by the layers
    mlps = [m for m in model.modules() if isinstance(m, MLP)]
    assert len(mlps) == layers and all(isinstance(m.act_fn, FusedSwiGLU) for m in mlps)
    # nothing else: no other module's forward, no module replaced, every parameter and buffer as it was
    assert [name for name, m in model.named_modules()
            if "forward" in vars(m) and not isinstance(m, RMSNorm | RotaryEmbedding)] == []
    assert {name: type(m) for name, m in model.named_modules() if not name.endswith(".act_fn")} == kinds
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[name], t) for name, t in state.items())

    swapped = [vars(m)["forward"] for m in (*norms, *rotaries)] + [m.act_fn for m in mlps]
    npu.prepare_model(model)  # idempotent (the runner may call it again)
    assert [vars(m)["forward"] for m in (*norms, *rotaries)] + [m.act_fn for m in mlps] == swapped


def test_prepare_model_without_the_act_fn_hook_keeps_swiglu_eager(fake: FakeTorchNPU, npu: NPUBackend,
                                                                  tiny_model_dir: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    model = _model(tiny_model_dir, torch.float16)
    for mlp in (m for m in model.modules() if isinstance(m, MLP)):
        if hasattr(mlp, "act_fn"):
            delattr(mlp, "act_fn")
    caplog.set_level(logging.DEBUG, logger="npuserve.engine.backends.npu")
    npu.prepare_model(model)
    assert not any(isinstance(m, FusedSwiGLU) for m in model.modules())
    assert "keeps its eager SwiGLU" in caplog.text
    assert all(isinstance(vars(m).get("forward"), FusedRMSNorm) for m in model.modules() if isinstance(m, RMSNorm))
