"""The operator's Prometheus client (operator/prometheus.py), through `read_windows`, the path the autotune loop runs:
each answer to its type, the PromQL it sends, a group's queries at once with a bound, the tuner's metrics from a
window; and the whole path against a real Prometheus scraping a real engine."""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from npuserve import engine_contract as contract
from npuserve.operator.names import INSTANCE_LABEL
from npuserve.operator.prometheus import (
    MAX_CONCURRENT_QUERIES,
    Empty,
    NotANumber,
    PrometheusClient,
    Selection,
    Selections,
    Unreachable,
    WindowReading,
    grouped_window_queries,
    prometheus_label_name,
)
from npuserve.planning.api import LatencyStats, PlanSchedule, TrialMetrics
from npuserve.planning.problem import TuningProblem
from tests.serve_process import free_port

URL = "http://prometheus.test:9090"
SEL = Selection(namespace="ns1", inference_service="tiny")
MATCHERS = '{namespace=~"ns1",npuserve_io_inferenceservice=~"tiny"}'
BY = "namespace,npuserve_io_inferenceservice"
SEL_LABELS = {"namespace": "ns1", "npuserve_io_inferenceservice": "tiny"}  # SEL's series, as grouped queries answer


def queries(window_s: int = 60, selection: Selection = SEL) -> dict[str, str]:
    """The PromQL of one window of `selection` read alone, by figure name."""
    return grouped_window_queries(Selections((selection,)), window_s)


def vector(*values: str) -> dict[str, object]:
    """An answer of one series per value, each labelled as SEL's (two values: two series for one InferenceService)."""
    return {"status": "success", "data": {"resultType": "vector",
                                          "result": [{"metric": SEL_LABELS | {"pod": f"p{i}"}, "value": [1.0, v]}
                                                     for i, v in enumerate(values)]}}


Handler = Callable[[httpx.Request], httpx.Response] | Callable[[httpx.Request], Awaitable[httpx.Response]]


def client(handler: Handler, concurrency: int = MAX_CONCURRENT_QUERIES) -> PrometheusClient:
    return PrometheusClient(URL, transport=httpx.MockTransport(handler), concurrency=concurrency)


def read_alone(prom: PrometheusClient, selection: Selection = SEL, start: float = 1000.0, end: float = 1060.0,
               ) -> WindowReading | Unreachable:
    (reading,) = prom.read_windows([(selection, start, end)])
    return reading


def answering(body: object, status: int = 200) -> WindowReading | Unreachable:
    """SEL's window read from a Prometheus that answers every query with `body`."""
    return read_alone(client(lambda request: httpx.Response(status, json=body)))


# --- (a) each answer to its type -----------------------------------------------------------------------------------


def test_a_number() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=vector("12.5"))

    reading = read_alone(client(handler), start=1700000000.25 - 60, end=1700000000.25)
    assert isinstance(reading, WindowReading) and reading.missing == {}
    assert reading.ttft_ms.mean == 12.5 and reading.kv_usage_max == 12.5
    assert len(seen) == len(queries())  # one query per figure
    # POST, form-encoded (a query over hundreds of InferenceServices is longer than a URL may be), with
    # Prometheus's own timeout beside the client's.
    for request in seen:
        assert (request.method, request.url.path) == ("POST", "/api/v1/query")
        assert request.headers["content-type"] == "application/x-www-form-urlencoded"
    asked = [parse_qs(r.content.decode()) for r in seen]
    assert sorted(a["query"][0] for a in asked) == sorted(queries().values())
    assert all((a["time"], a["timeout"]) == (["1700000000.250"], ["5s"]) for a in asked)


def test_an_answer_that_is_not_a_vector_is_a_bug_in_the_query() -> None:
    body = {"status": "success", "data": {"resultType": "scalar", "result": [1.0, "3"]}}
    with pytest.raises(ValueError, match="a scalar, not a vector"):
        answering(body)


def test_no_series_is_empty() -> None:
    reading = answering(vector())
    assert isinstance(reading, WindowReading)
    assert reading.missing == {name: Empty(promql) for name, promql in queries().items()}


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf"])
def test_nan_and_inf_are_not_a_number(value: str) -> None:
    reading = answering(vector(value))
    assert isinstance(reading, WindowReading)
    assert reading.ttft_ms.mean == NotANumber(queries()["ttft_ms.mean"], value)


