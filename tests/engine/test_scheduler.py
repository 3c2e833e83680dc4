"""Scheduler rules (docs/engine.md#the-scheduler-mindie-semantics), one test or two per rule, on an injected clock. No
torch, no wall time."""

from __future__ import annotations

from typing import Any

import pytest

from npuserve.engine.kvcache import KVCacheManager
from npuserve.engine.scheduler import Scheduler, SchedulerOutput, StageSelector, StepKind, WaitingQueue
from npuserve.engine.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus
from npuserve.mindie_config import EngineEnvironment, ScheduleSection

EOS = 0
TOKEN = 1  # a token that ends nothing


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def advance_us(self, us: float) -> None:
        self.t += us / 1e6


def make(
    blocks: int = 64,
    block_size: int = 4,
    host_blocks: int = 0,
    *,
    prefix: bool = True,
    policy: Any = "fcfs",
    max_seq_len: int = 2560,
    threshold: float = 0.5,
    **schedule: Any,
) -> tuple[Scheduler, KVCacheManager, Clock]:
    if "maxBatchSize" in schedule:
        schedule.setdefault("maxPrefillBatchSize", min(50, schedule["maxBatchSize"]))
    clock = Clock()
    kv = KVCacheManager(blocks, host_blocks, block_size, enable_prefix_caching=prefix)
    sched = Scheduler(
        ScheduleSection(**schedule),
        kv,
        policy=policy,
        max_seq_len=max_seq_len,
        eos_token_ids=(EOS,),
        recompute_threshold=threshold,
        clock=clock,
    )
    return sched, kv, clock


_prompt_base = iter(range(1000, 10**9, 1000))


def req(
    sched: Scheduler,
    n: int,
    max_tokens: int = 16,
    *,
    priority: int = 0,
    ignore_eos: bool = False,
    stop_token_ids: tuple[int, ...] = (),
    prompt: list[int] | None = None,
) -> Sequence:
    base = next(_prompt_base)  # distinct prompts: no accidental prefix hits
    seq = Sequence(
        prompt_token_ids=prompt if prompt is not None else [base + i for i in range(n)],
        sampling=SamplingParams(
            max_tokens=max_tokens, priority=priority, ignore_eos=ignore_eos, stop_token_ids=stop_token_ids
        ),
        arrival_time=sched.clock(),
    )
    sched.add(seq)
    return seq


def step(sched: Scheduler, token: int = TOKEN) -> tuple[SchedulerOutput, list[Sequence]]:
    out = sched.schedule()
    check_output(sched, out)
    return out, sched.update_from_output(out, [token] * len(out.seqs)).finished


def drain(queue: WaitingQueue) -> list[Sequence]:
    """The waiting queue in service order, emptied the way the scheduler takes from it."""
    return [queue.pop() for _ in range(len(queue))]


def check_output(sched: Scheduler, out: SchedulerOutput) -> None:
    """The guarantees SchedulerOutput documents for the engine."""
    bs = sched.kv.block_size
    for seq in out.seqs:
        assert seq.status is SequenceStatus.RUNNING
        assert len(seq.block_table) * bs >= seq.num_tokens
        assert not seq.host_block_table
        if out.kind is StepKind.PREFILL:
            assert 0 <= seq.num_cached_tokens < seq.num_tokens
        else:
            assert seq.num_cached_tokens == seq.num_tokens - 1


# --- stage selection: supportSelectBatch = false (DecidePDPriority) ------------------------------------------------


def test_prefill_starts_at_once_when_nothing_runs() -> None:
    sched, _, _ = make()
    a = req(sched, 5)
    out, _ = step(sched)
    assert out.kind is StepKind.PREFILL and out.seqs == [a]
    assert a.first_scheduled_time == sched.clock()


def test_prefill_waits_for_max_queue_delay_while_decoding() -> None:
    sched, _, clock = make(maxQueueDelayMicroseconds=5000)
    a = req(sched, 5)
    step(sched)
    b = req(sched, 5)
    clock.advance_us(4999)
    out, _ = step(sched)
    assert out.kind is StepKind.DECODE and out.seqs == [a]
    clock.advance_us(1)
    out, _ = step(sched)
    assert out.kind is StepKind.PREFILL and out.seqs == [b]


