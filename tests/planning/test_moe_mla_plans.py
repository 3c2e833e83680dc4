"""Plans of the MoE and MLA presets on 64 GiB Ascend 910B3 cards (8 per node), every expected number derived by hand
from the published config numbers in the comments (docs/planning.md, "MoE and MLA"); none is computed by the code
under test.

Common inputs: the guide's GSM8K workload (186 tokens in on average, 346 out, at most 512 out, at most 2048 in),
cacheBlockSize 128, the catalog's 910B3: 64 GiB per card, 3.4 GiB held at idle, memoryFraction 0.8, bf16 (2 bytes).
blocksPerRequest: min ceil(186/128) = 2, avg 2 + ceil(346/128) = 2 + 3 = 5, max 2 + ceil(512/128) = 2 + 4 = 6.
GiB = 2^30 = 1,073,741,824 bytes.
"""

from __future__ import annotations

from typing import Any

import pytest

from npuserve.catalog.models import MODEL_PRESETS
from npuserve.planning.api import Architecture, InferenceServiceSpec
from npuserve.planning.planner import PlanError, architecture_of, plan

GIB = 2**30
WORKLOAD = {"avgInputTokens": 186, "avgOutputTokens": 346, "maxOutputTokens": 512}


def spec_of(preset: str, **accelerator: Any) -> InferenceServiceSpec:
    return InferenceServiceSpec.model_validate({
        "model": {"name": preset, "preset": preset, "weights": {"loadFormat": "dummy"}},
        "accelerator": {"type": "ascend-910b3", **accelerator},
        "workload": WORKLOAD,
    })


def arch_spec(arch: dict[str, Any], **accelerator: Any) -> InferenceServiceSpec:
    return InferenceServiceSpec.model_validate({
        "model": {"name": "inline", "architecture": arch, "weights": {"loadFormat": "dummy"}},
        "accelerator": {"type": "ascend-910b3", **accelerator},
        "workload": WORKLOAD,
    })


def test_qwen3_30b_a3b_fits_one_card() -> None:
    # Qwen3-30B-A3B: hidden 2048, 48 layers, 32 heads, 4 KV heads, head_dim 128, vocab 151936, 128 experts of
    # intermediate 768, top 8, no shared expert, q/k norms, untied embeddings.
    # attention/layer: q 2048x4096 = 8,388,608; k,v 2x2048x512 = 2,097,152; o 4096x2048 = 8,388,608; qk norms 256
    #                  = 18,874,624
    # MoE/layer: router 128x2048 = 262,144; experts 128 x 3x2048x768 = 128 x 4,718,592 = 603,979,776 -> 604,241,920
    # norms/layer 2x2048 = 4,096; layer = 623,120,640; x48 = 29,909,790,720
    # embeddings + LM head 2 x 151936x2048 = 622,329,856; final norm 2,048
    # total 30,532,122,624 parameters -> 61,064,245,248 bytes = 56.871 GiB
    p = plan(spec_of("qwen3-30b-a3b"))
    assert p.explained("weightsGiB").inputs["numParameters"] == 30_532_122_624
    assert p.weightsGiB == 56.871
    # 1 card: floor((64 - 3.4 - 56.871) x 0.8) = floor(2.98) = 2 GiB
    assert (p.worldSize, p.nodes, p.cardsPerPod) == (1, 1, 1)
    assert p.npuMemSizeGiB == 2
    # KV/block: 2 x 48 layers x 128 tokens x 4 KV heads x 128 x 2 bytes = 12,582,912 (12 MiB)
    assert p.blockBytesPerCard == 12_582_912
    # blocks: floor(2 x 2^30 / 12,582,912) = floor(170.67) = 170
    assert p.totalBlocks == 170
    # maxBatchSize: 170 // 6 = 28, 170 // 5 = 34, 170 // 2 = 85
    assert (p.maxBatchSize.min, p.maxBatchSize.avg, p.maxBatchSize.max) == (28, 34, 85)
    assert p.schedule.maxBatchSize == 34
    assert "every expert counted" in p.explained("weightsGiB").note


