"""One run's outcome: what was measured (the records) and how the run went, before any figure is computed."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field

from npuserve.loadgen.config import BenchConfig
from npuserve.loadgen.records import RequestRecord, TokenCountSource


class BenchResult(BaseModel):
    config: BenchConfig
    model: str = Field(description="the served model name the requests named")
    started_at: datetime = Field(description="wall-clock start of the measured phase")
    duration_s: float = Field(description="measured phase: first send to the last response (warm-up excluded)")
    records: list[RequestRecord] = Field(description="every request, warm-up ones included (flagged)")
    token_source: TokenCountSource = Field(description="where most output token counts came from")
    tokenizer: str | None = Field(default=None, description="the client tokenizer's folder, when one was used")
    dataset: str = Field(description="the dataset's name or file, as reports print it")
    interrupted: bool = Field(default=False, description="stopped early (Ctrl-C); the records are what it had")
    simulated: bool = Field(default=False, description="records from the simulated engine's virtual clock")

    @property
    def measured(self) -> list[RequestRecord]:
        return [r for r in self.records if not r.warmup]

    @property
    def concurrency(self) -> int | None:
        return self.config.load.max_concurrency
