"""Structured output in the engine: the grammar's mask on the logits, batched, with the matcher advanced per token."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from npuserve.engine.engine import LLMEngine
from npuserve.engine.guided import GrammarError, GuidedSpec
from npuserve.engine.guided_mask import GuidedMasker, apply_bitmask
from npuserve.engine.sequence import FinishReason, SamplingParams
from npuserve.mindie_config import minimal_config

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}}
POINT = {"type": "object", "additionalProperties": False, "required": ["x", "y"],
         "properties": {"x": {"type": "number", "minimum": -10, "maximum": 10}, "y": {"type": "boolean"}}}
LIST = {"type": "array", "minItems": 1, "maxItems": 4,
        "items": {"type": "object", "additionalProperties": False, "required": ["id"],
                  "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9}}}}
REGEX = r"[a-z]{3,8}@[a-z]{2,5}\.com"
CHOICES = ["positive", "negative", "neutral"]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    return LLMEngine(minimal_config(tiny_model_dir, max_seq_len=512, maxIterTimes=256))


def test_masker_touches_only_guided_rows(engine: LLMEngine) -> None:
    guide = engine.compile_grammar(GuidedSpec.choice(["yes", "no"])).new_guide()
    vocab = engine.spec.vocab_size
    logits = torch.randn(3, vocab)
    before = logits.clone()
    apply_bitmask(logits, [1], GuidedMasker().fill([guide], vocab))
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert 0 < len(allowed) < vocab
    assert torch.equal(logits[1][allowed], before[1][allowed])
    texts = {engine.tokenizer.decode([t]) for t in allowed} if engine.tokenizer else set()
    assert all("yes".startswith(t) or "no".startswith(t) for t in texts)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_batched_requests_with_different_grammars_in_one_step(engine: LLMEngine, temperature: float) -> None:
    # any JSON object (unbounded strings) ends only when the model closes them: greedy from this prompt it does;
    # sampled, the third row gets a bounded schema instead
    third = GuidedSpec("json_object") if temperature == 0.0 else GuidedSpec.json_schema(LIST)
    specs = [GuidedSpec.json_schema(PERSON), GuidedSpec.json_schema(POINT), third,
             GuidedSpec("regex", REGEX), GuidedSpec.choice(CHOICES)]
    prompts = ["Hello", "The weather", "Hi there", "She walked", "The capital", "plain text"]
    params = [SamplingParams(max_tokens=200, temperature=temperature, seed=7,
                             guided=engine.compile_grammar(s)) for s in specs]
    params.append(SamplingParams(max_tokens=12, temperature=temperature, seed=7, ignore_eos=True))
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"mix-{temperature}-{i}", prompt, p)
    first = engine.step()
    while first.stats is None:
        first = engine.step()
    assert first.stats.num_seqs == len(prompts)  # one prefill step holds every grammar and the free row
    final: dict[str, str] = {}
    reasons: dict[str, FinishReason | None] = {}
    text: dict[str, str] = {}
    for o in first.outputs:
        text[o.request_id] = text.get(o.request_id, "") + o.new_text
    while engine.has_unfinished():
        for o in engine.step().outputs:
            if o.finished:
                final[o.request_id], reasons[o.request_id] = o.text, o.finish_reason
    out = [final[f"mix-{temperature}-{i}"] for i in range(len(prompts))]
    assert all(reasons[f"mix-{temperature}-{i}"] is FinishReason.STOP for i in range(5))
    jsonschema.validate(json.loads(out[0]), PERSON)
    jsonschema.validate(json.loads(out[1]), POINT)
    jsonschema.validate(json.loads(out[2]), {"type": "object"} if temperature == 0.0 else LIST)
    assert re.fullmatch(REGEX, out[3])
    assert out[4] in CHOICES
    # the row without a grammar is untouched: the same text as the prompt run alone
    alone = engine.generate(["plain text"], SamplingParams(max_tokens=12, temperature=temperature, seed=7,
                                                           ignore_eos=True))[0]
    assert out[5] == alone.text


def test_without_the_mask_the_output_is_not_held_to_the_grammar(engine: LLMEngine) -> None:
    """What the mask is for: the random model alone does not write JSON (so the tests above test the mask)."""
    free = engine.generate(["Hello"], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0].text
    with pytest.raises(ValueError):
        json.loads(free)


def test_invalid_constraints_are_refused(engine: LLMEngine) -> None:
    with pytest.raises(GrammarError):
        engine.compile_grammar(GuidedSpec.json_schema({"type": "no-such-type"}))
    with pytest.raises(GrammarError):
        engine.compile_grammar(GuidedSpec("regex", "[a-"))


def test_compiled_grammars_are_cached(engine: LLMEngine) -> None:
    spec = GuidedSpec.json_schema(POINT)
    assert engine.compile_grammar(spec) is engine.compile_grammar(GuidedSpec.json_schema(dict(POINT)))


def test_a_finished_grammar_stops_its_request_even_with_ignore_eos(engine: LLMEngine) -> None:
    grammar = engine.compile_grammar(GuidedSpec.choice(CHOICES))
    [out] = engine.generate(["Mood:"], SamplingParams(max_tokens=50, temperature=1.0, ignore_eos=True, guided=grammar))
    assert out.finish_reason is FinishReason.STOP and out.text in CHOICES


def test_grammars_hold_under_chunked_prefill(tiny_model_dir: Path) -> None:
    """A prompt cut into chunks: the rows of chunks short of the prompt's end neither take the mask nor advance the
    matcher, and the output still follows its grammar, decoding beside other requests' chunks."""
    engine = LLMEngine(minimal_config(tiny_model_dir, max_seq_len=512, maxIterTimes=256, maxPrefillTokens=8,
                                      extensions={"chunkedPrefill": True}))
    long_prompt = "The weather today is " * 6  # several 8-token chunks
    specs = [GuidedSpec.json_schema(POINT), GuidedSpec("regex", REGEX), GuidedSpec.choice(CHOICES)]
    params = [SamplingParams(max_tokens=120, temperature=0.0, guided=engine.compile_grammar(s)) for s in specs]
    outs = engine.generate([long_prompt, "She walked " * 5, long_prompt], params)
    assert all(o.finish_reason is FinishReason.STOP for o in outs)
    jsonschema.validate(json.loads(outs[0].text), POINT)
    assert re.fullmatch(REGEX, outs[1].text)
    assert outs[2].text in CHOICES
