"""The KV block size on npu: the paged-attention kernels take a multiple of 16 up to 128 with block x head size at
most 128 x 128 (ATB PagedAttention, SplitFuse's parallel decoding); the engine refuses any other at start-up, naming
it, before it loads a weight."""

from __future__ import annotations

import pytest

from npuserve.catalog.models import get_model_preset
from npuserve.engine.servable import refusals
from npuserve.mindie_config import minimal_config

TINY = get_model_preset("tiny")  # head size 32
LLAMA = get_model_preset("llama3-8b")  # head size 128


@pytest.mark.parametrize(("block_size", "spec", "error"), [
    (8, TINY, "multiple of 16"),
    (100, TINY, "multiple of 16"),
    (256, TINY, "at most 128"),
    (1024, TINY, "at most 128"),
])
def test_npu_refuses_a_block_size_its_kernels_cannot_take(block_size: int, spec: object, error: str) -> None:
    config = minimal_config("/m", cacheBlockSize=block_size)
    found = [r for r in refusals(config, "npu", spec) if "cacheBlockSize" in r]  # type: ignore[arg-type]
    assert len(found) == 1 and error in found[0], refusals(config, "npu", spec)  # type: ignore[arg-type]


@pytest.mark.parametrize(("block_size", "spec"), [(128, TINY), (128, LLAMA), (16, TINY), (64, LLAMA)])
def test_npu_takes_the_block_sizes_its_kernels_take(block_size: int, spec: object) -> None:
    config = minimal_config("/m", cacheBlockSize=block_size)
    assert not [r for r in refusals(config, "npu", spec) if "cacheBlockSize" in r]  # type: ignore[arg-type]


def test_other_devices_take_any_block_size() -> None:
    for device in ("cpu", "cuda"):
        assert not refusals(minimal_config("/m", cacheBlockSize=8), device, TINY)
