"""Metric arithmetic against timelines whose answers are worked out by hand (docs/loadgen.md#what-it-measures)."""

from __future__ import annotations

import numpy as np
import pytest

from npuserve.loadgen.config import SLO
from npuserve.loadgen.metrics import (
    compute_metrics,
    distribution,
    e2e_ms,
    itls_ms,
    mean_tokens,
    percentile,
    percentile_key,
    tpot_ms,
    ttft_ms,
)
from npuserve.loadgen.records import HeaderTimings, RequestRecord


def streamed(index: int, t0: float, chunks: list[float], tokens: int, prompt: int, **kw: object) -> RequestRecord:
    return RequestRecord(index=index, t0=t0, chunk_times=chunks, end=chunks[-1] + 0.001 if chunks else None,
                         prompt_tokens=prompt, output_tokens=tokens, status=200, **kw)  # type: ignore[arg-type]


# A: 4 tokens in 4 chunks. TTFT 100, E2E 300, TPOT (300-100)/3 = 66.67, gaps 50 100 50 (ms).
A = streamed(0, 0.0, [0.10, 0.15, 0.25, 0.30], tokens=4, prompt=10)
# B: 3 tokens in 2 chunks (the second carries two). TTFT 200, E2E 300, TPOT 100/2 = 50, gap 100.
B = streamed(1, 1.0, [1.2, 1.3], tokens=3, prompt=20)
# C: a single token. TTFT 50, E2E 50, no TPOT, no gap.
C = streamed(2, 2.0, [2.05], tokens=1, prompt=5)
# D: a server error after one chunk; E: rate limited. Neither adds a latency.
D = RequestRecord(index=3, t0=0.5, chunk_times=[0.6], end=0.7, prompt_tokens=7, output_tokens=1, status=500,
                  error="HTTP 500: boom")
E = RequestRecord(index=4, t0=0.6, end=0.61, status=429, error="HTTP 429")
# W: a warm-up request with a huge TTFT: in no figure.
W = streamed(5, 0.0, [5.0, 6.0], tokens=2, prompt=1000, warmup=True)
RUN = [W, A, B, C, D, E]


def test_per_request_latencies_of_a_streamed_request() -> None:
    assert ttft_ms(A) == pytest.approx(100.0)
    assert e2e_ms(A) == pytest.approx(300.0)
    assert tpot_ms(A) == pytest.approx(200.0 / 3)  # the first token's wait is not a per-token time
    assert itls_ms(A) == pytest.approx([50.0, 100.0, 50.0])
    assert tpot_ms(B) == pytest.approx(50.0)  # N - 1 = 2 gaps' worth of tokens, whatever the chunking


def test_single_token_request_has_no_tpot_and_no_itl() -> None:
    assert ttft_ms(C) == pytest.approx(50.0)
    assert e2e_ms(C) == pytest.approx(50.0)
    assert tpot_ms(C) is None
    assert itls_ms(C) == []


def test_failed_requests_have_no_latency() -> None:
    for r in (D, E):
        assert (ttft_ms(r), e2e_ms(r), tpot_ms(r), itls_ms(r)) == (None, None, None, [])


def test_header_mode_reads_the_tgi_headers() -> None:
    headers = HeaderTimings(queue_ms=10.0, prefill_ms=40.0, inference_ms=500.0, time_per_token_ms=20.0)
    r = RequestRecord(index=0, t0=1.0, end=1.6, output_tokens=5, status=200, headers=headers)
    assert ttft_ms(r) == pytest.approx(50.0)  # prefill + queue
    assert tpot_ms(r) == pytest.approx(20.0)
    assert e2e_ms(r) == pytest.approx(600.0)  # the client's clock, not x-inference-time
    assert itls_ms(r) == []
    one = r.model_copy(update={"output_tokens": 1})
    assert tpot_ms(one) is None


def test_unstreamed_request_without_headers_has_only_e2e() -> None:
    r = RequestRecord(index=0, t0=0.0, end=0.25, output_tokens=5, status=200)
    assert (ttft_ms(r), tpot_ms(r)) == (None, None)
    assert e2e_ms(r) == pytest.approx(250.0)


@pytest.mark.parametrize("q", [0, 1, 12.345, 25, 50, 66.6667, 75, 90, 95, 99, 99.9, 100])
@pytest.mark.parametrize("n", [1, 2, 3, 10, 1001])
def test_percentile_matches_numpy(q: float, n: int) -> None:
    values = np.random.default_rng(n).exponential(100.0, n)
    assert percentile(values.tolist(), q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)


