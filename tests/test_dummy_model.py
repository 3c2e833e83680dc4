"""The dummy model folder is a real HF folder: transformers loads it, tokenizes, applies the chat template and
generates; sharded output carries a correct index."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from npuserve.catalog import MODEL_PRESETS, get_model_preset
from npuserve.engine.model.dummy import hf_weight_shapes, write_dummy_model
from npuserve.modelspec import ModelSpec


def test_transformers_loads_and_generates(tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert out.shape[1] == inputs.input_ids.shape[1] + 8
    assert tokenizer.decode(inputs.input_ids[0]) == "The capital of France is"
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token_id == 2 and tokenizer.bos_token_id == 1


def test_byte_fallback_encodes_any_text(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "日本語 and emoji 🚀 and tabs\t!"
    assert tokenizer.decode(tokenizer(text).input_ids) == text


def test_every_id_the_model_can_sample_decodes_to_text(tiny_model_dir: Path) -> None:
    """The tokenizer covers the model's vocabulary: a random model samples every id, and an id that decodes to
    nothing made client-side token counts of dummy-model benchmarks wrong (42% of the tiny model's ids did)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    vocab_size = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    assert len(tokenizer) == vocab_size
    special = set(tokenizer.all_special_ids) | {3, 4}  # pad, bos, eos and the chat markers
    empty = [i for i in range(vocab_size) if i not in special and not tokenizer.decode([i])]
    assert empty == []


def test_same_seed_same_weights(tmp_path: Path) -> None:
    a = write_dummy_model(get_model_preset("tiny"), tmp_path / "a", seed=7)
    b = write_dummy_model(get_model_preset("tiny"), tmp_path / "b", seed=7)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


@pytest.mark.parametrize("preset", ["qwen2.5-7b", "qwen3-8b", "mistral-7b"])
def test_each_architecture_loads_in_transformers(preset: str, tmp_path: Path) -> None:
    small = MODEL_PRESETS[preset].model_copy(
        update={"num_layers": 1, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 16, "intermediate_size": 96, "vocab_size": 512, "dtype": "float32"}
    )
    folder = write_dummy_model(small, tmp_path / preset)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert type(model).__name__ == json.loads((folder / "config.json").read_text())["architectures"][0]
    assert model.num_parameters() == small.num_parameters
    model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False)


def test_sharded_folder_has_a_correct_index(tmp_path: Path) -> None:
    spec = get_model_preset("tiny")
    folder = write_dummy_model(spec, tmp_path / "sharded", max_shard_bytes=400_000)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert set(index["weight_map"]) == {name for name, _ in hf_weight_shapes(spec)}
    total = 0
    for name, file in index["weight_map"].items():
        with safe_open(str(folder / file), "pt") as f:
            total += f.get_tensor(name).nbytes
    assert total == index["metadata"]["total_size"] == spec.weight_bytes
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.num_parameters() == spec.num_parameters
    assert ModelSpec.from_pretrained(folder).num_layers == spec.num_layers
