"""Model, loader, backend and KV sizing: sharded and single-file checkpoints load to the same weights, fused
projections hold the HF tensors at their offsets, dummy weights need no files, broken checkpoints are refused,
the rope tables equal transformers', and KV sizing follows npuMemSize or the CPU's auto cap."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from safetensors.torch import load_file, save_file  # noqa: E402

from npuserve.catalog.models import get_model_preset  # noqa: E402
from npuserve.engine.backends import get_backend  # noqa: E402
from npuserve.engine.model.dummy import write_dummy_model  # noqa: E402
from npuserve.engine.model.loader import WeightLoadError, build_model, load_model  # noqa: E402
from npuserve.engine.runner import GiB, plan_kv_blocks  # noqa: E402
from npuserve.modelspec import ModelSpec  # noqa: E402

CPU = torch.device("cpu")


def test_sharded_checkpoint_equals_single_file(tmp_path: Path) -> None:
    spec = get_model_preset("tiny")
    single = write_dummy_model(spec, tmp_path / "single", seed=4)
    sharded = write_dummy_model(spec, tmp_path / "sharded", seed=4, max_shard_bytes=300_000)
    assert (sharded / "model.safetensors.index.json").exists()
    a = load_model(ModelSpec.from_pretrained(single), single, torch.float32, CPU)
    b = load_model(ModelSpec.from_pretrained(sharded), sharded, torch.float32, CPU)
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(pa, pb), name


def test_fused_projections_hold_hf_tensors(tmp_path: Path) -> None:
    spec = get_model_preset("tiny").model_copy(update={"model_type": "qwen2", "attention_bias": True})
    folder = write_dummy_model(spec, tmp_path / "q", seed=1)
    model = load_model(ModelSpec.from_pretrained(folder), folder, torch.float32, CPU)
    hf = load_file(str(folder / "model.safetensors"))
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    q, kv = spec.q_size, spec.kv_size
    assert torch.equal(attn.qkv_proj.weight[q : q + kv], hf["model.layers.1.self_attn.k_proj.weight"])
    assert torch.equal(attn.qkv_proj.bias[q + kv :], hf["model.layers.1.self_attn.v_proj.bias"])
    assert torch.equal(mlp.gate_up_proj.weight[spec.intermediate_size :], hf["model.layers.1.mlp.up_proj.weight"])


def test_tied_embeddings_share_the_head(tmp_path: Path) -> None:
    spec = get_model_preset("tiny").model_copy(update={"tie_word_embeddings": True})
    folder = write_dummy_model(spec, tmp_path / "t", seed=1)
    model = load_model(ModelSpec.from_pretrained(folder), folder, torch.float32, CPU)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_missing_tensor_is_refused(tmp_path: Path) -> None:
    folder = write_dummy_model(get_model_preset("tiny"), tmp_path / "m", seed=1)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(WeightLoadError, match="gate_up_proj"):
        load_model(ModelSpec.from_pretrained(folder), folder, torch.float32, CPU)


def test_dummy_load_format_reads_no_files() -> None:
    model = load_model(get_model_preset("tiny"), None, torch.float32, CPU, load_format="dummy", seed=1)
    w = model.model.layers[0].self_attn.qkv_proj.weight
    assert torch.isfinite(w).all() and w.std() > 0


def test_every_tensor_of_a_built_model_is_on_its_device() -> None:
    """The rope tables are recomputed on the host after the meta build; they must follow the model to its device,
    or the CUDA kernels are handed a host pointer (the first GPU run failed so). `meta` stands in for a device that
    is not the host."""
    meta = torch.device("meta")
    model = build_model(get_model_preset("tiny"), torch.float32, meta)
    placed = {name: t.device for name, t in [*model.named_parameters(), *model.named_buffers()]}
    assert "model.rotary.cos" in placed
    assert {name: d for name, d in placed.items() if d != meta} == {}


def test_llama3_rope_matches_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    from npuserve.engine.model.layers import RotaryEmbedding

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    ours = RotaryEmbedding(128, 32, 500000.0, scaling)
    config = transformers.LlamaConfig(head_dim=128, hidden_size=4096, num_attention_heads=32, rope_theta=500000.0,
                                      rope_scaling=scaling, max_position_embeddings=131072)
    theirs = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    pos = torch.arange(32).unsqueeze(0)
    cos, _ = theirs(torch.zeros(1, 32, 128), pos)
    assert torch.allclose(ours.cos, cos[0, :, :64], atol=1e-5)


def test_kv_sizing() -> None:
    spec = get_model_preset("tiny")
    backend = get_backend("cpu")
    per_block = spec.kv_bytes_per_block(16, dtype="float32")
    assert per_block == 2 * spec.num_layers * 16 * spec.num_key_value_heads * spec.head_dim * 4
    fixed = plan_kv_blocks(spec, backend, block_size=16, dtype=torch.float32, npu_mem_size_gib=1,
                           cpu_mem_size_gib=0, max_batch_size=4, max_seq_len=64)
    assert fixed.num_blocks == GiB // per_block and fixed.num_host_blocks == 0
    auto = plan_kv_blocks(spec, backend, block_size=16, dtype=torch.float32, npu_mem_size_gib=-1,
                          cpu_mem_size_gib=5, max_batch_size=4, max_seq_len=64)
    assert auto.num_blocks == 4 * (64 // 16 + 1)  # what maxBatchSize x maxSeqLen can use, not host memory
    assert auto.num_host_blocks == auto.num_blocks
    assert json.dumps(auto.source)
