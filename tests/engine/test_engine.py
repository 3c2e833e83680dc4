"""LLMEngine behaviour: aborts free every block, stop strings end a request through the scheduler, incremental
outputs add up, the CLI prints one JSON line per prompt and a summary, and sampling is reproducible by seed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from npuserve.cli import main as cli_main  # noqa: E402
from npuserve.engine.engine import LLMEngine  # noqa: E402
from npuserve.engine.output_processor import RequestOutput  # noqa: E402
from npuserve.engine.request_checks import RequestError  # noqa: E402
from npuserve.engine.sequence import FinishReason, SamplingParams  # noqa: E402
from npuserve.engine.step_output import SeqUpdate  # noqa: E402
from npuserve.mindie_config import minimal_config  # noqa: E402


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    config = minimal_config(tiny_model_dir, max_seq_len=128, max_input_len=96, cacheBlockSize=4, maxBatchSize=8,
                            maxPrefillBatchSize=8)
    return LLMEngine(config, num_kv_blocks=64)


def run_all(engine: LLMEngine) -> dict[str, list[object]]:
    outs: dict[str, list[object]] = {}
    while engine.has_unfinished():
        for o in engine.step().outputs:
            outs.setdefault(o.request_id, []).append(o)
    return outs


def test_aborts_leak_no_block(engine: LLMEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i in range(8):
        engine.add_request(f"a{i}", prompt_token_ids=list(range(5, 5 + 3 * i + 2)), params=params)
    engine.abort("a7")  # aborted before it was ever scheduled
    early = [o for _ in range(5) for o in engine.step().outputs]
    engine.abort("a0")
    engine.abort("a3")
    engine.abort("unknown")  # ignored
    outs = run_all(engine)
    for o in early:
        if o.finished:
            outs[o.request_id] = [o]
    reasons = {rid: o[-1].finish_reason for rid, o in outs.items()}  # type: ignore[attr-defined]
    assert reasons["a0"] is FinishReason.ABORT and reasons["a3"] is FinishReason.ABORT
    assert reasons["a7"] is FinishReason.ABORT
    assert reasons["a1"] is FinishReason.LENGTH
    assert engine.kv.num_used_blocks == 0
    assert engine.scheduler.num_running == 0 and not engine.has_unfinished()


def test_incremental_outputs_add_up(engine: LLMEngine) -> None:
    engine.add_request("s", "The capital of France is", SamplingParams(temperature=0.0, max_tokens=12,
                                                                       ignore_eos=True))
    outs = run_all(engine)["s"]
    last = outs[-1]
    assert last.finished and len(last.token_ids) == 12  # type: ignore[attr-defined]
    assert [t for o in outs for t in o.new_token_ids] == last.token_ids  # type: ignore[attr-defined]
    assert "".join(o.new_text for o in outs) == last.text  # type: ignore[attr-defined]
    assert last.text == engine.tokenizer.decode(last.token_ids)  # type: ignore[union-attr, attr-defined]


def test_stop_string_ends_request(engine: LLMEngine) -> None:
    free_run = engine.generate(["The quick brown fox"], SamplingParams(temperature=0.0, max_tokens=24,
                                                                       ignore_eos=True))[0]
    assert len(free_run.text) > 6
    stop = free_run.text[3:6]
    out = engine.generate(["The quick brown fox"], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                                  stop=(stop,)))[0]
    assert out.finish_reason is FinishReason.STOP
    assert out.text == free_run.text[: free_run.text.index(stop)]
    assert len(out.token_ids) < 24
    assert engine.kv.num_used_blocks == 0


def test_a_stop_string_seen_steps_late_drops_what_was_sampled_meanwhile(engine: LLMEngine) -> None:
    # the server's output side runs behind the step thread: here two steps behind. The output ends at the stop
    # string all the same; the engine ends the sequence at its next step after the hit (blocks freed then), and the
    # tokens it sampled in between are dropped from the outputs (vLLM v1)
    prompt = [5, 6, 7, 8, 9]
    free_run = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0]
    stop = free_run.text[3:6]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=(stop,))
    expected = engine.generate([prompt], params)[0]
    engine.add_request("late-stop", None, params, prompt_token_ids=prompt)
    behind: list[list[SeqUpdate]] = []
    outputs: list[RequestOutput] = []
    sampled = 0
    while engine.has_unfinished():
        updates = engine.run_step().updates
        sampled += sum(len(u.new_token_ids) for u in updates)
        behind.append(updates)
        if len(behind) > 2:
            outputs += engine.outputs.process(behind.pop(0))
    for late in behind:
        outputs += engine.outputs.process(late)
    assert outputs[-1].last and all(not o.finished for o in outputs[:-1])
    assert (outputs[-1].finish_reason, outputs[-1].text, outputs[-1].token_ids) == (
        FinishReason.STOP, expected.text, expected.token_ids)
    assert [t for o in outputs for t in o.new_token_ids] == expected.token_ids
    assert len(expected.token_ids) < sampled <= len(expected.token_ids) + 3  # ended soon after the hit
    assert engine.kv.num_used_blocks == 0 and not engine.has_unfinished()


def test_seeded_sampling_is_reproducible_and_logprobs(engine: LLMEngine) -> None:
    p = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=123, max_tokens=10, ignore_eos=True, logprobs=True)
    a = engine.generate([[5, 6, 7, 8]], p)[0]
    # Same seed inside a different batch gives the same tokens.
    other = SamplingParams(temperature=0.7, max_tokens=10, ignore_eos=True)
    b = engine.generate([[9, 9, 9], [5, 6, 7, 8]], [other, p])[1]
    assert a.token_ids == b.token_ids
    lp = engine.generate([[5, 6, 7, 8]], p)[0]
    assert lp.new_logprobs is not None and all(x <= 0.0 for x in lp.new_logprobs)


def test_refused_requests(engine: LLMEngine) -> None:
    with pytest.raises(RequestError):
        engine.add_request("e", prompt_token_ids=[])
    with pytest.raises(RequestError):
        engine.add_request("l", prompt_token_ids=[5] * 200)  # over maxInputTokenLen 96


def test_info_reports_blocks(engine: LLMEngine) -> None:
    info = engine.info()
    assert info.kv_blocks == 64 and info.block_size == 4 and info.device == "cpu"


def test_generate_cli(tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(x) for x in ["Hello there", {"prompt": "Two plus two"},
                                                          {"question": "How many clips?", "max_tokens": 3}]))
    rc = cli_main(["generate", "--model", str(tiny_model_dir), "--prompts-file", str(prompts), "--max-tokens", "6",
                   "--ignore-eos", "--block-size", "8", "--max-batch-size", "4"])
    assert rc == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [len(x["token_ids"]) for x in lines[:3]] == [6, 6, 3]
    assert all("text" in x and "ttft_s" in x for x in lines[:3])
    assert lines[3]["summary"] and lines[3]["output_tokens"] == 15 and lines[3]["output_tokens_per_s"] > 0


def test_generate_cli_reads_mindie_config(tiny_model_dir: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    config = minimal_config(tiny_model_dir, max_seq_len=256, cacheBlockSize=16, maxBatchSize=4)
    path = tmp_path / "config.json"
    config.save(path)
    rc = cli_main(["generate", "--config", str(path), "--prompt", "The capital of France is", "--max-tokens", "5",
                   "--ignore-eos"])
    assert rc == 0
    line = json.loads(capsys.readouterr().out.splitlines()[0])
    assert len(line["token_ids"]) == 5


def test_step_stats_count_the_tokens_computed(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request("stats-a", None, params, prompt_token_ids=[11, 12, 13, 14, 15])
    engine.add_request("stats-b", None, params, prompt_token_ids=[21, 22, 23])
    seen: list[tuple[str, int, int]] = []
    while engine.has_unfinished():
        stats = engine.step().stats
        if stats is not None:
            seen.append((stats.kind.value, stats.num_seqs, stats.num_tokens))
    assert seen[0] == ("prefill", 2, 8)  # every prompt token, not one per sequence
    assert all(tokens == seqs for kind, seqs, tokens in seen[1:] if kind == "decode")


def test_schedule_update_takes_effect_at_the_next_step_and_reports_what_runs(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    done = engine.update_schedule(engine.config.with_schedule(maxBatchSize=2, maxPrefillBatchSize=2).schedule)
    assert not done.done()  # taken on the step thread, not by the caller
    for i in range(5):
        engine.add_request(f"sched-{i}", None, params, prompt_token_ids=[10 + i, 20, 30])
    batches = []
    while engine.has_unfinished():
        result = engine.step()
        if result.stats is not None:
            batches.append(result.stats.num_seqs)
        assert result.snapshot.running <= 2
    assert done.result(timeout=0).maxBatchSize == 2
    assert engine.info().schedule["maxBatchSize"] == 2
    assert max(batches) == 2
