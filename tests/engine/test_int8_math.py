"""The int8 (W8A8) math of `int8_reference.py` on small examples worked out by hand: the quantized activations, the
int32 accumulators and the outputs are written out as numbers here, never computed by the code under test.
CUDA's int32 product (`cuda.py`: padded rows for torch._int_mm, a float32 fallback for odd K/N) equals the exact
one on the CPU."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from npuserve.engine.backends import int8_reference  # noqa: E402
from npuserve.engine.backends.cuda import cuda_int32_matmul, int_mm_rows  # noqa: E402
from npuserve.engine.backends.int8_reference import int_mm_takes  # noqa: E402
from npuserve.engine.model.int8 import Int8Experts, Int8Linear  # noqa: E402

X = torch.tensor([[1.0, -0.6, 0.2], [2.4, 0.0, -1.3]])
W_Q = torch.tensor([[1, -2, 3], [-4, 5, 0]], dtype=torch.int8)
W_SCALE = torch.tensor([0.1, 0.2])


def _linear(method: str) -> Int8Linear:
    layer = Int8Linear(3, 2, bias=False, method=method)  # type: ignore[arg-type]
    with torch.no_grad():
        layer.weight.copy_(W_Q)
        layer.weight_scale.copy_(W_SCALE)
        if method == "w8a8":
            assert layer.input_scale is not None and layer.input_offset is not None and layer.quant_bias is not None
            layer.input_scale.fill_(0.5)
            layer.input_offset.fill_(1.0)
            # msModelSlim's offset correction: -offset * row sums of W_q = -1 * (2, 1)
            layer.quant_bias.copy_(torch.tensor([-2, -1], dtype=torch.int32))
    return layer


def test_static_w8a8_by_hand() -> None:
    # x / 0.5 = [[2, -1.2, 0.4], [4.8, 0, -2.6]] -> round -> [[2, -1, 0], [5, 0, -3]] -> + offset 1
    x_q = int8_reference.quantize_static(X, torch.tensor([0.5]), torch.tensor([1.0]))
    assert x_q.tolist() == [[3, 0, 1], [6, 1, -2]]
    assert x_q.dtype == torch.int8
    # [3, 0, 1] . [1, -2, 3] = 6, . [-4, 5, 0] = -12; [6, 1, -2] . rows = -2, -19; + quant_bias (-2, -1)
    acc = int8_reference.int32_matmul(x_q, W_Q) + torch.tensor([-2, -1], dtype=torch.int32)
    assert acc.tolist() == [[4, -13], [-4, -20]]
    # y = acc * input_scale * weight_scale = acc * (0.05, 0.1)
    y = int8_reference.int8_linear(X, _linear("w8a8"))
    assert torch.allclose(y, torch.tensor([[0.2, -1.3], [-0.2, -2.0]]), atol=1e-6)


def test_static_rounds_half_to_even_and_clamps() -> None:
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, 300.0, -300.0]])
    assert int8_reference.quantize_static(x, torch.tensor([1.0]), torch.tensor([0.0])).tolist() == \
        [[0, 2, 2, 0, 127, -128]]


def test_dynamic_w8a8_by_hand() -> None:
    # per token s = max|x| / 127: 1/127 and 2.4/127; x / s = [127, -76.2, 25.4] and [127, 0, -68.79]
    x_q, s = int8_reference.quantize_per_token(X)
    assert x_q.tolist() == [[127, -76, 25], [127, 0, -69]]
    assert torch.allclose(s, torch.tensor([1 / 127, 2.4 / 127]))
    # [127, -76, 25] . [1, -2, 3] = 127 + 152 + 75 = 354, . [-4, 5, 0] = -508 - 380 = -888
    # [127, 0, -69] . [1, -2, 3] = 127 - 207 = -80,      . [-4, 5, 0] = -508
    assert int8_reference.int32_matmul(x_q, W_Q).tolist() == [[354, -888], [-80, -508]]
    y = int8_reference.int8_linear(X, _linear("w8a8_dynamic"))
    want = torch.tensor([[354 / 127 * 0.1, -888 / 127 * 0.2], [-80 * 2.4 / 127 * 0.1, -508 * 2.4 / 127 * 0.2]])
    assert torch.allclose(y, want, atol=1e-6)
    assert torch.allclose(want, torch.tensor([[0.2787402, -1.3984252], [-0.1511811, -1.92]]), atol=1e-6)


def test_a_zero_token_gets_scale_one() -> None:
    x_q, s = int8_reference.quantize_per_token(torch.zeros(1, 4))
    assert x_q.tolist() == [[0, 0, 0, 0]] and s.tolist() == [1.0]


def test_an_int8_expert_by_hand() -> None:
    experts = Int8Experts(num_experts=2, hidden_size=3, intermediate=1)
    with torch.no_grad():
        experts.w13.zero_()
        experts.w13[1].copy_(W_Q)  # expert 1: gate row [1, -2, 3], up row [-4, 5, 0]
        experts.w13_scale[1].copy_(W_SCALE)
        experts.w2.zero_()
        experts.w2[1].copy_(torch.tensor([[2], [-1], [127]], dtype=torch.int8))
        experts.w2_scale[1].copy_(torch.tensor([0.01, 0.02, 0.001]))
    out = int8_reference.int8_expert(X[:1], experts, 1)
    # gate, up = acc (354, -888) from the dynamic example times s = 1/127 and the row scales
    gate, up = 354 / 127 * 0.1, -888 / 127 * 0.2
    act = gate / (1 + math.exp(-gate)) * up  # SiLU(gate) * up = -0.22189...
    # one value: a_q = round(act / (|act| / 127)) = -127, acc = -127 * (2, -1, 127), times |act| / 127 and w2_scale
    want = torch.tensor([-127 * 2 * 0.01, -127 * -1 * 0.02, -127 * 127 * 0.001]) * (abs(act) / 127)
    assert torch.allclose(out[0], want, atol=1e-6)
    assert math.isclose(act, -0.221887, abs_tol=1e-5)


def test_cuda_rows_are_padded_for_int_mm() -> None:
    assert [int_mm_rows(m) for m in (1, 16, 17, 24, 25)] == [24, 24, 24, 24, 32]
    assert int_mm_takes(64, 128) and not int_mm_takes(12, 16) and not int_mm_takes(16, 12)


@pytest.mark.parametrize(("rows", "k", "n"), [(1, 16, 24), (5, 32, 8), (17, 16, 16), (40, 64, 32), (3, 12, 10)])
def test_cuda_int32_matmul_is_exact(rows: int, k: int, n: int) -> None:
    x_q, w_q, exact = _int8_operands(rows, k, n)
    assert torch.equal(cuda_int32_matmul(x_q, w_q), exact)


# (1, 1, 3): the experts' second product in test_an_int8_expert_by_hand, which torch 2.11's CPU `_int_mm` got wrong
@pytest.mark.parametrize(("rows", "k", "n"), [(1, 1, 3), (1, 3, 2), (2, 5, 7), (1, 16, 24), (40, 64, 32), (7, 8, 1)])
def test_int32_matmul_is_exact_on_the_cpu(rows: int, k: int, n: int) -> None:
    x_q, w_q, exact = _int8_operands(rows, k, n)
    assert torch.equal(int8_reference.int32_matmul(x_q, w_q), exact)


def _int8_operands(rows: int, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rows + k + n)
    x_q = torch.randint(-128, 128, (rows, k), generator=gen, dtype=torch.int8)
    w_q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    return x_q, w_q, (x_q.to(torch.int64) @ w_q.to(torch.int64).t()).to(torch.int32)
