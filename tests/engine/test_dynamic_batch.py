"""MindIE 2.3's dynamicBatchSizeEnable: the TPOT controller (engine/scheduler/dynamic_batch.py) fed injected step
times, the scheduler admitting under its cap (a fake clock), and the config fields it needs or refuses."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from npuserve.engine.kvcache import KVCacheManager
from npuserve.engine.scheduler import Scheduler, StepKind
from npuserve.engine.scheduler.dynamic_batch import DynamicBatchController
from npuserve.engine.sequence import SamplingParams, Sequence
from npuserve.mindie_config import MindIEConfigError, ScheduleSection, minimal_config

MS = 1e-3


def linear(fixed_ms: float, per_request_ms: float) -> Callable[[int], float]:
    """A decode step's time at a batch: fixed + per_request x batch (seconds)."""
    return lambda batch: (fixed_ms + per_request_ms * batch) * MS


def run(controller: DynamicBatchController, step_time: Callable[[int], float], steps: int,
        demand: int = 10**6) -> list[tuple[int, float]]:
    """A steady overload: the batch is the cap (or the demand); returns each step's (batch, TPOT)."""
    trace = []
    for _ in range(steps):
        batch = min(controller.cap, demand)
        tpot = step_time(batch)
        controller.observe(tpot, batch)
        trace.append((batch, tpot))
    return trace


def token_weighted_tpot(trace: list[tuple[int, float]]) -> float:
    return sum(b * t for b, t in trace) / sum(b for b, _ in trace)


# --- the controller on its own ----------------------------------------------------------------------------------


def test_converges_to_where_the_step_time_crosses_the_target() -> None:
    # 2 ms + 0.5 ms a request crosses 5.75 ms at 7.5 requests: the cap shares its time between 7 and 8.
    controller = DynamicBatchController(64, 5.75 * MS)
    trace = run(controller, linear(2.0, 0.5), 2000)
    steady = trace[500:]
    assert {b for b, _ in steady} == {7, 8}
    assert token_weighted_tpot(steady) == pytest.approx(5.75 * MS, rel=0.02)


def test_is_deterministic_given_the_step_times() -> None:
    a, b = DynamicBatchController(64, 5.75 * MS), DynamicBatchController(64, 5.75 * MS)
    assert run(a, linear(2.0, 0.5), 300) == run(b, linear(2.0, 0.5), 300)


def test_holds_the_target_when_the_step_time_changes() -> None:
    controller = DynamicBatchController(64, 5.75 * MS)
    run(controller, linear(2.0, 0.5), 1000)
    # The steps get twice as costly per request (longer contexts, a neighbour): 5.75 ms is now at 3.75 requests.
    trace = run(controller, linear(2.0, 1.0), 2000)
    steady = trace[500:]
    assert {b for b, _ in steady} == {3, 4}
    assert token_weighted_tpot(steady) == pytest.approx(5.75 * MS, rel=0.02)


def test_does_not_oscillate_between_extremes_under_noise() -> None:
    controller = DynamicBatchController(64, 5.75 * MS)
    noise = [1.0, 1.15, 0.9, 1.05, 0.85, 1.1, 0.95, 1.2]  # +-20% step to step, deterministic
    step = iter(range(10**9))
    trace = run(controller, lambda batch: linear(2.0, 0.5)(batch) * noise[next(step) % len(noise)], 3000)
    batches = [b for b, _ in trace[1000:]]
    assert max(batches) - min(batches) <= 3  # around 7.5, never back to 64 or down to 3
    assert token_weighted_tpot(trace[1000:]) == pytest.approx(5.75 * MS, rel=0.03)


def test_one_slow_step_moves_the_cap_a_little() -> None:
    controller = DynamicBatchController(64, 5.75 * MS)
    run(controller, linear(2.0, 0.5), 1000)
    before = controller.cap
    controller.observe(500 * MS, before)  # a 100x stall (a neighbour's burst)
    assert controller.cap >= before - 2  # 1 + 5% of 7 or 8 requests under the batch, rounded down


