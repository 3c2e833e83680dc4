"""The npu kernels' block-size rule (npuserve/npu_contract.py), defined once: the engine refuses at start-up what it
refuses (tests/engine/test_npu_block_size.py), and the operator's plan says so and refuses a pinned block size the
card's kernels cannot take."""

from __future__ import annotations

import re

import pytest

from npuserve.npu_contract import NPU_BLOCK_SIZE, block_size_problem, npu_block_size_problem, prefix_encoder_takes
from npuserve.planning.api import InferenceServiceSpec
from npuserve.planning.planner import PlanError, plan


@pytest.mark.parametrize(("block_size", "head_dim", "error"), [
    (8, 128, "multiple of 16"),
    (100, 64, "multiple of 16"),
    (0, 64, "multiple of 16"),
    (256, 64, "at most 128"),
    (128, 256, "32768 on npu"),  # block x head > 128 x 128: use 64 or less
    (128, 512, r"head size 512: the Ascend attention kernels take \(0, 256\]"),
])
def test_the_npu_kernels_refuse(block_size: int, head_dim: int, error: str) -> None:
    problem = npu_block_size_problem(block_size, head_dim)
    assert problem is not None and re.search(error, problem), problem


@pytest.mark.parametrize(("block_size", "head_dim"), [(128, 128), (128, 32), (16, 32), (64, 256), (112, 128)])
def test_the_npu_kernels_take(block_size: int, head_dim: int) -> None:
    assert npu_block_size_problem(block_size, head_dim) is None


def test_the_prefix_encoder_takes_block_128_and_heads_up_to_128_in_steps_of_16() -> None:
    assert prefix_encoder_takes(128, 128) and prefix_encoder_takes(128, 32)
    assert not prefix_encoder_takes(64, 128) and not prefix_encoder_takes(128, 256)
    assert not prefix_encoder_takes(128, 40)


def test_other_devices_take_any_block_size() -> None:
    assert block_size_problem("cpu", 8, 512) is None and block_size_problem("cuda", 1000, 128) is None
    assert block_size_problem("npu", 8, 128) is not None
    assert NPU_BLOCK_SIZE == 128


def _spec(accelerator: str, **schedule: int) -> InferenceServiceSpec:
    return InferenceServiceSpec.model_validate({
        "model": {"name": "llama3-8b", "preset": "llama3-8b", "weights": {"loadFormat": "dummy"}},
        "accelerator": {"type": accelerator, "cards": 2, "memoryGiB": 32, "reservedGiB": 3},
        "workload": {"avgInputTokens": 186, "avgOutputTokens": 346, "maxOutputTokens": 512},
        "engine": {"schedule": schedule},
    })


def test_the_plan_states_the_npu_rule_and_refuses_a_pinned_block_size_the_kernels_cannot_take() -> None:
    note = plan(_spec("ascend-910b4")).explained("schedule.cacheBlockSize").note
    assert "on npu: a multiple of 16 up to 128" in note and "prefix-encoder" in note
    with pytest.raises(PlanError, match=r"spec\.engine\.schedule\.cacheBlockSize: cacheBlockSize 256 on npu"):
        plan(_spec("ascend-910b4", cacheBlockSize=256))
    assert plan(_spec("ascend-910b4", cacheBlockSize=64)).schedule.cacheBlockSize == 64


def test_the_plan_leaves_other_devices_block_size_alone() -> None:
    p = plan(_spec("nvidia-h100-80gb", cacheBlockSize=256))
    assert p.schedule.cacheBlockSize == 256 and "on npu" not in p.explained("schedule.cacheBlockSize").note


def test_a_latent_attention_model_takes_fias_block_rule_on_npu() -> None:
    # DeepSeek-V3's qk head (192) at block 128 breaks the dense kernels' rule, which its attention never meets
    assert block_size_problem("npu", 128, 192) is not None
    assert block_size_problem("npu", 128, 192, latent_attention=True) is None
    assert block_size_problem("npu", 1024, 192, latent_attention=True) is None
    assert "multiple of 16 up to 1024" in str(block_size_problem("npu", 2048, 192, latent_attention=True))
    assert block_size_problem("cpu", 8, 192, latent_attention=True) is None