def test_a_refused_connection_is_unreachable() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    answer = read_alone(client(refuse))
    assert isinstance(answer, Unreachable) and answer.url == URL and "Connection refused" in answer.error
    assert not client(refuse).ready()


def test_a_timeout_is_unreachable() -> None:
    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=request)

    answer = read_alone(client(slow))
    assert isinstance(answer, Unreachable) and "ReadTimeout" in answer.error


def test_a_server_error_is_unreachable() -> None:
    answer = read_alone(client(lambda r: httpx.Response(500, text="internal error")))
    assert isinstance(answer, Unreachable) and "HTTP 500" in answer.error and "not JSON" in answer.error
    answer = read_alone(client(lambda r: httpx.Response(502, json={"message": "bad gateway"})))
    assert isinstance(answer, Unreachable) and "HTTP 502" in answer.error


def test_an_api_error_is_unreachable() -> None:
    body = {"status": "error", "errorType": "execution", "error": "query timed out in expression evaluation"}
    answer = answering(body, status=503)
    assert isinstance(answer, Unreachable)
    assert answer.error == "HTTP 503, execution: query timed out in expression evaluation"


def test_a_malformed_answer_is_unreachable() -> None:
    assert isinstance(answering({"status": "success"}), Unreachable)
    assert isinstance(answering(vector("twelve")), Unreachable)


def test_two_series_for_one_inference_service_are_a_bug_in_the_query() -> None:
    with pytest.raises(ValueError, match="two series"):
        answering(vector("1", "2"))


def test_ready() -> None:
    assert client(lambda r: httpx.Response(200, text="Prometheus Server is Ready.")).ready()
    assert not client(lambda r: httpx.Response(503, text="Service Unavailable")).ready()


# --- the PromQL ----------------------------------------------------------------------------------------------------


def test_label_names_as_prometheus_sanitizes_them() -> None:
    assert prometheus_label_name(INSTANCE_LABEL) == "npuserve_io_inferenceservice"
    assert prometheus_label_name("app.kubernetes.io/name") == "app_kubernetes_io_name"
    assert prometheus_label_name("a-b_C9") == "a_b_C9"


def test_selection_matchers() -> None:
    assert Selections((SEL,)).matchers() == MATCHERS
    one_pod = Selection(namespace="ns1", inference_service="tiny", pods=("tiny-7d9f-x2x",))
    assert Selections((one_pod,)).matchers() == MATCHERS[:-1] + ',pod=~"tiny-7d9f-x2x"}'
    # Regex metacharacters matched literally (Prometheus anchors the regex), backslashes escaped for the string.
    two = Selection(namespace="ns1", inference_service="tiny", pods=("a.b", "c"))
    assert Selections((two,)).matchers() == MATCHERS[:-1] + ',pod=~"a\\\\.b|c"}'
    assert Selections((SEL,)).matchers(finished_reason="error") == MATCHERS[:-1] + ',finished_reason="error"}'
    with pytest.raises(ValueError):
        Selection(namespace="ns1", inference_service="tiny", pods=())


def test_window_queries() -> None:
    q = queries(30)
    ttft = "npuserve:time_to_first_token_seconds"
    assert q["ttft_ms.samples"] == f"sum by ({BY}) (increase({ttft}_count{MATCHERS}[30s]))"
    assert q["ttft_ms.mean"] == (f"1000 * sum by ({BY}) (increase({ttft}_sum{MATCHERS}[30s]))"
                                 f" / sum by ({BY}) (increase({ttft}_count{MATCHERS}[30s]))")
    assert q["ttft_ms.p99"] == (f"1000 * histogram_quantile(0.99, sum by ({BY},le) "
                                f"(increase({ttft}_bucket{MATCHERS}[30s])))")
    assert q["tpot_ms.p90"].startswith(f"1000 * histogram_quantile(0.9, sum by ({BY},le) "
                                       "(increase(npuserve:time_per_output_token_seconds_bucket{")
    assert q["output_tokens_per_s"] == (f"sum by ({BY}) (increase(npuserve:generation_tokens_total{MATCHERS}[30s]))"
                                        " / 30")
    assert q["requests_finished"] == f"sum by ({BY}) (increase(npuserve:request_success_total{MATCHERS}[30s]))"
    assert q["errors"] == (f"sum by ({BY}) (increase(npuserve:request_success_total"
                           '{namespace=~"ns1",npuserve_io_inferenceservice=~"tiny",finished_reason="error"}[30s]))')
    assert 'finished_reason="abort"' in q["aborts"]
    assert q["preemptions"] == f"sum by ({BY}) (increase(npuserve:num_preemptions_total{MATCHERS}[30s]))"
    assert q["kv_usage_max"] == f"max by ({BY}) (max_over_time(npuserve:kv_cache_usage_perc{MATCHERS}[30s]))"
    per_pod = (f"avg_over_time(npuserve:num_requests_running{MATCHERS}[30s])"
               f" + avg_over_time(npuserve:num_requests_waiting{MATCHERS}[30s])")
    assert q["in_flight_sum"] == f"sum by ({BY}) ({per_pod})" and q["pods_reporting"] == f"count by ({BY}) ({per_pod})"


