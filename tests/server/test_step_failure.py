"""A step that crashes (the model runner raises): every request in flight ends with its error, streamed or not, on
the OpenAI and the TGI routes; no KV block is left held; the server stays up and serves once the runner works."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import RunningServer, running_server, wait_until
from tests.server.runner_control import RunnerControl

FAILURE = "engine step failed"
ERRORS = 'npuserve:request_success_total{finished_reason="error",model_name'
MAX_TOKENS = 200  # far more than the steps before the crash: every request is still running when it comes


@dataclass
class Reply:
    status: int
    body: Any = None  # a JSON body (non-streamed)
    events: list[Any] | None = None  # the `data:` events, decoded ("[DONE]" kept as a string)


async def _post(client: httpx.AsyncClient, path: str, payload: dict[str, Any]) -> Reply:
    r = await client.post(path, json=payload)
    return Reply(r.status_code, body=r.json())


async def _stream(client: httpx.AsyncClient, path: str, payload: dict[str, Any]) -> Reply:
    events: list[Any] = []
    async with client.stream("POST", path, json=payload) as r:
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                data = line[5:].strip()
                events.append(data if data == "[DONE]" else json.loads(data))
        return Reply(r.status_code, events=events)


async def _one_of_each(url: str) -> dict[str, Reply]:
    """OpenAI and TGI, streamed and not, at once."""
    completion = {"prompt": "a request in flight", "max_tokens": MAX_TOKENS, "ignore_eos": True}
    tgi = {"inputs": "a request in flight", "parameters": {"max_new_tokens": MAX_TOKENS, "ignore_eos": True}}
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        replies = await asyncio.gather(
            _post(client, "/v1/completions", completion),
            # logprobs: a chunk for every token, even one whose text is held back
            _stream(client, "/v1/completions", {**completion, "stream": True, "logprobs": 0}),
            _post(client, "/generate", tgi),
            _stream(client, "/generate_stream", tgi),
        )
    return dict(zip(("openai", "openai_stream", "tgi", "tgi_stream"), replies, strict=True))


def _error_message(body: Any) -> str:
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), body
    message = body["error"]["message"]
    assert isinstance(message, str)
    return message


def _serves(s: RunningServer) -> None:
    r = httpx.post(s.url + "/v1/completions", json={"prompt": "after", "max_tokens": 4, "ignore_eos": True},
                   timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    r = httpx.post(s.url + "/generate", json={"inputs": "after", "parameters": {"max_new_tokens": 4,
                                                                                 "ignore_eos": True}}, timeout=30)
    assert r.status_code == 200 and r.headers["x-generated-tokens"] == "4"


@pytest.fixture
def crashing(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    with running_server(tiny_model_dir, maxBatchSize=8) as s:
        yield s, RunnerControl(s.engine.engine, monkeypatch)


def test_every_request_in_flight_gets_its_error(crashing: tuple[RunningServer, RunnerControl]) -> None:
    s, control = crashing
    errors_before = s.metric(ERRORS)
    control.hold_until(4)  # all four are queued before the first step goes on
    control.crash_once_running(4)  # then the runner breaks while all four run, each with tokens out
    replies = asyncio.run(_one_of_each(s.url))

    assert control.kv_usage_at_crash is not None and control.kv_usage_at_crash > 0
    for name in ("openai", "tgi"):
        assert replies[name].status == 500, (name, replies[name].body)
        assert _error_message(replies[name].body).startswith(FAILURE)
    openai_events = replies["openai_stream"].events
    assert replies["openai_stream"].status == 200 and openai_events is not None
    assert openai_events[-1] == "[DONE]"  # OpenAI streams: the error is the last event before [DONE]
    assert _error_message(openai_events[-2]).startswith(FAILURE)
    assert openai_events[0]["choices"][0]["logprobs"]["tokens"]  # its tokens came first
    tgi_events = replies["tgi_stream"].events
    assert replies["tgi_stream"].status == 200 and tgi_events is not None
    assert _error_message(tgi_events[-1]).startswith(FAILURE)  # TGI streams end with the error
    assert "token" in tgi_events[0]

    # Nothing is left behind: the failed requests' blocks are free, nothing counts as running.
    wait_until(lambda: s.metric("npuserve:kv_cache_usage_perc") == 0.0
               and s.metric("npuserve:num_requests_running") == 0
               and s.metric("npuserve:num_requests_waiting") == 0)
    assert s.metric(ERRORS) == errors_before + 4

    # The server stays up: health is fine, and once the runner works it serves again.
    assert s.get("/health").status_code == 200
    control.repair()
    _serves(s)
    assert s.get("/ready").status_code == 200


def test_a_request_sent_while_the_runner_is_broken_fails_and_the_next_one_runs(
        crashing: tuple[RunningServer, RunnerControl]) -> None:
    s, control = crashing
    control.broken = True  # every step crashes, the first prefill included
    r = httpx.post(s.url + "/v1/completions", json={"prompt": "doomed", "max_tokens": 8}, timeout=30)
    assert r.status_code == 500 and _error_message(r.json()).startswith(FAILURE)
    r = httpx.post(s.url + "/generate", json={"inputs": "doomed", "parameters": {"max_new_tokens": 8}}, timeout=30)
    assert r.status_code == 500 and _error_message(r.json()).startswith(FAILURE)
    wait_until(lambda: s.metric("npuserve:kv_cache_usage_perc") == 0.0)
    control.repair()
    _serves(s)
