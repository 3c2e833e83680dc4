"""Report layouts over one fixed run whose figures are worked out by hand."""

from __future__ import annotations

import json
import math
from datetime import datetime

import pytest

from npuserve.engine_contract import RequestTimings
from npuserve.loadgen.config import SLO, BenchConfig, LoadConfig
from npuserve.loadgen.metrics import BenchMetrics, compute_metrics
from npuserve.loadgen.records import Endpoint, HeaderTimings, RequestRecord, TokenCountSource
from npuserve.loadgen.report_json import report_json
from npuserve.loadgen.report_mindie import render_mindie
from npuserve.loadgen.report_perf import benchmark_time, perf_metrics, render_perf
from npuserve.loadgen.report_vllm import default_result_filename, render_vllm, vllm_result_json
from npuserve.loadgen.result import BenchResult

STARTED = datetime(2025, 3, 17, 17, 32, 14)


def timings(queue_ms: float, prefill_batch: int, decode_batch: float) -> RequestTimings:
    return RequestTimings(queue_time_ms=queue_ms, prefill_batch_size=prefill_batch, mean_decode_batch_size=decode_batch)


def ok(index: int, t0: float, chunks: list[float], tokens: int, prompt: int, chars: int, server: RequestTimings,
       text: str) -> RequestRecord:
    return RequestRecord(index=index, t0=t0, chunk_times=chunks, end=chunks[-1], prompt_tokens=prompt,
                         output_tokens=tokens, output_chars=chars, text=text, status=200, server=server,
                         tokenize_ms=1.0, detokenize_ms=0.5, user=index % 2)


# TTFT 100 200 100; gaps (ms) [100 200] [100] [100 100 200]; E2E 400 300 500; tokens 3 2 4; prompts 100 200 100
RECORDS = [
    ok(0, 0.0, [0.1, 0.2, 0.4], 3, 100, 12, timings(5.0, 2, 3.0), "abc"),
    ok(1, 0.0, [0.2, 0.3], 2, 200, 8, timings(15.0, 1, 2.0), "de"),
    ok(2, 0.5, [0.6, 0.7, 0.8, 1.0], 4, 100, 20, timings(10.0, 4, 4.0), "fghi"),
    # failed after counting some output: still length 0 in vLLM's file, in no figure
    RequestRecord(index=3, t0=0.5, end=0.55, status=500, error="HTTP 500: boom", prompt_tokens=100, output_tokens=5),
    RequestRecord(index=-1, warmup=True, t0=-9.0, chunk_times=[-1.0], end=-1.0, output_tokens=1, status=200),
]


def bench(records: list[RequestRecord] = RECORDS, **load: object) -> BenchResult:
    config = BenchConfig(load=LoadConfig(**{"max_concurrency": 4, **load}))  # type: ignore[arg-type]
    return BenchResult(config=config, model="Qwen/QwQ-32B", started_at=STARTED, duration_s=2.0, records=records,
                       token_source=TokenCountSource.USAGE, dataset="gsm8k.jsonl")


def figures(result: BenchResult, slo: SLO | None = None, extra: tuple[float, ...] = ()) -> BenchMetrics:
    return compute_metrics(result.records, result.duration_s, slo=slo, extra_percentiles=extra)


def cells(text: str, metric: str) -> list[str]:
    """The stripped cells of the table row named `metric`."""
    (line,) = [line for line in text.splitlines() if line.startswith("|") and line.split("|")[1].strip() == metric]
    return [cell.strip() for cell in line.strip("|").split("|")]


# --- MindIE ----------------------------------------------------------------------------------------------------

def test_mindie_layout_titles_borders_and_names() -> None:
    text = render_mindie(bench(), figures(bench()))
    lines = text.splitlines()
    assert lines[0] == "The BenchMark test performance metric result is:"
    assert lines[1].startswith("+---------------------+")  # 19 = len("GeneratedTokenSpeed") + 2 spaces
    assert [c.strip() for c in lines[2].strip("|").split("|")] == [
        "Metric", "average", "max", "min", "P75", "P90", "SLO_P90", "P99", "N"]
    names = [line.split("|")[1].strip() for line in lines[4:21]]
    assert names == ["FirstTokenTime", "DecodeTime", "LastDecodeTime", "MaxDecodeTime", "GenerateTime",
                     "InputTokens", "GeneratedTokens", "GeneratedTokenSpeed", "GeneratedCharacters", "Tokenizer",
                     "Detokenizer", "CharactersPerToken", "PostProcessingTime", "ForwardTime", "PrefillBatchsize",
                     "DecoderBatchsize", "QueueWaitTime"]
    assert "|      FirstTokenTime |" in text
    assert "The BenchMark test common metric result is:" in lines
    assert "|          Common Metric |" in text


