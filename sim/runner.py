"""The virtual-clock loop: the real `Scheduler` and `KVCacheManager`, a cost model in place of the model.

One step, as `LLMEngine.step` does it: the sends due by now enter the scheduler (`Scheduler.add`, after the same
refusals the server makes: a prompt over maxInputTokenLen, a full waiting queue); `Scheduler.schedule()` picks the
step; the cost model prices it; the clock moves to the step's end; `Scheduler.update_from_output()` appends one
synthetic token per sampled row (token 0; a request ends by max_tokens, set to its true output length, so no EOS is
needed) and its timestamps (first token, finish) are the step's end. Each sampled token is one streamed chunk
arriving at that time, so the per-request records read as a streaming client's would. Nothing ran (nothing waits,
or only future sends): the clock jumps to the next send.

The loop costs O(sequences) Python per step, most of it inside the scheduler; tokens are never materialised beyond
the scheduler's own lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from npuserve.engine.scheduler import Scheduler, SchedulerOutput, StepKind
from npuserve.engine.sequence import FinishReason, SamplingParams, Sequence
from npuserve.engine.step_output import request_metrics
from npuserve.engine_contract import RequestTimings
from npuserve.loadgen.records import RequestRecord, TokenCountSource

from .cost_model import CostModel, StepCost, StepShape
from .load import LoadDriver

# A run that makes no progress for this many steps in a row is a bug (a request that can never be scheduled
# should have been refused); stop instead of spinning.
MAX_IDLE_STEPS = 100_000
IDLE_PROBE_S = 0.001  # the clock's step when work waits but nothing can run and no send is due


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request of a simulated run: its token counts (the dataset's, see `lengths`) and its cap."""

    prompt_tokens: int
    output_tokens: int  # how many tokens it generates before it stops on its own (<= max_tokens)
    max_tokens: int
    output_chars: int = 0


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One step of the run: when it started, what it ran, and its cost breakdown."""

    start_s: float
    kind: StepKind
    num_seqs: int
    num_tokens: int
    running: int  # running after the step was scheduled
    waiting: int
    cost: StepCost


@dataclass
class RunTrace:
    """What the loop produced: a record per request (in the order they ended) and every step."""

    records: list[RequestRecord] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    end_s: float = 0.0


def step_shape(out: SchedulerOutput) -> StepShape:
    """What the cost model needs of a scheduled step (called before `update`, which marks the tokens computed)."""
    seqs = out.seqs
    swapped = len(out.swap_in) + len(out.swap_out)
    if out.kind is StepKind.DECODE:
        context = sum(len(s.token_ids) for s in seqs)
        n = len(seqs)
        return StepShape(n, n, context, context, n, swapped)
    counts = out.num_new_tokens if out.kind is StepKind.MIXED else [s.num_tokens - s.num_cached_tokens for s in seqs]
    new = context = pairs = rows = 0
    for seq, k in zip(seqs, counts, strict=True):
        cached = seq.num_cached_tokens
        new += k
        context += cached + k
        pairs += k * cached + k * (k + 1) // 2  # causal: the i-th new token attends cached + i positions
        rows += cached + k >= seq.num_tokens  # a prompt chunk short of its end samples nothing
    return StepShape(len(seqs), new, context, pairs, rows, swapped)


class VirtualClockRunner:
    """Runs requests through a scheduler on a virtual clock priced by a cost model."""

    def __init__(self, scheduler: Scheduler, cost: CostModel, *, max_input_len: int, truncation: bool = False,
                 max_waiting: int | None = None, keep_steps: bool = True) -> None:
        self.scheduler = scheduler
        self.cost = cost
        self.max_input_len = max_input_len
        self.truncation = truncation
        self.max_waiting = max_waiting
        self.keep_steps = keep_steps
        self.now = 0.0
        scheduler.clock = self.clock  # the scheduler stamps queue, first-token and finish times with it

    def clock(self) -> float:
        return self.now

    def run(self, requests: list[SimRequest], load: LoadDriver, *, origin: float = 0.0, warmup: bool = False,
            trace: RunTrace | None = None, first_index: int = 0) -> RunTrace:
        """Send `requests` as `load` says until every one has ended; times in the records are relative to
        `origin`. Appends to `trace` (a fresh one by default)."""
        trace = trace or RunTrace()
        sched = self.scheduler
        owners: dict[int, tuple[RequestRecord, int | None]] = {}  # seq_id -> (its record, its user)
        chunks: dict[int, list[float]] = {}  # seq_id -> its token times (the record's chunk_times, filled in place)
        next_index = first_index
        idle = 0
        zeros: list[int] = []

        def send(when: float, user: int | None, index: int) -> None:
            nonlocal next_index
            req = requests[index]
            record = RequestRecord(index=next_index, warmup=warmup, user=user, t0=when - origin,
                                   prompt_tokens=req.prompt_tokens, token_source=TokenCountSource.SIMULATED)
            next_index += 1
            n = req.prompt_tokens
            error = None
            if n > self.max_input_len:
                if self.truncation:
                    n = self.max_input_len
                else:
                    error = f"the prompt has {n} tokens; maxInputTokenLen is {self.max_input_len}"
            if error is None and self.max_waiting is not None and sched.num_waiting >= self.max_waiting:
                record.status, record.error = 429, f"{sched.num_waiting} requests are waiting (the bound is " \
                                                   f"{self.max_waiting})"
            elif error is not None:
                record.status, record.error = 400, error
            if record.error is not None:
                record.end = when - origin
                trace.records.append(record)
                for released in load.ended(user, when):
                    send(*released)
                return
            record.prompt_tokens = n
            seq = Sequence([0] * n, SamplingParams(max_tokens=req.output_tokens, ignore_eos=True), arrival_time=when)
            owners[seq.seq_id] = (record, user)
            chunks[seq.seq_id] = record.chunk_times
            record.output_chars = req.output_chars
            sched.add(seq)

        def ended(seqs: list[Sequence]) -> None:
            for seq in seqs:
                record, user = owners.pop(seq.seq_id)
                chunks.pop(seq.seq_id, None)
                self._close(record, seq, origin)
                trace.records.append(record)
                for released in load.ended(user, self.now):
                    send(*released)

        while True:
            for when, user, index in load.due(self.now):
                send(when, user, index)
            if not sched.has_unfinished():
                nxt = load.next_time()
                if nxt is None:
                    if load.done:
                        break
                    raise RuntimeError("simulation stalled: requests are promised but none is due")  # pragma: no cover
                self.now = max(self.now, nxt)
                continue
            out = sched.schedule()
            ended(out.finished)
            if not out.seqs:
                idle += 1
                if idle > MAX_IDLE_STEPS:
                    raise RuntimeError(f"simulation stalled: {sched.num_waiting} waiting, {sched.num_running} "
                                       f"running, nothing schedulable")
                nxt = load.next_time()
                self.now = nxt if nxt is not None and nxt > self.now else self.now + IDLE_PROBE_S
                continue
            idle = 0
            shape = step_shape(out)
            start = self.now
            if self.keep_steps:
                cost = self.cost.step(shape)
                self.now = start + cost.total_s
                trace.steps.append(StepRecord(start - origin, out.kind, shape.num_seqs, shape.new_tokens,
                                              sched.num_running, sched.num_waiting, cost))
            else:
                self.now = start + self.cost.step_time(shape)
            rows = len(out.seqs) if out.kind is StepKind.DECODE else sum(s.num_samples for s in out.seqs)
            if len(zeros) < rows:
                zeros = [0] * rows
            outcome = sched.update_from_output(out, zeros[:rows])
            done = outcome.finished
            at = self.now - origin
            for seq in outcome.sampled_by:
                if seq is not None:
                    chunks[seq.seq_id].append(at)
            ended(done)
        trace.end_s = max(trace.end_s, self.now - origin)
        return trace

    @staticmethod
    def _close(record: RequestRecord, seq: Sequence, origin: float) -> None:
        finished = seq.finished_time if seq.finished_time is not None else record.t0 + origin
        record.end = finished - origin
        record.output_tokens = seq.num_output_tokens
        if seq.finish_reason is FinishReason.ERROR:
            record.status, record.error = 400, seq.error or "refused"
            return
        record.status = 200
        record.server = RequestTimings.from_engine(request_metrics(seq))
