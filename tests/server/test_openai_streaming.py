"""Streams as OpenAI and vLLM send them: when the first chunk goes out, the null keys, usage in every chunk, cached
tokens from the prefix cache; and the HTTP details probes and proxies rely on (HEAD, 413)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import RunningServer, running_server


@pytest.fixture(scope="module")
def small_blocks(tiny_model_dir: Path) -> Iterator[RunningServer]:
    """Blocks of 16 tokens, so a repeated prompt of a few dozen tokens hits the prefix cache."""
    with running_server(tiny_model_dir, cacheBlockSize=16, max_seq_len=2048, maxIterTimes=64,
                        app_kwargs={"max_body_bytes": 64 * 1024}) as s:
        yield s


def _model(server: RunningServer) -> str:
    return server.engine.engine.model_name


def _events(server: RunningServer, path: str, payload: dict[str, object]) -> list[dict[str, object]]:
    events = []
    with httpx.stream("POST", server.url + path, json=payload, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def test_no_chat_chunk_goes_out_before_the_first_token_is_computed(small_blocks: RunningServer,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's `bench serve` starts its TTFT clock at the first chunk with choices: a role chunk sent before prefill
    would make it measure the time to headers. Prefill is held in the runner; nothing may arrive meanwhile."""
    gate, computing = threading.Event(), threading.Event()
    execute = small_blocks.engine.engine.runner.execute

    def held_execute(*args: Any, **kwargs: Any) -> Any:
        computing.set()
        assert gate.wait(30)
        return execute(*args, **kwargs)

    monkeypatch.setattr(small_blocks.engine.engine.runner, "execute", held_execute)
    arrivals: list[tuple[float, dict[str, Any]]] = []
    payload = {"model": _model(small_blocks), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
               "stream": True}

    def read() -> None:
        with httpx.stream("POST", small_blocks.url + "/v1/chat/completions", json=payload, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append((time.monotonic(), json.loads(line[6:])))

    reader = threading.Thread(target=read)
    reader.start()
    assert computing.wait(30)
    time.sleep(0.5)  # room for an early chunk to arrive
    assert arrivals == []
    released = time.monotonic()
    gate.set()
    reader.join(60)
    first_time, first = arrivals[0]
    assert first_time >= released
    assert first["choices"][0]["delta"]["role"] == "assistant"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_non_final_chunks_carry_null_finish_reason_and_logprobs(small_blocks: RunningServer, path: str) -> None:
    body: dict[str, object] = {"max_tokens": 6, "stream": True, "ignore_eos": True}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    events = _events(small_blocks, path, body)
    *middle, last = events
    assert middle
    for event in middle:
        choice = event["choices"][0]  # type: ignore[index]
        assert choice["finish_reason"] is None and "logprobs" in choice and choice["logprobs"] is None
        assert "npuserve" not in event
    assert last["choices"][0]["finish_reason"] == "length"  # type: ignore[index]
    assert "npuserve" in last


def test_every_chunk_names_its_object_and_every_token_gets_its_own_chunk(small_blocks: RunningServer) -> None:
    """aiperf drops chunks without `object` ("No responses with actual content"); clients that time inter-token
    latency per chunk (vLLM's benchmark, aiperf, guidellm) need one chunk per token, even while a token's text is
    held back (a partial UTF-8 character): with the tiny model, greedy, ignore_eos, 32 tokens."""
    client = openai.OpenAI(base_url=small_blocks.url + "/v1", api_key="x")
    model = _model(small_blocks)
    completion = list(client.completions.create(model=model, prompt="The capital of France is", max_tokens=32,
                                                temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert [c.object for c in completion] == ["text_completion"] * 32
    assert all(c.model == model and c.created > 0 and c.id == completion[0].id for c in completion)
    chat = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=32, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True}))
    assert [c.object for c in chat] == ["chat.completion.chunk"] * 33  # the role chunk, then one per token
    assert all(c.choices[0].delta.content is not None for c in chat)
    answer = client.completions.create(model=model, prompt="hi", max_tokens=2)
    assert answer.object == "text_completion"
    assert client.models.list().data[0].object == "model"
    # system_fingerprint where vLLM sends it: whole responses and a stream's usage chunk, one value per server
    fingerprint = answer.system_fingerprint
    assert fingerprint is not None and fingerprint.startswith("npuserve-")
    chat_answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=2)
    assert chat_answer.system_fingerprint == fingerprint
    streamed = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=2, stream=True,
                                                   stream_options={"include_usage": True}))
    assert [c.system_fingerprint for c in streamed] == [None] * (len(streamed) - 1) + [fingerprint]


