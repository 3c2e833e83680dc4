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