def test_grouped_window_queries_select_every_member_and_keep_each_apart() -> None:
    group = Selections((Selection("ns1", "tiny"), Selection("ns2", "a.b"), Selection("ns1", "big")))
    assert group.labels == ("namespace", "npuserve_io_inferenceservice") and not group.by_pod
    matchers = '{namespace=~"ns1|ns2",npuserve_io_inferenceservice=~"a\\\\.b|big|tiny"}'
    q = grouped_window_queries(group, 30)
    ttft = "npuserve:time_to_first_token_seconds"
    assert q["ttft_ms.samples"] == f"sum by ({BY}) (increase({ttft}_count{matchers}[30s]))"
    assert q["ttft_ms.mean"] == (f"1000 * sum by ({BY}) (increase({ttft}_sum{matchers}[30s]))"
                                 f" / sum by ({BY}) (increase({ttft}_count{matchers}[30s]))")
    assert q["ttft_ms.p90"] == (f"1000 * histogram_quantile(0.9, sum by ({BY},le) "
                                f"(increase({ttft}_bucket{matchers}[30s])))")
    assert q["errors"] == (f"sum by ({BY}) (increase(npuserve:request_success_total"
                           '{namespace=~"ns1|ns2",npuserve_io_inferenceservice=~"a\\\\.b|big|tiny",'
                           'finished_reason="error"}[30s]))')
    assert q["kv_usage_max"] == f"max by ({BY}) (max_over_time(npuserve:kv_cache_usage_perc{matchers}[30s]))"
    assert q["pods_reporting"].startswith(f"count by ({BY}) (avg_over_time(npuserve:num_requests_running")
    assert q["schedule_generation_pods"] == (f"count by ({BY}) (max_over_time(npuserve:schedule_generation"
                                             f"{matchers}[30s]))")
    assert set(q) == set(BUSY)  # every figure a reading has
    one_pod = Selections((Selection("ns1", "tiny", pods=("tiny-0",)), Selection("ns1", "big", pods=("big-1",))))
    assert one_pod.by_pod and one_pod.key(one_pod.members[1]) == ("ns1", "big", "big-1")
    assert 'pod=~"big-1|tiny-0"' in grouped_window_queries(one_pod, 30)["requests_finished"]
    with pytest.raises(ValueError, match="one pod each"):
        Selections((Selection("ns1", "tiny"), Selection("ns1", "big", pods=("big-1",))))


# --- many windows, and a group's queries at once -------------------------------------------------------------------


class GroupedPrometheus:
    """Answers a grouped query with one series per InferenceService in `values` (figure name -> value); records each
    query's time and how many queries came."""

    def __init__(self, values: dict[tuple[str, str], dict[str, str]], down_after: int | None = None) -> None:
        self.values = values
        self.asked: list[tuple[str, str]] = []
        self.down_after = down_after

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if self.down_after is not None and len(self.asked) >= self.down_after:
            raise httpx.ConnectError("Connection refused", request=request)
        params = parse_qs(request.content.decode())
        query, at = params["query"][0], params["time"][0]
        self.asked.append((query, at))
        window_s = int(query.split("[", 1)[1].split("s]", 1)[0])
        result = []
        for (ns, name), figures in self.values.items():
            if f'"{ns}' not in query and f"|{ns}" not in query:
                continue
            names = grouped_window_queries(Selections((Selection(ns, name), Selection(ns, name + "-x"))), window_s)
            figure = next(f for f, q in names.items() if q.split("{")[0] == query.split("{")[0]
                          and q.count("finished_reason") == query.count("finished_reason")
                          and ("abort" in q) == ("abort" in query))
            if figure in figures:
                result.append({"metric": {"namespace": ns, "npuserve_io_inferenceservice": name},
                               "value": [float(at), figures[figure]]})
        return httpx.Response(200, json={"status": "success", "data": {"resultType": "vector", "result": result}})