def test_full_prefill_batch_starts_after_5ms_under_a_longer_delay() -> None:
    sched, _, clock = make(maxQueueDelayMicroseconds=100_000, maxPrefillBatchSize=2, maxBatchSize=10)
    req(sched, 5)
    step(sched)
    req(sched, 5)
    clock.advance_us(4000)
    assert step(sched)[0].kind is StepKind.DECODE  # one waiting, 4 ms: not yet
    clock.advance_us(2000)
    assert step(sched)[0].kind is StepKind.DECODE  # 6 ms but only one of two waits
    req(sched, 5)
    out, _ = step(sched)
    assert out.kind is StepKind.PREFILL and len(out.seqs) == 2


def test_decode_first_when_fewer_than_5_percent_blocks_free() -> None:
    sched, kv, clock = make(blocks=40, block_size=2)
    a = req(sched, 77)  # 39 of 40 blocks
    step(sched)
    assert kv.free_fraction < 0.05
    req(sched, 1)
    clock.advance_us(10_000)
    out, _ = step(sched)
    assert out.kind is StepKind.DECODE and out.seqs == [a]


def test_decode_first_when_requests_are_swapped() -> None:
    sched, _kv, clock = make(blocks=9, block_size=2, host_blocks=20, maxPreemptCount=1, threshold=0.9)
    a = req(sched, 8, max_tokens=4)
    b = req(sched, 9, max_tokens=4)
    step(sched)
    step(sched)  # a needs a block: b is swapped out
    assert list(sched.swapped) == [b] and b.status is SequenceStatus.SWAPPED
    c = req(sched, 1)
    while not a.is_finished:
        clock.advance_us(1e6)  # c's queue delay is long past
        out, _ = step(sched)
        assert out.kind is StepKind.DECODE and out.seqs == [a]  # b cannot come back yet: no prefill either
    out, _ = step(sched)
    assert out.kind is StepKind.DECODE and out.seqs == [b] and out.swap_in  # b comes back before c is prefilled
    assert c.status is SequenceStatus.WAITING


# --- stage selection: supportSelectBatch = true ---------------------------------------------------------------------


def test_select_batch_cost_rule() -> None:
    cfg = ScheduleSection(
        supportSelectBatch=True, maxBatchSize=4, maxPrefillBatchSize=2, prefillTimeMsPerReq=150, decodeTimeMsPerReq=50
    )
    sel = StageSelector()

    def choose(running: int, waiting: int = 1) -> StepKind:
        return sel.choose(
            cfg,
            num_running=running,
            num_waiting=waiting,
            num_swapped=0,
            num_stalled=0,
            free_fraction=1.0,
            oldest_wait_us=0.0,
        )

    # 2 running: prefillCost = 300; decodeWaste grows by 50 * (4 - 2) = 100 per step.
    assert [choose(2) for _ in range(3)] == [StepKind.DECODE, StepKind.DECODE, StepKind.PREFILL]
    assert sel.decode_waste_ms == 0.0  # reset by the prefill
    assert choose(2) is StepKind.DECODE and sel.decode_waste_ms == 100.0
    assert choose(2, waiting=0) is StepKind.DECODE and sel.decode_waste_ms == 0.0  # nothing waiting: reset
    assert choose(0) is StepKind.PREFILL  # nothing runs: no prefill cost


def test_select_batch_through_the_scheduler() -> None:
    sched, _, _ = make(supportSelectBatch=True, maxBatchSize=4, prefillTimeMsPerReq=150, decodeTimeMsPerReq=50)
    req(sched, 3)
    req(sched, 3)
    assert step(sched)[0].kind is StepKind.PREFILL
    req(sched, 3)
    kinds = [step(sched)[0].kind for _ in range(3)]
    assert kinds == [StepKind.DECODE, StepKind.DECODE, StepKind.PREFILL]


# --- prefill batch limits --------------------------------------------------------------------------------------------


def test_prefill_batch_closes_at_max_prefill_batch_size() -> None:
    sched, _, _ = make(maxPrefillBatchSize=2, maxBatchSize=10)
    seqs = [req(sched, 3) for _ in range(5)]
    out, _ = step(sched)
    assert out.seqs == seqs[:2]
    assert all(s.prefill_batch_size == 2 for s in seqs[:2])


