"""A FAKE of torch_npu, for tests. It is not torch_npu and runs no NPU kernel.

`install_fake_torch_npu(monkeypatch, release="7.3.0")` puts in `sys.modules["torch_npu"]` a module holding exactly
the operations that op-plugin release line has, under that line's signatures (tests/fake_npu_releases.py), each
implementing its documented semantics in plain torch on the CPU and refusing what the real one refuses, every rule
cited where it is checked (tests/fake_npu_attention.py for the cache and attention ops, tests/fake_npu_fused.py for
the fused kernels); `torch_npu.__version__` is a torch_npu of that line. It attaches a fake `torch.npu`
(`device_count`, `set_device`, `current_device`, `mem_get_info`, `empty_cache`, the peak-memory statistics,
`synchronize`, `utils.get_cann_version`); the "npu" device is the CPU (`FakeTorchNPU.device`): tensors stay on the CPU.

As torch_npu exposes them: every op carries its schema (`op.default._schema.arguments`, as the `torch.ops.npu.<op>`
packets do, and the ATB ones' `torch.ops.atb.<op>` once their first call has loaded NNAL's libatb.so and put them
in place, op-plugin `op_plugin/python/atb/_atb_ops.py`); with `nnal=False` each ATB op raises the OSError torch_npu
raises at that first call.

Memory: `free_bytes` of `total_bytes` are free, and `cached_bytes` more sit in the caching allocator, counted as
used by `mem_get_info` until `empty_cache()` returns them (as torch_npu's allocator holds a warm-up's blocks).

What it cannot check: host versus device placement, the kernels' real numerics and speed, the NZ layout, HCCL,
graphs, limits the references do not state.
"""

from __future__ import annotations

import inspect
import os
import sys
import types
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from tests.fake_npu_attention import NNAL_MISSING, FakeNPUError, integer, require
from tests.fake_npu_fused import ROTARY_MAX_HEAD_DIM
from tests.fake_npu_releases import ATB_OPS, RELEASES, FakeRelease

GiB = 1024**3
VISIBLE_DEVICES_ENV = "ASCEND_RT_VISIBLE_DEVICES"
DEFAULT_RELEASE = "7.3.0"  # the engine image's (deploy/docker/engine.Dockerfile: torch_npu 2.8.0.post2, CANN 8.5.0)


@dataclass
class FakeNPUNamespace:
    """The fake `torch.npu`: `physical_cards` cards of `total_bytes`, `free_bytes` of them free and `cached_bytes`
    held by the allocator's cache; the visible cards are those `ASCEND_RT_VISIBLE_DEVICES` lists (read at each
    call), numbered 0..n-1."""

    physical_cards: int = 8
    total_bytes: int = 64 * GiB
    free_bytes: int = 60 * GiB
    cached_bytes: int = 0
    allocated_bytes: int = 0  # what tensors hold now (a test sets it; nothing here allocates on a card)
    peak_allocated_bytes: int = 0  # since the last reset_peak_memory_stats
    cann: str = ""
    current: int | None = None
    synchronize_calls: int = 0
    empty_cache_calls: int = 0
    set_device_calls: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.utils = types.SimpleNamespace(get_cann_version=self.get_cann_version)

    def device_count(self) -> int:
        visible = os.environ.get(VISIBLE_DEVICES_ENV, "").strip()
        if not visible:
            return self.physical_cards
        return sum(1 for card in visible.split(",") if int(card) < self.physical_cards)

    def _index(self, device: object) -> int:
        if isinstance(device, str):
            require(device.startswith("npu:") and device[4:].isdigit(), f"device {device!r}: expected 'npu:<n>'")
            device = int(device[4:])
        index = integer("device", device)
        require(0 <= index < self.device_count(), f"device {index}: {self.device_count()} card(s) visible")
        return index

    def set_device(self, device: int | str) -> None:
        self.current = self._index(device)
        self.set_device_calls.append(self.current)

    def current_device(self) -> int:
        return 0 if self.current is None else self.current

    def mem_get_info(self, device: int | str | None = None) -> tuple[int, int]:
        if device is not None:
            self._index(device)
        return self.free_bytes, self.total_bytes

    def empty_cache(self) -> None:
        self.free_bytes += self.cached_bytes
        self.cached_bytes = 0
        self.empty_cache_calls += 1

    def reset_peak_memory_stats(self, device: int | str | None = None) -> None:
        self.peak_allocated_bytes = self.allocated_bytes

    def memory_allocated(self, device: int | str | None = None) -> int:
        return self.allocated_bytes

    def max_memory_allocated(self, device: int | str | None = None) -> int:
        return max(self.peak_allocated_bytes, self.allocated_bytes)

    def synchronize(self, device: int | str | None = None) -> None:
        if device is not None:
            self._index(device)
        self.synchronize_calls += 1

    def get_cann_version(self, module: str = "CANN") -> str:
        """torch_npu.npu.utils.get_cann_version (7.0.0 on): the version string, "" for an unknown module."""
        return self.cann if module == "CANN" else ""


