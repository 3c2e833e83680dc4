"""The run: probe the server, draw the requests, send them in the configured load shape, collect the records.

`run_benchmark(config) -> BenchResult` is the library entry (`npuserve bench`, the tuner's benchmark trials): it
prints nothing; `on_record` sees each record as it ends (progress bars, the trace file) and setting `stop` ends
the sending early (Ctrl-C), after which in-flight requests get `grace_s` to finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx
from pydantic import BaseModel

from npuserve.loadgen.arrivals import RequestQueue, iter_send_offsets, think_time
from npuserve.loadgen.client import ConnectionPool, send
from npuserve.loadgen.config import BenchConfig
from npuserve.loadgen.datasets import dataset_label, load_requests
from npuserve.loadgen.metrics import BenchMetrics, compute_metrics
from npuserve.loadgen.records import BenchRequest, RequestRecord, TokenCountSource
from npuserve.loadgen.result import BenchResult
from npuserve.loadgen.tokenizer import TokenCounter, TokenizerError, load_tokenizer

RecordHook = Callable[[RequestRecord], None]


class ServerUnreachable(RuntimeError):
    """Nothing answers at the base URL (or it answers nothing we can use); raised before any load is sent."""


class ServerInfo(BaseModel):
    model: str
    model_root: str | None = None  # the model folder the server names (vLLM and npuserve: `root` of /v1/models)


async def probe(http: httpx.AsyncClient, base_url: str, model: str | None) -> ServerInfo:
    """The served model, from `/v1/models` (or the given name when the server has no such route, as TGI)."""
    try:
        response = await http.get("/v1/models", timeout=10.0)
    except httpx.HTTPError as e:
        raise ServerUnreachable(f"cannot reach {base_url}: {type(e).__name__}: {e}") from None
    if response.status_code == 200:
        cards = response.json().get("data") or []
        chosen = next((c for c in cards if model is None or c.get("id") == model), None)
        if chosen is None:
            names = ", ".join(str(c.get("id")) for c in cards) or "none"
            raise ServerUnreachable(f"{base_url} serves no model named {model!r} (it serves: {names})")
        return ServerInfo(model=str(chosen["id"]), model_root=chosen.get("root"))
    if model is None:
        raise ServerUnreachable(f"{base_url}/v1/models answered {response.status_code}; name the model: --model")
    return ServerInfo(model=model)


def choose_tokenizer(config: BenchConfig, info: ServerInfo) -> TokenCounter | None:
    """--tokenizer, else the model folder the server names when it is on this machine, else none (the server's
    counts, or one token per chunk)."""
    if config.tokenizer is not None:
        return load_tokenizer(config.tokenizer)
    if info.model_root and (Path(info.model_root) / "tokenizer.json").is_file():
        with contextlib.suppress(TokenizerError):
            return load_tokenizer(Path(info.model_root))
    return None


class _Run:
    """One run's moving parts: the pool, the clock, the records, the stop signal."""

    def __init__(self, config: BenchConfig, pool: ConnectionPool, model: str, tokenizer: TokenCounter | None,
                 on_record: RecordHook | None, stop: asyncio.Event):
        self.config = config
        self.pool = pool
        self.model = model
        self.tokenizer = tokenizer
        self.on_record = on_record
        self.stop = stop
        self.records: list[RequestRecord] = []
        self.start = time.perf_counter()
        self.deadline = math.inf
        self.in_flight: set[asyncio.Task[None]] = set()
        self.next_index = 0

    def clock(self) -> float:
        return time.perf_counter() - self.start

    def sending(self) -> bool:
        return not self.stop.is_set() and self.clock() < self.deadline

    async def one(self, request: BenchRequest, *, user: int | None, warmup: bool) -> None:
        record = RequestRecord(index=self.next_index, user=user, warmup=warmup, t0=0.0)
        self.next_index += 1
        await send(self.pool, self.config.endpoint, request, record, model=self.model,
                   ignore_eos=self.config.ignore_eos, tokenizer=self.tokenizer, clock=self.clock)
        self.records.append(record)
        if self.on_record is not None:
            self.on_record(record)

    def spawn(self, request: BenchRequest, *, user: int | None = None, warmup: bool = False) -> asyncio.Task[None]:
        task = asyncio.create_task(self.one(request, user=user, warmup=warmup))
        self.in_flight.add(task)
        task.add_done_callback(self.in_flight.discard)
        return task

    async def closed_loop(self, requests: list[BenchRequest], users: int, cycle: bool, *, warmup: bool) -> None:
        """`users` users pull from one shared queue; each waits its think time between requests."""
        queue = RequestQueue(len(requests), cycle=cycle)
        rng = random.Random(self.config.load.seed + 1)

        async def user(u: int) -> None:
            while warmup or self.sending():
                index = queue.take()
                if index is None or self.stop.is_set():
                    return
                await self.spawn(requests[index], user=u, warmup=warmup)
                pause = think_time(rng, self.config.load.think_time_s)
                if pause > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.stop.wait(), timeout=pause)

        await asyncio.gather(*(user(u) for u in range(users)))

    async def open_loop(self, requests: list[BenchRequest], cycle: bool) -> None:
        """Requests leave at the configured rate, held to max_concurrency in flight when it is set."""
        load = self.config.load
        limit = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
        offsets = iter_send_offsets(load.request_rate, load.burstiness, random.Random(load.seed + 1))
        queue = RequestQueue(len(requests), cycle=cycle)

        async def gated(request: BenchRequest) -> None:
            assert limit is not None
            async with limit:
                if self.sending():
                    await self.one(request, user=None, warmup=False)

        for offset in offsets:
            index = queue.take()
            if index is None:
                break
            delay = offset - self.clock()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), timeout=delay)
            if not self.sending():
                break
            request = requests[index]
            if limit is None:
                self.spawn(request)
            else:
                task = asyncio.create_task(gated(request))
                self.in_flight.add(task)
                task.add_done_callback(self.in_flight.discard)
        if self.in_flight:
            await asyncio.wait(set(self.in_flight))


