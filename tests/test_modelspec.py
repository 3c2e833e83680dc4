import json
from pathlib import Path

import pytest

from npuserve.catalog import MODEL_PRESETS
from npuserve.modelspec import ModelSpec, UnsupportedModelError


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
def test_hf_config_round_trip(name: str) -> None:
    spec = MODEL_PRESETS[name]
    assert ModelSpec.from_hf_config(spec.to_hf_config()) == spec


def test_head_dim_defaults_to_hidden_over_heads() -> None:
    config = MODEL_PRESETS["llama2-7b"].to_hf_config()
    del config["head_dim"]
    assert ModelSpec.from_hf_config(config).head_dim == 4096 // 32


def test_num_key_value_heads_defaults_to_heads() -> None:
    config = MODEL_PRESETS["llama2-7b"].to_hf_config()
    del config["num_key_value_heads"]
    assert ModelSpec.from_hf_config(config).num_key_value_heads == 32


def test_qwen2_has_qkv_bias_and_qwen3_has_qk_norm() -> None:
    assert ModelSpec.from_hf_config(MODEL_PRESETS["qwen2.5-7b"].to_hf_config()).attention_bias
    qwen3 = ModelSpec.from_hf_config(MODEL_PRESETS["qwen3-8b"].to_hf_config())
    assert qwen3.qk_norm and not qwen3.attention_bias


def test_unknown_model_type_is_named() -> None:
    config = MODEL_PRESETS["llama3-8b"].to_hf_config() | {"model_type": "gpt_neox"}
    with pytest.raises(UnsupportedModelError, match="'gpt_neox'"):
        ModelSpec.from_hf_config(config)


def test_mistral_sliding_window_is_refused() -> None:
    config = MODEL_PRESETS["mistral-7b"].to_hf_config() | {"sliding_window": 4096}
    with pytest.raises(UnsupportedModelError, match="sliding_window"):
        ModelSpec.from_hf_config(config)


def test_kv_bytes_per_block_splits_heads_and_replicates_when_fewer_than_cards() -> None:
    spec = MODEL_PRESETS["llama3-8b"]  # 8 kv heads, 32 layers, head 128, bf16
    assert spec.kv_bytes_per_block(128, 1) == 2 * 32 * 128 * 8 * 128 * 2
    assert spec.kv_bytes_per_block(128, 2) == 2 * 32 * 128 * 4 * 128 * 2
    assert spec.kv_bytes_per_block(128, 16) == 2 * 32 * 128 * 1 * 128 * 2  # replicated: one head per card


def test_from_pretrained_reads_the_folder(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(MODEL_PRESETS["qwen3-8b"].to_hf_config()))
    assert ModelSpec.from_pretrained(tmp_path) == MODEL_PRESETS["qwen3-8b"]
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        ModelSpec.from_pretrained(tmp_path / "missing")


# --- MoE and MLA: the configs transformers itself writes, and the published ones -------------------------------------

transformers = pytest.importorskip("transformers")


def _written_by_transformers(config_class: str, **fields: object) -> dict[str, object]:
    """The config.json `save_pretrained` writes for a small model of this class."""
    config = getattr(transformers, config_class)(**fields)
    return json.loads(config.to_json_string())  # type: ignore[no-any-return]


def test_qwen3_moe_config_written_by_transformers() -> None:
    config = _written_by_transformers(
        "Qwen3MoeConfig", hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[3], vocab_size=256, rope_theta=1e6)
    spec = ModelSpec.from_hf_config(config)
    assert spec.moe is not None and spec.mla is None
    assert (spec.moe.num_experts, spec.moe.num_experts_per_tok, spec.moe.moe_intermediate_size) == (8, 2, 32)
    assert spec.moe.norm_topk_prob and spec.qk_norm and spec.rope_theta == 1e6
    # (i + 1) % 2 == 0 gives layers 1 and 3; 3 is MLP-only (Qwen3MoeDecoderLayer's rule)
    assert spec.moe_layers == [1]
    assert ModelSpec.from_hf_config(spec.to_hf_config()) == spec


