"""`DecodeGraphs` (engine/decode_graphs.py): capture once per bucket, replay over static buffers.

No GPU is here, so the graph is a FAKE: `RecordedOpsGraph`. Its capture context records every aten op the forward
runs (a `TorchDispatchMode`); replay re-runs the recorded ops over the same tensors and writes each result into the
memory the captured result had, as a CUDA graph replays its kernels over fixed addresses. What is not in a static
buffer at capture time (a Python number, a tensor made from host values) is baked in, as in a real graph; a host
sync (`.item()`, `bool(tensor)`) or an op with a data-dependent shape inside the capture raises, as CUDA capture
does. The backend is the CPU backend with that graph (`FakeGraphCPUBackend`).

What this proves: `run` copies each step into the static buffers and replays the right bucket; its rows equal the
eager forward for batch sizes that need padding; pad rows (with stale rows of a larger batch before them) write
only into the scratch block, never a real one; greedy tokens over steps of changing batch sizes equal the eager
ones; prefill, mixed and oversized batches get None. What only a GPU can show (the test at the end, skipped here):
real `torch.cuda.CUDAGraph` capture of the cuda backend (its Triton decode and fused kernels), the shared memory
pool, the speed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from npuserve.catalog.models import get_model_preset
from npuserve.engine.backends.base import Backend
from npuserve.engine.backends.cpu import CPUBackend
from npuserve.engine.batch import FlatBatch, build_decode, build_prefill
from npuserve.engine.decode_graphs import DecodeGraphs, decode_buckets
from npuserve.engine.model.llama import LlamaForCausalLM
from npuserve.engine.model.loader import load_model
from npuserve.engine.sequence import SamplingParams, Sequence

CPU = torch.device("cpu")
BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS = 4, 96, 8  # scratch block: NUM_BLOCKS (the runner allocates one more)
MAX_BATCH = 8  # buckets 1, 2, 4, 8

# Ops a CUDA graph cannot capture: a host sync, or an output shape that depends on the data.
_UNCAPTURABLE = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default,
                 torch.ops.aten.is_nonzero.default, torch.ops.aten.nonzero.default,
                 torch.ops.aten.masked_select.default}


class HostSyncInCapture(RuntimeError):
    pass


class RecordedOpsGraph:
    """A FAKE device graph (see the module docstring): records aten ops at capture, replays them in place."""

    def __init__(self) -> None:
        self.ops: list[tuple[Any, tuple[Any, ...], dict[str, Any], Any]] = []
        self.replays = 0

    def pool(self) -> object:
        return self  # a stand-in for the memory pool handle the next capture shares

    def replay(self) -> None:
        for func, args, kwargs, captured in self.ops:
            result = func(*args, **kwargs)
            if func.is_view or func._schema.is_mutable:  # a view aliases memory already; a mutation happened
                continue
            for old, new in zip(tree_flatten(captured)[0], tree_flatten(result)[0], strict=True):
                if isinstance(old, torch.Tensor) and old.untyped_storage().data_ptr() != \
                        new.untyped_storage().data_ptr():
                    old.copy_(new)  # into the captured result's memory, which later ops read
        self.replays += 1


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: RecordedOpsGraph) -> None:
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _UNCAPTURABLE:
            raise HostSyncInCapture(f"{func} in a captured region (a CUDA graph capture fails on it)")
        out = func(*args, **kwargs)
        self.graph.ops.append((func, args, kwargs, out))
        return out


class FakeGraphCPUBackend(CPUBackend):
    """The CPU backend with the fake graph, so DecodeGraphs captures and replays on the CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.graphs: list[RecordedOpsGraph] = []
        self.pools: list[Any] = []

    def new_decode_graph(self) -> RecordedOpsGraph:
        graph = RecordedOpsGraph()
        self.graphs.append(graph)
        return graph

    def graph_capture(self, graph: Any, pool: Any | None) -> AbstractContextManager[Any]:
        self.pools.append(pool)

        @contextmanager
        def recording() -> Iterator[None]:
            assert not graph.ops, "a graph is captured once"
            with _Recorder(graph):
                yield

        return recording()


