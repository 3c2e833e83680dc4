"""The `npu` backend's code, run against the FAKE torch_npu (tests/fake_torch_npu.py): no NPU is here.

What this proves: the backend picks its card and its calls by the torch_npu it finds (the cache write per op-plugin
release line), refuses a stack it cannot run (no NNAL) when it is built, measures free memory after emptying the
allocator's cache, and routes each step to a kernel whose documented contract allows it (the fake refuses any
other), with the kernels' dtypes (int32 slots, lengths and block tables), shapes, layouts and masks (the prefill mask
built once, at the longest sequence); its results equal the CPU backend's (the cache write exactly, attention within
float16/bfloat16 rounding). Greedy generation through the runner: test_npu_greedy.py; the fused kernels:
test_npu_fused.py; the fake's own strictness: test_npu_fake.py. What it cannot prove: the real kernels' numerics and
speed, host-versus-device placement, HCCL, graphs, memory (docs/engine.md, "The fake torch_npu").
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

import torch

from npuserve.engine import rank_runner
from npuserve.engine.backends.base import BackendUnavailableError
from npuserve.engine.backends.cpu import CPUBackend
from npuserve.engine.backends.npu import NPUBackend
from npuserve.engine.backends.npu_device import local_device_index, parse_visible_devices
from npuserve.engine.backends.npu_stack import KEYWORDS
from npuserve.engine.batch import build_decode, build_prefill
from npuserve.engine.model.loader import load_model
from npuserve.engine.runner import KVPlan, ModelRunner
from npuserve.engine.sequence import SamplingParams, Sequence
from npuserve.mindie_config import minimal_config
from npuserve.modelspec import ModelSpec
from tests.fake_torch_npu import RELEASES, FakeTorchNPU, install_fake_torch_npu
from tests.npu_testing import (
    BLOCK,
    CPU,
    DTYPES,
    HEAD_DIM,
    KV_HEADS,
    SMALL_BLOCK,
    assert_close,
    kv_cache,
    qkv,
    sequences,
)
from tests.paged_inputs import run_step

GiB = 1024**3


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


def test_free_memory_is_measured_after_the_allocator_cache_is_emptied(monkeypatch: pytest.MonkeyPatch) -> None:
    # a warm-up leaves its activations in torch_npu's caching allocator: they are free for the KV pool
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    fake = install_fake_torch_npu(monkeypatch, free_bytes=20 * GiB, cached_bytes=12 * GiB, total_bytes=64 * GiB)
    backend = NPUBackend(device=fake.device)
    assert backend.memory_info().free_bytes == 32 * GiB
    assert fake.npu.empty_cache_calls >= 1


def test_the_warm_up_peak_is_measured_by_the_allocator_statistics(fake: FakeTorchNPU, npu: NPUBackend) -> None:
    fake.npu.allocated_bytes = 20 * GiB  # the weights

    def warm_up() -> None:
        fake.npu.peak_allocated_bytes = 23 * GiB  # 3 GiB of activations at the peak

    assert npu.measure_peak(warm_up) == 3 * GiB


def test_missing_nnal_is_refused_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch_npu loads NNAL's libatb.so at the first ATB call: the backend makes that call when it is built
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    fake = install_fake_torch_npu(monkeypatch, nnal=False)
    with pytest.raises(BackendUnavailableError, match="NNAL"):
        NPUBackend(device=fake.device)


def test_backend_refuses_a_card_torch_npu_does_not_see(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    fake = install_fake_torch_npu(monkeypatch, physical_cards=2)
    with pytest.raises(RuntimeError, match="sees 2 card"):
        NPUBackend([0, 1, 2, 3], rank=3, device=fake.device)


def test_backend_refuses_float32_caches(npu: NPUBackend) -> None:
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        npu.allocate_kv_cache(1, 4, SMALL_BLOCK, KV_HEADS, HEAD_DIM, torch.float32)
    (cache,) = npu.allocate_kv_cache(1, 4, SMALL_BLOCK, KV_HEADS, HEAD_DIM, torch.float16)
    assert cache.shape == (2, 4, SMALL_BLOCK, KV_HEADS, HEAD_DIM)


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


# --- the torch_npu stack -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_the_backend_knows_each_supported_release_line(monkeypatch: pytest.MonkeyPatch, release: str) -> None:
    # the engine's matrix (npu_stack) and the fake's releases are written from the same sources independently
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    fake = install_fake_torch_npu(monkeypatch, release=release)
    stack = NPUBackend(device=fake.device).stack
    assert stack.release is not None and stack.release.name == release
    assert stack.release.cann == fake.release.cann and stack.torch_npu_version == fake.release.torch_npu
    assert stack.scatter_cache_mode == release.startswith("26.")  # found in the op's schema
    assert stack.missing() == []


def test_a_torch_npu_outside_the_matrix_runs_on_what_its_ops_say(monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    fake = install_fake_torch_npu(monkeypatch, release="26.1.0")
    fake.module.__version__ = "2.13.0"  # a release line nobody has checked yet
    stack = NPUBackend(device=fake.device).stack
    assert stack.release is None and stack.scatter_cache_mode  # the schema says cache_mode
    assert "not in the tested matrix" in caplog.text


@pytest.mark.parametrize("op", ["_npu_paged_attention_splitfuse", "_npu_reshape_and_cache", "npu_swiglu"])
def test_a_torch_npu_without_an_op_the_backend_calls_is_refused(monkeypatch: pytest.MonkeyPatch, op: str) -> None:
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    fake = install_fake_torch_npu(monkeypatch, release="7.3.0")
    delattr(fake.module, op)
    with pytest.raises(BackendUnavailableError, match=rf"torch_npu 2\.8\.0\.post2 \(op-plugin 7\.3\.0.*lacks {op}"):
        NPUBackend(device=fake.device)


def test_the_block_size_the_kernels_cannot_take_is_refused_before_the_cache(npu: NPUBackend) -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        npu.configure(block_size=8, head_dim=HEAD_DIM, max_seq_len=64)
    npu.configure(block_size=BLOCK, head_dim=HEAD_DIM, max_seq_len=64)


# --- the cache write ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("release", sorted(RELEASES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_fills_the_same_slots_as_the_cpu_backend_on_every_release(monkeypatch: pytest.MonkeyPatch,
                                                                           release: str, dtype: torch.dtype) -> None:
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    fake = install_fake_torch_npu(monkeypatch, release=release)
    npu = NPUBackend(device=fake.device)
    fake.calls.clear()  # building the backend made one ATB call (the NNAL check)
    seqs = sequences([5, 17, 1, 30], [0, 0, 0, 0], seed=1)
    batch = build_prefill(seqs, SMALL_BLOCK, CPU)
    _, k, v = qkv(batch.input_ids.shape[0], dtype, seed=2)
    expected, actual = kv_cache(dtype, 3), kv_cache(dtype, 3)
    CPUBackend().write_kv(expected, k, v, batch.meta.slot_mapping)
    npu.write_kv(actual, k, v, batch.meta.slot_mapping)
    assert torch.equal(actual, expected)
    # where the scatter op takes cache_mode (26.0.0 on) it writes with "Norm"; elsewhere ATB's reshape-and-cache
    writer = "npu_scatter_pa_kv_cache" if release.startswith("26.") else "_npu_reshape_and_cache"
    assert {op for op in fake.calls if op in ("npu_scatter_pa_kv_cache", "_npu_reshape_and_cache")} == {writer}


# --- attention: each step on a kernel whose contract allows it -----------------------------------------------------


def _compare(npu: NPUBackend, seqs: list[Sequence], dtype: torch.dtype, block_size: int, seed: int,
             new: list[int] | None = None, entry: str = "attention") -> None:
    cpu_meta, npu_meta = (build_prefill(seqs, block_size, CPU, new).meta for _ in range(2))  # one per backend
    tokens = npu_meta.query_start[-1]
    q, k, v = qkv(tokens, dtype, seed)
    cpu_cache, npu_cache = kv_cache(dtype, seed + 1, block_size), kv_cache(dtype, seed + 1, block_size)
    expected = CPUBackend().attention(q, k, v, cpu_cache, cpu_meta)
    if entry == "attention":
        actual = npu.attention(q, k, v, npu_cache, npu_meta)
    else:
        npu.write_kv(npu_cache, k, v, npu_meta.slot_mapping)
        actual = npu.prefill_attention(q, npu_cache, npu_meta)
    assert torch.equal(npu_cache, cpu_cache)
    assert_close(actual, expected, dtype)


ATTENTION_OPS = ("_npu_flash_attention", "_npu_flash_attention_qlens", "_npu_paged_attention",
                 "_npu_paged_attention_splitfuse")


def _kernels(fake: FakeTorchNPU) -> dict[str, int]:
    return {op: n for op, n in fake.calls.items() if op in ATTENTION_OPS}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("entry", ["attention", "prefill_attention"])
@pytest.mark.parametrize(("block_size", "kernel"), [(SMALL_BLOCK, "_npu_flash_attention"),
                                                     (BLOCK, "_npu_flash_attention_qlens")])
def test_prefill_matches_the_cpu_backend(fake: FakeTorchNPU, npu: NPUBackend, dtype: torch.dtype, entry: str,
                                         block_size: int, kernel: str) -> None:
    # block 128: the prefix-encoder kernel takes every prefill (no prefix is a 128-aligned prefix, as sglang calls
    # it); another block size: the flash kernel over the new tokens' own K and V
    _compare(npu, sequences([7, 23, 1, 16, 40], [0] * 5, 4, block_size), dtype, block_size, 5, entry=entry)
    assert _kernels(fake) == {kernel: 1}


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefix_cache_hits_of_whole_128_blocks_take_the_prefix_encoder_kernel(fake: FakeTorchNPU, npu: NPUBackend,
                                                                             dtype: torch.dtype) -> None:
    _compare(npu, sequences([300, 140, 9], [256, 128, 0], 7, BLOCK), dtype, BLOCK, 8)
    assert _kernels(fake) == {"_npu_flash_attention_qlens": 1}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [SMALL_BLOCK, BLOCK])
def test_prefixes_the_prefix_encoder_cannot_take_go_to_splitfuse(fake: FakeTorchNPU, npu: NPUBackend,
                                                                 dtype: torch.dtype, block_size: int) -> None:
    # hits of whole blocks of 16, and (as chunked prefill leaves them) of part of a block: no 128-aligned prefix
    _compare(npu, sequences([40, 33, 9, 150], [16, 5, 0, 130], 9, block_size), dtype, block_size, 10)
    assert _kernels(fake) == {"_npu_paged_attention_splitfuse": 1}


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_matches_the_cpu_backend(fake: FakeTorchNPU, npu: NPUBackend, dtype: torch.dtype) -> None:
    lengths = [1, 16, 17, 31, 64, 120]
    seqs = sequences(lengths, [n - 1 for n in lengths], seed=10)
    cpu_meta, npu_meta = (build_decode(seqs, SMALL_BLOCK, CPU).meta for _ in range(2))
    q, k, v = qkv(len(seqs), dtype, seed=11)
    cpu_cache, npu_cache = kv_cache(dtype, 12), kv_cache(dtype, 12)
    expected = CPUBackend().attention(q, k, v, cpu_cache, cpu_meta)
    actual = npu.attention(q, k, v, npu_cache, npu_meta)
    assert torch.equal(npu_cache, cpu_cache)
    assert_close(actual, expected, dtype)
    assert_close(npu.decode_attention(q, npu_cache, npu_meta), expected, dtype)  # over the cache as it now is
    assert _kernels(fake) == {"_npu_paged_attention": 2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("block_size", "total", "cached", "new"), [
    # two decodes ride in front of two prompt chunks (one continuing a prompt, one starting one)
    (SMALL_BLOCK, [12, 140, 30, 25], [11, 139, 8, 0], [1, 1, 10, 16]),
    (BLOCK, [12, 140, 30, 25], [11, 139, 8, 0], [1, 1, 10, 16]),
    # every prefix on the 128 grid, a decode's too: a mixed step still runs as vllm-ascend runs it, on SplitFuse
    (BLOCK, [129, 300], [128, 128], [1, 20]),
])
def test_a_chunked_prefill_step_runs_as_one_splitfuse_call(fake: FakeTorchNPU, npu: NPUBackend, dtype: torch.dtype,
                                                          block_size: int, total: list[int], cached: list[int],
                                                          new: list[int]) -> None:
    _compare(npu, sequences(total, cached, 13, block_size), dtype, block_size, 14, new=new)
    assert _kernels(fake) == {"_npu_paged_attention_splitfuse": 1}


# --- the prefill mask: built once, at the longest sequence --------------------------------------------------------


def test_the_prefill_mask_is_built_once_at_the_longest_sequence(fake: FakeTorchNPU, npu: NPUBackend,
                                                               tiny_model_dir: Path) -> None:
    spec = ModelSpec.from_pretrained(tiny_model_dir)
    model = load_model(spec, None, torch.float16, CPU)
    plan = KVPlan(num_blocks=16, num_host_blocks=0, block_size=SMALL_BLOCK, bytes_per_block=0, source="test")
    runner = ModelRunner(model, npu, plan, torch.float16, max_seq_len=96)
    fake.record.add("_npu_flash_attention")
    for n, first_block in ((7, 0), (40, 4)):  # two prefill steps of different lengths
        seq = Sequence(list(range(1, n + 1)), SamplingParams(temperature=0.0), arrival_time=0.0)
        seq.block_table = list(range(first_block, first_block + 3))
        run_step(runner, [seq], is_prefill=True)
    masks = [call["mask"] for call in fake.args["_npu_flash_attention"]]
    assert len(masks) == 2 * spec.num_layers
    assert all(tuple(m.shape) == (96, 96) and m.data_ptr() == masks[0].data_ptr() for m in masks)
    assert set(fake.args["_npu_flash_attention"][0]) == KEYWORDS["_npu_flash_attention"]


# --- tensor parallel and decode graphs ---------------------------------------------------------------------------


class _Joined(Exception):
    """Stops start-up at the rendezvous, once the arguments are recorded."""


def test_tensor_parallel_joins_over_hccl(fake: FakeTorchNPU, monkeypatch: pytest.MonkeyPatch,
                                         tiny_model_dir: Path) -> None:
    # a rank of a worldSize-2 engine on the npu joins its world over the collective library torch_npu registers
    joined: list[tuple[int, int, str]] = []

    def record(rank: int, world_size: int, init_method: str, dist_backend: str, store: object = None) -> None:
        joined.append((rank, world_size, dist_backend))
        raise _Joined

    monkeypatch.setattr(rank_runner, "get_backend", lambda *args: NPUBackend(device=fake.device))
    monkeypatch.setattr(rank_runner, "connect", record)
    config = minimal_config(tiny_model_dir, max_seq_len=256, model={"worldSize": 2})
    with pytest.raises(_Joined):
        rank_runner.build_rank_runner(config, tiny_model_dir, seed=0, rank=1, init_method="tcp://127.0.0.1:1")
    assert joined == [(1, 2, "hccl")]


def test_a_rank_of_a_group_of_pods_takes_its_pods_card(fake: FakeTorchNPU, monkeypatch: pytest.MonkeyPatch,
                                                       tiny_model_dir: Path) -> None:
    # worldSize 4 over 2 pods of 2 cards: rank 3 is the second rank of pod 1, on that pod's card 1 (npuDeviceIds
    # [[0, 1]] in every pod), and joins the world as rank 3 of 4
    from npuserve.engine import rank_runner

    cards: list[tuple[int, list[int] | None]] = []
    joined: list[tuple[int, int, str]] = []

    def backend(device: str, rank: int, ids: list[int] | None) -> NPUBackend:
        cards.append((rank, ids))
        return NPUBackend(device=fake.device)

    def record(rank: int, world_size: int, init_method: str, dist_backend: str, store: object = None) -> None:
        joined.append((rank, world_size, dist_backend))
        raise _Joined

    monkeypatch.setattr(rank_runner, "get_backend", backend)
    monkeypatch.setattr(rank_runner, "connect", record)
    config = minimal_config(tiny_model_dir, max_seq_len=256, model={"worldSize": 4})
    data = config.to_dict()
    data["BackendConfig"]["npuDeviceIds"] = [[0, 1]]
    config = type(config).from_dict(data)
    with pytest.raises(_Joined):
        rank_runner.build_rank_runner(config, tiny_model_dir, seed=0, rank=3, init_method="tcp://127.0.0.2:1",
                                      cards_per_pod=2)
    assert cards == [(1, [0, 1])] and joined == [(3, 4, "hccl")]


def test_decode_runs_eagerly_where_graphs_are_asked_for(fake: FakeTorchNPU, npu: NPUBackend,
                                                        tiny_model_dir: Path) -> None:
    # `_npu_paged_attention` reads its host lengths at launch, so a graph would replay the capture's: the runner
    # asked for graphs up to batch 8 builds none, and each decode step launches the kernel once per layer
    spec = ModelSpec.from_pretrained(tiny_model_dir)
    model = load_model(spec, None, torch.float16, CPU)
    plan = KVPlan(num_blocks=16, num_host_blocks=0, block_size=BLOCK, bytes_per_block=0, source="test")
    runner = ModelRunner(model, npu, plan, torch.float16, graph_batch_size=8, max_seq_len=256)
    assert runner.decode_graphs is None
    seqs = [Sequence(list(range(1, n + 1)), SamplingParams(temperature=0.0), arrival_time=0.0) for n in (5, 9)]
    for i, seq in enumerate(seqs):
        seq.block_table = [i]
    tokens = run_step(runner, seqs, is_prefill=True).token_ids
    for step in range(2):
        for seq, token in zip(seqs, tokens, strict=True):
            seq.num_cached_tokens = seq.num_tokens
            seq.token_ids.append(token)
        fake.calls.clear()
        tokens = run_step(runner, seqs, is_prefill=False).token_ids
        assert _kernels(fake) == {"_npu_paged_attention": spec.num_layers}, step