def test_deepseek_v3_config_written_by_transformers() -> None:
    config = _written_by_transformers(
        "DeepseekV3Config", hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
        topk_group=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=48, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, vocab_size=256,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "rope_theta": 10000.0})
    spec = ModelSpec.from_hf_config(config)
    assert spec.moe is not None and spec.mla is not None
    assert (spec.moe.scoring_func, spec.moe.topk_method, spec.moe.n_group, spec.moe.topk_group) == (
        "sigmoid", "noaux_tc", 4, 2)
    assert spec.moe.routed_scaling_factor == 2.5 and spec.moe.norm_topk_prob  # the config class's defaults
    assert spec.moe.shared_expert_intermediate_size == 32 and spec.moe_layers == [1, 2]
    assert spec.head_dim == 24 and spec.num_key_value_heads == 4  # qk head (16 + 8); transformers' head_dim=8 ignored
    assert spec.rope_scaling is not None and spec.rope_scaling["factor"] == 4.0
    # the latent cache: 3 layers x 16 tokens x (32 + 8) x 4 bytes, the same on every card
    assert spec.kv_bytes_per_block(16, world_size=1, dtype="float32") == 3 * 16 * 40 * 4
    assert spec.kv_bytes_per_block(16, world_size=4, dtype="float32") == 3 * 16 * 40 * 4
    assert ModelSpec.from_hf_config(spec.to_hf_config()) == spec


def test_deepseek_v2_lite_config_has_no_q_lora_and_greedy_softmax_routing() -> None:
    config = _written_by_transformers(
        "DeepseekV2Config", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
        moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2,
        first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, vocab_size=256)
    spec = ModelSpec.from_hf_config(config)
    assert spec.mla is not None and spec.mla.q_lora_rank is None and spec.mla.rope_interleave
    assert spec.moe is not None and (spec.moe.scoring_func, spec.moe.topk_method) == ("softmax", "greedy")
    assert spec.moe.shared_expert_intermediate_size == 64 and not spec.moe.norm_topk_prob


def test_published_deepseek_v3_config_parses_to_the_preset() -> None:
    # deepseek-ai/DeepSeek-V3 config.json (HF key names, ../shared/notes/moe-mla-lws.md), bf16-converted
    config = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
        "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
        "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
        "scoring_func": "sigmoid", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 129280, "bos_token_id": 0,
        "eos_token_id": 1, "num_nextn_predict_layers": 1,
    }
    assert ModelSpec.from_hf_config(config) == MODEL_PRESETS["deepseek-v3"]


def test_fp8_checkpoints_are_refused_with_the_bf16_advice() -> None:
    config = MODEL_PRESETS["deepseek-v3"].to_hf_config()
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": [128, 128]}
    with pytest.raises(UnsupportedModelError, match=r"FP8.*bf16"):
        ModelSpec.from_hf_config(config)


def test_other_quantization_is_refused_by_name() -> None:
    config = MODEL_PRESETS["qwen3-30b-a3b"].to_hf_config()
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    with pytest.raises(UnsupportedModelError, match="'awq'"):
        ModelSpec.from_hf_config(config)


@pytest.mark.parametrize(("field", "value", "named"), [
    ("moe_layer_freq", 2, "moe_layer_freq 2"),
    ("topk_method", "group_limited_greedy_v9", "topk_method"),
])
def test_unimplemented_deepseek_moe_variants_are_refused_by_name(field: str, value: object, named: str) -> None:
    config = MODEL_PRESETS["deepseek-v3"].to_hf_config()
    config[field] = value
    with pytest.raises(UnsupportedModelError, match=named):
        ModelSpec.from_hf_config(config)


def test_unknown_rope_scaling_is_refused_by_name() -> None:
    config = MODEL_PRESETS["qwen3-8b"].to_hf_config()
    config["rope_scaling"] = {"rope_type": "longrope", "factor": 4.0}
    with pytest.raises(UnsupportedModelError, match="'longrope'"):
        ModelSpec.from_hf_config(config)


def test_an_moe_config_without_its_experts_is_refused() -> None:
    config = MODEL_PRESETS["qwen3-30b-a3b"].to_hf_config()
    config["num_experts_per_tok"] = 200
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok"):
        ModelSpec.from_hf_config(config)
