"""A step that crashes (the model runner raises): every request in flight ends with its error, streamed or not, on
the OpenAI and the TGI routes; no KV block is left held; the server stays up and serves once the runner works,
unless its steps keep failing (then it exits). A step that never returns: /health fails, then the engine exits.
(Tensor parallel, where any step error is fatal: tests/engine/test_tensor_parallel.py.)"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from npuserve.engine.server.async_engine import MAX_CONSECUTIVE_STEP_FAILURES
from npuserve.engine_contract import TERMINATION_LOG_ENV
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
    assert s.exits == []
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


def test_one_rank_exits_once_its_steps_keep_failing(crashing: tuple[RunningServer, RunnerControl]) -> None:
    s, control = crashing
    control.broken = True  # every step fails: each request below is one failed step
    for _ in range(MAX_CONSECUTIVE_STEP_FAILURES):
        assert s.exits == []  # failures short of the bound: the server goes on
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "doomed", "max_tokens": 8}, timeout=30)
        assert r.status_code == 500 and _error_message(r.json()).startswith(FAILURE)
    wait_until(lambda: s.exits == [1])
    assert f"{MAX_CONSECUTIVE_STEP_FAILURES} engine steps failed in a row" in (s.engine.fatal_error or "")
    assert "RunnerFailure: injected runner failure" in (s.engine.fatal_error or "")
    assert s.get("/health").status_code == 503  # exiting


async def _completion_and_stream(url: str) -> tuple[Reply, Reply]:
    payload = {"prompt": "a step that never returns", "max_tokens": 8}
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        whole, streamed = await asyncio.gather(_post(client, "/v1/completions", payload),
                                               _stream(client, "/v1/completions", {**payload, "stream": True}))
    return whole, streamed


def test_a_step_that_never_returns_fails_health_then_exits(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    termination = tmp_path / "termination-log"
    monkeypatch.setenv(TERMINATION_LOG_ENV, str(termination))
    watchdog = {"stepTimeoutSeconds": 2, "stepTimeoutGraceSeconds": 2}
    with running_server(tiny_model_dir, extensions=watchdog) as s:
        control = RunnerControl(s.engine.engine, monkeypatch)
        try:
            assert s.get("/health").status_code == 200
            control.hang()  # inside the forward pass: the operation has started and never ends
            with ThreadPoolExecutor(1) as pool:
                replies = pool.submit(asyncio.run, _completion_and_stream(s.url))
                failing: list[dict[str, Any]] = []

                def health_fails() -> bool:
                    r = s.get("/health")
                    if r.status_code == 503:
                        failing.append(r.json())
                    return bool(failing)

                wait_until(health_fails, timeout=60)
                wait_until(lambda: s.exits == [1], timeout=60)
                whole, streamed = replies.result(timeout=60)
        finally:
            control.release()
    reason = failing[0]["reason"]
    assert failing[0]["status"] == "failing"
    # /health failed while the step was stuck, in the grace before the exit (the exit's message names the grace)
    assert "no engine step has completed" in reason and "npuserve.stepTimeoutSeconds 2" in reason
    assert "stepTimeoutGraceSeconds" not in reason
    assert "last started FORWARD #" in reason and "has not finished it" in reason  # the operation it hangs in
    fatal = s.engine.fatal_error or ""
    assert fatal.startswith("no engine step has completed") and "stepTimeoutGraceSeconds" in fatal
    # the requests in flight got their error before the exit: a 5xx, and a stream's last event
    assert whole.status == 500 and "the engine failed and exits: no engine step has completed" in _error_message(
        whole.body)
    assert streamed.events is not None and streamed.events[-1] == "[DONE]"
    assert "no engine step has completed" in _error_message(streamed.events[-2])
    assert "last started FORWARD #" in termination.read_text()  # the pod's termination message
