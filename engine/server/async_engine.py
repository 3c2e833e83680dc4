"""`AsyncEngine`: runs the engine's steps in one thread, its output processing in another, and hands each
request's outputs to asyncio.

The event loop never blocks on the device: requests are queued into the engine (thread-safe). The step thread runs
`LLMEngine.run_step()` back to back and queues each step's raw results (`SeqUpdate`s) to the output thread, which
detokenizes, checks stop strings (a hit is sent back with `LLMEngine.stop_sequence`, applied at the next step) and
pushes outputs into per-request asyncio queues with `call_soon_threadsafe`: a slow detokenize never stretches a
step (vLLM v1's engine-core / output-processor split). A consumer that goes away (client disconnect, cancellation)
aborts its request so its KV blocks are freed at the next step.

Failing loudly (docs/engine.md#errors-and-health): with one rank, a step that raises fails its requests and the
server goes on, unless `MAX_CONSECUTIVE_STEP_FAILURES` steps fail in a row. With several ranks any step error is
fatal: the other ranks are inside the operation rank 0 sent them, and the next collective would wait forever. A
fatal error (that, a rank that dies, the step watchdog's expiry) sends every request in flight its error, writes
the termination message, ends the other ranks and exits the process non-zero.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass

from npuserve.engine.engine import EngineSnapshot, LLMEngine, StepUpdates
from npuserve.engine.output_processor import RequestOutput
from npuserve.engine.sequence import FinishReason, SamplingParams
from npuserve.engine.server.fatal import EXIT_CODE, hard_exit, write_termination_message
from npuserve.engine.server.metrics import EngineMetrics, FinishedRequestSample
from npuserve.engine.server.watchdog import StepWatchdog
from npuserve.engine.step_output import SeqUpdate
from npuserve.mindie_config import ScheduleSection

log = logging.getLogger(__name__)

_IDLE_WAIT_SECONDS = 0.05  # how long the step thread sleeps with nothing to do (woken early by new requests)
_DELAY_POLL_SECONDS = 0.0005  # requests wait out maxQueueDelayMicroseconds: poll, do not spin


# One rank: this many failed steps in a row (none completing between them) and the engine exits; a step that
# fails now and then (one bad batch) fails its requests and the server goes on.
MAX_CONSECUTIVE_STEP_FAILURES = 5
# A fatal error: how long the requests in flight have to be sent their error before the process exits, and how
# long their last bytes have to leave once every handler is done.
FATAL_FLUSH_SECONDS = 5.0
_FATAL_LINGER_SECONDS = 0.5

ENGINE_FAILURE_PREFIX = "engine step failed: "
ENGINE_FATAL_PREFIX = "the engine failed and exits: "
SHUTDOWN_PREFIX = "the server is shutting down"


def is_engine_failure(output: RequestOutput) -> bool:
    """The request ended because a step crashed or the engine failed (the server's fault), not because of the
    request itself."""
    return output.error is not None and output.error.startswith((ENGINE_FAILURE_PREFIX, ENGINE_FATAL_PREFIX))


def is_shutdown_cut(output: RequestOutput) -> bool:
    """The request was still running when the drain after SIGTERM ran out of time, and was cut."""
    return output.error is not None and output.error.startswith(SHUTDOWN_PREFIX)


class EngineOverloaded(RuntimeError):
    """The waiting queue is at its bound; the server answers 429 with Retry-After."""


class EngineDraining(RuntimeError):
    """The server is shutting down and takes no new requests; the server answers 503."""


@dataclass(frozen=True, slots=True)
class _ForOutput:
    """What the step thread queues to the output thread: raw updates to process, then outputs made already (the
    errors of requests the engine no longer knows)."""

    updates: list[SeqUpdate]
    made: list[RequestOutput]


@dataclass(slots=True)
class _Stream:
    queue: asyncio.Queue[RequestOutput]
    loop: asyncio.AbstractEventLoop
    last_token_time: float | None = None


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: EngineMetrics | None = None, max_waiting: int | None = None,
                 exit_process: Callable[[int], None] = hard_exit):
        """`exit_process(code)` ends the process on a fatal error (in-process tests record it instead)."""
        self.engine = engine
        self.metrics = metrics or EngineMetrics(engine.model_name)
        self.max_waiting = max_waiting if max_waiting is not None else engine.extensions.maxWaitingRequests
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._output_thread: threading.Thread | None = None
        self._for_output: queue.SimpleQueue[_ForOutput | None] = queue.SimpleQueue()
        self.steps_run = 0  # steps that ran the model (the step thread's count)
        self._ids = itertools.count()
        self.draining = False
        self.step_error: str | None = None
        self.fatal_error: str | None = None  # set once: the engine is exiting
        self._fatal_lock = threading.Lock()
        self._exit_process = exit_process
        self._consecutive_failures = 0
        ext = engine.extensions
        self.watchdog = StepWatchdog(ext.stepTimeoutSeconds, ext.stepTimeoutGraceSeconds, self._describe_ranks,
                                     on_stuck=write_termination_message, on_expired=self.fatal)
        if engine.workers is not None:  # a rank that dies: its requests get their error before the process exits
            engine.workers.on_death = self.fatal
        if engine.group is not None:  # another pod of the group whose link closes: the same
            engine.group.on_death = self.fatal
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[bool] | None = None
        self._publish_state(engine.snapshot)
        self.metrics.set_schedule_generation(engine.config.extensions.scheduleGeneration)

    # --- lifecycle ---------------------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.engine.ready and self._thread is not None and self._thread.is_alive() and not self.draining

    @property
    def health_error(self) -> str | None:
        """Why /health fails (the engine is exiting, or a step is stuck), or None when the process is healthy."""
        return self.fatal_error or self.watchdog.stuck

    def start(self) -> None:
        """Starts the step thread; called on the asyncio loop, whose outputs it then serves."""
        self._loop = asyncio.get_running_loop()
        if self._thread is None:
            self._output_thread = threading.Thread(target=self._emit, name="npuserve-outputs", daemon=True)
            self._output_thread.start()
            self._thread = threading.Thread(target=self._run, name="npuserve-step-loop", daemon=True)
            self._thread.start()
            self.watchdog.start()

    def stop(self) -> None:
        self.watchdog.stop()
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._output_thread is not None:
            self._for_output.put(None)  # after the step thread's last updates
            self._output_thread.join(timeout=10)

    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    async def drain(self, timeout: float) -> bool:
        """Stop taking requests and wait for the running ones; those still running after `timeout` are cut (their
        clients get an error, streams a last error event). True if all finished in time."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.num_in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.num_in_flight() == 0:
            return True
        self.cut_in_flight(f"{SHUTDOWN_PREFIX} and its drain timeout ({timeout:g} s) has passed: the request was "
                           "cut before it finished; send it again")
        return False

    def begin_drain(self, timeout: float) -> None:
        """SIGTERM (any thread, a signal handler included): stop taking requests now and drain on the loop, so the
        requests still running at the timeout are cut before the HTTP server gives up on their connections."""
        if self.draining and self._drain_task is not None:
            return
        self.draining = True
        loop = self._loop
        if loop is None or loop.is_closed():
            return

        def start() -> None:
            self._drain_task = loop.create_task(self.drain(timeout))

        loop.call_soon_threadsafe(start)

    def cut_in_flight(self, message: str) -> None:
        """Ends every request in flight with `message` (an error its client is sent: 503), aborting it in the
        engine (its blocks are freed at the next step); one log line per request. On the asyncio loop."""
        with self._lock:
            cut, self._streams = list(self._streams.items()), {}
        for rid, stream in cut:
            self.engine.abort(rid)
            stream.queue.put_nowait(_error_output(rid, message))
            log.warning("request %s cut at shutdown: still running when the drain timeout passed", rid)
        self._wake.set()

    def fatal(self, message: str) -> None:
        """Ends the engine (any thread, once): one critical log line, the termination message, an error for every
        request in flight (their handlers get up to FATAL_FLUSH_SECONDS to send it), the other ranks killed, then
        the process exits non-zero. The step thread is not waited for: it may be the thing that is stuck."""
        with self._fatal_lock:
            if self.fatal_error is not None:
                return  # another thread is already ending the engine
            self.fatal_error = message
        self.draining = True  # /ready fails and new requests get 503 while the last errors go out
        log.critical("%s", message)
        write_termination_message(message)
        with self._lock:
            streams = list(self._streams.items())
        errors = [_error_output(rid, ENGINE_FATAL_PREFIX + message) for rid, _ in streams]
        if self._output_thread is not None and self._output_thread.is_alive():
            # behind the outputs already queued: a request the failing step ended gets that end first
            self._for_output.put(_ForOutput([], errors))
        else:
            for (_, stream), output in zip(streams, errors, strict=True):
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, output)
        deadline = time.monotonic() + FATAL_FLUSH_SECONDS
        while self.num_in_flight() and time.monotonic() < deadline:
            time.sleep(0.02)
        if streams:
            time.sleep(_FATAL_LINGER_SECONDS)  # their last bytes leave the socket
        if self.engine.workers is not None:
            self.engine.workers.kill()
        self.watchdog.stop()
        self._stop.set()
        self._wake.set()
        self._exit_process(EXIT_CODE)

    def _describe_ranks(self, now: float) -> str:
        """The last operation each rank started, as rank 0 knows it (the other ranks do not report theirs)."""
        progress = self.engine.runner.progress
        world = self.engine.tp.world_size
        if world == 1:
            return f"the engine's one rank last started {progress.describe(now)}"
        others = "rank 1" if world == 2 else f"ranks 1-{world - 1}"
        told = ("rank 0 was still sending it to them: they may not have received it" if progress.phase == "sending"
                else f"the last operation rank 0 sent them is {progress.name}")
        return (f"tensor-parallel rank 0 last started {progress.describe(now)}; {others}: {told} (each rank's own "
                "progress is not reported: its log says more)")

    # --- requests ----------------------------------------------------------------------------------------------

    def num_waiting(self) -> int:
        """Requests not yet running: in the scheduler's waiting queue or still in the engine's inbox (from the
        snapshot the step thread published after its last step: the scheduler itself is the step thread's)."""
        snapshot = self.engine.snapshot
        return max(0, self.num_in_flight() - snapshot.running - snapshot.swapped)

    def submit(self, prompt: str | list[int], params: SamplingParams,
               request_id: str | None = None) -> RequestStream:
        """Queues a request, or raises at once (EngineOverloaded, EngineDraining, RequestError)."""
        if self.draining:
            raise EngineDraining("the server is shutting down")
        if self.num_waiting() >= self.max_waiting:
            raise EngineOverloaded(f"{self.num_waiting()} requests are waiting (the bound is {self.max_waiting})")
        rid = request_id or f"req-{next(self._ids)}"
        stream = _Stream(asyncio.Queue(), asyncio.get_running_loop())
        with self._lock:
            self._streams[rid] = stream
        try:
            if isinstance(prompt, str):
                self.engine.add_request(rid, prompt, params)
            else:
                self.engine.add_request(rid, None, params, prompt_token_ids=prompt)
        except BaseException:
            with self._lock:
                self._streams.pop(rid, None)
            raise
        self._wake.set()
        return RequestStream(self, rid, stream)

    def _release(self, rid: str, finished: bool) -> None:
        with self._lock:
            self._streams.pop(rid, None)
        if not finished:
            self.engine.abort(rid)  # client gone: blocks freed at the next step
            self._wake.set()

    def update_schedule(self, schedule: ScheduleSection) -> Future[ScheduleSection]:
        """Resolves with the schedule the scheduler runs once the step thread has taken it."""
        done = self.engine.update_schedule(schedule)
        self._wake.set()
        return done

    # --- the step thread ---------------------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set() and self.fatal_error is None:
            if not engine.has_unfinished():
                self._wake.wait(_IDLE_WAIT_SECONDS)
                self._wake.clear()
                continue
            self.watchdog.step_started()
            try:
                result = engine.run_step()
            except Exception as e:  # a broken step must fail its requests, not hang them
                self.watchdog.step_finished()
                self._step_failed(e)
                continue
            self.watchdog.step_finished()
            self.step_error = None
            self._consecutive_failures = 0
            if result.updates:
                self._for_output.put(_ForOutput(result.updates, []))
            self._record_step(result)
            if result.stats is None:  # no model ran: waiting out maxQueueDelayMicroseconds
                time.sleep(_DELAY_POLL_SECONDS)

    def _step_failed(self, e: Exception) -> None:
        error = f"{type(e).__name__}: {e}"
        operation = self.engine.runner.progress.describe()
        if self.engine.tp.world_size > 1:
            log.error("the traceback of tensor-parallel rank 0's failure", exc_info=e)
            self.fatal(f"tensor-parallel rank 0 failed in {operation}: {error}; the other ranks are inside the "
                       "operation it sent them and cannot go on without it, so the engine exits")
            return
        log.exception("engine step failed")
        self.step_error = error
        self._consecutive_failures += 1
        self._fail_all(ENGINE_FAILURE_PREFIX + error)
        if self._consecutive_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            self.fatal(f"{self._consecutive_failures} engine steps failed in a row, none completing between them "
                       f"(the last in {operation}: {error}); the engine exits for a restart")

    # --- the output thread -------------------------------------------------------------------------------------

    def _emit(self) -> None:
        """Turns each step's updates into outputs (detokenization, stop strings) and delivers them, in order."""
        outputs = self.engine.outputs  # this thread's alone
        while (item := self._for_output.get()) is not None:
            made = item.made
            try:
                processed = outputs.process(item.updates)
            except Exception as e:  # its requests end with the error (aborted in the engine), the others go on
                log.exception("output processing failed")
                processed, error = [], f"{ENGINE_FAILURE_PREFIX}{type(e).__name__}: {e}"
                for rid in dict.fromkeys(u.request_id for u in item.updates):
                    self.engine.abort(rid)
                    made = [*made, _error_output(rid, error)]
            now = time.monotonic()
            self.metrics.observe_generated(sum(len(output.new_token_ids) for output in processed))
            for output in processed:
                self._deliver(output, now)
            for output in made:
                with self._lock:
                    stream = self._streams.get(output.request_id)
                if stream is not None:
                    stream.loop.call_soon_threadsafe(stream.queue.put_nowait, output)

    def _record_step(self, result: StepUpdates) -> None:
        step = result.stats
        if step is not None:
            self.steps_run += 1
            preemptions = result.num_preemptions
            if step.num_prefill_seqs:
                self.metrics.observe_step("prefill", step.num_prefill_seqs, preemptions)
                preemptions = 0
            if step.num_decode_seqs:  # a MIXED step observes both batch sizes
                self.metrics.observe_step("decode", step.num_decode_seqs, preemptions)
        elif result.num_preemptions:
            self.metrics.observe_step("decode", 0, result.num_preemptions)
        self._publish_state(result.snapshot)

    def _publish_state(self, snapshot: EngineSnapshot) -> None:
        self.metrics.set_state(running=snapshot.running, waiting=snapshot.waiting, swapped=snapshot.swapped,
                               kv_usage=snapshot.kv_usage, kv_blocks_total=snapshot.kv_blocks_total,
                               batch_cap=snapshot.batch_cap)

    def _deliver(self, output: RequestOutput, now: float) -> None:
        with self._lock:
            stream = self._streams.get(output.request_id)
        if stream is not None:
            if output.new_token_ids:
                if stream.last_token_time is not None:
                    gap = (now - stream.last_token_time) / len(output.new_token_ids)
                    for _ in output.new_token_ids:
                        self.metrics.observe_inter_token_latency(gap)
                stream.last_token_time = now
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, output)
        if output.finished:
            self.metrics.observe_finished(_sample(output))

    def _fail_all(self, error: str) -> None:
        """Every unfinished request ends with `error`, its blocks freed; its client gets the error."""
        try:
            failed = self.engine.fail_all(error)
        except Exception:  # the engine's state is past repair: answer the clients anyway
            log.exception("could not end the requests of a failed step")
            failed = []
        known = {u.request_id for u in failed}
        with self._lock:
            orphans = [rid for rid in self._streams if rid not in known]
        self._for_output.put(_ForOutput(failed, [_error_output(rid, error) for rid in orphans]))
        self._publish_state(self.engine.snapshot)


