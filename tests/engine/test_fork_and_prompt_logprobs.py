"""n > 1 and prompt logprobs on a real (dummy-weight) model, against `transformers`.

Forked choices share the prompt's full KV blocks and get a copy of its partial last block: greedy choices must all
equal transformers' greedy output token for token (a missing or wrong copy gives a different continuation), also
when the group's sequences are preempted by recompute or swap. Prompt logprobs equal transformers' log_softmax.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from npuserve.engine.model.dummy import write_dummy_model  # noqa: E402
from npuserve.engine.sequence import SamplingParams  # noqa: E402
from tests.engine.test_correctness import make_engine, prompts, reference, small_spec  # noqa: E402

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dummy_model(small_spec("qwen2"), tmp_path_factory.mktemp("qwen2"), seed=3, init_std=0.3)


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> object:
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("chunked", [False, True])
def test_prompt_logprobs_equal_transformers_log_softmax(model_dir: Path, hf_model: object, chunked: bool) -> None:
    prompt = prompts(seed=5)[4]  # 20 tokens
    # chunked prefill with 6-token steps: the prompt's logprobs come chunk by chunk
    engine = make_engine(model_dir, **_chunked() if chunked else {})
    engine.generate([prompt[:6]], SamplingParams(temperature=0.0, max_tokens=2))  # so the prefix cache holds some
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=5))[0]
    assert out.token_ids == [] and out.prompt_logprobs is not None
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0].float()  # type: ignore[operator]
    lp = torch.log_softmax(logits, dim=-1)
    assert len(out.prompt_logprobs) == len(prompt) - 1  # the first prompt token has none
    for pos, entry in enumerate(out.prompt_logprobs):
        token = prompt[pos + 1]
        assert entry.logprob == pytest.approx(lp[pos, token].item(), abs=1e-4)
        assert entry.rank == int((lp[pos] > lp[pos, token]).sum()) + 1
        values, ids = lp[pos].topk(5)
        assert [i for i, _ in entry.top] == ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-4)
    assert engine.kv.num_used_blocks == 0


def _chunked() -> dict[str, object]:
    return {"extensions": {"chunkedPrefill": True}, "maxPrefillTokens": 6}


@pytest.mark.parametrize("preempt", [None, "recompute", "swap", "chunked", "chunked-recompute"])
def test_forked_greedy_choices_match_transformers(model_dir: Path, hf_model: object, preempt: str | None) -> None:
    batch = prompts()[:4]  # 3, 7, 12 and 1 tokens: partial last blocks (block size 4) and a full one
    kwargs: dict[str, object] = {}
    if preempt in ("recompute", "swap", "chunked-recompute"):  # 4 groups x 3 sequences need up to 11 blocks each
        kwargs = dict(kv_blocks=40, threshold=0.99, maxPreemptCount=12 if preempt == "swap" else 0)
    if preempt is not None and preempt.startswith("chunked"):  # the prompts' last chunks fork
        kwargs.update(_chunked())
    engine = make_engine(model_dir, maxBatchSize=12, **kwargs)  # type: ignore[arg-type]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, n=3)
    outs = engine.generate_all(batch, params)
    expected = reference(hf_model, batch)
    for choices, ref in zip(outs, expected, strict=True):
        assert [c.index for c in choices] == [0, 1, 2]
        assert all(c.token_ids == ref for c in choices)
    if preempt in ("recompute", "swap", "chunked-recompute"):
        assert engine.scheduler.num_preemptions_total > 0
    assert engine.kv.num_used_blocks == 0


def test_fork_shares_the_full_prompt_blocks(model_dir: Path) -> None:
    engine = make_engine(model_dir, maxBatchSize=8)
    prompt = prompts(seed=9)[4][:14]  # 14 tokens: 3 full blocks of 4 and a partial one
    engine.add_request("r", None, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, n=4),
                       prompt_token_ids=prompt)
    while not engine.scheduler.running:
        engine.step()
    # After the prefill: 3 shared full blocks + 4 partial blocks (the parent's and 3 copies), not 4 x 4.
    assert engine.kv.num_used_blocks == 3 + 4
    tables = [s.block_table for s in engine.scheduler.running]
    assert len(tables) == 4 and all(t[:3] == tables[0][:3] for t in tables)
    assert len({t[3] for t in tables}) == 4
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.num_used_blocks == 0


def test_sampled_choices_differ_and_seeded_ones_repeat(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    prompt = prompts(seed=4)[2]
    free = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, n=4)
    texts = [c.token_ids for c in engine.generate_all([prompt], free)[0]]
    assert len({tuple(t) for t in texts}) > 1
    seeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, n=4, seed=11)
    first = [c.token_ids for c in engine.generate_all([prompt], seeded)[0]]
    again = [c.token_ids for c in engine.generate_all([prompt], seeded)[0]]
    assert first == again and len({tuple(t) for t in first}) > 1
    alone = engine.generate([prompt], SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=11))
    assert alone[0].token_ids == first[0]  # choice 0 of a seeded request is the request's n = 1 output


def test_abort_ends_every_choice_and_frees_the_blocks(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    engine.add_request("r", None, SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True, n=3),
                       prompt_token_ids=prompts()[2])
    while len(engine.scheduler.running) < 3:
        engine.step()
    engine.abort("r")
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step().outputs
    finals = [o for o in outputs if o.finished]
    assert sorted(o.index for o in finals) == [0, 1, 2] and sum(bool(o.last) for o in finals) == 1
    assert engine.kv.num_used_blocks == 0


@pytest.mark.parametrize("mode", ["processed_logprobs", "raw_logprobs"])
def test_logprobs_mode_from_the_config(model_dir: Path, mode: str) -> None:
    from npuserve.engine.engine import LLMEngine
    from npuserve.mindie_config import minimal_config

    config = minimal_config(model_dir, max_seq_len=128, cacheBlockSize=4, extensions={"logprobsMode": mode})
    engine = LLMEngine(config, warmup=False)
    params = SamplingParams(temperature=0.5, top_k=2, max_tokens=1, logprobs=True, top_logprobs=3, seed=1)
    out = engine.generate([prompts()[2]], params)[0]
    assert out.new_top_logprobs is not None and len(out.new_top_logprobs[0]) == 3
    third = out.new_top_logprobs[0][2][1]
    # processed: the third token is cut by top_k 2 (-inf, sent as -9999); raw: the model's own logprob
    assert (third == -9999.0) == (mode == "processed_logprobs")


def test_abort_before_the_prefill_ends_the_request_with_its_unborn_choices(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    engine.add_request("r", None, SamplingParams(temperature=1.0, max_tokens=8, n=3), prompt_token_ids=prompts()[1])
    engine.abort("r")
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step().outputs
    assert len(outputs) == 1 and outputs[0].finished and outputs[0].last and outputs[0].token_ids == []
    assert engine.kv.num_used_blocks == 0
