"""DeepSeek-V2/V3 greedy output equals transformers' token for token: multi-head latent attention over the two MLA
caches, YaRN rope and scale, V3's interleaved rope with q_lora, V2-Lite's plain q_proj; a dense first layer, then
MoE layers (V3: sigmoid, grouped, with a random e_score_correction_bias; V2: greedy softmax) with shared experts.

Checkpoints transformers itself writes (`DeepseekV3ForCausalLM(config).save_pretrained`, and V2) and
`npuserve model create-dummy --preset tiny-deepseek-v3`'s folder; float32, weights of std 0.3 so argmax is not
fragile. 8 prompts of
different lengths in one continuous batch with block size 4; prefix-cache hits (the expanded prefill reads the
cached latent back); forced preemption by swap (both caches go to the host and back); chunked prefill (mixed steps:
decodes absorbed, chunks expanded over their earlier chunks).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))
from test_correctness import make_engine, prefix_sharing_run, prompts, sharing_prompts  # noqa: E402

from npuserve.engine.sequence import SamplingParams  # noqa: E402

NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def yarn(mscale: float) -> dict[str, object]:
    return {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
            "beta_slow": 1, "mscale": mscale, "mscale_all_dim": mscale}


def hf_config(kind: str, num_layers: int = 3, first_k_dense_replace: int = 1) -> object:
    """A small V3 (q_lora, interleaved rope, sigmoid grouped routing) or V2 (no q_lora, greedy softmax) config: the
    first `first_k_dense_replace` layers dense, the others MoE with one shared expert."""
    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                  qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=first_k_dense_replace,
                  n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, max_position_embeddings=256,
                  initializer_range=0.3, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if kind == "v3":
        return transformers.DeepseekV3Config(q_lora_rank=48, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                             norm_topk_prob=True, rope_parameters={**yarn(1.0), "rope_theta": 10000.0},
                                             **common)
    return transformers.DeepseekV2Config(q_lora_rank=None, rope_parameters={**yarn(0.707), "rope_theta": 10000.0},
                                         **common)


def write_hf_checkpoint(kind: str, folder: Path, seed: int = 0, **config: int) -> Path:
    torch.manual_seed(seed)
    model_cls = transformers.DeepseekV3ForCausalLM if kind == "v3" else transformers.DeepseekV2ForCausalLM
    model = model_cls(hf_config(kind, **config))
    with torch.no_grad():  # transformers starts the correction bias at zero; a random one makes it count
        for layer in model.model.layers:
            bias = getattr(layer.mlp, "gate", None) and getattr(layer.mlp.gate, "e_score_correction_bias", None)
            if bias is not None:
                bias.copy_(torch.randn(bias.shape) * 0.5)
    model.save_pretrained(folder)
    return folder


def create_dummy(folder: Path, preset: str = "tiny-deepseek-v3", *overrides: str) -> Path:
    """`npuserve model create-dummy --preset <preset>`, std 0.3."""
    import subprocess
    import sys

    npuserve = str(Path(sys.executable).parent / "npuserve")
    sets = [arg for o in overrides for arg in ("--set", o)]
    run = subprocess.run([npuserve, "model", "create-dummy", "--preset", preset, "--out", str(folder),
                          "--seed", "3", "--init-std", "0.3", *sets], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return folder


@pytest.fixture(scope="module", params=["v3", "v2"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> object:
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


_REFERENCES: dict[tuple[str, tuple[tuple[int, ...], ...]], list[list[int]]] = {}


def reference(hf_model: object, batch: list[list[int]]) -> list[list[int]]:
    """transformers greedy output, one prompt at a time (no padding), cached per model and batch."""
    key = (str(hf_model.name_or_path), tuple(tuple(p) for p in batch))  # type: ignore[attr-defined]
    if key not in _REFERENCES:
        outs = []
        with torch.no_grad():
            for p in batch:
                out = hf_model.generate(  # type: ignore[attr-defined]
                    torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                    pad_token_id=0)
                outs.append(out[0, len(p):].tolist())
        _REFERENCES[key] = outs
    return _REFERENCES[key]


def test_one_continuous_batch_matches_transformers(model_dir: Path, hf_model: object) -> None:
    batch = prompts()
    engine = make_engine(model_dir)
    latent, rope = engine.runner.kv_caches[0]
    assert latent.shape[1:] == (4, 1, engine.spec.mla.kv_lora_rank)  # type: ignore[union-attr]
    assert rope.shape[1:] == (4, 1, engine.spec.mla.qk_rope_head_dim)  # type: ignore[union-attr]
    layer_bytes = sum(t.numel() * t.element_size() for t in engine.runner.kv_caches[0])
    assert engine.spec.kv_bytes_per_block(4) == layer_bytes // latent.shape[0] * engine.spec.num_layers
    outs = engine.generate(batch, GREEDY)
    assert [o.token_ids for o in outs] == reference(hf_model, batch)
    assert all(o.metrics["prefill_batch_size"] == len(batch) for o in outs)
    assert engine.kv.num_used_blocks == 0


def test_prefix_cache_hits_match_transformers(model_dir: Path, hf_model: object) -> None:
    assert prefix_sharing_run(make_engine(model_dir), GREEDY) == reference(hf_model, sharing_prompts())


def test_swap_preemption_matches_transformers(model_dir: Path, hf_model: object) -> None:
    batch = prompts()
    engine = make_engine(model_dir, kv_blocks=24, threshold=0.99, maxPreemptCount=8)
    outs = engine.generate(batch, GREEDY)
    assert engine.scheduler.num_preemptions_total > 0
    assert engine.runner._host_kv_caches is not None  # both caches went to the host and back
    assert [o.token_ids for o in outs] == reference(hf_model, batch)
    assert engine.kv.num_used_blocks == 0


def test_chunked_prefill_with_recompute_matches_transformers(model_dir: Path, hf_model: object) -> None:
    engine = make_engine(model_dir, kv_blocks=24, threshold=0.99, extensions={"chunkedPrefill": True},
                         maxPrefillTokens=6, maxPreemptCount=0)
    ids = [f"c{i}" for i in range(8)]
    batch = prompts()
    for rid, prompt in zip(ids, batch, strict=True):
        engine.add_request(rid, None, GREEDY, prompt_token_ids=prompt)
    outputs: dict[str, list[int]] = {}
    mixed = False
    while engine.has_unfinished():
        result = engine.step()
        if result.stats is not None and result.stats.num_prefill_seqs and result.stats.num_decode_seqs:
            mixed = True
        for o in result.outputs:
            if o.finished:
                outputs[o.request_id] = o.token_ids
    assert mixed  # chunks rode along with decodes
    assert engine.scheduler.num_preemptions_total > 0
    assert [outputs[r] for r in ids] == reference(hf_model, batch)


@pytest.mark.parametrize(("preset", "architecture"), [("tiny-deepseek-v3", "DeepseekV3ForCausalLM"),
                                                     ("tiny-deepseek-v2-lite", "DeepseekV2ForCausalLM")])
def test_create_dummy_loads_in_transformers_and_matches(tmp_path: Path, preset: str, architecture: str) -> None:
    """The preset's folder (V3: q_lora, YaRN, a dense layer then sigmoid grouped MoE with the correction bias; V2-Lite:
    q_proj, YaRN mscale 0.707, greedy softmax MoE) is that class to transformers, and the engine generates what it
    does."""
    folder = create_dummy(tmp_path / preset, preset)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert type(hf).__name__ == architecture
    if preset == "tiny-deepseek-v3":
        assert hf.model.layers[1].mlp.gate.e_score_correction_bias.abs().sum() > 0  # written and read, not zeros
    batch = prompts()[:3]
    outs = make_engine(folder).generate(batch, GREEDY)
    assert [o.token_ids for o in outs] == reference(hf, batch)


def test_forked_greedy_choices_match_transformers(model_dir: Path, hf_model: object) -> None:
    """n=3 forks at the first prefill: the partial last block is copied (both MLA caches) for each choice."""
    batch = prompts()[:4]  # 3, 7, 12 and 1 tokens: partial last blocks (block size 4) and a full one
    engine = make_engine(model_dir, maxBatchSize=12)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, n=3)
    outs = engine.generate_all(batch, params)
    for choices, ref in zip(outs, reference(hf_model, batch), strict=True):
        assert [c.token_ids for c in choices] == [ref] * 3
    assert engine.kv.num_used_blocks == 0
