from prometheus_client.parser import text_string_to_metric_families

from npuserve.engine.server.metrics import EngineMetrics, FinishedRequestSample

DESIGN_NAMES = {
    "npuserve:time_to_first_token_seconds", "npuserve:time_per_output_token_seconds",
    "npuserve:inter_token_latency_seconds", "npuserve:e2e_request_latency_seconds",
    "npuserve:request_queue_time_seconds", "npuserve:request_prefill_time_seconds",
    "npuserve:request_decode_time_seconds", "npuserve:num_requests_running", "npuserve:num_requests_waiting",
    "npuserve:num_requests_swapped", "npuserve:kv_cache_usage_perc", "npuserve:kv_cache_blocks_total",
    "npuserve:prompt_tokens", "npuserve:generation_tokens", "npuserve:num_preemptions",
    "npuserve:request_success", "npuserve:prefill_batch_size", "npuserve:decode_batch_size",
}


def _samples(metrics: EngineMetrics) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
                            + "}" if len(s.labels) > 1 else "")
            out[key] = s.value
    return out


def test_every_design_name_is_exported_with_the_model_label() -> None:
    metrics = EngineMetrics("m")
    metrics.set_state(running=0, waiting=0, swapped=0, kv_usage=0.0, kv_blocks_total=10)
    families = {f.name for f in text_string_to_metric_families(metrics.render().decode())}
    assert families >= DESIGN_NAMES
    assert 'model_name="m"' in metrics.render().decode()


def test_finished_request_moves_counters_and_histograms() -> None:
    metrics = EngineMetrics("m")
    metrics.observe_finished(FinishedRequestSample(
        finish_reason="length", prompt_tokens=10, generation_tokens=5, queue_time=0.1, prefill_time=0.2,
        decode_time=0.4, e2e_latency=0.7, time_to_first_token=0.3))
    s = _samples(metrics)
    # generated tokens count per step (observe_generated), as they come: the request's end adds none
    assert s["npuserve:prompt_tokens_total"] == 10 and s["npuserve:generation_tokens_total"] == 0
    metrics.observe_generated(5)
    assert _samples(metrics)["npuserve:generation_tokens_total"] == 5
    assert s["npuserve:request_success_total{finished_reason=length}"] == 1
    assert s["npuserve:request_success_total{finished_reason=stop}"] == 0
    assert s["npuserve:time_per_output_token_seconds_sum"] == 0.1  # 0.4 s over 4 gaps
    assert s["npuserve:time_to_first_token_seconds_count"] == 1


def test_request_without_tokens_records_no_latency_per_token() -> None:
    metrics = EngineMetrics("m")
    metrics.observe_finished(FinishedRequestSample(
        finish_reason="abort", prompt_tokens=3, generation_tokens=0, queue_time=0.5, prefill_time=0.0,
        decode_time=0.0, e2e_latency=0.5, time_to_first_token=None))
    s = _samples(metrics)
    assert s["npuserve:time_to_first_token_seconds_count"] == 0
    assert s["npuserve:time_per_output_token_seconds_count"] == 0
    assert s["npuserve:request_queue_time_seconds_count"] == 1


def test_steps_and_state() -> None:
    metrics = EngineMetrics("m")
    metrics.observe_step("prefill", 4)
    metrics.observe_step("decode", 32, preemptions=2)
    metrics.set_state(running=32, waiting=5, swapped=1, kv_usage=0.5, kv_blocks_total=100, batch_cap=40)
    s = _samples(metrics)
    assert s["npuserve:batch_size_cap"] == 40
    assert s["npuserve:prefill_batch_size_sum"] == 4 and s["npuserve:decode_batch_size_sum"] == 32
    assert s["npuserve:num_preemptions_total"] == 2
    assert (s["npuserve:num_requests_running"], s["npuserve:num_requests_waiting"]) == (32, 5)
    assert s["npuserve:kv_cache_usage_perc"] == 0.5


# vLLM's published bucket boundaries, copied from vllm/v1/metrics/loggers.py of vLLM v0.11 (`PrometheusStatLogger`;
# the TTFT, TPOT and request-latency lists are the same in the v0.10 series). vLLM buckets
# vllm:inter_token_latency_seconds as vllm:time_per_output_token_seconds.
VLLM_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                     40.0, 80.0, 160.0, 640.0, 2560.0]
VLLM_TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                     40.0, 80.0]
VLLM_REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
# vLLM has no per-step batch-size histogram: these are ours, powers of two, pinned so that a change is deliberate.
BATCH_SIZE_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]

EXPECTED_BUCKETS = {
    "npuserve:time_to_first_token_seconds": VLLM_TTFT_BUCKETS,
    "npuserve:time_per_output_token_seconds": VLLM_TPOT_BUCKETS,
    "npuserve:inter_token_latency_seconds": VLLM_TPOT_BUCKETS,
    "npuserve:e2e_request_latency_seconds": VLLM_REQUEST_LATENCY_BUCKETS,
    "npuserve:request_queue_time_seconds": VLLM_REQUEST_LATENCY_BUCKETS,
    "npuserve:request_prefill_time_seconds": VLLM_REQUEST_LATENCY_BUCKETS,
    "npuserve:request_decode_time_seconds": VLLM_REQUEST_LATENCY_BUCKETS,
    "npuserve:prefill_batch_size": BATCH_SIZE_BUCKETS,
    "npuserve:decode_batch_size": BATCH_SIZE_BUCKETS,
}


def _exported_buckets(metrics: EngineMetrics) -> dict[str, list[float]]:
    """Each histogram's upper bounds as /metrics exports them (the `le` labels, +Inf left out)."""
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        if family.type == "histogram":
            out[family.name] = [float(s.labels["le"]) for s in family.samples
                                if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"]
    return out


def test_buckets_are_vllms() -> None:
    exported = _exported_buckets(EngineMetrics("m"))
    assert set(exported) == set(EXPECTED_BUCKETS)
    for name, expected in EXPECTED_BUCKETS.items():
        assert exported[name] == [float(b) for b in expected], name


def test_two_engines_in_one_process_do_not_collide() -> None:
    a, b = EngineMetrics("a"), EngineMetrics("b")  # a shared registry would refuse the second
    a.observe_step("decode", 3)
    assert _samples(a)["npuserve:decode_batch_size_count"] == 1
    assert _samples(b)["npuserve:decode_batch_size_count"] == 0
    assert 'model_name="b"' in b.render().decode() and 'model_name="a"' not in b.render().decode()