def test_windows_that_end_together_are_read_with_one_query_per_figure() -> None:
    fake = GroupedPrometheus({("ns1", "a"): BUSY, ("ns2", "b"): BUSY | {"tpot_ms.mean": "80", "errors": "7"}})
    a, b, c = Selection("ns1", "a"), Selection("ns2", "b"), Selection("ns1", "c")  # c: no series at all
    readings = client(fake).read_windows([(a, 1000.0, 1060.0), (b, 1000.0, 1060.0), (c, 1000.0, 1060.0),
                                          (a, 1100.0, 1130.0)])
    figures = len(queries())
    assert len(fake.asked) == 2 * figures  # two groups (the fourth window ends later and is shorter)
    assert {at for _, at in fake.asked} == {"1060.000", "1130.000"}
    first, second, third, fourth = readings
    assert isinstance(first, WindowReading) and isinstance(second, WindowReading)
    assert first.selection == a and second.selection == b and first.missing == {} and second.missing == {}
    assert (first.tpot_ms.mean, second.tpot_ms.mean, first.errors, second.errors) == (40.0, 80.0, 1.0, 7.0)
    assert first.requests_finished == 101.0  # counts rounded (`increase` extrapolates: 101.2)
    assert isinstance(third, WindowReading) and third.trial_metrics() == "requests finished: no series in Prometheus"
    assert isinstance(fourth, WindowReading) and (fourth.window_s, fourth.end) == (30, 1130.0)


def test_once_prometheus_stops_answering_every_window_not_read_is_unreachable() -> None:
    fake = GroupedPrometheus({("ns1", "a"): BUSY}, down_after=len(queries()) + 1)
    a = Selection("ns1", "a")
    readings = client(fake).read_windows([(a, 1000.0, 1060.0), (a, 2000.0, 2060.0), (a, 3000.0, 3060.0)])
    assert isinstance(readings[0], WindowReading) and readings[0].missing == {}
    assert all(isinstance(r, Unreachable) and "Connection refused" in r.error for r in readings[1:])
    assert [at for _, at in fake.asked].count("1060.000") == len(queries())
    assert "3060.000" not in {at for _, at in fake.asked}  # the third window asks nothing


def test_a_groups_queries_run_at_once_with_a_bound() -> None:
    in_flight, peak = 0, 0

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)  # an answer that takes a while: the others are sent meanwhile
        in_flight -= 1
        return httpx.Response(200, json=vector("1"))

    for bound in (MAX_CONCURRENT_QUERIES, 3):
        peak = 0
        readings = client(handler, concurrency=bound).read_windows([(SEL, 1000.0, 1060.0), (SEL, 1100.0, 1160.0)])
        assert peak == bound < len(queries())  # at once, and never more than the bound
        assert all(isinstance(r, WindowReading) and r.missing == {} for r in readings)
        assert [r.end for r in readings if isinstance(r, WindowReading)] == [1060.0, 1160.0]  # in their order
    with pytest.raises(ValueError, match="concurrency"):
        PrometheusClient(URL, concurrency=0)


def test_a_query_not_answered_cancels_the_groups_others() -> None:
    """The group's other queries would wait out the same timeout: they are cancelled, not awaited."""
    failing = queries()["requests_finished"]
    answered: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        query = parse_qs(request.content.decode())["query"][0]
        if query == failing:
            raise httpx.ReadTimeout("timed out", request=request)
        await asyncio.sleep(30)  # a Prometheus that hangs: never reached while the read cancels
        answered.append(query)
        return httpx.Response(200, json=vector("1"))

    readings = client(handler, concurrency=len(queries())).read_windows([(SEL, 1000.0, 1060.0),
                                                                         (SEL, 1100.0, 1160.0)])
    assert all(isinstance(r, Unreachable) and "ReadTimeout" in r.error for r in readings)
    assert answered == []


# --- reading a window ----------------------------------------------------------------------------------------------


