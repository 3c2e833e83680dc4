"""Quantized checkpoints: the schemes npuserve serves, read from the checkpoint's own declaration, and the bytes
their weights take. One definition for the engine (which layers load int8 and how they multiply), the planner and
the simulator (bytes per parameter).

Two formats declare the same two int8 schemes (W8A8: int8 weights, one scale per output channel; int8 activations):
- msModelSlim (Huawei; what MindIE and vllm-ascend load): `quant_model_description.json` beside `config.json`, with
  `model_quant_type` and one entry per tensor: `W8A8` (static: the activation quantised with a per-tensor scale and
  offset found at calibration; tensors `weight` int8, `weight_scale`, `weight_offset`, `input_scale`,
  `input_offset`, `deq_scale`, `quant_bias`), `W8A8_DYNAMIC` (the activation quantised per token at run time;
  `weight`, `weight_scale`, `weight_offset`), `FLOAT` (kept in the model's dtype). One checkpoint may mix them
  (DeepSeek-R1 W8A8: attention static, experts dynamic).
- compressed-tensors (llm-compressor; vLLM): `quantization_config` in `config.json`, `quant_method:
  compressed-tensors`, `format: int-quantized`, config groups of int8 symmetric weights (strategy `channel`) and
  int8 input activations (strategy `tensor` static, or `token` dynamic), and an `ignore` list of modules kept in
  float (names, or `re:` patterns).

Anything else a checkpoint may declare (int4 or fp8 weights, another method, a quantized KV cache) is refused with
the scheme's name (`UnsupportedQuantizationError`): never loaded as if it were 16-bit.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# "w8a8": int8 weights per output channel, the activation quantised with one static scale (and, in msModelSlim, an
# offset) per tensor; "w8a8_dynamic": the same weights, the activation quantised per token at run time.
QuantMethod = Literal["w8a8", "w8a8_dynamic"]
QUANT_METHODS: tuple[str, ...] = ("w8a8", "w8a8_dynamic")
QuantFormat = Literal["msmodelslim", "compressed-tensors"]
QUANT_FORMATS: tuple[str, ...] = ("msmodelslim", "compressed-tensors")

MSMODELSLIM_DESCRIPTION = "quant_model_description.json"  # msModelSlim's declaration, beside config.json
_MSMODELSLIM_TYPES: dict[str, QuantMethod | None] = {"W8A8": "w8a8", "W8A8_DYNAMIC": "w8a8_dynamic", "FLOAT": None}

# Bytes each int8 linear layer stores per output channel beyond its int8 weight row, by format and method, as the
# tools write them for a 16-bit (bf16/fp16) model: the scales and offsets come in the model's dtype (a float32 model
# gets 4-byte ones); the per-tensor activation scale/offset are a few bytes per layer and not counted. Measured on
# msModelSlim 26.1.0 and llm-compressor 0.14.0.1 output (tests/thirdparty/test_quant_tools.py, docs/quantization.md):
# msModelSlim W8A8: weight_scale and weight_offset (2 each), deq_scale (float32, 4), quant_bias (int32, 4);
# W8A8_DYNAMIC: weight_scale and weight_offset (2 each). compressed-tensors (static and dynamic): weight_scale (2).
ROW_OVERHEAD_BYTES: dict[tuple[str, str], int] = {
    ("msmodelslim", "w8a8"): 2 + 2 + 4 + 4,
    ("msmodelslim", "w8a8_dynamic"): 2 + 2,
    ("compressed-tensors", "w8a8"): 2,
    ("compressed-tensors", "w8a8_dynamic"): 2,
}


class QuantizationRequest(BaseModel):
    """A scheme named by a user (the InferenceService's `spec.model.quantization`, the engine config's
    `npuserve.quantization`): which format and method. With a checkpoint, it must be what the checkpoint declares
    (the engine refuses a mismatch); with random weights (`loadFormat: dummy`) the engine draws int8 weights of this
    scheme; the planner sizes the weights by it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: QuantFormat = Field(description="the tool's format: msmodelslim (quant_model_description.json) or "
                                "compressed-tensors (llm-compressor)")
    method: QuantMethod = Field(description="w8a8: int8 weights and static int8 activations; w8a8_dynamic: int8 "
                                "weights, activations quantized per token at run time")

    def scheme(self) -> QuantScheme:
        """The standard coverage (`standard_module_method`) of this format and method."""
        return QuantScheme(format=self.format, method=self.method)

    def matches(self, scheme: QuantScheme) -> bool:
        return scheme.format == self.format and scheme.method == self.method


