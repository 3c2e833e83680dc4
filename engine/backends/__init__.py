"""Device and attention backends (docs/engine.md): `cpu` on torch SDPA, `cuda` on SDPA and a Triton paged decode
kernel, `npu` on torch_npu's ATB operators. Each is imported only when asked for (torch_npu needs Ascend's CANN
runtime, triton a GPU toolchain)."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from npuserve.engine.backends.base import AttentionMetadata, Backend, BackendUnavailableError, MemoryInfo
from npuserve.engine_contract import SERVABLE_DEVICES, unservable

__all__ = ["AttentionMetadata", "Backend", "BackendUnavailableError", "MemoryInfo", "get_backend", "resolve_device"]

DEVICES = ("auto", "cpu", "cuda", "npu")


def _has_npu() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch_npu") is not None


def resolve_device(name: str = "auto") -> str:
    """`auto`: an Ascend card when torch_npu is installed, else a CUDA GPU when torch sees one, else the CPU."""
    if name not in DEVICES:
        raise ValueError(f"unknown device backend {name!r}; expected one of {', '.join(DEVICES)}")
    if name != "auto":
        return name
    if _has_npu():
        return "npu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def get_backend(name: str = "auto", rank: int = 0, device_ids: Seq[int] | None = None) -> Backend:
    """The backend of tensor-parallel rank `rank`, on card `device_ids[rank]` (MindIE's `npuDeviceIds`, logical
    ids among the visible ones), else card `rank`."""
    device = resolve_device(name)
    if device not in SERVABLE_DEVICES:
        raise NotImplementedError(unservable(device, 1))
    if device == "npu":
        from npuserve.engine.backends.npu import NPUBackend

        return NPUBackend(device_ids, rank)
    if device == "cuda":
        import torch

        from npuserve.engine.backends.cuda import CUDABackend

        if device_ids is not None and rank >= len(device_ids):
            raise ValueError(f"rank {rank} has no card: npuDeviceIds {list(device_ids)} lists {len(device_ids)}")
        index = device_ids[rank] if device_ids is not None else rank
        return CUDABackend(torch.device("cuda", index))
    from npuserve.engine.backends.cpu import CPUBackend

    return CPUBackend()
