"""Plans of W8A8 (int8) checkpoints on 64 GiB Ascend 910B3 cards (8 per node), every expected number derived by hand
from the published config numbers in the comments (docs/planning.md, "Quantized weights"); none is computed by the
code under test.

A W8A8 linear layer stores one int8 byte per parameter plus, per output row, the scales its format writes:
msModelSlim W8A8 (static) 12 bytes (weight_scale and weight_offset bf16, deq_scale float32, quant_bias int32),
W8A8_DYNAMIC 4 bytes (weight_scale, weight_offset bf16), compressed-tensors 2 bytes (a bf16 weight_scale): what
msModelSlim 26.1.0 and llm-compressor 0.14.0.1 write for a bf16 model (docs/quantization.md, "What the tools
write"). Every linear module of a decoder layer is int8 except the MoE router; the embedding table, the LM head and the
norms stay bf16 (2 bytes), and so does the KV cache.

Common inputs (as tests/planning/test_moe_mla_plans.py): the guide's GSM8K workload (186 tokens in on average, 346
out, at most 512 out), cacheBlockSize 128, 64 GiB per card, int(3.4 x 2^30) bytes held at idle, memoryFraction 0.8;
blocksPerRequest.max = ceil(186/128) + ceil(512/128) = 6.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import pytest

from npuserve.planning.api import InferenceServiceSpec
from npuserve.planning.planner import plan

GIB = 2**30
CARD = 64 * GIB
IDLE = int(3.4 * GIB)
WORKLOAD = {"avgInputTokens": 186, "avgOutputTokens": 346, "maxOutputTokens": 512}


def spec_of(preset: str, quantization: dict[str, str] | None, **accelerator: Any) -> InferenceServiceSpec:
    model: dict[str, Any] = {"name": preset, "preset": preset, "weights": {"loadFormat": "dummy"}}
    if quantization is not None:
        model["quantization"] = quantization
    return InferenceServiceSpec.model_validate({
        "model": model, "accelerator": {"type": "ascend-910b3", **accelerator}, "workload": WORKLOAD})


def npu_mem_gib(weight_bytes: int, world_size: int) -> int:
    """floor((card - idle - weights / worldSize) x 0.8), in whole GiB (the guide's step 1)."""
    return math.floor((Fraction(CARD - IDLE) - Fraction(weight_bytes, world_size)) * Fraction(4, 5) / GIB)


# --- Qwen3-32B (dense), msModelSlim W8A8_DYNAMIC ----------------------------------------------------------------------
# config: 64 layers, hidden 5120, 64 heads and 8 KV heads of 128, intermediate 25600, vocab 151936, untied head.
# linear modules of one layer (out x in): q 8192x5120, k 1024x5120, v 1024x5120, o 5120x8192, gate and up
# 25600x5120, down 5120x25600 -> 41,943,040 + 2 x 5,242,880 + 41,943,040 + 3 x 131,072,000 = 487,587,840 parameters,
# 8192 + 1024 + 1024 + 5120 + 25600 + 25600 + 5120 = 71,680 output rows.
# bf16 per layer: 2 RMSNorms of 5120 + q_norm and k_norm of 128 = 10,496. Embeddings and head 2 x 151936 x 5120 =
# 1,555,824,640, final norm 5120.
QWEN3_32B_PARAMS = 64 * (487_587_840 + 10_496) + 1_555_824_640 + 5_120  # 32,762,123,264
QWEN3_32B_BF16 = 2 * QWEN3_32B_PARAMS  # 65,524,246,528 bytes = 61.02 GiB
QWEN3_32B_W8A8_DYNAMIC = 64 * (487_587_840 + 4 * 71_680 + 2 * 10_496) + 2 * (1_555_824_640 + 5_120)  # 34,336,974,848


def test_qwen3_32b_w8a8_dynamic_weights_and_the_smallest_world_size() -> None:
    assert QWEN3_32B_PARAMS == 32_762_123_264 and QWEN3_32B_W8A8_DYNAMIC == 34_336_974_848
    bf16 = plan(spec_of("qwen3-32b", None))
    w8a8 = plan(spec_of("qwen3-32b", {"format": "msmodelslim", "method": "w8a8_dynamic"}))

    assert bf16.weightsGiB == round(QWEN3_32B_BF16 / GIB, 3) == 61.024 and bf16.quantization == "none"
    assert w8a8.weightsGiB == round(QWEN3_32B_W8A8_DYNAMIC / GIB, 3) == 31.979
    assert w8a8.quantization == "msmodelslim W8A8_DYNAMIC"
    # bf16: 61.02 GiB leave 64 - 3.4 - 61.02 < 0 on one card -> 2 cards; W8A8: 28.6 GiB free on one card -> 1
    assert (bf16.worldSize, w8a8.worldSize) == (2, 1)
    assert w8a8.npuMemSizeGiB == npu_mem_gib(QWEN3_32B_W8A8_DYNAMIC, 1) == 22
    # the KV cache stays bf16: 2 (K, V) x 64 layers x 128 tokens x 8 KV heads x 128 x 2 bytes = 32 MiB a block
    assert w8a8.blockBytesPerCard == 2 * 64 * 128 * 8 * 128 * 2
    assert w8a8.totalBlocks == 22 * GIB // (32 * 2**20) == 704
    entry = w8a8.explained("weightsGiB")
    assert "msmodelslim W8A8_DYNAMIC" in entry.note and "4 bytes of scales per output row" in entry.note
    assert entry.inputs["quantizationSaving"] == QWEN3_32B_BF16 - QWEN3_32B_W8A8_DYNAMIC


def test_compressed_tensors_scales_are_bf16_two_bytes_a_row() -> None:
    # the same layers, 2 bytes a row (a bf16 weight_scale): 64 x (487,587,840 + 2 x 71,680 + 2 x 10,496) + bf16 rest
    expected = 64 * (487_587_840 + 2 * 71_680 + 2 * 10_496) + 2 * (1_555_824_640 + 5_120)
    got = plan(spec_of("qwen3-32b", {"format": "compressed-tensors", "method": "w8a8"}))
    assert got.weightsGiB == round(expected / GIB, 3)
    assert got.quantization == "compressed-tensors W8A8 (static)"


# --- Qwen3-235B-A22B (MoE), msModelSlim W8A8_DYNAMIC ------------------------------------------------------------------
# config: 94 layers, all MoE, hidden 4096, 64 heads and 4 KV heads of 128, 128 experts of 1536 (top 8), vocab 151936.
# attention: q 8192x4096, k and v 512x4096, o 4096x8192 = 71,303,168 parameters, 13,312 rows.
# one expert: gate and up 1536x4096, down 4096x1536 = 18,874,368 parameters, 7,168 rows; 128 of them.
# bf16 per layer: the router 128x4096 = 524,288, 2 RMSNorms of 4096 and q/k norms of 128 = 8,448.
# embeddings and head 2 x 151936 x 4096 = 1,244,659,712, final norm 4096.
QWEN3_235B_INT8 = 71_303_168 + 128 * 18_874_368  # 2,487,222,272 per layer
QWEN3_235B_ROWS = 13_312 + 128 * 7_168  # 930,816 per layer
QWEN3_235B_BF16 = 2 * (94 * (QWEN3_235B_INT8 + 524_288 + 8_448) + 1_244_659_712 + 4_096)  # 470,187,269,120
QWEN3_235B_W8A8_DYNAMIC = (94 * (QWEN3_235B_INT8 + 4 * QWEN3_235B_ROWS + 2 * (524_288 + 8_448))
                           + 2 * (1_244_659_712 + 4_096))  # 236,738,362,368


def test_qwen3_235b_a22b_w8a8_dynamic_halves_the_cards() -> None:
    assert QWEN3_235B_BF16 == 470_187_269_120 and QWEN3_235B_W8A8_DYNAMIC == 236_738_362_368
    bf16 = plan(spec_of("qwen3-235b-a22b", None))
    w8a8 = plan(spec_of("qwen3-235b-a22b", {"format": "msmodelslim", "method": "w8a8_dynamic"}))
    assert bf16.weightsGiB == round(QWEN3_235B_BF16 / GIB, 3) == 437.896
    assert w8a8.weightsGiB == round(QWEN3_235B_W8A8_DYNAMIC / GIB, 3) == 220.48
    # bf16 on 4 cards: 109.5 GiB a card > 64; on 8: 54.7 -> 4 GiB of KV. W8A8 on 2: 110.2 > 64; on 4: 55.1 -> 4 GiB
    assert (bf16.worldSize, w8a8.worldSize) == (8, 4)
    assert w8a8.npuMemSizeGiB == npu_mem_gib(QWEN3_235B_W8A8_DYNAMIC, 4) == 4
    # 4 KV heads over 4 cards: one a card, bf16: 2 x 94 x 128 x 1 x 128 x 2 bytes a block
    assert w8a8.blockBytesPerCard == 2 * 94 * 128 * 1 * 128 * 2 == 6_160_384
    assert w8a8.totalBlocks == 4 * GIB // 6_160_384


# --- DeepSeek-R1 (deepseek-v3 preset), msModelSlim W8A8 ---------------------------------------------------------------
# config: 61 layers (the first 3 dense, intermediate 18432), hidden 7168, 128 heads, MLA q_lora 1536, kv_lora 512,
# qk_nope 128, qk_rope 64, v 128; 256 routed experts of 2048 + 1 shared of 2048; vocab 129280.
# attention: q_a 1536x7168, q_b 24576x1536, kv_a 576x7168, kv_b 32768x512, o 7168x16384 = 11,010,048 + 37,748,736 +
#   4,128,768 + 16,777,216 + 117,440,512 = 187,105,280 parameters; 1536 + 24576 + 576 + 32768 + 7168 = 66,624 rows.
# dense MLP: gate and up 18432x7168, down 7168x18432 = 396,361,728 parameters, 44,032 rows.
# one expert (routed or shared): 3 x 2048 x 7168 = 44,040,192 parameters, 2048 + 2048 + 7168 = 11,264 rows.
# bf16: per layer the q_a and kv_a norms (1536 + 512) and 2 RMSNorms of 7168 = 16,384; per MoE layer the router
#   256x7168 + its 256 correction biases = 1,835,264; embeddings and head 2 x 129280 x 7168 = 1,853,358,080; norm 7168.
DSV3_INT8 = 3 * (187_105_280 + 396_361_728) + 58 * (187_105_280 + 257 * 44_040_192)  # 669,065,609,216
DSV3_ROWS = 3 * (66_624 + 44_032) + 58 * (66_624 + 257 * 11_264)  # 172,097,344
DSV3_BF16_PARAMS = 61 * 16_384 + 58 * 1_835_264 + 1_853_358_080 + 7_168  # 1,960,809,984
DSV3_W8A8 = DSV3_INT8 + 12 * DSV3_ROWS + 2 * DSV3_BF16_PARAMS  # 675,052,397,312 bytes = 628.69 GiB


def test_deepseek_r1_w8a8_on_910b3_is_mindies_two_nodes_of_eight() -> None:
    """MindIE's DeepSeek-R1 deployment guide (Ascend ModelZoo-PyTorch, MindIE/LLM/DeepSeek/DeepSeek-R1/README.md,
    https://gitee.com/ascend/ModelZoo-PyTorch, "硬件要求"): BF16 weights need at least 4 Atlas 800I A2 (8 x 64G)
    servers, W8A8 weights at least 2. On 910B3 cards (64 GiB, 8 a node) the planner gives the same: worldSize 16 over
    2 nodes for W8A8, 32 over 4 nodes for bf16."""
    assert DSV3_INT8 + DSV3_BF16_PARAMS == 671_026_419_200  # DeepSeek-V3's counted parameters (docs/planning.md)
    assert DSV3_W8A8 == 675_052_397_312
    bf16 = plan(spec_of("deepseek-v3", None))
    w8a8 = plan(spec_of("deepseek-v3", {"format": "msmodelslim", "method": "w8a8"}))
    assert (bf16.worldSize, bf16.nodes, bf16.cardsPerPod) == (32, 4, 8)
    assert w8a8.weightsGiB == round(DSV3_W8A8 / GIB, 3) == 628.692
    # 8 cards: 78.6 GiB a card > 64; 16 (the next count dividing the 128 heads and a whole number of nodes): 39.4
    assert (w8a8.worldSize, w8a8.nodes, w8a8.cardsPerPod) == (16, 2, 8)
    assert w8a8.quantization == "msmodelslim W8A8"
    assert w8a8.npuMemSizeGiB == npu_mem_gib(DSV3_W8A8, 16) == 17
    # the latent KV cache stays bf16: 61 layers x 128 tokens x (512 + 64) x 2 bytes, whole on each card
    assert w8a8.blockBytesPerCard == 61 * 128 * 576 * 2 == 8_994_816


def test_a_published_parameter_count_keeps_its_int8_share() -> None:
    # Qwen3-32B written inline with parameters 32.8 B (a published round figure): bytes = 32.8e9 x 2 - saving x
    # 32.8e9 / 32,762,123,264, the saving being the counted model's: 65,524,246,528 - 34,336,974,848 = 31,187,271,680
    arch = {"modelType": "qwen3", "numLayers": 64, "hiddenSize": 5120, "numAttentionHeads": 64,
            "numKeyValueHeads": 8, "headDim": 128, "intermediateSize": 25600, "vocabSize": 151936,
            "maxPositionEmbeddings": 40960, "parameters": 32_800_000_000}
    spec = InferenceServiceSpec.model_validate({
        "model": {"name": "q", "architecture": arch, "weights": {"loadFormat": "dummy"},
                  "quantization": {"format": "msmodelslim", "method": "w8a8_dynamic"}},
        "accelerator": {"type": "ascend-910b3"}, "workload": WORKLOAD})
    expected = Fraction(32_800_000_000 * 2) - Fraction(31_187_271_680 * 32_800_000_000, 32_762_123_264)
    got = plan(spec)
    assert got.weightsGiB == round(float(expected / GIB), 3)
    assert "scaled by numParameters / counted parameters" in got.explained("weightsGiB").note


def test_the_tpot_floor_reads_the_int8_weights() -> None:
    # Qwen3-32B W8A8_DYNAMIC on one card: a decode step reads every layer and the LM head, not the embedding table:
    # 34,336,974,848 - 151936 x 5120 x 2 = 32,781,150,208 bytes = 30.5 GiB
    spec = spec_of("qwen3-32b", {"format": "msmodelslim", "method": "w8a8_dynamic"})
    spec = spec.model_copy(update={"slo": spec.slo.model_copy(update={"objective": "decodeLatency", "tpotMs": 1})})
    (warning,) = [w for w in plan(spec).warnings if w.startswith("spec.slo.tpotMs")]
    assert f"{(QWEN3_32B_W8A8_DYNAMIC - 151936 * 5120 * 2) / GIB:.3g} GiB of the 31.979 GiB" in warning
    assert "30.5 GiB" in warning


@pytest.mark.parametrize("quantization, message", [
    ({"format": "msmodelslim", "method": "w4a8"}, "method"),
    ({"format": "gptq", "method": "w8a8"}, "format"),
    ({"format": "msmodelslim", "method": "w8a8", "kvCache": "int8"}, "kvCache"),
])
def test_spec_refuses_other_schemes_naming_the_field(quantization: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        spec_of("qwen3-32b", quantization)
