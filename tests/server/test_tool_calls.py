"""Tool calls with the official `openai` client, on a copy of the tiny model whose chat template has tools in the
Qwen2.5 style; a model whose template has no tools refuses them with a 400 naming `tools`."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from npuserve.engine.server import tool_calls
from tests.server.conftest import RunningServer, running_server

# Qwen2.5's tool template, shortened (no default system prompt)
QWEN_TOOL_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                                       "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}}}}}
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
CALL_REGEX = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "unit": "celsius"\}\}'
              r"\n</tool_call>")


@pytest.fixture(scope="module")
def tool_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    folder = tmp_path_factory.mktemp("tiny-tools")
    for f in tiny_model_dir.iterdir():
        shutil.copy(f, folder / f.name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN_TOOL_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with running_server(folder, max_seq_len=2048) as s:
        yield s


@pytest.fixture(scope="module")
def client(tool_server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=tool_server.url + "/v1", api_key="unused", max_retries=0)


def _chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    messages = kwargs.pop("messages", [{"role": "user", "content": "Weather in Paris?"}])
    kwargs.setdefault("max_tokens", 120)
    return client.chat.completions.create(model=client.models.list().data[0].id, messages=messages, **kwargs)


def test_auto_parses_hermes_tool_calls(client: openai.OpenAI) -> None:
    # the random model never writes a call by itself: a regex makes it write one, which the parser must read
    result = _chat(client, tools=[WEATHER, TIME], temperature=1.0, extra_body={"guided_regex": CALL_REGEX})
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")


def test_auto_streamed_tool_call_deltas(client: openai.OpenAI) -> None:
    chunks = list(_chat(client, tools=[WEATHER], temperature=1.0, stream=True,
                        extra_body={"guided_regex": CALL_REGEX}))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].function and deltas[0].function.name == "get_weather" and deltas[0].id
    arguments = "".join(d.function.arguments or "" for d in deltas if d.function)
    assert json.loads(arguments)["unit"] == "celsius"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_a_tool_with_valid_arguments(client: openai.OpenAI, stream: bool, parallel: bool) -> None:
    result = _chat(client, tools=[WEATHER, TIME], tool_choice="required", temperature=1.0, seed=2,
                   parallel_tool_calls=parallel, stream=stream)
    if stream:
        chunks = list(result)
        calls = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
        named = [(d.function.name, d.function.arguments) for d in calls if d.function]
        reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        named = [(c.function.name, c.function.arguments) for c in result.choices[0].message.tool_calls or []]
        reason = result.choices[0].finish_reason
    assert reason == "tool_calls" and named and (parallel or len(named) == 1)
    for name, arguments in named:
        jsonschema.validate(json.loads(arguments or ""), PARAMS[name or ""])


@pytest.mark.parametrize("stream", [False, True])
def test_named_function_is_called_with_valid_arguments(client: openai.OpenAI, stream: bool) -> None:
    choice = {"type": "function", "function": {"name": "get_time"}}
    result = _chat(client, tools=[WEATHER, TIME], tool_choice=choice, temperature=1.0, stream=stream)
    if stream:
        chunks = list(result)
        deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
        assert deltas[0].function and deltas[0].function.name == "get_time"
        arguments = "".join(d.function.arguments or "" for d in deltas if d.function)
    else:
        [call] = result.choices[0].message.tool_calls or []
        assert call.function.name == "get_time"
        arguments = call.function.arguments
    jsonschema.validate(json.loads(arguments), PARAMS["get_time"])


def test_none_leaves_the_output_as_content(client: openai.OpenAI) -> None:
    result = _chat(client, tools=[WEATHER], tool_choice="none", temperature=1.0,
                   extra_body={"guided_regex": CALL_REGEX})
    assert not result.choices[0].message.tool_calls
    assert (result.choices[0].message.content or "").startswith("<tool_call>")


def test_history_with_tool_calls_and_tool_results(client: openai.OpenAI, tool_server: RunningServer) -> None:
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    result = _chat(client, tools=[WEATHER], messages=history, max_tokens=5, temperature=0.0)
    assert result.choices[0].finish_reason in ("stop", "length")
    # what the template was given: the call's arguments as an object, the tool's result
    from npuserve.engine.server.openai_chat import _template_message
    from npuserve.engine.server.protocol import ChatMessage

    messages = [_template_message(ChatMessage.model_validate(m)) for m in history]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "unit": "celsius"}
    assert messages[2]["tool_call_id"] == "call_1"


def test_tool_choice_errors(tool_server: RunningServer) -> None:
    def post(**body: Any) -> httpx.Response:
        return httpx.post(tool_server.url + "/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body})

    r = post(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    r = post(tool_choice="required")
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    r = post(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    # strict needs a constrained choice: with auto the calls are parsed, so strict would be accepted and not kept
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}  # type: ignore[dict-item]
    r = post(tools=[WEATHER, strict])
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools.1.function.strict"
    assert post(tools=[strict], tool_choice="required").status_code == 200


def test_a_template_without_tools_refuses_them(server: RunningServer) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_parser() -> None:
    content, calls = tool_calls.parse('Let me look.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
                                      '\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>')
    assert content == "Let me look." and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1}),
                                                                                               ("g", {})]
    assert tool_calls.parse("<tool_call>\nnot json\n</tool_call>") == ("<tool_call>\nnot json\n</tool_call>", [])
    stream = tool_calls.ToolCallStream()
    text = 'Hi <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    pieces = [stream.feed(text[i:i + 3], final=i + 3 >= len(text)) for i in range(0, len(text), 3)]
    assert "".join(p[0] for p in pieces) == "Hi " and [c.name for p in pieces for c in p[1]] == ["f"]
