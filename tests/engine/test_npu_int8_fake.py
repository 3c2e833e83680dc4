"""The npu backend's int8 (W8A8) layers (engine/backends/npu_int8.py) on the FAKE torch_npu (tests/fake_npu_quant.py):
the NPU path equals the CPU reference (engine/backends/int8_reference.py) on the same modules, static and dynamic,
bf16 and fp16, linear layers and routed experts; and the fake is strict (it refuses what the real ops refuse).

The bounds: both sides quantize the same activations to the same int8 values and multiply exactly in integers; they
differ only in float rounding. The reference dequantizes in float32 and rounds once to the output dtype; the NPU
path (a) rounds the static fp16 deq_scale to the 10 mantissa bits `npu_trans_quant_param` keeps (relative 2^-10),
(b) multiplies by 1/input_scale where the reference divides by input_scale (an x exactly between two int8 steps may
round the other way), (c) adds a float bias after rounding the product to the output dtype (static), and in the
experts (d) rounds the first matmul's output and the SwiGLU to the output dtype before requantizing, and uses
bfloat16 weight scales for a bf16 output (the grouped matmul's table). So each comparison allows a few units in
the last place of the output dtype relative to the output's largest value (`_close`). Measured on these seeds (the
largest over lines, methods and biases): linear 6.0e-3 (bf16, a float bias rounded twice) and 7.6e-4 (fp16);
experts 9.3e-3 (bf16) and 2.2e-3 (fp16); each bound is about 2.5 times that or more.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from npuserve.engine.backends import int8_reference
from npuserve.engine.backends.base import BackendUnavailableError
from npuserve.engine.backends.cpu import CPUBackend
from npuserve.engine.backends.npu import NPUBackend
from npuserve.engine.backends.npu_stack import INT8_LINEAR_OPS, KEYWORDS
from npuserve.engine.model.int8 import Int8Experts, Int8Linear
from tests.fake_npu_attention import FakeNPUError
from tests.fake_npu_quant import int64_scale_value
from tests.fake_torch_npu import FakeTorchNPU, install_fake_torch_npu

DTYPES = [torch.bfloat16, torch.float16]
LINES = ["7.0.0", "7.3.0", "26.0.0"]
# Largest |npu - reference| over the output's largest |value|: bf16 has 8 significant bits, fp16 11.
LINEAR_BOUND = {torch.bfloat16: 2**-6, torch.float16: 2**-9}
EXPERTS_BOUND = {torch.bfloat16: 2**-5, torch.float16: 2**-7}


def _backend(monkeypatch: pytest.MonkeyPatch, release: str) -> tuple[FakeTorchNPU, NPUBackend]:
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    fake = install_fake_torch_npu(monkeypatch, release=release)
    return fake, NPUBackend(device=fake.device)


def _int8(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)


def _linear(k: int, n: int, method: str, bias: bool, dtype: torch.dtype, seed: int) -> Int8Linear:
    """An Int8Linear with random int8 weights and scales as a calibration would give (msModelSlim's quant_bias:
    -offset * the row sums, plus a rounded float part)."""
    gen = torch.Generator().manual_seed(seed)
    layer = Int8Linear(k, n, bias=bias, method=method)  # type: ignore[arg-type]
    with torch.no_grad():
        layer.weight.copy_(_int8((n, k), gen))
        layer.weight_scale.copy_(0.002 + 0.004 * torch.rand(n, generator=gen))
        if method == "w8a8":
            assert layer.input_scale is not None and layer.input_offset is not None and layer.quant_bias is not None
            layer.input_scale.fill_(0.02)
            layer.input_offset.fill_(3.0)
            rounded = torch.randint(-50, 50, (n,), generator=gen, dtype=torch.int32)
            layer.quant_bias.copy_(-3 * layer.weight.to(torch.int32).sum(dim=1) + rounded)
    if bias:
        layer.bias = nn.Parameter(torch.randn(n, generator=gen).to(dtype), requires_grad=False)
    return layer


def _experts(num: int, hidden: int, inter: int, seed: int) -> Int8Experts:
    gen = torch.Generator().manual_seed(seed)
    experts = Int8Experts(num, hidden, inter)
    with torch.no_grad():
        experts.w13.copy_(_int8((num, 2 * inter, hidden), gen))
        experts.w2.copy_(_int8((num, hidden, inter), gen))
        experts.w13_scale.copy_(0.001 + 0.002 * torch.rand(num, 2 * inter, generator=gen))
        experts.w2_scale.copy_(0.001 + 0.002 * torch.rand(num, hidden, generator=gen))
    return experts


def _close(actual: torch.Tensor, expected: torch.Tensor, bound: float) -> float:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert torch.isfinite(actual.float()).all()
    worst = float((actual.float() - expected.float()).abs().max() / expected.float().abs().max())
    assert worst <= bound, f"|npu - reference| reaches {worst:.2e} of the largest output (bound {bound:.2e})"
    return worst


# --- linear layers ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("release", LINES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("method", ["w8a8", "w8a8_dynamic"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_int8_linear_equals_the_reference(monkeypatch: pytest.MonkeyPatch, release: str, dtype: torch.dtype,
                                          method: str, bias: bool) -> None:
    fake, npu = _backend(monkeypatch, release)
    layer = _linear(37, 23, method, bias, dtype, seed=3)  # odd K and N
    npu.prepare_model(nn.ModuleDict({"proj": layer}))
    assert layer.weight.shape == (23, 37) and layer.weight.t().is_contiguous()  # (K, N) memory, shape unchanged
    x = (2.0 * torch.randn(2, 5, 37, generator=torch.Generator().manual_seed(4))).to(dtype)  # (.., K) input
    expected = int8_reference.int8_linear(x, layer)
    actual = npu.int8_linear(x, layer)
    _close(actual, expected, LINEAR_BOUND[dtype])
    assert fake.calls["npu_quant_matmul"] == 1
    if method == "w8a8":
        assert fake.calls["npu_quantize"] == 1 and fake.calls["npu_dynamic_quant"] == 0
        assert fake.calls["npu_trans_quant_param"] == (1 if dtype == torch.float16 else 0)
    else:
        assert fake.calls["npu_dynamic_quant"] == 1 and fake.calls["npu_quantize"] == 0


def test_static_fp16_passes_the_int64_deq_scale_and_bf16_the_float32_one(monkeypatch: pytest.MonkeyPatch) -> None:
    fake, npu = _backend(monkeypatch, "7.3.0")
    fake.record.add("npu_quant_matmul")
    layer = _linear(16, 8, "w8a8", bias=False, dtype=torch.float16, seed=1)
    npu.prepare_model(nn.ModuleDict({"proj": layer}))
    for dtype in (torch.float16, torch.bfloat16):
        npu.int8_linear(torch.randn(3, 16).to(dtype), layer)
    calls = fake.args["npu_quant_matmul"]
    assert [set(c) for c in calls] == [{"bias", "output_dtype"}] * 2
    assert [c["output_dtype"] for c in calls] == [torch.float16, torch.bfloat16]
    assert calls[0]["bias"] is layer.quant_bias and calls[0]["bias"].dtype == torch.int32


def test_the_static_path_is_the_written_out_example(monkeypatch: pytest.MonkeyPatch) -> None:
    # K=2, N=2; input_scale 0.5, offset 1: x = [1.0, -0.74] -> round([2, -1.48]) + 1 = [3, 0]; quant_bias = -1 * row
    # sums = [-3, -1]; acc = [3*1 + 0*2 - 3, 3*(-1) + 0*0 - 1] = [0, -4]; y = acc * 0.5 * [0.25, 0.125] = [0, -0.25]
    _, npu = _backend(monkeypatch, "7.3.0")
    layer = Int8Linear(2, 2, bias=False, method="w8a8")
    assert layer.input_scale is not None and layer.input_offset is not None and layer.quant_bias is not None
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1, 2], [-1, 0]], dtype=torch.int8))
        layer.weight_scale.copy_(torch.tensor([0.25, 0.125]))
        layer.input_scale.fill_(0.5)
        layer.input_offset.fill_(1.0)
        layer.quant_bias.copy_(torch.tensor([-3, -1], dtype=torch.int32))
    npu.prepare_model(nn.ModuleDict({"proj": layer}))
    out = npu.int8_linear(torch.tensor([[1.0, -0.74]], dtype=torch.bfloat16), layer)
    assert out.tolist() == [[0.0, -0.25]]


# --- routed experts -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("release", LINES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_int8_experts_equal_the_reference(monkeypatch: pytest.MonkeyPatch, release: str, dtype: torch.dtype) -> None:
    fake, npu = _backend(monkeypatch, release)
    experts = _experts(num=6, hidden=40, inter=24, seed=7)
    npu.prepare_model(nn.ModuleDict({"experts": experts}))
    assert experts.w13.transpose(1, 2).is_contiguous() and experts.w2.transpose(1, 2).is_contiguous()
    gen = torch.Generator().manual_seed(8)
    tokens, top = 9, 2
    x = torch.randn(tokens, 40, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(6, generator=gen)[:top] for _ in range(tokens)]).to(torch.int32)
    weights = torch.softmax(torch.randn(tokens, top, generator=gen), dim=-1)
    expected = CPUBackend().moe_experts_int8(x, weights, ids, experts)
    actual = npu.moe_experts_int8(x, weights, ids, experts)
    _close(actual, expected, EXPERTS_BOUND[dtype])
    assert fake.calls["npu_grouped_matmul"] == 2 and fake.calls["npu_dynamic_quant"] == 2
    assert fake.calls["npu_moe_init_routing_v2"] == 1


# --- refusals -----------------------------------------------------------------------------------------------------


def test_a_stack_without_the_int8_ops_is_refused_naming_them(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = install_fake_torch_npu(monkeypatch, release="7.3.0")
    monkeypatch.delattr(fake.module, "npu_quant_matmul")
    npu = NPUBackend(device=fake.device)
    with pytest.raises(BackendUnavailableError, match="npu_quant_matmul"):
        npu.prepare_model(nn.ModuleDict({"proj": _linear(8, 4, "w8a8_dynamic", False, torch.bfloat16, 0)}))


def test_the_fake_quant_matmul_is_the_documented_formula(fake: FakeTorchNPU) -> None:
    # (x1 @ x2 + bias) * scale: [[1, 2], [3, 4]] @ [[1, 0, 2], [0, 1, -1]] = [[1, 2, 0], [3, 4, 2]]; + [1, 0, 0];
    # * [0.5, 1, 2]
    x1 = torch.tensor([[1, 2], [3, 4]], dtype=torch.int8)
    x2 = torch.tensor([[1, 0, 2], [0, 1, -1]], dtype=torch.int8)
    out = fake.module.npu_quant_matmul(x1, x2, torch.tensor([0.5, 1.0, 2.0]),
                                       bias=torch.tensor([1, 0, 0], dtype=torch.int32), output_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.tolist() == [[1.0, 2.0, 0.0], [2.0, 4.0, 4.0]]
    # per token: row t times pertoken_scale[t]
    out = fake.module.npu_quant_matmul(x1, x2, torch.tensor([1.0]), pertoken_scale=torch.tensor([1.0, 0.5]),
                                       output_dtype=torch.float16)
    assert out.tolist() == [[1.0, 2.0, 0.0], [1.5, 2.0, 1.0]]


def test_trans_quant_param_keeps_the_high_19_bits_of_the_float32(fake: FakeTorchNPU) -> None:
    # 1.0 is 0x3F800000 (no low bits); 0.1 is 0x3DCCCCCD, whose low 13 bits 0x0CCD are cut: 0x3DCCC000
    packed = fake.module.npu_trans_quant_param(torch.tensor([1.0, 0.1]))
    assert packed.dtype == torch.int64 and packed.tolist() == [0x3F800000, 0x3DCCC000]
    assert int64_scale_value(packed)[1].item() == pytest.approx(0.1, rel=2**-10)


def test_dynamic_quant_scales_each_row_by_its_largest_value(fake: FakeTorchNPU) -> None:
    y, scale = fake.module.npu_dynamic_quant(torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0]], dtype=torch.float16))
    assert y.dtype == torch.int8 and y.tolist() == [[64, -127, 32], [0, 0, 0]]  # 0.5 * 127 = 63.5 -> 64 (half even)
    assert scale.dtype == torch.float32 and scale.tolist() == pytest.approx([1 / 127, 0.0])


I8 = torch.int8


@pytest.mark.parametrize(("change", "message"), [
    ({"x2": torch.zeros(4, 3, dtype=torch.bfloat16)}, "x2: dtype"),  # a float weight
    ({"x2": torch.zeros(3, 4, dtype=I8)}, "must be transposed"),  # the (N, K) weight
    ({"scale": torch.zeros(3, dtype=torch.int64)}, "scale: dtype"),  # int64 with a bf16 output
    ({"scale": torch.zeros(3, dtype=torch.float16)}, "scale: dtype"),
    ({"bias": torch.zeros(3, dtype=torch.float16)}, "bias: dtype"),  # fp16 bias with a bf16 output
    ({"output_dtype": None}, "output_dtype"),  # None is an int8 output
    ({"pertoken_scale": torch.ones(2, dtype=torch.float16)}, "pertoken_scale: dtype"),
    ({"pertoken_scale": torch.ones(5)}, "pertoken_scale: 5 values"),
    ({"offset": torch.zeros(3)}, "offset"),
])
def test_the_fake_quant_matmul_refuses_what_the_op_refuses(fake: FakeTorchNPU, change: dict[str, object],
                                                           message: str) -> None:
    args: dict[str, object] = {"x1": torch.zeros(2, 4, dtype=I8), "x2": torch.zeros(4, 3, dtype=I8),
                               "scale": torch.ones(3), "output_dtype": torch.bfloat16, **change}
    x1, x2, scale = args.pop("x1"), args.pop("x2"), args.pop("scale")
    with pytest.raises(FakeNPUError, match=message):
        fake.module.npu_quant_matmul(x1, x2, scale, **args)


def test_the_fake_quant_matmul_refuses_a_float32_bias_or_offset_on_a_plain_fp16_output(fake: FakeTorchNPU) -> None:
    x1, x2 = torch.zeros(2, 4, dtype=I8), torch.zeros(4, 3, dtype=I8)
    with pytest.raises(FakeNPUError, match="bias: dtype"):  # fp16 out without pertoken_scale: int32 bias only
        fake.module.npu_quant_matmul(x1, x2, torch.ones(3), bias=torch.zeros(3), output_dtype=torch.float16)
    with pytest.raises(FakeNPUError, match="scale: dtype"):  # fp16 out with pertoken_scale: float32 scale only
        fake.module.npu_quant_matmul(x1, x2, torch.zeros(3, dtype=torch.int64), pertoken_scale=torch.ones(2),
                                     output_dtype=torch.float16)


def test_the_fake_quantizers_refuse_a_float32_input_and_a_wrong_zero_point(fake: FakeTorchNPU) -> None:
    with pytest.raises(FakeNPUError, match="input: dtype"):
        fake.module.npu_dynamic_quant(torch.zeros(2, 4))
    s = torch.ones(4)
    with pytest.raises(FakeNPUError, match="zero_points"):
        fake.module.npu_quantize(torch.zeros(2, 4), s, torch.zeros(4, dtype=I8), torch.qint8, -1, False)


def test_the_fake_grouped_matmul_takes_int8_only_with_the_tables_scales(fake: FakeTorchNPU) -> None:
    x = torch.ones(3, 4, dtype=I8)
    w = torch.ones(2, 4, 5, dtype=I8)
    groups = torch.tensor([1, 2])
    common: dict[str, object] = {"per_token_scale": [torch.ones(3)], "group_list": groups, "split_item": 2,
                                 "group_type": 0, "group_list_type": 1}
    out = fake.module.npu_grouped_matmul([x], [w], scale=[torch.full((2, 5), 0.5, dtype=torch.bfloat16)],
                                         output_dtype=torch.bfloat16, **common)[0]
    assert out.dtype == torch.bfloat16 and out.tolist() == [[2.0] * 5] * 3  # 4 * 0.5
    with pytest.raises(FakeNPUError, match="scale\\[0\\]: dtype"):  # float32 scales give fp16, not bf16
        fake.module.npu_grouped_matmul([x], [w], scale=[torch.ones(2, 5)], output_dtype=torch.bfloat16, **common)
    with pytest.raises(FakeNPUError, match="output_dtype"):
        fake.module.npu_grouped_matmul([x], [w], scale=[torch.ones(2, 5)], **common)
    with pytest.raises(FakeNPUError, match="quantisation"):  # a float x with scales: the float form has none
        fake.module.npu_grouped_matmul([x.half()], [w.half()], scale=[torch.ones(2, 5)], **common)


def test_trans_quant_param_takes_round_mode_from_7_1_0(monkeypatch: pytest.MonkeyPatch) -> None:
    old = install_fake_torch_npu(monkeypatch, release="7.0.0").module
    with pytest.raises(TypeError):
        old.npu_trans_quant_param(torch.ones(2), None, 0)
    new = install_fake_torch_npu(monkeypatch, release="7.1.0").module
    assert new.npu_trans_quant_param(torch.ones(2), None, 0).dtype == torch.int64


def test_the_int8_calls_pass_exactly_the_keywords_the_doctor_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    fake, npu = _backend(monkeypatch, "26.0.0")
    fake.record.update(INT8_LINEAR_OPS)
    for method in ("w8a8", "w8a8_dynamic"):
        layer = _linear(16, 8, method, bias=True, dtype=torch.float16, seed=2)
        npu.prepare_model(nn.ModuleDict({"proj": layer}))
        npu.int8_linear(torch.randn(3, 16).half(), layer)
    used = {op: set().union(*(call.keys() for call in calls)) for op, calls in fake.args.items()}
    assert set(used) == set(INT8_LINEAR_OPS)
    assert all(used[op] == KEYWORDS[op] for op in used), used
