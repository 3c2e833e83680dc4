"""Tensor parallel on the CPU (gloo): worldSize 2 generates exactly the tokens worldSize 1 does, greedy, for the
dummy llama, qwen2, qwen3 and mistral models, in the engine, through `npuserve generate` and through
`npuserve serve`; each rank holds and reads only its slice; a rank that dies takes the server down.

The models are the correctness suite's (float32, init_std 0.3, so argmax is not fragile: the ranks sum partial
products in another order than one rank does, and near-ties would flip).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

torch = pytest.importorskip("torch")

from npuserve.engine.batch import build_prefill  # noqa: E402
from npuserve.engine.engine import LLMEngine  # noqa: E402
from npuserve.engine.model.dummy import write_dummy_model  # noqa: E402
from npuserve.engine.model.loader import build_model, init_dummy_weights, load_hf_weights  # noqa: E402
from npuserve.engine.parallel.batch_delta import BatchKind, BatchMirror, DeltaSender  # noqa: E402
from npuserve.engine.parallel.layout import TensorParallelLayoutError, TPLayout  # noqa: E402
from npuserve.engine.parallel.step_message import Op, StepMessage, decode, encode  # noqa: E402
from npuserve.engine.sequence import SamplingParams, Sequence  # noqa: E402
from npuserve.mindie_config import EngineEnvironment, minimal_config  # noqa: E402
from npuserve.modelspec import ModelSpec  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_batch_delta import assert_same_batch  # noqa: E402
from test_correctness import ARCHS, prefix_sharing_run, prompts, small_spec  # noqa: E402

from tests.serve_process import wait_ready  # noqa: E402
from tests.world_size_2 import generate_world_size_2, in_process, serve_world_size_2  # noqa: E402

CPU = torch.device("cpu")
NPUSERVE = str(Path(sys.executable).parent / "npuserve")
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module", params=ARCHS)
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dummy_model(small_spec(request.param), tmp_path_factory.mktemp(request.param), seed=3, init_std=0.3)


# --- the layout: which slice each rank holds -------------------------------------------------------------------


def test_the_layout_splits_heads_rows_and_vocabulary() -> None:
    spec = small_spec("llama")  # 4 heads, 2 KV heads, head_dim 16, intermediate 128, vocab 512
    r1 = TPLayout.of(spec, 1, 2)
    assert (r1.heads, r1.first_head, r1.kv_heads, r1.first_kv_head) == (2, 2, 1, 1)
    assert (r1.intermediate, r1.vocab_rows, r1.vocab_start, r1.vocab_real_rows) == (64, 256, 256, 256)
    assert r1.hf_slice("model.layers.0.self_attn.q_proj.weight") == (0, 32, 32)
    assert r1.hf_slice("model.layers.0.self_attn.v_proj.bias") == (0, 16, 16)
    assert r1.hf_slice("model.layers.0.self_attn.o_proj.weight") == (1, 32, 32)
    assert r1.hf_slice("model.layers.0.mlp.down_proj.weight") == (1, 64, 64)
    assert r1.hf_slice("model.layers.0.input_layernorm.weight") is None


def test_kv_heads_are_replicated_when_fewer_than_the_ranks() -> None:
    spec = small_spec("llama")  # 2 KV heads over 4 ranks: ranks 0, 1 use head 0; ranks 2, 3 head 1
    layouts = [TPLayout.of(spec, r, 4) for r in range(4)]
    assert [(x.kv_heads, x.first_kv_head) for x in layouts] == [(1, 0), (1, 0), (1, 1), (1, 1)]
    assert spec.kv_bytes_per_block(4, world_size=4) == spec.kv_bytes_per_block(4, world_size=2)


def test_the_vocabulary_pads_to_equal_rows_per_rank() -> None:
    spec = small_spec("llama").model_copy(update={"vocab_size": 510})
    last = TPLayout.of(spec, 3, 4)
    assert (last.vocab_rows, last.vocab_start, last.vocab_real_rows) == (128, 384, 126)


def test_a_model_that_does_not_split_is_refused_naming_the_dimension() -> None:
    with pytest.raises(TensorParallelLayoutError, match="num_attention_heads 4"):
        TPLayout.of(small_spec("llama"), 0, 3)
    with pytest.raises(TensorParallelLayoutError, match="num_key_value_heads 2"):
        TPLayout.of(small_spec("llama").model_copy(update={"num_attention_heads": 6}), 0, 3)


# --- each rank reads only its slice ----------------------------------------------------------------------------


def _slice(t: torch.Tensor, cut: tuple[int, int, int] | None) -> torch.Tensor:
    if cut is None:
        return t
    dim, start, length = cut
    return t.narrow(dim, start, length)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_loads_its_slice_of_the_checkpoint(model_dir: Path, rank: int) -> None:
    spec = ModelSpec.from_pretrained(model_dir)
    whole = build_model(spec, torch.float32, CPU)
    load_hf_weights(whole, model_dir)
    layout = TPLayout.of(spec, rank, 2)
    part = build_model(spec, torch.float32, CPU, layout)
    load_hf_weights(part, model_dir)
    w, p = dict(whole.named_parameters()), dict(part.named_parameters())
    attn = "model.layers.1.self_attn."
    q, k, v = w[attn + "qkv_proj.weight"].split([spec.q_size, spec.kv_size, spec.kv_size])
    expected_qkv = torch.cat([_slice(q, layout.hf_slice(attn + "q_proj.weight")),
                              _slice(k, layout.hf_slice(attn + "k_proj.weight")),
                              _slice(v, layout.hf_slice(attn + "v_proj.weight"))])
    assert torch.equal(p[attn + "qkv_proj.weight"], expected_qkv)
    assert p[attn + "qkv_proj.weight"].shape[0] == layout.q_size + 2 * layout.kv_size  # a slice, not the whole
    assert torch.equal(p[attn + "o_proj.weight"], _slice(w[attn + "o_proj.weight"], (1, rank * 32, 32)))
    assert torch.equal(p["model.embed_tokens.weight"], w["model.embed_tokens.weight"][rank * 256:(rank + 1) * 256])
    assert torch.equal(p["model.norm.weight"], w["model.norm.weight"])


def test_random_weights_split_over_ranks_are_the_whole_models_slices() -> None:
    spec = small_spec("qwen2")  # qkv bias: the fused bias is sliced too
    whole = build_model(spec, torch.float32, CPU)
    init_dummy_weights(whole, seed=5)
    part = build_model(spec, torch.float32, CPU, TPLayout.of(spec, 1, 2))
    init_dummy_weights(part, seed=5)
    w, p = dict(whole.named_parameters()), dict(part.named_parameters())
    bias = w["model.layers.0.self_attn.qkv_proj.bias"]
    assert torch.equal(p["model.layers.0.self_attn.qkv_proj.bias"],
                       torch.cat([bias[32:64], bias[64 + 16:64 + 32], bias[96 + 16:96 + 32]]))
    assert torch.equal(p["model.layers.0.mlp.gate_up_proj.weight"],
                       torch.cat([w["model.layers.0.mlp.gate_up_proj.weight"][64:128],
                                  w["model.layers.0.mlp.gate_up_proj.weight"][192:256]]))


# --- the step message --------------------------------------------------------------------------------------------


def test_a_mixed_step_travels_as_tensors_and_comes_back_whole() -> None:
    decoding = Sequence([5, 6, 7, 8, 9], SamplingParams(), arrival_time=0.0)
    decoding.block_table, decoding.num_cached_tokens = [3, 1], 4
    chunked = Sequence(list(range(10, 21)), SamplingParams(), arrival_time=0.0)
    chunked.block_table = [0, 2, 4]
    delta, batch = DeltaSender().build([decoding, chunked], BatchKind.MIXED, 4, CPU, num_new_tokens=[1, 6])
    assert batch.meta.decode_part is not None  # a mixed step: the decode has its own layout
    msg = decode(Op.FORWARD, *encode(StepMessage(Op.FORWARD, delta=delta, logit_rows=[(1, 4)])))
    assert msg.delta == delta and msg.logit_rows == [(1, 4)]
    assert_same_batch(BatchMirror().build(msg.delta, 4, CPU), batch)
    assert_same_batch(batch, build_prefill([decoding, chunked], 4, CPU, num_new_tokens=[1, 6]))
    swap = decode(Op.SWAP, *encode(StepMessage(Op.SWAP, pairs=[(1, 2), (3, 4)], pairs_in=[(5, 6)])))
    assert (swap.pairs, swap.pairs_in) == ([(1, 2), (3, 4)], [(5, 6)])


# --- worldSize 2 generates what worldSize 1 does -------------------------------------------------------------------


def tp_engine(model_dir: Path, world_size: int, kv_blocks: int | None = None, **extra: object) -> LLMEngine:
    schedule: dict[str, object] = dict(cacheBlockSize=4, maxBatchSize=8, maxPrefillBatchSize=8, maxPrefillTokens=512,
                                       maxIterTimes=128)
    extensions = extra.pop("extensions", None)
    schedule.update(extra)
    config = minimal_config(model_dir, max_seq_len=128, max_input_len=96, model={"worldSize": world_size},
                            extensions=extensions, **schedule)  # type: ignore[arg-type]
    return LLMEngine(config, env=EngineEnvironment(recompute_threshold=0.99), num_kv_blocks=kv_blocks)


def _workload(engine: LLMEngine) -> list[object]:
    """A continuous batch with a forked request (n=2) and one asking for prompt logprobs, then prefix-cache hits."""
    batch = prompts()
    params = [GREEDY] * len(batch)
    params[1] = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, n=2)
    params[4] = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, prompt_logprobs=2)
    first = engine.generate_all(batch, params)
    tokens = [[o.token_ids for o in outs] for outs in first] + prefix_sharing_run(engine, GREEDY)
    logprobs = [(lp.rank, round(lp.logprob, 3)) for lp in first[4][0].prompt_logprobs or []]
    assert len(logprobs) == len(batch[4]) - 1
    return [tokens, logprobs]


def _squeezed(engine: LLMEngine) -> list[list[int]]:
    """Chunked prefill over a pool too small for the batch: preemptions by swap, mixed steps."""
    outs = engine.generate(prompts(), SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    assert engine.scheduler.num_preemptions_total > 0 and engine.runner._host_kv_caches is not None
    return [o.token_ids for o in outs]


def test_world_size_2_generates_what_world_size_1_does(model_dir: Path) -> None:
    results: dict[int, list[object]] = {1: [], 2: []}
    for world_size in (1, 2):
        engine = tp_engine(model_dir, world_size)
        try:
            results[world_size].append(_workload(engine))
            info = engine.info()
            assert info.worldSize == world_size
            assert info.kv_bytes_per_block == engine.spec.kv_bytes_per_block(4, world_size=world_size)
        finally:
            engine.close()
        squeezed = tp_engine(model_dir, world_size, kv_blocks=30, maxPreemptCount=8, maxPrefillTokens=6,
                           extensions={"chunkedPrefill": True})
        try:
            results[world_size].append(_squeezed(squeezed))
        finally:
            squeezed.close()
    assert results[2] == results[1]


def test_one_process_holds_one_tensor_parallel_engine_at_a_time(model_dir: Path) -> None:
    engine = tp_engine(model_dir, 2)
    try:
        with pytest.raises(RuntimeError, match="one tensor-parallel engine at a time"):
            tp_engine(model_dir, 2)
    finally:
        engine.close()


# --- through the commands ------------------------------------------------------------------------------------------


TEXTS = ["the quick brown fox", "a", "tensor parallel over two ranks of one pod", "hello world, again"]


def test_npuserve_generate_with_world_size_2(model_dir: Path, tmp_path: Path) -> None:
    tokens, ready = generate_world_size_2(model_dir, TEXTS, tmp_path)
    assert tokens == [t for t, _ in in_process(model_dir, TEXTS)]
    if ready is not None:
        assert ready.get("worldSize") == 2


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()]


def test_npuserve_serve_with_world_size_2(model_dir: Path) -> None:
    assert serve_world_size_2(model_dir, TEXTS) == [(len(t), text) for t, text in in_process(model_dir, TEXTS)]


def _allowed_cpus(pid: int) -> set[int]:
    from npuserve.engine.affinity import parse_cpulist

    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return parse_cpulist(line.split(":", 1)[1])
    raise AssertionError("no Cpus_allowed_list")


def test_each_rank_binds_to_its_numa_node_and_a_rank_that_dies_takes_the_server_down(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    from npuserve.engine_contract import CPU_BINDING_ENV
    from tests.serve_process import free_port

    cpus = sorted(os.sched_getaffinity(0))
    env = dict(os.environ)
    if len(cpus) >= 2:  # a stand-in two-node machine: node 0 the first core, node 1 the rest
        for node, members in ((0, cpus[:1]), (1, cpus[1:])):
            (tmp_path / f"node{node}").mkdir()
            (tmp_path / f"node{node}" / "cpulist").write_text(",".join(map(str, members)) + "\n")
        env |= {CPU_BINDING_ENV: "numa", "NPUSERVE_NUMA_SYSFS_ROOT": str(tmp_path)}
    port = free_port()
    proc = subprocess.Popen([NPUSERVE, "serve", "--model", str(tiny_model_dir), "--host", "127.0.0.1", "--port",
                             str(port), "--world-size", "2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, timeout=180)
        workers = _children(proc.pid)
        assert len(workers) == 1
        if len(cpus) >= 2:  # rank r on node r: each rank's own cores
            assert _allowed_cpus(proc.pid) == set(cpus[:1])
            assert _allowed_cpus(workers[0]) == set(cpus[1:])
        os.kill(workers[0], signal.SIGKILL)
        code = proc.wait(timeout=30)  # no hang: rank 0 notices at once
    finally:
        if proc.poll() is None:
            proc.kill()
        out, _ = proc.communicate(timeout=30)
    assert code != 0
    assert f"tensor-parallel rank 1 (pid {workers[0]}) exited with code -9" in out


def test_a_rank_0_that_fails_while_building_ends_its_workers(tiny_model_dir: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from npuserve.engine import rank_runner

    def broken(*args: object, **kwargs: object) -> None:
        raise MemoryError("rank 0 ran out of memory loading its slice")

    monkeypatch.setattr(rank_runner, "load_model", broken)  # rank 0 only: the worker is another process
    before = set(_children(os.getpid()))
    with pytest.raises(MemoryError, match="rank 0 ran out of memory"):
        tp_engine(tiny_model_dir, 2)
    assert set(_children(os.getpid())) == before  # the worker, waiting in a collective, was ended
    assert not dist.is_initialized()  # and the world left: the process can build another engine
    monkeypatch.undo()
    tp_engine(tiny_model_dir, 2).close()


# --- fatal means exit: a failed step, a rank that stops answering (docs/engine.md#errors-and-health) ---------------

FAULT_SERVE = Path(__file__).with_name("tp_fault_serve.py")


def _gone(pid: int) -> bool:
    """The process has ended (a zombie not yet reaped counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def _ends(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _gone(pid)


def _serve_2_ranks(command: list[str], model_dir: Path, termination: Path,
                   *extra: str) -> tuple[subprocess.Popen[str], str]:
    from npuserve.engine_contract import TERMINATION_LOG_ENV
    from tests.serve_process import free_port

    port = free_port()
    proc = subprocess.Popen([*command, "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
                             "--world-size", "2", *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, TERMINATION_LOG_ENV: str(termination)})
    return proc, f"http://127.0.0.1:{port}"


def test_a_rank_0_step_that_fails_after_the_broadcast_ends_every_rank_and_the_server(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    termination = tmp_path / "termination-log"
    proc, url = _serve_2_ranks([sys.executable, str(FAULT_SERVE), "rank0", "serve"], tiny_model_dir, termination)
    workers: list[int] = []
    try:
        wait_ready(url, proc, timeout=180)
        workers = _children(proc.pid)
        r = httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=120)
        code = proc.wait(timeout=120)  # never a hang: the worker sits in a collective rank 0 never joins
    finally:
        if proc.poll() is None:
            proc.kill()
        out, _ = proc.communicate(timeout=30)
    assert code == 1, out
    # one line naming the rank and the operation
    named = [line for line in out.splitlines() if "tensor-parallel rank 0 failed in FORWARD #" in line]
    assert len(named) == 1 and "CRITICAL" in named[0] and "injected fault on rank 0" in named[0], out
    # the request in flight got its error first
    assert r.status_code == 500, r.text
    assert "tensor-parallel rank 0 failed in FORWARD #" in r.json()["error"]["message"]
    assert "tensor-parallel rank 0 failed in FORWARD #" in termination.read_text()  # the pod's termination message
    assert workers and all(_ends(w) for w in workers)  # every rank ended


def test_a_worker_whose_operation_fails_ends_every_rank_and_the_server(tiny_model_dir: Path, tmp_path: Path) -> None:
    termination = tmp_path / "termination-log"
    proc, url = _serve_2_ranks([sys.executable, str(FAULT_SERVE), "rank1", "serve"], tiny_model_dir, termination)
    try:
        wait_ready(url, proc, timeout=180)
        r = httpx.post(url + "/v1/completions", json={"prompt": [7] * 11, "max_tokens": 4}, timeout=120)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        out, _ = proc.communicate(timeout=30)
    assert code == 1, out
    # the worker's one line names its rank and the operation rank 0 sent it
    named = [line for line in out.splitlines() if "tensor-parallel rank 1 failed in FORWARD #" in line]
    assert len(named) == 1 and "(sent by rank 0)" in named[0] and "injected fault on rank 1" in named[0], out
    # rank 0 ends too (it sees the rank exit, or its collective fail, whichever comes first), the request answered
    assert r.status_code == 500 and r.json()["error"]["message"].startswith("the engine failed and exits: "), r.text
    assert "tensor-parallel rank" in termination.read_text()


def test_a_rank_that_stops_answering_fails_health_then_ends_the_server(tiny_model_dir: Path,
                                                                         tmp_path: Path) -> None:
    config = minimal_config(tiny_model_dir, extensions={"stepTimeoutSeconds": 3, "stepTimeoutGraceSeconds": 3})
    config.save(tmp_path / "config.json")
    termination = tmp_path / "termination-log"
    proc, url = _serve_2_ranks([NPUSERVE, "serve"], tiny_model_dir, termination, "--config",
                               str(tmp_path / "config.json"))
    workers: list[int] = []
    failing: list[dict[str, str]] = []
    try:
        wait_ready(url, proc, timeout=180)
        workers = _children(proc.pid)
        os.kill(workers[0], signal.SIGSTOP)  # alive, and answering nothing: rank 0's next collective waits for it
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1) as pool:
            sent = pool.submit(httpx.post, url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4},
                               timeout=120)
            while proc.poll() is None and not failing:
                try:
                    health = httpx.get(url + "/health", timeout=5)
                    if health.status_code == 503:
                        failing.append(health.json())
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
            code = proc.wait(timeout=120)
            ended = [_ends(w) for w in workers]  # rank 0 ended the stopped rank before it went
            r = sent.result(timeout=60)
    finally:
        for w in workers:
            if not _gone(w):
                os.kill(w, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
        out, _ = proc.communicate(timeout=30)
    assert code == 1, out
    # /health failed in the grace, naming what each rank last started
    assert failing and "no engine step has completed" in failing[0]["reason"], out
    reason = failing[0]["reason"]
    assert "tensor-parallel rank 0 last started FORWARD #" in reason and "rank 1:" in reason
    assert "stepTimeoutGraceSeconds" in out and "tensor-parallel rank 0 last started FORWARD #" in out
    assert r.status_code == 500 and "no engine step has completed" in r.json()["error"]["message"]
    assert "rank 1:" in termination.read_text()
    assert ended == [True]