class FakePrometheus:
    """Answers each figure's query with the value given for its name (`queries`), as SEL's series, or no series."""

    def __init__(self, values: dict[str, str], window_s: int = 60, selection: Selection = SEL) -> None:
        self.by_query = {q: values.get(name) for name, q in queries(window_s, selection).items()}
        self.times: set[str] = set()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        params = parse_qs(request.content.decode())
        self.times.add(params["time"][0])
        value = self.by_query[params["query"][0]]  # a query outside `queries`: KeyError, the test fails
        return httpx.Response(200, json=vector() if value is None else vector(value))


BUSY = {"ttft_ms.mean": "120", "ttft_ms.p90": "200", "ttft_ms.p99": "300", "ttft_ms.samples": "100.4",
        "tpot_ms.mean": "40", "tpot_ms.p90": "50", "tpot_ms.p99": "60", "tpot_ms.samples": "99.6",
        "e2e_mean_ms": "5000", "output_tokens_per_s": "512.5", "requests_finished": "101.2", "errors": "1.01",
        "aborts": "3", "preemptions": "0", "kv_usage_max": "0.7", "in_flight_sum": "30", "pods_reporting": "2"}
# The schedule-generation gauge: both pods ran generation 7 throughout.
BUSY |= {"schedule_generation_min": "7", "schedule_generation_max": "7", "schedule_generation_pods": "2"}


def read(values: dict[str, str], start: float = 1000.0, end: float = 1060.0) -> WindowReading:
    fake = FakePrometheus(values, window_s=max(1, math.ceil(end - start)))
    reading = read_alone(client(fake), SEL, start, end)
    assert isinstance(reading, WindowReading)
    assert fake.times == {f"{end:.3f}"}  # every query at the window's end
    return reading


def test_a_busy_window_gives_the_tuners_metrics() -> None:
    reading = read(BUSY)
    assert reading.missing == {}
    assert reading.ttft_ms.samples == 100.0 and reading.requests_finished == 101.0  # counts rounded
    assert reading.error_rate == 1 / 101 and reading.in_flight_per_pod == 15.0
    assert reading.trial_metrics() == TrialMetrics(
        outputTokensPerSecond=512.5, ttftMs=LatencyStats(mean=120, p90=200, p99=300),
        tpotMs=LatencyStats(mean=40, p90=50, p99=60), errorRate=1 / 101, samples=100, preemptions=0,
        kvUsageMax=0.7, inFlightPerPod=15.0, e2eMeanMs=5000.0)
    assert reading.trial_metrics(min_requests=200) == "only 101 requests finished in the window (fewer than 200)"


def test_the_schedule_generations_run_are_read_per_pod_over_the_window() -> None:
    q = queries(60)
    gauge = 'npuserve:schedule_generation{namespace=~"ns1",npuserve_io_inferenceservice=~"tiny"}[60s]'
    assert q["schedule_generation_min"] == f"min by ({BY}) (min_over_time({gauge}))"
    assert q["schedule_generation_max"] == f"max by ({BY}) (max_over_time({gauge}))"
    assert q["schedule_generation_pods"] == f"count by ({BY}) (max_over_time({gauge}))"
    reading = read(BUSY | {"schedule_generation_min": "6"})
    assert (reading.schedule_generation_min, reading.schedule_generation_max,
            reading.schedule_generation_pods) == (6.0, 7.0, 2.0)


def test_the_window_is_whole_seconds_from_the_end() -> None:
    reading = read(BUSY, start=1000.2, end=1029.9)
    assert (reading.window_s, reading.start, reading.end) == (30, pytest.approx(999.9), 1029.9)
    assert read(BUSY, start=1000.0, end=1000.0).window_s == 1
    # Prometheus keeps milliseconds: a difference of scrape timestamps in float seconds is not rounded up past them.
    assert read(BUSY, start=1700000000.123, end=1700000030.123).window_s == 30


