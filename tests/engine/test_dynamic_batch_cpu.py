"""dynamicBatchSizeEnable on the real CPU engine: under a steady overload (more requests than maxBatchSize, a closed
loop), the requests' mean TPOT holds at decodeExpectedTime within 5% (MindIE documents about 10%).

The target is set from this machine's own range, measured first: the mean TPOT at a small and at the largest batch
with the controller off; the target is a whole millisecond (MindIE's decodeExpectedTime is an integer of ms)
strictly between them, so the test holds on a slower or a faster machine. TPOT is measured as a client measures it:
each request's (last token - first token) / (tokens - 1), from the wall-clock times at which `step()` returned its
outputs (not from the engine's own figures), averaged over the requests that started in the steady part. The
machine is shared and noisy: a miss is measured a second time before the test fails (as
tests/sim/test_cpu_calibration.py does).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from npuserve.engine.engine import LLMEngine  # noqa: E402
from npuserve.engine.sequence import SamplingParams  # noqa: E402
from npuserve.mindie_config import MindIEConfig, minimal_config  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.wallclock]

MAX_BATCH = 128
SMALL_BATCH = 4
TOLERANCE = 0.05
MARGIN = 1.15  # the target at least this far inside the measured range, at each end
WARMUP_S = 1.5  # the controller settles (from maxBatchSize down) within this; requests starting later count
RUN_S = 5.0

_ids = itertools.count()


def closed_loop(engine: LLMEngine, concurrency: int, seconds: float, warmup: float) -> tuple[float, int]:
    """Keeps `concurrency` requests in the engine for `seconds` (a finished one is replaced at once); returns the
    mean TPOT of the requests whose first token came after `warmup`, and how many there were."""
    lengths = itertools.cycle(range(16, 49, 5))  # 16 .. 46 output tokens: requests end at different steps
    live: set[str] = set()

    def add() -> None:
        i = next(_ids)
        rid = f"r{i}"
        engine.add_request(rid, prompt_token_ids=[5 + (i * 7 + k) % 900 for k in range(12)],
                           params=SamplingParams(temperature=0.0, max_tokens=next(lengths), ignore_eos=True))
        live.add(rid)

    for _ in range(concurrency):
        add()
    start = time.monotonic()
    first: dict[str, float] = {}
    tpots: list[float] = []
    while time.monotonic() - start < seconds:
        outputs = engine.step().outputs
        now = time.monotonic()
        for o in outputs:
            if o.token_ids and o.request_id not in first:
                first[o.request_id] = now
            if o.finished:
                live.discard(o.request_id)
                if first[o.request_id] - start > warmup and len(o.token_ids) > 1:
                    tpots.append((now - first[o.request_id]) / (len(o.token_ids) - 1))
                add()
    for rid in live:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return (sum(tpots) / len(tpots) if tpots else math.nan), len(tpots)


def apply(engine: LLMEngine, config: MindIEConfig) -> None:
    engine.update_schedule(config.schedule)
    engine.step()  # takes it


@pytest.fixture(scope="module")
def engine_and_config(tiny_model_dir: Path) -> Iterator[tuple[LLMEngine, MindIEConfig]]:
    config = minimal_config(tiny_model_dir, max_seq_len=128, max_input_len=32, cacheBlockSize=16,
                            maxBatchSize=MAX_BATCH, maxPrefillBatchSize=MAX_BATCH)
    # One torch thread: on cores shared with other work, a second thread's waits make the tiny model's steps 10x
    # slower at random (seen on the 2-core test machine).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = LLMEngine(config, num_kv_blocks=MAX_BATCH * 8 + 64)
    closed_loop(engine, MAX_BATCH, 1.0, 0.0)  # every batch shape once: the first run of a shape is slow
    yield engine, config
    engine.close()
    torch.set_num_threads(threads)


def measure(engine: LLMEngine, config: MindIEConfig) -> tuple[float, float, int, float, int]:
    """(small-batch TPOT, largest-batch TPOT, target ms, controlled TPOT, requests counted)."""
    apply(engine, config.with_schedule(maxBatchSize=SMALL_BATCH, maxPrefillBatchSize=SMALL_BATCH))
    low, _ = closed_loop(engine, SMALL_BATCH + 8, 2.0, 0.5)
    apply(engine, config)
    high, _ = closed_loop(engine, MAX_BATCH + 16, 2.0, 0.5)
    inside = [ms for ms in range(1, 10001) if low * MARGIN < ms / 1000 < high / MARGIN]
    if not inside:
        pytest.skip(f"this machine's TPOT range {low * 1000:.2f} .. {high * 1000:.2f} ms holds no whole millisecond "
                    f"{MARGIN}x inside it (decodeExpectedTime is whole ms)")
    middle = math.sqrt(low * high) * 1000
    target_ms = min(inside, key=lambda ms: abs(ms - middle))
    apply(engine, config.with_schedule(dynamicBatchSizeEnable=True, decodeExpectedTime=target_ms))
    held, counted = closed_loop(engine, MAX_BATCH + 32, RUN_S, WARMUP_S)  # more requests than maxBatchSize
    apply(engine, config)
    return low, high, target_ms, held, counted


def test_the_mean_tpot_holds_at_decode_expected_time_under_overload(
        engine_and_config: tuple[LLMEngine, MindIEConfig]) -> None:
    engine, config = engine_and_config
    results = []
    for _ in range(2):  # a neighbour's burst rarely hits twice
        low, high, target_ms, held, counted = measure(engine, config)
        results.append(f"TPOT {low * 1000:.3f} ms at batch {SMALL_BATCH}, {high * 1000:.3f} ms at {MAX_BATCH}; "
                       f"target {target_ms} ms: held {held * 1000:.3f} ms over {counted} requests "
                       f"({(held * 1000 / target_ms - 1) * 100:+.1f}%)")
        print(results[-1])
        if abs(held * 1000 / target_ms - 1) <= TOLERANCE and counted >= 100:
            return
    pytest.fail("the mean TPOT missed decodeExpectedTime by more than 5% twice:\n" + "\n".join(results))