def test_qwen3_30b_a3b_on_two_cards_splits_the_kv_heads() -> None:
    # 2 cards: 56.871 / 2 = 28.435 GiB of weights per card; floor((64 - 3.4 - 28.435) x 0.8) = floor(25.73) = 25
    # KV/block: 4 KV heads / 2 = 2 per card: 2 x 48 x 128 x 2 x 128 x 2 = 6,291,456
    # blocks: floor(25 x 2^30 / 6,291,456) = floor(4266.67) = 4266; 4266 // 6 = 711, // 5 = 853, // 2 = 2133
    p = plan(spec_of("qwen3-30b-a3b", cards=2))
    assert (p.npuMemSizeGiB, p.blockBytesPerCard, p.totalBlocks) == (25, 6_291_456, 4266)
    assert (p.maxBatchSize.min, p.maxBatchSize.avg, p.maxBatchSize.max) == (711, 853, 2133)


def test_qwen3_235b_a22b_needs_eight_cards() -> None:
    # Qwen3-235B-A22B: hidden 4096, 94 layers, 64 heads, 4 KV heads, head_dim 128, vocab 151936, 128 experts of
    # intermediate 1536, top 8.
    # attention/layer: q 4096x8192 = 33,554,432; k,v 2x4096x512 = 4,194,304; o 33,554,432; qk norms 256
    #                  = 71,303,424
    # MoE/layer: router 128x4096 = 524,288; experts 128 x 3x4096x1536 = 128 x 18,874,368 = 2,415,919,104
    #            -> 2,416,443,392
    # norms 8,192; layer = 2,487,755,008; x94 = 233,848,970,752
    # embeddings + head 2 x 151936x4096 = 1,244,659,712; final norm 4,096
    # total 235,093,634,560 -> 470,187,269,120 bytes = 437.896 GiB
    p = plan(spec_of("qwen3-235b-a22b"))
    assert p.explained("weightsGiB").inputs["numParameters"] == 235_093_634_560
    assert p.weightsGiB == 437.896
    # cards must divide the 64 heads: 1, 2, 4 hold 437.9, 218.9, 109.5 GiB per card, more than 64 GiB.
    # 8 cards: 54.737 GiB per card; floor((64 - 3.4 - 54.737) x 0.8) = floor(4.69) = 4
    assert (p.worldSize, p.nodes, p.cardsPerPod) == (8, 1, 8)
    assert p.npuMemSizeGiB == 4
    # KV/block: 4 KV heads over 8 cards -> replicated, 1 per card: 2 x 94 x 128 x 1 x 128 x 2 = 6,160,384
    assert p.blockBytesPerCard == 6_160_384
    # blocks: floor(4 x 2^30 / 6,160,384) = floor(697.19) = 697; 697 // 6 = 116, // 5 = 139, // 2 = 348
    assert p.totalBlocks == 697
    assert (p.maxBatchSize.min, p.maxBatchSize.avg, p.maxBatchSize.max) == (116, 139, 348)
    assert "rejected: 1 card(s) give 0 blocks" in p.explained("worldSize").note


