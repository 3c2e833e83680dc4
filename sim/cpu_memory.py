"""How fast this CPU reads weights as a function of how many there are: the CPU profile's memory curve
(docs/simulator.md, "The CPU engine as a source").

A CPU's caches make its achieved read bandwidth depend on the working set: weights that fit in the last-level cache
are read at the cache's rate, larger ones at the DRAM's. The size that fits is not what the kernel reports: on a
shared host the last-level cache is shared with other tenants (one host reports a 480 MiB L3 and reads 29 GB/s up to
64 MB, 13 GB/s from 128 MB on). So the curve is measured, with the kernel a decode step runs (`F.linear` of a few
rows against 4 MiB weight matrices, one torch thread), and it is the profile's bandwidth: at model A's weight bytes
for the fit, at another model's for its prediction (`CpuProfile.hardware_for`).
"""

from __future__ import annotations

import bisect
import math
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

MIB = 1 << 20
CURVE_SIZES_MIB: tuple[int, ...] = (8, 16, 32, 64, 128, 256, 512)
# The rows a curve's matrices are multiplied with. A CPU's small-matrix kernels read weights faster with fewer rows
# (29, 14 and 9 GB/s at 1, 4 and 8 rows from one host's L3), so the rows are those of a typical decode step of the
# profile's batch range (ProfilePlan.batches 2-16: 7.5 on average).
CURVE_ROWS = 8
_MATRIX = (2048, 512)  # float32: 4 MiB, the size of one of a small model's projection matrices


@dataclass(frozen=True, slots=True)
class MemoryCurve:
    """Achieved read bandwidth (GB/s) at each working set (bytes), sizes ascending."""

    sizes: tuple[int, ...]
    gbps: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.sizes or len(self.sizes) != len(self.gbps) or list(self.sizes) != sorted(set(self.sizes)):
            raise ValueError("a memory curve needs ascending, distinct sizes, one bandwidth each")
        if min(self.gbps) <= 0:
            raise ValueError("a memory curve's bandwidths are positive")

    def at(self, size: float) -> float:
        """The bandwidth at `size` bytes: linear in log(size) between measured sizes, the end values beyond them."""
        if size <= self.sizes[0]:
            return self.gbps[0]
        if size >= self.sizes[-1]:
            return self.gbps[-1]
        i = bisect.bisect_right(self.sizes, size)
        lo, hi = self.sizes[i - 1], self.sizes[i]
        share = math.log(size / lo) / math.log(hi / lo)
        return self.gbps[i - 1] + share * (self.gbps[i] - self.gbps[i - 1])


class MemoryProbe:
    """Holds the largest working set's matrices, so that each `measure()` (one per round of the profile's fit,
    interleaved with its points) only reads them; `curve()` is the median of the rounds at each size."""

    def __init__(self, sizes_mib: tuple[int, ...] = CURVE_SIZES_MIB, rows: int = CURVE_ROWS) -> None:
        per_matrix = _MATRIX[0] * _MATRIX[1] * 4
        self.counts = [max(1, size * MIB // per_matrix) for size in sizes_mib]
        self.sizes = tuple(count * per_matrix for count in self.counts)
        self.matrices = [torch.full(_MATRIX, 0.01) for _ in range(max(self.counts))]
        self.rows = torch.full((rows, _MATRIX[1]), 0.5)
        self.samples: list[list[float]] = [[] for _ in self.sizes]

    def measure(self, passes_bytes: int = 1536 * MIB) -> None:
        """Each size read `passes_bytes` worth (at least 3 passes, small sizes more), the median pass kept."""
        for i, count in enumerate(self.counts):
            matrices = self.matrices[:count]
            seconds = []
            for _ in range(max(3, passes_bytes // self.sizes[i])):
                start = time.perf_counter()
                for matrix in matrices:
                    F.linear(self.rows, matrix)
                seconds.append(time.perf_counter() - start)
            self.samples[i].append(self.sizes[i] / statistics.median(seconds) / 1e9)

    def curve(self) -> MemoryCurve:
        if not all(self.samples):
            raise RuntimeError("measure() the memory curve at least once first")
        return MemoryCurve(self.sizes, tuple(statistics.median(s) for s in self.samples))