def test_the_window_reports_kv_usage_and_preemptions_and_the_judge_decides_exhaustion() -> None:
    base = PlanSchedule(cacheBlockSize=128, maxBatchSize=108, maxPrefillBatchSize=54, maxPrefillTokens=10044,
                        prefillTimeMsPerReq=150, decodeTimeMsPerReq=50, maxIterTimes=512, maxPreemptCount=0,
                        supportSelectBatch=True, maxQueueDelayMicroseconds=5000)
    p = TuningProblem(objective="throughput", batch_min=90, batch_max=272, batch_start=108, base=base,
                      mean_input_tokens=186, max_input_tokens=2048)
    for usage, preemptions, failure in (("0.995", "7", "KVCacheExhausted"), ("1", "0", None), ("0.5", "7", None)):
        metrics = read(BUSY | {"kv_usage_max": usage, "preemptions": preemptions}).trial_metrics()
        assert isinstance(metrics, TrialMetrics)
        # Facts only: Prometheus's figures as they came, no finding of its own.
        assert (metrics.kvUsageMax, metrics.preemptions, metrics.kvExhausted) == (float(usage), int(preemptions), False)
        assert p.judge(metrics).failure == failure, (usage, preemptions)


def test_one_token_outputs_have_no_tpot() -> None:
    reading = read(BUSY | {"tpot_ms.samples": "0", "tpot_ms.mean": "NaN", "tpot_ms.p90": "NaN",
                           "tpot_ms.p99": "NaN"})
    assert set(reading.missing) == {"tpot_ms.mean", "tpot_ms.p90", "tpot_ms.p99"}
    metrics = reading.trial_metrics()
    assert isinstance(metrics, TrialMetrics) and metrics.tpotMs == LatencyStats(mean=0, p90=0, p99=0)


def test_an_idle_window_is_inconclusive() -> None:
    idle = {k: "0" for k in BUSY} | {k: "NaN" for k in BUSY if k.endswith(("mean", "p90", "p99", "mean_ms"))}
    reading = read(idle)
    assert reading.error_rate == 0.0
    assert reading.trial_metrics() == "no requests finished in the window"


def test_no_series_is_inconclusive_and_named() -> None:
    reading = read({})
    assert set(reading.missing) == set(queries(60))
    assert all(isinstance(v, Empty) for v in reading.missing.values())
    assert reading.trial_metrics() == "requests finished: no series in Prometheus"
    gap = read(BUSY | {"kv_usage_max": "NaN"}).trial_metrics()
    assert gap == "figures missing: kv_usage_max: NaN (no samples)"


def test_errors_before_any_token_fail_the_trial_not_stall_it() -> None:
    all_errors = BUSY | {"requests_finished": "10", "errors": "10", "output_tokens_per_s": "0"} | {
        f"{p}.{s}": "NaN" for p in ("ttft_ms", "tpot_ms") for s in ("mean", "p90", "p99")} | {
        "ttft_ms.samples": "0", "tpot_ms.samples": "0"}
    metrics = read(all_errors).trial_metrics()
    assert isinstance(metrics, TrialMetrics) and metrics.errorRate == 1.0 and metrics.samples == 0
    aborted = all_errors | {"errors": "0", "aborts": "10"}
    assert read(aborted).trial_metrics() == "10 requests finished, none with a first token (clients went away)"