def test_deepseek_v3_spans_four_nodes() -> None:
    # DeepSeek-V3 (bf16): hidden 7168, 61 layers (first 3 dense, intermediate 18432), 128 heads, MLA q_lora 1536,
    # kv_lora 512, qk_nope 128, qk_rope 64, v 128; 256 routed experts of 2048 + 1 shared of 2048, top 8;
    # vocab 129280; the router has a per-expert bias (noaux_tc).
    # MLA/layer: q_a 7168x1536 = 11,010,048 + q norm 1,536 + q_b 1536 x 128x192 = 37,748,736 -> 48,760,320;
    #            kv_a 7168 x (512+64) = 4,128,768; kv norm 512; kv_b 512 x 128x(128+128) = 16,777,216;
    #            o 128x128 x 7168 = 117,440,512; attention = 187,107,328
    # dense layer: MLP 3x7168x18432 = 396,361,728 + norms 14,336 -> 583,483,392; x3 = 1,750,450,176
    # MoE layer: router 256x7168 + 256 = 1,835,264; experts 256 x 3x7168x2048 = 256 x 44,040,192
    #            = 11,274,289,152; shared 44,040,192 -> 11,320,164,608; + attention + norms = 11,507,286,272;
    #            x58 = 667,422,603,776
    # embeddings + head 2 x 129280x7168 = 1,853,358,080; final norm 7,168
    # total 671,026,419,200 (the published 671B) -> 1,342,052,838,400 bytes = 1249.884 GiB (~1.22 TiB)
    p = plan(spec_of("deepseek-v3"))
    assert p.explained("weightsGiB").inputs["numParameters"] == 671_026_419_200
    assert p.weightsGiB == 1249.884
    # cards divide the 128 heads: 8 cards (one node) hold 156.2 GiB each, 16 hold 78.1: neither fits 64 GiB.
    # 32 cards: 39.059 GiB each; floor((64 - 3.4 - 39.059) x 0.8) = floor(17.23) = 17
    assert (p.worldSize, p.nodes, p.cardsPerPod) == (32, 4, 8)
    assert p.npuMemSizeGiB == 17
    # MLA KV/block: 61 layers x 128 tokens x (512 + 64) x 2 bytes = 8,994,816, whole on every card
    assert p.blockBytesPerCard == 8_994_816
    # blocks: floor(17 x 2^30 / 8,994,816) = floor(2029.34) = 2029; // 6 = 338, // 5 = 405, // 2 = 1014
    assert p.totalBlocks == 2029
    assert (p.maxBatchSize.min, p.maxBatchSize.avg, p.maxBatchSize.max) == (338, 405, 1014)
    assert p.explained("blockBytesPerCard").formula == (
        "numLayers x cacheBlockSize x (kvLoraRank + qkRopeHeadDim) x dtypeBytes")
    assert "spans 4 nodes of 8 cards" in p.explained("nodes").note
    note = p.explained("worldSize").note
    assert "8 card(s) give 0 blocks (156.236 GiB of weights per card" in note
    assert "16 card(s) give 0 blocks (78.118 GiB" in note


def test_deepseek_v3_mla_kv_per_card_does_not_shrink_with_more_cards() -> None:
    # 64 cards (8 nodes): 19.529 GiB of weights each; floor((64 - 3.4 - 19.529) x 0.8) = floor(32.86) = 32
    # the block is still 8,994,816 bytes per card (the latent is not split); floor(32 x 2^30 / 8,994,816) = 3819
    p = plan(spec_of("deepseek-v3", cards=64))
    assert (p.worldSize, p.nodes, p.cardsPerPod) == (64, 8, 8)
    assert (p.npuMemSizeGiB, p.blockBytesPerCard, p.totalBlocks) == (32, 8_994_816, 3819)


def test_moe_world_size_must_divide_the_expert_intermediate_size() -> None:
    # 32 heads and 4 KV heads allow 8 cards, but an expert of intermediate 772 does not split over 8 (772 = 4 x 193)
    arch = {"modelType": "qwen3_moe", "numLayers": 4, "hiddenSize": 1024, "numAttentionHeads": 32,
            "numKeyValueHeads": 4, "headDim": 128, "vocabSize": 1000, "intermediateSize": 3072,
            "numExperts": 16, "numExpertsPerToken": 2, "moeIntermediateSize": 772}
    with pytest.raises(PlanError, match="772 moe_intermediate_size"):
        plan(arch_spec(arch, cards=8))
    assert plan(arch_spec(arch, cards=4)).worldSize == 4


def test_mla_has_no_kv_heads_to_divide() -> None:
    # latent attention: 128 heads, "KV heads" = heads; 32 cards divide the heads and the latent is whole per card
    p = plan(spec_of("deepseek-v3", cards=32))
    assert "kvHeadsPerCard" not in p.explained("blockBytesPerCard").inputs


