"""PromQL over HTTP: the engine metrics of InferenceServices over time windows
(docs/operator.md#what-the-operator-reads-from-prometheus).

The tuner judges a trial from what Prometheus scraped of the engines while the trial's schedule ran. This module
reads that window and turns it into the tuner's `TrialMetrics`, or says why the window cannot be judged. It reports
facts (KV usage, preemptions) and judges nothing: whether the KV cache ran out is the judge's (`problem.py`).

- Series are selected by `namespace` and `npuserve_io_inferenceservice`: the pod label `npuserve.io/inferenceservice`
  as the PodMonitors' `podTargetLabels` copy it (the chart's monitor and `render.render_podmonitor`), optionally
  narrowed to some pods (benchmark mode measures one).
- Every query runs at the window's end over the whole window (`[Ns]`, whole seconds) and aggregates to one series
  per InferenceService: the windows that end together are read with one query per figure for them all.
- Nothing here raises on a bad Prometheus: a query answers a number, `Empty` (no series), `NotANumber` (NaN or Inf,
  e.g. a mean over no requests) or `Unreachable`. A query that answers two series for one InferenceService, or no
  vector, is a bug here, and raises.

The metric names come from the engine contract (`npuserve.engine_contract`); the operator never imports the engine.
The client's methods are synchronous, each with its own event loop: the operator calls them from a worker thread.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import httpx

from npuserve import engine_contract as contract
from npuserve.engine_contract import EngineMetric
from npuserve.operator.names import INSTANCE_LABEL
from npuserve.planning.api import LatencyStats, TrialMetrics

QUERY_PATH = "/api/v1/query"
READY_PATH = "/-/ready"
# Queries in flight at once: a group's 20 figures in three rounds, well inside Prometheus's default
# --query.max-concurrency of 20, which its other clients (rules, dashboards) share.
MAX_CONCURRENT_QUERIES = 8


# --- outcomes ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Unreachable:
    """Prometheus did not answer a query: refused, timed out, a 5xx, a body that is not its JSON, or an error."""

    url: str
    error: str


@dataclass(frozen=True, slots=True)
class Empty:
    """The query matched no series (nothing scraped there, or fewer than two samples for an `increase`)."""

    query: str


@dataclass(frozen=True, slots=True)
class NotANumber:
    """The query answered NaN or +-Inf: typically a ratio over no requests (0/0)."""

    query: str
    value: str = "NaN"


Figure = float | Empty | NotANumber


def describe(figure: Figure | Unreachable) -> str:
    if isinstance(figure, Empty):
        return "no series in Prometheus"
    if isinstance(figure, NotANumber):
        return f"{figure.value} (no samples)"
    if isinstance(figure, Unreachable):
        return f"Prometheus at {figure.url} unreachable: {figure.error}"
    return f"{figure:g}"


# --- selecting an InferenceService's series ------------------------------------------------------------------------


def prometheus_label_name(k8s_label: str) -> str:
    """A Kubernetes label key as a Prometheus label name, as the Prometheus Operator copies `podTargetLabels`:
    every character outside [a-zA-Z0-9_] becomes `_` (`npuserve.io/inferenceservice` ->
    `npuserve_io_inferenceservice`)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", k8s_label)


INSTANCE_PROM_LABEL = prometheus_label_name(INSTANCE_LABEL)


