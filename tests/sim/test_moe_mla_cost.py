"""The simulator's MoE and MLA terms (docs/simulator.md, "MoE and MLA"): the expert-touch rule against a direct count
on random routings, the weights a step reads and the FLOPs of a token by hand from the config numbers, and the latent
KV that every card holds whole."""

from __future__ import annotations

import numpy as np
import pytest

from npuserve.catalog.accelerators import Efficiency, get_accelerator
from npuserve.catalog.models import MODEL_PRESETS
from npuserve.modelspec import MoESpec
from npuserve.sim.cost_model import CostModel, CostParams, Hardware, StepShape

TRIALS = 4000


def _distinct_experts(rng: np.random.Generator, experts: int, top_k: int, tokens: int) -> np.ndarray:
    """TRIALS draws of `tokens` tokens, each choosing `top_k` distinct experts of `experts` uniformly: the number of
    distinct experts chosen in each draw."""
    scores = rng.random((TRIALS, tokens, experts), dtype=np.float32)
    chosen = np.argpartition(scores, top_k - 1, axis=2)[:, :, :top_k]  # the k lowest scores: a uniform k-subset
    hit = np.zeros((TRIALS, experts), dtype=bool)
    rows = np.repeat(np.arange(TRIALS), tokens * top_k)
    hit[rows, chosen.reshape(-1)] = True
    return hit.sum(axis=1)


@pytest.mark.parametrize(("experts", "top_k", "tokens"), [
    (128, 8, 1), (128, 8, 4), (128, 8, 16), (128, 8, 64), (256, 8, 32), (16, 4, 3), (64, 6, 10), (8, 2, 5)])
def test_expert_touch_rule_matches_a_direct_count_on_random_routings(experts: int, top_k: int, tokens: int) -> None:
    counts = _distinct_experts(np.random.default_rng(experts * 1000 + tokens), experts, top_k, tokens)
    rule = MoESpec(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=1).experts_touched(tokens)
    standard_error = counts.std() / np.sqrt(TRIALS)
    assert abs(counts.mean() - rule) <= 4 * standard_error + 1e-9, (counts.mean(), rule)
    assert abs(counts.mean() - rule) <= 0.01 * rule


def test_expert_touch_rule_by_hand() -> None:
    moe = MoESpec(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768)
    assert moe.experts_touched(0) == 0
    assert moe.experts_touched(1) == pytest.approx(8)  # one token: its top k
    # 16 tokens: 128 x (1 - (120/128)^16); (15/16)^16 = 0.356074 -> 128 x 0.643926 = 82.4225
    assert moe.experts_touched(16) == pytest.approx(82.4225, abs=1e-4)
    assert moe.experts_touched(10_000) == pytest.approx(128)  # a long prefill reads every expert


# the 910B3's datasheet figures with written-out achieved fractions (the fitted ones move with each fit)
HW = Hardware.of(get_accelerator("ascend-910b3"), Efficiency(bandwidth=0.85, compute=0.6, link=0.7, source="test"))
NO_OVERHEAD = CostParams()  # no launches, no host work, no all-reduce latency


def test_qwen3_30b_a3b_decode_reads_the_touched_experts_and_computes_the_active_ones() -> None:
    # Qwen3-30B-A3B per layer: attention 18,874,624 (q 8,388,608 + k,v 2,097,152 + o 8,388,608 + qk norms 256),
    # router 262,144, norms 4,096, one expert 3 x 2048 x 768 = 4,718,592; 48 layers; LM head 151936 x 2048 =
    # 311,164,928 (the embedding table is a lookup, not read).
    model = MODEL_PRESETS["qwen3-30b-a3b"]
    cost = CostModel(model, HW, 2, NO_OVERHEAD)
    bandwidth = HW.bandwidth_gbps * 1e9 * 0.85
    # non-expert read per layer 18,874,624 + 262,144 + 4,096 = 19,140,864; x48 = 918,761,472; + head -> 1,229,926,400
    # one token touches 8 experts per layer: 48 x 8 x 4,718,592 = 1,811,939,328 -> 3,041,865,728 parameters
    one = 3_041_865_728 * 2 / 2
    assert cost.weights_s(1) == pytest.approx(one / bandwidth, rel=1e-12)
    # every expert: 48 x 128 x 4,718,592 = 28,991,029,248 -> 30,220,955,648 parameters (all but the embeddings)
    every = 30_220_955_648 * 2 / 2
    assert cost.weight_bytes_per_card == pytest.approx(every, rel=1e-12)
    assert cost.weights_s(100_000) == pytest.approx(every / bandwidth, rel=1e-9)
    # 16 decoding sequences: 82.4225 experts of 128 per layer (test_expert_touch_rule_by_hand)
    sixteen = (1_229_926_400 + 48 * 82.42251 * 4_718_592) * 2 / 2
    assert cost.weights_s(16) == pytest.approx(sixteen / bandwidth, rel=1e-6)
    decode = cost.step(StepShape(num_seqs=16, new_tokens=16, context_tokens=16 * 500, attended_pairs=16 * 500,
                                 sampled_rows=16))
    assert decode.weights_s == cost.weights_s(16)
    # FLOPs of a token: active layer parameters 48 x (18,874,624 + 262,144 + 8 x 4,718,592 + 4,096) = 2,730,700,800
    flops = HW.tflops * 1e12 * 0.6
    prefill = cost.step(StepShape(num_seqs=1, new_tokens=1000, context_tokens=1000, attended_pairs=0,
                                  sampled_rows=0))
    assert prefill.compute_s == pytest.approx(1000 * 2 * 2_730_700_800 / 2 / flops, rel=1e-12)


def test_deepseek_v3_decode_reads_the_latent_kv_whole_on_every_card() -> None:
    # 61 layers x (kv_lora_rank 512 + rope 64) x 2 bytes = 70,272 bytes per token, on each card at any worldSize
    model = MODEL_PRESETS["deepseek-v3"]
    for cards in (8, 32, 64):
        cost = CostModel(model, HW, cards, NO_OVERHEAD)
        assert cost.kv_bytes_per_token_per_card == 70_272
        assert cost.block_bytes_per_card == 128 * 70_272
    cost = CostModel(model, HW, 32, NO_OVERHEAD)
    step = cost.step(StepShape(num_seqs=8, new_tokens=8, context_tokens=8 * 1000, attended_pairs=8 * 1000,
                               sampled_rows=8))
    assert step.kv_s == pytest.approx(8000 * 70_272 / (HW.bandwidth_gbps * 1e9 * 0.85), rel=1e-12)


def test_a_dense_model_reads_every_weight_at_any_batch() -> None:
    cost = CostModel(MODEL_PRESETS["llama3-8b"], HW, 1, NO_OVERHEAD)
    assert cost.weights_s(1) == cost.weights_s(1000) == cost.weight_bytes_per_card / (HW.bandwidth_gbps * 1e9 * 0.85)