def test_max_prefill_batch_size_zero_means_max_batch_size() -> None:
    sched, _, _ = make(maxPrefillBatchSize=0, maxBatchSize=3)
    for _ in range(5):
        req(sched, 3)
    out, _ = step(sched)
    assert len(out.seqs) == 3


def test_prefill_batch_closes_at_max_prefill_tokens() -> None:
    sched, _, _ = make(maxPrefillTokens=10, maxBatchSize=10, maxPrefillBatchSize=10)
    a, b, _c = req(sched, 4), req(sched, 6), req(sched, 1)
    out = sched.schedule()
    assert out.seqs == [a, b]
    assert out.num_batched_tokens == 10


def test_a_lone_prompt_over_max_prefill_tokens_still_runs() -> None:
    sched, _, _ = make(maxPrefillTokens=8)
    a = req(sched, 12)
    out, _ = step(sched)
    assert out.seqs == [a]


def test_prefill_batch_respects_max_batch_size_running() -> None:
    sched, _, clock = make(maxBatchSize=3, maxPrefillBatchSize=3)
    req(sched, 3)
    req(sched, 3)
    step(sched)
    for _ in range(3):
        req(sched, 3)
    clock.advance_us(10_000)
    out, _ = step(sched)
    assert out.kind is StepKind.PREFILL and len(out.seqs) == 1
    assert sched.num_running == 3 and sched.num_waiting == 2
    clock.advance_us(10_000)
    assert step(sched)[0].kind is StepKind.DECODE  # full: decode whatever the delay


def test_prefill_batch_closes_when_blocks_run_out_in_queue_order() -> None:
    sched, _, _ = make(blocks=5, block_size=4)
    a, b, c = req(sched, 12), req(sched, 12), req(sched, 2)  # 3 + 3 blocks: b does not fit
    out, _ = step(sched)
    assert out.seqs == [a]
    assert b.status is SequenceStatus.WAITING and c.status is SequenceStatus.WAITING  # c does not overtake b


def test_prefix_hits_are_skipped_in_prefill() -> None:
    sched, _, clock = make(block_size=4)
    shared = list(range(500, 508))
    a = req(sched, 0, prompt=[*shared, 1, 2])
    step(sched)
    b = req(sched, 0, prompt=[*shared, 3])
    clock.advance_us(10_000)
    out = sched.schedule()
    assert out.seqs == [b]
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert out.num_batched_tokens == 1


# --- preemption ------------------------------------------------------------------------------------------------------


def _two_running(
    threshold: float, b_max_tokens: int = 3, **kw: Any
) -> tuple[Scheduler, KVCacheManager, Sequence, Sequence]:
    """9 blocks of 2 tokens: a (8 tokens, 4 blocks) and b (9 tokens, 5 blocks) fill the cache. After the prefill
    a holds 9 tokens and needs a 5th block; b holds 10 in its 5 blocks and can run."""
    sched, kv, _ = make(blocks=9, block_size=2, threshold=threshold, **kw)
    a = req(sched, 8, max_tokens=3)
    b = req(sched, 9, max_tokens=b_max_tokens)
    out, _ = step(sched)
    assert out.seqs == [a, b] and kv.device.num_free == 0
    return sched, kv, a, b


def test_recompute_preempts_the_most_recently_admitted() -> None:
    sched, _kv, a, b = _two_running(threshold=0.9)  # b holds 5/9 of the blocks: under 0.9, preempt
    out, _ = step(sched)
    assert out.kind is StepKind.DECODE and out.seqs == [a]
    assert out.preempted == [b] and not out.swap_out
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and b.num_cached_tokens == 0
    assert b.num_preemptions == 1 and sched.num_preemptions_total == 1
    assert sched.waiting.peek() is b


def test_recomputed_request_prefills_prompt_and_output_and_continues() -> None:
    sched, _, a, b = _two_running(threshold=0.9)
    step(sched)  # b preempted; its first output token is kept
    assert b.num_output_tokens == 1
    while a.status is not SequenceStatus.FINISHED:
        step(sched)
    out = sched.schedule()
    check_output(sched, out)
    assert out.kind is StepKind.PREFILL and out.seqs == [b]
    assert b.num_tokens == 10  # 9 prompt + 1 generated, all recomputed (less any prefix hit)
    sched.update_from_output(out, [7])
    assert b.output_token_ids == [TOKEN, 7]
    while b.status is not SequenceStatus.FINISHED:
        step(sched)
    assert b.num_output_tokens == 3 and b.finish_reason is FinishReason.LENGTH


