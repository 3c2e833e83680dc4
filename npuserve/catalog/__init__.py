"""Built-in catalogs: model architectures and accelerators."""

from npuserve.catalog.accelerators import ACCELERATORS, Accelerator, get_accelerator
from npuserve.catalog.models import MODEL_PRESETS, get_model_preset

__all__ = ["ACCELERATORS", "MODEL_PRESETS", "Accelerator", "get_accelerator", "get_model_preset"]