@dataclass(frozen=True)
class PreparedRun:
    """What a run needs before it sends: the served model, the tokenizer, the drawn requests (warm-up first). A
    sweep or a capacity search prepares once and runs every point on it: one probe, one tokenizer load, one draw."""

    info: ServerInfo
    tokenizer: TokenCounter | None
    requests: list[BenchRequest]


async def prepare(config: BenchConfig) -> PreparedRun:
    async with httpx.AsyncClient(base_url=config.base_url) as http:
        info = await probe(http, config.base_url, config.model)
    tokenizer = choose_tokenizer(config, info)
    load = config.load
    drawn = load_requests(config.dataset, load.warmup_requests + load.num_prompts, tokenizer=tokenizer,
                          seed=load.seed)
    return PreparedRun(info, tokenizer, drawn)


async def run_benchmark(config: BenchConfig, *, on_record: RecordHook | None = None,
                        stop: asyncio.Event | None = None, grace_s: float = 5.0,
                        prepared: PreparedRun | None = None) -> BenchResult:
    """One run. `prepared` (from `prepare` on a config with the same server, dataset, seed and counts) skips the
    probe, the tokenizer load and the draw."""
    load = config.load
    if load.duration_s is not None and load.max_concurrency is None and not math.isfinite(load.request_rate):
        raise ValueError("--duration with an unbounded --request-rate sends without end: give --max-concurrency "
                         "or --request-rate")
    stop = stop or asyncio.Event()
    prepared = prepared or await prepare(config)
    info, tokenizer = prepared.info, prepared.tokenizer
    warmups, requests = prepared.requests[:load.warmup_requests], prepared.requests[load.warmup_requests:]
    async with contextlib.AsyncExitStack() as stack:
        pool = ConnectionPool(config.base_url, config.request_timeout_s)
        stack.push_async_callback(pool.aclose)
        trace = stack.enter_context(config.save_trace.open("w")) if config.save_trace else None

        def hook(record: RequestRecord) -> None:
            if trace is not None:
                trace.write(record.model_dump_json() + "\n")
                trace.flush()
            if on_record is not None:
                on_record(record)

        run = _Run(config, pool, info.model, tokenizer, hook, stop)
        if warmups:
            await run.closed_loop(warmups, load.max_concurrency or 1, cycle=False, warmup=True)
        run.start = time.perf_counter()
        started_at = datetime.now().astimezone()
        run.deadline = load.duration_s if load.duration_s is not None else math.inf
        cycle = load.duration_s is not None
        sender = (run.closed_loop(requests, load.max_concurrency or 1, cycle, warmup=False)
                  if load.closed_loop else run.open_loop(requests, cycle))
        sending = asyncio.ensure_future(sender)
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({sending, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not sending.done():
            # Interrupted: no new request leaves; the ones in flight get a grace period, then are dropped.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(sending), timeout=grace_s)
            for task in list(run.in_flight):
                task.cancel()
            sending.cancel()
            await asyncio.gather(sending, *run.in_flight, return_exceptions=True)
        stopped.cancel()
    measured = [r for r in run.records if not r.warmup]
    ended = max((r.end or r.t0 for r in measured), default=run.clock())
    sources = [r.token_source for r in measured if r.token_source is not None]
    source = max(set(sources), key=sources.count) if sources else TokenCountSource.CHUNKS
    return BenchResult(
        config=config, model=info.model, started_at=started_at, duration_s=max(ended, 1e-9), records=run.records,
        token_source=source, tokenizer=tokenizer.name if tokenizer is not None else None,
        dataset=dataset_label(config.dataset), interrupted=stop.is_set(),
    )


class BenchReport(BaseModel):
    """A run and its figures: what `benchmark` returns to a library caller (the tuner's benchmark trials)."""

    result: BenchResult
    metrics: BenchMetrics


async def benchmark(config: BenchConfig, *, on_record: RecordHook | None = None, stop: asyncio.Event | None = None,
                    extra_percentiles: tuple[float, ...] = ()) -> BenchReport:
    """`run_benchmark`, then the figures of docs/loadgen.md#what-it-measures over its measured records (SLOs from the
    config)."""
    result = await run_benchmark(config, on_record=on_record, stop=stop)
    metrics = compute_metrics(result.measured, result.duration_s, config.slo, extra_percentiles)
    return BenchReport(result=result, metrics=metrics)
