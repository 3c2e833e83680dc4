"""What one run measured: a record per request, as it arrived (docs/loadgen.md#what-it-measures).

Every figure of every report (MindIE's tables, vLLM's summary and JSON, the perf scheme, the sweep CSV) is computed
from these records by the pure functions of `metrics`; the client only records. Times are seconds on the run's
monotonic clock (0 = the run's start), so records from a simulated run (a virtual clock) read the same.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from npuserve.engine_contract import RequestTimings


class Endpoint(StrEnum):
    """The routes the load generator drives; the value is the path."""

    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"
    TGI_STREAM = "/generate_stream"
    TGI = "/generate"  # not streamed: latencies come from the timing headers (the perf scheme)

    @property
    def streamed(self) -> bool:
        return self is not Endpoint.TGI


class TokenCountSource(StrEnum):
    """Where a run's token counts came from; reports name it (vLLM counts with a tokenizer, MindIE from the server)."""

    USAGE = "usage"  # the server's usage block (OpenAI) or token counts (TGI details and headers)
    TOKENIZER = "tokenizer"  # the client's tokenizer over the text
    CHUNKS = "chunks"  # one token per streamed chunk: an estimate, said as such
    SIMULATED = "simulated"  # the simulated engine's exact counts


class BenchRequest(BaseModel):
    """One prompt drawn from a dataset."""

    model_config = ConfigDict(frozen=True)

    prompt: str
    prompt_len: int | None = Field(default=None, description="prompt tokens, when a tokenizer counted them")
    max_tokens: int = Field(gt=0, description="output tokens asked for (the dataset's, capped by --max-output-len)")


class HeaderTimings(BaseModel):
    """The TGI `/generate` timing headers of one response, in milliseconds (`engine_contract.HEADER_*`)."""

    queue_ms: float
    prefill_ms: float
    inference_ms: float
    time_per_token_ms: float

    @property
    def first_token_ms(self) -> float:
        """The perf scheme's first-token latency: prefill time + queue time."""
        return self.prefill_ms + self.queue_ms


class RequestRecord(BaseModel):
    """One request as the client saw it. `chunk_times` holds every content-bearing chunk's arrival, so TTFT is the
    first, E2E the last, and ITL the gaps between them (docs/loadgen.md#what-it-measures)."""

    index: int = Field(description="order of sending within the run")
    warmup: bool = Field(default=False, description="a warm-up request: recorded, excluded from every figure")
    user: int | None = Field(default=None, description="the closed-loop user that sent it")
    t0: float = Field(description="send time, seconds since the run's start")
    chunk_times: list[float] = Field(default_factory=list, description="content chunk arrivals, seconds since start")
    end: float | None = Field(default=None, description="when the response ended (or failed)")
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    token_source: TokenCountSource | None = None
    output_chars: int = 0
    text: str = ""
    status: int | None = Field(default=None, description="HTTP status; None when no response arrived")
    error: str | None = None
    server: RequestTimings | None = Field(default=None, description="the engine's own timings (its `npuserve` field)")
    headers: HeaderTimings | None = Field(default=None, description="TGI /generate timing headers")
    tokenize_ms: float | None = Field(default=None, description="client time to tokenize the prompt")
    detokenize_ms: float | None = Field(default=None, description="client time to count the output's tokens")

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200

    @property
    def rate_limited(self) -> bool:
        return self.status == 429