def test_mindie_performance_cells() -> None:
    text = render_mindie(bench(), figures(bench()))
    assert cells(text, "FirstTokenTime") == ["FirstTokenTime", "133.3333 ms", "200.0000 ms", "100.0000 ms",
                                             "150.0000 ms", "180.0000 ms", "180.0000 ms", "198.0000 ms", "3"]
    decode = cells(text, "DecodeTime")
    assert decode[1] == "133.3333 ms" and decode[8] == "6"  # six gaps pooled
    assert decode[5] == "200.0000 ms"  # P90 of the pooled gaps
    assert decode[6] == "146.6667 ms"  # SLO_P90: P90 of the request means 150, 100, 133.33
    assert cells(text, "LastDecodeTime")[1:4] == ["166.6667 ms", "200.0000 ms", "100.0000 ms"]
    assert cells(text, "GenerateTime")[1] == "400.0000 ms"
    assert cells(text, "GeneratedTokenSpeed")[1] == "7.3889 token/s"  # mean of 3/0.4, 2/0.3, 4/0.5
    assert cells(text, "InputTokens")[1:4] == ["133.3333", "200.0000", "100.0000"]
    assert cells(text, "CharactersPerToken") == ["CharactersPerToken", "4.4444", *["/"] * 7]  # 40 chars / 9 tokens
    assert cells(text, "QueueWaitTime")[1] == "10000.0000 μs"
    assert cells(text, "QueueWaitTime")[6] == "/ μs"
    assert cells(text, "DecoderBatchsize")[6] == "/"
    assert cells(text, "PrefillBatchsize")[1] == "2.3333"


def test_mindie_common_cells() -> None:
    text = render_mindie(bench(), figures(bench()))
    assert cells(text, "CurrentTime")[1] == "2025-03-17 17:32:16"  # start + 2 s
    assert cells(text, "TimeElapsed")[1] == "2.0000 s"
    assert cells(text, "DataSource")[1] == "gsm8k.jsonl"
    assert cells(text, "Failed")[1] == "1( 25.0% )"
    assert cells(text, "Returned")[1] == "3( 75.0% )"
    assert cells(text, "Total")[1] == "4[ 100.0% ]"
    assert cells(text, "Concurrency")[1] == "4"
    assert cells(text, "ModelName")[1] == "Qwen/QwQ-32B"
    assert cells(text, "lpct")[1] == "1.0000 ms"  # TTFT 400 ms over 400 prompt tokens
    assert cells(text, "Throughput")[1] == "1.5000 req/s"
    assert cells(text, "GenerateSpeed")[1] == "4.5000 token/s"
    assert cells(text, "GenerateSpeedPerClient")[1] == "1.1250 token/s"
    assert cells(text, "accuracy")[1] == "/"
    assert "RequestRate" not in text


def test_mindie_rows_without_a_source_say_so() -> None:
    bare = [r.model_copy(update={"server": None, "tokenize_ms": None, "detokenize_ms": None}) for r in RECORDS]
    text = render_mindie(bench(bare), figures(bench(bare)))
    for metric in ("PrefillBatchsize", "DecoderBatchsize", "QueueWaitTime", "Tokenizer", "Detokenizer",
                   "PostProcessingTime", "ForwardTime"):
        assert cells(text, metric) == [metric, *["n/a"] * 7, "0"]
    assert "PrefillBatchsize, DecoderBatchsize, QueueWaitTime: the server sent no per-request timings" in text
    assert "Tokenizer, Detokenizer: the client tokenized nothing (no tokenizer)" in text
    assert "PostProcessingTime, ForwardTime: " in text


