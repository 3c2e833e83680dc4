"""Every field of OpenAI's completions and chat request schemas, each given a non-default value: honoured (its
effect is observed) or refused with a 400 that names it. Nothing is accepted and ignored.

The field lists are OpenAI's published request schemas (plus vLLM's extensions this server implements). A field
that moves from refused to honoured moves from REFUSED_* to a check below."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from npuserve.engine.engine import LLMEngine
from npuserve.engine.sequence import SamplingParams
from npuserve.mindie_config import minimal_config
from tests.server.conftest import RunningServer, running_server

PROMPT = "The quick brown fox"

# OpenAI's CreateCompletionRequest and CreateChatCompletionRequest fields, with a non-default value each.
COMPLETION_FIELDS: dict[str, Any] = {
    "model": None, "prompt": None, "best_of": 2, "echo": True, "frequency_penalty": 0.5, "logit_bias": {"5": 10},
    "logprobs": 2, "max_tokens": 3, "n": 2, "presence_penalty": 0.5, "seed": 7, "stop": ["x"], "stream": True,
    "stream_options": {"include_usage": True}, "suffix": "!", "temperature": 0.0, "top_p": 1e-9, "user": "alice",
}
CHAT_FIELDS: dict[str, Any] = {
    "messages": None, "model": None, "audio": {"voice": "alloy", "format": "wav"}, "frequency_penalty": 0.5,
    "function_call": "auto", "functions": [{"name": "f", "parameters": {"type": "object"}}],
    "logit_bias": {"5": 10}, "logprobs": True, "max_completion_tokens": 3, "max_tokens": 3,
    "metadata": {"k": "v"}, "modalities": ["text", "audio"], "n": 2, "parallel_tool_calls": True,
    "prediction": {"type": "content", "content": "x"}, "presence_penalty": 0.5, "reasoning_effort": "low",
    "response_format": {"type": "json_object"}, "seed": 7, "service_tier": "flex", "stop": ["x"], "store": True,
    "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0,
    "tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    "top_logprobs": 2, "top_p": 1e-9, "user": "alice", "verbosity": "low",
    "web_search_options": {"search_context_size": "low"}, "prompt_cache_key": "k", "safety_identifier": "s",
}
# vLLM's extensions this server honours, checked below like the rest (vLLM's `bench serve` sends
# repetition_penalty with every request).
EXTENSIONS = {"top_k": 1, "ignore_eos": True, "stop_token_ids": [5], "priority": 1, "repetition_penalty": 1.5,
              "min_p": 0.1, "min_tokens": 2, "skip_special_tokens": False, "spaces_between_special_tokens": False,
              "include_stop_str_in_output": True, "truncate_prompt_tokens": 2}
CHAT_EXTENSIONS = {"chat_template_kwargs": {"persona": "x"}, "add_generation_prompt": False}

REFUSED_COMPLETION = {"suffix"}
REFUSED_CHAT = {"audio", "function_call", "functions", "metadata", "modalities",
                "prediction", "reasoning_effort", "service_tier", "store", "verbosity",
                "web_search_options", "prompt_cache_key", "safety_identifier"}


@pytest.fixture(scope="module")
def eos_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model whose EOS is the first token it would say greedily after PROMPT, so EOS handling shows."""
    folder = tmp_path_factory.mktemp("eos") / "tiny"
    shutil.copytree(tiny_model_dir, folder)
    engine = LLMEngine(minimal_config(folder, max_seq_len=256), warmup=False)
    first = engine.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0.0))[0].token_ids[0]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": first}))
    return folder


@pytest.fixture(scope="module")
def server(eos_model: Path) -> Iterator[RunningServer]:
    with running_server(eos_model, max_seq_len=256, maxIterTimes=64) as s:
        yield s


