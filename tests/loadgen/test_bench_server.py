"""`npuserve bench` against a real `npuserve serve` engine (the tiny dummy model on the CPU): every report format,
a sweep with its CSV and plot, SLOs and goodput, the TGI header mode, 429s counted right, Ctrl-C, an unreachable
server, and the same run measured by an independent client (the official `openai` client)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import csv
import io
import json
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from npuserve.cli import main
from npuserve.loadgen.config import BenchConfig, DatasetConfig, DatasetName, LoadConfig
from npuserve.loadgen.metrics import compute_metrics
from npuserve.loadgen.records import Endpoint, RequestRecord
from npuserve.loadgen.result import BenchResult
from npuserve.loadgen.run import ServerUnreachable, run_benchmark
from tests.server.conftest import RunningServer, running_server


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[RunningServer]:
    with running_server(tiny_model_dir, maxBatchSize=16, cacheBlockSize=16) as s:
        yield s


def _bench(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["bench", *args])
    out, err = capsys.readouterr()
    return code, out, err


def _small_load(url: str) -> list[str]:
    return ["--base-url", url, "--dataset-name", "random", "--random-input-len", "24", "--random-output-len", "8",
            "--num-prompts", "12", "--max-concurrency", "4", "--ignore-eos"]


def test_vllm_summary_and_saved_result(engine: RunningServer, capsys: pytest.CaptureFixture[str],
                                       tmp_path: Path) -> None:
    code, out, _ = _bench(capsys, *_small_load(engine.url), "--save-result", "--result-dir", str(tmp_path),
                          "--result-filename", "r.json", "--metric-percentiles", "50,99")
    assert code == 0, out
    assert "Serving Benchmark Result" in out
    assert "Successful requests:" in out and " 12 " in out.split("Successful requests:")[1].splitlines()[0] + " "
    assert "P50 TTFT (ms):" in out and "P99 TPOT (ms):" in out
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["completed"] == 12
    assert saved["total_output_tokens"] == 12 * 8  # --ignore-eos: every request gives its 8 tokens
    assert len(saved["ttfts"]) == 12 and len(saved["itls"]) == 12
    for key in ("duration", "request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms",
                "p99_ttft_ms", "p50_ttft_ms", "mean_tpot_ms", "mean_itl_ms", "input_lens", "output_lens"):
        assert key in saved, key


def test_one_output_throughput_is_printed(engine: RunningServer, capsys: pytest.CaptureFixture[str]) -> None:
    """The closing progress line gave the rate from the first send (warm-up and tail included), the report the
    measured phase's: two figures 6% apart. The report's is the one (vLLM's peak, the most tokens in a second, is
    another quantity)."""
    code, out, err = _bench(capsys, *_small_load(engine.url))
    assert code == 0
    figures = [line for line in (out + err).splitlines() if "tok/s" in line and "utput" in line and "Peak" not in line]
    assert len(figures) == 1 and figures[0].startswith("Output token throughput"), figures


def test_mindie_tables_carry_the_engine_timings(engine: RunningServer, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _bench(capsys, *_small_load(engine.url), "--format", "mindie")
    assert code == 0
    assert "The BenchMark test performance metric result is:" in out
    assert "The BenchMark test common metric result is:" in out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("|")}
    for name in ("FirstTokenTime", "DecodeTime", "GenerateTime", "PrefillBatchsize", "DecoderBatchsize",
                 "QueueWaitTime", "Returned", "Concurrency", "GenerateSpeed"):
        assert name in rows, name
    assert "12( 100.0% )" in rows["Returned"]
    # The engine sends its per-request timings, so the batch-size rows hold numbers, not "n/a".
    assert "n/a" not in rows["PrefillBatchsize"] and "n/a" not in rows["DecoderBatchsize"]


def test_perf_scheme_through_the_tgi_headers(engine: RunningServer, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _bench(capsys, *_small_load(engine.url), "--endpoint", Endpoint.TGI.value, "--format", "perf",
                          "--think-time", "0:0.01")
    assert code == 0, out
    for name in ("first_token_latency", "avg_token_latency", "response_time", "benchmark_time",
                 "throughput_token_rate", "throughput_request_rate", "error_rate"):
        assert name in out, name


def test_tgi_header_records_hold_the_server_timings(engine: RunningServer) -> None:
    config = BenchConfig(base_url=engine.url, endpoint=Endpoint.TGI, ignore_eos=True,
                         dataset=DatasetConfig(name=DatasetName.RANDOM, random_input_len=16, random_output_len=6),
                         load=LoadConfig(num_prompts=4, max_concurrency=2))
    result = asyncio.run(run_benchmark(config))
    for record in result.measured:
        assert record.ok and record.headers is not None and not record.chunk_times
        assert record.output_tokens == 6
        # first-token latency = x-prefill-time + x-queue-time, within the client's own round trip
        assert 0 < record.headers.first_token_ms <= (record.end - record.t0) * 1000  # type: ignore[operator]


def test_json_report_holds_every_record(engine: RunningServer, capsys: pytest.CaptureFixture[str],
                                        tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    code, out, _ = _bench(capsys, *_small_load(engine.url), "--format", "json", "--warmup-requests", "2",
                          "--endpoint", Endpoint.CHAT.value, "--save-trace", str(trace))
    assert code == 0
    report = json.loads(out[: out.rindex("}") + 1])
    assert len(report["records"]) == 14  # 2 warm-up + 12 measured
    assert sum(1 for r in report["records"] if r["warmup"]) == 2
    assert report["metrics"]["completed"] == 12
    assert len(trace.read_text().splitlines()) == 14


def test_sweep_writes_the_csv_and_the_plot(engine: RunningServer, capsys: pytest.CaptureFixture[str],
                                           tmp_path: Path) -> None:
    table, plot = tmp_path / "sweep.csv", tmp_path / "sweep.png"
    code, out, _ = _bench(capsys, *_small_load(engine.url), "--sweep", "max-concurrency=1,2,4",
                          "--sweep-csv", str(table), "--plot", str(plot), "--slo-tpot-ms", "1000")
    assert code == 0, out
    rows = list(csv.DictReader(io.StringIO(table.read_text())))
    assert [row["batch"] for row in rows] == ["1", "2", "4"]
    assert all(float(row["TOTAL_THROUGHPUT(toks/s)"]) > float(row["generate_throughput(toks/s)"]) > 0 for row in rows)
    assert rows[0]["tp"] == "1"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_slos_give_goodput_and_a_verdict(engine: RunningServer, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _bench(capsys, *_small_load(engine.url), "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000")
    assert code == 0
    assert "SLO: PASS" in out
    assert "Request goodput (req/s):" in out
    code, out, _ = _bench(capsys, *_small_load(engine.url), "--slo-ttft-ms", "0.001")
    assert "SLO: FAIL" in out
    goodput = float(out.split("Request goodput (req/s):")[1].split()[0])
    assert goodput == 0.0


def test_shed_requests_count_as_429_errors(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # One slot in the waiting queue and a long decode: most of 16 simultaneous requests are shed with 429.
    with running_server(tiny_model_dir, max_waiting=1, maxBatchSize=2, cacheBlockSize=16) as s:
        before = s.metric("npuserve:request_success_total")
        config = BenchConfig(base_url=s.url, ignore_eos=True,
                             dataset=DatasetConfig(name=DatasetName.RANDOM, random_input_len=8,
                                                   random_output_len=64),
                             load=LoadConfig(num_prompts=16))
        result = asyncio.run(run_benchmark(config))
        metrics = compute_metrics(result.measured, result.duration_s)
        served = sum(v for k, v in _success_counts(s).items()) - before
    assert metrics.rate_limited > 0
    assert metrics.completed + metrics.rate_limited == 16
    assert metrics.failed == metrics.rate_limited
    assert metrics.completed == served  # what the server finished is what the client counted as done
    assert metrics.error_rate == pytest.approx(metrics.rate_limited / 16)


def _success_counts(s: RunningServer) -> dict[str, float]:
    counts = {}
    for line in s.get("/metrics").text.splitlines():
        if line.startswith("npuserve:request_success_total{"):
            head, _, value = line.rpartition(" ")
            counts[head] = float(value)
    return counts


def test_unreachable_server_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _bench(capsys, "--base-url", "http://127.0.0.1:9", "--num-prompts", "3")
    assert code == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1 and "cannot reach http://127.0.0.1:9" in err


def test_every_request_failing_exits_1_with_the_errors(engine: RunningServer,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    # 400 output tokens on a 512-token context with 2000-token prompts: the server refuses each one with a 400.
    code, _, err = _bench(capsys, "--base-url", engine.url, "--dataset-name", "random", "--random-input-len", "2000",
                          "--random-output-len", "400", "--num-prompts", "3")
    assert code == 1
    assert "every request failed" in err and "HTTP 400" in err


def test_stop_event_ends_the_run_with_what_it_measured(engine: RunningServer) -> None:
    config = BenchConfig(base_url=engine.url, ignore_eos=True,
                         dataset=DatasetConfig(name=DatasetName.RANDOM, random_input_len=8, random_output_len=32),
                         load=LoadConfig(num_prompts=500, max_concurrency=2))

    async def interrupted() -> tuple[int, bool]:
        stop = asyncio.Event()

        def on_record(record: RequestRecord) -> None:
            if record.index == 5:  # as Ctrl-C would, part way through
                stop.set()

        result = await run_benchmark(config, stop=stop, on_record=on_record)
        assert all(r.ok for r in result.measured)  # the ones in flight at the stop finished in the grace period
        return len(result.measured), result.interrupted

    done, interrupted_flag = asyncio.run(interrupted())
    assert interrupted_flag
    assert 6 <= done <= 8  # what had ended, plus the two in flight; nothing sent after the stop


def test_unknown_model_name_is_refused_before_load(engine: RunningServer) -> None:
    config = BenchConfig(base_url=engine.url, model="no-such-model")
    with pytest.raises(ServerUnreachable, match="no model named 'no-such-model'"):
        asyncio.run(run_benchmark(config))


# --- the same load measured two ways ------------------------------------------------------------------------------


async def _independent(url: str, model: str, prompts: list[str], max_tokens: int, concurrency: int
                       ) -> tuple[float, float]:
    """Mean TTFT (ms) and output tok/s as the official openai client sees them, with its own clock."""
    from openai import AsyncOpenAI

    # t0 = when httpx sends the request (its request hook), after the openai client's own request building: the
    # bench client's t0 is likewise taken just before it hands the request to httpx.
    sent_at: contextvars.ContextVar[float] = contextvars.ContextVar("sent_at")

    async def on_request(_: httpx.Request) -> None:
        sent_at.set(time.perf_counter())

    http = httpx.AsyncClient(event_hooks={"request": [on_request]}, timeout=120)
    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, http_client=http)
    ttfts: list[float] = []
    tokens = 0
    queue = list(prompts)

    # One request first, outside the figures, as bench's --warmup-requests: the client's first call builds its models.
    warm = await client.completions.create(model=model, prompt=prompts[0], max_tokens=2, stream=True)
    async for _ in warm:
        pass

    async def user() -> None:
        nonlocal tokens
        while queue:
            prompt = queue.pop()
            first = None
            stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                     temperature=0.0, stream=True,
                                                     stream_options={"include_usage": True},
                                                     extra_body={"ignore_eos": True})
            async for chunk in stream:
                if first is None and chunk.choices:  # a token arrived, whether or not it decoded to text yet
                    first = time.perf_counter()
                if chunk.usage is not None:
                    tokens += chunk.usage.completion_tokens
            assert first is not None
            ttfts.append((first - sent_at.get()) * 1000)

    start = time.perf_counter()
    await asyncio.gather(*(user() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    await client.close()
    return statistics.mean(ttfts), tokens / elapsed


@contextmanager
def serve_process(model: Path) -> Iterator[str]:
    """`npuserve serve` in its own process: the two clients compared below must not share an interpreter (and its
    GIL) with the engine, or the heavier client would slow the engine it measures."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [str(Path(sys.executable).parent / "npuserve"), "serve", "--model", str(model), "--host", "127.0.0.1",
               "--port", str(port)]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            assert proc.poll() is None and time.monotonic() < deadline, "npuserve serve did not start"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_bench_agrees_with_an_independent_client(tiny_model_dir: Path) -> None:
    """TTFT within 25% and output tok/s within 15% of what the official openai client measures with its own clock.
    The two run at the same time against one server, each with two users sending the same prompts, so both see the
    same engine load (a noisy neighbour on this shared machine hits both alike). TTFT is a wait for the next step
    plus a prefill, spread over about half its mean: two means of 64 requests each differ by about 9% (one sigma)
    from sampling alone, so 25% is near three sigma; a bias in either client's clock larger than that still fails."""
    with serve_process(tiny_model_dir) as url:
        config = BenchConfig(base_url=url, ignore_eos=True,
                             dataset=DatasetConfig(name=DatasetName.RANDOM, random_input_len=500,
                                                   random_output_len=32),
                             load=LoadConfig(num_prompts=64, max_concurrency=2, warmup_requests=2, seed=3))
        prompts = _prompts_of(config)
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]

        async def both() -> tuple[BenchResult, tuple[float, float]]:
            ours = asyncio.ensure_future(run_benchmark(config))
            theirs = asyncio.ensure_future(_independent(url, model, prompts, 32, 2))
            return await ours, await theirs

        result, (their_ttft, their_tps) = asyncio.run(both())
    metrics = compute_metrics(result.measured, result.duration_s)
    assert metrics.completed == 64
    ttft_ratio = metrics.ttft_ms.mean / their_ttft
    tps_ratio = metrics.output_throughput / their_tps
    print(f"bench/openai: TTFT {metrics.ttft_ms.mean:.1f}/{their_ttft:.1f} ms = {ttft_ratio:.3f}, "
          f"output tok/s {metrics.output_throughput:.1f}/{their_tps:.1f} = {tps_ratio:.3f}")
    assert 0.75 <= ttft_ratio <= 1.25
    assert 0.85 <= tps_ratio <= 1.15


