"""The npu backend's mixture of experts and multi-head latent attention (engine/backends/npu_moe.py, npu_mla.py)
against the torch reference (`Backend`'s), through the FAKE torch_npu of every supported op-plugin line."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from npuserve.engine.backends.base import BackendUnavailableError, grouped_experts, select_experts
from npuserve.engine.backends.cpu import CPUBackend
from npuserve.engine.backends.npu import NPUBackend
from npuserve.engine.backends.npu_moe import lay_out_experts
from npuserve.engine.backends.npu_stack import FIRST_LINE, KEYWORDS, MLA_OPS, MOE_COMBINE_OPS, MOE_OPS
from npuserve.engine.batch import build_decode
from npuserve.modelspec import MoESpec
from tests.fake_torch_npu import RELEASES, FakeTorchNPU, install_fake_torch_npu
from tests.npu_testing import CPU, sequences

LINES = sorted(RELEASES)
QWEN = MoESpec(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=24, norm_topk_prob=True)
V3 = MoESpec(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=24, norm_topk_prob=True,
             scoring_func="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=2, routed_scaling_factor=2.5)
V2 = MoESpec(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=24, scoring_func="softmax",
             topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=16.0)


def _backend(monkeypatch: pytest.MonkeyPatch, release: str) -> tuple[FakeTorchNPU, NPUBackend]:
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    fake = install_fake_torch_npu(monkeypatch, release=release)
    return fake, NPUBackend(device=fake.device)


def _pairs(weights: torch.Tensor, ids: torch.Tensor) -> list[dict[int, float]]:
    """Each row's {expert: weight} (the column order is not part of the contract)."""
    return [{int(e): float(w) for e, w in zip(i, r, strict=True)} for i, r in zip(ids, weights, strict=True)]


# --- routing ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("release", LINES)
@pytest.mark.parametrize(("moe", "op"), [(QWEN, "npu_moe_gating_top_k_softmax"), (V3, "npu_moe_gating_top_k")],
                         ids=["softmax", "sigmoid-grouped"])
def test_routing_through_the_gating_ops_equals_the_reference(monkeypatch: pytest.MonkeyPatch, release: str,
                                                             moe: MoESpec, op: str) -> None:
    fake, npu = _backend(monkeypatch, release)
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(9, moe.num_experts, generator=gen).half()
    bias = 0.1 * torch.randn(moe.num_experts, generator=gen) if moe.scoring_func == "sigmoid" else None
    weights, ids = npu.moe_select_experts(logits, moe, bias)
    expected = select_experts(logits, moe, bias)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    for actual_row, expected_row in zip(_pairs(weights, ids), _pairs(*expected), strict=True):
        assert actual_row.keys() == expected_row.keys()
        assert all(abs(actual_row[e] - expected_row[e]) < 1e-5 for e in actual_row)
    assert fake.calls[op] == 1


def test_sigmoid_routing_without_renormalisation_runs_on_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    fake, npu = _backend(monkeypatch, "26.1.0")
    moe = V3.model_copy(update={"norm_topk_prob": False})  # npu_moe_gating_top_k would renormalise
    logits = torch.randn(5, 16, generator=torch.Generator().manual_seed(16))
    bias = torch.zeros(16)
    assert _pairs(*npu.moe_select_experts(logits, moe, bias)) == _pairs(*select_experts(logits, moe, bias))
    assert fake.calls["npu_moe_gating_top_k"] == 0


