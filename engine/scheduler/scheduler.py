"""Continuous-batching scheduler with MindIE semantics (docs/engine.md#the-scheduler-mindie-semantics). No torch.

The engine drives it, from the step-loop thread only (it is not thread-safe):

    sched = Scheduler(schedule, kv, policy="fcfs", max_seq_len=2560, eos_token_ids=(2,),
                      recompute_threshold=env.recompute_threshold, clock=time.monotonic)
    sched.add(seq)                       # queue a request (ends at once with ERROR if it can never fit)
    out = sched.schedule()               # one PREFILL or DECODE step (or IDLE); see SchedulerOutput (frozen)
    ...copy out.block_copies, out.swap_out, then out.swap_in; run the model on out.seqs; sample...
    outcome = sched.update_from_output(out, token_ids, logprobs)   # all of the results' bookkeeping
    sched.finish(seq, FinishReason.STOP)  # a stop string the output processor found in the text
    sched.abort(seq_id)                   # client gone: blocks freed now, reported in the next out.finished

Rules:
- Queues: waiting (ordered by the policy, see `queues.py`), running (admission order, at most maxBatchSize),
  swapped (FIFO).
- Step kind: `stage.py` (DecidePDPriority, or the select-batch cost rule).
- A prefill batch takes waiting requests in policy order and closes at maxPrefillBatchSize requests
  (0 = maxBatchSize), maxPrefillTokens uncached tokens, maxBatchSize running, or when the head of the queue cannot
  get its blocks (strict order: a later, smaller request does not overtake it). A lone request longer than
  maxPrefillTokens (only a recomputed one can be) still runs alone, so it cannot wait forever.
- A decode step gives every running request the block its next token needs, oldest first. If blocks run out, the
  recompute threshold decides (below); when preempting, the victim is the most recently admitted running request:
  swapped to host if fewer than maxPreemptCount were swapped this step and the host pool has room, else recomputed
  (blocks freed, back to the front of waiting; its prompt and generated tokens are prefilled again and its output
  continues). Swapped requests come back (FIFO) in a decode step with no preemption, before any new prefill.
- Recompute threshold (MINDIE_LLM_RECOMPUTE_THRESHOLD / MIES_RECOMPUTE_THRESHOLD, default 0.5, [0, 1)). MindIE's
  tuning guide (MindIE Service 2.0, "性能调优流程", table 1) defines it as the share of all blocks held by the
  requests that can currently be dispatched (block utilisation): when that share is below the threshold,
  recomputation is triggered, freeing the blocks of a few requests so the others can run; a larger value triggers
  recomputation more easily. Implemented so: when some running requests cannot get a block, let `held` be the
  device blocks held by those that can. If `held >= threshold * total blocks`, the decode step runs those and the
  others stall in place (no preemption; they keep their blocks and go first once blocks free up). Otherwise
  victims are preempted (swap or recompute, as above) until every remaining request can run. If no request can run
  at all, preemption happens whatever the threshold, so nothing hangs (MindIE's "0 means no request can be
  dispatched" is not reproduced). A threshold close to 1 gives vLLM's behaviour: always preempt.
- n > 1 (a request sampling several sequences from one prompt): the parent is admitted to a prefill only when
  maxBatchSize has room for all n (n above maxBatchSize is refused at `add`) and the KV cache has room for its
  blocks plus the forks' (`KVCacheManager.fork_blocks`). The prefill samples n tokens from its last logits;
  `update_from_output` forks n - 1 children sharing the prompt's full blocks (the partial last block copied: the
  copies travel in the next step's `out.block_copies`, which the runner applies before anything else of that
  step), lists them in `outcome.forked` and gives each its own first token. From
  then on every sequence of the group is scheduled, preempted (swapped or recomputed) and ended on its own.
- max_tokens 0 (prompt logprobs only): the prefill runs and the request ends LENGTH with no output token.
- Ends: EOS (unless ignore_eos) or a stop token, once min_tokens are out -> STOP; max_tokens, maxIterTimes (output
  tokens) or maxSeqLen (prompt + output) -> LENGTH. A prompt that can never fit the whole cache, or leaves no room
  under maxSeqLen, ends with ERROR; a request that outgrows the whole cache while decoding ends with LENGTH.
- Chunked prefill (`chunked_prefill`, MindIE's SplitFuse, npuserve.chunkedPrefill): no stage choice; every step
  is MIXED: the running requests decode first (one token each, with the decode step's preemption rules), then
  prompts already admitted continue by chunks, then waiting requests are admitted (blocks for the whole prompt at
  once, at most maxPrefillBatchSize a step, none while any is swapped), all under maxPrefillTokens tokens. A chunk
  short of the prompt's last token samples nothing; the last one gives the first token. A request preempted in the
  middle of its prompt is recomputed, never swapped. supportSelectBatch and maxQueueDelayMicroseconds do not apply
  (MindIE turns supportSelectBatch off with SplitFuse).
- Aborts free the request's blocks at once; the next `schedule()` lists it in `finished`.
- `update_schedule(section)` hot-applies ScheduleConfig fields at the next `schedule()`; cacheBlockSize is fixed
  by the KV manager and not changed live. A maxBatchSize lowered below the running count admits nothing new until
  enough requests end; those already running keep decoding.
- dynamicBatchSizeEnable (MindIE 2.3's SLO scheduling, `dynamic_batch.py`): each decode step reports its requests'
  mean gap since their previous token to the controller, whose cap (3 .. maxBatchSize) replaces maxBatchSize in
  every admission rule (prefill, swap-in, the stage choice); `batch_cap` is the cap in force. A cap below the
  running count never preempts: it admits nothing new until enough requests end. Off: no controller exists.
- The runner copies `block_copies`, then `swap_out`, then `swap_in` whenever they are non-empty, with or
  without scheduled sequences (`SchedulerOutput.has_device_work`): the copies must not be skipped.
- After the run, `update_from_output` alone does the step's bookkeeping: the cached-token counts (and the prompt's
  prefix-cache hits, for usage), prompt logprobs, the sampled tokens, forks, the grammars' advance and the ends.
- Per request: first_scheduled_time (queue time = it - arrival_time), prefill_batch_size (of its first prefill),
  decode_batch_size_sum and num_decode_steps (mean decode batch size), first_token_time, finished_time.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

from npuserve.mindie_config import ScheduleSection

from .. import guided
from ..kvcache import KVCacheManager
from ..sequence import FinishReason, PromptLogprob, Sequence, SequenceStatus, TopLogprobs
from .dynamic_batch import DynamicBatchController
from .output import SchedulerOutput, StepDraft, StepKind, StepOutcome
from .queues import Policy, WaitingQueue
from .stage import StageSelector

_RUNNING = SequenceStatus.RUNNING


class Scheduler:
    def __init__(
        self,
        schedule: ScheduleSection,
        kv: KVCacheManager,
        *,
        policy: Policy = "fcfs",
        max_seq_len: int = 2560,
        eos_token_ids: Iterable[int] = (),
        recompute_threshold: float = 0.5,
        chunked_prefill: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0.0 <= recompute_threshold < 1.0:
            raise ValueError(f"recompute_threshold must be in [0, 1), got {recompute_threshold}")
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
        self.schedule_config = schedule
        self.kv = kv
        self.max_seq_len = max_seq_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.recompute_threshold = recompute_threshold
        self.chunked_prefill = chunked_prefill
        self.clock = clock
        self.waiting = WaitingQueue(policy)
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.num_preemptions_total = 0
        self.num_stalled = 0  # running requests left out of the last decode step for want of a block
        self._seqs: dict[int, Sequence] = {}  # every unfinished request, by id
        self._pending_finished: list[Sequence] = []  # ended outside a step (add errors, aborts)
        self._pending_schedule: ScheduleSection | None = None
        self._pending_copies: list[tuple[int, int]] = []  # the last step's forks: the next step copies them first
        self._stage = StageSelector()
        self.dynamic_batch = _dynamic_batch(schedule, None)
        self._last_decode_end: float | None = None  # when the last decode step's tokens came out (controller on)

    # --- counters ----------------------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    @property
    def batch_cap(self) -> int:
        """The running batch cap in force: maxBatchSize, or the TPOT controller's cap (dynamicBatchSizeEnable)."""
        if self.dynamic_batch is None:
            return self.schedule_config.maxBatchSize
        return self.dynamic_batch.cap

    def has_unfinished(self) -> bool:
        """True while a request is unfinished or an ended one has not been reported by `schedule()` yet."""
        return bool(self._seqs) or bool(self._pending_finished)

    # --- requests ----------------------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        if seq.seq_id in self._seqs:
            raise ValueError(f"sequence {seq.seq_id} was already added")
        error = self._admission_error(seq)
        if error is not None:
            seq.error = error
            self._end(seq, FinishReason.ERROR, self.clock())
            self._pending_finished.append(seq)
            return
        seq.status = SequenceStatus.WAITING
        self._seqs[seq.seq_id] = seq
        self.waiting.push(seq)

    def _admission_error(self, seq: Sequence) -> str | None:
        n = seq.num_prompt_tokens
        if n == 0:
            return "empty prompt"
        if seq.sampling.n > self.schedule_config.maxBatchSize:
            return (f"n of {seq.sampling.n} sequences exceeds maxBatchSize {self.schedule_config.maxBatchSize}, "
                    "the most that can run at once")
        if n >= self.max_seq_len:
            return f"prompt of {n} tokens leaves no room for output under maxSeqLen {self.max_seq_len}"
        if not self.kv.can_ever_fit(n) or self.kv.blocks_for(n) + self.kv.fork_blocks(seq) > self.kv.num_device_blocks:
            return (
                f"prompt of {n} tokens needs {self.kv.blocks_for(n)} KV blocks; "
                f"the whole cache has {self.kv.num_device_blocks}"
            )
        return None

    def abort(self, seq_id: int) -> bool:
        """End a request now (client gone); False if it is unknown or already finished."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return False
        self.finish(seq, FinishReason.ABORT)
        self._pending_finished.append(seq)
        return True

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a request from outside a step (a stop string, an abort): blocks freed at once."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)
        self._end(seq, reason, self.clock())

    def _end(self, seq: Sequence, reason: FinishReason, now: float) -> None:
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finished_time = now
        self._seqs.pop(seq.seq_id, None)

    def update_schedule(self, schedule: ScheduleSection) -> None:
        """Hot-apply new ScheduleConfig values; they take effect at the next `schedule()`."""
        self._pending_schedule = schedule

    # --- one step ----------------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        if self._pending_schedule is not None:
            self.schedule_config, self._pending_schedule = self._pending_schedule, None
            was = self.dynamic_batch
            self.dynamic_batch = _dynamic_batch(self.schedule_config, was)
            if self.dynamic_batch is not was:
                self._last_decode_end = None  # a new controller: the gaps count from its first decode step
        self.kv.begin_step()
        now = self.clock()
        out = StepDraft(kind=StepKind.IDLE, finished=self._pending_finished, block_copies=self._pending_copies)
        self._pending_finished, self._pending_copies = [], []
        if self.chunked_prefill:
            self._schedule_mixed(out, now)
            return out.freeze()
        oldest = self.waiting.oldest_arrival()
        cap = self.batch_cap
        stage_config = self.schedule_config
        if cap != stage_config.maxBatchSize:  # the stage rules weigh the batch against the cap in force
            stage_config = stage_config.model_copy(update={"maxBatchSize": cap})
        kind = self._stage.choose(
            stage_config,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_swapped=len(self.swapped),
            num_stalled=self.num_stalled,
            free_fraction=self.kv.free_fraction,
            # Rounded so float noise in the clock cannot hold a due prefill back one step.
            oldest_wait_us=0.0 if oldest is None else round((now - oldest) * 1e6, 3),
        )
        if kind is StepKind.PREFILL:
            self._schedule_prefill(out, now)
            if not out.seqs and (self.running or self.swapped):
                kind = StepKind.DECODE
        if kind is StepKind.DECODE:
            self._schedule_decode(out, now)
            if not out.seqs and self.waiting and not self.running:
                # Everything running was preempted or ended: use the step for the front of the queue.
                self._schedule_prefill(out, now)
        return out.freeze()

    def _schedule_prefill(self, out: StepDraft, now: float) -> None:
        cfg = self.schedule_config
        kv = self.kv
        cap = self.batch_cap
        max_reqs = min(cfg.effective_max_prefill_batch_size, cap - len(self.running))
        batch: list[Sequence] = []
        tokens = 0
        forks = 0  # running slots the batch's forks will take after the step
        while len(batch) < max_reqs:
            seq = self._servable_head(out, now)
            if seq is None:
                break
            # A group of n larger than the TPOT controller's cap (never than maxBatchSize) still starts alone.
            limit = max(cap, seq.num_samples) if not self.running and not batch else cap
            if len(self.running) + forks + seq.num_samples > limit or not kv.can_allocate(seq):
                break
            new_tokens = seq.num_tokens - kv.prefix_hit_tokens(seq)
            if batch and tokens + new_tokens > cfg.maxPrefillTokens:
                break
            self.waiting.pop()
            kv.allocate(seq)
            forks += seq.num_forks_pending
            tokens += seq.num_tokens - seq.num_cached_tokens
            seq.status = _RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            self.running.append(seq)
            batch.append(seq)
        for seq in batch:
            if not seq.prefill_batch_size:
                seq.prefill_batch_size = len(batch)
        if batch:
            out.kind = StepKind.PREFILL
            out.seqs = batch

    def _schedule_mixed(self, out: StepDraft, now: float) -> None:
        """Chunked prefill: every running request decodes, unfinished prompts continue by chunks, and new ones are
        admitted, all in one step under maxPrefillTokens tokens (decodes first, one token each)."""
        if not self.running and not self.swapped and not self.waiting:
            return
        cfg = self.schedule_config
        decoding = [s for s in self.running if s.num_cached_tokens >= s.num_tokens - 1]
        chunking = [s for s in self.running if s.num_cached_tokens < s.num_tokens - 1]
        self._schedule_decode(out, now, only=decoding)
        # _schedule_decode may preempt (the newest first, chunking ones included) and swap in
        seqs, counts = list(out.seqs), [1] * len(out.seqs)
        budget = cfg.maxPrefillTokens - len(seqs)

        def take(seq: Sequence) -> None:
            nonlocal budget
            chunk = min(seq.num_tokens - seq.num_cached_tokens, budget)
            seqs.append(seq)
            counts.append(chunk)
            budget -= chunk

        for seq in chunking:
            if seq.status is _RUNNING and budget > 0:
                take(seq)
        admitted = 0
        max_new = min(cfg.effective_max_prefill_batch_size, self.batch_cap - len(self.running))
        while budget > 0 and admitted < max_new and not out.swap_out and not self.swapped:
            new = self._admit(out, now)
            if new is None:
                break
            take(new)
            admitted += 1
        prefills = len(seqs) - len(out.seqs)
        for seq in seqs[len(seqs) - admitted:]:
            seq.prefill_batch_size = prefills
        if seqs:
            out.kind, out.seqs, out.num_new_tokens, out.num_prefill_seqs = StepKind.MIXED, seqs, counts, prefills

    def _servable_head(self, out: StepDraft, now: float) -> Sequence | None:
        """The head of the waiting queue, after ending the heads that can never run (into `out.finished`)."""
        max_batch = self.schedule_config.maxBatchSize
        while (seq := self.waiting.peek()) is not None:
            if not self.kv.can_ever_fit(seq.num_tokens):
                # Only a recomputed request can have grown past the cache: it keeps what it generated.
                if seq.num_output_tokens:
                    reason = FinishReason.LENGTH
                else:
                    seq.error, reason = f"prompt of {seq.num_tokens} tokens cannot fit the KV cache", FinishReason.ERROR
            elif seq.num_samples > max_batch:  # maxBatchSize lowered live below its n: it can never run
                seq.error = f"n of {seq.num_samples} sequences exceeds maxBatchSize {max_batch}"
                reason = FinishReason.ERROR
            else:
                return seq
            self.waiting.pop()
            self._end(seq, reason, now)
            out.finished.append(seq)
        return None

    def _admit(self, out: StepDraft, now: float) -> Sequence | None:
        """The head of the waiting queue, with blocks for its whole prompt, now running; None if it cannot be."""
        kv = self.kv
        seq = self._servable_head(out, now)
        forks = sum(s.num_forks_pending for s in self.running)  # children of prompts still being chunked
        if seq is None or len(self.running) + forks + seq.num_samples > self.batch_cap:
            return None
        if not kv.can_allocate(seq):
            return None
        self.waiting.pop()
        kv.allocate(seq)
        seq.status = _RUNNING
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = now
        self.running.append(seq)
        return seq

    def _schedule_decode(self, out: StepDraft, now: float, only: list[Sequence] | None = None) -> None:
        kv = self.kv
        append = kv.append
        blocked: list[Sequence] = []
        decoding = self.running if only is None else only
        for seq in decoding:
            if not append(seq):
                blocked.append(seq)
        stalled: set[int] = set()
        preempted = False
        if blocked:
            stalled, preempted = self._resolve_blocked(out, blocked, now)
        self.num_stalled = len(stalled)
        batch = [s for s in decoding if s.status is _RUNNING and s.seq_id not in stalled]
        if not preempted and not stalled:
            self._swap_in(out, batch, now)
        n = len(batch)
        for seq in batch:
            seq.decode_batch_size_sum += n
            seq.num_decode_steps += 1
        if batch:
            out.kind = StepKind.DECODE
            out.seqs = batch

    def _resolve_blocked(self, out: StepDraft, blocked: list[Sequence], now: float) -> tuple[set[int], bool]:
        """Requests that found no block: stall them or preempt (see the recompute threshold in the docstring).

        Returns the ids of the stalled requests and whether anything was preempted.
        """
        kv = self.kv
        still: list[Sequence] = []
        for seq in blocked:
            if kv.can_ever_fit(seq.num_tokens):
                still.append(seq)
            else:
                self.running.remove(seq)
                self._end(seq, FinishReason.LENGTH, now)
                out.finished.append(seq)
        blocked = still
        if not blocked:
            return set(), False
        blocked_ids = {s.seq_id for s in blocked}
        held = sum(len(s.block_table) for s in self.running if s.seq_id not in blocked_ids)
        can_run = len(self.running) > len(blocked)
        if can_run and held >= self.recompute_threshold * kv.num_device_blocks:
            return blocked_ids, False
        swaps = 0
        while blocked:
            victim = self.running.pop()  # the most recently admitted
            if victim.seq_id in blocked_ids:
                blocked.remove(victim)
                blocked_ids.discard(victim.seq_id)
            swaps += self._preempt(out, victim, swaps)
            blocked = [s for s in blocked if not kv.append(s)]
        return set(), True

    def _preempt(self, out: StepDraft, victim: Sequence, swaps_this_step: int) -> int:
        """Swap the victim out or send it back to be recomputed; returns 1 if it was swapped."""
        victim.num_preemptions += 1
        self.num_preemptions_total += 1
        kv = self.kv
        mid_prompt = victim.num_cached_tokens < victim.num_tokens - 1  # a chunked prefill not done: recompute it
        mid_prompt |= victim.num_forks_pending > 0  # its prompt's end not sampled yet (n > 1): recompute it too
        if swaps_this_step < self.schedule_config.maxPreemptCount and not mid_prompt and kv.can_swap_out(victim):
            out.swap_out.extend(kv.swap_out(victim))
            victim.status = SequenceStatus.SWAPPED
            self.swapped.append(victim)
            return 1
        kv.free(victim)
        victim.num_cached_tokens = 0
        victim.status = SequenceStatus.WAITING
        self.waiting.push_front(victim)
        out.preempted.append(victim)
        return 0

    def _swap_in(self, out: StepDraft, batch: list[Sequence], now: float) -> None:
        kv = self.kv
        max_batch = self.batch_cap
        while self.swapped and len(self.running) < max_batch:
            seq = self.swapped[0]
            if not kv.can_ever_fit(seq.num_tokens):
                self.swapped.popleft()
                self._end(seq, FinishReason.LENGTH, now)
                out.finished.append(seq)
                continue
            if not kv.can_swap_in(seq):
                break
            self.swapped.popleft()
            out.swap_in.extend(kv.swap_in(seq))
            kv.append(seq)
            seq.status = _RUNNING
            self.running.append(seq)
            batch.append(seq)

    # --- after the model ran -----------------------------------------------------------------------------------

    def update_from_output(
        self, output: SchedulerOutput, token_ids: list[int], logprobs: list[float] | None = None,
        top_logprobs: list[TopLogprobs] | None = None,
        prompt_logprobs: dict[int, list[PromptLogprob]] | None = None,
    ) -> StepOutcome:
        """Everything a step's results change, in one place: each sequence's prefix-cache hits (at its first
        prompt step) and cached-token count, its prompt logprobs (`prompt_logprobs`: seq_id -> this step's), the
        sampled tokens (`seq.num_samples` per scheduled sequence, in `output.seqs` order: one, or one per choice at
        a forking prefill), the forks (their block copies go out with the next step), the grammars' advance, and
        the ends. A sequence that ended while the step ran (aborted, or `finish`ed) is skipped. `output` is only
        read.
        """
        seqs = output.seqs
        if not seqs:
            return StepOutcome([], [], [], [], [])
        # A decode step samples one row per sequence (forks happen at the prefill that ends a prompt).
        rows = len(seqs) if output.kind is StepKind.DECODE else sum(s.num_samples for s in seqs)
        if len(token_ids) != rows:
            raise ValueError(f"{len(token_ids)} tokens for {rows} sampled rows of {len(seqs)} scheduled sequences")
        now = self.clock()
        if self.dynamic_batch is not None and output.kind is StepKind.DECODE:
            self._observe_decode(self.dynamic_batch, seqs, now)
        kv = self.kv
        cache = kv.cache_computed if kv.enable_prefix_caching else None
        block_size = kv.block_size
        prefill = output.kind is not StepKind.DECODE  # MIXED steps compute prompt tokens too
        chunks = output.num_new_tokens if output.kind is StepKind.MIXED else None
        eos, max_iter, max_seq_len = self.eos_token_ids, self.schedule_config.maxIterTimes, self.max_seq_len
        finished: list[Sequence] = []
        owners: list[Sequence | None] = [None] * rows
        forked: list[tuple[Sequence, Sequence]] = []
        copies: list[tuple[int, int]] = []
        if prefill:
            for seq in seqs:
                # the prefix cache's hits (before this step marks its tokens cached): usage's cached_tokens
                if seq.num_prompt_cached_tokens is None:
                    seq.num_prompt_cached_tokens = min(seq.num_cached_tokens, seq.num_prompt_tokens)
                if prompt_logprobs and seq.seq_id in prompt_logprobs:
                    seq.prompt_logprobs = (seq.prompt_logprobs or []) + prompt_logprobs[seq.seq_id]

        # the hot loop (every running request, every step): locals only, one call per sampled token
        def append(seq: Sequence, r: int) -> None:
            sp = seq.sampling
            if seq.first_token_time is None:
                seq.first_token_time = now
            if sp.max_tokens == 0:  # prompt logprobs only: nothing is generated
                reason = FinishReason.LENGTH
            else:
                token = token_ids[r]
                owners[r] = seq
                tokens = seq.token_ids
                tokens.append(token)
                if logprobs is not None:
                    seq.output_logprobs.append(logprobs[r])
                    seq.cumulative_logprob += logprobs[r]
                if top_logprobs is not None and sp.top_logprobs:
                    seq.output_top_logprobs.append(top_logprobs[r])
                n = len(tokens)
                num_out = n - len(seq.prompt_token_ids)
                if ((token in eos and not sp.ignore_eos) or token in sp.stop_token_ids) and num_out >= sp.min_tokens:
                    reason = FinishReason.STOP
                elif num_out >= sp.max_tokens or num_out >= max_iter or n >= max_seq_len:
                    reason = FinishReason.LENGTH
                else:
                    return
            self._end(seq, reason, now)
            finished.append(seq)

        row = 0
        for i, seq in enumerate(seqs):
            first_row = row
            forks = seq.num_forks_pending
            row += 1 + forks
            if seq.status is not _RUNNING:
                continue
            n = len(seq.token_ids)
            if chunks is not None and seq.num_cached_tokens + chunks[i] < n:
                seq.num_cached_tokens += chunks[i]  # a prompt chunk short of the last token: nothing sampled
                if cache is not None:
                    cache(seq)
                continue
            seq.num_cached_tokens = n  # every token before the new one now has its KV
            if cache is not None and (prefill or n % block_size == 0):
                cache(seq)
            if forks:
                children = self._fork(seq, forked, copies)
                for j, member in enumerate([seq, *children]):
                    append(member, first_row + j)
            else:
                append(seq, first_row)
        for seq in guided.advance(owners, token_ids):  # the grammar is complete: the request stops here
            self.finish(seq, FinishReason.STOP)
            finished.append(seq)
        if finished:
            self.running = [s for s in self.running if s.status is _RUNNING]
        self._pending_copies.extend(copies)
        return StepOutcome([*seqs, *(child for _, child in forked)], finished, forked, copies, owners)

    def _observe_decode(self, controller: DynamicBatchController, seqs: list[Sequence], now: float) -> None:
        """The live TPOT of a decode step, for the controller: its requests' mean gap since their previous token
        (the last decode step's end, or their first token when that came later: a prefill since). The first decode
        step after the controller started only marks the time."""
        last, self._last_decode_end = self._last_decode_end, now
        if last is None:
            return
        total = 0.0
        for seq in seqs:
            previous = seq.first_token_time
            total += now - (last if previous is None or last > previous else previous)
        controller.observe(total / len(seqs), len(seqs))

    def _fork(self, parent: Sequence, forked: list[tuple[Sequence, Sequence]],
              copies: list[tuple[int, int]]) -> list[Sequence]:
        """The parent's n - 1 children, sharing its prompt's blocks; they run from the next step on."""
        children = []
        for index in range(parent.index + 1, parent.index + 1 + parent.num_forks_pending):
            child = parent.fork(index)
            copies.extend(self.kv.fork(parent, child))
            child.status = _RUNNING
            self._seqs[child.seq_id] = child
            self.running.append(child)
            forked.append((parent, child))
            children.append(child)
        parent.num_forks_pending = 0
        return children


def _dynamic_batch(schedule: ScheduleSection, running: DynamicBatchController | None) -> DynamicBatchController | None:
    """The controller a schedule asks for: None when dynamicBatchSizeEnable is off; the running one, with the new
    bounds and target, when it stays on (its cap carries over); a new one (cap at maxBatchSize) when it turns on."""
    if not schedule.dynamicBatchSizeEnable:
        return None
    target_s = schedule.decodeExpectedTime / 1000.0
    if running is None:
        return DynamicBatchController(schedule.maxBatchSize, target_s)
    running.reconfigure(schedule.maxBatchSize, target_s)
    return running