def test_an_event_is_one_line_whatever_splits_lines() -> None:
    """Token text may hold NEL or U+2028/U+2029, which JSON leaves raw but str.splitlines() breaks at (guidellm
    split an event in two and failed the request on it)."""
    from npuserve.engine.server.protocol import CompletionChoice, CompletionResponse
    from npuserve.engine.server.sse import sse

    text = "a\x85b\u2028c\u2029d\n"
    event = sse(CompletionResponse(id="x", created=1, model="m", choices=[CompletionChoice(index=0, text=text)]))
    lines = event.splitlines()
    assert lines == [lines[0], ""] and lines[0].startswith("data: ")
    assert json.loads(lines[0][6:])["choices"][0]["text"] == text


def test_continuous_usage_stats_puts_usage_in_every_chunk(small_blocks: RunningServer) -> None:
    client = openai.OpenAI(base_url=small_blocks.url + "/v1", api_key="x")
    stream = client.completions.create(model=_model(small_blocks), prompt="count with me", max_tokens=8, stream=True,
                                       extra_body={"ignore_eos": True, "stream_options": {
                                           "include_usage": True, "continuous_usage_stats": True}})
    chunks = list(stream)
    assert all(chunk.usage is not None for chunk in chunks)
    completion_tokens = [chunk.usage.completion_tokens for chunk in chunks if chunk.usage is not None]
    assert len(completion_tokens) >= 3
    assert completion_tokens == sorted(completion_tokens) and completion_tokens[-1] == 8
    # without the option, only the closing usage chunk has it
    stream = client.completions.create(model=_model(small_blocks), prompt="count with me", max_tokens=8, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    assert [c.usage.completion_tokens for c in stream if c.usage is not None] == [8]


def test_cached_tokens_count_the_prefix_cache_hits_of_a_repeated_prompt(small_blocks: RunningServer) -> None:
    client = openai.OpenAI(base_url=small_blocks.url + "/v1", api_key="x")
    prompt = list(range(3, 3 + 50))  # 50 tokens: three full blocks of 16
    first = client.completions.create(model=_model(small_blocks), prompt=prompt, max_tokens=2)
    second = client.completions.create(model=_model(small_blocks), prompt=prompt, max_tokens=2)
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens_details is not None and second.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 48
    messages: Any = [{"role": "user", "content": "again " * 30}]
    chat = client.chat.completions.create(model=_model(small_blocks), messages=messages, max_tokens=2)
    again = client.chat.completions.create(model=_model(small_blocks), messages=messages, max_tokens=2)
    assert chat.usage is not None and again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == (chat.usage.prompt_tokens // 16) * 16 > 0


@pytest.mark.parametrize("path", ["/health", "/ready", "/metrics", "/v1/models"])
def test_probes_answer_head(small_blocks: RunningServer, path: str) -> None:
    response = httpx.head(small_blocks.url + path, timeout=10)
    assert response.status_code == 200 and response.content == b""


def test_a_body_over_the_limit_is_413_before_it_is_read(small_blocks: RunningServer) -> None:
    big = {"prompt": "x" * 70_000, "max_tokens": 1}
    response = httpx.post(small_blocks.url + "/v1/completions", json=big, timeout=10)
    assert response.status_code == 413
    assert response.json()["error"]["param"] == "body"

    def chunked() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(70):
            yield b"y" * 1000
        yield b'", "max_tokens": 1}'

    response = httpx.post(small_blocks.url + "/v1/completions", content=chunked(),
                          headers={"content-type": "application/json"}, timeout=10)
    assert response.status_code == 413
    small = httpx.post(small_blocks.url + "/v1/completions", json={"prompt": "ok", "max_tokens": 1}, timeout=30)
    assert small.status_code == 200
