"""How much load one `npuserve bench` process can generate, so the generator never limits the engine it measures.

The peer is a minimal streaming endpoint in its own process (a bare ASGI app on uvicorn, not the engine): every
request gets its first SSE chunk after a fixed delay (the true TTFT) and the rest of its chunks at once. The script
sends open-loop load at rising request rates and prints, per rate, the streamed requests per second the generator
sustained (against the rate offered) and its TTFT error (measured TTFT minus the endpoint's known delay); the last
row is a closed loop of --users users, the most the generator sends. The endpoint shares the machine with the
generator, so on a small machine both limit the figures.
Target: at least 500 req/s with 16 chunks each.

    .venv/bin/python -P benchmarks/loadgen_capacity.py [--rates 250,500,1000] [--seconds 4] [--chunks 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import socket
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

FIRST_TOKEN_DELAY_S = 0.010  # the endpoint's known TTFT: the generator's error is what it adds on top

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def make_endpoint(chunks: int) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    models = json.dumps({"object": "list", "data": [{"id": "echo", "object": "model", "root": None}]}).encode()
    body = b"".join(b'data: {"choices":[{"index":0,"text":"tok "}]}\n\n' for _ in range(chunks - 1))
    usage = json.dumps({"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": chunks}})
    tail = body + b"data: " + usage.encode() + b"\n\ndata: [DONE]\n\n"
    first = b'data: {"choices":[{"index":0,"text":"tok "}]}\n\n'

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/v1/models":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": models})
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await asyncio.sleep(FIRST_TOKEN_DELAY_S)
        await send({"type": "http.response.body", "body": first, "more_body": True})
        await send({"type": "http.response.body", "body": tail})

    return app


def serve(port: int, chunks: int) -> None:
    import uvicorn

    uvicorn.run(make_endpoint(chunks), host="127.0.0.1", port=port, log_level="error", access_log=False,
                backlog=4096)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def measure(url: str, rate: float, seconds: float, users: int | None = None,
                  num: int | None = None) -> tuple[float, float, float, int]:
    from npuserve.loadgen.config import BenchConfig, DatasetConfig, LoadConfig
    from npuserve.loadgen.metrics import compute_metrics
    from npuserve.loadgen.run import run_benchmark

    config = BenchConfig(base_url=url, dataset=DatasetConfig(random_input_len=8, random_output_len=16),
                         load=LoadConfig(num_prompts=num or max(1, int(rate * seconds)), request_rate=rate,
                                         max_concurrency=users, seed=1))
    result = await run_benchmark(config)
    metrics = compute_metrics(result.measured, result.duration_s)
    ttfts = sorted(r.chunk_times[0] - r.t0 for r in result.measured if r.ok and r.chunk_times)
    error_mean = (statistics.mean(ttfts) - FIRST_TOKEN_DELAY_S) * 1000
    error_p99 = (ttfts[int(0.99 * (len(ttfts) - 1))] - FIRST_TOKEN_DELAY_S) * 1000
    return metrics.request_throughput, error_mean, error_p99, metrics.failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="250,500,1000", help="offered request rates (req/s)")
    parser.add_argument("--seconds", type=float, default=4.0, help="seconds of load per rate")
    parser.add_argument("--chunks", type=int, default=16, help="streamed chunks per request")
    parser.add_argument("--users", type=int, default=64, help="closed-loop users of the last row (the ceiling)")
    args = parser.parse_args()
    port = free_port()
    server = multiprocessing.get_context("spawn").Process(target=serve, args=(port, args.chunks), daemon=True)
    server.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(url + "/v1/models", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    print(f"endpoint: {args.chunks} chunks per request, first after {FIRST_TOKEN_DELAY_S * 1000:.0f} ms")
    print(f"{'offered req/s':>14} {'sustained req/s':>16} {'sustained/offered':>18} "
          f"{'TTFT error mean ms':>19} {'TTFT error p99 ms':>18} {'failed':>7}")
    try:
        for rate in (float(r) for r in args.rates.split(",")):
            sustained, err_mean, err_p99, failed = asyncio.run(measure(url, rate, args.seconds))
            print(f"{rate:>14.0f} {sustained:>16.1f} {sustained / rate:>18.3f} {err_mean:>19.2f} {err_p99:>18.2f} "
                  f"{failed:>7}")
        # The ceiling: a closed loop offers as fast as the generator can send.
        sustained, err_mean, err_p99, failed = asyncio.run(
            measure(url, math.inf, args.seconds, users=args.users, num=int(500 * args.seconds)))
        print(f"{f'{args.users} users':>14} {sustained:>16.1f} {'-':>18} {err_mean:>19.2f} {err_p99:>18.2f} "
              f"{failed:>7}")
    finally:
        server.terminate()
        server.join(timeout=10)


if __name__ == "__main__":
    main()