def test_bounds_are_three_and_max_batch_size() -> None:
    low = DynamicBatchController(64, 1 * MS)  # faster than any batch can go
    assert min(b for b, _ in run(low, linear(2.0, 0.5), 500)) >= 3
    assert low.cap == 3  # MindIE's lower bound
    high = DynamicBatchController(16, 100 * MS)  # slower than the largest batch
    assert {b for b, _ in run(high, linear(2.0, 0.5), 500)} == {16}
    tiny = DynamicBatchController(2, 1 * MS)  # maxBatchSize under 3: the bound is maxBatchSize
    run(tiny, linear(2.0, 0.5), 100)
    assert tiny.cap == 2


def test_does_not_grow_while_the_load_does_not_fill_it() -> None:
    controller = DynamicBatchController(64, 5.75 * MS)
    run(controller, linear(2.0, 0.5), 2000)  # at 7 or 8
    converged = controller.cap
    run(controller, linear(2.0, 0.5), 500, demand=4)  # little load: TPOT far under the target
    assert controller.cap == converged


def test_live_bounds_and_target() -> None:
    controller = DynamicBatchController(64, 5.75 * MS)
    run(controller, linear(2.0, 0.5), 1000)
    controller.reconfigure(5, 5.75 * MS)  # maxBatchSize lowered live
    assert controller.cap == 5
    controller.reconfigure(64, 4.0 * MS)  # a tighter target: 4 ms is at 4 requests
    steady = run(controller, linear(2.0, 0.5), 2000)[500:]
    assert {b for b, _ in steady} <= {3, 4, 5}
    assert token_weighted_tpot(steady) == pytest.approx(4.0 * MS, rel=0.02)


# --- the scheduler under the cap (a fake clock that advances by each step's modelled time) ------------------------


class StepClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def make(**schedule: object) -> tuple[Scheduler, StepClock]:
    clock = StepClock()
    kv = KVCacheManager(4096, 0, 4, enable_prefix_caching=False)
    section = ScheduleSection.model_validate({"maxPrefillBatchSize": 16, **schedule})
    return Scheduler(section, kv, max_seq_len=512, eos_token_ids=(0,), clock=clock), clock


_lengths = iter(range(10**9))


