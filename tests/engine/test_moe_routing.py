"""The MoE backend reference against transformers: `moe_select_experts` equals transformers' own routers
(Qwen2/3-MoE, DeepSeek-V2 greedy and group-limited, DeepSeek-V3 noaux_tc) on random logits, and `moe_experts`
equals a dense all-experts computation.

Each router gets the logits unchanged: hidden size = experts and an identity router weight. The DeepSeek-V3 data
is such that the correction bias, the group limit, the renormalisation and the scaling factor each change the
result (each named test asserts that of its own step, then that ours matches the full rule).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers.models.deepseek_v2.configuration_deepseek_v2 import DeepseekV2Config  # noqa: E402
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter  # noqa: E402
from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter  # noqa: E402
from transformers.models.qwen2_moe.configuration_qwen2_moe import Qwen2MoeConfig  # noqa: E402
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter  # noqa: E402
from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter  # noqa: E402

from npuserve.engine.backends.cpu import CPUBackend  # noqa: E402
from npuserve.modelspec import MoESpec  # noqa: E402

E, K, TOKENS = 16, 4, 64
BACKEND = CPUBackend()


def _logits(seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(TOKENS, E, generator=torch.Generator().manual_seed(seed)) * scale


def _identity(router: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        router.weight.copy_(torch.eye(E))
    return router.eval()


def _pairs(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's (id, weight) pairs ordered by id: the order of the K columns is not part of the result."""
    ids = ids.long()
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), weights.float().gather(1, order)


def _assert_same(ours: tuple[torch.Tensor, torch.Tensor], theirs: tuple[torch.Tensor, torch.Tensor]) -> None:
    our_ids, our_w = _pairs(*ours)
    their_ids, their_w = _pairs(*theirs)
    assert torch.equal(our_ids, their_ids)
    torch.testing.assert_close(our_w, their_w, rtol=1e-6, atol=1e-7)