def test_percentile_by_hand_and_bad_arguments() -> None:
    assert percentile([200.0, 50.0, 100.0], 99) == pytest.approx(198.0)  # rank 1.98: 100 + 0.98 * 100
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_distribution_statistics_and_extra_percentiles() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    d = distribution(values, extra_percentiles=(99, 99.9, 50))
    assert (d.n, d.mean, d.median, d.min, d.max) == (4, 2.5, 2.5, 1.0, 4.0)
    assert d.std == pytest.approx(float(np.std(values)))  # population std, as vLLM's np.std
    assert d.p75 == pytest.approx(3.25)
    assert set(d.percentiles) == {"99", "99.9", "50"}
    assert d.at(99.9) == pytest.approx(3.997)
    assert d.at(90) == d.p90
    with pytest.raises(KeyError):
        d.at(42)
    assert percentile_key(99.0) == "99" and percentile_key(99.9) == "99.9"


def test_empty_distribution_is_explicit() -> None:
    d = distribution([])
    assert d.empty and d.n == 0 and d.mean == 0.0


def test_run_counts_and_throughputs() -> None:
    m = compute_metrics(RUN, duration_s=2.0)
    assert (m.sent, m.completed, m.failed, m.rate_limited) == (5, 3, 2, 1)  # the warm-up is not sent
    assert m.error_rate == pytest.approx(0.4)
    assert (m.total_input_tokens, m.total_output_tokens) == (35, 8)  # completed requests only
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(4.0)
    assert m.total_token_throughput == pytest.approx(21.5)
    assert m.good_requests is None and m.goodput is None and m.slo is None


def test_run_latency_distributions_exclude_failures_and_warmup() -> None:
    m = compute_metrics(RUN, duration_s=2.0)
    assert m.ttft_ms.n == 3 and m.ttft_ms.mean == pytest.approx(350.0 / 3)
    assert m.ttft_ms.max == pytest.approx(200.0)
    assert m.tpot_ms.n == 2 and m.tpot_ms.mean == pytest.approx((200.0 / 3 + 50.0) / 2)
    assert m.itl_ms.n == 4 and m.itl_ms.mean == pytest.approx(75.0)  # pooled gaps: 50 100 50 | 100
    assert m.e2e_ms.n == 3 and m.e2e_ms.mean == pytest.approx(650.0 / 3)


def test_peak_output_throughput_buckets_by_second() -> None:
    # second 0: A's 4 tokens; second 1: B's 3 (two chunks of 1.5); second 2: C's 1
    assert compute_metrics(RUN, duration_s=2.0).peak_output_throughput == pytest.approx(4.0)


def test_goodput_counts_requests_meeting_every_objective() -> None:
    slo = SLO(ttft_ms=150.0, tpot_ms=60.0)
    m = compute_metrics(RUN, duration_s=2.0, slo=slo)
    # A: TPOT 66.7 misses; B: TTFT 200 misses; C: TTFT 50, no TPOT to miss -> good
    assert m.good_requests == 1
    assert m.goodput == pytest.approx(0.5)


def test_slo_verdict_uses_the_chosen_statistic() -> None:
    mean = compute_metrics(RUN, duration_s=2.0, slo=SLO(ttft_ms=150.0, tpot_ms=60.0, statistic="mean")).slo
    assert mean is not None and mean.passed  # mean TTFT 116.7, mean TPOT 58.3
    assert [(v.metric, v.met) for v in mean.objectives] == [("ttft", True), ("tpot", True)]
    p99 = compute_metrics(RUN, duration_s=2.0, slo=SLO(ttft_ms=150.0, statistic="p99")).slo
    assert p99 is not None and not p99.passed
    assert p99.objectives[0].measured_ms == pytest.approx(198.0)


def test_an_objective_without_measurements_fails() -> None:
    verdict = compute_metrics([C], duration_s=1.0, slo=SLO(tpot_ms=10.0)).slo
    assert verdict is not None and not verdict.passed
    assert verdict.objectives[0].measured_ms is None


def test_no_requests_and_no_duration() -> None:
    m = compute_metrics([], duration_s=0.0)
    assert (m.sent, m.error_rate, m.request_throughput) == (0, 0.0, 0.0)
    assert m.ttft_ms.empty and m.peak_output_throughput is None


def test_mean_tokens_of_completed_requests() -> None:
    assert mean_tokens(RUN) == (pytest.approx(35 / 3), pytest.approx(8 / 3))
    assert mean_tokens([E]) == (None, None)
