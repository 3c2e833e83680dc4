"""A FAKE of torch_npu's int8 (W8A8) operations, for tests: plain torch on the CPU, no NPU kernel.

Each op computes its documented formula (integer products exact, in int64; the dequantisation in float32, rounded
once to the output dtype) and refuses what its documented contract refuses on Atlas A2/A3 (the 910B/910C cards).
Sources: Ascend/op-plugin `docs/context/torch_npu-npu_quant_matmul.md`, `torch_npu-npu_quantize.md`,
`torch_npu-npu_dynamic_quant.md`, `torch_npu-npu_trans_quant_param.md`, `torch_npu-npu_grouped_matmul.md` (the
parameter pages and their dtype-combination tables), and `op_plugin/config/op_plugin_functions.yaml` per release
branch for each schema (the line that first has an argument):

- `npu_quantize(input, scales, zero_points, dtype, axis=1, div_mode=True)` (every line): div_mode False:
  `round(input * scales + zero_points)` saturated to int8; scales 1D of input's last size (or 1), float32, float16 or
  bfloat16; zero_points the shape and dtype of scales. The fake implements div_mode False, dtype qint8, axis -1.
- `npu_dynamic_quant(input, *, smooth_scales, group_index, dst_type)` (6.0.rc3; 26.0.0 adds quant_mode and
  dst_type_max): per row `scale = max|x| / 127`, `y = round(x / scale)`; input float16 or bfloat16 (not float32),
  more than one dimension; scale float32 of input's shape less its last axis. A zero row gives scale 0 and y 0 (the
  formula's 0/0 is not documented). The fake implements no smooth_scales, group_index, int4.
- `npu_trans_quant_param(scale, offset=None)` (every line; `round_mode` from 7.1.0): float32 scale -> int64 holding
  its bits; round_mode 0 keeps the high 19 bits (sign, exponent, 10 mantissa bits). The fake implements no offset
  and round_mode 0.
- `npu_quant_matmul(x1, x2, scale, *, offset, pertoken_scale, bias, output_dtype)` (6.0.rc2; `group_sizes` 7.1.0;
  `x1_dtype`, `x2_dtype`, `pertoken_scale_dtype`, `scale_dtype`, `y_scale` 26.0.0): `(x1 @ x2 + bias_int32) *
  scale [* pertoken_scale]`, a float bias added after the scales; x1 (.., M, K) and x2 (K, N) int8, K and N at most
  65535; scale (1,) or (N,); pertoken_scale (M,) float32; bias (N,). The A2/A3 table of combinations:
  float16 out without pertoken_scale: scale int64 or float32, bias int32 or none; bfloat16 out: scale float32 or
  bfloat16, bias int32, bfloat16, float32 or none, pertoken_scale float32 or none; float16 out with pertoken_scale:
  scale float32, bias int32, bfloat16, float32 or none; offset only with an int8 output. The fake implements int8
  inputs, a 2D x2, float16 and bfloat16 outputs.
- `npu_grouped_matmul` with int8 x (Tensor group_list, 7.0.0): per group `(x_g @ weight_g) * scale_g *
  per_token_scale[rows]`; the table's rows the fake implements: scale bfloat16 -> bfloat16 out, scale float32 ->
  float16 out (per_token_scale float32 or none); offset none; one x, one (E, K, N) weight, scale (E, N) as
  vllm-ascend passes it (`vllm_ascend/quantization/w8a8_dynamic.py` apply_mlp). A float x goes to the float fake
  (tests/fake_npu_moe.py).

What it cannot check: the kernels' numerics (their accumulation and rounding order), the NZ layout, graph mode's
extra limits (e.g. a float32 scale with a float16 output), speed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tests import fake_npu_moe as moe
from tests.fake_npu_attention import integer, require

INT8_MAX = 127
INNER_LIMIT = 65535  # npu_quant_matmul: the last dimension of x1 and x2 at most 65535
HALF = (torch.float16, torch.bfloat16)
QUANTIZE_SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _tensor(name: str, t: object, dtypes: tuple[torch.dtype, ...], ndims: tuple[int, ...]) -> torch.Tensor:
    require(isinstance(t, torch.Tensor), f"{name}: expected a tensor, got {type(t).__name__}")
    assert isinstance(t, torch.Tensor)
    require(t.dim() in ndims, f"{name}: {t.dim()} dimensions, shape {tuple(t.shape)} (takes {ndims})")
    require(t.dtype in dtypes, f"{name}: dtype {t.dtype} not supported (takes {', '.join(map(str, dtypes))})")
    return t


def _saturate(values: torch.Tensor) -> torch.Tensor:
    """Round half to even, saturate to int8."""
    return torch.round(values).clamp(-128, INT8_MAX).to(torch.int8)


# --- activation quantization --------------------------------------------------------------------------------------


def npu_quantize(input: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None, dtype: Any,
                 axis: int = 1, div_mode: bool = True) -> torch.Tensor:
    """div_mode False: `round(input * scales + zero_points)` as int8 (module docstring)."""
    x = _tensor("input", input, (torch.float32, *HALF), tuple(range(1, 9)))
    require(div_mode is False, "div_mode: the fake implements False (multiply by scales) only")
    require(dtype is torch.qint8, f"dtype {dtype}: the fake implements torch.qint8 only")
    require(integer("axis", axis) == -1, "axis: the fake implements -1 (the last axis) only")
    s = _tensor("scales", scales, QUANTIZE_SCALE_DTYPES, (1,))
    require(s.shape[0] in (1, x.shape[-1]), f"scales: {s.shape[0]} values for a last axis of {x.shape[-1]}")
    result = x.float() * s.float()
    if zero_points is not None:
        z = _tensor("zero_points", zero_points, QUANTIZE_SCALE_DTYPES, (1,))
        require(z.shape == s.shape and z.dtype == s.dtype,
                f"zero_points: shape {tuple(z.shape)} {z.dtype}, must be scales' ({tuple(s.shape)} {s.dtype})")
        result = result + z.float()
    return _saturate(result)


def _dynamic_quant(input: torch.Tensor, smooth_scales: Any, group_index: Any,
                   dst_type: Any) -> tuple[torch.Tensor, torch.Tensor]:
    x = _tensor("input", input, HALF, tuple(range(2, 9)))
    require(smooth_scales is None and group_index is None,
            "smooth_scales, group_index: the fake implements neither")
    require(dst_type in (None, torch.int8), f"dst_type {dst_type}: the fake implements int8 only")
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / INT8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return _saturate(xf / safe.unsqueeze(-1)), scale


def npu_dynamic_quant(input: torch.Tensor, *, smooth_scales: Any = None, group_index: Any = None,
                      dst_type: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """7.0.0-7.3.0: per-token symmetric int8 (module docstring): (y int8, scale float32)."""
    return _dynamic_quant(input, smooth_scales, group_index, dst_type)


def npu_dynamic_quant_26(input: torch.Tensor, *, smooth_scales: Any = None, group_index: Any = None,
                         dst_type: Any = None, quant_mode: str = "pertoken",
                         dst_type_max: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """26.0.0 on: adds quant_mode and dst_type_max."""
    require(quant_mode == "pertoken" and dst_type_max == 0.0, "quant_mode: the fake implements 'pertoken' only")
    return _dynamic_quant(input, smooth_scales, group_index, dst_type)


# --- the scale's int64 form ------------------------------------------------------------------------------------------

HIGH_19_BITS = 0xFFFFE000  # round_mode 0: the float32's sign, exponent and 10 mantissa bits


def _trans_quant_param(scale: torch.Tensor, offset: Any, round_mode: int) -> torch.Tensor:
    s = _tensor("scale", scale, (torch.float32,), (1, 2))
    require(offset is None, "offset: the fake implements None only")
    require(round_mode == 0, "round_mode: the fake implements 0 (truncation) only")
    bits = s.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return bits & HIGH_19_BITS


def npu_trans_quant_param_70(scale: torch.Tensor, offset: torch.Tensor | None = None) -> torch.Tensor:
    """7.0.0: no round_mode."""
    return _trans_quant_param(scale, offset, 0)


def npu_trans_quant_param(scale: torch.Tensor, offset: torch.Tensor | None = None, round_mode: int = 0) -> torch.Tensor:
    """7.1.0 on: round_mode (0 truncation, 1 R_INT)."""
    return _trans_quant_param(scale, offset, integer("round_mode", round_mode))


def int64_scale_value(scale: torch.Tensor) -> torch.Tensor:
    """The float32 an int64 scale of `npu_trans_quant_param` holds in its low 32 bits."""
    low = scale & 0xFFFFFFFF
    low = torch.where(low >= 2**31, low - 2**32, low)
    return low.to(torch.int32).view(torch.float32)


# --- the quantized matmul ----------------------------------------------------------------------------------------


def _allowed(out: torch.dtype, per_token: bool) -> tuple[tuple[torch.dtype, ...], tuple[torch.dtype, ...]]:
    """(scale dtypes, bias dtypes) of the A2/A3 table row for this output and pertoken_scale."""
    if out == torch.bfloat16:
        return (torch.float32, torch.bfloat16), (torch.int32, torch.bfloat16, torch.float32)
    if per_token:
        return (torch.float32,), (torch.int32, torch.bfloat16, torch.float32)
    return (torch.int64, torch.float32), (torch.int32,)


def _quant_matmul(x1: torch.Tensor, x2: torch.Tensor, scale: torch.Tensor, offset: Any, pertoken_scale: Any,
                  bias: Any, output_dtype: Any) -> torch.Tensor:
    a = _tensor("x1", x1, (torch.int8,), (2, 3, 4, 5, 6))
    w = _tensor("x2", x2, (torch.int8,), (2,))
    k, n = w.shape
    require(a.shape[-1] == k, f"x1 is (.., {a.shape[-1]}) but x2 is (K={k}, N={n}): x2 is the (K, N) right "
                              "matrix, so an (N, K) weight must be transposed")
    require(k <= INNER_LIMIT and n <= INNER_LIMIT, f"x1, x2: last dimensions {k}, {n} above {INNER_LIMIT}")
    require(output_dtype in HALF, f"output_dtype {output_dtype}: the fake implements float16 and bfloat16 "
                                  "(None means int8)")
    require(offset is None, "offset: only with an int8 output")
    rows = a.reshape(-1, k)
    per_token = pertoken_scale is not None
    scale_dtypes, bias_dtypes = _allowed(output_dtype, per_token)
    s = _tensor("scale", scale, scale_dtypes, (1,))
    require(s.shape[0] in (1, n), f"scale: {s.shape[0]} values, takes 1 or n={n}")
    acc = rows.to(torch.int64) @ w.to(torch.int64)
    float_bias = None
    if bias is not None:
        b = _tensor("bias", bias, bias_dtypes, (1,))
        require(b.shape[0] == n, f"bias: {b.shape[0]} values for n={n}")
        if b.dtype == torch.int32:
            acc = acc + b.to(torch.int64)
        else:
            float_bias = b.float()
    require(bool((acc.abs() < 2**31).all()), "the int32 accumulator overflows")
    y = acc.float() * (int64_scale_value(s) if s.dtype == torch.int64 else s.float())
    if per_token:
        p = _tensor("pertoken_scale", pertoken_scale, (torch.float32,), (1,))
        require(p.shape[0] == rows.shape[0], f"pertoken_scale: {p.shape[0]} values for m={rows.shape[0]}")
        y = y * p.unsqueeze(-1)
    if float_bias is not None:
        y = y + float_bias
    return y.to(output_dtype).reshape(*a.shape[:-1], n)


def npu_quant_matmul_70(x1: torch.Tensor, x2: torch.Tensor, scale: torch.Tensor, *, offset: Any = None,
                        pertoken_scale: Any = None, bias: Any = None, output_dtype: Any = None) -> torch.Tensor:
    """7.0.0: no group_sizes."""
    return _quant_matmul(x1, x2, scale, offset, pertoken_scale, bias, output_dtype)


def npu_quant_matmul_71(x1: torch.Tensor, x2: torch.Tensor, scale: torch.Tensor, *, offset: Any = None,
                        pertoken_scale: Any = None, bias: Any = None, output_dtype: Any = None,
                        group_sizes: Any = None) -> torch.Tensor:
    """7.1.0-7.3.0: adds group_sizes (int4 group quantization; the fake implements None)."""
    require(group_sizes is None, "group_sizes: the fake implements None only")
    return _quant_matmul(x1, x2, scale, offset, pertoken_scale, bias, output_dtype)


def npu_quant_matmul_26(x1: torch.Tensor, x2: torch.Tensor, scale: torch.Tensor, *, offset: Any = None,
                        pertoken_scale: Any = None, bias: Any = None, output_dtype: Any = None, x1_dtype: Any = None,
                        x2_dtype: Any = None, pertoken_scale_dtype: Any = None, scale_dtype: Any = None,
                        group_sizes: Any = None, y_scale: Any = None) -> torch.Tensor:
    """26.0.0 on: adds x1_dtype, x2_dtype, pertoken_scale_dtype, scale_dtype, y_scale (the fake implements None)."""
    require(all(a is None for a in (x1_dtype, x2_dtype, pertoken_scale_dtype, scale_dtype, group_sizes, y_scale)),
            "x1_dtype, x2_dtype, pertoken_scale_dtype, scale_dtype, group_sizes, y_scale: the fake implements None")
    return _quant_matmul(x1, x2, scale, offset, pertoken_scale, bias, output_dtype)


# --- the grouped matmul's int8 form ---------------------------------------------------------------------------------


def _grouped_int8(x: list[torch.Tensor], weight: list[torch.Tensor], scale: Any, per_token_scale: Any,
                  group_list: Any, split_item: int, group_type: Any, group_list_type: int,
                  output_dtype: Any) -> list[torch.Tensor]:
    require(len(x) == 1 and len(weight) == 1, "x, weight: the fake implements one x and one (E, K, N) weight")
    a = _tensor("x[0]", x[0], (torch.int8,), (2,))
    w = _tensor("weight[0]", weight[0], (torch.int8,), (3,))
    require(group_type == 0, "group_type: the fake implements 0 (groups along x's rows)")
    require(split_item in (2, 3), "split_item: with one x split into groups, 2 or 3 (one concatenated output)")
    experts, k, n = w.shape
    require(a.shape[1] == k, f"x[0] is (M, {a.shape[1]}) but each expert's weight is [K={k}, N={n}] (x @ W): "
                             "a weight laid out (E, N, K) must be transposed")
    require(output_dtype in HALF, f"output_dtype {output_dtype}: with int8 x the fake implements float16 and "
                                  "bfloat16 (the table's int8 and int32 rows are not implemented)")
    require(isinstance(scale, list | tuple) and len(scale) == 1, "scale: a list of one (E, N) tensor")
    wanted = torch.bfloat16 if output_dtype == torch.bfloat16 else torch.float32  # the table's rows
    s = _tensor("scale[0]", scale[0], (wanted,), (2,))
    require(tuple(s.shape) == (experts, n), f"scale[0]: shape {tuple(s.shape)}, expected (E={experts}, N={n})")
    groups = moe._index_tensor("group_list", group_list, 1, torch.int64)
    require(groups.shape[0] == experts, f"group_list: {groups.shape[0]} entries for {experts} weights")
    kind = integer("group_list_type", group_list_type)
    require(kind in (0, 1), f"group_list_type {kind}: the fake implements 0 cumsum and 1 counts")
    counts = groups if kind == 1 else torch.diff(groups, prepend=groups.new_zeros(1))
    require(bool((counts >= 0).all()), f"group_list: {'counts' if kind else 'cumsum'} must not decrease")
    require(int(counts.sum()) <= a.shape[0], f"group_list: {int(counts.sum())} rows, x has {a.shape[0]}")
    token_scale = torch.ones(a.shape[0])
    if per_token_scale is not None:
        require(isinstance(per_token_scale, list | tuple) and len(per_token_scale) == 1,
                "per_token_scale: a list of one tensor")
        p = _tensor("per_token_scale[0]", per_token_scale[0], (torch.float32,), (1,))
        require(p.shape[0] == a.shape[0], f"per_token_scale[0]: {p.shape[0]} values for m={a.shape[0]}")
        token_scale = p.float()
    out = torch.zeros(a.shape[0], n, dtype=torch.float32)
    start = 0
    for g, c in enumerate(counts.tolist()):
        acc = a[start:start + c].to(torch.int64) @ w[g].to(torch.int64)
        out[start:start + c] = acc.float() * s[g].float() * token_scale[start:start + c].unsqueeze(-1)
        start += c
    return [out.to(output_dtype)]


def npu_grouped_matmul(x: list[torch.Tensor], weight: list[torch.Tensor], *, bias: Any = None, scale: Any = None,
                       offset: Any = None, antiquant_scale: Any = None, antiquant_offset: Any = None,
                       per_token_scale: Any = None, group_list: torch.Tensor | None = None,
                       activation_input: Any = None, activation_quant_scale: Any = None,
                       activation_quant_offset: Any = None, split_item: int = 0, group_type: int | None = None,
                       group_list_type: int = 0, act_type: int = 0, tuning_config: Any = None,
                       output_dtype: Any = None) -> list[torch.Tensor]:
    """int8 x: the quantized form (module docstring); a float x: tests/fake_npu_moe.py's grouped matmul."""
    require(isinstance(x, list | tuple) and isinstance(weight, list | tuple), "x, weight: lists of tensors")
    if not (x and isinstance(x[0], torch.Tensor) and x[0].dtype == torch.int8):
        require(weight and isinstance(weight[0], torch.Tensor) and weight[0].dtype != torch.int8,
                "weight[0]: int8 with a float x is the antiquant (weight-only) form, which the fake does not "
                "implement")
        return moe.npu_grouped_matmul(
            x, weight, bias=bias, scale=scale, offset=offset, antiquant_scale=antiquant_scale,
            antiquant_offset=antiquant_offset, per_token_scale=per_token_scale, group_list=group_list,
            activation_input=activation_input, activation_quant_scale=activation_quant_scale,
            activation_quant_offset=activation_quant_offset, split_item=split_item, group_type=group_type,
            group_list_type=group_list_type, act_type=act_type, tuning_config=tuning_config,
            output_dtype=output_dtype)
    require(offset is None, "offset: only None is supported")
    require(all(v is None for v in (bias, antiquant_scale, antiquant_offset, activation_input,
                                    activation_quant_scale, activation_quant_offset)),
            "bias, antiquant, activation inputs: the fake's int8 form implements none")
    require(integer("act_type", act_type) == 0, "act_type: the fake implements 0 (none)")
    require(isinstance(group_list, torch.Tensor), "group_list: a Tensor (int64) on this line")
    return _grouped_int8(list(x), list(weight), scale, per_token_scale, group_list, integer("split_item", split_item),
                         group_type, group_list_type, output_dtype)


def quant_ops(line: str) -> dict[str, Callable[..., Any]]:
    """The int8 ops of op-plugin release `line` under that line's schemas (module docstring)."""
    newest = line.startswith("26.")
    return {
        "npu_quantize": npu_quantize,
        "npu_dynamic_quant": npu_dynamic_quant_26 if newest else npu_dynamic_quant,
        "npu_trans_quant_param": npu_trans_quant_param_70 if line == "7.0.0" else npu_trans_quant_param,
        "npu_quant_matmul": (npu_quant_matmul_26 if newest else npu_quant_matmul_70 if line == "7.0.0"
                             else npu_quant_matmul_71),
        "npu_grouped_matmul": npu_grouped_matmul,
    }
