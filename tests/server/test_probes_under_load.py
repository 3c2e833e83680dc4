"""No request can stall another: `/health` and `/ready` answer within 100 ms while a maximal prompt (15 MB, under
the 16 MiB body limit) is tokenized and while a burst of 4,000 concurrent requests arrives, on the real `npuserve
serve` (a process of its own). Before, tokenization ran on the asyncio loop: /ready took 15.4 s behind a 15 MB prompt.

How the latency is judged on a shared 2-core machine: a prober of its own (another process, so the load generator's
work does not delay it) sends a probe every 20 ms on a fresh connection, as the kubelet does, while the load runs,
and records each probe's time from connect to the last byte. The budget of 100 ms is held by the 90th percentile:
a stalled loop fails every probe of the stall (today all of them, by seconds), while one probe delayed by the
machine's other tenants does not fail the test; and no probe may take a second (the kubelet's default timeout, where
a pod is restarted or taken out of service). The figures are printed.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.serve_process import serve_process

BUDGET_S = 0.100
KUBELET_TIMEOUT_S = 1.0

PROBER = r"""
import json, socket, sys, time
port, stop = int(sys.argv[1]), sys.argv[2]
import os
seen = []
i = 0
while not os.path.exists(stop):
    path = "/health" if i % 2 == 0 else "/ready"
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    seen.append([path, time.monotonic() - t0, int(data.split(b" ", 2)[1])])
    i += 1
    time.sleep(0.02)
print(json.dumps(seen))
"""


class Prober:
    """Probes the server from another process until stopped; the latencies it saw."""

    def __init__(self, port: int, folder: Path) -> None:
        self.stop_file = folder / f"stop-{time.monotonic_ns()}"
        self.proc = subprocess.Popen([sys.executable, "-P", "-c", PROBER, str(port), str(self.stop_file)],
                                     stdout=subprocess.PIPE, text=True)

    def finish(self) -> list[tuple[str, float, int]]:
        self.stop_file.touch()
        out, _ = self.proc.communicate(timeout=60)
        return [(p, t, s) for p, t, s in json.loads(out)]


def _judge(seen: list[tuple[str, float, int]], what: str) -> None:
    latencies = sorted(t for _, t, _ in seen)
    p90 = latencies[int(0.9 * (len(latencies) - 1))]
    print(f"\n{what}: {len(seen)} probes, median {statistics.median(latencies) * 1000:.1f} ms, "
          f"p90 {p90 * 1000:.1f} ms, max {latencies[-1] * 1000:.1f} ms")
    assert len(seen) >= 10, "too few probes to judge"
    assert all(status == 200 for _, _, status in seen), seen
    assert p90 <= BUDGET_S, f"{what}: p90 probe latency {p90 * 1000:.0f} ms over {BUDGET_S * 1000:.0f} ms"
    assert latencies[-1] < KUBELET_TIMEOUT_S, f"{what}: a probe took {latencies[-1]:.2f} s"


@pytest.fixture(scope="module")
def serve(tiny_model_dir: Path) -> Iterator[int]:
    with serve_process("--model", str(tiny_model_dir), "--log-level", "warning") as (base, _):
        yield int(base.rsplit(":", 1)[1])


def _words(num_bytes: int) -> str:
    """Text that does not repeat (the tokenizer caches words it has seen, which would make it fast)."""
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    out, size = [], 0
    while size < num_bytes:
        word = "".join(rng.choice(letters) for _ in range(rng.randint(2, 9)))
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:num_bytes]


def test_probes_answer_while_a_maximal_prompt_is_tokenized(serve: int, tmp_path: Path) -> None:
    prompt = _words(15_000_000)
    answer: list[httpx.Response] = []

    def send() -> None:
        answer.append(httpx.post(f"http://127.0.0.1:{serve}/v1/completions", json={"prompt": prompt, "max_tokens": 1},
                                 timeout=300))

    prober = Prober(serve, tmp_path)
    time.sleep(0.3)
    sender = threading.Thread(target=send)
    started = time.monotonic()
    sender.start()
    sender.join(300)
    took = time.monotonic() - started
    seen = prober.finish()
    assert answer and answer[0].status_code == 400  # tokenized, then refused: over maxInputTokenLen
    assert "maxInputTokenLen" in answer[0].json()["error"]["message"]
    assert took > 1.0, f"the prompt was handled in {took:.2f} s: too fast to show a stall"
    _judge(seen, f"15 MB prompt ({took:.1f} s to tokenize and refuse)")


async def _burst(port: int, n: int) -> dict[int, int]:
    """n requests at once, each on its own connection (raw asyncio streams: a light client); statuses counted."""
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: load\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()

    async def one() -> int:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head + body)
        await writer.drain()
        data = await reader.read()
        writer.close()
        return int(data.split(b" ", 2)[1]) if data else 0

    statuses: dict[int, int] = {}
    for status in await asyncio.gather(*(one() for _ in range(n)), return_exceptions=True):
        key = status if isinstance(status, int) else -1
        statuses[key] = statuses.get(key, 0) + 1
    return statuses


def test_probes_answer_while_4000_concurrent_requests_arrive(serve: int, tmp_path: Path) -> None:
    prober = Prober(serve, tmp_path)
    time.sleep(0.3)
    started = time.monotonic()
    statuses = asyncio.run(_burst(serve, 4000))
    took = time.monotonic() - started
    seen = prober.finish()
    assert set(statuses) <= {200, 429} and sum(statuses.values()) == 4000, statuses
    _judge(seen, f"4000 concurrent requests ({took:.1f} s, statuses {statuses})")
