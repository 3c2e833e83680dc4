"""DeepSeek (latent attention, MoE layers) under tensor parallel on the CPU (gloo): the heads split over the ranks,
the latent replicated (every rank writes the whole latent into its own caches); worldSize 2 generates what worldSize 1
does, in the engine (with prefix hits, chunked prefill and swap preemption), through `npuserve generate` and through
`npuserve serve`. Also: each rank reads only its heads' rows and columns, the MTP layer's tensors are skipped.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from npuserve.catalog.models import get_model_preset  # noqa: E402
from npuserve.engine.engine import LLMEngine  # noqa: E402
from npuserve.engine.model.dummy import write_dummy_model  # noqa: E402
from npuserve.engine.model.loader import build_model, load_hf_weights  # noqa: E402
from npuserve.engine.parallel.layout import TPLayout  # noqa: E402
from npuserve.engine.sequence import SamplingParams  # noqa: E402
from npuserve.modelspec import ModelSpec  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_correctness import prefix_sharing_run  # noqa: E402
from test_deepseek_correctness import prompts, write_hf_checkpoint  # noqa: E402
from test_tensor_parallel import tp_engine  # noqa: E402

from tests.world_size_2 import generate_world_size_2, in_process, serve_world_size_2  # noqa: E402

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def dummy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dummy_model(get_model_preset("tiny-deepseek-v3"), tmp_path_factory.mktemp("dsv3"), seed=3,
                             init_std=0.3)


@pytest.fixture(scope="module")
def v3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_checkpoint("v3", tmp_path_factory.mktemp("hf-v3"))


def test_the_layout_splits_mla_heads_and_replicates_the_latent() -> None:
    spec = get_model_preset("tiny-deepseek-v3")  # 4 heads; qk 32 + 16, v 32; q_lora 96, kv_lora 64
    r1 = TPLayout.of(spec, 1, 2)
    assert r1.hf_slice("model.layers.0.self_attn.q_b_proj.weight") == (0, 2 * 48, 2 * 48)
    assert r1.hf_slice("model.layers.0.self_attn.kv_b_proj.weight") == (0, 2 * 64, 2 * 64)
    assert r1.hf_slice("model.layers.0.self_attn.o_proj.weight") == (1, 2 * 32, 2 * 32)
    for replicated in ("q_a_proj.weight", "q_a_layernorm.weight", "kv_a_proj_with_mqa.weight",
                       "kv_a_layernorm.weight"):
        assert r1.hf_slice(f"model.layers.0.self_attn.{replicated}") is None
    # every rank holds the whole latent: a block costs the same whatever the ranks
    assert spec.kv_bytes_per_block(4, world_size=2) == spec.kv_bytes_per_block(4, world_size=1)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_loads_its_heads_of_a_transformers_checkpoint(v3_dir: Path, rank: int) -> None:
    spec = ModelSpec.from_pretrained(v3_dir)  # 4 heads, nope 16, rope 8, v 16
    whole = build_model(spec, torch.float32, CPU)
    load_hf_weights(whole, v3_dir)
    part = build_model(spec, torch.float32, CPU, TPLayout.of(spec, rank, 2))
    load_hf_weights(part, v3_dir)
    w, p = dict(whole.named_parameters()), dict(part.named_parameters())
    attn = "model.layers.1.self_attn."
    assert torch.equal(p[attn + "q_b_proj.weight"], w[attn + "q_b_proj.weight"][rank * 48:(rank + 1) * 48])
    assert torch.equal(p[attn + "kv_b_proj.weight"], w[attn + "kv_b_proj.weight"][rank * 64:(rank + 1) * 64])
    assert torch.equal(p[attn + "o_proj.weight"], w[attn + "o_proj.weight"][:, rank * 32:(rank + 1) * 32])
    assert torch.equal(p[attn + "kv_a_proj_with_mqa.weight"], w[attn + "kv_a_proj_with_mqa.weight"])
    assert torch.equal(p[attn + "q_a_proj.weight"], w[attn + "q_a_proj.weight"])


def test_the_mtp_layer_is_skipped(v3_dir: Path, tmp_path: Path) -> None:
    """V3/R1 checkpoints carry the multi-token-prediction layer as `model.layers.{num_hidden_layers}`: not served,
    its tensors are not read."""
    tensors = load_file(str(v3_dir / "model.safetensors"))
    spec = ModelSpec.from_pretrained(v3_dir)
    mtp = f"model.layers.{spec.num_layers}."
    extra = {name.replace("model.layers.1.", mtp): t.clone() for name, t in tensors.items()
             if name.startswith("model.layers.1.")}
    extra[mtp + "eh_proj.weight"] = torch.zeros(spec.hidden_size, 2 * spec.hidden_size)
    extra[mtp + "enorm.weight"] = torch.ones(spec.hidden_size)
    extra[mtp + "shared_head.head.weight"] = torch.zeros(spec.vocab_size, spec.hidden_size)
    save_file({**tensors, **extra}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((v3_dir / "config.json").read_text())
    with_mtp, plain = build_model(spec, torch.float32, CPU), build_model(spec, torch.float32, CPU)
    load_hf_weights(with_mtp, tmp_path)
    load_hf_weights(plain, v3_dir)
    for (name, a), (_, b) in zip(with_mtp.named_parameters(), plain.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def _workload(engine: LLMEngine) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(prompts(), GREEDY)] + prefix_sharing_run(engine, GREEDY)


def test_world_size_2_generates_what_world_size_1_does(dummy_dir: Path) -> None:
    results: dict[int, list[object]] = {1: [], 2: []}
    for world_size in (1, 2):
        engine = tp_engine(dummy_dir, world_size)
        try:
            results[world_size].append(_workload(engine))
        finally:
            engine.close()
        squeezed = tp_engine(dummy_dir, world_size, kv_blocks=30, maxPreemptCount=8, maxPrefillTokens=6,
                           extensions={"chunkedPrefill": True})
        try:
            outs = squeezed.generate(prompts(), SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
            assert squeezed.scheduler.num_preemptions_total > 0 and squeezed.runner._host_kv_caches is not None
            results[world_size].append([o.token_ids for o in outs])
        finally:
            squeezed.close()
    assert results[2] == results[1]


TEXTS = ["the quick brown fox", "a", "latent attention over two ranks", "hello world, again"]


def test_npuserve_generate_with_world_size_2(dummy_dir: Path, tmp_path: Path) -> None:
    tokens, _ = generate_world_size_2(dummy_dir, TEXTS, tmp_path)
    assert tokens == [t for t, _ in in_process(dummy_dir, TEXTS)]


def test_npuserve_serve_with_world_size_2(dummy_dir: Path) -> None:
    assert serve_world_size_2(dummy_dir, TEXTS) == [(len(t), text) for t, text in in_process(dummy_dir, TEXTS)]