def _post(server: RunningServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def _complete(server: RunningServer, **fields: Any) -> dict[str, Any]:
    body = {"model": server.engine.engine.model_name, "prompt": PROMPT, "max_tokens": 4, "ignore_eos": True}
    response = _post(server, "/v1/completions", body | fields)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def _chat(server: RunningServer, **fields: Any) -> dict[str, Any]:
    body = {"model": server.engine.engine.model_name, "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 4, "ignore_eos": True}
    response = _post(server, "/v1/chat/completions", body | fields)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def _text(result: dict[str, Any]) -> str:
    choice = result["choices"][0]
    return str(choice["text"] if "text" in choice else choice["message"]["content"])


@pytest.mark.parametrize(("path", "field"), [("/v1/completions", f) for f in sorted(REFUSED_COMPLETION)]
                         + [("/v1/chat/completions", f) for f in sorted(REFUSED_CHAT)])
def test_fields_not_honoured_are_refused_by_name(server: RunningServer, path: str, field: str) -> None:
    fields = COMPLETION_FIELDS if "chat" not in path else CHAT_FIELDS
    base: dict[str, Any] = {"model": server.engine.engine.model_name, "max_tokens": 2}
    base |= {"prompt": PROMPT} if "chat" not in path else {"messages": [{"role": "user", "content": "hi"}]}
    response = _post(server, path, base | {field: fields[field]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"]


def test_the_field_lists_cover_the_schemas() -> None:
    """Every field is either refused (above) or has a behaviour check (below)."""
    checked = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "seed", "stop", "stream",
               "stream_options", "temperature", "top_p", "user", "logprobs", "response_format", "tools",
               "tool_choice", "parallel_tool_calls", "n", "best_of", "echo", "top_logprobs", "logit_bias",
               "presence_penalty", "frequency_penalty", *EXTENSIONS, *CHAT_EXTENSIONS}
    assert set(COMPLETION_FIELDS) <= REFUSED_COMPLETION | checked
    assert set(CHAT_FIELDS) <= REFUSED_CHAT | checked
    assert not REFUSED_COMPLETION & checked - {"logprobs"} and not REFUSED_CHAT & checked
    from npuserve.engine.server.protocol import ChatCompletionRequest, CompletionRequest

    # every field the schemas declare is in the lists (so a field added without a check fails here)
    declared = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    vllm_structured = {"guided_json", "guided_regex", "guided_choice", "guided_grammar"}  # test_structured_output
    assert declared <= set(COMPLETION_FIELDS) | set(CHAT_FIELDS) | checked | vllm_structured | {
        "prompt_logprobs"}  # tests/server/test_openai_choices_logprobs.py


def test_unknown_fields_are_refused_by_name(server: RunningServer) -> None:
    response = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "frobnicate": 1})
    assert response.status_code == 400 and response.json()["error"]["param"] == "frobnicate"
    response = _post(server, "/v1/chat/completions",
                     {"messages": [{"role": "user", "content": "hi", "mood": "ok"}], "max_tokens": 1})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages.0.mood"


def test_model_is_honoured(server: RunningServer) -> None:
    assert _post(server, "/v1/completions", {"model": "other", "prompt": "hi"}).status_code == 404
    assert _post(server, "/v1/chat/completions",
                 {"model": "other", "messages": [{"role": "user", "content": "hi"}]}).status_code == 404


@pytest.mark.parametrize("call", [_complete, _chat])
def test_length_limits_are_honoured(server: RunningServer, call: Callable[..., dict[str, Any]]) -> None:
    assert call(server, max_tokens=3)["usage"]["completion_tokens"] == 3
    if call is _chat:
        assert call(server, max_tokens=None, max_completion_tokens=2)["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("call", [_complete, _chat])
def test_sampling_fields_are_honoured(server: RunningServer, call: Callable[..., dict[str, Any]]) -> None:
    greedy = _text(call(server, temperature=0.0, max_tokens=12))
    # top_p so small, or top_k 1, keeps only the likeliest token: sampling at temperature 1 becomes greedy
    assert _text(call(server, temperature=1.0, top_p=1e-9, max_tokens=12)) == greedy
    assert _text(call(server, temperature=1.0, top_k=1, max_tokens=12)) == greedy
    seeded = [_text(call(server, temperature=1.0, seed=s, max_tokens=12)) for s in (7, 7, 8)]
    assert seeded[0] == seeded[1] != seeded[2]
    assert seeded[0] != greedy  # temperature itself is honoured: sampling differs from argmax


@pytest.mark.parametrize("call", [_complete, _chat])
def test_stops_and_eos_are_honoured(server: RunningServer, call: Callable[..., dict[str, Any]]) -> None:
    if call is _complete:  # the model's EOS is the first greedy token after PROMPT (the fixture's doing)
        ended = call(server, temperature=0.0, ignore_eos=False)
        assert ended["usage"]["completion_tokens"] == 1 and ended["choices"][0]["finish_reason"] == "stop"
        assert call(server, temperature=0.0, ignore_eos=True)["usage"]["completion_tokens"] == 4
    first = call(server, temperature=0.0, max_tokens=6, logprobs=0 if call is _complete else True)
    tokens = (first["choices"][0]["logprobs"]["tokens"] if call is _complete
              else [e["token"] for e in first["choices"][0]["logprobs"]["content"]])
    second_text = tokens[1]
    stopped = call(server, temperature=0.0, max_tokens=6, stop=[second_text])
    assert stopped["choices"][0]["finish_reason"] == "stop" and second_text not in _text(stopped)


def test_stop_token_ids_are_honoured(server: RunningServer, eos_model: Path) -> None:
    eos = json.loads((eos_model / "generation_config.json").read_text())["eos_token_id"]
    # the EOS is ignored, but the same id given as a stop token still ends the request (vLLM's semantics)
    result = _complete(server, temperature=0.0, ignore_eos=True, stop_token_ids=[eos])
    assert result["usage"]["completion_tokens"] == 1 and result["choices"][0]["finish_reason"] == "stop"


def test_stream_and_stream_options_are_honoured(server: RunningServer) -> None:
    body = {"model": server.engine.engine.model_name, "prompt": PROMPT, "max_tokens": 3, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 3


def test_logprobs_are_honoured(server: RunningServer) -> None:
    assert len(_complete(server, logprobs=0)["choices"][0]["logprobs"]["token_logprobs"]) == 4
    assert len(_chat(server, logprobs=True)["choices"][0]["logprobs"]["content"]) == 4
    assert _chat(server)["choices"][0]["logprobs"] is None


def test_choices_echo_and_top_logprobs_are_honoured(server: RunningServer) -> None:
    """n, best_of, echo, logprobs > 0 and top_logprobs (tests/server/test_openai_choices_logprobs.py: in depth)."""
    for call in (_complete, _chat):
        assert len(call(server, n=2, temperature=1.0)["choices"]) == 2
    every = _complete(server, n=3, temperature=1.0, seed=5, logprobs=0)["choices"]
    best = max(every, key=lambda c: sum(c["logprobs"]["token_logprobs"]))
    chosen = _complete(server, best_of=3, temperature=1.0, seed=5)["choices"]
    assert [c["text"] for c in chosen] == [best["text"]]
    assert _complete(server, echo=True)["choices"][0]["text"].startswith(PROMPT)
    tops = _complete(server, logprobs=2)["choices"][0]["logprobs"]["top_logprobs"]
    assert len(tops) == 4 and all(1 <= len(t) <= 3 for t in tops)
    content = _chat(server, logprobs=True, top_logprobs=2)["choices"][0]["logprobs"]["content"]
    assert all(len(e["top_logprobs"]) == 2 for e in content)


def test_user_is_written_to_the_request_log(server: RunningServer, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="npuserve.engine.server.openai_shared"):
        _complete(server, user="alice")
        _chat(server, user="bob")
    assert "'alice'" in caplog.text and "'bob'" in caplog.text


def test_priority_is_refused_unless_the_server_schedules_by_it(server: RunningServer, eos_model: Path) -> None:
    response = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "priority": 1})
    assert response.status_code == 400 and response.json()["error"]["param"] == "priority"
    with running_server(eos_model, max_seq_len=256, extensions={"policy": "priority"}) as by_priority:
        assert _post(by_priority, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "priority": 1}).is_success


