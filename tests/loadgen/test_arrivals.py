"""Send schedules and request hand-out: gamma inter-arrivals with mean 1/rate and coefficient of variation
1/sqrt(burstiness), the first request at once, inf rate all at once, the same schedule for the same seed."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest

from npuserve.loadgen.arrivals import RequestQueue, iter_send_offsets, think_time


def send_offsets(n: int, request_rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """The first `n` send offsets the runner would use."""
    return list(itertools.islice(iter_send_offsets(request_rate, burstiness, rng), n))


def _gaps(offsets: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(offsets)]


def test_first_request_leaves_at_once_and_offsets_only_grow() -> None:
    offsets = send_offsets(50, 2.0, 1.0, random.Random(0))
    assert len(offsets) == 50
    assert offsets[0] == 0.0
    assert all(gap > 0 for gap in _gaps(offsets))


@pytest.mark.parametrize("rate", [0.5, 5.0, 200.0])
def test_the_mean_gap_is_one_over_the_rate(rate: float) -> None:
    gaps = _gaps(send_offsets(40_001, rate, 1.0, random.Random(1)))
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.03)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_burstiness_sets_the_coefficient_of_variation_not_the_mean(burstiness: float) -> None:
    gaps = _gaps(send_offsets(40_001, 10.0, burstiness, random.Random(2)))
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(0.1, rel=0.05)
    assert statistics.pstdev(gaps) / mean == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_an_infinite_rate_sends_everything_at_once_and_draws_nothing() -> None:
    rng = random.Random(3)
    state = rng.getstate()
    assert send_offsets(5, math.inf, 1.0, rng) == [0.0] * 5
    assert rng.getstate() == state


def test_the_same_seed_gives_the_same_schedule() -> None:
    first = send_offsets(100, 3.0, 0.5, random.Random(7))
    assert send_offsets(100, 3.0, 0.5, random.Random(7)) == first
    assert send_offsets(100, 3.0, 0.5, random.Random(8)) != first


def test_the_endless_schedule_starts_as_the_counted_one() -> None:
    endless = iter_send_offsets(3.0, 2.0, random.Random(5))
    assert [next(endless) for _ in range(20)] == send_offsets(20, 3.0, 2.0, random.Random(5))


def test_no_requests_give_no_offsets() -> None:
    assert send_offsets(0, 1.0, 1.0, random.Random(0)) == []


@pytest.mark.parametrize(
    ("rate", "burstiness"), [(0.0, 1.0), (-1.0, 1.0), (math.nan, 1.0), (1.0, 0.0), (1.0, math.inf)]
)
def test_bad_rates_and_shapes_are_refused(rate: float, burstiness: float) -> None:
    with pytest.raises(ValueError):
        send_offsets(3, rate, burstiness, random.Random(0))


def test_think_time_stays_between_its_bounds_and_covers_them() -> None:
    rng = random.Random(4)
    pauses = [think_time(rng, (1.0, 3.0)) for _ in range(5000)]
    assert all(1.0 <= pause <= 3.0 for pause in pauses)
    assert min(pauses) < 1.05 and max(pauses) > 2.95
    assert statistics.fmean(pauses) == pytest.approx(2.0, rel=0.03)
    assert think_time(rng, (2.5, 2.5)) == 2.5


def test_no_think_time_is_zero_and_draws_nothing() -> None:
    rng = random.Random(4)
    state = rng.getstate()
    assert think_time(rng, None) == 0.0
    assert rng.getstate() == state


def test_bad_think_time_bounds_are_refused() -> None:
    with pytest.raises(ValueError):
        think_time(random.Random(0), (3.0, 1.0))


def test_the_queue_hands_each_index_once_then_nothing() -> None:
    queue = RequestQueue(3, cycle=False)
    assert [queue.take() for _ in range(5)] == [0, 1, 2, None, None]
    assert queue.taken == 3


def test_the_cycling_queue_goes_round_again() -> None:
    queue = RequestQueue(3, cycle=True)
    assert [queue.take() for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert queue.taken == 7


def test_an_empty_queue_is_refused() -> None:
    with pytest.raises(ValueError):
        RequestQueue(0, cycle=True)