def parse_quantization(value: str, flag: str = "--quantization") -> QuantizationRequest:
    """A command line's `FORMAT:METHOD` (msmodelslim:w8a8_dynamic) as a `QuantizationRequest`; the ValueError names
    `flag`. One parser for `npuserve plan`, `simulate` and `generate`."""
    fmt, sep, method = value.partition(":")
    if not sep or fmt not in QUANT_FORMATS or method not in QUANT_METHODS:
        raise ValueError(f"{flag} {value!r}: expected FORMAT:METHOD with FORMAT one of {', '.join(QUANT_FORMATS)} "
                         f"and METHOD one of {', '.join(QUANT_METHODS)} (KV cache quantization is not supported)")
    return QuantizationRequest.model_validate({"format": fmt, "method": method})


class UnsupportedQuantizationError(ValueError):
    """The checkpoint declares a quantization npuserve does not serve; the message names the scheme."""


class QuantScheme(BaseModel):
    """What a checkpoint declares: its format, its headline method, and which linear modules are int8 and how.

    `modules` (msModelSlim): HF module name (the tensor name less `.weight`) -> method, or None for a module kept in
    float; a module not listed falls back to the standard rule (`standard_module_method`). `ignore`
    (compressed-tensors): names or `re:` patterns of modules kept in float. Without either (a plan from a catalog
    model, no checkpoint read), every decoder linear layer but the MoE router is int8 with `method`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: QuantFormat
    method: QuantMethod
    modules: dict[str, QuantMethod | None] = Field(default_factory=dict)
    ignore: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """As a user would say it: `msmodelslim W8A8_DYNAMIC`, `compressed-tensors W8A8 (static)`."""
        if self.format == "msmodelslim":
            return f"msmodelslim {self.method.upper()}"
        return f"compressed-tensors W8A8 ({'dynamic' if self.method == 'w8a8_dynamic' else 'static'})"

    def module_method(self, module: str) -> QuantMethod | None:
        """How the linear module `module` (HF name, e.g. `model.layers.3.mlp.experts.7.up_proj`) is stored: a
        method (int8), or None (the model's dtype)."""
        if module in self.modules:
            return self.modules[module]
        if any(_ignored(module, pattern) for pattern in self.ignore):
            return None
        return self.method if standard_module_method(module) else None

    def row_overhead_bytes(self, method: QuantMethod | None = None) -> int:
        return ROW_OVERHEAD_BYTES[(self.format, method or self.method)]

    def linear_bytes(self, module: str, out_features: int, in_features: int, dtype_bytes: int) -> int:
        """Bytes the linear module's weight takes in this checkpoint (its scales included)."""
        method = self.module_method(module)
        if method is None:
            return out_features * in_features * dtype_bytes
        return out_features * (in_features + self.row_overhead_bytes(method))


def standard_module_method(module: str) -> bool:
    """The standard coverage of both tools' W8A8 recipes: every linear layer inside a decoder layer is int8, but the
    MoE router (`mlp.gate`) and Qwen2-MoE's `shared_expert_gate`; the embedding, the LM head and the norms stay in
    float (they are not linear layers of a decoder layer)."""
    if ".layers." not in module or not module.startswith("model."):
        return False
    return not (module.endswith(".mlp.gate") or module.endswith(".shared_expert_gate"))


def _ignored(module: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return module == pattern or module.endswith("." + pattern) or pattern == module.rsplit(".", 1)[-1] == "lm_head"


# --- reading a checkpoint's declaration ---------------------------------------------------------------------------


def scheme_of(config: dict[str, Any], description: dict[str, Any] | None = None) -> QuantScheme | None:
    """The scheme a checkpoint declares: `description` is msModelSlim's `quant_model_description.json` (None: the
    folder has none), `config` the `config.json`. None: not quantized. Raises `UnsupportedQuantizationError` naming
    anything else."""
    quant = config.get("quantization_config")
    if description is not None:
        if quant:
            raise UnsupportedQuantizationError(
                f"the checkpoint declares two quantizations: {MSMODELSLIM_DESCRIPTION} and config.json's "
                f"quantization_config ({_quant_method_name(quant)}); keep one")
        return _msmodelslim_scheme(description)
    if not quant:
        return None
    method = _quant_method_name(quant)
    if method != "compressed-tensors":
        raise UnsupportedQuantizationError(_OTHER_METHODS.get(method, (
            f"quantization_config with quant_method {method!r} is not supported; npuserve serves W8A8 (int8) "
            "checkpoints from msModelSlim and compressed-tensors (llm-compressor), and bf16/fp16 ones")))
    return _compressed_tensors_scheme(quant)


def description_path(folder: str | Path) -> Path | None:
    """msModelSlim's description file in `folder`, None without one. Its `ascendV1` save (what its examples write
    for vllm-ascend, and what vllm-ascend reads) names it `quant_model_description.json`; its `safe_tensor` save
    (MindIE's) `quant_model_description_<type>.json` (e.g. `_w8a8_dynamic`). Both carry the same entries."""
    folder = Path(folder)
    exact = folder / MSMODELSLIM_DESCRIPTION
    if exact.exists():
        return exact
    found = sorted(folder.glob("quant_model_description*.json"))
    if len(found) > 1:
        raise UnsupportedQuantizationError(
            f"the checkpoint has several msModelSlim description files ({', '.join(p.name for p in found)}); keep one")
    return found[0] if found else None


def read_scheme(folder: str | Path, config: dict[str, Any] | None = None) -> QuantScheme | None:
    """`scheme_of` on a model folder (its config.json and msModelSlim's description file, when present)."""
    folder = Path(folder)
    if config is None:
        config = json.loads((folder / "config.json").read_text())
    path = description_path(folder)
    description = json.loads(path.read_text()) if path is not None else None
    return scheme_of(config, description)


_OTHER_METHODS = {
    "fp8": ("quantization_config with quant_method 'fp8' (FP8 block-quantised checkpoints, the original "
            "DeepSeek-V3/R1 release) is not supported: Ascend 910B cards have no FP8; convert the checkpoint to bf16 "
            "first (DeepSeek's inference/fp8_cast_bf16.py), or to W8A8 with msModelSlim"),
}


def _quant_method_name(quant: dict[str, Any]) -> str:
    return str(quant.get("quant_method") or quant.get("quant_type") or "unknown")


def _msmodelslim_scheme(description: dict[str, Any]) -> QuantScheme:
    headline = str(description.get("model_quant_type") or "")
    if headline not in ("W8A8", "W8A8_DYNAMIC"):
        raise UnsupportedQuantizationError(
            f"msModelSlim model_quant_type {headline or 'missing'!r} is not supported; npuserve serves W8A8 and "
            "W8A8_DYNAMIC")
    for key in ("kv_cache_type", "kv_quant_type", "fa_quant_type"):
        value = description.get(key)
        if value not in (None, "", "FLOAT"):
            raise UnsupportedQuantizationError(
                f"msModelSlim {key} {value!r} (a quantized KV cache / attention) is not supported; the KV cache "
                "stays 16-bit")
    modules: dict[str, QuantMethod | None] = {}
    for key, value in description.items():
        if not isinstance(value, str) or not key.endswith(".weight"):
            continue
        if ".kv_cache_scale" in key or key.endswith(("k_cache.weight", "v_cache.weight")):
            raise UnsupportedQuantizationError(f"msModelSlim KV cache quantization ({key}: {value}) is not "
                                               "supported; the KV cache stays 16-bit")
        if value not in _MSMODELSLIM_TYPES:
            raise UnsupportedQuantizationError(
                f"msModelSlim quant type {value!r} (tensor {key}) is not supported; npuserve serves W8A8, "
                "W8A8_DYNAMIC and FLOAT")
        modules[key.removesuffix(".weight")] = _MSMODELSLIM_TYPES[value]
    method: QuantMethod = "w8a8" if headline == "W8A8" else "w8a8_dynamic"
    return QuantScheme(format="msmodelslim", method=method, modules=modules)


def _compressed_tensors_scheme(quant: dict[str, Any]) -> QuantScheme:
    if quant.get("kv_cache_scheme"):
        kv = quant["kv_cache_scheme"]
        raise UnsupportedQuantizationError(
            f"compressed-tensors kv_cache_scheme ({_describe_args(kv)}) is not supported; the KV cache stays 16-bit")
    groups = quant.get("config_groups") or {}
    if not groups:
        raise UnsupportedQuantizationError("compressed-tensors quantization_config without config_groups")
    methods: set[QuantMethod] = set()
    for name, group in groups.items():
        methods.add(_compressed_tensors_group(str(name), group, str(quant.get("format") or "")))
    if len(methods) != 1:
        raise UnsupportedQuantizationError(
            f"compressed-tensors config groups with different activation schemes ({', '.join(sorted(methods))}) are "
            "not supported")
    return QuantScheme(format="compressed-tensors", method=methods.pop(),
                       ignore=tuple(str(p) for p in quant.get("ignore") or ()))


def _describe_args(args: dict[str, Any] | None) -> str:
    if not args:
        return "none"
    return (f"{args.get('type', 'int')}{args.get('num_bits', '?')} strategy {args.get('strategy')}"
            + (" dynamic" if args.get("dynamic") else "") + ("" if args.get("symmetric", True) else " asymmetric"))


def _compressed_tensors_group(name: str, group: dict[str, Any], top_format: str) -> QuantMethod:
    weights, acts = group.get("weights") or {}, group.get("input_activations")
    scheme = f"config group {name!r}: weights {_describe_args(weights)}, input activations {_describe_args(acts)}"
    fmt = str(group.get("format") or top_format)
    if fmt != "int-quantized":
        raise UnsupportedQuantizationError(
            f"compressed-tensors format {fmt!r} ({scheme}) is not supported; npuserve serves int-quantized W8A8")
    targets = list(group.get("targets") or [])
    int8_weights = (weights.get("type", "int") == "int" and weights.get("num_bits") == 8
                    and weights.get("strategy") == "channel" and weights.get("symmetric", True)
                    and not weights.get("dynamic"))
    int8_acts = (acts is not None and acts.get("type", "int") == "int" and acts.get("num_bits") == 8
                 and acts.get("symmetric", True)
                 and ((acts.get("strategy") == "tensor" and not acts.get("dynamic"))
                      or (acts.get("strategy") == "token" and acts.get("dynamic"))))
    if not (int8_weights and int8_acts) or targets not in (["Linear"], ["re:.*Linear"]):
        raise UnsupportedQuantizationError(
            f"compressed-tensors {scheme}, targets {targets} is not supported; npuserve serves int8 W8A8 (weights "
            "int8 per channel, symmetric; activations int8 per tensor static or per token dynamic) on Linear")
    assert acts is not None
    return "w8a8_dynamic" if acts.get("dynamic") else "w8a8"
