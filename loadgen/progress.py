"""Progress while a run sends: a rich bar on a terminal, plain log lines elsewhere (CI logs, pipes)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

from npuserve.loadgen.records import RequestRecord


class ProgressCounter:
    """What the display shows: requests done, errors (429s apart), live output tokens per second."""

    def __init__(self, total: int | None):
        self.total = total
        self.done = 0
        self.errors = 0
        self.rate_limited = 0
        self.tokens = 0
        self.started = time.monotonic()
        self.listener: Callable[[ProgressCounter], None] | None = None

    def add(self, record: RequestRecord) -> None:
        if record.warmup:
            return
        self.done += 1
        if record.rate_limited:
            self.rate_limited += 1
        elif not record.ok:
            self.errors += 1
        self.tokens += record.output_tokens or 0
        if self.listener is not None:
            self.listener(self)

    def tokens_per_second(self) -> float:
        return self.tokens / max(time.monotonic() - self.started, 1e-9)

    def line(self, final: bool = False) -> str:
        """The counts, and while the run goes on the live output rate (so far, from the first send: warm-up and the
        tail included). The last line has no rate: the report's output throughput (over the measured phase) is the
        one figure of it a run prints."""
        total = f"/{self.total}" if self.total else ""
        counts = f"{self.done}{total} requests, {self.errors} errors, {self.rate_limited} rate-limited (429)"
        return counts if final else f"{counts}, {self.tokens_per_second():.1f} output tok/s so far"


@contextmanager
def progress(total: int | None, *, label: str = "bench", stream: TextIO | None = None,
             interval_s: float = 5.0) -> Iterator[ProgressCounter]:
    """Yields the counter the run's record hook feeds; draws it as a rich bar on a TTY, else logs a line every
    `interval_s` and at the end."""
    stream = stream or sys.stderr
    counter = ProgressCounter(total)
    if stream.isatty():
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                       TextColumn("{task.fields[status]}"), TimeElapsedColumn(),
                       console=Console(file=stream), transient=True)
        with bar:
            task = bar.add_task(label, total=total, status="")

            def draw(c: ProgressCounter) -> None:
                bar.update(task, completed=c.done,
                           status=f"errors {c.errors}  429 {c.rate_limited}  {c.tokens_per_second():.0f} tok/s")

            counter.listener = draw
            yield counter
        return
    last = [time.monotonic()]

    def log(c: ProgressCounter) -> None:
        now = time.monotonic()
        if now - last[0] >= interval_s:
            last[0] = now
            print(f"{label}: {c.line()}", file=stream, flush=True)

    counter.listener = log
    yield counter
    print(f"{label}: {counter.line(final=True)}", file=stream, flush=True)
