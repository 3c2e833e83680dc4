"""Device and attention backends (DESIGN.md 3.3). `cpu` runs on torch SDPA; `cuda` and `npu` are later work."""

from __future__ import annotations

from npuserve.engine.backends.base import AttentionMetadata, Backend, MemoryInfo
from npuserve.engine_contract import SERVABLE_DEVICES, unservable

__all__ = ["AttentionMetadata", "Backend", "MemoryInfo", "get_backend", "resolve_device"]

DEVICES = ("auto", "cpu", "cuda", "npu")


def resolve_device(name: str = "auto") -> str:
    """`auto` is the CPU here (the accelerator backends are not built yet)."""
    if name not in DEVICES:
        raise ValueError(f"unknown device backend {name!r}; expected one of {', '.join(DEVICES)}")
    return "cpu" if name == "auto" else name


def get_backend(name: str = "auto") -> Backend:
    device = resolve_device(name)
    if device not in SERVABLE_DEVICES:
        raise NotImplementedError(unservable(device, 1))
    from npuserve.engine.backends.cpu import CPUBackend

    return CPUBackend()