class RequestStream:
    """One request's outputs as they come; the last has `finished`. Closing it early aborts the request."""

    def __init__(self, owner: AsyncEngine, request_id: str, stream: _Stream) -> None:
        self.request_id = request_id
        self._owner = owner
        self._stream = stream
        self._finished = False
        self._closed = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self._finished:
                output = await self._stream.queue.get()
                self._finished = bool(output.last)
                yield output
        finally:
            self.close()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._owner._release(self.request_id, self._finished)


def _error_output(request_id: str, error: str) -> RequestOutput:
    """The last output of a request that ends with `error`, sent to its handler."""
    return RequestOutput(request_id=request_id, new_token_ids=[], new_text="", new_logprobs=None, token_ids=[],
                         text="", num_prompt_tokens=0, finished=True, finish_reason=FinishReason.ERROR, error=error)


def _sample(output: RequestOutput) -> FinishedRequestSample:
    m = output.metrics
    return FinishedRequestSample(
        finish_reason=(output.finish_reason or FinishReason.ABORT).value,
        prompt_tokens=output.num_prompt_tokens if output.index == 0 else 0,  # a request's prompt counts once
        generation_tokens=len(output.token_ids),
        queue_time=m.get("queue_time", m.get("e2e", 0.0)),
        prefill_time=m.get("prefill_time", 0.0),
        decode_time=m.get("decode_time", 0.0),
        e2e_latency=m.get("e2e", 0.0),
        time_to_first_token=m.get("ttft"),
    )
