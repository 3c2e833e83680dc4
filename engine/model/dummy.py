"""Writes an HF-format model folder with random weights: config, safetensors (sharded past a size), tokenizer.

The folder is real in every way but the values of its weights, so it goes through the real loader, loads in
`transformers`, and stands in for models that cannot be downloaded here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from npuserve.engine.model.dummy_tokenizer import BOS_ID, EOS_ID, PAD_ID, write_tokenizer
from npuserve.engine.model.loader import TORCH_DTYPES
from npuserve.modelspec import ModelSpec

DEFAULT_MAX_SHARD_BYTES = 2 * 1000**3  # shard when over 2 GB, as transformers' save_pretrained does by default


def hf_weight_shapes(spec: ModelSpec) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every tensor of the HF checkpoint, by its HF name, in file order."""
    h, q, kv = spec.hidden_size, spec.q_size, spec.kv_size
    yield "model.embed_tokens.weight", (spec.vocab_size, h)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        if spec.mla is not None:
            yield from _mla_attention_shapes(spec, p)
        else:
            yield p + "self_attn.q_proj.weight", (q, h)
            yield p + "self_attn.k_proj.weight", (kv, h)
            yield p + "self_attn.v_proj.weight", (kv, h)
            if spec.attention_bias:
                yield p + "self_attn.q_proj.bias", (q,)
                yield p + "self_attn.k_proj.bias", (kv,)
                yield p + "self_attn.v_proj.bias", (kv,)
            if spec.qk_norm:
                yield p + "self_attn.q_norm.weight", (spec.head_dim,)
                yield p + "self_attn.k_norm.weight", (spec.head_dim,)
            yield p + "self_attn.o_proj.weight", (h, q)
        yield p + "post_attention_layernorm.weight", (h,)
        yield from _mlp_shapes(spec, i, p)
    yield "model.norm.weight", (h,)
    if not spec.tie_word_embeddings:
        yield "lm_head.weight", (spec.vocab_size, h)


def _mla_attention_shapes(spec: ModelSpec, p: str) -> Iterator[tuple[str, tuple[int, ...]]]:
    """DeepSeek's latent attention, as transformers' DeepseekV2/V3Attention names it."""
    mla, h, heads, bias = spec.mla, spec.hidden_size, spec.num_attention_heads, spec.attention_bias
    assert mla is not None
    if mla.q_lora_rank is None:
        yield p + "self_attn.q_proj.weight", (heads * mla.qk_head_dim, h)
    else:
        yield p + "self_attn.q_a_proj.weight", (mla.q_lora_rank, h)
        if bias:
            yield p + "self_attn.q_a_proj.bias", (mla.q_lora_rank,)
        yield p + "self_attn.q_a_layernorm.weight", (mla.q_lora_rank,)
        yield p + "self_attn.q_b_proj.weight", (heads * mla.qk_head_dim, mla.q_lora_rank)
    yield p + "self_attn.kv_a_proj_with_mqa.weight", (mla.cache_dim, h)
    if bias:
        yield p + "self_attn.kv_a_proj_with_mqa.bias", (mla.cache_dim,)
    yield p + "self_attn.kv_a_layernorm.weight", (mla.kv_lora_rank,)
    yield p + "self_attn.kv_b_proj.weight", (heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank)
    yield p + "self_attn.o_proj.weight", (h, heads * mla.v_head_dim)
    if bias:
        yield p + "self_attn.o_proj.bias", (h,)


def _mlp_shapes(spec: ModelSpec, index: int, p: str) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Layer `index`'s MLP tensors: dense, or the MoE block's (router, each routed expert, the shared expert) in
    the per-expert naming of the published checkpoints and of transformers' `save_pretrained`."""
    h, moe = spec.hidden_size, spec.moe
    if moe is None or not moe.is_moe_layer(index):
        yield p + "mlp.gate_proj.weight", (spec.intermediate_size, h)
        yield p + "mlp.up_proj.weight", (spec.intermediate_size, h)
        yield p + "mlp.down_proj.weight", (h, spec.intermediate_size)
        return
    inter = moe.moe_intermediate_size
    yield p + "mlp.gate.weight", (moe.num_experts, h)
    if moe.e_score_correction_bias:
        yield p + "mlp.gate.e_score_correction_bias", (moe.num_experts,)
    for e in range(moe.num_experts):
        yield p + f"mlp.experts.{e}.gate_proj.weight", (inter, h)
        yield p + f"mlp.experts.{e}.up_proj.weight", (inter, h)
        yield p + f"mlp.experts.{e}.down_proj.weight", (h, inter)
    shared, name = moe.shared_expert_intermediate_size, "shared_expert" if spec.model_type == "qwen2_moe" \
        else "shared_experts"
    if shared:
        yield p + f"mlp.{name}.gate_proj.weight", (shared, h)
        yield p + f"mlp.{name}.up_proj.weight", (shared, h)
        yield p + f"mlp.{name}.down_proj.weight", (h, shared)
    if moe.shared_expert_gate:
        yield p + "mlp.shared_expert_gate.weight", (1, h)


def _random_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator, std: float) -> torch.Tensor:
    if name.endswith("norm.weight"):
        # Norm scales near one, not exactly: a loader that drops or swaps a norm still changes the output.
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    return torch.randn(shape, generator=gen) * std


def write_dummy_model(
    spec: ModelSpec,
    out: str | Path,
    seed: int = 0,
    init_std: float = 0.02,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Writes the folder and returns its path. Tensors are made one shard at a time to bound host memory."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    # The tokenizer is ours, so the special ids are ours too, whatever the preset's real ids were.
    spec = spec.model_copy(update={"bos_token_id": BOS_ID, "eos_token_id": EOS_ID})
    dtype = TORCH_DTYPES[spec.dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()

    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    shard_bytes = 0
    for name, shape in hf_weight_shapes(spec):
        nbytes = itemsize * _numel(shape)
        if shards[-1] and shard_bytes + nbytes > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append((name, shape))
        shard_bytes += nbytes

    gen = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    total_bytes = 0
    for index, shard in enumerate(shards, start=1):
        filename = "model.safetensors" if len(shards) == 1 else f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: _random_tensor(name, shape, gen, init_std).to(dtype) for name, shape in shard}
        save_file(tensors, str(folder / filename), metadata={"format": "pt"})
        for name, tensor in tensors.items():
            weight_map[name] = filename
            total_bytes += tensor.numel() * tensor.element_size()
        del tensors
    if len(shards) > 1:
        index_doc = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index_doc, indent=2) + "\n")

    (folder / "config.json").write_text(json.dumps(spec.to_hf_config(), indent=2) + "\n")
    generation = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID, "do_sample": False}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    write_tokenizer(folder, spec.vocab_size, spec.max_position_embeddings)
    return folder


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n
