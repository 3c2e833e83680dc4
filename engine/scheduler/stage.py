"""Which kind of step runs next: prefill or decode (MindIE's "Standard" template never mixes them).

supportSelectBatch=false is MindIE's DecidePDPriority:
- decode first when the swapped queue is not empty, or fewer than 5% of blocks are free, or prefill should not
  start yet;
- prefill starts at once when nothing runs, or when the oldest waiting request has waited
  maxQueueDelayMicroseconds, or when it has waited more than 5000 us (MindIE's default delay) and at least
  maxPrefillBatchSize requests wait: a full batch need not wait out a longer configured delay.

supportSelectBatch=true is MindIE's throughput stage policy: while requests wait, each step computes
`prefillCost = prefillTimeMsPerReq * running` and accumulates `decodeWaste += decodeTimeMsPerReq *
(maxBatchSize - running)`; decode if prefillCost > decodeWaste, else prefill and decodeWaste resets. With nothing
waiting, decodeWaste resets.

Rules of ours in both modes: swapped requests come back first (decode, which swaps them in); a running batch that
is already maxBatchSize long decodes; running requests stalled for want of a block decode first, so new prefills
cannot take the blocks they wait for.
"""

from __future__ import annotations

from npuserve.mindie_config import ScheduleSection

from .output import StepKind

LOW_FREE_BLOCKS_FRACTION = 0.05
FULL_BATCH_MIN_DELAY_US = 5000.0


class StageSelector:
    def __init__(self) -> None:
        self.decode_waste_ms = 0.0

    def choose(
        self,
        schedule: ScheduleSection,
        *,
        num_running: int,
        num_waiting: int,
        num_swapped: int,
        num_stalled: int,
        free_fraction: float,
        oldest_wait_us: float,
    ) -> StepKind:
        if num_waiting == 0:
            self.decode_waste_ms = 0.0
            return StepKind.DECODE if num_running or num_swapped else StepKind.IDLE
        if num_swapped or num_stalled or num_running >= schedule.maxBatchSize:
            return StepKind.DECODE
        if schedule.supportSelectBatch:
            return self._select_batch(schedule, num_running)
        return self._pd_priority(schedule, num_running, num_waiting, free_fraction, oldest_wait_us)

    def _pd_priority(
        self,
        schedule: ScheduleSection,
        num_running: int,
        num_waiting: int,
        free_fraction: float,
        oldest_wait_us: float,
    ) -> StepKind:
        if num_running == 0:
            return StepKind.PREFILL
        if free_fraction < LOW_FREE_BLOCKS_FRACTION:
            return StepKind.DECODE
        if oldest_wait_us >= schedule.maxQueueDelayMicroseconds:
            return StepKind.PREFILL
        if oldest_wait_us > FULL_BATCH_MIN_DELAY_US and num_waiting >= schedule.effective_max_prefill_batch_size:
            return StepKind.PREFILL
        return StepKind.DECODE

    def _select_batch(self, schedule: ScheduleSection, num_running: int) -> StepKind:
        prefill_cost = schedule.prefillTimeMsPerReq * num_running
        self.decode_waste_ms += schedule.decodeTimeMsPerReq * (schedule.maxBatchSize - num_running)
        if prefill_cost > self.decode_waste_ms:
            return StepKind.DECODE
        self.decode_waste_ms = 0.0
        return StepKind.PREFILL
