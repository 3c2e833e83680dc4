"""Greedy generation of DeepSeek-V3-shaped models (multi-head latent attention and sigmoid grouped MoE) through the
model runner with the npu backend, against the FAKE torch_npu (tests/fake_torch_npu.py) of every supported op-plugin
line: the CPU backend's tokens exactly.

Two models: `tiny-deepseek-v3` as it is, whose kv_lora_rank 64 and rope 16 are outside the MLA ops' contract (its
MLA runs on the torch reference, said in the log, its MoE on the npu ops), and the same model with DeepSeek-V3's
latent and rope widths (512, 64), whose cache writes go through `npu_kv_rmsnorm_rope_cache` and decodes through
FIA's MLA path."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from npuserve.catalog.models import get_model_preset
from npuserve.engine.backends.cpu import CPUBackend
from npuserve.engine.backends.npu import NPUBackend
from npuserve.engine.model.dummy import write_dummy_model
from npuserve.engine.runner import ModelRunner
from npuserve.modelspec import ModelSpec
from tests.fake_torch_npu import RELEASES, install_fake_torch_npu
from tests.npu_testing import runner_of
from tests.paged_inputs import greedy_tokens, greedy_tokens_chunked

DTYPE = torch.float16
STEPS = 5
_expected: dict[tuple[str, bool], list[list[int]]] = {}


def _legal_spec() -> ModelSpec:
    """tiny-deepseek-v3 with FIA's and the cache write's MLA widths: kv_lora_rank 512, qk_rope_head_dim 64."""
    fields = get_model_preset("tiny-deepseek-v3").model_dump()
    fields["mla"].update(kv_lora_rank=512, qk_rope_head_dim=64)
    fields["head_dim"] = fields["mla"]["qk_nope_head_dim"] + 64
    return ModelSpec.model_validate(fields)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {"tiny": write_dummy_model(get_model_preset("tiny-deepseek-v3"), tmp_path_factory.mktemp("v3"), seed=0),
            "legal": write_dummy_model(_legal_spec(), tmp_path_factory.mktemp("v3-512"), seed=0)}


def _generate(runner: ModelRunner, vocab: int, chunked: bool) -> list[list[int]]:
    gen = torch.Generator().manual_seed(31)
    prompts = [torch.randint(5, vocab, (n,), generator=gen).tolist() for n in (20, 300, 45, 60)]
    if chunked:
        return greedy_tokens_chunked(runner, prompts, steps=STEPS, seed=32, chunk=100)
    return greedy_tokens(runner, prompts, steps=STEPS, seed=32)


@pytest.mark.parametrize("chunked", [False, True], ids=["whole-prefills", "chunked-prefill"])
@pytest.mark.parametrize("release", sorted(RELEASES))
def test_mla_greedy_generation_equals_the_cpu_backend(monkeypatch: pytest.MonkeyPatch, model_dirs: dict[str, Path],
                                                      release: str, chunked: bool) -> None:
    model_dir = model_dirs["legal"]
    vocab = ModelSpec.from_pretrained(model_dir).vocab_size
    if ("legal", chunked) not in _expected:
        _expected["legal", chunked] = _generate(runner_of(model_dir, CPUBackend(), DTYPE), vocab, chunked)
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    fake = install_fake_torch_npu(monkeypatch, release=release)
    npu = runner_of(model_dir, NPUBackend(device=fake.device), DTYPE)
    assert _generate(npu, vocab, chunked) == _expected["legal", chunked]
    calls = fake.calls
    assert calls["npu_kv_rmsnorm_rope_cache"] > 0 and calls["npu_fused_infer_attention_score"] > 0
    assert calls["npu_moe_gating_top_k"] > 0 and calls["npu_grouped_matmul"] > 0  # DeepSeek-V3's MoE layers


def test_the_tiny_preset_runs_its_mla_on_the_reference_and_equals_the_cpu_backend(
        monkeypatch: pytest.MonkeyPatch, model_dirs: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    model_dir = model_dirs["tiny"]
    vocab = ModelSpec.from_pretrained(model_dir).vocab_size
    expected = _generate(runner_of(model_dir, CPUBackend(), DTYPE), vocab, chunked=False)
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    fake = install_fake_torch_npu(monkeypatch, release="7.3.0")
    with caplog.at_level(logging.WARNING):
        assert _generate(runner_of(model_dir, NPUBackend(device=fake.device), DTYPE), vocab, chunked=False) == expected
    assert fake.calls["npu_kv_rmsnorm_rope_cache"] == 0 and fake.calls["npu_fused_infer_attention_score"] == 0
    assert fake.calls["npu_moe_gating_top_k"] > 0
    assert "MLA cache write runs on the torch reference: kv_lora_rank 64" in caplog.text
