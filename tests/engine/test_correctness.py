"""Greedy output of the engine equals `transformers` greedy `generate` on the same weights, token for token.

For each architecture (llama, qwen2, qwen3, mistral): 8 prompts of different lengths, 32 tokens each, as one
continuous batch with block size 4 (sequences span many blocks); then with prefix-cache hits, and with forced
preemptions by recompute and by swap. Small float32 dummy models with init_std 0.3 so argmax is not fragile.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from npuserve.engine.engine import LLMEngine  # noqa: E402
from npuserve.engine.model.dummy import write_dummy_model  # noqa: E402
from npuserve.engine.sequence import SamplingParams  # noqa: E402
from npuserve.mindie_config import EngineEnvironment, minimal_config  # noqa: E402
from npuserve.modelspec import ModelSpec  # noqa: E402

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
NEW_TOKENS = 32
PROMPT_LENS = [3, 7, 12, 1, 20, 9, 5, 16]


def small_spec(model_type: str) -> ModelSpec:
    return ModelSpec(
        model_type=model_type, num_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, vocab_size=512, max_position_embeddings=512, dtype="float32",
        rms_norm_eps=1e-5, rope_theta=10000.0, attention_bias=model_type == "qwen2", qk_norm=model_type == "qwen3",
        tie_word_embeddings=model_type == "qwen3",
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64} if model_type == "llama" else None,
    )


def prompts(seed: int = 1, prefix: list[int] | None = None) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [(prefix or []) + torch.randint(5, 500, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=ARCHS)
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dummy_model(small_spec(request.param), tmp_path_factory.mktemp(request.param), seed=3, init_std=0.3)


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> object:
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


_REFERENCES: dict[tuple[str, tuple[tuple[int, ...], ...]], list[list[int]]] = {}


def reference(hf_model: object, batch: list[list[int]]) -> list[list[int]]:
    """transformers greedy output for the batch (one left-padded `generate` call, cached per model and batch)."""
    key = (str(hf_model.name_or_path), tuple(tuple(p) for p in batch))  # type: ignore[attr-defined]
    if key not in _REFERENCES:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            out = hf_model.generate(  # type: ignore[attr-defined]
                ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                pad_token_id=0,
            )
        _REFERENCES[key] = out[:, width:].tolist()
    return _REFERENCES[key]


def make_engine(model_dir: Path, kv_blocks: int | None = None, threshold: float = 0.5, **schedule: object) -> LLMEngine:
    sched: dict[str, object] = dict(cacheBlockSize=4, maxBatchSize=8, maxPrefillBatchSize=8, maxPrefillTokens=512,
                                    maxIterTimes=128)
    sched.update(schedule)
    config = minimal_config(model_dir, max_seq_len=128, max_input_len=96, **sched)
    return LLMEngine(config, env=EngineEnvironment(recompute_threshold=threshold), num_kv_blocks=kv_blocks)


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def test_one_continuous_batch_matches_transformers(model_dir: Path, hf_model: object) -> None:
    batch = prompts()
    engine = make_engine(model_dir)
    outs = engine.generate(batch, GREEDY)
    assert [o.token_ids for o in outs] == reference(hf_model, batch)
    assert all(o.metrics["prefill_batch_size"] == len(batch) for o in outs)  # one prefill batch, not 8
    assert engine.kv.num_used_blocks == 0


def sharing_prompts() -> list[list[int]]:
    """8 prompts that begin with the same 13 tokens (3 full blocks of 4)."""
    return prompts(seed=2, prefix=prompts(seed=7)[4][:13])


def prefix_sharing_run(engine: LLMEngine, params: SamplingParams = GREEDY) -> list[list[int]]:
    """`sharing_prompts()` in two rounds (2, then 6), so the second round hits the first's cached blocks; asserts
    that it did. Each prompt's greedy tokens, in order."""
    batch = sharing_prompts()
    first = engine.generate(batch[:2], params)
    hits_before = engine.kv.prefix_hits
    rest = engine.generate(batch[2:], params)
    assert engine.kv.prefix_hits > hits_before
    return [o.token_ids for o in first + rest]


def test_prefix_cache_hits_match_transformers(model_dir: Path, hf_model: object) -> None:
    engine = make_engine(model_dir)
    assert prefix_sharing_run(engine) == reference(hf_model, sharing_prompts())
    assert engine.kv.num_used_blocks == 0


@pytest.mark.parametrize("preempt", ["recompute", "swap"])
def test_preemption_matches_transformers(model_dir: Path, hf_model: object, preempt: str) -> None:
    batch = prompts()
    # 8 sequences need up to 13 blocks each at the end; 40 blocks force preemptions while they decode.
    engine = make_engine(model_dir, kv_blocks=40, threshold=0.99,
                         maxPreemptCount=8 if preempt == "swap" else 0)
    outs = engine.generate(batch, GREEDY)
    assert engine.scheduler.num_preemptions_total > 0
    if preempt == "swap":
        assert engine.runner._host_kv_caches is not None  # blocks went through the host cache
    assert [o.token_ids for o in outs] == reference(hf_model, batch)
    assert engine.kv.num_used_blocks == 0


def _chunked(model_dir: Path, kv_blocks: int | None = None, **schedule: object) -> LLMEngine:
    """Chunked prefill with a 6-token budget: the longer prompts take several steps, mixed with decodes."""
    return make_engine(model_dir, kv_blocks, extensions={"chunkedPrefill": True}, maxPrefillTokens=6, **schedule)


def test_chunked_prefill_matches_transformers(model_dir: Path, hf_model: object) -> None:
    batch = prompts()
    engine = _chunked(model_dir)
    ids = [f"c{i}" for i in range(len(batch))]
    for rid, prompt in zip(ids, batch, strict=True):
        engine.add_request(rid, None, GREEDY, prompt_token_ids=prompt)
    outputs: dict[str, list[int]] = {}
    steps = []
    while engine.has_unfinished():
        result = engine.step()
        if result.stats is not None:
            steps.append(result.stats)
        for o in result.outputs:
            if o.finished:
                outputs[o.request_id] = o.token_ids
    assert [outputs[r] for r in ids] == reference(hf_model, batch)
    assert max(s.num_tokens for s in steps) <= 6  # maxPrefillTokens bounds every step
    assert any(s.num_prefill_seqs and s.num_decode_seqs for s in steps)  # chunks rode along with decodes
    assert engine.kv.num_used_blocks == 0


def test_chunked_prefill_with_prefix_hits_and_recompute_matches_transformers(model_dir: Path,
                                                                              hf_model: object) -> None:
    engine = _chunked(model_dir)
    assert prefix_sharing_run(engine) == reference(hf_model, sharing_prompts())
    squeezed = _chunked(model_dir, kv_blocks=40, threshold=0.99)
    outs = squeezed.generate(prompts(), GREEDY)
    assert squeezed.scheduler.num_preemptions_total > 0
    assert [o.token_ids for o in outs] == reference(hf_model, prompts())
    assert squeezed.kv.num_used_blocks == 0
