"""Fixtures of the npu backend's tests: the FAKE torch_npu (tests/fake_torch_npu.py; no NPU is here) and a backend
built on it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from npuserve.engine.backends.npu import NPUBackend
from tests.fake_torch_npu import FakeTorchNPU, install_fake_torch_npu


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeTorchNPU]:
    """The fake torch_npu of the engine image's release line (7.3.0)."""
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    yield install_fake_torch_npu(monkeypatch)


@pytest.fixture
def npu(fake: FakeTorchNPU) -> NPUBackend:
    return NPUBackend(device=fake.device)
