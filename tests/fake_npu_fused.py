"""A FAKE of torch_npu's fused kernels, for tests: plain torch on the CPU, no NPU kernel.

The prototypes, formulas and limits of Ascend's torch_npu API reference (op-plugin docs/context, `npu_rms_norm`,
`npu_swiglu`, `npu_rotary_mul`; their schemas in `op_plugin/config/op_plugin_functions.yaml` are the same from 7.0.0
to 26.1.0, 26.0.0 adding `npu_rotary_mul`'s `rotate=None`), positional or by keyword as documented, returning their
results:

- `npu_rms_norm(self, gamma, epsilon=1e-06) -> (y, rstd)`: `y = x / sqrt(mean(x^2) + eps) * gamma` over gamma's
  trailing dimensions, rstd the float32 reciprocal; x of 2-8 dimensions; gamma in x's dtype.
- `npu_swiglu(input, dim=-1)`: `silu(A) * B`, A and B the first and second halves along `dim`; contiguous input.
- `npu_rotary_mul(input, r1, r2, rotary_mode="half")`: `r1 * x + r2 * cat(-x2, x1)` (x1, x2 the halves of the last
  dimension); 4-dimensional, r1/r2 in one of the documented broadcast layouts (1S1D for BSND, ...), values in
  [-1, 1], D even and below 896. The fake takes r1 and r2 in the input's dtype only, and "half" mode only.
"""

from __future__ import annotations

import torch

from tests.fake_npu_attention import integer as _int
from tests.fake_npu_attention import require as _require

# --- the fused kernels -----------------------------------------------------------------------------------------

FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ROTARY_MAX_HEAD_DIM = 896  # "D < 896, and a multiple of 2" (npu_rotary_mul, half mode, A2/A3)
ROTARY_MAX_BROADCAST = 1000  # "B, N < 1000"
# npu_rotary_mul's r1/r2 layouts, per input layout (BSND: 1S1D, BS1D, BSND; BNSD: 11SD, B1SD, BNSD; SBND: S11D,
# SB1D, SBND), as which of the three leading dimensions r1 spans (True) or broadcasts (False).
ROTARY_LAYOUTS = frozenset({(False, True, False), (True, True, False), (True, True, True), (False, False, True),
                            (True, False, True), (True, False, False)})


def _shaped(name: str, t: object, *, dims: range, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    """A tensor of `dims` dimensions and one of `dtypes` (contiguity not demanded: the references do not)."""
    _require(isinstance(t, torch.Tensor), f"{name}: expected a tensor, got {type(t).__name__}")
    assert isinstance(t, torch.Tensor)
    _require(t.dim() in dims, f"{name}: {t.dim()} dimensions (takes {dims.start}-{dims.stop - 1})")
    _require(t.dtype in dtypes, f"{name}: dtype {t.dtype} not supported (takes {', '.join(map(str, dtypes))})")
    _require(t.numel() > 0, f"{name}: empty")
    return t


def npu_rms_norm(self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-06) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over gamma's trailing dimensions of `self` (ATen's name for the input): `(y, rstd)`, y in the input's
    dtype, rstd = 1 / sqrt(mean(x^2) + epsilon) in float32, shaped as the input with those dimensions 1."""
    x = _shaped("self", self, dims=range(2, 9), dtypes=FUSED_DTYPES)
    g = _shaped("gamma", gamma, dims=range(1, x.dim() + 1), dtypes=(x.dtype,))
    _require(tuple(x.shape[x.dim() - g.dim():]) == tuple(g.shape),
             f"gamma {tuple(g.shape)} is not the trailing dimensions of self {tuple(x.shape)}")
    _require(isinstance(epsilon, float), f"epsilon: expected a float, got {epsilon!r}")
    reduced = tuple(range(x.dim() - g.dim(), x.dim()))
    rstd = torch.rsqrt(x.float().pow(2).mean(dim=reduced, keepdim=True) + epsilon)
    return (x.float() * rstd * g.float()).to(x.dtype), rstd


def npu_swiglu(input: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """`silu(A) * B`, A and B the first and second halves of `input` along `dim`, in the input's dtype."""
    x = _shaped("input", input, dims=range(1, 9), dtypes=FUSED_DTYPES)
    _require(x.is_contiguous(), f"input: must be contiguous (shape {tuple(x.shape)}, strides {x.stride()})")
    axis = _int("dim", dim)
    _require(-x.dim() <= axis < x.dim(), f"dim {axis} outside [{-x.dim()}, {x.dim() - 1}]")
    _require(x.shape[axis] % 2 == 0, f"input: dimension {axis} of size {x.shape[axis]} does not halve")
    a, b = x.float().chunk(2, dim=axis)
    return (torch.nn.functional.silu(a) * b).to(x.dtype)


def npu_rotary_mul(input: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half") -> torch.Tensor:
    """Rotary embedding, "half" mode: `r1 * x + r2 * cat(-x2, x1)`, x1 and x2 the halves of the last dimension; r1
    (cos) and r2 (sin) broadcast over the input in one of the documented layouts."""
    _require(rotary_mode in ("half", "interleave"), f"rotary_mode {rotary_mode!r}: takes 'half' or 'interleave'")
    _require(rotary_mode == "half", "rotary_mode 'interleave': the fake implements 'half' only")
    x = _shaped("input", input, dims=range(4, 5), dtypes=FUSED_DTYPES)
    cos = _shaped("r1", r1, dims=range(4, 5), dtypes=(x.dtype,))
    sin = _shaped("r2", r2, dims=range(4, 5), dtypes=(x.dtype,))
    dim = x.shape[-1]
    _require(dim % 2 == 0 and dim < ROTARY_MAX_HEAD_DIM, f"input: D = {dim} (takes an even D below 896)")
    _require(cos.shape == sin.shape, f"r1 {tuple(cos.shape)} and r2 {tuple(sin.shape)} differ")
    _require(cos.shape[-1] == dim, f"r1 {tuple(cos.shape)}: last dimension is not the input's D = {dim}")
    leading = range(3)
    _require(all(cos.shape[i] in (1, x.shape[i]) for i in leading),
             f"r1 {tuple(cos.shape)} does not broadcast over input {tuple(x.shape)}")
    spans = [cos.shape[i] == x.shape[i] for i in leading]
    ones = [cos.shape[i] == 1 for i in leading]
    _require(any(all(spans[i] if full else ones[i] for i, full in enumerate(layout)) for layout in ROTARY_LAYOUTS),
             f"r1 {tuple(cos.shape)} for input {tuple(x.shape)}: not one of the documented layouts")
    _require(all(x.shape[i] < ROTARY_MAX_BROADCAST for i in leading if cos.shape[i] == 1 < x.shape[i]),
             f"input {tuple(x.shape)}: B and N must be below {ROTARY_MAX_BROADCAST}")
    _require(bool((cos.abs() <= 1).all() and (sin.abs() <= 1).all()), "r1, r2: values outside [-1, 1]")
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (cos.float() * xf + sin.float() * torch.cat((-x2, x1), dim=-1)).to(x.dtype)
