"""`LLMEngine`: the offline/online engine loop. One `step()` = `Scheduler.schedule()` -> `ModelRunner` ->
`Scheduler.update()` -> incremental detokenization and stop strings -> per-request outputs.

Thread model (for the HTTP server): `add_request` and `abort` may be called from any thread; they validate and
queue, and the step-loop thread applies them at the start of the next `step()`. Everything else runs on the
step-loop thread only.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from npuserve.engine.backends import get_backend
from npuserve.engine.detokenizer import IncrementalDetokenizer, Tokenizer, TokenizerLike
from npuserve.engine.kvcache import KVCacheManager
from npuserve.engine.model.loader import TORCH_DTYPES, load_model
from npuserve.engine.runner import KVPlan, ModelRunner, plan_kv_blocks
from npuserve.engine.scheduler import Scheduler, StepKind
from npuserve.engine.sequence import FinishReason, SamplingParams, Sequence
from npuserve.mindie_config import EngineEnvironment, MindIEConfig, NpuserveExtensions, ScheduleSection
from npuserve.modelspec import ModelSpec

log = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the engine refuses (empty or too long a prompt, a duplicate id); the server answers 400."""


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request. `new_*` are the increments; the rest is cumulative."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[float] | None
    token_ids: list[int]  # all output tokens so far
    text: str  # all output text so far (stop string excluded)
    num_prompt_tokens: int
    finished: bool
    finish_reason: FinishReason | None = None
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # see `_metrics`


@dataclass(slots=True)
class _Request:
    request_id: str
    seq: Sequence
    detok: IncrementalDetokenizer | None
    num_emitted: int = 0  # output tokens already reported