def test_an_unreachable_prometheus_stops_the_reading() -> None:
    calls = 0

    def down_after_two(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        if calls > 2:
            raise httpx.ConnectError("Connection refused", request=request)
        return httpx.Response(200, json=vector("1"))

    reading = read_alone(client(down_after_two))
    assert isinstance(reading, Unreachable) and "Connection refused" in reading.error


# --- (b) a real Prometheus scraping a real engine ------------------------------------------------------------------

N_REQUESTS, MAX_TOKENS = 20, 8
ENGINE_LABELS = {"namespace": "ns1", "npuserve_io_inferenceservice": "tiny", "pod": "tiny-0"}
TWIN_LABELS = {"namespace": "ns2", "npuserve_io_inferenceservice": "twin", "pod": "twin-0"}


def _wait(what: str, ready: Callable[[], bool], timeout: float, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"{what} exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"{what} not ready after {timeout:.0f} s"
        time.sleep(0.1)


def _prometheus_binary() -> str:
    """$NPUSERVE_PROMETHEUS, else a Prometheus on PATH (Debian's package serves a static scrape config), else the e2e
    harness's `ensure_prometheus()`, which builds the cluster's pinned release on first use."""
    explicit = os.environ.get("NPUSERVE_PROMETHEUS") or shutil.which("prometheus")
    if explicit:
        return explicit
    harness = str(Path(__file__).resolve().parents[2] / "e2e" / "cluster")
    sys.path.insert(0, harness)
    try:
        import localk8s
    finally:
        sys.path.remove(harness)
    ensure = getattr(localk8s, "ensure_prometheus", None)
    assert ensure is not None, "no prometheus: apt-get install prometheus, or set NPUSERVE_PROMETHEUS"
    return str(ensure())


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class Stack:
    engine: str
    prometheus: subprocess.Popen[bytes]
    client: PrometheusClient


@pytest.fixture
def stack(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Stack]:
    engine_port, prom_port = free_port(), free_port()
    engine_url = f"http://127.0.0.1:{engine_port}"
    engine = subprocess.Popen([str(Path(sys.executable).parent / "npuserve"), "serve", "--model", str(tiny_model_dir),
                               "--host", "127.0.0.1", "--port", str(engine_port)],
                              stdout=(tmp_path / "engine.log").open("wb"), stderr=subprocess.STDOUT)
    config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
              "scrape_configs": [{"job_name": "npuserve-engine",
                                  "static_configs": [{"targets": [f"127.0.0.1:{engine_port}"],
                                                      "labels": ENGINE_LABELS}]},
                                 # The same engine as a second InferenceService: a grouped read keeps them apart.
                                 {"job_name": "npuserve-engine-twin",
                                  "static_configs": [{"targets": [f"127.0.0.1:{engine_port}"],
                                                      "labels": TWIN_LABELS}]}]}
    (tmp_path / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    prometheus = subprocess.Popen([_prometheus_binary(), f"--config.file={tmp_path / 'prometheus.yml'}",
                                   f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                   f"--web.listen-address=127.0.0.1:{prom_port}"],
                                  stdout=(tmp_path / "prometheus.log").open("wb"), stderr=subprocess.STDOUT)
    prom = PrometheusClient(f"http://127.0.0.1:{prom_port}")
    try:
        def engine_ready() -> bool:
            try:
                return httpx.get(f"{engine_url}/ready", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        _wait("the engine", engine_ready, 90, engine)
        _wait("prometheus", prom.ready, 30, prometheus)
        yield Stack(engine_url, prometheus, prom)
    finally:
        _stop(prometheus)
        _stop(engine)


def _latest_scrape(prom: PrometheusClient, matchers: str) -> float | None:
    """The timestamp of the last scrape of the engine's series `matchers` selects, or None."""
    series = contract.METRIC_TIME_TO_FIRST_TOKEN.count_series
    answer = httpx.post(f"{prom.url}/api/v1/query", data={"query": f"max(timestamp({series}{matchers}))"}, timeout=5)
    result = answer.json()["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def _wait_for_scrapes(prom: PrometheusClient, after: float, count: int, labels: dict[str, str] = ENGINE_LABELS,
                      ) -> float:
    """Waits until Prometheus holds `count` scrapes of the engine under `labels` taken after `after`; the last one's
    timestamp."""
    matchers = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
    deadline = time.monotonic() + 30
    seen: set[float] = set()
    while True:
        at = _latest_scrape(prom, matchers)
        if at is not None and at > after:
            seen.add(at)
            if len(seen) >= count:
                return max(seen)
        assert time.monotonic() < deadline, f"Prometheus is not scraping the engine ({at})"
        time.sleep(0.2)


@pytest.mark.timeout(600)  # a cold machine builds Prometheus first (about 4 minutes on 2 cores)
def test_a_real_prometheus_reads_a_real_engine(stack: Stack) -> None:
    prom = stack.client
    # `increase` extrapolates to a window's edges, unless a sample sits on the edge or the counter's first sample
    # is 0. The window opens a second before a scrape taken before the load: the samples at the start are 0 (also
    # when the range is open on the left, as from Prometheus 3).
    start = _wait_for_scrapes(prom, after=0.0, count=1) - 1.0
    # The twin is scraped on its own schedule: once it is, it has a sample before the load in the window too.
    _wait_for_scrapes(prom, after=0.0, count=1, labels=TWIN_LABELS)
    with httpx.Client(base_url=stack.engine, timeout=60) as http:
        for i in range(N_REQUESTS):
            answer = http.post("/v1/completions", json={"prompt": f"request {i}", "max_tokens": MAX_TOKENS,
                                                         "ignore_eos": True, "temperature": 0})
            assert answer.status_code == 200, answer.text
        own = {s.name: s.value for f in text_string_to_metric_families(http.get("/metrics").text)
               for s in f.samples}
    loaded = time.time()
    # It closes on the second scrape after the load: it ends on a sample, so no extrapolation at the end either.
    # The twin scraped after the load before that (else its window saw no requests: NaN means, a flaky comparison).
    twin_loaded = _wait_for_scrapes(prom, after=loaded, count=1, labels=TWIN_LABELS)
    end = _wait_for_scrapes(prom, after=twin_loaded, count=2)

    reading = read_alone(prom, SEL, start, end)
    assert isinstance(reading, WindowReading), reading
    assert reading.missing == {}, reading.missing
    assert reading.ttft_ms.samples == N_REQUESTS and reading.tpot_ms.samples == N_REQUESTS
    assert reading.requests_finished == N_REQUESTS and reading.errors == 0 and reading.aborts == 0
    assert isinstance(reading.output_tokens_per_s, float)
    assert reading.output_tokens_per_s * reading.window_s == pytest.approx(N_REQUESTS * MAX_TOKENS, rel=1e-6)
    ttft = contract.METRIC_TIME_TO_FIRST_TOKEN
    engine_mean_ms = 1000 * own[ttft.sum_series] / own[ttft.count_series]
    assert reading.ttft_ms.mean == pytest.approx(engine_mean_ms, rel=0.01)
    assert reading.pods_reporting == 1 and reading.error_rate == 0.0
    assert isinstance(reading.kv_usage_max, float) and 0 <= reading.kv_usage_max < 0.99
    metrics = reading.trial_metrics(min_requests=N_REQUESTS)
    assert isinstance(metrics, TrialMetrics), metrics
    assert metrics.samples == N_REQUESTS and metrics.errorRate == 0 and not metrics.kvExhausted
    assert metrics.ttftMs.p90 <= metrics.ttftMs.p99 and metrics.tpotMs.mean > 0

    # A window that ends between scrapes: `increase` extrapolates the slope it sampled to the window's edge, and
    # counts more requests than came (the flat tail after the load does not stop it).
    later = read_alone(prom, SEL, start, end + 0.5)
    assert isinstance(later, WindowReading) and isinstance(later.output_tokens_per_s, float)
    assert later.output_tokens_per_s * later.window_s > N_REQUESTS * MAX_TOKENS

    one_pod = read_alone(prom, Selection(namespace="ns1", inference_service="tiny", pods=("tiny-0",)), start, end)
    assert isinstance(one_pod, WindowReading) and one_pod.ttft_ms.samples == N_REQUESTS
    for elsewhere in (Selection(namespace="ns2", inference_service="tiny"),
                      Selection(namespace="ns1", inference_service="tiny", pods=("tiny-1",))):
        empty = read_alone(prom, elsewhere, start, end)
        assert isinstance(empty, WindowReading) and set(empty.missing) == set(queries(1, elsewhere))
        assert empty.trial_metrics() == "requests finished: no series in Prometheus"

    # Read together, with one query per figure grouped by InferenceService: each reading is what it is alone.
    twin = Selection(namespace="ns2", inference_service="twin")
    nowhere = Selection(namespace="ns2", inference_service="tiny")  # a name and a namespace that do not go together
    together = prom.read_windows([(SEL, start, end), (twin, start, end), (nowhere, start, end),
                                  (Selection("ns1", "tiny", pods=("tiny-0",)), start, end),
                                  (Selection("ns2", "twin", pods=("twin-0",)), start, end)])
    assert all(isinstance(r, WindowReading) for r in together), together
    assert together[0] == reading
    assert together[0].figures() == read_alone(prom, SEL, start, end).figures()  # not a cached object
    alone = read_alone(prom, twin, start, end)
    assert isinstance(alone, WindowReading) and together[1].figures() == alone.figures()
    assert isinstance(together[1], WindowReading) and together[1].requests_finished == alone.requests_finished > 0
    assert isinstance(together[2], WindowReading) and set(together[2].missing) == set(queries(1))
    assert isinstance(together[3], WindowReading) and together[3].figures() == one_pod.figures()
    assert isinstance(together[4], WindowReading) and together[4].figures() == alone.figures()

    _stop(stack.prometheus)
    gone = read_alone(prom, SEL, start, end)
    assert isinstance(gone, Unreachable) and gone.url == prom.url
    assert not prom.ready()