def _prompts_of(config: BenchConfig) -> list[str]:
    from npuserve.loadgen.datasets import load_requests
    from npuserve.loadgen.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(Path(_model_root(config)))
    warmup = config.load.warmup_requests
    requests = load_requests(config.dataset, warmup + config.load.num_prompts, tokenizer=tokenizer,
                             seed=config.load.seed)
    return [r.prompt for r in requests[warmup:]]  # the measured ones, as bench draws them


def _model_root(config: BenchConfig) -> str:
    return str(httpx.get(config.base_url + "/v1/models", timeout=10).json()["data"][0]["root"])


def test_library_run_returns_a_report_and_prints_nothing(engine: RunningServer,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from npuserve.loadgen import SLO, BenchReport, benchmark

    config = BenchConfig(base_url=engine.url, ignore_eos=True, slo=SLO(tpot_ms=60_000),
                         dataset=DatasetConfig(name=DatasetName.RANDOM, random_input_len=8, random_output_len=4),
                         load=LoadConfig(num_prompts=5, max_concurrency=5))
    report = asyncio.run(benchmark(config))
    assert isinstance(report, BenchReport)
    assert report.metrics.completed == 5 and report.metrics.total_output_tokens == 20
    assert report.metrics.slo is not None and report.metrics.slo.passed
    assert report.result.tokenizer is not None  # the model folder /v1/models names, found on this machine
    assert capsys.readouterr() == ("", "")


def test_open_loop_rate_and_duration_modes(engine: RunningServer) -> None:
    base = BenchConfig(base_url=engine.url, ignore_eos=True,
                       dataset=DatasetConfig(name=DatasetName.RANDOM, random_input_len=8, random_output_len=4))
    # Open loop: 20 req/s Poisson for 10 requests takes about half a second of sending, not all at once.
    paced = asyncio.run(run_benchmark(base.model_copy(update={"load": LoadConfig(num_prompts=10, request_rate=20)})))
    sends = sorted(r.t0 for r in paced.measured)
    assert len(sends) == 10 and all(r.ok for r in paced.measured)
    assert sends[-1] - sends[0] > 0.1  # spread by the arrivals (mean 0.45 s), where an unpaced run sends at once
    # --duration: two users cycle a 3-prompt dataset until 1.5 s have passed, then stop sending.
    load = LoadConfig(num_prompts=3, duration_s=1.5, max_concurrency=2)
    timed = asyncio.run(run_benchmark(base.model_copy(update={"load": load})))
    assert len(timed.measured) > 3  # the dataset was cycled
    assert max(r.t0 for r in timed.measured) < 1.5  # nothing sent after the deadline
    assert {r.user for r in timed.measured} == {0, 1}


def test_bad_flags_name_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _bench(capsys, "--dataset-name", "gsm8k", "--num-prompts", "2")
    assert code == 2 and "--dataset-path" in err
    code, _, err = _bench(capsys, "--think-time", "3:1", "--concurrency", "2")
    assert code == 2 and "--think-time" in err
    code, _, err = _bench(capsys, "--sweep", "batch=1,2")
    assert code == 2 and "--sweep" in err
    # Flags that would do nothing in this run are refused by name, not ignored.
    for flags, named in ((["--plot", "x.png"], "--plot"), (["--sweep-csv", "x.csv"], "--sweep-csv"),
                         (["--result-dir", "out"], "--result-dir"),
                         (["--sweep", "max-concurrency=1", "--save-trace", "t.jsonl"], "--save-trace"),
                         (["--sweep", "max-concurrency=1", "--format", "mindie"], "--format"),
                         (["--format", "perf", "--metric-percentiles", "50"], "--metric-percentiles"),
                         (["--max-search-concurrency", "8"], "--max-search-concurrency"),
                         (["--percentile-metrics", "ttft,nope"], "--percentile-metrics")):
        code, _, err = _bench(capsys, "--base-url", "http://127.0.0.1:9", *flags)
        assert code == 2 and named in err, (flags, err)
