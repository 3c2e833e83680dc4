"""The step watchdog: a step that never returns (a hung device, a rank that stopped answering, a collective
waiting for a peer) must not leave the server green and useless.

With a step in progress for longer than `npuserve.stepTimeoutSeconds`, the watchdog calls `on_stuck` (the server's
/health turns failing, the termination message is written); if the same step is still in progress
`stepTimeoutGraceSeconds` later, `on_expired` (the engine exits). A step that completes in the grace clears it.
An idle engine runs no step and is never stuck.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

_MAX_POLL_SECONDS = 1.0


class StepWatchdog:
    def __init__(self, timeout: float, grace: float, describe: Callable[[float], str],
                 on_stuck: Callable[[str], None], on_expired: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`describe(elapsed)`: what is stuck, for the message (the last operation of each rank)."""
        self.timeout = timeout
        self.grace = grace
        self._describe = describe
        self._on_stuck = on_stuck
        self._on_expired = on_expired
        self._clock = clock
        self._busy_since: float | None = None  # when the step in progress began; None: no step in progress
        self._stuck_since: float | None = None  # when that step was found stuck
        self._stuck_step: float | None = None  # its _busy_since
        self.stuck: str | None = None  # the message while a step is stuck
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- the step thread ---------------------------------------------------------------------------------------

    def step_started(self) -> None:
        self._busy_since = self._clock()

    def step_finished(self) -> None:
        self._busy_since = None
        if self.stuck is not None:
            log.warning("the stuck step completed after all; /health answers ok again")
            self.stuck = None

    # --- the watchdog's thread ---------------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="npuserve-step-watchdog", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        poll = min(_MAX_POLL_SECONDS, max(0.01, min(self.timeout, self.grace or self.timeout) / 4))
        while not self._stop.wait(poll):
            if self.check():
                return

    def check(self) -> bool:
        """One look; True once `on_expired` was called (the watchdog has nothing more to do)."""
        busy, now = self._busy_since, self._clock()
        if busy is None or busy != self._stuck_step:
            self._stuck_since = self._stuck_step = None
            if busy is None:
                self.stuck = None
                return False
        elapsed = now - busy
        if self._stuck_since is None:
            if elapsed < self.timeout:
                return False
            message = (f"no engine step has completed for {elapsed:.1f} s (npuserve.stepTimeoutSeconds "
                       f"{self.timeout:g}): {self._describe(now)}")
            self._stuck_since, self._stuck_step, self.stuck = now, busy, message
            log.critical("%s; /health fails, and the engine exits in %g s unless the step completes", message,
                         self.grace)
            self._on_stuck(message)
        if now - self._stuck_since >= self.grace:
            self._on_expired(f"{self.stuck}; it was still stuck {self.grace:g} s later "
                             "(npuserve.stepTimeoutGraceSeconds), so the engine exits")
            return True
        return False
