"""The running batch cap that holds the mean TPOT at a target: MindIE 2.3's `dynamicBatchSizeEnable` with
`decodeExpectedTime` (docs/engine.md, "Dynamic batch size"). No torch, no clock: the scheduler feeds it.

What it reads, per decode step: the time each request of the step waited for this token since its previous one
(the "live TPOT"), averaged over the step's requests. That is the gap a client sees between two tokens: the decode
step itself, plus any prefill step the engine ran in between (a prefill delays every running request), plus the
host's work between steps. MindIE measures the same thing: its LatencyPredictor records, per sequence group and
token, `now - lastCompletionTime` (src/scheduler/latency_predictor/latency_predictor.cpp, AddPercentileData), and
its DynamicBatchSize compares the recent average with decodeExpectedTime
(src/scheduler/policy/dynamic_batch_size.cpp).

The rule (ours; MindIE's is a bound search with a fixed +-5 ms dead band, 2 requests a move, which cannot hold a
TPOT of a few ms within a few percent): a token-weighted integral controller on the cap, held as a real number,

    cap += gain * batch * (target - tpot) / target      (the relative error clipped to +-MAX_RELATIVE_ERROR)

so it settles where the token-weighted mean of the step gaps, which is the requests' mean TPOT, equals the target;
when the target lies between the TPOT of batch b and b + 1, the cap time-shares between them. The error is not
clipped: a slow step (a prefill in between, a neighbour's burst) is part of the TPOT the clients see, and clipping
it would bias the mean above the target. It is stable: each move is a small fraction of the cap (gain x error),
and two anti-windup rules keep it next to what runs: it does not grow while the batch runs below it (too little
load: a faster TPOT says nothing of a larger batch), and it does not fall further than FLOOR_SLACK under the running
batch (lowering it further changes nothing until requests end; this also bounds what one stall can do). The cap
stays within [min(LOWER_BOUND, maxBatchSize), maxBatchSize] and starts at maxBatchSize, as MindIE's does.

The scheduler admits no new request while the running batch is at the cap; it never preempts to shrink the batch
(a preempted request's KV would be recomputed or swapped: work thrown away to save a few ms of TPOT), so a lower cap
takes effect as running requests end.
"""

from __future__ import annotations

from dataclasses import dataclass

LOWER_BOUND = 3  # MindIE's batchSizeLowerBound_ (dynamic_batch_size.cpp): the cap never goes below 3 requests
DEFAULT_GAIN = 0.02  # cap change per token of relative TPOT error: 2% of the cap a step at 100% error
FLOOR_SLACK = 0.05  # the cap falls at most 1 + 5% of the running batch under it (anti-windup)


@dataclass(frozen=True, slots=True)
class DynamicBatchState:
    """What the controller last did, for /info and logs."""

    cap: int
    tpot_s: float | None  # the last step's token-weighted gap; None before the first decode step


class DynamicBatchController:
    def __init__(self, max_batch_size: int, target_s: float, *, gain: float = DEFAULT_GAIN) -> None:
        if gain <= 0:
            raise ValueError(f"gain must be > 0, got {gain}")
        self.gain = gain
        self._max = max_batch_size
        self._target = target_s
        self._cap = float(max_batch_size)
        self.last_tpot_s: float | None = None
        self.reconfigure(max_batch_size, target_s)

    @property
    def lower_bound(self) -> int:
        return min(LOWER_BOUND, self._max)

    @property
    def cap(self) -> int:
        """The running batch cap: no new request is admitted while this many run."""
        return max(self.lower_bound, min(self._max, int(self._cap)))

    @property
    def target_s(self) -> float:
        return self._target

    def reconfigure(self, max_batch_size: int, target_s: float) -> None:
        """A new maxBatchSize or decodeExpectedTime (live); the cap keeps its value within the new bounds."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if target_s <= 0:
            raise ValueError(f"target_s must be > 0, got {target_s}")
        self._max, self._target = max_batch_size, target_s
        self._cap = min(max(self._cap, float(self.lower_bound)), float(max_batch_size))

    def observe(self, tpot_s: float, batch: int) -> int:
        """One decode step of `batch` requests whose mean gap since their previous token was `tpot_s`; returns the
        new cap."""
        if batch < 1:
            return self.cap
        self.last_tpot_s = tpot_s
        error = (self._target - tpot_s) / self._target
        if error > 0 and batch < self.cap:
            return self.cap  # the cap does not bind: too little load to learn anything about a larger batch
        cap = self._cap + self.gain * batch * error
        if error < 0:
            cap = max(cap, min(self._cap, batch - 1 - FLOOR_SLACK * batch))
        self._cap = min(max(cap, float(self.lower_bound)), float(self._max))
        return self.cap

    def state(self) -> DynamicBatchState:
        return DynamicBatchState(self.cap, self.last_tpot_s)
