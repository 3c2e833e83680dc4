"""Greedy output of the engine's Qwen3-MoE and Qwen2-MoE equals transformers' greedy `generate`, token for token.

Three checkpoints: a Qwen3-MoE written by transformers itself (`Qwen3MoeForCausalLM(config).save_pretrained`), one
written by our `create-dummy` writer, and a Qwen2-MoE written by transformers (qkv bias, a shared expert with its
sigmoid gate). Dense and MoE layers are mixed (mlp_only_layers, decoder_sparse_step). The correctness suite's
patterns: 8 prompts of different lengths as one continuous batch with block size 4, prefix-cache hits, forced
preemptions (recompute, swap); then tensor parallel (worldSize 2) in the engine, through `npuserve generate`
and `npuserve serve`. Float32, weights of std 0.3 (norm scales near 1) so argmax is not fragile.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from npuserve.engine.engine import LLMEngine  # noqa: E402
from npuserve.engine.model.dummy import write_dummy_model  # noqa: E402
from npuserve.engine.model.dummy_tokenizer import write_tokenizer  # noqa: E402
from npuserve.engine.model.loader import build_model, init_dummy_weights, load_hf_weights  # noqa: E402
from npuserve.engine.model.moe import SparseMoeBlock  # noqa: E402
from npuserve.engine.parallel.layout import TensorParallelLayoutError, TPLayout  # noqa: E402
from npuserve.mindie_config import EngineEnvironment, minimal_config  # noqa: E402
from npuserve.modelspec import ModelSpec  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_correctness import GREEDY, make_engine, prefix_sharing_run, prompts, reference, sharing_prompts  # noqa: E402

from tests.world_size_2 import generate_world_size_2, in_process, serve_world_size_2  # noqa: E402

CPU = torch.device("cpu")
NPUSERVE = str(Path(sys.executable).parent / "npuserve")
SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5,
             tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2)


def _randomise(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            value = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * value if name.endswith("norm.weight") else 0.3 * value)


def _save_transformers(kind: str, folder: Path) -> Path:
    if kind == "qwen3_moe":  # layers: MoE, dense (mlp_only_layers), MoE
        config = transformers.Qwen3MoeConfig(**SHAPE, num_hidden_layers=3, norm_topk_prob=True, mlp_only_layers=[1])
        model = transformers.Qwen3MoeForCausalLM(config)
    else:  # layers: dense, MoE, dense, MoE (decoder_sparse_step 2); shared expert and its gate; no renormalisation
        config = transformers.Qwen2MoeConfig(**SHAPE, num_hidden_layers=4, norm_topk_prob=False,
                                             decoder_sparse_step=2, shared_expert_intermediate_size=48)
        model = transformers.Qwen2MoeForCausalLM(config)
    _randomise(model, seed=11)
    model.save_pretrained(folder)
    write_tokenizer(folder, config.vocab_size, config.max_position_embeddings)
    return folder


def _dummy_spec() -> ModelSpec:
    return ModelSpec(model_type="qwen3_moe", num_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, intermediate_size=96, vocab_size=512, max_position_embeddings=512, dtype="float32",
                     rms_norm_eps=1e-5, qk_norm=True,
                     moe={"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                          "norm_topk_prob": True, "mlp_only_layers": (2,)})


@pytest.fixture(scope="module", params=["qwen3_moe-transformers", "qwen3_moe-create-dummy", "qwen2_moe-transformers"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen3_moe-create-dummy":
        return write_dummy_model(_dummy_spec(), folder, seed=3, init_std=0.3)
    return _save_transformers(request.param.split("-")[0], folder)


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> object:
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_the_checkpoint_builds_the_moe_layers_it_declares(model_dir: Path) -> None:
    spec = ModelSpec.from_pretrained(model_dir)
    assert spec.moe is not None and 0 < len(spec.moe_layers) < spec.num_layers  # MoE and dense layers mixed
    model = build_model(spec, torch.float32, CPU)
    load_hf_weights(model, model_dir)
    moe_layers = [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, SparseMoeBlock)]
    assert moe_layers == spec.moe_layers


def test_one_continuous_batch_matches_transformers(model_dir: Path, hf_model: object) -> None:
    batch = prompts()
    engine = make_engine(model_dir)
    outs = engine.generate(batch, GREEDY)
    assert [o.token_ids for o in outs] == reference(hf_model, batch)
    assert all(o.metrics["prefill_batch_size"] == len(batch) for o in outs)
    assert engine.kv.num_used_blocks == 0


def test_prefix_cache_hits_match_transformers(model_dir: Path, hf_model: object) -> None:
    assert prefix_sharing_run(make_engine(model_dir)) == reference(hf_model, sharing_prompts())


@pytest.mark.parametrize("preempt", ["recompute", "swap"])
def test_preemption_matches_transformers(model_dir: Path, hf_model: object, preempt: str) -> None:
    batch = prompts()
    engine = make_engine(model_dir, kv_blocks=40, threshold=0.99, maxPreemptCount=8 if preempt == "swap" else 0)
    outs = engine.generate(batch, GREEDY)
    assert engine.scheduler.num_preemptions_total > 0
    if preempt == "swap":
        assert engine.runner._host_kv_caches is not None
    assert [o.token_ids for o in outs] == reference(hf_model, batch)
    assert engine.kv.num_used_blocks == 0


def test_an_moe_model_decodes_eagerly_on_a_backend_with_graphs(model_dir: Path) -> None:
    """The reference experts read their token counts on the host, which a captured graph cannot: the runner leaves
    decode graphs off for an MoE model unless the backend says its experts can be captured."""
    from test_decode_graphs import FakeGraphCPUBackend

    from npuserve.engine.runner import KVPlan, ModelRunner

    spec = ModelSpec.from_pretrained(model_dir)
    model = build_model(spec, torch.float32, CPU)
    load_hf_weights(model, model_dir)
    plan = KVPlan(16, 0, 4, 0, "test")
    assert ModelRunner(model, FakeGraphCPUBackend(), plan, torch.float32, graph_batch_size=4,
                       max_seq_len=64).decode_graphs is None
    capturable = FakeGraphCPUBackend()
    capturable.moe_in_decode_graphs = True
    assert ModelRunner(model, capturable, plan, torch.float32, graph_batch_size=4,
                       max_seq_len=64).decode_graphs is not None


def test_create_dummy_writes_a_folder_transformers_loads(tmp_path: Path) -> None:
    run = subprocess.run([NPUSERVE, "model", "create-dummy", "--preset", "tiny-qwen3-moe", "--out",
                          str(tmp_path / "m"), "--init-std", "0.3"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    model = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    spec = ModelSpec.from_pretrained(tmp_path / "m")
    ours = build_model(spec, torch.float32, CPU)
    load_hf_weights(ours, tmp_path / "m")
    theirs = model.model.layers[1].mlp.experts
    assert torch.equal(ours.model.layers[1].mlp.experts.w13, theirs.gate_up_proj)
    assert torch.equal(ours.model.layers[1].mlp.experts.w2, theirs.down_proj)


def test_the_fused_layout_of_transformers_state_dict_loads_too(model_dir: Path, tmp_path: Path) -> None:
    """transformers keeps the experts fused in memory (`mlp.experts.gate_up_proj` (E, 2I, H), `down_proj`
    (E, H, I)); a checkpoint saved from its state dict as it is loads into the same weights, whole and per rank."""
    from safetensors.torch import save_file

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight" or
             not hf.config.tie_word_embeddings}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((model_dir / "config.json").read_text())
    spec = ModelSpec.from_pretrained(model_dir)
    for layout in (None, TPLayout.of(spec, 1, 2)):
        fused, per_expert = build_model(spec, torch.float32, CPU, layout), build_model(spec, torch.float32, CPU, layout)
        load_hf_weights(fused, tmp_path)
        load_hf_weights(per_expert, model_dir)
        for (name, a), (_, b) in zip(fused.named_parameters(), per_expert.named_parameters(), strict=True):
            assert torch.equal(a, b), name


# --- tensor parallel -----------------------------------------------------------------------------------------------


def test_a_world_size_that_does_not_divide_the_experts_is_refused_by_name() -> None:
    spec = _dummy_spec().model_copy(update={"moe": _dummy_spec().moe.model_copy(  # type: ignore[union-attr]
        update={"moe_intermediate_size": 36})})
    with pytest.raises(TensorParallelLayoutError, match="moe_intermediate_size 36"):
        TPLayout.of(spec, 0, 8)
    assert TPLayout.of(spec, 1, 2).moe_intermediate == 18


def test_a_rank_holds_every_experts_slice_and_random_weights_are_the_whole_models(model_dir: Path) -> None:
    spec = ModelSpec.from_pretrained(model_dir)
    layer = f"model.layers.{spec.moe_layers[0]}.mlp."
    inter, half = spec.moe.moe_intermediate_size, spec.moe.moe_intermediate_size // 2  # type: ignore[union-attr]
    for fill in ("checkpoint", "dummy"):
        whole = build_model(spec, torch.float32, CPU)
        part = build_model(spec, torch.float32, CPU, TPLayout.of(spec, 1, 2))
        for model in (whole, part):
            load_hf_weights(model, model_dir) if fill == "checkpoint" else init_dummy_weights(model, seed=5)
        w, p = dict(whole.named_parameters()), dict(part.named_parameters())
        w13 = w[layer + "experts.w13"]
        assert torch.equal(p[layer + "experts.w13"], torch.cat([w13[:, half:inter], w13[:, inter + half:]], dim=1))
        assert torch.equal(p[layer + "experts.w2"], w[layer + "experts.w2"][:, :, half:])
        assert torch.equal(p[layer + "gate.weight"], w[layer + "gate.weight"])  # the router is replicated
        if spec.moe.shared_expert_intermediate_size:  # type: ignore[union-attr]
            shared = w[layer + "shared_expert.down_proj.weight"]
            assert torch.equal(p[layer + "shared_expert.down_proj.weight"], shared[:, shared.shape[1] // 2:])
            assert torch.equal(p[layer + "shared_expert_gate.weight"], w[layer + "shared_expert_gate.weight"])


def _tp_engine(model_dir: Path, world_size: int) -> LLMEngine:
    config = minimal_config(model_dir, max_seq_len=128, max_input_len=96, model={"worldSize": world_size},
                            cacheBlockSize=4, maxBatchSize=8, maxPrefillBatchSize=8, maxPrefillTokens=512,
                            maxIterTimes=128)
    return LLMEngine(config, env=EngineEnvironment(recompute_threshold=0.99))


def test_world_size_2_matches_transformers(model_dir: Path, hf_model: object) -> None:
    batch = prompts()
    engine = _tp_engine(model_dir, 2)
    try:
        outs = engine.generate(batch, GREEDY)
        assert engine.info().worldSize == 2
    finally:
        engine.close()
    assert [o.token_ids for o in outs] == reference(hf_model, batch)


TEXTS = ["the quick brown fox", "a", "mixture of experts over two ranks", "hello world, again"]


@pytest.fixture(scope="module")
def dummy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dummy_model(_dummy_spec(), tmp_path_factory.mktemp("moe-cli"), seed=3, init_std=0.3)


def test_npuserve_generate_with_world_size_2(dummy_dir: Path, tmp_path: Path) -> None:
    tokens, _ = generate_world_size_2(dummy_dir, TEXTS, tmp_path)
    assert tokens == [t for t, _ in in_process(dummy_dir, TEXTS)]


def test_npuserve_serve_with_world_size_2(dummy_dir: Path) -> None:
    assert serve_world_size_2(dummy_dir, TEXTS) == [(len(t), text) for t, text in in_process(dummy_dir, TEXTS)]
