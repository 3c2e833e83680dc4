"""TGI-style routes, health/ready/info, the admin schedule route and the config-file watch."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import RunningServer, running_server, wait_until
from tests.server.runner_control import RunnerControl, histogram, histogram_delta


def test_generate_headers_and_body(server: RunningServer) -> None:
    r = httpx.post(server.url + "/generate", json={"inputs": "hello", "parameters": {
        "max_new_tokens": 7, "ignore_eos": True, "details": True}}, timeout=30)
    assert r.status_code == 200
    assert r.headers["x-prompt-tokens"] == str(len(server.engine.engine.encode("hello")))
    assert r.headers["x-generated-tokens"] == "7"
    for name in ("x-queue-time", "x-prefill-time", "x-inference-time", "x-time-per-token"):
        assert float(r.headers[name]) >= 0
    assert float(r.headers["x-inference-time"]) >= float(r.headers["x-prefill-time"])
    body = r.json()
    assert body["details"]["generated_tokens"] == 7 and body["details"]["finish_reason"] == "length"
    assert "".join(t["text"] for t in body["details"]["tokens"]) == body["generated_text"]


def test_timing_headers_are_the_requests_own_timings_in_milliseconds() -> None:
    """Written-out timings: 10 ms queued, 40 ms prefill, 500 ms decoding 11 tokens (10 decode steps after the
    first token) -> 50 ms per token; the inference time is prefill plus decode."""
    from npuserve.engine.output_processor import RequestOutput
    from npuserve.engine.server.tgi_api import timing_headers

    output = RequestOutput(request_id="r", new_token_ids=[], new_text="", new_logprobs=None,
                           token_ids=list(range(11)), text="", num_prompt_tokens=5, finished=True,
                           metrics={"queue_time": 0.010, "prefill_time": 0.040, "decode_time": 0.500})
    assert timing_headers(output) == {"x-prompt-tokens": "5", "x-generated-tokens": "11", "x-queue-time": "10.000",
                                      "x-prefill-time": "40.000", "x-inference-time": "540.000",
                                      "x-time-per-token": "50.000"}


def test_generate_stream_matches_generate(server: RunningServer) -> None:
    payload = {"inputs": "The quick brown", "parameters": {"max_new_tokens": 9, "ignore_eos": True}}
    full = httpx.post(server.url + "/generate", json=payload, timeout=30).json()["generated_text"]
    events = []
    with httpx.stream("POST", server.url + "/generate_stream", json=payload, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
    assert len(events) == 9
    assert "".join(e["token"]["text"] for e in events) == full
    assert events[-1]["generated_text"] == full and events[-1]["details"]["generated_tokens"] == 9


def test_generate_validation(server: RunningServer) -> None:
    r = httpx.post(server.url + "/generate", json={"inputs": "", "parameters": {}}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "inputs"
    r = httpx.post(server.url + "/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 10**6}},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "parameters.max_new_tokens"


def test_health_ready_info(server: RunningServer) -> None:
    assert server.get("/health").json() == {"status": "ok"}
    assert server.get("/ready").json() == {"ready": True}
    info = server.get("/info").json()
    engine = server.engine.engine
    assert info["model"] == engine.model_name and info["worldSize"] == 1
    assert info["kv_blocks"] == engine.kv_plan.num_blocks > 0
    assert info["block_size"] == engine.config.schedule.cacheBlockSize
    assert info["schedule"]["maxBatchSize"] == engine.config.schedule.maxBatchSize


def test_metrics_move_as_requests_run(server: RunningServer) -> None:
    before = server.metric("npuserve:generation_tokens_total")
    ok_before = server.metric('npuserve:request_success_total{finished_reason="length",model_name')
    httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 6, "ignore_eos": True},
               timeout=30).raise_for_status()
    assert server.metric("npuserve:generation_tokens_total") == before + 6
    assert server.metric('npuserve:request_success_total{finished_reason="length",model_name') == ok_before + 1
    assert server.metric("npuserve:time_to_first_token_seconds_count") >= 1
    assert server.metric("npuserve:kv_cache_blocks_total") == server.engine.engine.kv_plan.num_blocks


def test_generated_tokens_count_as_they_stream_not_when_the_request_ends(
        server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A window's tok/s is the counter's increase over it: tokens must count as generated (as vLLM's do), so a
    request longer than the window is not counted whole in the window it happens to finish in."""
    runner = server.engine.engine.runner
    execute = runner.execute

    def slow_execute(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.05)  # 100 tokens take 5 s: the request is still running when the counter is read
        return execute(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", slow_execute)
    before = server.metric("npuserve:generation_tokens_total")
    body = {"prompt": "hi", "max_tokens": 100, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        r.raise_for_status()
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: {")
            if chunks >= 5:
                break
        mid = server.metric("npuserve:generation_tokens_total")
        assert before + 5 <= mid < before + 100, (before, mid)
    wait_until(lambda: server.metric("npuserve:num_requests_running") == 0)


def test_admin_requires_a_token(server: RunningServer) -> None:
    r = httpx.put(server.url + "/admin/schedule", json={"maxBatchSize": 8}, timeout=30)
    assert r.status_code == 401
    r = httpx.put(server.url + "/admin/schedule", json={"maxBatchSize": 8}, timeout=30,
                  headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401


def test_admin_disabled_without_a_configured_token(tiny_model_dir: Path) -> None:
    with running_server(tiny_model_dir) as s:
        r = httpx.put(s.url + "/admin/schedule", json={"maxBatchSize": 8}, timeout=30,
                      headers={"Authorization": "Bearer anything"})
        assert r.status_code == 403 and "NPUSERVE_ADMIN_TOKEN" in r.json()["error"]["message"]


def test_admin_refuses_invalid_values_and_keeps_the_config(server: RunningServer) -> None:
    auth = {"Authorization": "Bearer s3cret"}
    before = server.get("/info").json()["schedule"]
    for body, field in (({"maxBatchSize": 0}, "maxBatchSize"), ({"maxQueueDelayMicroseconds": 1}, "maxQueue"),
                        ({"cacheBlockSize": 16}, "cacheBlockSize"), ({"maxBatchSize": "many"}, "maxBatchSize")):
        r = httpx.put(server.url + "/admin/schedule", json=body, headers=auth, timeout=30)
        assert r.status_code == 422, body
        assert field in r.json()["error"]["message"]
    assert server.get("/info").json()["schedule"] == before


async def _concurrent_completions(url: str, n: int, max_tokens: int) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=60) as client:
        responses = await asyncio.gather(*(
            client.post(url + "/v1/completions", json={"prompt": f"request {i}", "max_tokens": max_tokens,
                                                       "ignore_eos": True}) for i in range(n)))
    for r in responses:
        r.raise_for_status()
    return [r.json() for r in responses]


def _decode_steps_while(s: RunningServer, control: RunnerControl, n: int) -> tuple[dict[float, float], list[float]]:
    """Runs n concurrent requests, all queued before the engine goes on; returns the decode-batch-size histogram of
    the steps they ran (cumulative count per upper bound) and each request's mean decode batch size."""
    before = histogram(s, "npuserve:decode_batch_size")
    control.hold_until(n)
    results = asyncio.run(_concurrent_completions(s.url, n, 12))
    wait_until(lambda: s.metric("npuserve:num_requests_running") == 0)
    steps = histogram_delta(before, histogram(s, "npuserve:decode_batch_size"))
    return steps, [r["npuserve"]["mean_decode_batch_size"] for r in results]


def test_admin_schedule_reaches_the_scheduler(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """PUT /admin/schedule changes the batches the scheduler forms, not only what the server reports."""
    auth = {"Authorization": "Bearer t"}
    with running_server(tiny_model_dir, admin_token="t", maxBatchSize=16) as s:
        control = RunnerControl(s.engine.engine, monkeypatch)
        r = httpx.put(s.url + "/admin/schedule", json={"maxBatchSize": 2, "maxPrefillBatchSize": 2}, headers=auth,
                      timeout=30)
        assert r.status_code == 200 and r.json()["schedule"]["maxBatchSize"] == 2
        steps, means = _decode_steps_while(s, control, 6)
        inf = float("inf")
        assert steps[inf] > 0
        assert steps[2.0] == steps[inf]  # no decode step ran more than two requests ...
        assert steps[2.0] - steps[1.0] > 0  # ... and some ran two: six requests were there to batch
        assert max(means) <= 2
        assert s.get("/info").json()["schedule"]["maxBatchSize"] == 2

        # and back up: the same six requests now decode together
        r = httpx.put(s.url + "/admin/schedule", json={"maxBatchSize": 16}, headers=auth, timeout=30)
        assert r.status_code == 200
        steps, means = _decode_steps_while(s, control, 6)
        assert steps[inf] - steps[4.0] > 0 and max(means) > 2
        assert s.get("/info").json()["schedule"]["maxBatchSize"] == 16


def test_config_file_changes_apply_live_and_bad_ones_are_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    config_path = tmp_path / "config.json"
    with running_server(tiny_model_dir, config_path=config_path, maxBatchSize=16) as s:
        data = json.loads(config_path.read_text())
        data["BackendConfig"]["ScheduleConfig"].update(maxBatchSize=9, maxPrefillBatchSize=4)
        config_path.write_text(json.dumps(data))
        wait_until(lambda: s.get("/info").json()["schedule"]["maxBatchSize"] == 9)
        data["BackendConfig"]["ScheduleConfig"]["maxBatchSize"] = -3
        config_path.write_text(json.dumps(data) + " ")
        watcher = s.server.config.app.state.config_watcher  # type: ignore[attr-defined]
        wait_until(lambda: watcher.rejected == 1)
        assert s.get("/info").json()["schedule"]["maxBatchSize"] == 9


async def _completions_of_token_ids(url: str, n: int, prompt_len: int, max_tokens: int) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=120) as client:
        responses = await asyncio.gather(*(
            client.post(url + "/v1/completions", json={"prompt": [7 + i] * prompt_len, "max_tokens": max_tokens,
                                                       "ignore_eos": True}) for i in range(n)))
    for r in responses:
        r.raise_for_status()
    return [r.json() for r in responses]


def _preemptions(s: RunningServer) -> float:
    """The engine's preemption counter (its series appears at the first preemption)."""
    try:
        return s.metric("npuserve:num_preemptions_total")
    except KeyError:
        return 0.0


def test_a_live_max_batch_size_raise_within_the_limit_runs_without_preemption(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Started at maxBatchSize 2 with npuserve.maxBatchSizeLimit 8, raised live to 8: eight requests of 64 tokens
    (4 blocks of 16 each, 32 blocks in all) decode together with no preemption. A KV pool sized for the start-up
    batch (2 x (128 / 16 + 1) = 18 blocks on the CPU) would preempt them."""
    auth = {"Authorization": "Bearer t"}
    with running_server(tiny_model_dir, admin_token="t", max_seq_len=128, maxIterTimes=64, cacheBlockSize=16,
                        maxBatchSize=2, extensions={"maxBatchSizeLimit": 8}) as s:
        assert s.get("/info").json()["kv_blocks"] == 72  # 8 x (128 / 16 + 1): sized for the limit
        control = RunnerControl(s.engine.engine, monkeypatch)
        r = httpx.put(s.url + "/admin/schedule", json={"maxBatchSize": 8, "maxPrefillBatchSize": 8}, headers=auth,
                      timeout=30)
        assert r.status_code == 200 and r.json()["schedule"]["maxBatchSize"] == 8
        preempted = _preemptions(s)
        control.hold_until(8)
        results = asyncio.run(_completions_of_token_ids(s.url, 8, prompt_len=40, max_tokens=24))
        assert all(r["usage"]["completion_tokens"] == 24 for r in results)
        assert max(r["npuserve"]["mean_decode_batch_size"] for r in results) > 2  # the raise took effect
        assert all(r["npuserve"]["num_preemptions"] == 0 for r in results)
        assert _preemptions(s) == preempted

        # past the limit: refused, naming the field and the limit; the running schedule kept
        r = httpx.put(s.url + "/admin/schedule", json={"maxBatchSize": 9}, headers=auth, timeout=30)
        assert r.status_code == 422
        error = r.json()["error"]
        assert error["param"] == "maxBatchSize" and "npuserve.maxBatchSizeLimit (8)" in error["message"]
        assert s.get("/info").json()["schedule"]["maxBatchSize"] == 8


def test_without_a_limit_a_live_raise_past_the_start_up_max_batch_size_is_refused(tiny_model_dir: Path,
                                                                                  tmp_path: Path) -> None:
    """A hand-written config (no npuserve.maxBatchSizeLimit): the engine is sized for its start-up maxBatchSize,
    so a live raise past it is refused (from PUT and from the config file) rather than run short of KV blocks and
    graphs."""
    auth = {"Authorization": "Bearer t"}
    config_path = tmp_path / "config.json"
    with running_server(tiny_model_dir, admin_token="t", config_path=config_path, maxBatchSize=4) as s:
        assert "npuserve" not in json.loads(config_path.read_text())
        r = httpx.put(s.url + "/admin/schedule", json={"maxBatchSize": 5}, headers=auth, timeout=30)
        assert r.status_code == 422
        assert r.json()["error"]["param"] == "maxBatchSize"
        assert "npuserve.maxBatchSizeLimit (4)" in r.json()["error"]["message"]
        r = httpx.put(s.url + "/admin/schedule", json={"maxBatchSize": 3, "maxPrefillBatchSize": 3}, headers=auth,
                      timeout=30)
        assert r.status_code == 200 and r.json()["schedule"]["maxBatchSize"] == 3
        assert s.get("/info").json()["graph_batch_sizes"] == []  # the CPU backend has no graphs
        data = json.loads(config_path.read_text())
        data["BackendConfig"]["ScheduleConfig"]["maxBatchSize"] = 6
        config_path.write_text(json.dumps(data))
        watcher = s.server.config.app.state.config_watcher  # type: ignore[attr-defined]
        wait_until(lambda: watcher.rejected == 1)
        assert s.get("/info").json()["schedule"]["maxBatchSize"] == 3


def test_admin_turns_the_tpot_controller_on_and_info_and_metrics_show_its_cap(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """dynamicBatchSizeEnable and decodeExpectedTime apply live; /info and npuserve:batch_size_cap show the cap."""
    auth = {"Authorization": "Bearer t"}
    with running_server(tiny_model_dir, admin_token="t", maxBatchSize=16) as s:
        info = s.get("/info").json()
        assert info["batch_size_cap"] == 16 and info["schedule"]["dynamicBatchSizeEnable"] is False
        r = httpx.put(s.url + "/admin/schedule", json={"dynamicBatchSizeEnable": True, "decodeExpectedTime": 1},
                      headers=auth, timeout=30)
        assert r.status_code == 200 and r.json()["schedule"]["decodeExpectedTime"] == 1
        execute = s.engine.engine.runner.execute

        def slow_execute(*args: Any, **kwargs: Any) -> Any:  # every step >= 3 ms: a 1 ms TPOT is out of reach
            time.sleep(0.003)
            return execute(*args, **kwargs)

        monkeypatch.setattr(s.engine.engine.runner, "execute", slow_execute)
        asyncio.run(_concurrent_completions(s.url, 12, 24))
        cap = s.get("/info").json()["batch_size_cap"]
        assert 3 <= cap < 12
        assert s.metric("npuserve:batch_size_cap") == cap
        r = httpx.put(s.url + "/admin/schedule", json={"stageSelectPolicy": 2}, headers=auth, timeout=30)
        assert r.status_code == 422 and "stageSelectPolicy" in r.json()["error"]["message"]
        r = httpx.put(s.url + "/admin/schedule", json={"dynamicBatchSizeEnable": False}, headers=auth, timeout=30)
        assert r.status_code == 200 and s.get("/info").json()["batch_size_cap"] == 16
