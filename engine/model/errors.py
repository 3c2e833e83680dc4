"""The loader's error, shared by the loader and the module swap of a quantized model (`quantize.py`)."""

from __future__ import annotations


class WeightLoadError(RuntimeError):
    """The checkpoint does not match the model (missing, unexpected or misshapen tensors)."""