def test_response_format_is_honoured(server: RunningServer) -> None:
    result = _chat(server, temperature=0.0, max_tokens=48, ignore_eos=False,
                   response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {
                       "type": "object", "properties": {"n": {"type": "boolean"}}, "required": ["n"],
                       "additionalProperties": False}}})
    assert isinstance(json.loads(_text(result))["n"], bool)
    assert result["choices"][0]["finish_reason"] == "stop"  # the grammar ended it, not max_tokens


def test_tools_need_a_template_that_takes_them(server: RunningServer) -> None:
    """The tiny model's template has no tools: tools are refused by name, never dropped; tool_choice and
    parallel_tool_calls without tools are refused by name too (tests/server/test_tool_calls.py: with a template)."""
    base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for field in ("tools", "tool_choice", "parallel_tool_calls"):
        response = _post(server, "/v1/chat/completions", base | {field: CHAT_FIELDS[field]})
        assert response.status_code == 400 and response.json()["error"]["param"] == field, response.text


@pytest.mark.parametrize("call", [_complete, _chat])
def test_logit_bias_and_openai_penalties_are_honoured(server: RunningServer,
                                                      call: Callable[..., dict[str, Any]]) -> None:
    """In depth against transformers and the formula: tests/engine/test_logits_processors.py."""
    forced = call(server, temperature=0.0, max_tokens=5, logit_bias={"300": 100}, logprobs=0 if call is _complete
                  else True)
    tokens = (forced["choices"][0]["logprobs"]["tokens"] if call is _complete
              else [e["token"] for e in forced["choices"][0]["logprobs"]["content"]])
    assert len(set(tokens)) == 1 and _text(forced) == tokens[0] * 5
    greedy = _text(call(server, temperature=0.0, max_tokens=12))
    assert _text(call(server, temperature=0.0, max_tokens=12, presence_penalty=2.0)) != greedy
    assert _text(call(server, temperature=0.0, max_tokens=12, frequency_penalty=2.0)) != greedy
    assert _text(call(server, temperature=0.0, max_tokens=12, repetition_penalty=100.0)) != greedy
    # min_p 1 keeps only the likeliest token: sampling becomes greedy
    assert _text(call(server, temperature=1.0, min_p=1.0, max_tokens=12)) == greedy
    refused = _post(server, "/v1/completions", {"prompt": PROMPT, "logit_bias": {"99999": 1}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "logit_bias"
    refused = _post(server, "/v1/completions", {"prompt": PROMPT, "logit_bias": {"5": 101}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "logit_bias"


@pytest.mark.parametrize("body", [
    {"prompt": "0", "logprobs": 3, "repetition_penalty": 5e-324},  # schemathesis found a 500 here (NaN logprobs)
    {"prompt": "0", "logprobs": 3, "temperature": 5e-324},
    {"prompt": "0", "logprobs": 3, "temperature": 1e-3, "repetition_penalty": 100.0},
])
def test_accepted_extremes_answer_with_finite_logprobs(server: RunningServer, body: dict[str, Any]) -> None:
    response = _post(server, "/v1/completions", body | {"max_tokens": 4})
    assert response.status_code == 200, response.text
    logprobs = response.json()["choices"][0]["logprobs"]
    assert all(-9999.0 <= v <= 0.0 for v in logprobs["token_logprobs"])
    assert all(-9999.0 <= v <= 0.0 for top in logprobs["top_logprobs"] for v in top.values())


def test_min_tokens_holds_back_eos_stop_tokens_and_stop_strings(server: RunningServer, eos_model: Path) -> None:
    eos = json.loads((eos_model / "generation_config.json").read_text())["eos_token_id"]
    assert _complete(server, temperature=0.0, ignore_eos=False)["usage"]["completion_tokens"] == 1  # EOS at once
    held = _complete(server, temperature=0.0, ignore_eos=False, min_tokens=3, max_tokens=8)
    assert held["usage"]["completion_tokens"] >= 3
    held = _complete(server, temperature=0.0, ignore_eos=True, stop_token_ids=[eos], min_tokens=3, max_tokens=8)
    assert held["usage"]["completion_tokens"] >= 3
    refused = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "min_tokens": 3})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "min_tokens"


def test_vllm_detokenization_options_are_honoured(server: RunningServer, eos_model: Path) -> None:
    from transformers import AutoTokenizer

    special = {"logit_bias": {"3": 100}, "temperature": 0.0, "max_tokens": 3}  # <|im_start|>, a special token
    assert _text(_complete(server, **special)) == ""
    kept = _text(_complete(server, **special, skip_special_tokens=False))
    reference = AutoTokenizer.from_pretrained(eos_model)
    for spaces in (True, False):
        assert _text(_complete(server, **special, skip_special_tokens=False,
                               spaces_between_special_tokens=spaces)) == kept
        assert kept == reference.decode([3, 3, 3], skip_special_tokens=False,
                                        spaces_between_special_tokens=spaces)
    tokens = _complete(server, temperature=0.0, max_tokens=6, logprobs=0)["choices"][0]["logprobs"]["tokens"]
    stop = next(t for t in tokens[1:] if t.strip())
    cut = _text(_complete(server, temperature=0.0, max_tokens=6, stop=[stop]))
    kept_stop = _text(_complete(server, temperature=0.0, max_tokens=6, stop=[stop], include_stop_str_in_output=True))
    assert kept_stop == cut + stop and kept_stop.endswith(stop)


@pytest.mark.parametrize("call", [_complete, _chat])
def test_truncate_prompt_tokens_keeps_the_last_tokens(server: RunningServer,
                                                      call: Callable[..., dict[str, Any]]) -> None:
    assert call(server, truncate_prompt_tokens=2)["usage"]["prompt_tokens"] == 2
    assert call(server, truncate_prompt_tokens=-1)["usage"]["prompt_tokens"] == call(server)["usage"]["prompt_tokens"]


def test_chat_template_kwargs_and_add_generation_prompt_are_honoured(eos_model: Path,
                                                                     tmp_path: Path) -> None:
    folder = tmp_path / "persona"
    shutil.copytree(eos_model, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% if persona %}[{{ persona }}]{% endif %}" + config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with running_server(folder, max_seq_len=256, maxIterTimes=64) as s:
        plain = _chat(s)["usage"]["prompt_tokens"]
        assert _chat(s, chat_template_kwargs={"persona": "pirate"})["usage"]["prompt_tokens"] > plain
        assert _chat(s, add_generation_prompt=False)["usage"]["prompt_tokens"] < plain
        refused = _post(s, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                    "chat_template_kwargs": {"messages": []}})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template_kwargs"
