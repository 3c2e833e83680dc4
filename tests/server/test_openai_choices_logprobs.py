"""n, best_of, top-k logprobs, echo and prompt logprobs through the official `openai` client."""

from __future__ import annotations

import json
import math
from typing import Any

import openai
import pytest

from tests.server.conftest import RunningServer

PROMPT = "The quick brown fox jumps over"


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(server: RunningServer) -> str:
    return server.engine.engine.model_name


def _prompt_len(server: RunningServer, text: str = PROMPT) -> int:
    return len(server.engine.engine.encode(text))


def test_n_choices_differ_share_one_prompt_and_repeat_with_a_seed(client: openai.OpenAI, model: str,
                                                                   server: RunningServer) -> None:
    kwargs: dict[str, Any] = dict(model=model, prompt=PROMPT, max_tokens=12, temperature=1.0, n=3,
                                  extra_body={"ignore_eos": True})
    result = client.completions.create(**kwargs)
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert len({c.text for c in result.choices}) > 1  # each choice samples its own tokens
    assert result.usage is not None
    assert result.usage.prompt_tokens == _prompt_len(server)  # the prompt counts once
    assert result.usage.completion_tokens == 3 * 12
    seeded = [client.completions.create(seed=5, **kwargs) for _ in range(2)]
    assert [c.text for c in seeded[0].choices] == [c.text for c in seeded[1].choices]
    assert len({c.text for c in seeded[0].choices}) > 1


def test_n_streamed_sends_chunks_per_choice(client: openai.OpenAI, model: str, server: RunningServer) -> None:
    kwargs: dict[str, Any] = dict(model=model, prompt=PROMPT, max_tokens=10, temperature=1.0, n=2, seed=3,
                                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    texts = {0: "", 1: ""}
    finishes = []
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finishes.append(c.index)
    assert texts == {c.index: c.text for c in full.choices}
    assert sorted(finishes) == [0, 1]
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens == _prompt_len(server) and usage.completion_tokens == 20


def test_best_of_keeps_the_choices_of_highest_cumulative_logprob(client: openai.OpenAI, model: str) -> None:
    base: dict[str, Any] = dict(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=21,
                                extra_body={"ignore_eos": True})
    every = client.completions.create(n=4, logprobs=0, **base)
    totals = {c.text: math.fsum(c.logprobs.token_logprobs or []) for c in every.choices if c.logprobs}
    best = client.completions.create(n=2, best_of=4, logprobs=0, **base)
    assert [c.index for c in best.choices] == [0, 1]
    expected = sorted(totals, key=lambda t: -totals[t])[:2]
    assert [c.text for c in best.choices] == expected
    no_logprobs = client.completions.create(n=2, best_of=4, **base)
    assert [c.text for c in no_logprobs.choices] == expected and no_logprobs.choices[0].logprobs is None
    assert no_logprobs.usage is not None and no_logprobs.usage.completion_tokens == 16  # the returned choices'


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"n": 2, "best_of": 1}, "best_of"),
        ({"best_of": 3, "stream": True}, "best_of"),
        ({"logprobs": 21}, "logprobs"),
        ({"n": 100000}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 0, "echo": True, "n": 2}, "n"),
        ({"extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs"),
    ],
)
def test_out_of_range_choice_and_logprob_fields_are_400(client: openai.OpenAI, model: str,
                                                         kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.completions.create(model=model, prompt="hi", **kwargs)
    body = excinfo.value.body
    assert isinstance(body, dict) and body["param"] == param and param in body["message"]


def test_completion_top_logprobs(client: openai.OpenAI, model: str) -> None:
    result = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=5,
                                       extra_body={"ignore_eos": True})
    lp = result.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs and lp.text_offset is not None
    assert "".join(lp.tokens) == result.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        # Keyed by text, as OpenAI's: tokens of the dummy byte tokenizer that decode alike share a key.
        assert 1 <= len(top) <= 6 and top[token] == chosen  # greedy: the chosen token is the most likely
        assert chosen == max(top.values()) and all(v <= 0 for v in top.values())


def test_top_logprobs_are_of_the_distribution_sampled_from(client: openai.OpenAI, model: str) -> None:
    """temperature 0.7 and top_k 3: three tokens have finite logprobs, summing (as probabilities) to 1; the others
    are cut (-9999, as vLLM sends -inf)."""
    result = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                            temperature=0.7, logprobs=True, top_logprobs=5, seed=1,
                                            extra_body={"ignore_eos": True, "top_k": 3})
    content = result.choices[0].logprobs.content if result.choices[0].logprobs else None
    assert content
    for entry in content:
        values = [t.logprob for t in entry.top_logprobs]
        assert len(values) == 5 and values[3:] == [-9999.0, -9999.0]
        assert math.fsum(math.exp(v) for v in values[:3]) == pytest.approx(1.0, abs=1e-4)
        assert entry.logprob in values[:3]


