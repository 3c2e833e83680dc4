from prometheus_client.parser import text_string_to_metric_families

from npuserve.engine.server.metrics import TTFT_BUCKETS, EngineMetrics, FinishedRequestSample

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
    assert s["npuserve:prompt_tokens_total"] == 10 and s["npuserve:generation_tokens_total"] == 5
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
    metrics.set_state(running=32, waiting=5, swapped=1, kv_usage=0.5, kv_blocks_total=100)
    s = _samples(metrics)
    assert s["npuserve:prefill_batch_size_sum"] == 4 and s["npuserve:decode_batch_size_sum"] == 32
    assert s["npuserve:num_preemptions_total"] == 2
    assert (s["npuserve:num_requests_running"], s["npuserve:num_requests_waiting"]) == (32, 5)
    assert s["npuserve:kv_cache_usage_perc"] == 0.5


def test_buckets_are_vllms() -> None:
    assert TTFT_BUCKETS[0] == 0.001 and TTFT_BUCKETS[-1] == 2560.0


def test_two_engines_in_one_process_do_not_collide() -> None:
    EngineMetrics("a")
    EngineMetrics("b")
