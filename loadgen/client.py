"""The streaming client: one request in, one `RequestRecord` out, for each route the load generator drives.

It only records (send time, every content chunk's arrival, text, the server's counts and timings, status, error);
the figures come later from `metrics`. Requests travel on HTTP/1.1 keep-alive connections (`ConnectionPool`, as
many as the concurrency), so connection set-up is paid once per connection, not per request.
"""

from __future__ import annotations

import contextlib
import json
import ssl
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

from npuserve import engine_contract as contract
from npuserve.loadgen.records import (
    BenchRequest,
    Endpoint,
    HeaderTimings,
    RequestRecord,
    TokenCountSource,
)
from npuserve.loadgen.tokenizer import TokenCounter

Clock = Callable[[], float]


JSON_HEADERS = {"content-type": "application/json"}


class StreamError(Exception):
    """An error event inside an otherwise successful (200) stream."""


class ConnectionPool:
    """Keep-alive HTTP/1.1 connections, one per request in flight: as many as the concurrency (closed loop), or as
    the open loop's requests in flight. Each is an `httpx.AsyncClient` holding a single connection, handed to one
    request at a time; idle ones are reused. One shared httpx pool of C connections costs more per request the
    larger C is (httpcore matches every request against every connection): 4.7 ms of CPU per streamed request at
    16 connections against 2.7 ms with a client per connection on the development machine, and the load generator
    must never be what limits the engine."""

    def __init__(self, base_url: str, timeout_s: float):
        self.base_url = base_url
        # One TLS context for every connection: httpx would load the CA bundle again for each client (~50 ms).
        self.tls = ssl.create_default_context()
        self.timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 30.0), pool=None)
        self._idle: list[httpx.AsyncClient] = []
        self._every: list[httpx.AsyncClient] = []

    def _open(self) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        client = httpx.AsyncClient(base_url=self.base_url, limits=limits, timeout=self.timeout, verify=self.tls,
                                   http1=True, http2=False)
        self._every.append(client)
        return client

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[httpx.AsyncClient]:
        client = self._idle.pop() if self._idle else self._open()
        try:
            yield client
        finally:
            self._idle.append(client)

    async def aclose(self) -> None:
        for client in self._every:
            await client.aclose()
        self._every.clear()
        self._idle.clear()


