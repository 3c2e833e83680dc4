"""Greedy generation through the model runner with the npu backend, against the FAKE torch_npu of every supported
op-plugin release line (tests/fake_torch_npu.py): the tiny dummy model in float16 at the npu's block size, 128, with
a prefix-cache hit, whole prefills and chunked prefill, generates the CPU backend's tokens exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from npuserve.engine.backends.cpu import CPUBackend
from npuserve.engine.backends.npu import NPUBackend
from npuserve.engine.backends.npu_stack import INT8_LINEAR_OPS, KEYWORDS, MLA_OPS, MOE_COMBINE_OPS, MOE_OPS
from npuserve.engine.runner import ModelRunner
from npuserve.modelspec import ModelSpec
from tests.fake_torch_npu import RELEASES, install_fake_torch_npu
from tests.npu_testing import runner_of
from tests.paged_inputs import greedy_tokens, greedy_tokens_chunked

DTYPE = torch.float16  # the Ascend kernels take float16 or bfloat16, not the preset's float32
STEPS = 6
CHUNK = 100  # chunked prefill's tokens per prompt per step: continuation chunks start off the 128 grid
_expected: dict[bool, list[list[int]]] = {}


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(17)
    # the second prompt spans two whole blocks and more: the last prompt is admitted behind them (a prefix hit)
    return [torch.randint(5, vocab, (n,), generator=gen).tolist() for n in (20, 300, 45, 60)]


def _generate(runner: ModelRunner, prompts: list[list[int]], chunked: bool) -> list[list[int]]:
    if chunked:
        return greedy_tokens_chunked(runner, prompts, steps=STEPS, seed=18, chunk=CHUNK)
    return greedy_tokens(runner, prompts, steps=STEPS, seed=18)


@pytest.mark.parametrize("chunked", [False, True], ids=["whole-prefills", "chunked-prefill"])
@pytest.mark.parametrize("release", sorted(RELEASES))
def test_greedy_generation_equals_the_cpu_backend(monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path,
                                                  release: str, chunked: bool) -> None:
    prompts = _prompts(ModelSpec.from_pretrained(tiny_model_dir).vocab_size)
    if chunked not in _expected:
        _expected[chunked] = _generate(runner_of(tiny_model_dir, CPUBackend(), DTYPE), prompts, chunked)
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    fake = install_fake_torch_npu(monkeypatch, release=release)
    actual = _generate(runner_of(tiny_model_dir, NPUBackend(device=fake.device), DTYPE), prompts, chunked)
    assert actual == _expected[chunked]
    calls = fake.calls
    assert calls["_npu_flash_attention_qlens"] > 0 and calls["_npu_paged_attention"] > 0  # prefills, decodes
    assert calls["_npu_flash_attention"] == 0  # block 128: the prefix-encoder kernel takes every whole prefill
    assert (calls["_npu_paged_attention_splitfuse"] > 0) == chunked  # mixed steps and off-grid prefixes
    assert all(calls[op] > 0 for op in ("npu_rms_norm", "npu_rotary_mul", "npu_swiglu"))  # the fused kernels


def test_greedy_generation_without_the_fused_kernels_equals_the_cpu_backend(monkeypatch: pytest.MonkeyPatch,
                                                                           tiny_model_dir: Path) -> None:
    prompts = _prompts(ModelSpec.from_pretrained(tiny_model_dir).vocab_size)
    if False not in _expected:
        _expected[False] = _generate(runner_of(tiny_model_dir, CPUBackend(), DTYPE), prompts, chunked=False)
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    fake = install_fake_torch_npu(monkeypatch)
    npu = NPUBackend(device=fake.device)
    monkeypatch.setattr(npu, "prepare_model", lambda model: None)
    assert _generate(runner_of(tiny_model_dir, npu, DTYPE), prompts, chunked=False) == _expected[False]
    assert not any(fake.calls[op] for op in ("npu_rms_norm", "npu_rotary_mul", "npu_swiglu"))


def test_the_backend_passes_each_op_exactly_the_keywords_the_doctor_checks(monkeypatch: pytest.MonkeyPatch,
                                                                          tiny_model_dir: Path) -> None:
    # npu_stack.KEYWORDS is what `npuserve doctor` looks for in each op's schema: the calls must use those names
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    fake = install_fake_torch_npu(monkeypatch, release="26.0.0")
    fake.record.update(KEYWORDS)
    prompts = _prompts(ModelSpec.from_pretrained(tiny_model_dir).vocab_size)
    _generate(runner_of(tiny_model_dir, NPUBackend(device=fake.device), DTYPE), prompts, chunked=True)
    used = {op: set().union(*(call.keys() for call in calls)) for op, calls in fake.args.items()}
    # on 26.0.0 at block 128 every op but the flash kernel runs (reshape-and-cache in the backend's NNAL check)
    # a dense float model calls none of the MoE, MLA and int8 ops
    moe_mla = (set(MOE_OPS) | set(MOE_COMBINE_OPS) | set(MLA_OPS) | set(INT8_LINEAR_OPS)) - {"npu_swiglu"}
    assert set(used) == set(KEYWORDS) - {"_npu_flash_attention"} - moe_mla
    assert all(used[op] == KEYWORDS[op] for op in used), used
