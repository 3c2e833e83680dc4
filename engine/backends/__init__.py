"""Device and attention backends (DESIGN.md 3.3). `cpu` runs on torch SDPA; `cuda` and `npu` are later work."""

from __future__ import annotations

from npuserve.engine.backends.base import AttentionMetadata, Backend, MemoryInfo

__all__ = ["AttentionMetadata", "Backend", "MemoryInfo", "get_backend"]


def get_backend(name: str = "auto") -> Backend:
    """`auto` picks the CPU here; the `npu` (torch_npu) and `cuda` backends are not built yet and say so."""
    if name in ("auto", "cpu"):
        from npuserve.engine.backends.cpu import CPUBackend

        return CPUBackend()
    if name in ("npu", "cuda"):
        raise NotImplementedError(f"the {name!r} backend is not built yet; use device 'cpu'")
    raise ValueError(f"unknown device backend {name!r}; expected auto, cpu, cuda or npu")
