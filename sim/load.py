"""The load shapes of `npuserve bench` on the virtual clock: when each request is sent and by which user.

The same pieces as the async runner (`npuserve.loadgen.run`): `arrivals.iter_send_offsets` for open-loop send times,
`arrivals.think_time` for closed-loop pauses, `arrivals.RequestQueue` for which dataset entry goes next, each seeded
as the runner seeds them (`seed + 1`), so a simulated run sends the schedule a real one would.

- Closed loop (`max_concurrency` users, no request rate): every user sends at once, and sends its next request when
  its previous one ends, after its think time.
- Open loop: requests leave at their offsets; with `max_concurrency` a request that finds every slot taken leaves
  when one frees (its send time is then, as the async runner's semaphore-gated send records it).
- `duration_s`: the dataset is cycled and nothing is sent after the deadline; requests in flight finish.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from collections.abc import Iterator

from npuserve.loadgen.arrivals import RequestQueue, iter_send_offsets, think_time
from npuserve.loadgen.config import LoadConfig

# (time, tie-break, user or None, dataset index or None): None index = a closed-loop user's turn to take one.
_Event = tuple[float, int, int | None, int | None]


class LoadDriver:
    """Hands out (send time, user, dataset index) as the virtual clock passes; told when each request ends."""

    def __init__(self, load: LoadConfig, num_requests: int, *, start: float = 0.0, users: int | None = None,
                 cycle: bool | None = None, deadline: float | None = None) -> None:
        self.load = load
        cycle = load.duration_s is not None if cycle is None else cycle
        self.queue = RequestQueue(num_requests, cycle=cycle)
        self.deadline = deadline if deadline is not None else (
            start + load.duration_s if load.duration_s is not None else math.inf)
        self.closed = users is not None or load.closed_loop
        self.limit = load.max_concurrency
        self.in_flight = 0
        self._events: list[_Event] = []
        self._order = itertools.count()
        self._backlog: deque[int] = deque()  # open loop with a concurrency limit: ready, waiting for a slot
        self._rng = random.Random(load.seed + 1)
        self._offsets: Iterator[float] | None = None
        self._paused = False  # open loop: the next arrival is drawn once the backlog has drained
        self._floor = -math.inf  # ...and none of those leaves before the slot that drained it freed
        self._start = start
        if self.closed:
            for user in range(users if users is not None else load.max_concurrency or 1):
                self._push(start, user, None)
        else:
            if cycle and not math.isfinite(load.request_rate) and self.limit is None:
                raise ValueError("--duration with an unbounded --request-rate sends without end: give "
                                 "--max-concurrency or --request-rate")
            self._offsets = iter_send_offsets(load.request_rate, load.burstiness, self._rng)
            self._next_offset()

    def _push(self, time: float, user: int | None, index: int | None) -> None:
        heapq.heappush(self._events, (time, next(self._order), user, index))

    def _next_offset(self) -> None:
        assert self._offsets is not None
        index = self.queue.take()
        if index is None:
            return
        time = self._start + next(self._offsets)
        if time <= self.deadline:
            self._push(time, None, index)

    def next_time(self) -> float | None:
        """When the next send is due; None when nothing more will be sent unless a request ends first."""
        return self._events[0][0] if self._events else None

    @property
    def done(self) -> bool:
        """Nothing left to send, and nothing that a request still in flight could release."""
        return not self._events and not self._backlog and (self.in_flight == 0 or not self.closed)

    def due(self, now: float) -> list[tuple[float, int | None, int]]:
        """The sends due by `now`, in time order: (send time, user, dataset index)."""
        sends: list[tuple[float, int | None, int]] = []
        events = self._events
        while events and events[0][0] <= now:
            time, _, user, index = heapq.heappop(events)
            if self.closed:
                index = self.queue.take() if time <= self.deadline else None
                if index is None:
                    continue  # this user is done
                sends.append((time, user, index))
                self.in_flight += 1
                continue
            assert index is not None
            if self.limit is not None and self.in_flight >= self.limit:
                # Every slot is taken: it waits. Later arrivals would queue behind it, so they are drawn only once
                # it has left (at an infinite rate they would otherwise be drawn without end).
                self._backlog.append(index)
                self._paused = True
                continue
            self._next_offset()
            sends.append((max(time, self._floor), None, index))
            self.in_flight += 1
        return sends

    def ended(self, user: int | None, now: float) -> list[tuple[float, int | None, int]]:
        """A request ended at `now`: a closed-loop user thinks then takes the next; a gated open-loop request may
        leave now. Returns any send this releases at once."""
        self.in_flight -= 1
        if self.closed:
            self._push(now + think_time(self._rng, self.load.think_time_s), user, None)
            return []
        if now > self.deadline:
            self._backlog.clear()
            return []
        sends: list[tuple[float, int | None, int]] = []
        if self._backlog:
            self.in_flight += 1
            sends.append((now, None, self._backlog.popleft()))
        if not self._backlog and self._paused:
            self._paused = False
            self._floor = now
            self._next_offset()
        return sends
