"""The Triton paged decode attention kernel (issue 14, part 3) against the CPU backend's decode attention.

The kernel runs under Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors, in a worker process: this file
run as a script. The variable must be set before triton is imported, not only before the kernel is jitted, since
triton.language's own jitted helpers (`tl.sum`, `tl.max`, `tl.cdiv`, `tl.zeros`) are jitted, compiled or
interpreted, when triton is imported; this test process has imported triton already. One worker runs every check
and reports each one's traceback; each check is a test here. A second worker, at the same time and without the
variable, has Triton's real compiler (its NVIDIA backend and the ptxas in its wheel) lower both kernels for an
H100 (sm_90) down to a cubin: the interpreter accepts code the compiler refuses. Running compiled code is for a GPU.

The checks: random caches with shuffled, non-contiguous block tables whose padding entries point outside the
cache (the kernel must never read them; the reference gets zeros there, as the runner pads); context lengths of
1, exactly a block, a block and one, across the kernel's 64-position tiles; MHA, GQA and a group that is not a
power of two; block sizes 1 to 128; head dims 32 (the tiny preset), 64, 80, 128; fp32, fp16, bf16; split-K;
context 0; and the tiny model's greedy decode, its K/V written by a real prefill through `Backend.write_kv` at
the slot mapping, with the kernel as its decode attention.

Tolerances (absolute and relative): fp32 1e-5 (the two differ only in summation order and exp2 against exp; seen:
under 1e-6). fp16 2e-3 and bf16 1.6e-2: two units in the last place at magnitude 1, since the outputs are rounded
to the input dtype and the kernel rounds the softmax weights to it before the P.V product, as a tensor-core kernel
does (seen: one unit). The half-precision outputs are also held to the same tolerance against fp32 attention over
the same rounded values.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton  # shipped with torch here: its absence is a failure, not a skip

from npuserve.catalog.models import get_model_preset
from npuserve.engine.backends.base import AttentionMetadata
from npuserve.engine.backends.cpu import CPUBackend
from npuserve.engine.backends.triton_paged_attention import (
    _kernels,
    _merge_splits_kernel,
    _paged_decode_kernel,
    interpreting,
    paged_decode_attention,
)
from npuserve.engine.model.loader import load_model
from npuserve.engine.runner import KVPlan, ModelRunner
from npuserve.engine.sequence import SamplingParams, Sequence

sys.path.append(str(Path(__file__).resolve().parents[2]))  # a worker runs this file as a script: `tests` importable
from tests.kernel_workers import Check, run_workers, work
from tests.paged_inputs import run_step

CPU = torch.device("cpu")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
OUT_OF_RANGE = 1 << 40  # the padding entries of the kernel's block tables: reading one would fault
INTERPRETED: dict[str, Check] = {}  # run by the interpreter worker
COMPILED: dict[str, Check] = {}  # run by the compiler worker


def _meta(block_tables: torch.Tensor, context_lens: torch.Tensor) -> AttentionMetadata:
    batch = block_tables.shape[0]
    return AttentionMetadata(
        is_prefill=False, slot_mapping=torch.zeros(batch, dtype=torch.long), block_tables=block_tables,
        context_lens=context_lens, query_lens=torch.ones(batch, dtype=torch.long),
        query_start=list(range(batch + 1)), max_query_len=1, max_context_len=int(context_lens.max()), cache={},
    )


def _case(seed: int, heads: int, kv_heads: int, head_dim: int, block_size: int, lens: list[int],
          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, a random cache, the kernel's block tables (padded out of range), the reference's (padded with 0), lens."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in lens]
    num_blocks = sum(needed) + 3  # a few blocks no sequence owns, full of other values
    order = torch.randperm(num_blocks, generator=gen)  # shuffled: no sequence's blocks are contiguous or sorted
    tables = torch.full((len(lens), max(needed) + 2), OUT_OF_RANGE, dtype=torch.long)
    start = 0
    for b, n in enumerate(needed):
        tables[b, :n] = order[start : start + n]
        start += n
    reference_tables = torch.where(tables == OUT_OF_RANGE, 0, tables)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    return q, cache, tables, reference_tables, torch.tensor(lens, dtype=torch.long)


def _compare(seed: int, heads: int, kv_heads: int, head_dim: int, block_size: int, lens: list[int],
             dtype: torch.dtype, num_splits: int = 1) -> None:
    q, cache, tables, reference_tables, context_lens = _case(seed, heads, kv_heads, head_dim, block_size, lens, dtype)
    expected = CPUBackend().decode_attention(q, cache, _meta(reference_tables, context_lens))
    out = paged_decode_attention(q, cache, tables, context_lens, head_dim**-0.5, num_splits=num_splits)
    assert out.shape == q.shape and out.dtype == dtype
    tol = TOL[dtype]
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    if dtype != torch.float32:  # and close to exact attention over the same (rounded) values
        exact = CPUBackend().decode_attention(q.float(), cache.float(), _meta(reference_tables, context_lens))
        torch.testing.assert_close(out.float(), exact, atol=tol, rtol=tol)


# heads, kv_heads, head_dim, block_size, context lengths
CASES = {
    "mha": (4, 4, 64, 16, [1, 16, 17, 50]),
    "tiny-gqa2-tile-edges": (4, 2, 32, 4, [1, 4, 8, 63, 64, 65]),
    "gqa4-dim128": (8, 2, 128, 32, [32, 64, 100]),
    "group3-dim80": (6, 2, 80, 8, [1, 8, 9, 40]),
    "block1-gqa4": (4, 1, 64, 1, [1, 3, 20]),
    "block128-gqa8": (8, 1, 128, 128, [1, 128, 129]),
}
for _name, _shape in CASES.items():
    INTERPRETED[f"fp32-{_name}"] = lambda shape=_shape: _compare(1, *shape, torch.float32)
for _dtype, _name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
    INTERPRETED[f"{_name}-gqa4-dim128"] = lambda dtype=_dtype: _compare(2, 8, 2, 128, 16, [1, 16, 33, 100], dtype)
# split-K: context 1 leaves all but one split empty, 65 is two tiles over three splits
INTERPRETED["split3-fp32"] = lambda: _compare(3, 4, 2, 32, 4, [1, 64, 65, 150], torch.float32, num_splits=3)
INTERPRETED["split2-bf16"] = lambda: _compare(3, 4, 2, 32, 4, [1, 64, 65, 150], torch.bfloat16, num_splits=2)


def _empty_context(num_splits: int) -> None:
    """A padded row of a bucketed batch (context 0) gives zeros, not NaN, and leaves the other rows exact."""
    q, cache, tables, reference_tables, _ = _case(4, 4, 2, 32, 4, [5, 9], torch.float32)
    out = paged_decode_attention(q, cache, tables, torch.tensor([0, 9]), 32**-0.5, num_splits=num_splits)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    expected = CPUBackend().decode_attention(q[1:], cache, _meta(reference_tables[1:], torch.tensor([9])))
    torch.testing.assert_close(out[1:], expected, atol=1e-5, rtol=1e-5)


INTERPRETED["empty-context"] = lambda: _empty_context(1)
INTERPRETED["empty-context-split2"] = lambda: _empty_context(2)


class _TritonDecodeBackend(CPUBackend):
    """The CPU backend whose decode attention is the kernel's, checked against its own at each call."""

    def __init__(self) -> None:
        super().__init__()
        self.errors: list[float] = []

    def decode_attention(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        expected = super().decode_attention(q, kv_cache, meta)
        out = paged_decode_attention(q, kv_cache, meta.block_tables, meta.context_lens, q.shape[-1] ** -0.5)
        self.errors.append((out - expected).abs().max().item())
        return out


def _greedy(backend: CPUBackend, steps: int) -> list[list[int]]:
    """The tiny model's greedy tokens through the model runner: a real prefill (K/V written by `write_kv` at the
    slot mapping), then decode steps; block size 4, shuffled block tables."""
    spec = get_model_preset("tiny")
    block_size, prompt_lens = 4, [1, 4, 7, 12]
    model = load_model(spec, None, torch.float32, CPU, load_format="dummy", seed=3)
    needed = [-(-(n + steps) // block_size) for n in prompt_lens]
    num_blocks = sum(needed) + 2
    runner = ModelRunner(model, backend, KVPlan(num_blocks, 0, block_size, 0, "test"), torch.float32)
    gen = torch.Generator().manual_seed(5)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    seqs = []
    for n, blocks in zip(prompt_lens, needed, strict=True):
        prompt = torch.randint(1, spec.vocab_size, (n,), generator=gen).tolist()
        seq = Sequence(prompt, SamplingParams(temperature=0.0), arrival_time=0.0)
        seq.block_table, order = order[:blocks], order[blocks:]
        seqs.append(seq)
    for step in range(steps):
        sampled = run_step(runner, seqs, is_prefill=step == 0).token_ids
        for seq, token in zip(seqs, sampled, strict=True):
            seq.num_cached_tokens = seq.num_tokens
            seq.token_ids.append(token)
    return [seq.output_token_ids for seq in seqs]


def _tiny_model_after_a_real_prefill() -> None:
    """Contexts 2..17 over block size 4 (tiny: 4 heads, 2 KV heads, head dim 32): each step lands on or crosses
    block boundaries somewhere; the tokens equal the CPU backend's."""
    checked = _TritonDecodeBackend()
    tokens = _greedy(checked, steps=6)
    assert len(checked.errors) == 5 * get_model_preset("tiny").num_layers  # every decode step, every layer
    assert max(checked.errors) < 1e-5, checked.errors
    assert tokens == _greedy(CPUBackend(), steps=6)


def _interpreter_runs() -> None:
    assert interpreting()
    decode_kernel, merge_kernel = _kernels(True)
    assert type(decode_kernel).__name__ == type(merge_kernel).__name__ == "InterpretedFunction"


INTERPRETED["tiny-model-real-prefill"] = _tiny_model_after_a_real_prefill
INTERPRETED["is-interpreted"] = _interpreter_runs


def _compile_for_sm90() -> None:
    """Both kernels with the argument types a bf16 Llama-3-8B-shaped decode (32 heads over 8 KV heads, head dim
    128, MindIE's 128-token blocks, split in two) gives them, lowered for an H100."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    assert not interpreting()
    assert "nvidia" in triton.backends.backends, "this triton build has no NVIDIA backend"
    decode_kernel, merge_kernel = _kernels(False)
    target, options = GPUTarget("cuda", 90, 32), {"num_warps": 4}
    names = list(inspect.signature(_paged_decode_kernel).parameters)
    signature = dict.fromkeys(names, "i32") | {
        "out_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "q_ptr": "*bf16", "kv_ptr": "*bf16",
        "block_tables_ptr": "*i64", "context_lens_ptr": "*i64", "qk_scale": "fp32", "stride_kv": "i64",
    }
    constants = {"GROUP": 4, "GROUP_PAD": 16, "HEAD_DIM": 128, "DIM_PAD": 128, "BLOCK_SIZE": 128, "BLOCK_N": 64,
                 "NUM_SPLITS": 2, "FP32_DOT": False, "WIDEN": False}
    source = ASTSource(decode_kernel, signature | dict.fromkeys(constants, "constexpr"), constants)
    assert triton.compile(source, target=target, options=options).asm["cubin"]
    names = list(inspect.signature(_merge_splits_kernel).parameters)
    signature = dict.fromkeys(names, "i32") | {"out_ptr": "*bf16", "part_ptr": "*fp32", "m_ptr": "*fp32",
                                               "l_ptr": "*fp32"}
    constants = {"HEAD_DIM": 128, "DIM_PAD": 128, "NUM_SPLITS": 2, "SPLIT_PAD": 2}
    source = ASTSource(merge_kernel, signature | dict.fromkeys(constants, "constexpr"), constants)
    assert triton.compile(source, target=target, options=options).asm["cubin"]


COMPILED["sm90-cubin"] = _compile_for_sm90


# --- the tests: each reads its check's outcome from the workers ------------------------------------------------


@pytest.fixture(scope="module")
def worker_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Runs the interpreter worker and the compiler worker side by side; {check: "ok", or what went wrong}. A
    worker that dies (a wild read faults the interpreter) fails the check it was running and those after it."""
    modes = {"interpret": list(INTERPRETED), "compile": list(COMPILED)}
    return run_workers(__file__, modes, tmp_path_factory.mktemp("triton-cache"), timeout=300)


@pytest.mark.parametrize("check", [*INTERPRETED, *COMPILED])
def test_kernel(check: str, worker_results: dict[str, str]) -> None:
    outcome = worker_results[check]
    if outcome != "ok":
        pytest.fail(f"{check}:\n{outcome}", pytrace=False)


def test_compiled_mode_refuses_cpu_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, cache, tables, _, lens = _case(6, 4, 2, 32, 4, [3], torch.float32)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        paged_decode_attention(q, cache, tables, lens, 1.0)


def test_importing_needs_no_triton() -> None:
    """The module imports where triton cannot be imported (the cpu backend never needs it); calling it says why."""
    code = (
        "import sys\n"
        "sys.modules['triton'] = None\n"
        "import torch\n"
        "from npuserve.engine.backends import triton_paged_attention as m\n"
        "assert not m.HAS_TRITON\n"
        "try:\n"
        "    m.paged_decode_attention(torch.zeros(1, 1, 16), torch.zeros(2, 1, 1, 1, 16), torch.zeros(1, 1,"
        " dtype=torch.long), torch.ones(1, dtype=torch.long), 1.0)\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
    )
    result = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "needs triton" in result.stdout


if __name__ == "__main__":  # a worker: `python -P <this file> interpret|compile`
    work(INTERPRETED if sys.argv[1] == "interpret" else COMPILED)