def test_mindie_open_loop_shows_the_rate() -> None:
    result = bench(max_concurrency=None, request_rate=8.0)
    text = render_mindie(result, figures(result))
    assert cells(text, "Concurrency")[1] == "/"
    assert cells(text, "RequestRate")[1] == "8.0000 req/s"
    assert cells(text, "GenerateSpeedPerClient")[1] == "/"


# --- vLLM ------------------------------------------------------------------------------------------------------

def test_vllm_summary_block() -> None:
    result = bench(request_rate=8.0)
    text = render_vllm(result, figures(result, SLO(ttft_ms=150.0), (99.9,)), percentile_metrics=("ttft", "e2el"),
                       metric_percentiles=(50, 99.9))
    lines = text.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[1] == "Successful requests:                     3         "
    assert lines[2] == "Failed requests:                         1         "
    assert lines[3] == "Maximum request concurrency:             4         "
    assert lines[4] == "Request rate configured (RPS):           8.00      "
    assert lines[5] == "Benchmark duration (s):                  2.00      "
    assert lines[6] == "Total input tokens:                      400       "
    assert lines[7] == "Total generated tokens:                  9         "
    assert lines[8] == "Request throughput (req/s):              1.50      "
    assert lines[9] == "Request goodput (req/s):                 1.00      "  # TTFT 100, 100 meet 150
    assert lines[10] == "Output token throughput (tok/s):         4.50      "
    assert lines[11].startswith("Peak output token throughput (tok/s):")
    assert lines[12] == "Total Token throughput (tok/s):          204.50    "
    assert lines[13] == "---------------Time to First Token----------------"
    assert lines[14] == "Mean TTFT (ms):                          133.33    "
    assert lines[15] == "Median TTFT (ms):                        100.00    "
    assert lines[16] == "P50 TTFT (ms):                           100.00    "
    assert lines[17].startswith("P99.9 TTFT (ms):")
    assert lines[18] == "----------------End-to-end Latency----------------"
    assert lines[19] == "Mean E2EL (ms):                          400.00    "
    assert lines[-1] == "=" * 50
    assert "Inter-token Latency" not in text


def test_vllm_summary_defaults_and_absent_values() -> None:
    result = bench(max_concurrency=None)  # unbounded rate, no concurrency cap
    single = [RequestRecord(index=0, t0=0.0, chunk_times=[0.1], end=0.1, output_tokens=1, status=200)]
    text = render_vllm(bench(single, max_concurrency=None), compute_metrics(single, 1.0))
    assert "Maximum request concurrency:" not in text and "Request rate configured" not in text
    assert "Request goodput" not in text
    assert "Mean TPOT (ms):                          n/a       " in text.splitlines()  # no second token anywhere
    assert "P99 ITL (ms):" in text and "End-to-end Latency" not in text
    with pytest.raises(ValueError, match="latency"):
        render_vllm(result, figures(result), percentile_metrics=("latency",))


def test_vllm_result_json_fields() -> None:
    result = bench()
    data = vllm_result_json(result, figures(result, extra=(99.9,)), percentile_metrics=("ttft", "tpot", "itl", "e2el"),
                            metric_percentiles=(99, 99.9))
    json.dumps(data, allow_nan=False)
    assert {"date", "backend", "model_id", "tokenizer_id", "num_prompts", "request_rate", "burstiness",
            "max_concurrency", "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
            "request_throughput", "request_goodput", "output_throughput", "total_token_throughput", "input_lens",
            "output_lens", "ttfts", "itls", "generated_texts", "errors", "mean_ttft_ms", "median_ttft_ms",
            "std_ttft_ms", "p99_ttft_ms", "p99.9_ttft_ms", "mean_tpot_ms", "p99_itl_ms", "mean_e2el_ms",
            "p99.9_e2el_ms"} <= set(data)
    assert data["date"] == "20250317-173214"
    assert (data["backend"], data["model_id"], data["tokenizer_id"]) == ("openai", "Qwen/QwQ-32B", "Qwen/QwQ-32B")
    assert (data["request_rate"], data["max_concurrency"], data["burstiness"]) == ("inf", 4, 1.0)
    assert (data["completed"], data["failed"], data["request_goodput"]) == (3, 1, None)
    # per measured request in sending order; the failed one: length 0, ttft 0.0, its error
    assert data["output_lens"] == [3, 2, 4, 0]
    assert data["input_lens"] == [100, 200, 100, 100]
    assert data["ttfts"] == pytest.approx([0.1, 0.2, 0.1, 0.0])
    assert data["itls"][1] == pytest.approx([0.1])
    assert data["errors"] == ["", "", "", "HTTP 500: boom"]
    assert data["generated_texts"] == ["abc", "de", "fghi", ""]
    assert data["p99_ttft_ms"] == pytest.approx(198.0)
    assert data["median_e2el_ms"] == pytest.approx(400.0)