def promql_string(value: str) -> str:
    """A PromQL double-quoted string literal."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def regex_quote(value: str) -> str:
    """`value` matched literally in a RE2 regex (Go's regexp.QuoteMeta: the same characters)."""
    return re.sub(r"([\\.+*?()|\[\]{}^$])", r"\\\1", value)


@dataclass(frozen=True, slots=True)
class Selection:
    """The series of one InferenceService; `pods` narrows them to those pods (benchmark mode measures one)."""

    namespace: str
    inference_service: str
    pods: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.pods is not None:
            if isinstance(self.pods, str) or not self.pods:
                raise ValueError("pods: give a sequence of at least one pod name, or None for every pod")
            object.__setattr__(self, "pods", tuple(self.pods))  # a list given stays hashable and unshared


# --- the queries of one window -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Selections:
    """Several InferenceServices' series, read with one query per figure for all of them, grouped by namespace and
    InferenceService (and by pod where each is narrowed to one pod: benchmark mode measures one). The matchers select
    a superset (every namespace by every name); the grouping keeps each InferenceService's own series apart."""

    members: tuple[Selection, ...]

    def __post_init__(self) -> None:
        if not self.members:
            raise ValueError("members: give at least one selection")
        shapes = {None if s.pods is None else len(s.pods) for s in self.members}
        if shapes not in ({None}, {1}) and len(self.members) > 1:
            raise ValueError("members: all read every pod, or all one pod each (a selection of several pods is "
                             "read alone)")

    @property
    def by_pod(self) -> bool:
        return self.members[0].pods is not None and len(self.members) > 1

    @property
    def labels(self) -> tuple[str, ...]:
        """The grouping labels, in the order `key` gives their values."""
        return ("namespace", INSTANCE_PROM_LABEL, "pod") if self.by_pod else ("namespace", INSTANCE_PROM_LABEL)

    def key(self, selection: Selection) -> tuple[str, ...]:
        base = (selection.namespace, selection.inference_service)
        return (*base, selection.pods[0]) if self.by_pod and selection.pods else base

    def matchers(self, **extra: str) -> str:
        def one_of(values: set[str]) -> str:
            return promql_string("|".join(regex_quote(v) for v in sorted(values)))

        parts = [f"namespace=~{one_of({s.namespace for s in self.members})}",
                 f"{INSTANCE_PROM_LABEL}=~{one_of({s.inference_service for s in self.members})}"]
        pods = {p for s in self.members for p in s.pods or ()}
        if pods:
            parts.append(f"pod=~{one_of(pods)}")
        parts.extend(f"{k}={promql_string(v)}" for k, v in extra.items())
        return "{" + ",".join(parts) + "}"


def grouped_window_queries(selections: Selections, window_s: int) -> dict[str, str]:
    """The PromQL of every figure of a reading, by figure name, for every member of `selections` at once: each runs
    at the window's end and answers one series per member (none for a member without series), labelled with
    `selections.labels`."""
    matchers, by = selections.matchers, ",".join(selections.labels)
    sel = matchers()
    rng = f"[{window_s}s]"

    def agg(op: str, expr: str) -> str:
        return f"{op} by ({by}) ({expr})"

    def increase(series: str, matchers: str = sel) -> str:
        return agg("sum", f"increase({series}{matchers}{rng})")

    def mean_ms(m: EngineMetric) -> str:
        return f"1000 * {increase(m.sum_series)} / {increase(m.count_series)}"

    def quantile_ms(m: EngineMetric, q: float) -> str:
        return f"1000 * histogram_quantile({q}, sum by ({by},le) (increase({m.bucket}{sel}{rng})))"

    queries: dict[str, str] = {}
    for prefix, m in (("ttft_ms", contract.METRIC_TIME_TO_FIRST_TOKEN),
                      ("tpot_ms", contract.METRIC_TIME_PER_OUTPUT_TOKEN)):
        queries[f"{prefix}.mean"] = mean_ms(m)
        queries[f"{prefix}.p90"] = quantile_ms(m, 0.9)
        queries[f"{prefix}.p99"] = quantile_ms(m, 0.99)
        queries[f"{prefix}.samples"] = increase(m.count_series)
    success = contract.METRIC_REQUEST_SUCCESS.series
    reason = contract.METRIC_LABEL_FINISHED_REASON
    # Per pod, then summed: running + waiting match on every label (both gauges carry the same ones).
    in_flight = (f"avg_over_time({contract.METRIC_NUM_REQUESTS_RUNNING.series}{sel}{rng})"
                 f" + avg_over_time({contract.METRIC_NUM_REQUESTS_WAITING.series}{sel}{rng})")
    queries |= {
        "e2e_mean_ms": mean_ms(contract.METRIC_E2E_REQUEST_LATENCY),
        "output_tokens_per_s": f"{increase(contract.METRIC_GENERATION_TOKENS.series)} / {window_s}",
        "requests_finished": increase(success),
        "errors": increase(success, matchers(**{reason: contract.FINISHED_REASON_ERROR})),
        "aborts": increase(success, matchers(**{reason: contract.FINISHED_REASON_ABORT})),
        "preemptions": increase(contract.METRIC_NUM_PREEMPTIONS.series),
        "kv_usage_max": agg("max", f"max_over_time({contract.METRIC_KV_CACHE_USAGE_PERC.series}{sel}{rng})"),
        "in_flight_sum": agg("sum", in_flight),
        "pods_reporting": agg("count", in_flight),
    }
    # The schedule generation each pod ran: its lowest and highest sample in the window, over every pod, and how
    # many pods reported one (a pod without the gauge ran something unknown).
    generation = f"{contract.METRIC_SCHEDULE_GENERATION.series}{sel}{rng}"
    queries |= {
        "schedule_generation_min": agg("min", f"min_over_time({generation})"),
        "schedule_generation_max": agg("max", f"max_over_time({generation})"),
        "schedule_generation_pods": agg("count", f"max_over_time({generation})"),
    }
    return queries


# Request counts: `increase` extrapolates to the window's edges, so it answers 20.4 for 20 requests.
_COUNTS = frozenset({"ttft_ms.samples", "tpot_ms.samples", "requests_finished", "errors", "aborts", "preemptions"})


# --- a window's reading --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LatencyReading:
    """One latency histogram over the window, in milliseconds; `samples` is the requests it observed."""

    mean: Figure
    p90: Figure
    p99: Figure
    samples: Figure


@dataclass(frozen=True, slots=True)
class WindowReading:
    """What Prometheus holds of one InferenceService over `[start, end]`; each figure is a value or why it is not."""

    selection: Selection
    start: float  # end - window_s
    end: float
    window_s: int
    ttft_ms: LatencyReading
    tpot_ms: LatencyReading
    e2e_mean_ms: Figure
    output_tokens_per_s: Figure
    requests_finished: Figure  # every finished_reason
    errors: Figure  # finished_reason="error"
    aborts: Figure  # finished_reason="abort": clients that went away, not errors
    preemptions: Figure
    kv_usage_max: Figure  # 0-1, the highest any pod reached
    in_flight_sum: Figure  # mean requests running + waiting per pod over the window, summed over pods
    pods_reporting: Figure  # pods with in-flight gauges in the window
    # The schedule generation gauge: lowest and highest sample over every pod, and the pods reporting one.
    schedule_generation_min: Figure = Empty("schedule_generation_min")
    schedule_generation_max: Figure = Empty("schedule_generation_max")
    schedule_generation_pods: Figure = Empty("schedule_generation_pods")

    @classmethod
    def from_figures(cls, selection: Selection, end: float, window_s: int, figures: dict[str, Figure]) -> WindowReading:
        """A reading from the figures of `grouped_window_queries`, by name."""

        def latency(prefix: str) -> LatencyReading:
            return LatencyReading(mean=figures[f"{prefix}.mean"], p90=figures[f"{prefix}.p90"],
                                  p99=figures[f"{prefix}.p99"], samples=figures[f"{prefix}.samples"])

        f = figures
        return cls(selection=selection, start=end - window_s, end=end, window_s=window_s,
                   ttft_ms=latency("ttft_ms"), tpot_ms=latency("tpot_ms"), e2e_mean_ms=f["e2e_mean_ms"],
                   output_tokens_per_s=f["output_tokens_per_s"], requests_finished=f["requests_finished"],
                   errors=f["errors"], aborts=f["aborts"], preemptions=f["preemptions"],
                   kv_usage_max=f["kv_usage_max"], in_flight_sum=f["in_flight_sum"],
                   pods_reporting=f["pods_reporting"], schedule_generation_min=f["schedule_generation_min"],
                   schedule_generation_max=f["schedule_generation_max"],
                   schedule_generation_pods=f["schedule_generation_pods"])

    def figures(self) -> dict[str, Figure]:
        """Every figure by name (`ttft_ms.p90`, `errors`, ...), the names of `grouped_window_queries`."""
        out: dict[str, Figure] = {}
        for f in fields(self):
            value: Any = getattr(self, f.name)
            if isinstance(value, LatencyReading):
                out |= {f"{f.name}.{g.name}": getattr(value, g.name) for g in fields(LatencyReading)}
            elif f.name not in ("selection", "start", "end", "window_s"):
                out[f.name] = value
        return out

    @property
    def missing(self) -> dict[str, Empty | NotANumber]:
        """The figures without a value, and why."""
        return {k: v for k, v in self.figures().items() if not isinstance(v, float)}

    @property
    def error_rate(self) -> Figure:
        """errors / finished requests; 0 when none finished."""
        if not isinstance(self.requests_finished, float):
            return self.requests_finished
        if not isinstance(self.errors, float):
            return self.errors
        return min(1.0, self.errors / self.requests_finished) if self.requests_finished > 0 else 0.0

    @property
    def in_flight_per_pod(self) -> Figure:
        """Mean requests in flight per pod: the per-instance concurrency the window ran at."""
        if not isinstance(self.in_flight_sum, float):
            return self.in_flight_sum
        if not isinstance(self.pods_reporting, float):
            return self.pods_reporting
        return self.in_flight_sum / self.pods_reporting if self.pods_reporting > 0 else 0.0

    def trial_metrics(self, min_requests: int = 1) -> TrialMetrics | str:
        """The tuner's measurement of this window, or why the window is inconclusive (too few requests finished, a
        figure missing). `samples` is TTFT's sample count; TPOT is 0 when every output was one token."""
        finished = self.requests_finished
        if not isinstance(finished, float):
            return f"requests finished: {describe(finished)}"
        if finished < min_requests:
            return ("no requests finished in the window" if finished == 0 else
                    f"only {finished:.0f} requests finished in the window (fewer than {min_requests})")
        ttft, tpot = self.ttft_ms, self.tpot_ms
        needed = {"output_tokens_per_s": self.output_tokens_per_s, "errors": self.errors,
                  "preemptions": self.preemptions, "kv_usage_max": self.kv_usage_max,
                  "ttft_ms.samples": ttft.samples, "tpot_ms.samples": tpot.samples}
        # A latency has statistics only when it has samples: TTFT when some request produced a token, TPOT when
        # some produced two. Without them its mean and quantiles are NaN, and 0 below stands in.
        for prefix, reading in (("ttft_ms", ttft), ("tpot_ms", tpot)):
            if isinstance(reading.samples, float) and reading.samples > 0:
                needed |= {f"{prefix}.mean": reading.mean, f"{prefix}.p90": reading.p90,
                           f"{prefix}.p99": reading.p99}
        gaps = [f"{k}: {describe(v)}" for k, v in needed.items() if not isinstance(v, float)]
        if gaps:
            return "figures missing: " + "; ".join(gaps)
        v = {k: x for k, x in needed.items() if isinstance(x, float)}
        if v["ttft_ms.samples"] == 0 and v["errors"] == 0:
            # Every request was aborted before its first token: nothing measured, and nothing failed either.
            return f"{finished:.0f} requests finished, none with a first token (clients went away)"

        def stats(prefix: str) -> LatencyStats:
            if v[f"{prefix}.samples"] == 0:
                return LatencyStats(mean=0.0, p90=0.0, p99=0.0)
            return LatencyStats(mean=v[f"{prefix}.mean"], p90=v[f"{prefix}.p90"], p99=v[f"{prefix}.p99"])

        per_pod = self.in_flight_per_pod
        return TrialMetrics(
            outputTokensPerSecond=v["output_tokens_per_s"],
            ttftMs=stats("ttft_ms"),
            tpotMs=stats("tpot_ms"),
            errorRate=min(1.0, v["errors"] / finished),
            samples=round(v["ttft_ms.samples"]),
            preemptions=round(v["preemptions"]),
            kvUsageMax=v["kv_usage_max"],
            inFlightPerPod=per_pod if isinstance(per_pod, float) else None,
            e2eMeanMs=self.e2e_mean_ms if isinstance(self.e2e_mean_ms, float) else None,
        )


# --- the client ----------------------------------------------------------------------------------------------------


class PrometheusClient:
    """Instant queries against Prometheus's HTTP API (`POST /api/v1/query`, form-encoded: a query over many
    InferenceServices is longer than a URL may be). Each query is bounded by `timeout`, on the wire and on
    Prometheus's side (its `timeout` parameter); at most `concurrency` are in flight at once. Each call runs its own
    event loop: call it from a worker thread, not from an event loop.

    `transport` replaces the network (tests pass an `httpx.MockTransport`)."""

    def __init__(self, url: str, timeout: float = 5.0, transport: httpx.AsyncBaseTransport | None = None,
                 concurrency: int = MAX_CONCURRENT_QUERIES) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency {concurrency}: want >= 1")
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.concurrency = concurrency
        self._transport = transport

    def _http(self) -> httpx.AsyncClient:
        # One per call: an AsyncClient's connections belong to the event loop that opened them.
        return httpx.AsyncClient(base_url=self.url, timeout=self.timeout, transport=self._transport)

    def ready(self) -> bool:
        """Whether Prometheus answers and is ready to serve queries (`/-/ready`)."""

        async def ask() -> bool:
            async with self._http() as http:
                try:
                    return (await http.get(READY_PATH)).status_code == 200
                except httpx.HTTPError:
                    return False

        return asyncio.run(ask())

    def read_windows(self, windows: Sequence[tuple[Selection, float, float]]) -> list[WindowReading | Unreachable]:
        """The readings of many windows (selection, start, end), in their order. Each query runs at `end` over
        `ceil(end - start)` seconds (at least 1), one query per figure for every window that ends at the same time and
        is as long (`grouped_window_queries`): the autotune loop aligns window ends to a grid so that they do. A
        selection of several pods is read alone. A group's queries run at once (at most `concurrency`); once
        Prometheus does not answer one, the group's others are cancelled and every window not read yet is
        Unreachable with that answer."""
        return asyncio.run(self._read_windows(windows))

    async def _read_windows(self, windows: Sequence[tuple[Selection, float, float]],
                            ) -> list[WindowReading | Unreachable]:
        groups: dict[tuple[int, int, object], list[int]] = {}
        for i, (selection, start, end) in enumerate(windows):
            shape: object = None if selection.pods is None else (1 if len(selection.pods) == 1 else i)
            groups.setdefault((_window_seconds(start, end), round(end * 1000), shape), []).append(i)
        out: list[WindowReading | Unreachable | None] = [None] * len(windows)
        down: Unreachable | None = None
        async with self._http() as http:
            gate = asyncio.Semaphore(self.concurrency)
            for (window_s, _, _), members in groups.items():
                end = windows[members[0]][2]
                selections = Selections(tuple(dict.fromkeys(windows[i][0] for i in members)))
                queries = grouped_window_queries(selections, window_s)
                answers = down or await self._read_group(http, gate, queries, end, selections.labels)
                if isinstance(answers, Unreachable):
                    down = answers
                    for i in members:
                        out[i] = down
                    continue
                for i in members:
                    selection = windows[i][0]
                    key = selections.key(selection)
                    figures: dict[str, Figure] = {
                        name: _count(name, answers[name][key]) if key in answers[name] else Empty(promql)
                        for name, promql in queries.items()}
                    out[i] = WindowReading.from_figures(selection, end, window_s, figures)
        return [r for r in out if r is not None]

    async def _read_group(self, http: httpx.AsyncClient, gate: asyncio.Semaphore, queries: dict[str, str],
                          at: float, labels: tuple[str, ...],
                          ) -> dict[str, dict[tuple[str, ...], float | NotANumber]] | Unreachable:
        """Every query of one group at once, by figure name; the first that Prometheus does not answer, instead."""

        async def one(name: str, promql: str) -> tuple[str, dict[tuple[str, ...], float | NotANumber] | Unreachable]:
            async with gate:
                return name, await self._query_by(http, promql, at, labels)

        tasks = [asyncio.create_task(one(name, promql)) for name, promql in queries.items()]
        answers: dict[str, dict[tuple[str, ...], float | NotANumber]] = {}
        try:
            for finished in asyncio.as_completed(tasks):
                name, answer = await finished  # a bug in a query (ValueError) raises here
                if isinstance(answer, Unreachable):
                    return answer  # the rest would wait out the same timeout: cancelled below
                answers[name] = answer
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return answers

    async def _ask(self, http: httpx.AsyncClient, promql: str, at: float,
                   ) -> list[tuple[dict[str, str], str]] | Unreachable:
        """The answer's series (labels, value as Prometheus wrote it)."""
        try:
            response = await http.post(QUERY_PATH, data={"query": promql, "time": f"{at:.3f}",
                                                         "timeout": f"{self.timeout:g}s"})
        except httpx.HTTPError as e:
            return Unreachable(self.url, f"{type(e).__name__}: {e}".rstrip(": "))
        answered = f"HTTP {response.status_code}"
        try:
            body = response.json()
        except ValueError:
            return Unreachable(self.url, f"{answered}, not JSON: {response.text[:200]!r}")
        if not isinstance(body, dict) or body.get("status") != "success":
            # Prometheus answers its errors as JSON (400 bad_data, 422 execution, 503 timeout); a proxy may not.
            if isinstance(body, dict) and "error" in body:
                return Unreachable(self.url, f"{answered}, {body.get('errorType', 'error')}: {body['error']}")
            return Unreachable(self.url, f"{answered}, not a Prometheus answer: {response.text[:200]!r}")
        try:
            result_type, result = body["data"]["resultType"], body["data"]["result"]
            if result_type == "vector":
                return [(dict(r.get("metric", {})), str(r["value"][1])) for r in result]
        except (KeyError, IndexError, TypeError, AttributeError) as e:
            return Unreachable(self.url, f"{answered}, malformed answer ({type(e).__name__}: {e})")
        # Every query here is a `... by (labels)` aggregation, which answers a vector.
        raise ValueError(f"query answered a {result_type}, not a vector: {promql}")

    def _number(self, text: str, promql: str) -> float | NotANumber | Unreachable:
        try:
            value = float(text)  # Prometheus writes "NaN", "+Inf", "-Inf" for the non-finite
        except ValueError:
            return Unreachable(self.url, f"a value that is not a number: {text!r}")
        if not math.isfinite(value):
            return NotANumber(promql, text)
        return value

    async def _query_by(self, http: httpx.AsyncClient, promql: str, at: float, labels: tuple[str, ...],
                        ) -> dict[tuple[str, ...], float | NotANumber] | Unreachable:
        """One instant query at unix time `at` that answers a series per value of `labels`: each series' number by
        those values. Two series with the same values are a bug in the query, and raise ValueError."""
        answer = await self._ask(http, promql, at)
        if isinstance(answer, Unreachable):
            return answer
        out: dict[tuple[str, ...], float | NotANumber] = {}
        for metric, text in answer:
            key = tuple(metric.get(label, "") for label in labels)
            if key in out:
                raise ValueError(f"query answered two series for {dict(zip(labels, key, strict=True))}: {promql}")
            number = self._number(text, promql)
            if isinstance(number, Unreachable):
                return number
            out[key] = number
        return out


def _window_seconds(start: float, end: float) -> int:
    # Rounded to Prometheus's milliseconds first: two scrape timestamps 30 s apart differ by 30.000000000x here.
    return max(1, math.ceil(round(end - start, 3)))


def _count(name: str, figure: Figure) -> Figure:
    """A request count as a whole number (`increase` extrapolates: 20.4 for 20 requests); other figures as they are."""
    return float(round(figure)) if name in _COUNTS and isinstance(figure, float) else figure
