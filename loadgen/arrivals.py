"""When requests leave and which prompt each one takes (docs/loadgen.md#what-it-measures). Pure functions of a seeded
`random.Random`, so the async runner (wall clock) and the simulator (virtual clock) send the same schedule for the same
seed.

Open loop (vLLM's `--request-rate`, `--burstiness`): inter-arrival gaps are gamma distributed with shape
`burstiness` and scale 1 / (rate * burstiness): the mean gap is 1 / rate whatever the shape, and the coefficient of
variation is 1 / sqrt(burstiness): 1 is a Poisson process, below 1 burstier, above 1 more regular. As in vLLM, the
first request leaves at once (offset 0) and each gap follows a request.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator


def iter_send_offsets(request_rate: float, burstiness: float, rng: random.Random) -> Iterator[float]:
    """Endless cumulative send offsets in seconds since the run's start (for `--duration`, where the count is not
    known ahead); `request_rate = inf` sends everything at once (all offsets 0)."""
    if not request_rate > 0:  # also refuses NaN
        raise ValueError(f"request rate {request_rate}: want > 0 (inf: all at once)")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness {burstiness}: want a finite number > 0")
    return _offsets(request_rate, burstiness, rng)


def _offsets(request_rate: float, burstiness: float, rng: random.Random) -> Iterator[float]:
    offset = 0.0
    yield offset
    if math.isinf(request_rate):
        while True:
            yield 0.0
    scale = 1.0 / (request_rate * burstiness)
    while True:
        offset += rng.gammavariate(burstiness, scale)
        yield offset


def think_time(rng: random.Random, bounds: tuple[float, float] | None) -> float:
    """A closed-loop user's pause between its requests: uniform between the bounds; 0 (and no draw) without them."""
    if bounds is None:
        return 0.0
    low, high = bounds
    if not 0 <= low <= high:
        raise ValueError(f"think time {low}:{high}: want 0 <= low <= high")
    return rng.uniform(low, high)


class RequestQueue:
    """Hands out dataset indices to whoever sends next (one open-loop sender, or closed-loop users sharing one
    queue). `cycle=False` (`--num-prompts`): each index once, then None. `cycle=True` (`--duration`): the indices
    again and again; the caller stops at its deadline. `take` never awaits, so tasks of one event loop share a queue
    without a lock."""

    def __init__(self, num_requests: int, cycle: bool) -> None:
        if num_requests <= 0:
            raise ValueError(f"{num_requests} requests: want > 0")
        self.num_requests = num_requests
        self.cycle = cycle
        self.taken = 0  # indices handed out so far: the next request's sending order

    def take(self) -> int | None:
        if not self.cycle and self.taken >= self.num_requests:
            return None
        index = self.taken % self.num_requests
        self.taken += 1
        return index
