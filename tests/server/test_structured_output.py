"""Structured output through the API with the official `openai` client: response_format (json_object,
json_schema), vLLM's guided_json / guided_regex / guided_choice / guided_grammar, TGI's grammar. The model's weights
are random, so only the grammar's token mask makes these outputs valid."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.server.conftest import RunningServer

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99}}}
ORDER = {"type": "object", "additionalProperties": False, "required": ["items", "express"],
         "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3,
                                  "items": {"enum": ["apple", "bread", "milk"]}},
                        "express": {"type": "boolean"}, "note": {"type": "null"}}}
SCORE = {"type": "object", "additionalProperties": False, "required": ["score", "grade"],
         "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1},
                        "grade": {"type": "string", "pattern": "^[A-F]$"}}}


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.chat.completions.create(model=client.models.list().data[0].id,
                                          messages=[{"role": "user", "content": "Tell me about it"}], **kwargs)


@pytest.mark.parametrize("schema", [PERSON, ORDER, SCORE], ids=["person", "order", "score"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_validates(client: openai.OpenAI, schema: dict[str, Any], temperature: float) -> None:
    result = _chat(client, temperature=temperature, seed=11, max_tokens=200,
                   response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    choice = result.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content or ""), schema)


def test_json_schema_streamed(client: openai.OpenAI) -> None:
    chunks = list(_chat(client, temperature=1.0, seed=3, max_tokens=200, stream=True,
                        response_format={"type": "json_schema", "json_schema": {"name": "o", "schema": ORDER}}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), ORDER)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_json_object(client: openai.OpenAI) -> None:
    result = _chat(client, temperature=0.0, max_tokens=200, response_format={"type": "json_object"})
    assert result.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(result.choices[0].message.content or ""), dict)


def test_guided_json_regex_choice_on_completions(client: openai.OpenAI, server: RunningServer) -> None:
    model = server.engine.engine.model_name
    out = client.completions.create(model=model, prompt="A person:", max_tokens=200, temperature=1.0, seed=5,
                                    extra_body={"guided_json": PERSON})
    jsonschema.validate(json.loads(out.choices[0].text), PERSON)
    regex = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"
    out = client.completions.create(model=model, prompt="A date:", max_tokens=50, temperature=1.0, seed=5,
                                    extra_body={"guided_regex": regex})
    assert re.fullmatch(regex, out.choices[0].text) and out.choices[0].finish_reason == "stop"
    choices = ["positive", "negative", "neutral"]
    batch = client.completions.create(model=model, prompt=["I loved it", "Meh", "Awful"], max_tokens=20,
                                      temperature=1.0, extra_body={"guided_choice": choices})
    assert all(c.text in choices and c.finish_reason == "stop" for c in batch.choices)


def test_guided_choice_and_grammar_on_chat(client: openai.OpenAI) -> None:
    result = _chat(client, temperature=1.0, max_tokens=20, extra_body={"guided_choice": ["yes", "no"]})
    assert result.choices[0].message.content in ("yes", "no")
    grammar = 'start: "move " DIR " " NUM\nDIR: "north" | "south"\nNUM: /[1-9]/'
    result = _chat(client, temperature=1.0, max_tokens=20, extra_body={"guided_grammar": grammar})
    assert re.fullmatch(r"move (north|south) [1-9]", result.choices[0].message.content or "")


def test_tgi_grammar(server: RunningServer) -> None:
    body = {"inputs": "Pick", "parameters": {"max_new_tokens": 30, "grammar": {"type": "regex", "value": "[xyz]{4}"}}}
    r = httpx.post(server.url + "/generate", json=body, timeout=60)
    assert r.status_code == 200 and re.fullmatch("[xyz]{4}", r.json()["generated_text"])
    body["parameters"]["grammar"] = {"type": "json", "value": PERSON}  # type: ignore[index]
    r = httpx.post(server.url + "/generate", json=body, timeout=60)
    jsonschema.validate(json.loads(r.json()["generated_text"]), PERSON)


@pytest.mark.parametrize(("extra", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_json": {"type": "object"}}, "response_format"),
])
def test_invalid_or_conflicting_constraints_are_400_naming_the_field(server: RunningServer, extra: dict[str, Any],
                                                                     param: str) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **extra}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