def _differ(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    a_ids, a_w = _pairs(*a)
    b_ids, b_w = _pairs(*b)
    return not torch.equal(a_ids, b_ids) or not torch.allclose(a_w, b_w)


# --- Qwen2/3-MoE: softmax, top-k, renormalised when norm_topk_prob ------------------------------------------------

@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_qwen_routing_matches_transformers(family: str, norm: bool) -> None:
    logits = _logits(seed=1, scale=2.0)
    common = dict(hidden_size=E, num_experts=E, num_experts_per_tok=K, norm_topk_prob=norm,
                  num_attention_heads=4, num_key_value_heads=2)
    router = (_identity(Qwen3MoeTopKRouter(Qwen3MoeConfig(**common))) if family == "qwen3_moe"
              else _identity(Qwen2MoeTopKRouter(Qwen2MoeConfig(**common))))
    with torch.no_grad():
        _, w, ids = router(logits)
    moe = MoESpec(num_experts=E, num_experts_per_tok=K, moe_intermediate_size=8, norm_topk_prob=norm)
    ours = BACKEND.moe_select_experts(logits, moe, None)
    assert ours[0].dtype == torch.float32 and ours[1].dtype == torch.int32
    assert ours[0].shape == ours[1].shape == (TOKENS, K)
    _assert_same(ours, (w, ids))
    if norm:
        torch.testing.assert_close(ours[0].sum(-1), torch.ones(TOKENS))


# --- DeepSeek-V2: softmax greedy or group-limited greedy, times routed_scaling_factor ------------------------------

@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_routing_matches_transformers(method: str) -> None:
    logits = _logits(seed=2, scale=2.0)
    config = DeepseekV2Config(hidden_size=E, num_attention_heads=4, n_routed_experts=E, num_experts_per_tok=K,
                              n_group=4, topk_group=2, topk_method=method, routed_scaling_factor=16.0)
    with torch.no_grad():
        _, w, ids = _identity(DeepseekV2TopkRouter(config))(logits)
    moe = MoESpec(num_experts=E, num_experts_per_tok=K, moe_intermediate_size=8, topk_method=method, n_group=4,
                  topk_group=2, routed_scaling_factor=16.0)
    ours = BACKEND.moe_select_experts(logits, moe, None)
    _assert_same(ours, (w, ids))
    if method == "group_limited_greedy":  # the group limit changes the choice on this data
        ungrouped = MoESpec(num_experts=E, num_experts_per_tok=K, moe_intermediate_size=8, routed_scaling_factor=16.0)
        assert _differ(ours, BACKEND.moe_select_experts(logits, ungrouped, None))


# --- DeepSeek-V3: sigmoid, biased choice, top-2-sum group limit, renormalised, scaled ------------------------------

V3 = dict(num_experts=E, num_experts_per_tok=K, moe_intermediate_size=8, norm_topk_prob=True, scoring_func="sigmoid",
          topk_method="noaux_tc", n_group=4, topk_group=2, routed_scaling_factor=2.5)


def _v3_data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(TOKENS, E, generator=gen) * 2.0
    bias = torch.randn(E, generator=gen) * 0.3  # some negative: a -inf mask and a 0.0 mask differ
    return logits, bias


def _transformers_v3(logits: torch.Tensor, bias: torch.Tensor, **changes: object) -> tuple[torch.Tensor, torch.Tensor]:
    fields = dict(n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True) | changes
    config = DeepseekV3Config(hidden_size=E, num_attention_heads=4, n_routed_experts=E, num_experts_per_tok=K,
                              **fields)
    router = _identity(DeepseekV3TopkRouter(config))
    with torch.no_grad():
        router.e_score_correction_bias.copy_(bias)
        _, w, ids = router(logits)
    return w, ids


def _ours_v3() -> tuple[torch.Tensor, torch.Tensor]:
    logits, bias = _v3_data()
    return BACKEND.moe_select_experts(logits, MoESpec(**V3), bias)  # type: ignore[arg-type]


def test_v3_correction_bias_changes_the_choice_and_matches() -> None:
    logits, bias = _v3_data()
    full = _transformers_v3(logits, bias)
    assert _differ(full, _transformers_v3(logits, torch.zeros(E)))
    _assert_same(_ours_v3(), full)


def test_v3_group_limit_changes_the_choice_and_matches() -> None:
    logits, bias = _v3_data()
    full = _transformers_v3(logits, bias)
    assert _differ(full, _transformers_v3(logits, bias, n_group=1, topk_group=1))
    _assert_same(_ours_v3(), full)


def test_v3_renormalisation_changes_the_weights_and_matches() -> None:
    logits, bias = _v3_data()
    full = _transformers_v3(logits, bias)
    assert _differ(full, _transformers_v3(logits, bias, norm_topk_prob=False))
    ours = _ours_v3()
    _assert_same(ours, full)
    torch.testing.assert_close(ours[0].sum(-1), torch.full((TOKENS,), 2.5))


def test_v3_scaling_factor_changes_the_weights_and_matches() -> None:
    logits, bias = _v3_data()
    full = _transformers_v3(logits, bias)
    assert _differ(full, _transformers_v3(logits, bias, routed_scaling_factor=1.0))
    _assert_same(_ours_v3(), full)


def test_v3_masked_groups_lose_to_negative_biased_scores() -> None:
    """The installed transformers masks the dropped groups with -inf (an older one used 0.0, which a negative
    biased score loses to): with every biased score negative, only experts of the kept groups are chosen."""
    logits, _ = _v3_data()
    bias = torch.full((E,), -2.0)
    full = _transformers_v3(logits, bias)
    ours = BACKEND.moe_select_experts(logits, MoESpec(**V3), bias)  # type: ignore[arg-type]
    _assert_same(ours, full)
    groups = ours[1].long() // (E // 4)
    assert all(len(set(row)) <= 2 for row in groups.tolist())  # topk_group 2 of 4 groups


def test_v3_weights_are_the_unbiased_scores() -> None:
    logits, bias = _v3_data()
    w, ids = BACKEND.moe_select_experts(logits, MoESpec(**{**V3, "norm_topk_prob": False}), bias)  # type: ignore[arg-type]
    torch.testing.assert_close(w, logits.sigmoid().gather(1, ids.long()) * 2.5)


# --- the experts ---------------------------------------------------------------------------------------------------

def _dense_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                   w2: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, then each token's top-k mixed: the slow, obvious reference."""
    inter = w2.shape[2]
    h = torch.einsum("th,eih->tei", x, w13)
    y = torch.einsum("tei,ehi->teh", torch.nn.functional.silu(h[..., :inter]) * h[..., inter:], w2)
    mix = torch.zeros(x.shape[0], w13.shape[0]).scatter_add_(1, ids.long(), weights.float())
    return torch.einsum("te,teh->th", mix, y)


@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_moe_experts_equals_the_dense_reference(tokens: int) -> None:
    gen = torch.Generator().manual_seed(4)
    hidden, inter, experts = 32, 24, 16
    x = torch.randn(tokens, hidden, generator=gen)
    logits = torch.randn(tokens, experts, generator=gen)
    moe = MoESpec(num_experts=experts, num_experts_per_tok=K, moe_intermediate_size=inter, norm_topk_prob=True)
    weights, ids = BACKEND.moe_select_experts(logits, moe, None)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.2
    out = BACKEND.moe_experts(x, weights, ids, w13, w2)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, _dense_experts(x, weights, ids, w13, w2), rtol=1e-5, atol=1e-5)
    # tensor parallel: two ranks' intermediate slices (gate and up rows of each half, down's columns) sum to it
    half = inter // 2
    rows = [torch.cat([w13[:, r * half:(r + 1) * half], w13[:, inter + r * half:inter + (r + 1) * half]], 1)
            for r in range(2)]
    parts = [BACKEND.moe_experts(x, weights, ids, rows[r], w2[:, :, r * half:(r + 1) * half]) for r in range(2)]
    torch.testing.assert_close(parts[0] + parts[1], out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_backends_packed_experts_equal_the_reference(dtype: torch.dtype) -> None:
    """After `prepare_model` the CPU backend runs the experts on weights packed once (where oneDNN is there)."""
    from npuserve.engine.model.moe import FusedExperts

    gen = torch.Generator().manual_seed(6)
    experts = FusedExperts(16, 32, 24)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    experts = experts.to(dtype)
    backend = CPUBackend()
    backend.prepare_model(experts)
    x = torch.randn(9, 32, generator=gen).to(dtype)
    moe = MoESpec(num_experts=16, num_experts_per_tok=K, moe_intermediate_size=24)
    weights, ids = backend.moe_select_experts(torch.randn(9, 16, generator=gen), moe, None)
    out = backend.moe_experts(x, weights, ids, experts.w13, experts.w2)
    want = CPUBackend().moe_experts(x, weights, ids, experts.w13, experts.w2)  # not prepared: the reference
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out, want, rtol=tolerance, atol=tolerance)
    # oneDNN packs bf16 only on CPUs with AVX512-BW/VL/DQ or AVX-NE-CONVERT; elsewhere the reference runs
    packs = torch.backends.mkldnn.is_available() and (dtype != torch.bfloat16
                                                      or torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert bool(backend._packed_experts) == packs


def test_a_float32_router_keeps_its_weight_and_bias_in_float32_in_a_bfloat16_model() -> None:
    """DeepSeek's router (transformers keeps `gate.weight` and `e_score_correction_bias` in float32)."""
    from npuserve.catalog.models import get_model_preset
    from npuserve.engine.model.base import CausalLM
    from npuserve.engine.model.moe import SparseMoeBlock
    from npuserve.engine.parallel.layout import TPLayout

    spec = get_model_preset("tiny-deepseek-v3")
    model = CausalLM(spec, TPLayout(0, 1, 48, 4, 4, 0, 0, 256, 1024, 1024, moe_intermediate=64,
                                    shared_intermediate=64))
    model.block = SparseMoeBlock(spec, model.layout, model.tp, float32_router=True)
    model.to(torch.bfloat16).finish_build(torch.device("cpu"))
    assert model.block.gate.weight.dtype == torch.float32
    assert model.block.gate.e_score_correction_bias.dtype == torch.float32  # type: ignore[union-attr]
    assert model.block.experts.w13.dtype == torch.bfloat16