@dataclass
class FakeTorchNPU:
    """What `install_fake_torch_npu` installed: the module, the `torch.npu` namespace, the release, each op's count
    of successful calls, and the keyword arguments of the calls to the ops named in `record`."""

    module: types.ModuleType
    npu: FakeNPUNamespace
    release: FakeRelease
    calls: Counter[str]
    record: set[str] = field(default_factory=set)
    args: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # the fake's "npu" device


def _schema(op: Callable[..., Any]) -> types.SimpleNamespace:
    """`torch.ops.npu.<op>.default`'s stand-in: `_schema.arguments`, each with its `name`."""
    names = [types.SimpleNamespace(name=p) for p in inspect.signature(op).parameters]
    return types.SimpleNamespace(_schema=types.SimpleNamespace(arguments=names))


def _wrap(name: str, op: Callable[..., Any], fake: FakeTorchNPU, nnal: bool) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        if name in ATB_OPS and not nnal:
            raise OSError(2, NNAL_MISSING)
        result = op(*args, **kwargs)  # the op's own signature refuses misnamed (and, if keyword-only, positional) ones
        fake.calls[name] += 1
        if name in fake.record:
            fake.args.setdefault(name, []).append(dict(kwargs))
        return result

    call.__name__ = call.__qualname__ = name
    call.__doc__ = op.__doc__
    call.default = _schema(op)  # type: ignore[attr-defined]
    return call


def install_fake_torch_npu(monkeypatch: pytest.MonkeyPatch, *, release: str = DEFAULT_RELEASE, nnal: bool = True,
                           physical_cards: int = 8, total_bytes: int = 64 * GiB, free_bytes: int = 60 * GiB,
                           cached_bytes: int = 0) -> FakeTorchNPU:
    """Makes `import torch_npu` return the fake of op-plugin `release` and `torch.npu` the fake namespace, until
    the test ends. `nnal=False`: NNAL (libatb.so) is missing, so every ATB op raises OSError."""
    line = RELEASES[release]
    namespace = FakeNPUNamespace(physical_cards=physical_cards, total_bytes=total_bytes, free_bytes=free_bytes,
                                 cached_bytes=cached_bytes, cann=line.cann)
    module = types.ModuleType("torch_npu", f"FAKE torch_npu {line.torch_npu} (op-plugin {line.name}; "
                                           "tests/fake_torch_npu.py): plain torch on the CPU")
    fake = FakeTorchNPU(module=module, npu=namespace, release=line, calls=Counter())
    for name, op in line.ops().items():
        setattr(module, name, _wrap(name, op, fake, nnal))
    module.__version__ = line.torch_npu  # type: ignore[attr-defined]
    module.npu = namespace  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    monkeypatch.setattr(torch, "npu", namespace, raising=False)
    return fake


__all__ = ["RELEASES", "ROTARY_MAX_HEAD_DIM", "FakeNPUError", "FakeNPUNamespace", "FakeTorchNPU",
           "install_fake_torch_npu"]