def test_deepseek_v2_grouped_softmax_routing_runs_on_the_reference(monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    fake, npu = _backend(monkeypatch, "7.3.0")
    logits = torch.randn(5, 16, generator=torch.Generator().manual_seed(6))
    with caplog.at_level(logging.WARNING):
        weights, ids = npu.moe_select_experts(logits, V2, None)
    assert _pairs(weights, ids) == _pairs(*select_experts(logits, V2, None))
    assert not any(fake.calls[op] for op in ("npu_moe_gating_top_k", "npu_moe_gating_top_k_softmax"))
    assert "group_limited_greedy routing" in caplog.text and "torch reference" in caplog.text


# --- the experts --------------------------------------------------------------------------------------------------


class _Experts(nn.Module):
    def __init__(self, experts: int, hidden: int, inter: int, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.w13 = nn.Parameter(0.2 * torch.randn(experts, 2 * inter, hidden, generator=gen).half())
        self.w2 = nn.Parameter(0.2 * torch.randn(experts, hidden, inter, generator=gen).half())


@pytest.mark.parametrize("laid_out", [True, False], ids=["laid-out", "model-layout"])
@pytest.mark.parametrize("release", LINES)
def test_the_moe_chain_equals_the_reference(monkeypatch: pytest.MonkeyPatch, release: str, laid_out: bool) -> None:
    fake, npu = _backend(monkeypatch, release)
    experts = _Experts(8, 32, 12, seed=7)  # 2I = 24 != H = 32: an untransposed weight would be refused
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(11, 32, generator=gen).half()
    weights, ids = select_experts(torch.randn(11, 8, generator=gen), QWEN.model_copy(update={"num_experts": 8}),
                                  None)
    expected = grouped_experts(x, weights, ids, experts.w13, experts.w2)
    if laid_out:
        before = experts.w13.detach().clone()
        assert lay_out_experts(experts) == 2
        assert experts.w13.shape == (8, 24, 32) and torch.equal(experts.w13, before)
        assert experts.w13.transpose(1, 2).is_contiguous()
    with torch.no_grad():
        actual = npu.moe_experts(x, weights, ids, experts.w13, experts.w2)
    torch.testing.assert_close(actual, expected, atol=2e-2, rtol=2e-2)
    assert fake.calls["npu_moe_init_routing_v2"] == 1 and fake.calls["npu_grouped_matmul"] == 2
    assert fake.calls["npu_swiglu"] == 1
    combine = "npu_moe_finalize_routing" if release == "7.0.0" else "npu_moe_token_unpermute"
    assert fake.calls[combine] == 1  # 7.0.0 lacks token_unpermute: finalize_routing with the k-major index


class _MoEModel(nn.Module):
    def __init__(self, moe: MoESpec | None) -> None:
        super().__init__()
        self.spec = type("Spec", (), {"moe": moe, "mla": None})()
        self.experts = _Experts(8, 32, 12, seed=9)


def test_a_stack_without_the_moe_ops_refuses_a_moe_model_by_name_and_serves_a_dense_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    fake = install_fake_torch_npu(monkeypatch, release="7.3.0")
    monkeypatch.delattr(fake.module, "npu_moe_init_routing_v2")  # a torch_npu outside the matrix, say
    npu = NPUBackend(device=fake.device)
    npu.prepare_model(_MoEModel(None))  # dense: fine
    with pytest.raises(BackendUnavailableError, match="lacks npu_moe_init_routing_v2"):
        npu.prepare_model(_MoEModel(QWEN))


# --- multi-head latent attention -------------------------------------------------------------------------------


def _mla_inputs(rank: int, rope: int, tokens: int = 5, seed: int = 10) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    angles = torch.rand(tokens, rope // 2, generator=gen) * 6
    return dict(kv_a=torch.randn(tokens, rank + rope, generator=gen).half(),
                gamma=(1 + 0.1 * torch.randn(rank, generator=gen)).half(),
                cos=torch.cat([angles.cos()] * 2, -1), sin=torch.cat([angles.sin()] * 2, -1),
                slot_mapping=torch.tensor([3, 40, 17, 99, 64][:tokens]))


@pytest.mark.parametrize("interleaved", [True, False], ids=["deepseek-rope", "neox-rope"])
@pytest.mark.parametrize("release", LINES)
def test_the_mla_cache_write_equals_the_reference(monkeypatch: pytest.MonkeyPatch, release: str,
                                                  interleaved: bool) -> None:
    fake, npu = _backend(monkeypatch, release)
    a = _mla_inputs(512, 64)
    ref_caches = CPUBackend().allocate_mla_cache(1, 8, 16, 512, 64, torch.float16)[0]
    npu_caches = npu.allocate_mla_cache(1, 8, 16, 512, 64, torch.float16)[0]
    expected = CPUBackend().mla_write_cache(a["kv_a"], a["gamma"], 1e-6, a["cos"], a["sin"], a["slot_mapping"],
                                            *ref_caches, interleaved)
    actual = npu.mla_write_cache(a["kv_a"], a["gamma"], 1e-6, a["cos"], a["sin"], a["slot_mapping"], *npu_caches,
                                 interleaved)
    for x, y in zip(actual, expected, strict=True):
        torch.testing.assert_close(x.float(), y.float(), atol=2e-2, rtol=2e-2)
    for x, y in zip(npu_caches, ref_caches, strict=True):
        torch.testing.assert_close(x.float(), y.float(), atol=2e-2, rtol=2e-2)
    assert fake.calls["npu_kv_rmsnorm_rope_cache"] == 1


def test_an_mla_shape_outside_the_ops_contract_runs_on_the_reference(monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    fake, npu = _backend(monkeypatch, "7.3.0")
    a = _mla_inputs(64, 16)  # the tiny presets' kv_lora_rank 64, rope 16
    caches = npu.allocate_mla_cache(1, 8, 16, 64, 16, torch.float16)[0]
    ref = CPUBackend().allocate_mla_cache(1, 8, 16, 64, 16, torch.float16)[0]
    with caplog.at_level(logging.WARNING):
        actual = npu.mla_write_cache(a["kv_a"], a["gamma"], 1e-6, a["cos"], a["sin"], a["slot_mapping"], *caches,
                                     True)
    expected = CPUBackend().mla_write_cache(a["kv_a"], a["gamma"], 1e-6, a["cos"], a["sin"], a["slot_mapping"],
                                            *ref, True)
    assert all(torch.equal(x, y) for x, y in zip(actual, expected, strict=True))
    assert fake.calls["npu_kv_rmsnorm_rope_cache"] == 0
    assert "kv_lora_rank 64" in caplog.text


def _decode_case(heads: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    latent = torch.randn(64, 16, 1, 512, generator=gen).half()
    rope = torch.randn(64, 16, 1, 64, generator=gen).half()
    q_latent = (0.05 * torch.randn(3, heads, 512, generator=gen)).half()
    q_pe = (0.05 * torch.randn(3, heads, 64, generator=gen)).half()
    return latent, rope, q_latent, q_pe


@pytest.mark.parametrize(("release", "heads"), [(line, 4) for line in LINES] + [("7.3.0", 6)])
def test_the_mla_decode_equals_the_reference(monkeypatch: pytest.MonkeyPatch, release: str, heads: int) -> None:
    fake, npu = _backend(monkeypatch, release)
    latent, rope, q_latent, q_pe = _decode_case(heads, seed=11)
    seqs = sequences([1, 40, 17], [0, 39, 16], seed=12)
    expected = CPUBackend().mla_decode_attention(q_latent, q_pe, latent, rope, build_decode(seqs, 16, CPU).meta,
                                                 0.07)
    actual = npu.mla_decode_attention(q_latent, q_pe, latent, rope, build_decode(seqs, 16, fake.device).meta, 0.07)
    torch.testing.assert_close(actual.float(), expected.float(), atol=1e-2, rtol=1e-2)
    # 6 query heads per rank are not in FIA's MLA set: the reference runs
    assert fake.calls["npu_fused_infer_attention_score"] == (1 if heads == 4 else 0)


@pytest.mark.parametrize("release", ["7.0.0", "26.0.0"])
def test_the_moe_and_mla_calls_pass_exactly_the_keywords_the_doctor_checks(monkeypatch: pytest.MonkeyPatch,
                                                                          release: str) -> None:
    fake, npu = _backend(monkeypatch, release)
    names = (set(MOE_OPS) | set(MOE_COMBINE_OPS) | set(MLA_OPS)) - {"npu_swiglu"}
    fake.record.update(names)
    experts = _Experts(16, 32, 12, seed=13)
    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(14))
    for moe in (QWEN, V3):
        weights, ids = npu.moe_select_experts(logits, moe, torch.zeros(16) if moe is V3 else None)
        npu.moe_experts(torch.randn(4, 32).half(), weights, ids, experts.w13, experts.w2)
    a = _mla_inputs(512, 64)
    latent, rope = npu.allocate_mla_cache(1, 128, 16, 512, 64, torch.float16)[0]
    npu.mla_write_cache(a["kv_a"], a["gamma"], 1e-6, a["cos"], a["sin"], a["slot_mapping"], latent, rope, True)
    _, _, q_latent, q_pe = _decode_case(4, seed=15)
    seqs = sequences([1, 40, 17], [0, 39, 16], seed=12)
    npu.mla_decode_attention(q_latent, q_pe, latent, rope, build_decode(seqs, 16, fake.device).meta, 0.1)
    used = {op: set().union(*(call.keys() for call in calls)) for op, calls in fake.args.items()}
    combine = "npu_moe_finalize_routing" if release == "7.0.0" else "npu_moe_token_unpermute"
    assert set(used) == names - set(MOE_COMBINE_OPS) | {combine}
    assert all(used[op] == KEYWORDS[op] for op in used), used


def test_an_mla_model_takes_fias_block_rule_not_the_dense_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    _, npu = _backend(monkeypatch, "7.3.0")
    with pytest.raises(ValueError, match="128 x head size 192"):  # DeepSeek-V3's qk head (128 + 64), dense rule
        npu.configure(block_size=128, head_dim=192, max_seq_len=4096)
    model = _MoEModel(None)
    model.spec.mla = object()  # type: ignore[attr-defined]
    npu.prepare_model(model)
    npu.configure(block_size=128, head_dim=192, max_seq_len=4096)  # no dense kernel runs: FIA's rule
    with pytest.raises(ValueError, match="multiple of 16 up to 1024"):
        npu.configure(block_size=40, head_dim=192, max_seq_len=4096)


@pytest.mark.parametrize("release", LINES)
def test_the_stack_table_and_the_fake_agree_on_each_ops_first_line(monkeypatch: pytest.MonkeyPatch,
                                                                   release: str) -> None:
    _, npu = _backend(monkeypatch, release)

    def line(name: str) -> tuple[int, ...]:
        return tuple(int(p) if p.isdigit() else 0 for p in name.replace("rc", "").split("."))

    for op, first in FIRST_LINE.items():
        assert (op in npu.stack.present) == (line(release) >= line(first)), op
    assert npu.stack.moe_combine_op == ("npu_moe_finalize_routing" if release == "7.0.0"
                                        else "npu_moe_token_unpermute")
    assert not npu.stack.missing_moe() and not npu.stack.missing_mla()
