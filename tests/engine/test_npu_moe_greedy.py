"""Greedy generation of the tiny MoE model (`tiny-qwen3-moe`) through the model runner with the npu backend, against
the FAKE torch_npu (tests/fake_torch_npu.py) of every supported op-plugin line: the MoE chain (gating, init_routing_v2,
grouped matmuls, swiglu, token_unpermute or, on 7.0.0, finalize_routing) generates the CPU backend's tokens exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from npuserve.catalog.models import get_model_preset
from npuserve.engine.backends.cpu import CPUBackend
from npuserve.engine.backends.npu import NPUBackend
from npuserve.engine.model.dummy import write_dummy_model
from npuserve.modelspec import ModelSpec
from tests.fake_torch_npu import RELEASES, install_fake_torch_npu
from tests.npu_testing import runner_of
from tests.paged_inputs import greedy_tokens

DTYPE = torch.float16
STEPS = 6
_expected: list[list[int]] = []


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dummy_model(get_model_preset("tiny-qwen3-moe"), tmp_path_factory.mktemp("tiny-qwen3-moe"), seed=0)


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(23)
    return [torch.randint(5, vocab, (n,), generator=gen).tolist() for n in (20, 300, 45, 60)]


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_moe_greedy_generation_equals_the_cpu_backend(monkeypatch: pytest.MonkeyPatch, moe_model_dir: Path,
                                                      release: str) -> None:
    prompts = _prompts(ModelSpec.from_pretrained(moe_model_dir).vocab_size)
    if not _expected:
        _expected.extend(greedy_tokens(runner_of(moe_model_dir, CPUBackend(), DTYPE), prompts, steps=STEPS, seed=24))
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    fake = install_fake_torch_npu(monkeypatch, release=release)
    npu = runner_of(moe_model_dir, NPUBackend(device=fake.device), DTYPE)
    actual = greedy_tokens(npu, prompts, steps=STEPS, seed=24)
    assert actual == _expected
    calls = fake.calls
    assert calls["npu_moe_gating_top_k_softmax"] > 0 and calls["npu_moe_init_routing_v2"] > 0
    assert calls["npu_grouped_matmul"] == 2 * calls["npu_moe_init_routing_v2"]
    combine = "npu_moe_finalize_routing" if release == "7.0.0" else "npu_moe_token_unpermute"
    assert calls[combine] == calls["npu_moe_init_routing_v2"]
