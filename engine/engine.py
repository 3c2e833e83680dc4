"""`LLMEngine`: the offline/online engine loop. One `run_step()` goes one way: `Scheduler.schedule()` (a frozen
`SchedulerOutput`) -> the step builder -> one `ModelRunner.execute` (the last step's fork copies, the swaps, the
forward) -> `Scheduler.update_from_output()`, which alone writes the step's results into the sequences -> each
sequence's raw results (`SeqUpdate`s: token ids, logprobs, finish
reasons). The output processor (`outputs`: detokenization, stop strings, `RequestOutput`s) turns those into
outputs off the step thread in the server (`server/async_engine.py`); `step()` runs both, one after the other, for
offline use.

Thread model (for the HTTP server): `add_request`, `abort`, `stop_sequence` and `update_schedule` may be called
from any thread; they validate and queue, and the step-loop thread applies them at the start of the next step.
Everything else but `outputs` runs on the step-loop thread only; other threads read `snapshot` (replaced, never
mutated, after each step). `outputs` is used by one thread (the server's output thread, or the caller of `step()`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from npuserve.engine import guided
from npuserve.engine.affinity import rank_threads
from npuserve.engine.backends import resolve_device
from npuserve.engine.detokenizer import Tokenizer, TokenizerLike
from npuserve.engine.kvcache import KVCacheManager
from npuserve.engine.model.served_scheme import served_spec
from npuserve.engine.output_processor import OutputProcessor, RequestOutput
from npuserve.engine.parallel.comm import master_store
from npuserve.engine.parallel.ranks import WorkerArgs, WorkerRanks
from npuserve.engine.parallel.step_message import Op, StepMessage
from npuserve.engine.rank_runner import build_rank_runner
from npuserve.engine.request_checks import RequestError, RequestLimits
from npuserve.engine.runner import KVPlan
from npuserve.engine.scheduler import Scheduler, StepKind
from npuserve.engine.sequence import FinishReason, SamplingParams, Sequence
from npuserve.engine.servable import check_servable
from npuserve.engine.step_builder import StepBuilder
from npuserve.engine.step_output import SeqTracker, SeqUpdate
from npuserve.engine_contract import EngineInfo
from npuserve.mindie_config import (
    EngineEnvironment,
    MindIEConfig,
    NpuserveExtensions,
    ScheduleSection,
    minimal_config,
)
from npuserve.modelspec import ModelSpec

if TYPE_CHECKING:
    from npuserve.engine.parallel.group import LeaderGroup

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepStats:
    """What one step ran: its kind, sequences, tokens computed, seconds on the device, and how many of the
    sequences computed prompt tokens (all of a PREFILL step, the chunks of a MIXED one, none of a DECODE one)."""

    kind: StepKind
    num_seqs: int
    num_tokens: int
    seconds: float
    num_prefill_seqs: int = 0

    @property
    def num_decode_seqs(self) -> int:
        return self.num_seqs - self.num_prefill_seqs


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """The scheduler's and KV cache's state after a step, taken on the step thread: what other threads read."""

    running: int
    waiting: int
    swapped: int
    kv_usage: float
    kv_blocks_total: int
    schedule: ScheduleSection
    batch_cap: int  # the running batch cap in force (maxBatchSize, or the TPOT controller's: dynamicBatchSizeEnable)


@dataclass(frozen=True, slots=True)
class StepUpdates:
    """What one step of the step thread did: each sequence's raw results, for the output processor."""

    updates: list[SeqUpdate]
    stats: StepStats | None  # None: no model ran (idle, or waiting out maxQueueDelayMicroseconds)
    num_preemptions: int  # requests preempted (swapped or recomputed) in this step
    snapshot: EngineSnapshot


@dataclass(frozen=True, slots=True)
class StepResult:
    """A step and its outputs (`step()`: offline and tests)."""

    outputs: list[RequestOutput]
    stats: StepStats | None
    num_preemptions: int
    snapshot: EngineSnapshot


@dataclass(slots=True)
class _PendingRequest:
    request_id: str
    seq: Sequence