def add(sched: Scheduler) -> Sequence:
    max_tokens = 12 + next(_lengths) * 7 % 25  # 12 .. 36 output tokens: requests end at different steps
    seq = Sequence(prompt_token_ids=[5, 6, 7, 8], arrival_time=sched.clock(),
                   sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    sched.add(seq)
    return seq


def serve(sched: Scheduler, clock: StepClock, steps: int, concurrency: int
          ) -> tuple[list[tuple[StepKind, int]], list[Sequence]]:
    """A closed loop of `concurrency` requests: each step's time is 2 ms + 0.5 ms a request (decode), 3 ms
    (prefill); a finished request is replaced at once. Returns each step's kind and size, and the finished."""
    for _ in range(concurrency):
        add(sched)
    trace, done = [], []
    for _ in range(steps):
        out = sched.schedule()
        assert out.seqs
        clock.t += (2.0 + 0.5 * len(out.seqs)) * MS if out.kind is StepKind.DECODE else 3.0 * MS
        outcome = sched.update_from_output(out, [1] * len(out.seqs))
        trace.append((out.kind, len(out.seqs)))
        for seq in outcome.finished:
            done.append(seq)
            add(sched)
    return trace, done


def mean_tpot(seqs: list[Sequence]) -> float:
    """The requests' mean TPOT, as a client measures it: (last token - first token) / (tokens - 1)."""
    tpots = [(s.finished_time - s.first_token_time) / (s.num_output_tokens - 1) for s in seqs
             if s.finished_time is not None and s.first_token_time is not None]
    return sum(tpots) / len(tpots)


def test_off_means_off() -> None:
    sched, clock = make(maxBatchSize=16)
    assert sched.dynamic_batch is None
    trace, _ = serve(sched, clock, 300, concurrency=40)
    assert sched.batch_cap == 16
    assert max(n for kind, n in trace if kind is StepKind.DECODE) == 16


def test_the_scheduler_holds_the_requests_mean_tpot_and_never_preempts() -> None:
    # A decode step of b requests takes 2 + 0.5 b ms, so 7 ms is reached at b = 10 before any prefill counts;
    # the prefills that replace finished requests delay the running ones, so the cap settles below 10.
    sched, clock = make(maxBatchSize=16, dynamicBatchSizeEnable=True, decodeExpectedTime=7)
    assert sched.batch_cap == 16  # starts at maxBatchSize, as MindIE's does
    trace, done = serve(sched, clock, 4000, concurrency=40)
    decodes = [n for kind, n in trace[2000:] if kind is StepKind.DECODE]
    assert min(decodes) >= 3 and max(decodes) <= 10
    assert max(decodes) - min(decodes) <= 3
    half = done[len(done) // 2].first_scheduled_time or 0.0
    steady = [s for s in done if (s.first_scheduled_time or 0.0) > half]
    assert mean_tpot(steady) == pytest.approx(7 * MS, rel=0.03)
    assert sched.num_preemptions_total == 0  # a lower cap waits for requests to end


def test_turned_on_and_off_live() -> None:
    sched, clock = make(maxBatchSize=16)
    serve(sched, clock, 50, concurrency=40)
    sched.update_schedule(sched.schedule_config.model_copy(update={"dynamicBatchSizeEnable": True,
                                                                   "decodeExpectedTime": 7}))
    serve(sched, clock, 1500, concurrency=0)  # the 40 queued are replaced as they end: still loaded
    assert sched.dynamic_batch is not None and sched.batch_cap < 16
    sched.update_schedule(sched.schedule_config.model_copy(update={"dynamicBatchSizeEnable": False}))
    sched.schedule()
    assert sched.dynamic_batch is None and sched.batch_cap == 16


def test_a_group_larger_than_the_cap_still_starts_alone() -> None:
    sched, _ = make(maxBatchSize=16, dynamicBatchSizeEnable=True, decodeExpectedTime=7)
    assert sched.dynamic_batch is not None
    for _ in range(5):
        sched.dynamic_batch.observe(1.0, 3)  # 1 s a token at 3 requests: the cap falls to its bound
    assert sched.batch_cap == 3
    group = Sequence(prompt_token_ids=[5, 6, 7, 8], arrival_time=sched.clock(),
                     sampling=SamplingParams(max_tokens=4, n=5, ignore_eos=True))
    sched.add(group)
    add(sched)
    out = sched.schedule()
    assert out.kind is StepKind.PREFILL and out.seqs == [group]  # n = 5 > 3: alone, and nothing joins it


# --- the config fields ------------------------------------------------------------------------------------------


def test_config_fields_and_defaults() -> None:
    section = ScheduleSection()
    assert (section.dynamicBatchSizeEnable, section.decodeExpectedTime, section.stageSelectPolicy) == (False, 50, 0)
    config = minimal_config("/models/m", dynamicBatchSizeEnable=True, decodeExpectedTime=30)
    assert config.to_dict()["BackendConfig"]["ScheduleConfig"] == {"dynamicBatchSizeEnable": True,
                                                                   "decodeExpectedTime": 30}
    assert config.with_schedule(decodeExpectedTime=20).schedule.decodeExpectedTime == 20


@pytest.mark.parametrize(("schedule", "named"), [
    ({"stageSelectPolicy": 2}, "stageSelectPolicy 2 is not supported"),
    ({"stageSelectPolicy": 1}, "stageSelectPolicy 1 is not supported"),
    ({"prefillExpectedTime": 1500}, "prefillExpectedTime is not supported"),
    ({"decodeExpectedTime": 0}, "decodeExpectedTime"),
    ({"decodeExpectedTime": 10001}, "decodeExpectedTime"),
])
def test_what_is_not_built_is_refused_by_name(schedule: dict[str, object], named: str) -> None:
    with pytest.raises(MindIEConfigError, match=named):
        minimal_config("/models/m", **schedule)


def test_not_with_chunked_prefill_as_in_mindie() -> None:
    with pytest.raises(MindIEConfigError, match=r"dynamicBatchSizeEnable does not run with npuserve\.chunkedPrefill"):
        minimal_config("/models/m", dynamicBatchSizeEnable=True, extensions={"chunkedPrefill": True})
