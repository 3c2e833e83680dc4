"""Disconnects free KV blocks, overload sheds with 429, SIGTERM drains running requests and exits 0."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx

from tests.serve_process import free_port, wait_ready
from tests.server.conftest import running_server, wait_until


async def _open_and_drop(url: str, n: int, chunks_before_drop: int) -> int:
    """Opens n streams, reads a few chunks of each, then drops every connection; returns how many streamed."""
    streamed = 0

    async def one(client: httpx.AsyncClient, i: int) -> None:
        nonlocal streamed
        payload = {"prompt": f"stream number {i}", "max_tokens": 200, "ignore_eos": True, "stream": True}
        async with client.stream("POST", url + "/v1/completions", json=payload) as r:
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    seen += 1
                    if seen >= chunks_before_drop:
                        streamed += 1
                        return  # leaving the block closes the connection mid-stream

    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=n)) as client:
        await asyncio.gather(*(one(client, i) for i in range(n)))
    return streamed


def test_fifty_dropped_streams_free_their_blocks(tiny_model_dir: Path) -> None:
    with running_server(tiny_model_dir, cacheBlockSize=16, maxBatchSize=64, maxIterTimes=256) as s:
        assert asyncio.run(_open_and_drop(s.url, 50, 3)) == 50
        wait_until(lambda: s.metric("npuserve:kv_cache_usage_perc") == 0.0
                   and s.metric("npuserve:num_requests_running") == 0, timeout=60)
        assert s.engine.engine.kv.num_used_blocks == 0
        aborted = s.metric('npuserve:request_success_total{finished_reason="abort",model_name')
        assert aborted == 50
        # nothing hangs: the server still answers
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "still alive", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200


def test_dropped_non_streaming_request_is_aborted(tiny_model_dir: Path) -> None:
    with running_server(tiny_model_dir, max_seq_len=4096, maxIterTimes=4000) as server:
        async def drop() -> None:
            async with httpx.AsyncClient(timeout=0.3) as client:
                with contextlib.suppress(httpx.TimeoutException):
                    await client.post(server.url + "/v1/completions",
                                      json={"prompt": "long", "max_tokens": 4000, "ignore_eos": True})

        asyncio.run(drop())
        wait_until(lambda: server.metric('npuserve:request_success_total{finished_reason="abort",model_name') == 1)
        wait_until(lambda: server.engine.engine.kv.num_used_blocks == 0)
        assert server.metric('npuserve:request_success_total{finished_reason="length",model_name') == 0


def test_overload_sheds_with_429_and_retry_after(tiny_model_dir: Path) -> None:
    with running_server(tiny_model_dir, max_waiting=2, maxBatchSize=1, maxPrefillBatchSize=1) as s:
        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as client:
                return list(await asyncio.gather(*(
                    client.post(s.url + "/v1/completions",
                                json={"prompt": f"r{i}", "max_tokens": 40, "ignore_eos": True})
                    for i in range(12))))

        responses = asyncio.run(burst())
        codes = [r.status_code for r in responses]
        assert set(codes) <= {200, 429} and codes.count(200) >= 1 and codes.count(429) >= 1
        for r in responses:
            if r.status_code == 429:
                assert r.headers["Retry-After"] == "1" and r.json()["error"]["type"] == "RateLimitError"
            else:
                assert r.json()["usage"]["completion_tokens"] == 40  # accepted requests are served in full


def test_sigterm_drains_running_requests_and_exits_zero(tiny_model_dir: Path) -> None:
    port = free_port()
    script = Path(sys.executable).parent / "npuserve"
    proc = subprocess.Popen([str(script), "serve", "--model", str(tiny_model_dir), "--host", "127.0.0.1",
                             "--port", str(port), "--drain-timeout", "20", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        first_chunk = threading.Event()
        result: dict[str, object] = {}

        def stream() -> None:
            payload = {"prompt": "drain me", "max_tokens": 500, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}
            with httpx.stream("POST", url + "/v1/completions", json=payload, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data:") and line != "data: [DONE]":
                        first_chunk.set()
                        chunk = json.loads(line[5:])
                        if chunk.get("usage"):
                            result["usage"] = chunk["usage"]
                    if line == "data: [DONE]":
                        result["done"] = True

        reader = threading.Thread(target=stream)
        reader.start()
        assert first_chunk.wait(60)
        os.kill(proc.pid, signal.SIGTERM)
        reader.join(60)
        assert result.get("done") is True
        assert result["usage"]["completion_tokens"] == 500  # type: ignore[index]
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