class LLMEngine:
    def __init__(
        self,
        config: MindIEConfig,
        *,
        env: EngineEnvironment | None = None,
        model_dir: str | Path | None = None,
        warmup: bool = True,
        seed: int = 0,
        num_kv_blocks: int | None = None,
        num_host_blocks: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        group: LeaderGroup | None = None,
    ) -> None:
        """`group`: the leader of a replica whose ranks span pods, every other pod already in (engine/parallel/
        group.py); this process is rank 0 and starts only its own pod's other ranks."""
        # the limit set, so a live schedule past the batch the engine is sized for is refused (with_schedule)
        config = config.with_batch_size_limit()
        self.config = config
        self.env = env or EngineEnvironment.from_environ()
        ext = config.npuserve or NpuserveExtensions()
        self.extensions = ext
        folder = Path(model_dir or config.model.modelWeightPath)
        self.model_dir = folder
        self.model_name = ext.servedModelName or config.model.modelName
        self.spec = served_spec(ModelSpec.from_pretrained(folder), ext.quantization, ext.loadFormat == "dummy")
        if self.spec.quantization is not None:
            log.info("quantized weights: %s", self.spec.quantization.name)
        self.clock = clock
        self.group = group
        self.nnodes = group.layout.nnodes if group is not None else 1
        # before loading: refused settings fail fast
        check_servable(config, resolve_device(ext.device), self.spec, nnodes=self.nnodes)
        world_size = config.model.worldSize
        per_pod = world_size // self.nnodes
        self.workers: WorkerRanks | None = None
        store = group.store if group is not None else None  # the world's TCPStore where this process made it
        self._threads_before = torch.get_num_threads()
        if world_size > 1:  # one process per other rank, started first: every rank joins the world while it builds
            import torch.distributed as dist

            if dist.is_initialized():
                raise RuntimeError("a process holds one tensor-parallel engine at a time (one torch.distributed "
                                   "world): close() the other engine first")
            torch.set_num_threads(rank_threads(per_pod))
            if group is not None:
                workers = WorkerRanks(world_size, init_method=group.local_init_method, cards_per_pod=per_pod)
            else:  # rank 0 holds the store's port before the workers look for it
                store, port = master_store("127.0.0.1", world_size)
                workers = WorkerRanks(world_size, init_method=f"tcp://127.0.0.1:{port}")
            self.workers = workers
            resolved, level = config.to_dict(), logging.getLogger().getEffectiveLevel()
            workers.start(lambda rank: WorkerArgs(
                rank=rank, world_size=world_size, init_method=workers.init_method, config=resolved,
                model_dir=str(folder), seed=seed, log_level=level, env=self.env,
                num_kv_blocks=num_kv_blocks, num_host_blocks=num_host_blocks, cards_per_pod=workers.cards_per_pod))
        try:
            built = build_rank_runner(config, folder, seed=seed,
                                      init_method=self.workers.init_method if self.workers else None,
                                      env=self.env, num_kv_blocks=num_kv_blocks, num_host_blocks=num_host_blocks,
                                      cards_per_pod=per_pod, store=store)
        except BaseException:
            self._abandon_workers()  # they would wait in a collective for a rank 0 that is not coming
            raise
        self.backend, self.dtype, self.model = built.backend, built.dtype, built.model
        self.load_seconds = built.load_seconds
        self.kv_plan: KVPlan = built.kv_plan
        self.runner = built.runner
        self.tp = built.tp
        self.ranks = built.ranks
        self.step_builder = StepBuilder(self.kv_plan.block_size, self.backend.device, self.spec.vocab_size,
                                        self.runner.delta_sender)
        deploy = config.BackendConfig.ModelDeployConfig
        schedule = config.schedule
        log.info("KV cache: %d device blocks, %d host blocks of %d tokens per rank (%s)", self.kv_plan.num_blocks,
                 self.kv_plan.num_host_blocks, self.kv_plan.block_size, self.kv_plan.source)
        self.kv = KVCacheManager(self.kv_plan.num_blocks, self.kv_plan.num_host_blocks, self.kv_plan.block_size,
                                 enable_prefix_caching=ext.enablePrefixCaching)
        self.eos_token_ids: frozenset[int] = frozenset(self._eos_ids(folder))  # fixed: any thread may read it
        self.scheduler = Scheduler(
            schedule, self.kv, policy=ext.policy, max_seq_len=deploy.maxSeqLen,
            eos_token_ids=self.eos_token_ids, recompute_threshold=self.env.recompute_threshold,
            chunked_prefill=ext.chunkedPrefill, clock=clock,
        )
        if ext.chunkedPrefill and schedule.supportSelectBatch:
            log.warning("npuserve.chunkedPrefill turns supportSelectBatch off, as MindIE's SplitFuse does: every "
                        "step mixes decodes and prompt chunks, so there is no prefill-or-decode choice to weigh")
        self.request_limits = RequestLimits(self.spec.vocab_size, deploy.maxInputTokenLen, deploy.truncation)
        self.tokenizer: TokenizerLike | None = None
        if (folder / "tokenizer.json").exists():
            self.tokenizer = Tokenizer(folder)
        elif ext.loadFormat == "dummy":  # random weights without a tokenizer (the operator's dummy pods): ours
            self.tokenizer = Tokenizer.dummy(self.spec.vocab_size)
        self.outputs = OutputProcessor(self.tokenizer, self.stop_sequence)
        self.grammars: guided.GrammarCompiler | None = None  # structured output; None without a tokenizer
        if isinstance(self.tokenizer, Tokenizer):
            vocab_json = self.tokenizer.to_json()
            self.grammars = guided.GrammarCompiler(vocab_json, self.spec.vocab_size,
                                                  sorted(self.eos_token_ids))
        self.tracker = SeqTracker()  # the unfinished sequences, their requests, what was reported (step thread)
        self._inbox: list[_PendingRequest] = []
        self._aborts: list[str] = []
        self._stops: list[int] = []  # seq ids a stop string ended (the output side)
        self._schedule_updates: list[tuple[ScheduleSection, Future[ScheduleSection]]] = []
        self._lock = threading.Lock()
        self._preemptions_seen = 0
        self.snapshot = self._snapshot()
        self.ready = False
        if warmup:
            self.runner.warmup()
        self.ready = True

    def close(self) -> None:
        """Stops the other ranks (tensor parallel) and leaves the distributed world; call it after the step loop
        ended. With one rank there is nothing to stop."""
        channel = self.runner.channel
        group = self.group

        def stop() -> None:
            if group is not None:
                group.stopping()  # first: the other pods' ends that follow the STOP are no death
            if channel is not None:
                channel.send(StepMessage(Op.STOP))

        self._release_ranks(stop)

    def _abandon_workers(self) -> None:
        """Rank 0 failed while building: the workers wait in a collective for it, so they are killed."""
        self._release_ranks(None)

    def _release_ranks(self, stop: Callable[[], None] | None) -> None:
        """`stop` tells the workers to end (they are killed without one); then the world is left."""
        if self.workers is None:
            return
        import torch.distributed as dist

        workers, self.workers = self.workers, None
        workers.stop(stop)
        if self.group is not None:
            self.group.close()  # without a stop said first (rank 0 failed while building), the other pods exit
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(self._threads_before)

    # --- construction helpers ----------------------------------------------------------------------------------

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, **schedule: Any) -> LLMEngine:
        """An engine with MindIE's defaults for the model in `model_dir`; `schedule` overrides ScheduleConfig."""
        return cls(minimal_config(model_dir, **schedule))

    def _eos_ids(self, folder: Path) -> list[int]:
        ids = set(self.spec.eos_token_ids)
        gen = folder / "generation_config.json"
        if gen.exists():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, list):
                ids.update(int(e) for e in eos)
        return sorted(ids)

    # --- requests (any thread) -----------------------------------------------------------------------------------

    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise RequestError(f"the model folder {self.model_dir} has no tokenizer.json; send token ids")
        return self.tokenizer.encode(prompt)

    def encode_tail(self, prompt: str, limit: int | None) -> tuple[list[int], int]:
        """The prompt's last `limit` token ids and its whole length in tokens (blocking: call it off the loop)."""
        if isinstance(self.tokenizer, Tokenizer):
            return self.tokenizer.encode_tail(prompt, limit)
        ids = self.encode(prompt)
        return (ids if limit is None else ids[len(ids) - limit :] if limit > 0 else []), len(ids)

    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
    ) -> Sequence:
        """Queue a request; it enters the scheduler at the next `step()`. Raises RequestError if refused."""
        params = params or SamplingParams()
        ids = list(prompt_token_ids) if prompt_token_ids is not None else self.encode(prompt or "")
        ids = self.request_limits.prompt_ids(ids, params)
        if params.min_tokens:
            params.eos_token_ids = tuple(sorted(self.eos_token_ids))  # what min_tokens holds back
        seq = Sequence(ids, params, arrival_time=self.clock() if arrival_time is None else arrival_time)
        with self._lock:
            if self.tracker.has_request(request_id) or any(r.request_id == request_id for r in self._inbox):
                raise RequestError(f"request id {request_id!r} is already in use")
            self._inbox.append(_PendingRequest(request_id, seq))
        return seq

    def compile_grammar(self, spec: guided.GuidedSpec) -> guided.CompiledGrammar:
        """A request's constraint compiled for this model's vocabulary (cached). Blocking: call it off the asyncio
        loop. Raises GrammarError."""
        if self.grammars is None:
            raise guided.GrammarError(f"structured output needs a tokenizer, and {self.model_dir} has none")
        return self.grammars.compile(spec)

    def abort(self, request_id: str) -> None:
        """End a request (client gone); its blocks are freed at the next step, which reports it ABORT."""
        with self._lock:
            self._aborts.append(request_id)

    def stop_sequence(self, seq_id: int) -> None:
        """A stop string ended the sequence (the output processor saw it); the next step ends it with finish_reason
        "stop" and frees its blocks (what it sampled meanwhile is dropped from its outputs)."""
        with self._lock:
            self._stops.append(seq_id)

    def update_schedule(self, schedule: ScheduleSection) -> Future[ScheduleSection]:
        """Hot-apply ScheduleConfig: the scheduler takes it at the next step, which resolves the future with the
        schedule it then runs."""
        done: Future[ScheduleSection] = Future()
        with self._lock:
            self._schedule_updates.append((schedule, done))
        return done

    # --- the step loop (one thread) ------------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        """Work for a step: queued requests, aborts, stops or schedule updates, or unfinished requests."""
        with self._lock:
            if self._inbox or self._aborts or self._stops or self._schedule_updates:
                return True
        return bool(self.tracker) or self.scheduler.has_unfinished()

    def _drain_inbox(self) -> tuple[list[Future[ScheduleSection]], list[Sequence]]:
        """Applies what other threads queued; returns the schedule updates' futures and the sequences a stop
        string ended (their blocks now freed)."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
            stops, self._stops = self._stops, []
            updates, self._schedule_updates = self._schedule_updates, []
        for pending in inbox:
            self.tracker.add(pending.request_id, pending.seq)
            self.scheduler.add(pending.seq)
        for request_id in aborts:
            for seq_id in self.tracker.request_seq_ids(request_id):
                self.scheduler.abort(seq_id)
        stopped = []
        for seq_id in stops:
            seq = self.tracker.sequence(seq_id)
            if seq is not None and seq.finish_reason is None:
                self.scheduler.finish(seq, FinishReason.STOP)
                stopped.append(seq)
        for schedule, _ in updates:
            self.scheduler.update_schedule(schedule)
        return [done for _, done in updates], stopped

    def step(self) -> StepResult:
        """One step and its outputs on the calling thread (offline use): `run_step()`, then the output processor.
        A stop string found in this step's text ends its sequence at the next step."""
        core = self.run_step()
        return StepResult(self.outputs.process(core.updates), core.stats, core.num_preemptions, core.snapshot)

    def run_step(self) -> StepUpdates:
        """One scheduler step on the step thread: the raw results of every sequence that got a token or ended, and
        what the step ran."""
        applied, stopped = self._drain_inbox()
        out = self.scheduler.schedule()  # takes a pending schedule update first
        for done in applied:
            done.set_result(self.scheduler.schedule_config)
        stats: StepStats | None = None
        stepped: list[Sequence] = []
        if out.seqs:
            num_tokens = out.num_batched_tokens  # before update_from_output, which marks the new tokens cached
            t0 = time.perf_counter()
            mixed = out.kind is StepKind.MIXED
            step = self.step_builder.build(out.seqs, is_prefill=out.kind is StepKind.PREFILL,
                                           num_new_tokens=out.num_new_tokens if mixed else None,
                                           block_copies=out.block_copies, swap_out=out.swap_out, swap_in=out.swap_in)
            sampled = self.runner.execute(step)  # the block copies and swaps first, then the forward
            outcome = self.scheduler.update_from_output(out, sampled.token_ids, sampled.logprobs,
                                                        sampled.top_logprobs, sampled.prompt_logprobs)
            for parent, child in outcome.forked:
                self.tracker.add_fork(parent, child)
            stepped = outcome.stepped
            num_prefill = out.num_prefill_seqs if mixed else len(out.seqs) if out.kind is StepKind.PREFILL else 0
            stats = StepStats(out.kind, len(out.seqs), num_tokens, time.perf_counter() - t0, num_prefill)
        elif out.has_device_work:  # copies and swaps with no sequence to run: they must not be skipped
            self.runner.move_blocks(out.block_copies, out.swap_out, out.swap_in)
        updates = self.tracker.updates(stopped + out.finished, stepped, self.clock())
        preemptions = self.scheduler.num_preemptions_total - self._preemptions_seen
        self._preemptions_seen = self.scheduler.num_preemptions_total
        self.snapshot = self._snapshot()
        return StepUpdates(updates, stats, preemptions, self.snapshot)

    def fail_all(self, error: str) -> list[SeqUpdate]:
        """After a step raised: ends every unfinished request with `error` (their blocks freed), so none hangs;
        returns their last updates, for the output processor."""
        _, stopped = self._drain_inbox()
        failed: list[Sequence] = []
        for request_id in self.tracker.requests():
            for seq_id in self.tracker.request_seq_ids(request_id):
                seq = self.tracker.sequence(seq_id)
                if seq is None:
                    continue
                seq.error = error
                if seq.finish_reason is None:
                    self.scheduler.finish(seq, FinishReason.ERROR)
                failed.append(seq)  # also one the broken step ended without reporting it
        updates = self.tracker.updates(stopped + failed, [], self.clock())
        self.snapshot = self._snapshot()
        return updates

    def _snapshot(self) -> EngineSnapshot:
        scheduler, kv = self.scheduler, self.kv
        return EngineSnapshot(running=scheduler.num_running, waiting=scheduler.num_waiting,
                              swapped=scheduler.num_swapped, kv_usage=kv.usage, kv_blocks_total=kv.num_device_blocks,
                              schedule=scheduler.schedule_config, batch_cap=scheduler.batch_cap)

    # --- offline ---------------------------------------------------------------------------------------------------

    def generate(
        self, prompts: Iterable[str | list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[RequestOutput]:
        """Runs the prompts as one continuous batch; returns each one's final output, in order (with n > 1, the
        first choice's; `generate_all` returns every choice)."""
        return [outs[0] for outs in self.generate_all(prompts, params)]

    def generate_all(
        self, prompts: Iterable[str | list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[RequestOutput]]:
        """Like `generate`; each prompt's final outputs of all its choices, by choice index."""
        ids: list[str] = []
        for i, prompt in enumerate(prompts):
            p = params[i] if isinstance(params, list) else params
            rid = f"gen-{i}-{id(self)}-{time.monotonic_ns()}"
            if isinstance(prompt, str):
                self.add_request(rid, prompt, p)
            else:
                self.add_request(rid, None, p, prompt_token_ids=prompt)
            ids.append(rid)
        final: dict[str, dict[int, RequestOutput]] = {}
        done: set[str] = set()
        while self.has_unfinished():
            result = self.step()
            for o in result.outputs:
                if o.finished:
                    final.setdefault(o.request_id, {})[o.index] = o
                if o.last:
                    done.add(o.request_id)
            if result.stats is None and not done >= set(ids):
                time.sleep(0.0005)  # waiting out maxQueueDelayMicroseconds
        return [[final[r][i] for i in sorted(final[r])] for r in ids]

    def info(self, **server: Any) -> EngineInfo:
        """`/info`: model, device, the KV blocks actually allocated, the schedule the scheduler runs; `server`
        adds the HTTP side's fields (served name, readiness, queue bound)."""
        graphs = self.runner.decode_graphs
        return EngineInfo(
            model=self.model_name, model_type=self.spec.model_type, dtype=str(self.dtype).removeprefix("torch."),
            device=self.backend.name, worldSize=self.config.model.worldSize, nodes=self.nnodes, ranks=self.ranks,
            kv_blocks=self.kv_plan.num_blocks,
            kv_host_blocks=self.kv_plan.num_host_blocks, block_size=self.kv_plan.block_size,
            kv_bytes_per_block=self.kv_plan.bytes_per_block, kv_sizing=self.kv_plan.source,
            schedule=self.snapshot.schedule.model_dump(mode="json"),
            graph_batch_sizes=graphs.captured_sizes if graphs is not None else [],
            scheduleGeneration=self.config.extensions.scheduleGeneration, batch_size_cap=self.snapshot.batch_cap,
            quantization=self.spec.quantization.name if self.spec.quantization is not None else None, **server,
        )
