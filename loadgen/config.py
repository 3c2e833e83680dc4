"""What a load-generator run is asked to do (docs/loadgen.md#what-it-measures): one pydantic config, shared by
`npuserve bench`, the simulator (`npuserve simulate`) and the tuner. Flag names follow vLLM's `bench serve` where
they overlap."""

from __future__ import annotations

import math
from enum import StrEnum
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from npuserve.loadgen.records import Endpoint


class DatasetName(StrEnum):
    RANDOM = "random"  # random token ids of --random-input-len, --random-output-len (vLLM's random dataset)
    GSM8K = "gsm8k"  # GSM8K JSONL: the question is the prompt
    SHAREGPT = "sharegpt"  # ShareGPT JSON: first human turn, the gpt turn's length as the output length
    JSONL = "jsonl"  # one {"prompt": ..., "max_tokens": ...} per line


DEFAULT_MAX_OUTPUT_LEN = 256  # output tokens for datasets that carry no length of their own (gsm8k, jsonl)


class DatasetConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: DatasetName = DatasetName.RANDOM
    path: Path | None = Field(default=None, description="the dataset file (gsm8k, sharegpt, jsonl)")
    random_input_len: int = Field(default=1024, gt=0)
    random_output_len: int = Field(default=128, gt=0)
    random_range_ratio: float = Field(default=0.0, ge=0.0, lt=1.0,
                                      description="lengths drawn uniformly from [L*(1-r), L*(1+r)]")
    max_output_len: int | None = Field(default=None, gt=0,
                                       description="caps every request's max_tokens; the output length of "
                                                   "datasets without one (default 256)")

    @model_validator(mode="after")
    def _path_when_needed(self) -> DatasetConfig:
        if self.name is not DatasetName.RANDOM and self.path is None:
            raise ValueError(f"dataset {self.name.value!r} needs a file: --dataset-path")
        return self


class LoadConfig(BaseModel):
    """The load shape. Open loop: requests leave at `request_rate` (gamma inter-arrivals of shape `burstiness`;
    1 = Poisson; inf rate = all at once), at most `max_concurrency` in flight when set. Closed loop with think time
    (the seeds' perf scheme): `max_concurrency` users pull from one shared queue and wait `think_time_s` (uniform
    between the bounds) between their requests."""

    model_config = ConfigDict(extra="forbid")

    num_prompts: int = Field(default=1000, gt=0)
    duration_s: float | None = Field(default=None, gt=0,
                                     description="send until this much time has passed (cycling the dataset), "
                                                 "instead of stopping after num_prompts")
    request_rate: float = Field(default=math.inf, gt=0)
    burstiness: float = Field(default=1.0, gt=0)
    max_concurrency: int | None = Field(default=None, gt=0)
    think_time_s: tuple[float, float] | None = None
    warmup_requests: int = Field(default=0, ge=0)
    seed: int = 0

    @model_validator(mode="after")
    def _consistent(self) -> LoadConfig:
        if self.think_time_s is not None:
            low, high = self.think_time_s
            if not 0 <= low <= high:
                raise ValueError(f"--think-time {low}:{high}: want 0 <= low <= high")
            if self.max_concurrency is None:
                raise ValueError("--think-time needs users: --concurrency (or --max-concurrency)")
            if math.isfinite(self.request_rate):
                raise ValueError("--think-time and --request-rate are two load shapes; give one")
        return self

    @property
    def closed_loop(self) -> bool:
        return self.max_concurrency is not None and not math.isfinite(self.request_rate)


SLOStatistic = Literal["mean", "p90", "p99"]


class SLO(BaseModel):
    """Latency objectives. Goodput counts the requests that meet every objective given (vLLM's --goodput); the
    PASS/FAIL verdict holds `statistic` of each metric over the run against its objective."""

    model_config = ConfigDict(extra="forbid")

    ttft_ms: float | None = Field(default=None, gt=0)
    tpot_ms: float | None = Field(default=None, gt=0)
    statistic: SLOStatistic = "mean"

    @property
    def given(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None


class BenchConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    base_url: str = "http://127.0.0.1:8000"
    endpoint: Endpoint = Endpoint.COMPLETIONS
    model: str | None = Field(default=None, description="served model name; None: the first of /v1/models")
    tokenizer: Path | None = Field(default=None, description="an HF folder; None: the model folder /v1/models "
                                                            "names when it is local, else the server's counts")
    dataset: DatasetConfig = Field(default_factory=DatasetConfig)
    load: LoadConfig = Field(default_factory=LoadConfig)
    slo: SLO = Field(default_factory=SLO)
    ignore_eos: bool = False
    request_timeout_s: float = Field(default=600.0, gt=0)
    save_trace: Path | None = Field(default=None, description="JSONL of the records, written as they arrive")
