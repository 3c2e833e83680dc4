"""The npu backend's fused kernels (RMSNorm, RoPE, SwiGLU through torch_npu) against the eager layers they
replace, and `prepare_model`'s swap, run against the FAKE torch_npu (tests/fake_torch_npu.py): no NPU is here."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from npuserve.engine.backends.npu import NPUBackend
from npuserve.engine.backends.npu_fused import FusedRMSNorm, FusedRotary, FusedSwiGLU
from npuserve.engine.model.layers import RMSNorm, RotaryEmbedding, silu_and_mul
from npuserve.engine.model.llama import MLP, LlamaForCausalLM
from npuserve.engine.model.loader import load_model
from npuserve.modelspec import ModelSpec
from tests.fake_torch_npu import FakeTorchNPU
from tests.npu_testing import CPU, DTYPES, HEAD_DIM, HEADS, assert_close, qkv

# --- fused kernels -------------------------------------------------------------------------------------------------


def test_the_fake_fused_kernels_compute_their_documented_formulas(fake: FakeTorchNPU) -> None:
    ops = fake.module
    y, rstd = ops.npu_rms_norm(torch.tensor([[3.0, 4.0]]), torch.tensor([1.0, 2.0]), epsilon=0.0)
    torch.testing.assert_close(y, torch.tensor([[3.0, 8.0]]) / math.sqrt(12.5))
    torch.testing.assert_close(rstd, torch.tensor([[1 / math.sqrt(12.5)]]))
    torch.testing.assert_close(ops.npu_swiglu(torch.tensor([[2.0, -1.0, 3.0, 5.0]])),
                               torch.tensor([[2.0 * torch.sigmoid(torch.tensor(2.0)).item() * 3.0,
                                              -1.0 * torch.sigmoid(torch.tensor(-1.0)).item() * 5.0]]))
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 1, 1, 4)
    one, zero = torch.ones(1, 1, 1, 4), torch.zeros(1, 1, 1, 4)
    torch.testing.assert_close(ops.npu_rotary_mul(x, one, zero), x)  # cos 1: unchanged
    torch.testing.assert_close(ops.npu_rotary_mul(x, zero, one), torch.tensor([-3.0, -4.0, 1.0, 2.0]).view(1, 1, 1, 4))
    assert fake.calls == {"npu_rms_norm": 1, "npu_swiglu": 1, "npu_rotary_mul": 2}


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_rms_norm_matches_the_eager_one(fake: FakeTorchNPU, npu: NPUBackend, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(20)
    hidden = RMSNorm(HEADS * HEAD_DIM, 1e-5).to(dtype)
    per_head = RMSNorm(HEAD_DIM, 1e-6).to(dtype)  # qwen3's q/k norm
    mixed = RMSNorm(HEAD_DIM, 1e-6)  # float32 weights: the kernel wants gamma in the input's dtype
    with torch.no_grad():
        for norm in (hidden, per_head, mixed):
            norm.weight.copy_(1 + 0.1 * torch.randn(norm.weight.shape, generator=gen))
    x = (3 * torch.randn(7, HEADS * HEAD_DIM, generator=gen)).to(dtype)
    q, _, _ = qkv(7, dtype, seed=21)  # a view of the fused projection, not contiguous
    expected = hidden(x), per_head(q), mixed(q)
    npu.prepare_model(nn.ModuleList([hidden, per_head, mixed]))
    assert all(isinstance(vars(m).get("forward"), FusedRMSNorm) for m in (hidden, per_head, mixed))
    actual = hidden(x), per_head(q), mixed(q)
    for a, e in zip(actual[:2], expected[:2], strict=True):
        assert_close(a, e, dtype)
    assert torch.equal(actual[2], expected[2])  # left to the eager forward
    assert fake.calls["npu_rms_norm"] == 2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0,
                                             "original_max_position_embeddings": 1024}])
def test_fused_rope_matches_the_eager_one(fake: FakeTorchNPU, npu: NPUBackend, dtype: torch.dtype,
                                          scaling: dict[str, object] | None) -> None:
    rotary = RotaryEmbedding(HEAD_DIM, 4096, 10000.0, scaling)
    positions = torch.tensor([0, 1, 2, 37, 1000, 4095, 5])
    q, k, _ = qkv(len(positions), dtype, seed=22)  # views of the fused projection, as the model makes them
    expected = rotary(positions, q, k)
    npu.prepare_model(rotary)
    assert isinstance(rotary.forward, FusedRotary)
    actual = rotary(positions, q, k)
    for a, e in zip(actual, expected, strict=True):
        assert_close(a, e, dtype)
    assert fake.calls["npu_rotary_mul"] == 2  # q and k


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_swiglu_matches_silu_and_mul(fake: FakeTorchNPU, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(23)
    x = (3 * torch.randn(7, 2 * 96, generator=gen)).to(dtype)
    assert_close(FusedSwiGLU(fake.module)(x), silu_and_mul(x), dtype)
    assert fake.calls["npu_swiglu"] == 1


def _model(tiny_model_dir: Path, dtype: torch.dtype, qk_norm: bool = False) -> LlamaForCausalLM:
    spec = ModelSpec.from_pretrained(tiny_model_dir).model_copy(update={"qk_norm": qk_norm})
    return load_model(spec, None, dtype, CPU)  # random weights


def test_prepare_model_swaps_exactly_the_leaf_kernels(fake: FakeTorchNPU, npu: NPUBackend, tiny_model_dir: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(tiny_model_dir, torch.float16, qk_norm=True)
    layers = model.spec.num_layers
    state = {name: t.clone() for name, t in model.state_dict().items()}
    kinds = {name: type(m) for name, m in model.named_modules() if not name.endswith(".act_fn")}
    npu.prepare_model(model)

    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 4 * layers + 1  # input, post-attention, q and k norms per layer; the final norm
    assert all(isinstance(vars(m).get("forward"), FusedRMSNorm) for m in norms)
    rotaries = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
    assert len(rotaries) == 1 and isinstance(vars(rotaries[0]).get("forward"), FusedRotary)  # shared by the layers
    mlps = [m for m in model.modules() if isinstance(m, MLP)]
    assert len(mlps) == layers and all(isinstance(m.act_fn, FusedSwiGLU) for m in mlps)
    # nothing else: no other module's forward, no module replaced, every parameter and buffer as it was
    assert [name for name, m in model.named_modules()
            if "forward" in vars(m) and not isinstance(m, RMSNorm | RotaryEmbedding)] == []
    assert {name: type(m) for name, m in model.named_modules() if not name.endswith(".act_fn")} == kinds
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[name], t) for name, t in state.items())

    swapped = [vars(m)["forward"] for m in (*norms, *rotaries)] + [m.act_fn for m in mlps]
    npu.prepare_model(model)  # idempotent (the runner may call it again)
    assert [vars(m)["forward"] for m in (*norms, *rotaries)] + [m.act_fn for m in mlps] == swapped


def test_prepare_model_without_the_act_fn_hook_keeps_swiglu_eager(fake: FakeTorchNPU, npu: NPUBackend,
                                                                  tiny_model_dir: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    model = _model(tiny_model_dir, torch.float16)
    for mlp in (m for m in model.modules() if isinstance(m, MLP)):
        if hasattr(mlp, "act_fn"):
            delattr(mlp, "act_fn")
    caplog.set_level(logging.DEBUG, logger="npuserve.engine.backends.npu_fused")
    npu.prepare_model(model)
    assert not any(isinstance(m, FusedSwiGLU) for m in model.modules())
    assert "keeps its eager SwiGLU" in caplog.text
    assert all(isinstance(vars(m).get("forward"), FusedRMSNorm) for m in model.modules() if isinstance(m, RMSNorm))
