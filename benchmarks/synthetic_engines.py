#!/usr/bin/env python3
"""Synthetic engines: one process that answers as N engine pods, for the operator's autotune loop at scale.

    .venv/bin/python benchmarks/synthetic_engines.py --pods pods.json [--stats stats.json]

`pods.json` is a list of `{"name": pod, "ip": podIP, "token": admin token, "kv_blocks": blocks}`. For each pod the
process listens on `<podIP>:8000` (the engine's port; every 127.0.0.0/8 address is the loopback, so the local
cluster's KWOK pod IPs can be bound without configuring anything) and answers as the engine does:

- `GET /metrics`: the pod's own `EngineMetrics` registry (`engine/server/metrics.py`): the engine's metric families,
  labels and buckets, rendered by the engine's code, so Prometheus scrapes exactly the engine's exposition;
- `GET /health`, `GET /ready`: 200, the engine's bodies;
- `GET /info`: an `EngineInfo` (the contract's model; the operator's readiness reads `kv_blocks` from it);
- `PUT /admin/schedule`: the bearer token checked as the engine does (401, 403 without a token), the body validated
  by the engine's own `ScheduleUpdate` (422), and the engine's generation rule (`admin.generation_refusal`: a
  generation not newer than the running one is refused with 409); an accepted schedule is applied at once and the
  schedule-generation gauge set to its generation.

Traffic: no requests are served; a model of a loaded engine records finished requests into each registry in real time
(a background thread, every `--tick` seconds). Each pod has `--concurrency` requests in flight, offered by clients
that never stop; the scheduler runs `running = min(maxBatchSize, concurrency)` of them and the rest wait. Per
request, drawn around (lognormal, `--jitter`) the model's means:

    TPOT = tpot_base + tpot_per_request * running                      (seconds per output token after the first)
    TTFT = prefill + queue_per_waiting * waiting / running             (waiting = concurrency - running)
    output tokens uniform in [output_tokens / 2, 3 * output_tokens / 2]; e2e = TTFT + (tokens - 1) * TPOT

With the defaults (10 ms + 0.01 ms x running, 3000 in flight) TPOT is 40 ms at the plan's starting batch (4096:
every request runs) and 30 ms at 2000: a decodeLatency SLO of tpotMs 30 has its optimum near maxBatchSize 2000, which
the tuner must find from the windows. The finished-request rate is `--rate` per pod and per second, whatever the
batch (not Little's law: recording running/e2e requests per second for 300 pods would cost more CPU than the operator
under test; the tuner judges latencies, which the batch sets, and needs only `minSamples` requests per window). The
gauges follow the model: running, waiting, KV usage = running x blocks per request / blocks; the token counters
follow the recorded requests. A schedule applied takes effect at once (no draining: the operator's settling time is
still spent).

Importable: `SyntheticEngines(pods, model).serve()`; `TrafficModel` holds the formula.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import math
import random
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from npuserve import engine_contract as contract
from npuserve.engine.server.admin import generation_refusal
from npuserve.engine.server.metrics import EngineMetrics, FinishedRequestSample
from npuserve.engine.server.protocol import ScheduleUpdate
from npuserve.engine_contract import EngineInfo

MODEL_NAME = "tiny"
BLOCK_SIZE = 128


@dataclass(frozen=True)
class TrafficModel:
    """The synthetic engine's latencies as functions of the applied maxBatchSize (see the module's docstring)."""

    concurrency: int = 3000  # requests in flight per pod
    tpot_base_s: float = 0.010
    tpot_per_request_s: float = 0.00001
    prefill_s: float = 0.020
    queue_per_waiting_s: float = 2.0  # TTFT's queueing part per waiting request per running one
    output_tokens: int = 128
    prompt_tokens: int = 64
    rate: float = 4.0  # finished requests recorded per pod and second
    jitter: float = 0.10  # sigma of the lognormal factor on each request's TTFT and TPOT
    blocks_per_request: float = 2.0

    def running(self, max_batch: int) -> int:
        return max(1, min(max_batch, self.concurrency))

    def waiting(self, max_batch: int) -> int:
        return max(0, self.concurrency - self.running(max_batch))

    def tpot_s(self, max_batch: int) -> float:
        return self.tpot_base_s + self.tpot_per_request_s * self.running(max_batch)

    def ttft_s(self, max_batch: int) -> float:
        return self.prefill_s + self.queue_per_waiting_s * self.waiting(max_batch) / self.running(max_batch)

    def sample(self, max_batch: int, rng: random.Random) -> FinishedRequestSample:
        def noisy(x: float) -> float:
            return x * math.exp(rng.gauss(-self.jitter**2 / 2, self.jitter))

        tokens = rng.randint(max(2, self.output_tokens // 2), max(2, 3 * self.output_tokens // 2))
        ttft, tpot = noisy(self.ttft_s(max_batch)), noisy(self.tpot_s(max_batch))
        queue = max(0.0, ttft - self.prefill_s)
        decode = (tokens - 1) * tpot
        return FinishedRequestSample(finish_reason=contract.FINISHED_REASON_STOP, prompt_tokens=self.prompt_tokens,
                                     generation_tokens=tokens, queue_time=queue, prefill_time=ttft - queue,
                                     decode_time=decode, e2e_latency=ttft + decode, time_to_first_token=ttft)


@dataclass
class SyntheticPod:
    name: str
    ip: str
    token: str
    kv_blocks: int = 8192
    schedule: dict[str, Any] = field(default_factory=lambda: {"maxBatchSize": 4096})
    generation: int | None = None
    metrics: EngineMetrics = field(init=False)
    owed: float = 0.0  # fractional requests carried to the next tick
    puts: dict[int, int] = field(default_factory=dict)  # HTTP status -> count
    scrapes: int = 0
    infos: int = 0

    def __post_init__(self) -> None:
        self.metrics = EngineMetrics(MODEL_NAME)
        self.metrics.set_schedule_generation(self.generation)

    @property
    def max_batch(self) -> int:
        return int(self.schedule.get("maxBatchSize") or 1)


def _json(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers=headers)


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    # The engine's APIError body (engine/server/errors.py): OpenAI's error shape.
    return _json(status, {"error": {"message": message, "type": "invalid_request_error", "code": status}}, headers)


class SyntheticEngines:
    def __init__(self, pods: list[SyntheticPod], model: TrafficModel, port: int = contract.ENGINE_PORT,
                 tick: float = 0.5, seed: int = 0) -> None:
        self.pods = {p.ip: p for p in pods}
        self.model = model
        self.port = port
        self.tick = tick
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.recorded = 0
        self.app = Starlette(routes=[
            Route(contract.HEALTH_PATH, self.health, methods=["GET", "HEAD"]),
            Route(contract.READY_PATH, self.ready, methods=["GET", "HEAD"]),
            Route(contract.INFO_PATH, self.info, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET", "HEAD"]),
            Route(contract.ADMIN_SCHEDULE_PATH, self.put_schedule, methods=["PUT"]),
        ])

    # -- HTTP, one app on every pod's address; the socket a request came in on names the pod --

    def _pod(self, request: Request) -> SyntheticPod:
        server = request.scope.get("server") or ("", 0)
        return self.pods[server[0]]

    async def health(self, request: Request) -> Response:
        return _json(200, {"status": "ok"})

    async def ready(self, request: Request) -> Response:
        return _json(200, {"ready": True})

    async def info(self, request: Request) -> Response:
        pod = self._pod(request)
        pod.infos += 1
        with self.lock:
            schedule = dict(pod.schedule)
            generation = pod.generation
        info = EngineInfo(model=MODEL_NAME, model_type="llama", dtype="float32", device="cpu", worldSize=1,
                          kv_blocks=pod.kv_blocks, kv_host_blocks=0, block_size=BLOCK_SIZE,
                          kv_bytes_per_block=131072, kv_sizing="synthetic", schedule=schedule,
                          scheduleGeneration=generation, served_model_name=MODEL_NAME, version="synthetic",
                          ready=True, num_requests_in_flight=self.model.concurrency)
        return _json(200, info.model_dump(mode="json"))

    async def metrics(self, request: Request) -> Response:
        pod = self._pod(request)
        pod.scrapes += 1
        with self.lock:
            body = pod.metrics.render()
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def put_schedule(self, request: Request) -> Response:
        pod = self._pod(request)
        response = await self._put_schedule(pod, request)
        pod.puts[response.status_code] = pod.puts.get(response.status_code, 0) + 1
        return response

    async def _put_schedule(self, pod: SyntheticPod, request: Request) -> Response:
        scheme, _, token = (request.headers.get("authorization") or "").partition(" ")
        if not pod.token:
            return _error(403, f"the admin API is disabled: set {contract.ADMIN_TOKEN_ENV} to enable it")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), pod.token.encode()):
            return _error(401, "a valid bearer token is required", {"WWW-Authenticate": "Bearer"})
        try:
            body = ScheduleUpdate.model_validate_json(await request.body())
        except ValidationError as e:
            return _error(422, str(e))
        changes = body.model_dump(exclude_none=True, exclude={contract.SCHEDULE_GENERATION_KEY})
        if not changes:
            return _error(422, "no ScheduleConfig field given")
        with self.lock:
            refusal = generation_refusal(pod.generation, body.scheduleGeneration)
            if refusal is not None:
                return _error(409, refusal)
            pod.schedule.update(changes)
            if body.scheduleGeneration is not None:
                pod.generation = body.scheduleGeneration
            pod.metrics.set_schedule_generation(pod.generation)
            schedule = dict(pod.schedule)
        return _json(200, {"schedule": schedule, contract.SCHEDULE_GENERATION_KEY: body.scheduleGeneration})

    # -- traffic --

    def record(self, dt: float) -> None:
        """Each pod's finished requests over the last `dt` seconds, and its gauges."""
        m = self.model
        for pod in self.pods.values():
            with self.lock:
                batch = pod.max_batch
                pod.owed += m.rate * dt
                n = int(pod.owed)
                pod.owed -= n
                for _ in range(n):
                    pod.metrics.observe_finished(m.sample(batch, self.rng))
                running = m.running(batch)
                pod.metrics.set_state(running=running, waiting=m.waiting(batch), swapped=0,
                                      kv_usage=min(1.0, running * m.blocks_per_request / pod.kv_blocks),
                                      kv_blocks_total=pod.kv_blocks)
            self.recorded += n

    def traffic(self) -> None:
        last = time.monotonic()
        while not self.stopping.wait(self.tick):
            now = time.monotonic()
            self.record(now - last)
            last = now

    # -- running --

    def sockets(self) -> list[socket.socket]:
        out = []
        for ip in self.pods:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((ip, self.port))
            s.listen(128)
            s.set_inheritable(True)
            out.append(s)
        return out

    def serve(self, ready: threading.Event | None = None) -> None:
        """Binds every pod's address, then serves until SIGINT/SIGTERM (uvicorn's handlers) or `stop()`."""
        socks = self.sockets()
        self.record(0.0)  # the gauges before the first scrape
        traffic = threading.Thread(target=self.traffic, name="traffic", daemon=True)
        traffic.start()
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off",
                                timeout_keep_alive=30)
        self.server = uvicorn.Server(config)
        if ready is not None:
            ready.set()
        try:
            asyncio.run(self.server.serve(sockets=socks))
        finally:
            self.stopping.set()
            traffic.join(5)
            for s in socks:
                s.close()

    def stop(self) -> None:
        self.stopping.set()
        server = getattr(self, "server", None)
        if server is not None:
            server.should_exit = True

    def stats(self) -> dict[str, Any]:
        puts: dict[str, int] = {}
        for pod in self.pods.values():
            for code, n in pod.puts.items():
                puts[str(code)] = puts.get(str(code), 0) + n
        batches = sorted(p.max_batch for p in self.pods.values())
        return {
            "pods": len(self.pods),
            "requests_recorded": self.recorded,
            "puts_by_status": puts,
            "scrapes": sum(p.scrapes for p in self.pods.values()),
            "pods_never_scraped": sum(1 for p in self.pods.values() if p.scrapes == 0),
            "info_reads": sum(p.infos for p in self.pods.values()),
            "max_batch_size": {"min": batches[0], "median": batches[len(batches) // 2], "max": batches[-1]}
            if batches else None,
            "model": asdict(self.model),
        }


def load_pods(path: Path) -> list[SyntheticPod]:
    return [SyntheticPod(name=p["name"], ip=p["ip"], token=p["token"], kv_blocks=int(p.get("kv_blocks", 8192)))
            for p in json.loads(path.read_text())]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=Path, required=True, help="JSON list of {name, ip, token, kv_blocks}")
    parser.add_argument("--stats", type=Path, help="write what was served here on exit (JSON)")
    parser.add_argument("--port", type=int, default=contract.ENGINE_PORT)
    parser.add_argument("--tick", type=float, default=0.5, help="seconds between two recordings of the traffic")
    defaults = TrafficModel()
    for name, value in asdict(defaults).items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    args = parser.parse_args()
    model = TrafficModel(**{k: getattr(args, k) for k in asdict(defaults)})
    engines = SyntheticEngines(load_pods(args.pods), model, port=args.port, tick=args.tick)
    signal.signal(signal.SIGTERM, lambda *_: engines.stop())
    try:
        engines.serve()
    finally:
        if args.stats is not None:
            args.stats.write_text(json.dumps(engines.stats(), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