def test_vllm_result_filename() -> None:
    assert default_result_filename(bench()) == "openai-infqps-concurrency4-QwQ-32B-20250317-173214.json"
    chat = bench(max_concurrency=None, request_rate=10)
    chat.config.endpoint = Endpoint.CHAT
    assert default_result_filename(chat) == "openai-chat-10.0qps-QwQ-32B-20250317-173214.json"


# --- the perf scheme -------------------------------------------------------------------------------------------

def header_record(index: int, user: int, t0: float, end: float, queue: float, prefill: float, inference: float,
                  per_token: float, tokens: int) -> RequestRecord:
    return RequestRecord(index=index, user=user, t0=t0, end=end, output_tokens=tokens, status=200,
                         headers=HeaderTimings(queue_ms=queue, prefill_ms=prefill, inference_ms=inference,
                                               time_per_token_ms=per_token))


def test_perf_report_from_tgi_headers() -> None:
    records = [header_record(0, 0, 0.0, 0.6, 10.0, 40.0, 500.0, 20.0, 5),
               header_record(1, 0, 1.0, 1.8, 20.0, 60.0, 700.0, 30.0, 3),
               header_record(2, 1, 0.2, 0.5, 0.0, 30.0, 250.0, 10.0, 4)]
    result = bench(records, max_concurrency=2)
    result.config.endpoint = Endpoint.TGI
    report = perf_metrics(result, compute_metrics(records, 2.0))
    assert report.first_token_latency is not None and report.first_token_latency.mean == pytest.approx(160.0 / 3)
    assert report.avg_token_latency is not None and report.avg_token_latency.p50 == pytest.approx(20.0)
    assert report.response_time is not None and report.response_time.mean == pytest.approx(1450.0 / 3)
    assert report.benchmark_time == pytest.approx(1.8)  # user 0: 0.0 -> 1.8; user 1: 0.2 -> 0.5
    assert report.throughput_token_rate == pytest.approx(6.0)
    assert report.throughput_request_rate == pytest.approx(1.5)
    assert (report.error_rate, report.concurrency_users) == (0.0, 2)


def test_perf_report_from_streams_and_its_text() -> None:
    result = bench(request_rate=4.0, max_concurrency=None)
    report = perf_metrics(result, figures(result))
    assert report.response_time is not None and report.response_time.mean == pytest.approx(400.0)
    assert report.concurrency_users is None  # open loop
    text = render_perf(result, figures(result))
    assert "first_token_latency" in text and "133.33" in text
    assert "error_rate" in text and "25.00%" in text
    assert "concurrency_users" in text and "open loop" in text


def test_benchmark_time_without_users_is_the_whole_run() -> None:
    records = [RequestRecord(index=0, t0=0.5, end=1.0), RequestRecord(index=1, t0=1.0, chunk_times=[3.5])]
    assert benchmark_time(records) == pytest.approx(3.0)


# --- everything as JSON ----------------------------------------------------------------------------------------

def test_report_json_holds_config_metrics_mindie_and_records() -> None:
    result = bench()
    data = report_json(result, figures(result))
    text = json.dumps(data, allow_nan=False)  # strict JSON: the unbounded rate is written as "inf"
    assert data["config"]["load"]["request_rate"] == "inf"
    assert data["metrics"]["completed"] == 3
    assert data["mindie"]["common"]["Returned"] == "3( 75.0% )"
    assert data["mindie"]["performance"][0]["metric"] == "FirstTokenTime"
    assert len(data["records"]) == 5 and data["records"][4]["warmup"] is True
    assert data["perf"]["benchmark_time"] == pytest.approx(1.0)
    assert math.isclose(json.loads(text)["metrics"]["ttft_ms"]["mean"], 400.0 / 3)
