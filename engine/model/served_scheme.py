"""The scheme the engine serves: the checkpoint's own declaration, checked against the engine config's
`npuserve.quantization` (a `QuantizationRequest`), or the request's with random weights. No torch here: the
config checks (`servable.py`) call it before anything loads."""

from __future__ import annotations

from npuserve.modelspec import ModelSpec
from npuserve.quantization import QuantizationRequest


class QuantizationMismatchError(ValueError):
    """The engine config's `npuserve.quantization` is not what the checkpoint declares."""


def served_spec(spec: ModelSpec, request: QuantizationRequest | None, dummy: bool) -> ModelSpec:
    """The spec the engine serves: the checkpoint's scheme, which `request` (the engine config's
    `npuserve.quantization`) must match; with random weights (`dummy`) and no checkpoint scheme, the request's."""
    if request is None:
        return spec
    wanted = request.scheme()
    if spec.quantization is None:
        if dummy:
            return spec.model_copy(update={"quantization": wanted})
        raise QuantizationMismatchError(
            f"the engine config's npuserve.quantization is {wanted.name}, but the checkpoint is not quantized "
            "(no quant_model_description.json, no quantization_config)")
    if not request.matches(spec.quantization):
        raise QuantizationMismatchError(
            f"the engine config's npuserve.quantization is {wanted.name}, but the checkpoint declares "
            f"{spec.quantization.name}; set it to the checkpoint's scheme or leave it out")
    return spec