def test_parameters_override_still_sets_the_weights_of_an_moe_architecture() -> None:
    arch = architecture_of(MODEL_PRESETS["qwen3-30b-a3b"]).model_dump(exclude_none=True)
    # 30e9 parameters x 2 bytes = 60,000,000,000 bytes = 55.879 GiB
    p = plan(arch_spec({**arch, "parameters": 30_000_000_000}))
    assert p.weightsGiB == 55.879
    assert "spec.model.architecture.parameters" in p.explained("weightsGiB").note


_IDENTITY = {"model", "preset"}  # the plan names its model; everything else must agree


def _numbers(p: Any) -> dict[str, Any]:
    data = p.model_dump(exclude=_IDENTITY | {"explain", "warnings"})
    return data  # type: ignore[no-any-return]


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "deepseek-v2-lite",
                                    "tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-deepseek-v2-lite"])
def test_inline_architecture_of_a_preset_plans_the_same(preset: str) -> None:
    arch = architecture_of(MODEL_PRESETS[preset])
    assert Architecture.model_validate(arch.model_dump(exclude_none=True)) == arch
    from_preset = plan(spec_of(preset))
    inline = plan(arch_spec(arch.model_dump(exclude_none=True)))
    assert _numbers(inline) == _numbers(from_preset)
    assert [(e.name, e.value) for e in inline.explain] == [(e.name, e.value) for e in from_preset.explain]


def test_tpot_floor_reads_the_top_k_experts_not_all_of_them() -> None:
    # Qwen3-235B-A22B on 8 cards, one decode token: dense parts + 8 of the 128 experts in each of the 94 layers.
    # non-expert: layer 2,487,755,008 - 2,415,919,104 = 71,835,904; x94 = 6,752,574,976; + the LM head
    #             622,329,856 (the embedding table is a lookup, not read whole) -> 7,374,904,832 parameters
    # touched experts: 94 x 8 x 18,874,368 = 14,193,524,736
    # read: 21,568,429,568 parameters x 2 = 43,136,859,136 bytes = 40.17 GiB, over 8 cards at the 910B3's bandwidth
    spec = InferenceServiceSpec.model_validate({
        "model": {"name": "q", "preset": "qwen3-235b-a22b", "weights": {"loadFormat": "dummy"}},
        "accelerator": {"type": "ascend-910b3"}, "workload": WORKLOAD,
        "slo": {"objective": "decodeLatency", "tpotMs": 1}})
    (warning,) = [w for w in plan(spec).warnings if w.startswith("spec.slo.tpotMs")]
    assert "40.2 GiB of the 437.896 GiB of weights" in warning


def test_ttft_floor_computes_the_active_parameters() -> None:
    # Qwen3-30B-A3B's active parameters: LM head 311,164,928 + final norm 2,048 + 48 x (attention 18,874,624 +
    # router 262,144 + 8 experts x 4,718,592 + norms 4,096 = 56,889,600) = 3,041,867,776 (not the 30.5 B it holds)
    from npuserve.catalog.accelerators import get_accelerator

    spec = InferenceServiceSpec.model_validate({
        "model": {"name": "q", "preset": "qwen3-30b-a3b", "weights": {"loadFormat": "dummy"}},
        "accelerator": {"type": "ascend-910b3"}, "workload": WORKLOAD,
        "slo": {"objective": "firstTokenAndDecode", "tpotMs": 1000, "ttftMs": 1}})
    (warning,) = [w for w in plan(spec).warnings if w.startswith("spec.slo.ttftMs")]
    acc = get_accelerator("ascend-910b3")
    tflops = acc.peak_tflops_16bit
    assert tflops
    floor_ms = 2 * 3_041_867_776 * 186 / (tflops * 1e12) * 1000  # one card, 186 prompt tokens
    assert f"below {floor_ms:.2f} ms" in warning


def test_deepseek_v3_at_the_default_block_size_gets_no_npu_block_warning() -> None:
    # Latent attention goes to FIA's MLA decode (a multiple of 16 up to 1024), not the dense kernels' 128 x 128
    # rule, which DeepSeek's 192-wide qk head would break at block 128.
    result = plan(spec_of("deepseek-v3"))
    assert not [w for w in result.warnings if "cacheBlockSize" in w], result.warnings
