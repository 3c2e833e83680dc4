#!/usr/bin/env python3
"""Synthetic engines: one process that answers as N engine pods, for the operator's autotune loop at scale.

    .venv/bin/python benchmarks/synthetic_engines.py --pods pods.json [--stats stats.json]

`pods.json` is a list of `{"name": pod, "ip": podIP, "token": admin token, "kv_blocks": blocks}`. For each pod the
process listens on `<podIP>:8000` (the engine's port; every 127.0.0.0/8 address is the loopback, so the local
cluster's KWOK pod IPs can be bound without configuring anything): a standard-library threaded HTTP server per pod,
HTTP/1.0 (each connection closed after its response: with keep-alive, a few hundred pods' scrapers and the
operator's clients left thousands of connections to a single event loop). It answers as the engine does:

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
import hmac
import json
import math
import random
import resource
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError

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


Reply = tuple[int, bytes, dict[str, str]]  # status, body, headers


def _json(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> Reply:
    return status, json.dumps(body).encode(), {"Content-Type": "application/json", **(headers or {})}


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> Reply:
    # The engine's APIError body (engine/server/errors.py): OpenAI's error shape.
    return _json(status, {"error": {"message": message, "type": "invalid_request_error", "code": status}}, headers)


class _Handler(BaseHTTPRequestHandler):
    """One request to one pod's address; HTTP/1.0, so the connection closes after the response (nothing idles)."""

    server: _PodServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, reply: Reply, head: bool = False) -> None:
        status, body, headers = reply
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _route(self, head: bool = False) -> None:
        engines, pod = self.server.engines, self.server.pod
        path = self.path.split("?", 1)[0]
        if path == contract.HEALTH_PATH:
            self._send(_json(200, {"status": "ok"}), head)
        elif path == contract.READY_PATH:
            self._send(_json(200, {"ready": True}), head)
        elif path == contract.INFO_PATH:
            self._send(engines.info(pod), head)
        elif path == "/metrics":
            self._send(engines.metrics(pod), head)
        else:
            self._send(_error(404, f"{path} not found"), head)

    def do_GET(self) -> None:
        self._route()

    def do_HEAD(self) -> None:
        self._route(head=True)

    def do_PUT(self) -> None:
        if self.path.split("?", 1)[0] != contract.ADMIN_SCHEDULE_PATH:
            self._send(_error(404, f"{self.path} not found"))
            return
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._send(self.server.engines.put_schedule(self.server.pod, self.headers.get("Authorization"), body))


class _PodServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128

    def __init__(self, engines: SyntheticEngines, pod: SyntheticPod, port: int) -> None:
        self.engines, self.pod = engines, pod
        super().__init__((pod.ip, port), _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client that went away (a scrape timeout)
            super().handle_error(request, client_address)


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
        self.servers: list[_PodServer] = []

    # -- HTTP: a threaded server on each pod's address --

    def info(self, pod: SyntheticPod) -> Reply:
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

    def metrics(self, pod: SyntheticPod) -> Reply:
        pod.scrapes += 1
        with self.lock:
            body = pod.metrics.render()
        return 200, body, {"Content-Type": CONTENT_TYPE_LATEST}

    def put_schedule(self, pod: SyntheticPod, authorization: str | None, raw: bytes) -> Reply:
        reply = self._put_schedule(pod, authorization, raw)
        with self.lock:
            pod.puts[reply[0]] = pod.puts.get(reply[0], 0) + 1
        return reply

    def _put_schedule(self, pod: SyntheticPod, authorization: str | None, raw: bytes) -> Reply:
        scheme, _, token = (authorization or "").partition(" ")
        if not pod.token:
            return _error(403, f"the admin API is disabled: set {contract.ADMIN_TOKEN_ENV} to enable it")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), pod.token.encode()):
            return _error(401, "a valid bearer token is required", {"WWW-Authenticate": "Bearer"})
        try:
            body = ScheduleUpdate.model_validate_json(raw)
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
                    sample = m.sample(batch, self.rng)
                    pod.metrics.observe_generated(sample.generation_tokens)  # a synthetic request's tokens at once
                    pod.metrics.observe_finished(sample)
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

    def serve(self, ready: threading.Event | None = None) -> None:
        """Binds every pod's address, then serves until `stop()` (SIGTERM/SIGINT from the command line)."""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # a listening socket per pod, a connection per call
        want = 4 * len(self.pods) + 256
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard),
                                                        hard))
        self.servers = [_PodServer(self, pod, self.port) for pod in self.pods.values()]
        self.record(0.0)  # the gauges before the first scrape
        threads = [threading.Thread(target=self.traffic, name="traffic", daemon=True)]
        threads += [threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 2.0}, daemon=True,
                                     name=f"http-{srv.pod.ip}") for srv in self.servers]
        for t in threads:
            t.start()
        if ready is not None:
            ready.set()
        self.stopping.wait()
        for srv in self.servers:  # no shutdown(): it waits out each server's poll in turn; the threads are daemons
            srv.server_close()

    def stop(self) -> None:
        self.stopping.set()

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
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: engines.stop())
    try:
        engines.serve()
    finally:
        if args.stats is not None:
            args.stats.write_text(json.dumps(engines.stats(), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