def test_preempted_goes_to_the_front_of_waiting() -> None:
    sched, _, _a, b = _two_running(threshold=0.9)
    c = req(sched, 1)
    step(sched)
    assert drain(sched.waiting) == [b, c]


def test_swap_when_max_preempt_count_allows_and_host_has_room() -> None:
    sched, _kv, a, b = _two_running(threshold=0.9, host_blocks=10, maxPreemptCount=1)
    blocks_before = list(b.block_table)
    out, _ = step(sched)
    assert out.seqs == [a] and not out.preempted
    assert [d for d, _ in out.swap_out] == blocks_before
    assert b.status is SequenceStatus.SWAPPED and list(sched.swapped) == [b]
    host = [h for _, h in out.swap_out]
    while a.status is not SequenceStatus.FINISHED:
        step(sched)
    out, _ = step(sched)
    assert out.kind is StepKind.DECODE and b in out.seqs
    assert [h for h, _ in out.swap_in] == host
    assert b.output_token_ids == [TOKEN, TOKEN]  # its output continued without a recompute


def test_swap_without_host_room_falls_back_to_recompute() -> None:
    sched, _, _, b = _two_running(threshold=0.9, host_blocks=2, maxPreemptCount=1)
    out, _ = step(sched)
    assert out.preempted == [b] and not out.swap_out


def test_at_most_max_preempt_count_swaps_per_step() -> None:
    # block size 1: every sequence needs a block every step. a holds 4, b and c hold 1: the cache is full.
    sched, _, _ = make(blocks=6, block_size=1, host_blocks=10, maxPreemptCount=1, threshold=0.9)
    a, b, c = req(sched, 4), req(sched, 1), req(sched, 1)
    step(sched)
    c_blocks = list(c.block_table)
    out, _ = step(sched)  # all three blocked: c swapped (1 of 1), then b recomputed
    assert out.seqs == [a]
    assert c.status is SequenceStatus.SWAPPED and b.status is SequenceStatus.WAITING
    assert out.preempted == [b] and [d for d, _ in out.swap_out] == c_blocks


# --- the recompute threshold (MINDIE_LLM_RECOMPUTE_THRESHOLD) --------------------------------------------------------


def test_threshold_stalls_instead_of_preempting_when_runnable_requests_hold_enough_blocks() -> None:
    # b, the request that can run, holds 5 of 9 blocks (56%): at threshold 0.5 that is enough, a stalls.
    sched, _, a, b = _two_running(threshold=0.5, b_max_tokens=2)
    out, finished = step(sched)
    assert out.seqs == [b] and not out.preempted and not out.swap_out
    assert a.status is SequenceStatus.RUNNING and sched.num_stalled == 1
    assert sched.num_preemptions_total == 0
    assert finished == [b]  # and frees its blocks
    # a, stalled, runs next: decode first, ahead of a new prefill whose queue delay is past.
    c = req(sched, 1)
    sched.clock.advance_us(1e6)  # type: ignore[attr-defined]
    out, _ = step(sched)
    assert out.kind is StepKind.DECODE and out.seqs == [a]
    assert c.status is SequenceStatus.WAITING and sched.num_stalled == 0


@pytest.mark.parametrize(("threshold", "preempts"), [(0.0, False), (0.5, False), (0.55, False), (0.56, True)])
def test_threshold_boundary(threshold: float, preempts: bool) -> None:
    # held / total = 5 / 9 = 0.5555...: preemption exactly when that is below the threshold.
    sched, _, _, b = _two_running(threshold=threshold)
    out, _ = step(sched)
    assert (out.preempted == [b]) is preempts


def test_threshold_never_blocks_progress_when_nothing_can_run() -> None:
    sched, _, _ = make(blocks=8, block_size=2, threshold=0.0)
    a, b = req(sched, 8), req(sched, 8)  # 4 + 4 blocks; both need a 5th
    step(sched)
    out, _ = step(sched)
    assert out.seqs == [a] and out.preempted == [b]


