"""The waiting queue, ordered by the scheduling policy.

`fcfs` serves by arrival; `priority` by `SamplingParams.priority` (lower first), then arrival;
`longest-output-first` by the largest `max_tokens` first, then arrival. Sequences preempted by recompute go to the
front whatever the policy (`push_front`), the last pushed first. Removal (aborts) is lazy: the heap entry goes stale
and is skipped, so every operation stays O(log n).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Literal

from ..sequence import Sequence

Policy = Literal["fcfs", "priority", "longest-output-first"]
POLICIES: tuple[Policy, ...] = ("fcfs", "priority", "longest-output-first")

# (rank, primary key, arrival, entry number): rank 0 = pushed to the front, 1 = ordered by the policy.
_Key = tuple[int, float, float, int]


class WaitingQueue:
    def __init__(self, policy: Policy = "fcfs") -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {policy!r}; expected one of {', '.join(POLICIES)}")
        self.policy: Policy = policy
        self._heap: list[tuple[_Key, Sequence]] = []
        self._by_arrival: list[tuple[float, int, Sequence]] = []  # for the oldest waiting request
        self._entry: dict[int, int] = {}  # seq_id -> its live entry number
        self._counter = itertools.count()
        self._front = itertools.count()

    def __len__(self) -> int:
        return len(self._entry)

    def __bool__(self) -> bool:
        return bool(self._entry)

    def _primary(self, seq: Sequence) -> float:
        if self.policy == "priority":
            return float(seq.sampling.priority)
        if self.policy == "longest-output-first":
            return -float(seq.sampling.max_tokens)
        return 0.0

    def push(self, seq: Sequence) -> None:
        self._insert(seq, (1, self._primary(seq), seq.arrival_time, next(self._counter)))

    def push_front(self, seq: Sequence) -> None:
        n = next(self._counter)
        self._insert(seq, (0, float(-next(self._front)), 0.0, n))

    def _insert(self, seq: Sequence, key: _Key) -> None:
        if seq.seq_id in self._entry:
            raise ValueError(f"sequence {seq.seq_id} is already waiting")
        self._entry[seq.seq_id] = key[3]
        heapq.heappush(self._heap, (key, seq))
        heapq.heappush(self._by_arrival, (seq.arrival_time, key[3], seq))

    def _live(self, key_n: int, seq: Sequence) -> bool:
        return self._entry.get(seq.seq_id) == key_n

    def peek(self) -> Sequence | None:
        heap = self._heap
        while heap:
            key, seq = heap[0]
            if self._live(key[3], seq):
                return seq
            heapq.heappop(heap)
        return None

    def pop(self) -> Sequence:
        seq = self.peek()
        if seq is None:
            raise IndexError("pop from an empty waiting queue")
        heapq.heappop(self._heap)
        del self._entry[seq.seq_id]
        return seq

    def remove(self, seq: Sequence) -> bool:
        """Drop a sequence (an abort); False if it was not waiting."""
        return self._entry.pop(seq.seq_id, None) is not None

    def oldest_arrival(self) -> float | None:
        heap = self._by_arrival
        while heap:
            arrival, n, seq = heap[0]
            if self._live(n, seq):
                return arrival
            heapq.heappop(heap)
        return None