def _bind(model: LlamaForCausalLM, backend: Backend, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """The KV cache the runner would allocate (one scratch block past the pool), bound to the attention layers."""
    spec = model.spec
    caches = backend.allocate_kv_cache(spec.num_layers, NUM_BLOCKS + 1, BLOCK_SIZE, spec.num_key_value_heads,
                                       spec.head_dim, dtype)
    for layer, cache in zip(model.attention_layers(), caches, strict=True):
        layer.backend = backend
        layer.kv_cache = cache
    return caches


def _tiny(backend: Backend, device: torch.device = CPU,
          dtype: torch.dtype = torch.float32) -> tuple[LlamaForCausalLM, list[torch.Tensor]]:
    model = load_model(get_model_preset("tiny"), None, dtype, device, load_format="dummy", seed=11)
    return model, _bind(model, backend, dtype)


def _sequences(count: int, seed: int) -> list[Sequence]:
    """Prompts of 1..19 tokens, each with the blocks for up to MAX_BLOCKS * BLOCK_SIZE tokens, from a shuffled
    pool (never the scratch block)."""
    rng = random.Random(seed)
    pool = list(range(NUM_BLOCKS))
    rng.shuffle(pool)
    seqs = []
    for _ in range(count):
        prompt = [rng.randrange(3, 1024) for _ in range(rng.randrange(1, 20))]
        seq = Sequence(prompt, SamplingParams(temperature=0.0), arrival_time=0.0)
        seq.block_table, pool = pool[:MAX_BLOCKS], pool[MAX_BLOCKS:]
        seqs.append(seq)
    return seqs


def _advance(seqs: list[Sequence], tokens: list[int]) -> None:
    for seq, token in zip(seqs, tokens, strict=True):
        seq.num_cached_tokens = seq.num_tokens
        seq.token_ids.append(token)


def _decode_batch(seqs: list[Sequence], device: torch.device = CPU) -> FlatBatch:
    """A decode batch whose block tables are as wide as the contexts need (narrower than the static one)."""
    batch = build_decode(seqs, BLOCK_SIZE, device)
    assert batch.meta.block_tables.shape[1] <= MAX_BLOCKS
    return batch


@torch.inference_mode()
def _prefill(model: LlamaForCausalLM, seqs: list[Sequence], device: torch.device = CPU) -> None:
    batch = build_prefill(seqs, BLOCK_SIZE, device)
    hidden = model(batch.input_ids, batch.positions, batch.meta)
    _advance(seqs, model.compute_logits(hidden[batch.logits_indices]).argmax(-1).tolist())


@pytest.fixture
def captured() -> tuple[LlamaForCausalLM, FakeGraphCPUBackend, list[torch.Tensor], DecodeGraphs]:
    backend = FakeGraphCPUBackend()
    model, caches = _tiny(backend)
    graphs = DecodeGraphs(model, backend, max_batch_size=MAX_BATCH, max_blocks_per_seq=MAX_BLOCKS,
                          block_size=BLOCK_SIZE, scratch_block=NUM_BLOCKS)
    graphs.capture()
    return model, backend, caches, graphs


# --- buckets ---------------------------------------------------------------------------------------------------


def test_buckets() -> None:
    assert decode_buckets(1) == [1]
    assert decode_buckets(8) == [1, 2, 4, 8]
    assert decode_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert decode_buckets(0) == []
    b200 = decode_buckets(200)
    assert b200[:8] == [1, 2, 4, 8, 16, 24, 32, 48] and b200[-3:] == [176, 192, 200]
    b1000 = decode_buckets(1000)
    assert b1000[-1] == 512 and 256 in b1000 and 288 in b1000 and b1000 == sorted(set(b1000))


# --- capture ---------------------------------------------------------------------------------------------------


def test_capture_is_largest_first_in_one_pool(captured: tuple[Any, FakeGraphCPUBackend, Any, DecodeGraphs]) -> None:
    _, backend, _, graphs = captured
    assert graphs.buckets == [1, 2, 4, 8] and graphs.captured
    assert len(backend.graphs) == 4 and all(g.ops for g in backend.graphs)
    first = backend.graphs[0]
    assert backend.pools == [None, first, first, first]  # the largest (first) graph's pool, shared


def test_a_backend_without_graphs_runs_eagerly() -> None:
    backend = CPUBackend()
    model, _ = _tiny(backend)
    graphs = DecodeGraphs(model, backend, max_batch_size=4, max_blocks_per_seq=MAX_BLOCKS, block_size=BLOCK_SIZE,
                          scratch_block=NUM_BLOCKS)
    graphs.capture()
    seqs = _sequences(2, seed=1)
    _prefill(model, seqs)
    assert not graphs.captured and graphs.run(_decode_batch(seqs)) is None


# --- replay ----------------------------------------------------------------------------------------------------


def _slots(batch: FlatBatch) -> set[int]:
    return set(batch.meta.slot_mapping.tolist())


def _changed_slots(before: list[torch.Tensor], after: list[torch.Tensor]) -> set[int]:
    """Flat slots (block * block_size + offset) whose K or V changed in any layer."""
    changed: set[int] = set()
    for b, a in zip(before, after, strict=True):
        diff = (b != a).reshape(2, b.shape[1] * b.shape[2], -1).any(dim=-1).any(dim=0)
        changed |= set(diff.nonzero().flatten().tolist())
    return changed


@torch.inference_mode()
def test_replay_equals_eager_and_pad_rows_touch_only_the_scratch_block(
        captured: tuple[LlamaForCausalLM, FakeGraphCPUBackend, list[torch.Tensor], DecodeGraphs]) -> None:
    model, backend, caches, graphs = captured
    seqs = _sequences(MAX_BATCH, seed=2)
    _prefill(model, seqs)
    scratch = set(range(NUM_BLOCKS * BLOCK_SIZE, (NUM_BLOCKS + 1) * BLOCK_SIZE))
    rng = random.Random(3)
    # 8 first, so the smaller batches after it find stale real rows past their own (pads must overwrite them)
    for size in [8, 3, 5, 1, 2, 7, 8, 6]:
        step = rng.sample(seqs, size)
        bucket = next(n for n in graphs.buckets if n >= size)
        replays = {n: g.replays for n, g in zip(reversed(graphs.buckets), backend.graphs, strict=True)}
        before = [c.clone() for c in caches]
        batch = _decode_batch(step)
        hidden = graphs.run(batch)
        assert hidden is not None and hidden.shape == (size, model.spec.hidden_size)
        hidden = hidden.clone()
        after_graph = [c.clone() for c in caches]
        now = {n: g.replays for n, g in zip(reversed(graphs.buckets), backend.graphs, strict=True)}
        assert now == {n: replays[n] + (n == bucket) for n in replays}, "the bucket's graph, once"
        # only this step's slots and the scratch block changed
        assert _changed_slots(before, after_graph) <= _slots(batch) | scratch
        # the same step run eagerly over the same cache
        for c, b in zip(caches, before, strict=True):
            c.copy_(b)
        eager_batch = _decode_batch(step)
        expected = model(eager_batch.input_ids, eager_batch.positions, eager_batch.meta)
        torch.testing.assert_close(hidden, expected, atol=1e-5, rtol=1e-5)
        for g, e in zip(after_graph, caches, strict=True):
            real = slice(0, NUM_BLOCKS)
            torch.testing.assert_close(g[:, real], e[:, real], atol=1e-6, rtol=1e-6)
        tokens = model.compute_logits(hidden).argmax(-1).tolist()
        assert tokens == model.compute_logits(expected).argmax(-1).tolist()
        _advance(step, tokens)


@torch.inference_mode()
def test_greedy_tokens_equal_eager_decoding() -> None:
    """Steps of changing batch sizes, the graph's tokens against a second model run eagerly throughout."""
    graph_backend = FakeGraphCPUBackend()
    model, _ = _tiny(graph_backend)
    graphs = DecodeGraphs(model, graph_backend, max_batch_size=MAX_BATCH, max_blocks_per_seq=MAX_BLOCKS,
                          block_size=BLOCK_SIZE, scratch_block=NUM_BLOCKS)
    graphs.capture()
    eager_model, _ = _tiny(CPUBackend())
    runs = []
    for m, use_graphs in ((model, True), (eager_model, False)):
        seqs = _sequences(6, seed=4)
        _prefill(m, seqs)
        for step in range(12):
            active = seqs[: [6, 5, 3, 6, 1, 4][step % 6]]
            batch = _decode_batch(active)
            hidden = graphs.run(batch) if use_graphs else None
            if use_graphs:
                assert hidden is not None
            else:
                hidden = m(batch.input_ids, batch.positions, batch.meta)
            _advance(active, m.compute_logits(hidden).argmax(-1).tolist())
        runs.append([s.output_token_ids for s in seqs])
    assert runs[0] == runs[1]


@torch.inference_mode()
def test_what_no_graph_holds_is_refused(
        captured: tuple[LlamaForCausalLM, FakeGraphCPUBackend, list[torch.Tensor], DecodeGraphs]) -> None:
    model, backend, _, graphs = captured
    seqs = _sequences(MAX_BATCH + 1, seed=5)
    _prefill(model, seqs)
    assert graphs.run(build_prefill(seqs[:2], BLOCK_SIZE, CPU)) is None  # a prefill
    # a mixed (chunked prefill) step: two decodes ahead of a prompt chunk
    chunked = seqs[:2] + _sequences(1, seed=6)
    chunked[2].block_table = list(range(NUM_BLOCKS - MAX_BLOCKS, NUM_BLOCKS))
    mixed = build_prefill(chunked, BLOCK_SIZE, CPU, [1, 1, 2])
    assert mixed.meta.decode_part is not None and graphs.run(mixed) is None
    assert graphs.run(_decode_batch(seqs)) is None  # more sequences than the largest bucket
    # a context longer than the static block table holds
    long = Sequence([5] * (MAX_BLOCKS * BLOCK_SIZE + 1), SamplingParams(temperature=0.0), arrival_time=0.0)
    long.block_table = list(range(MAX_BLOCKS + 1))
    assert graphs.run(build_decode([long], BLOCK_SIZE, CPU)) is None
    assert all(g.replays == 0 for g in backend.graphs)


# --- the fake is honest ----------------------------------------------------------------------------------------


def test_the_fake_graph_replays_over_the_captured_memory() -> None:
    x = torch.arange(4.0)
    out = torch.zeros(4)
    graph = RecordedOpsGraph()
    with _Recorder(graph):
        y = x * 2 + 1  # fresh results: written back into y's memory on replay
        out.add_(y)  # a mutation: done again on replay
    x.copy_(torch.tensor([10.0, 20.0, 30.0, 40.0]))
    graph.replay()
    assert torch.equal(y, torch.tensor([21.0, 41.0, 61.0, 81.0]))
    assert torch.equal(out, torch.tensor([1.0, 3.0, 5.0, 7.0]) + y)


class _SyncingBackend(FakeGraphCPUBackend):
    def decode_attention(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: Any) -> torch.Tensor:
        length = int(meta.context_lens.max())  # a host sync: fine eagerly, refused under capture
        meta.max_context_len = length
        return super().decode_attention(q, kv_cache, meta)


def test_the_fake_graph_refuses_a_host_sync() -> None:
    backend = _SyncingBackend()
    model, _ = _tiny(backend)
    graphs = DecodeGraphs(model, backend, max_batch_size=2, max_blocks_per_seq=MAX_BLOCKS, block_size=BLOCK_SIZE,
                          scratch_block=NUM_BLOCKS)
    with pytest.raises(HostSyncInCapture, match=r"item|_local_scalar_dense"):
        graphs.capture()


# --- on a GPU ----------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_cuda_graphs_equal_eager_cuda_decoding(dtype: torch.dtype) -> None:
    from npuserve.engine.backends.cuda import CUDABackend

    gpu = torch.device("cuda", 0)
    backend = CUDABackend(gpu)
    model, caches = _tiny(backend, gpu, dtype)
    backend.prepare_model(model)  # the fused Triton kernels inside the graphs too
    graphs = DecodeGraphs(model, backend, max_batch_size=MAX_BATCH, max_blocks_per_seq=MAX_BLOCKS,
                          block_size=BLOCK_SIZE, scratch_block=NUM_BLOCKS)
    graphs.capture()
    assert graphs.captured
    seqs = _sequences(MAX_BATCH, seed=8)
    _prefill(model, seqs, gpu)
    scratch = set(range(NUM_BLOCKS * BLOCK_SIZE, (NUM_BLOCKS + 1) * BLOCK_SIZE))
    for size in [8, 3, 5, 1, 8, 2]:
        step = seqs[:size]
        before = [c.clone() for c in caches]
        batch = _decode_batch(step, gpu)
        hidden = graphs.run(batch)
        assert hidden is not None
        hidden = hidden.clone()
        assert _changed_slots(before, caches) <= _slots(batch) | scratch
        for c, b in zip(caches, before, strict=True):
            c.copy_(b)
        eager = _decode_batch(step, gpu)
        expected = model(eager.input_ids, eager.positions, eager.meta)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(hidden, expected, atol=tol, rtol=tol)
        _advance(step, model.compute_logits(expected).argmax(-1).tolist())
    assert math.isfinite(float(hidden.float().abs().max()))


def test_the_engine_captures_at_warm_up_and_replays_its_decode_steps(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through LLMEngine and ModelRunner: the graphs are captured before the engine is ready, decode steps replay
    them, and the tokens equal an engine without graphs (pad rows and the scratch block never reach a real one)."""
    from npuserve.engine import rank_runner
    from npuserve.engine.engine import LLMEngine
    from npuserve.engine.sequence import SamplingParams
    from npuserve.mindie_config import minimal_config

    texts = ["one", "two words", "a somewhat longer prompt than the others", "x"]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    config = minimal_config(tiny_model_dir, max_seq_len=128, maxBatchSize=4, cacheBlockSize=4)
    eager = [o.token_ids for o in LLMEngine(config).generate(texts, params)]
    backend = FakeGraphCPUBackend()
    monkeypatch.setattr(rank_runner, "get_backend", lambda *args: backend)
    engine = LLMEngine(config)
    graphs = engine.runner.decode_graphs
    assert graphs is not None and graphs.captured and graphs.buckets == [1, 2, 4]
    assert engine.kv_plan.num_blocks == engine.kv.num_device_blocks  # the scratch block is the runner's, not the pool's
    assert engine.runner.kv_caches[0].shape[1] == engine.kv_plan.num_blocks + 1
    before = sum(g.replays for g in backend.graphs)
    assert [o.token_ids for o in engine.generate(texts, params)] == eager
    assert sum(g.replays for g in backend.graphs) - before >= 19  # the decode steps went through the graphs


# --- sized for the largest batch a live schedule may set (npuserve.maxBatchSizeLimit) -------------------------------


def _engine_started_at_batch_2(model_dir: Path, limit: int | None, **extensions: Any) -> Any:
    from npuserve.engine.engine import LLMEngine
    from npuserve.mindie_config import minimal_config

    if limit is not None:
        extensions["maxBatchSizeLimit"] = limit
    config = minimal_config(model_dir, max_seq_len=128, maxBatchSize=2, cacheBlockSize=4, extensions=extensions,
                            model={"npuMemSize": 1} if extensions.get("device") == "cuda" else None)
    return LLMEngine(config)


def _decode_buckets_used(engine: Any, monkeypatch: pytest.MonkeyPatch) -> list[int | None]:
    """Records, for each decode step from now on, the bucket whose graph it replayed (None: it ran eagerly)."""
    graphs: DecodeGraphs = engine.runner.decode_graphs
    run, used = graphs.run, []

    def recording_run(batch: FlatBatch) -> torch.Tensor | None:
        hidden = run(batch)
        if not batch.meta.is_prefill and batch.meta.prefill_part is None:
            used.append(graphs.bucket_for(batch.meta.batch_size) if hidden is not None else None)
        return hidden

    monkeypatch.setattr(graphs, "run", recording_run)
    return used


@pytest.mark.parametrize(("limit", "sizes"), [(None, [1, 2]), (20, [1, 2, 4, 8, 16, 20])])
def test_graphs_are_captured_up_to_the_max_batch_size_limit(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, limit: int | None, sizes: list[int]) -> None:
    """Started at maxBatchSize 2: the buckets go up to npuserve.maxBatchSizeLimit, or to 2 without one; /info says
    which."""
    from npuserve.engine import rank_runner

    backend = FakeGraphCPUBackend()
    monkeypatch.setattr(rank_runner, "get_backend", lambda *args: backend)
    engine = _engine_started_at_batch_2(tiny_model_dir, limit)
    assert engine.info().graph_batch_sizes == sizes
    assert len([g for g in backend.graphs if g.ops]) == len(sizes)  # (the runner's probe graph captures nothing)


def _live_raise_replays_the_new_size(engine: Any, monkeypatch: pytest.MonkeyPatch) -> list[int | None]:
    """Raises maxBatchSize from 2 to 8 on the running engine, decodes eight requests together; the buckets used."""
    from npuserve.engine.sequence import SamplingParams

    used = _decode_buckets_used(engine, monkeypatch)
    engine.update_schedule(engine.config.with_schedule(maxBatchSize=8, maxPrefillBatchSize=8).schedule)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = engine.generate([f"prompt number {i}" for i in range(8)], params)
    assert all(len(o.token_ids) == 6 for o in outputs)
    return used


def test_a_live_raise_within_the_limit_replays_the_graph_of_the_new_size(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from npuserve.engine import rank_runner

    backend = FakeGraphCPUBackend()
    monkeypatch.setattr(rank_runner, "get_backend", lambda *args: backend)
    engine = _engine_started_at_batch_2(tiny_model_dir, 8)
    largest = next(g for g in backend.graphs if g.ops)  # captured first: the graph for 8
    replays_before = largest.replays
    used = _live_raise_replays_the_new_size(engine, monkeypatch)
    assert used == [8] * 5  # five decode steps of the eight requests, each a replay of the graph for 8
    assert largest.replays - replays_before == 5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_a_live_raise_within_the_limit_replays_the_graph_of_the_new_size(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same through the cuda backend and real CUDA graphs."""
    engine = _engine_started_at_batch_2(tiny_model_dir, 8, device="cuda")
    assert engine.backend.name == "cuda" and engine.info().graph_batch_sizes == [1, 2, 4, 8]
    assert _live_raise_replays_the_new_size(engine, monkeypatch) == [8] * 5