def _decode_under_environment(environ: dict[str, str]) -> tuple[SchedulerOutput, Sequence, Sequence]:
    """The decode step of `_two_running` with the threshold read from `environ` as the engine reads it."""
    threshold = EngineEnvironment.from_environ(environ).recompute_threshold
    sched, _, a, b = _two_running(threshold=threshold)
    return step(sched)[0], a, b


def _preempted(out: SchedulerOutput, a: Sequence, b: Sequence) -> bool:
    """Which way the decode step went: b, the runnable request, holds 5 of 9 blocks (a share of 0.556)."""
    if out.seqs == [b]:  # enough blocks are held by runnable requests: a stalls, keeping its blocks
        assert a.status is SequenceStatus.RUNNING and a.block_table and b.num_preemptions == 0
        return False
    assert out.seqs == [a]  # too few: b, the most recently admitted, is recomputed and a runs
    assert b.status is SequenceStatus.WAITING and not b.block_table and b.num_preemptions == 1
    return True


@pytest.mark.parametrize("name", ["MINDIE_LLM_RECOMPUTE_THRESHOLD", "MIES_RECOMPUTE_THRESHOLD"])
@pytest.mark.parametrize(("value", "preempts"), [("0.5", False), ("0.6", True)])
def test_threshold_from_the_environment_decides_preemption(name: str, value: str, preempts: bool) -> None:
    # MindIE's reading: below the threshold, the share held by the requests that can run triggers recomputation.
    assert _preempted(*_decode_under_environment({name: value})) is preempts


def test_threshold_default_is_mindies_half() -> None:
    assert _preempted(*_decode_under_environment({})) is False  # 0.556 >= 0.5


@pytest.mark.parametrize(("newer", "older", "preempts"), [("0.6", "0.5", True), ("0.5", "0.6", False)])
def test_threshold_newer_environment_name_wins(newer: str, older: str, preempts: bool) -> None:
    environ = {"MINDIE_LLM_RECOMPUTE_THRESHOLD": newer, "MIES_RECOMPUTE_THRESHOLD": older}
    assert _preempted(*_decode_under_environment(environ)) is preempts


def test_threshold_out_of_range_refused() -> None:
    with pytest.raises(ValueError):
        make(threshold=1.0)


# --- requests that can never run ------------------------------------------------------------------------------------


def test_prompt_larger_than_the_whole_cache_ends_with_error() -> None:
    sched, kv, _ = make(blocks=4, block_size=4)
    big = req(sched, 17)
    ok = req(sched, 3)
    assert big.status is SequenceStatus.FINISHED and big.finish_reason is FinishReason.ERROR and big.error
    out, _ = step(sched)
    assert out.finished == [big] and out.seqs == [ok]
    assert kv.num_used_blocks == 1


def test_prompt_without_room_under_max_seq_len_ends_with_error() -> None:
    sched, _, _ = make(max_seq_len=8)
    s = req(sched, 8)
    assert s.finish_reason is FinishReason.ERROR
    assert sched.has_unfinished()  # until the next schedule() reports it
    out = sched.schedule()
    assert out.finished == [s] and not sched.has_unfinished()


def test_request_outgrowing_the_cache_ends_with_length() -> None:
    sched, kv, _ = make(blocks=2, block_size=2, max_seq_len=100)
    s = req(sched, 3, max_tokens=50)
    for _ in range(10):
        if s.is_finished:
            break
        step(sched)
    # 4 tokens have KV in the 2 blocks; the 5th was sampled from them and needs none.
    assert s.finish_reason is FinishReason.LENGTH and s.num_tokens == 5
    assert kv.num_used_blocks == 0


# --- policies --------------------------------------------------------------------------------------------------------


def _prefill_order(policy: str, specs: list[tuple[int, int]]) -> list[int]:
    sched, _, clock = make(policy=policy, maxPrefillBatchSize=1, maxBatchSize=10)
    seqs = []
    for i, (priority, max_tokens) in enumerate(specs):
        seqs.append(req(sched, 3, max_tokens=max_tokens, priority=priority))
        seqs[-1].arrival_time += i * 1e-3  # distinct arrivals in list order
    order = []
    for _ in specs:
        clock.advance_us(1e6)
        out, _ = step(sched)
        assert out.kind is StepKind.PREFILL
        order.append(seqs.index(out.seqs[0]))
    return order