def test_echo_with_logprobs_for_log_likelihood(client: openai.OpenAI, model: str, server: RunningServer) -> None:
    """As lm-eval calls it: echo, max_tokens 0, logprobs k -> the prompt's tokens and logprobs, first null."""
    result = client.completions.create(model=model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2,
                                       temperature=0)
    choice = result.choices[0]
    assert choice.text == PROMPT
    lp = choice.logprobs
    n = _prompt_len(server)
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.token_logprobs) == n and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert all(t is not None and len(t) >= 2 for t in lp.top_logprobs[1:])
    assert result.usage is not None and result.usage.completion_tokens == 0 and result.usage.prompt_tokens == n
    # The same prompt with a generated tail: the prompt's logprobs do not change, the tail follows.
    more = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, echo=True, logprobs=2,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert more.choices[0].text.startswith(PROMPT) and len(more.choices[0].text) > len(PROMPT)
    more_lp = more.choices[0].logprobs
    assert more_lp is not None and more_lp.token_logprobs is not None
    assert len(more_lp.token_logprobs) == n + 3
    assert more_lp.token_logprobs[:n] == pytest.approx(lp.token_logprobs)
    echo_only = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, echo=True, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert echo_only.choices[0].text.startswith(PROMPT) and echo_only.choices[0].logprobs is None


def test_echo_streamed_sends_the_prompt_first(client: openai.OpenAI, model: str) -> None:
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=3, echo=True, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[0].choices[0].text.startswith(PROMPT) and text.startswith(PROMPT) and len(text) > len(PROMPT)


def test_vllm_prompt_logprobs_field(client: openai.OpenAI, model: str, server: RunningServer) -> None:
    result = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, temperature=0,
                                       extra_body={"prompt_logprobs": 3})
    entries = (result.choices[0].model_extra or {})["prompt_logprobs"]
    ids = server.engine.engine.encode(PROMPT)
    assert len(entries) == len(ids) and entries[0] is None
    for token, entry in zip(ids[1:], entries[1:], strict=True):
        assert str(token) in entry and 3 <= len(entry) <= 4
        assert entry[str(token)]["rank"] >= 1 and entry[str(token)]["logprob"] <= 0


def test_chat_n_and_top_logprobs(client: openai.OpenAI, model: str, server: RunningServer) -> None:
    messages: Any = [{"role": "user", "content": "hello"}]
    result = client.chat.completions.create(model=model, messages=messages, max_tokens=5, temperature=1.0, n=2,
                                            logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    assert [c.index for c in result.choices] == [0, 1]
    for choice in result.choices:
        content = choice.logprobs.content if choice.logprobs else None
        assert content is not None and len(content) == 5
        for entry in content:
            assert len(entry.top_logprobs) == 3
            assert all(t.logprob <= 0 and t.bytes == list(t.token.encode()) for t in entry.top_logprobs)
            assert entry.logprob <= entry.top_logprobs[0].logprob
    assert result.usage is not None and result.usage.completion_tokens == 10
    single = client.chat.completions.create(model=model, messages=messages, max_tokens=5, temperature=1.0,
                                            extra_body={"ignore_eos": True})
    assert single.usage is not None and result.usage.prompt_tokens == single.usage.prompt_tokens
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=1.0,
                                                 n=2, stream=True, extra_body={"ignore_eos": True}))
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]


@pytest.mark.parametrize(("kwargs", "param"), [({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                                               ({"top_logprobs": 2}, "top_logprobs")])
def test_chat_top_logprobs_out_of_range_is_400(client: openai.OpenAI, model: str, kwargs: dict[str, Any],
                                               param: str) -> None:
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], **kwargs)
    body = excinfo.value.body
    assert isinstance(body, dict) and body["param"] == param


def test_n_with_a_grammar_holds_every_choice_to_it(client: openai.OpenAI, model: str) -> None:
    """Each forked choice gets its own grammar state, advanced by its own tokens."""
    schema = {"type": "object", "properties": {"n": {"type": "boolean"}}, "required": ["n"],
              "additionalProperties": False}
    result = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=48, temperature=1.0, n=3, seed=2,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    assert len(result.choices) == 3
    for choice in result.choices:
        assert isinstance(json.loads(choice.message.content or ""), dict) and choice.finish_reason == "stop"