def request_body(endpoint: Endpoint, request: BenchRequest, model: str, ignore_eos: bool) -> dict[str, Any]:
    """The body each route takes; greedy sampling, as vLLM's benchmark sends."""
    if endpoint is Endpoint.COMPLETIONS:
        return {"model": model, "prompt": request.prompt, "max_tokens": request.max_tokens, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    if endpoint is Endpoint.CHAT:
        return {"model": model, "messages": [{"role": "user", "content": request.prompt}],
                "max_completion_tokens": request.max_tokens, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    return {"inputs": request.prompt, "parameters": {"max_new_tokens": request.max_tokens, "ignore_eos": ignore_eos}}


def _error_message(body: bytes) -> str:
    """The server's own words: OpenAI's `error.message`, TGI's `error`, else the body's start."""
    try:
        data = json.loads(body)
    except ValueError:
        return body[:300].decode(errors="replace").strip()
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if isinstance(error, str):
            return error
        if "detail" in data:
            return str(data["detail"])
    return body[:300].decode(errors="replace").strip()


async def _sse_events(response: httpx.Response, clock: Clock) -> AsyncIterator[tuple[float, dict[str, Any]]]:
    """The stream's JSON events, each with the arrival time of the bytes that completed it. Events are split by hand
    from the raw byte chunks (httpx's line iterator decodes and splits every line: a third of the client's time at
    hundreds of streams per second). It reads to the body's end even after `[DONE]`: a response left unread cannot
    go back to the keep-alive pool, and every request would pay a new connection."""
    pending = b""
    async for data in response.aiter_bytes():
        now = clock()
        pending += data.replace(b"\r\n", b"\n") if b"\r" in data else data
        while (cut := pending.find(b"\n\n")) >= 0:
            block, pending = pending[:cut], pending[cut + 2:]
            for line in block.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    continue
                event = json.loads(payload)
                if isinstance(event, dict):
                    yield now, event


def _chunk_output(endpoint: Endpoint, event: dict[str, Any]) -> str | None:
    """The output text an event carries, or None when the event is no token arrival. A completion chunk is one
    whatever its text (a token may decode to nothing yet, and the last chunk can carry only the finish reason);
    a chat chunk is one when its delta carries output or it finishes (OpenAI's first, role-only delta is not)."""
    if endpoint is Endpoint.TGI_STREAM:
        token = event.get("token")
        return str(token.get("text") or "") if isinstance(token, dict) else None
    choices = event.get("choices") or []
    if not choices:
        return None  # the usage-only chunk
    choice = choices[0]
    if endpoint is Endpoint.COMPLETIONS:
        return str(choice.get("text") or "")
    delta = choice.get("delta") or {}
    text = delta.get("content") or delta.get("reasoning_content") or ""
    if not text and delta.get("tool_calls"):
        text = json.dumps(delta["tool_calls"])
    return str(text) if text or choice.get("finish_reason") else None


def _read_final(endpoint: Endpoint, event: dict[str, Any], record: RequestRecord) -> None:
    """Counts and timings the server sends with the end of a stream."""
    usage = event.get("usage")
    if isinstance(usage, dict):
        record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
        if usage.get("completion_tokens") is not None:
            record.output_tokens = int(usage["completion_tokens"])
            record.token_source = TokenCountSource.USAGE
    timings = event.get(contract.TIMINGS_FIELD)
    if isinstance(timings, dict):
        record.server = contract.RequestTimings.model_validate(timings)
    if endpoint is Endpoint.TGI_STREAM and isinstance(event.get("details"), dict):
        details = event["details"]
        if details.get("generated_tokens") is not None:
            record.output_tokens = int(details["generated_tokens"])
            record.token_source = TokenCountSource.USAGE
        if details.get(contract.HEADER_PROMPT_TOKENS) is not None:
            record.prompt_tokens = int(details[contract.HEADER_PROMPT_TOKENS])


def _header_timings(headers: httpx.Headers) -> HeaderTimings | None:
    try:
        return HeaderTimings(
            queue_ms=float(headers[contract.HEADER_QUEUE_TIME]),
            prefill_ms=float(headers[contract.HEADER_PREFILL_TIME]),
            inference_ms=float(headers[contract.HEADER_INFERENCE_TIME]),
            time_per_token_ms=float(headers[contract.HEADER_TIME_PER_TOKEN]),
        )
    except (KeyError, ValueError):
        return None


async def _stream(http: httpx.AsyncClient, endpoint: Endpoint, body: bytes, record: RequestRecord,
                  clock: Clock) -> None:
    text_parts: list[str] = []
    async with http.stream("POST", endpoint.value, content=body, headers=JSON_HEADERS) as response:
        record.status = response.status_code
        if response.status_code != 200:
            record.error = _error_message(await response.aread())
            return
        async for now, event in _sse_events(response, clock):
            if "error" in event and "choices" not in event and "token" not in event:
                raise StreamError(_error_message(json.dumps(event).encode()))
            text = _chunk_output(endpoint, event)
            if text is not None:
                record.chunk_times.append(now)
                text_parts.append(text)
            _read_final(endpoint, event, record)
    record.text = "".join(text_parts)


async def _whole(http: httpx.AsyncClient, body: bytes, record: RequestRecord) -> None:
    """TGI `/generate`: no chunks; the perf scheme's latencies come from the timing headers."""
    response = await http.post(Endpoint.TGI.value, content=body, headers=JSON_HEADERS)
    record.status = response.status_code
    if response.status_code != 200:
        record.error = _error_message(response.content)
        return
    record.text = str(response.json().get("generated_text") or "")
    record.headers = _header_timings(response.headers)
    if record.headers is None:
        record.error = "the response carries no x-queue-time/x-prefill-time/x-inference-time/x-time-per-token headers"
    generated = response.headers.get(contract.HEADER_GENERATED_TOKENS)
    prompt = response.headers.get(contract.HEADER_PROMPT_TOKENS)
    if generated is not None:
        record.output_tokens = int(generated)
        record.token_source = TokenCountSource.USAGE
    if prompt is not None:
        record.prompt_tokens = int(prompt)


def _count_tokens(record: RequestRecord, request: BenchRequest, tokenizer: TokenCounter | None) -> None:
    """Fills the counts the server did not send: by the client's tokenizer, else one token per chunk."""
    if record.prompt_tokens is None:
        record.prompt_tokens = request.prompt_len
    counted = None
    if tokenizer is not None:
        # Timed as MindIE's Detokenizer row: the client's own pass over the output.
        start = time.perf_counter()
        counted = len(tokenizer.encode(record.text))
        record.detokenize_ms = (time.perf_counter() - start) * 1000
    if record.output_tokens is not None:
        return
    if counted is not None:
        record.output_tokens = counted
        record.token_source = TokenCountSource.TOKENIZER
    else:
        record.output_tokens = len(record.chunk_times)
        record.token_source = TokenCountSource.CHUNKS


async def send(pool: ConnectionPool, endpoint: Endpoint, request: BenchRequest, record: RequestRecord, *,
               model: str, ignore_eos: bool, tokenizer: TokenCounter | None, clock: Clock) -> RequestRecord:
    """Sends one request and fills `record` (whose index, user and warm-up flag the caller set); never raises for
    a failed request: the failure is the record's status and error."""
    body = json.dumps(request_body(endpoint, request, model, ignore_eos)).encode()
    if tokenizer is not None:
        # Timed as MindIE's Tokenizer row (its client tokenizes each prompt); before t0, so not in the latency.
        start = time.perf_counter()
        prompt_len = len(tokenizer.encode(request.prompt))
        record.tokenize_ms = (time.perf_counter() - start) * 1000
        record.prompt_tokens = prompt_len
    try:
        async with pool.connection() as http:
            record.t0 = clock()
            if endpoint.streamed:
                await _stream(http, endpoint, body, record, clock)
            else:
                await _whole(http, body, record)
    except StreamError as e:
        record.error = str(e)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        record.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    record.end = clock()
    record.output_chars = len(record.text)
    if record.ok:
        _count_tokens(record, request, tokenizer)
    return record