@dataclass(slots=True)
class StepStats:
    kind: StepKind
    num_seqs: int
    num_tokens: int
    seconds: float


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
    ) -> None:
        self.config = config
        self.env = env or EngineEnvironment.from_environ()
        ext = config.npuserve or NpuserveExtensions()
        self.extensions = ext
        folder = Path(model_dir or config.model.modelWeightPath)
        self.model_dir = folder
        self.model_name = ext.servedModelName or config.model.modelName
        self.spec = ModelSpec.from_pretrained(folder)
        self.clock = clock
        self.backend = get_backend(ext.device)
        dtype = TORCH_DTYPES[self.spec.dtype if ext.dtype == "auto" else ext.dtype]
        self.dtype = dtype
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        load_format = "dummy" if ext.loadFormat == "dummy" else "safetensors"
        self.model = load_model(self.spec, folder, dtype, self.backend.device, load_format, seed=seed)
        self.load_seconds = time.perf_counter() - t0
        deploy = config.BackendConfig.ModelDeployConfig
        schedule = config.schedule
        self.kv_plan: KVPlan = plan_kv_blocks(
            self.spec, self.backend, block_size=schedule.cacheBlockSize, dtype=dtype,
            npu_mem_size_gib=config.model.npuMemSize, cpu_mem_size_gib=config.model.cpuMemSize,
            max_batch_size=schedule.maxBatchSize, max_seq_len=deploy.maxSeqLen,
            memory_fraction=self.env.npu_memory_fraction,
        )
        if num_kv_blocks is not None or num_host_blocks is not None:  # tests and benchmarks pin the pool sizes
            self.kv_plan = dataclasses.replace(
                self.kv_plan,
                num_blocks=self.kv_plan.num_blocks if num_kv_blocks is None else num_kv_blocks,
                num_host_blocks=self.kv_plan.num_host_blocks if num_host_blocks is None else num_host_blocks,
                source="set by the caller",
            )
        log.info("KV cache: %d device blocks, %d host blocks of %d tokens (%s)", self.kv_plan.num_blocks,
                 self.kv_plan.num_host_blocks, self.kv_plan.block_size, self.kv_plan.source)
        self.runner = ModelRunner(self.model, self.backend, self.kv_plan, dtype)
        self.kv = KVCacheManager(self.kv_plan.num_blocks, self.kv_plan.num_host_blocks, self.kv_plan.block_size,
                                 enable_prefix_caching=ext.enablePrefixCaching)
        self.scheduler = Scheduler(
            schedule, self.kv, policy=ext.policy, max_seq_len=deploy.maxSeqLen,
            eos_token_ids=self._eos_ids(folder), recompute_threshold=self.env.recompute_threshold, clock=clock,
        )
        self.max_input_len = deploy.maxInputTokenLen
        self.truncation = deploy.truncation
        self.tokenizer: TokenizerLike | None = None
        if (folder / "tokenizer.json").exists():
            self.tokenizer = Tokenizer(folder)
        elif load_format == "dummy":  # random weights without a tokenizer (the operator's dummy pods): ours
            self.tokenizer = Tokenizer.dummy(self.spec.vocab_size)
        self._requests: dict[str, _Request] = {}
        self._by_seq: dict[int, _Request] = {}
        self._inbox: list[_Request] = []
        self._aborts: list[str] = []
        self._lock = threading.Lock()
        self.last_step: StepStats | None = None
        self.ready = False
        if warmup:
            self.runner.warmup()
        self.ready = True

    # --- construction helpers ----------------------------------------------------------------------------------

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, **schedule: Any) -> LLMEngine:
        """An engine with MindIE's defaults for the model in `model_dir`; `schedule` overrides ScheduleConfig."""
        from npuserve.mindie_config import minimal_config

        config = minimal_config(Path(model_dir).name, str(model_dir), **schedule)
        return cls(config)

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
        if not ids:
            raise RequestError("the prompt is empty")
        if len(ids) > self.max_input_len:
            if not self.truncation:
                raise RequestError(f"the prompt has {len(ids)} tokens; maxInputTokenLen is {self.max_input_len}")
            ids = ids[-self.max_input_len :]
        if params.max_tokens < 1:
            raise RequestError("max_tokens must be at least 1")
        if any(t < 0 or t >= self.spec.vocab_size for t in ids):
            raise RequestError(f"prompt token ids must be in [0, {self.spec.vocab_size})")
        seq = Sequence(ids, params, arrival_time=self.clock() if arrival_time is None else arrival_time)
        detok = IncrementalDetokenizer(self.tokenizer, params.stop) if self.tokenizer is not None else None
        req = _Request(request_id, seq, detok)
        with self._lock:
            if request_id in self._requests or any(r.request_id == request_id for r in self._inbox):
                raise RequestError(f"request id {request_id!r} is already in use")
            self._inbox.append(req)
        return seq

    def abort(self, request_id: str) -> None:
        """End a request (client gone); its blocks are freed at the next step, which reports it ABORT."""
        with self._lock:
            self._aborts.append(request_id)

    def has_unfinished(self) -> bool:
        with self._lock:
            if self._inbox or self._aborts:
                return True
        return bool(self._requests) or self.scheduler.has_unfinished()

    def update_schedule(self, schedule: ScheduleSection) -> None:
        """Hot-apply ScheduleConfig (the scheduler takes it at its next step)."""
        self.scheduler.update_schedule(schedule)

    # --- the step loop (one thread) ------------------------------------------------------------------------------

    def _drain_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        for req in inbox:
            self._requests[req.request_id] = req
            self._by_seq[req.seq.seq_id] = req
            self.scheduler.add(req.seq)
        for request_id in aborts:
            aborted = self._requests.get(request_id)
            if aborted is not None:
                self.scheduler.abort(aborted.seq.seq_id)

    def step(self) -> list[RequestOutput]:
        """One scheduler step; returns an output for every request that got a token or ended."""
        self._drain_inbox()
        out = self.scheduler.schedule()
        outputs: list[RequestOutput] = []
        for seq in out.finished:  # aborts and admission errors
            req = self._by_seq.get(seq.seq_id)
            if req is not None:
                outputs.append(self._output(req, finished=True))
        if out.kind is StepKind.IDLE or not out.seqs:
            self.last_step = None
            return outputs
        num_tokens = out.num_batched_tokens  # before update(), which marks the new tokens cached
        t0 = time.perf_counter()
        self.runner.swap(out.swap_out, out.swap_in)
        sampled = self.runner.execute(out.seqs, is_prefill=out.kind is StepKind.PREFILL)
        ended = {s.seq_id for s in self.scheduler.update(out, sampled.token_ids, sampled.logprobs)}
        self.last_step = StepStats(out.kind, len(out.seqs), num_tokens, time.perf_counter() - t0)
        for seq in out.seqs:
            req = self._by_seq.get(seq.seq_id)
            if req is None:
                continue
            finished = seq.seq_id in ended
            if finished or seq.num_output_tokens > req.num_emitted:
                outputs.append(self._output(req, finished=finished))
        return outputs

    def _output(self, req: _Request, finished: bool) -> RequestOutput:
        seq = req.seq
        new_ids = seq.output_token_ids[req.num_emitted :]
        new_logprobs = seq.output_logprobs[req.num_emitted :] if seq.sampling.logprobs else None
        new_text = text = ""
        if req.detok is not None:
            new_text = req.detok.add(new_ids) if new_ids else ""
            if req.detok.stopped and not finished:
                self.scheduler.finish(seq, FinishReason.STOP)  # blocks freed now
                finished = True
            if finished:
                new_text += req.detok.finish()
            text = req.detok.text
        req.num_emitted = seq.num_output_tokens
        if finished:
            self._requests.pop(req.request_id, None)
            self._by_seq.pop(seq.seq_id, None)
        return RequestOutput(
            request_id=req.request_id, new_token_ids=new_ids, new_text=new_text, new_logprobs=new_logprobs,
            token_ids=seq.output_token_ids, text=text, num_prompt_tokens=seq.num_prompt_tokens, finished=finished,
            finish_reason=seq.finish_reason if finished else None, error=seq.error, metrics=_metrics(seq),
        )

    # --- offline ---------------------------------------------------------------------------------------------------

    def generate(
        self, prompts: Iterable[str | list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[RequestOutput]:
        """Runs the prompts as one continuous batch; returns each one's final output, in order."""
        ids: list[str] = []
        for i, prompt in enumerate(prompts):
            p = params[i] if isinstance(params, list) else params
            rid = f"gen-{i}-{id(self)}-{time.monotonic_ns()}"
            if isinstance(prompt, str):
                self.add_request(rid, prompt, p)
            else:
                self.add_request(rid, None, p, prompt_token_ids=prompt)
            ids.append(rid)
        final: dict[str, RequestOutput] = {}
        text: dict[str, str] = {}
        while self.has_unfinished():
            for o in self.step():
                text[o.request_id] = text.get(o.request_id, "") + o.new_text
                if o.finished:
                    final[o.request_id] = o
            if self.last_step is None and not final.keys() >= set(ids):
                time.sleep(0.0005)  # waiting out maxQueueDelayMicroseconds
        return [final[r] for r in ids]

    def info(self) -> dict[str, Any]:
        """What `/info` shows: model, device, the KV blocks actually allocated, the live schedule."""
        return {
            "model": self.model_name,
            "model_type": self.spec.model_type,
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": self.backend.name,
            "worldSize": self.config.model.worldSize,
            "kv_blocks": self.kv_plan.num_blocks,
            "kv_host_blocks": self.kv_plan.num_host_blocks,
            "block_size": self.kv_plan.block_size,
            "kv_bytes_per_block": self.kv_plan.bytes_per_block,
            "kv_sizing": self.kv_plan.source,
            "schedule": self.scheduler.schedule_config.model_dump(mode="json"),
        }


def make_config(
    model_dir: str | Path,
    *,
    max_seq_len: int | None = None,
    max_input_len: int | None = None,
    extensions: dict[str, Any] | None = None,
    model: dict[str, Any] | None = None,
    **schedule: Any,
) -> MindIEConfig:
    """A MindIE config for one model with MindIE's defaults; the keywords override its fields (validated)."""
    deploy: dict[str, Any] = {
        "ModelConfig": [{"modelName": Path(model_dir).name, "modelWeightPath": str(model_dir), **(model or {})}]
    }
    if max_seq_len is not None:
        deploy["maxSeqLen"] = max_seq_len
        max_input_len = max_input_len or min(max_seq_len, 2048)
        schedule.setdefault("maxIterTimes", min(512, max_seq_len))
    if max_input_len is not None:
        deploy["maxInputTokenLen"] = max_input_len
    if "maxPrefillTokens" not in schedule and max_input_len is not None:
        schedule["maxPrefillTokens"] = max(8192, max_input_len)
    mbs = schedule.get("maxBatchSize")
    if mbs is not None and "maxPrefillBatchSize" not in schedule:
        schedule["maxPrefillBatchSize"] = min(50, int(mbs))
    data: dict[str, Any] = {"BackendConfig": {"ModelDeployConfig": deploy, "ScheduleConfig": schedule}}
    if extensions:
        data["npuserve"] = extensions
    return MindIEConfig.from_dict(data)


def _metrics(seq: Sequence) -> dict[str, float]:
    m: dict[str, float] = {"arrival_time": seq.arrival_time}
    if seq.first_scheduled_time is not None:
        m["queue_time"] = seq.first_scheduled_time - seq.arrival_time
        if seq.first_token_time is not None:
            m["prefill_time"] = seq.first_token_time - seq.first_scheduled_time
    if seq.first_token_time is not None:
        m["ttft"] = seq.first_token_time - seq.arrival_time
        if seq.finished_time is not None:
            m["decode_time"] = seq.finished_time - seq.first_token_time
    if seq.finished_time is not None:
        m["e2e"] = seq.finished_time - seq.arrival_time
    m["prefill_batch_size"] = float(seq.prefill_batch_size)
    if seq.num_decode_steps:
        m["mean_decode_batch_size"] = seq.decode_batch_size_sum / seq.num_decode_steps
    m["num_preemptions"] = float(seq.num_preemptions)
    return m
