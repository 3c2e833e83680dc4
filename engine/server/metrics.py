"""Prometheus metrics of the engine (docs/engine.md#metrics): vLLM's names with the `npuserve:` prefix and vLLM's
buckets.

The names live in the engine contract (`npuserve.engine_contract`, "Prometheus metric names"), which the operator's
Prometheus client and the Helm chart's dashboard read too. Each engine owns a registry, so several engines in one
process (tests) do not collide.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from npuserve import engine_contract as contract
from npuserve.engine_contract import EngineMetric

# vLLM v1's bucket boundaries (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@dataclass(frozen=True, slots=True)
class FinishedRequestSample:
    """One finished request's figures, in seconds and tokens."""

    finish_reason: str
    prompt_tokens: int
    generation_tokens: int
    queue_time: float
    prefill_time: float  # first scheduled -> first token
    decode_time: float  # first token -> last token
    e2e_latency: float  # arrival -> last token
    time_to_first_token: float | None  # None when no token was produced

    @property
    def time_per_output_token(self) -> float | None:
        if self.generation_tokens < 2:
            return None
        return self.decode_time / (self.generation_tokens - 1)


class EngineMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        labels = [contract.METRIC_LABEL_MODEL]
        r = self.registry

        def hist(metric: EngineMetric, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(metric.name, doc, labels, buckets=buckets, registry=r)

        def gauge(metric: EngineMetric, doc: str) -> Gauge:
            return Gauge(metric.name, doc, labels, registry=r)

        def counter(metric: EngineMetric, doc: str, extra_labels: tuple[str, ...] = ()) -> Counter:
            # Registered under the base name; prometheus_client exports `<name>_total` (EngineMetric.series).
            return Counter(metric.name, doc, [*labels, *extra_labels], registry=r)

        self.time_to_first_token = hist(contract.METRIC_TIME_TO_FIRST_TOKEN, "Time to first token.", TTFT_BUCKETS)
        self.time_per_output_token = hist(contract.METRIC_TIME_PER_OUTPUT_TOKEN,
                                          "Mean time per output token of a request, after the first.", TPOT_BUCKETS)
        self.inter_token_latency = hist(contract.METRIC_INTER_TOKEN_LATENCY, "Gap between consecutive tokens.",
                                        TPOT_BUCKETS)
        self.e2e_request_latency = hist(contract.METRIC_E2E_REQUEST_LATENCY, "End-to-end request latency.",
                                        REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = hist(contract.METRIC_REQUEST_QUEUE_TIME, "Time waiting before the first schedule.",
                                       REQUEST_LATENCY_BUCKETS)
        self.request_prefill_time = hist(contract.METRIC_REQUEST_PREFILL_TIME, "First schedule to first token.",
                                         REQUEST_LATENCY_BUCKETS)
        self.request_decode_time = hist(contract.METRIC_REQUEST_DECODE_TIME, "First token to last token.",
                                        REQUEST_LATENCY_BUCKETS)
        self.prefill_batch_size = hist(contract.METRIC_PREFILL_BATCH_SIZE, "Requests per prefill step.",
                                       BATCH_SIZE_BUCKETS)
        self.decode_batch_size = hist(contract.METRIC_DECODE_BATCH_SIZE, "Requests per decode step.",
                                      BATCH_SIZE_BUCKETS)

        self.num_requests_running = gauge(contract.METRIC_NUM_REQUESTS_RUNNING, "Requests in the running batch.")
        self.num_requests_waiting = gauge(contract.METRIC_NUM_REQUESTS_WAITING, "Requests waiting for prefill.")
        self.num_requests_swapped = gauge(contract.METRIC_NUM_REQUESTS_SWAPPED, "Requests swapped to host memory.")
        self.kv_cache_usage_perc = gauge(contract.METRIC_KV_CACHE_USAGE_PERC,
                                         "Fraction of device KV blocks in use (0-1).")
        self.kv_cache_blocks_total = gauge(contract.METRIC_KV_CACHE_BLOCKS_TOTAL, "Device KV blocks allocated.")
        self.schedule_generation = gauge(contract.METRIC_SCHEDULE_GENERATION,
                                         "Generation of the schedule the scheduler runs (-1: none).")
        self.batch_size_cap = gauge(contract.METRIC_BATCH_SIZE_CAP,
                                    "Running batch cap in force: maxBatchSize, or the TPOT controller's cap "
                                    "(dynamicBatchSizeEnable).")

        self.prompt_tokens = counter(contract.METRIC_PROMPT_TOKENS, "Prompt tokens processed.")
        self.generation_tokens = counter(contract.METRIC_GENERATION_TOKENS, "Tokens generated.")
        self.num_preemptions = counter(contract.METRIC_NUM_PREEMPTIONS, "Requests preempted (swap or recompute).")
        self.request_success = counter(contract.METRIC_REQUEST_SUCCESS, "Requests finished, by reason.",
                                       (contract.METRIC_LABEL_FINISHED_REASON,))
        # Export zeros from the start, so rate() and histogram_quantile() work before the first request.
        for metric in (self.time_to_first_token, self.time_per_output_token, self.inter_token_latency,
                       self.e2e_request_latency, self.request_queue_time, self.request_prefill_time,
                       self.request_decode_time, self.prefill_batch_size, self.decode_batch_size,
                       self.num_requests_running, self.num_requests_waiting, self.num_requests_swapped,
                       self.kv_cache_usage_perc, self.kv_cache_blocks_total, self.prompt_tokens,
                       self.generation_tokens, self.num_preemptions, self.batch_size_cap):
            metric.labels(model_name)
        for reason in contract.FINISHED_REASONS:
            self.request_success.labels(model_name, reason)
        self.set_schedule_generation(None)

    # --- recording ---------------------------------------------------------------------------------------------

    def observe_step(self, kind: str, batch_size: int, preemptions: int = 0) -> None:
        target = self.prefill_batch_size if kind == "prefill" else self.decode_batch_size
        target.labels(self.model_name).observe(batch_size)
        if preemptions:
            self.num_preemptions.labels(self.model_name).inc(preemptions)

    def observe_generated(self, tokens: int) -> None:
        """Tokens one step generated, counted as they come (as vLLM counts them), not when their request ends: a
        window's increase is then the tokens generated in it, not those of the requests that happened to finish in it
        (with requests about as long as the window, a figure that rises and falls with their number)."""
        if tokens:
            self.generation_tokens.labels(self.model_name).inc(tokens)

    def observe_inter_token_latency(self, seconds: float) -> None:
        self.inter_token_latency.labels(self.model_name).observe(seconds)

    def observe_finished(self, sample: FinishedRequestSample) -> None:
        m = self.model_name
        self.prompt_tokens.labels(m).inc(sample.prompt_tokens)
        self.request_success.labels(m, sample.finish_reason).inc()
        self.e2e_request_latency.labels(m).observe(sample.e2e_latency)
        self.request_queue_time.labels(m).observe(sample.queue_time)
        if sample.time_to_first_token is not None:
            self.time_to_first_token.labels(m).observe(sample.time_to_first_token)
            self.request_prefill_time.labels(m).observe(sample.prefill_time)
            self.request_decode_time.labels(m).observe(sample.decode_time)
        tpot = sample.time_per_output_token
        if tpot is not None:
            self.time_per_output_token.labels(m).observe(tpot)

    def set_state(self, *, running: int, waiting: int, swapped: int, kv_usage: float, kv_blocks_total: int,
                  batch_cap: int | None = None) -> None:
        m = self.model_name
        if batch_cap is not None:
            self.batch_size_cap.labels(m).set(batch_cap)
        self.num_requests_running.labels(m).set(running)
        self.num_requests_waiting.labels(m).set(waiting)
        self.num_requests_swapped.labels(m).set(swapped)
        self.kv_cache_usage_perc.labels(m).set(kv_usage)
        self.kv_cache_blocks_total.labels(m).set(kv_blocks_total)

    def set_schedule_generation(self, generation: int | None) -> None:
        value = contract.SCHEDULE_GENERATION_NONE if generation is None else generation
        self.schedule_generation.labels(self.model_name).set(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