def test_fcfs_policy() -> None:
    assert _prefill_order("fcfs", [(5, 10), (0, 50), (9, 30)]) == [0, 1, 2]


def test_priority_policy_lower_first() -> None:
    assert _prefill_order("priority", [(5, 10), (0, 50), (9, 30), (0, 1)]) == [1, 3, 0, 2]


def test_longest_output_first_policy() -> None:
    assert _prefill_order("longest-output-first", [(0, 10), (0, 50), (0, 30), (0, 50)]) == [1, 3, 2, 0]


def test_unknown_policy_refused() -> None:
    with pytest.raises(ValueError):
        WaitingQueue("lifo")  # type: ignore[arg-type]


def test_preempted_go_first_under_any_policy() -> None:
    q = WaitingQueue("priority")
    seqs = [Sequence([1], SamplingParams(priority=p), arrival_time=0.0) for p in (0, 1, 2)]
    q.push(seqs[0])
    q.push_front(seqs[2])
    q.push_front(seqs[1])
    assert q.oldest_arrival() == 0.0
    assert drain(q) == [seqs[1], seqs[2], seqs[0]]


# --- ends ------------------------------------------------------------------------------------------------------------


def test_eos_stops_unless_ignored() -> None:
    sched, kv, _ = make()
    a = req(sched, 3)
    b = req(sched, 3, ignore_eos=True)
    _, finished = step(sched, token=EOS)
    assert finished == [a] and a.finish_reason is FinishReason.STOP
    assert b.status is SequenceStatus.RUNNING
    assert a.block_table == [] and kv.num_used_blocks == len(b.block_table)


def test_no_stop_before_min_tokens() -> None:
    """vLLM's min_tokens: EOS and stop tokens end nothing until that many tokens are out (the sampler also holds
    them back; this holds when a token comes anyway, e.g. the only one a grammar allows)."""
    sched, _, _ = make()
    a = req(sched, 3, stop_token_ids=(42,))
    a.sampling.min_tokens = 3
    for token in (EOS, 42):
        _, finished = step(sched, token=token)
        assert finished == [] and a.status is SequenceStatus.RUNNING
    _, finished = step(sched, token=42)
    assert finished == [a] and a.finish_reason is FinishReason.STOP and a.output_token_ids == [EOS, 42, 42]


def test_stop_token_ids_stop_even_with_ignore_eos() -> None:
    sched, _, _ = make()
    a = req(sched, 3, ignore_eos=True, stop_token_ids=(42,))
    step(sched)
    _, finished = step(sched, token=42)
    assert finished == [a] and a.finish_reason is FinishReason.STOP and a.output_token_ids == [TOKEN, 42]


def test_max_tokens_ends_with_length() -> None:
    sched, _, _ = make()
    a = req(sched, 3, max_tokens=3)
    done = []
    while not done:
        done = step(sched)[1]
    assert done == [a] and a.num_output_tokens == 3 and a.finish_reason is FinishReason.LENGTH


def test_max_iter_times_caps_output() -> None:
    sched, _, _ = make(maxIterTimes=2)
    a = req(sched, 3, max_tokens=100)
    step(sched)
    step(sched)
    assert a.finish_reason is FinishReason.LENGTH and a.num_output_tokens == 2


def test_max_seq_len_caps_prompt_plus_output() -> None:
    sched, _, _ = make(max_seq_len=6)
    a = req(sched, 4, max_tokens=100)
    step(sched)
    step(sched)
    assert a.finish_reason is FinishReason.LENGTH and a.num_tokens == 6


def test_finish_for_a_stop_string_frees_blocks() -> None:
    sched, kv, _ = make()
    a = req(sched, 3)
    step(sched)
    sched.finish(a, FinishReason.STOP)
    assert a.finish_reason is FinishReason.STOP and kv.num_used_blocks == 0
    assert sched.num_running == 0 and not sched.has_unfinished()


# --- aborts ----------------------------------------------------------------------------------------------------------


def test_abort_waiting_running_and_swapped_free_blocks_at_once() -> None:
    sched, kv, a, b = _two_running(threshold=0.9, host_blocks=10, maxPreemptCount=1)
    step(sched)  # b swapped out
    c = req(sched, 2)
    assert sched.abort(a.seq_id) and sched.abort(b.seq_id) and sched.abort(c.seq_id)
    assert not sched.abort(a.seq_id)
    assert kv.num_used_blocks == 0 and kv.host.num_free == 10
    assert sched.num_running == sched.num_waiting == sched.num_swapped == 0
    assert sched.has_unfinished()  # until the aborts are reported
    out = sched.schedule()
    assert out.kind is StepKind.IDLE and out.finished == [a, b, c]
    assert all(s.finish_reason is FinishReason.ABORT for s in (a, b, c))
    assert not sched.has_unfinished()


def test_abort_during_a_step_is_skipped_by_update_from_output() -> None:
    sched, _kv, _ = make()
    a, b = req(sched, 3), req(sched, 3)
    out = sched.schedule()
    sched.abort(a.seq_id)
    finished = sched.update_from_output(out, [TOKEN, TOKEN]).finished
    assert finished == [] and a.num_output_tokens == 0 and b.num_output_tokens == 1
    assert sched.schedule().finished == [a]


# --- hot update, statistics, idle ------------------------------------------------------------------------------------


def test_update_schedule_applies_at_the_next_step() -> None:
    sched, _, _ = make(maxPrefillBatchSize=1, maxBatchSize=10)
    for _ in range(4):
        req(sched, 3)
    sched.update_schedule(ScheduleSection(maxPrefillBatchSize=3, maxBatchSize=10))
    assert sched.schedule_config.maxPrefillBatchSize == 1
    out, _ = step(sched)
    assert len(out.seqs) == 3 and sched.schedule_config.maxPrefillBatchSize == 3


def test_per_request_statistics() -> None:
    sched, _, clock = make(maxBatchSize=10)
    a = req(sched, 3, max_tokens=4)
    clock.advance_us(2000)
    b = req(sched, 3, max_tokens=4)
    _out, _ = step(sched)
    assert a.first_scheduled_time == b.first_scheduled_time == clock.t
    assert a.first_scheduled_time - a.arrival_time == pytest.approx(0.002)
    assert a.prefill_batch_size == 2 and a.first_token_time == clock.t
    step(sched)
    step(sched)
    assert a.num_decode_steps == 2 and a.decode_batch_size_sum == 4
    assert a.output_token_ids == [TOKEN] * 3


def test_idle_when_empty() -> None:
    sched, _, _ = make()
    out, finished = step(sched)
    assert out.kind is StepKind.IDLE and out.seqs == [] and finished == []
    assert not sched.has_unfinished()


def test_duplicate_add_refused() -> None:
    sched, _, _ = make()
    a = req(sched, 3)
    with pytest.raises(ValueError):
        sched.add(a)


def test_update_checks_token_count() -> None:
    sched, _, _ = make()
    req(sched, 3)
    out = sched.schedule()
    with pytest.raises(ValueError):
        sched.update_from_output(out, [])


def test_logprobs_recorded() -> None:
    sched, _, _ = make()
    a = req(sched, 3)
    out = sched.schedule()
    sched.update_from_output(out, [TOKEN], [-0.25])
    assert a.output_logprobs == [-0.25]


def test_a_group_larger_than_a_lowered_max_batch_size_ends_with_an_error() -> None:
    sched = Scheduler(ScheduleSection(maxBatchSize=4, maxPrefillBatchSize=4), KVCacheManager(16, 0, 4),
                      clock=lambda: 0.0)
    seq = Sequence([1, 2, 3], SamplingParams(n=3), arrival_time=0.0)
    sched.add(seq)
    sched.update_schedule(ScheduleSection(maxBatchSize=2, maxPrefillBatchSize=2))
    out = sched.schedule()
    assert seq in out.finished and seq.finish_reason is FinishReason.ERROR and "maxBatchSize" in (seq.error or "")
    assert not sched.has_unfinished() and sched.kv.num_used_blocks == 0


def test_n_above_max_batch_size_is_refused_at_add() -> None:
    sched = Scheduler(ScheduleSection(maxBatchSize=2, maxPrefillBatchSize=2), KVCacheManager(16, 0, 4),
                      clock=lambda: 0.0)
    seq = Sequence([1, 2, 3], SamplingParams(n=3), arrival_time=0.0)
    sched.add(seq)
    assert seq.finish_reason is FinishReason.ERROR and "maxBatchSize" in (seq.error or "")
