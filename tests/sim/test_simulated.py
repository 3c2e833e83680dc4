"""The simulated engine: the cost model's terms scale as they must, the virtual-clock run drives the real scheduler
and conserves requests, its records read as a streaming client's, and the fit to the MindIE guide holds."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from npuserve.catalog.accelerators import ACCELERATORS, EFFICIENCIES, LINK_LATENCIES, get_accelerator
from npuserve.catalog.engines import ENGINE_PROFILES
from npuserve.catalog.models import get_model_preset
from npuserve.loadgen.arrivals import iter_send_offsets
from npuserve.loadgen.config import BenchConfig, DatasetConfig, DatasetName, LoadConfig
from npuserve.loadgen.metrics import compute_metrics
from npuserve.loadgen.records import TokenCountSource
from npuserve.loadgen.report_mindie import render_mindie
from npuserve.loadgen.report_vllm import render_vllm
from npuserve.mindie_config import MindIEConfig
from npuserve.sim import (
    CostModel,
    CostParams,
    Hardware,
    OutputLengths,
    SimRequest,
    SimulationConfig,
    draw_requests,
    simulate,
    sweep,
)
from npuserve.sim.cost_model import StepShape
from npuserve.sim.lengths import draw_output
from npuserve.sim.load import LoadDriver

LLAMA = get_model_preset("llama3-8b")
H100 = Hardware.of(get_accelerator("nvidia-h100-80gb"))


def decode_shape(batch: int, context_per_seq: int) -> StepShape:
    """A decode step of `batch` sequences each holding `context_per_seq` tokens."""
    return StepShape(num_seqs=batch, new_tokens=batch, context_tokens=batch * context_per_seq,
                     attended_pairs=batch * context_per_seq, sampled_rows=batch)


def prefill_shape(prompt_lens: list[int]) -> StepShape:
    """A prefill step of fresh prompts (causal attention: a prompt of n tokens attends n (n + 1) / 2 pairs)."""
    return StepShape(num_seqs=len(prompt_lens), new_tokens=sum(prompt_lens), context_tokens=sum(prompt_lens),
                     attended_pairs=sum(n * (n + 1) // 2 for n in prompt_lens), sampled_rows=len(prompt_lens))


def engine_config(world_size: int = 1, **schedule: object) -> MindIEConfig:
    return MindIEConfig.from_dict({"BackendConfig": {
        "ModelDeployConfig": {"ModelConfig": [{"modelName": "m", "modelWeightPath": "m", "worldSize": world_size,
                                               "npuMemSize": 8, "cpuMemSize": 1}]},
        "ScheduleConfig": schedule,
    }})


def sim_config(load: LoadConfig, *, blocks: int = 4000, dataset: DatasetConfig | None = None,
               **schedule: int | bool) -> SimulationConfig:
    bench = BenchConfig(dataset=dataset or DatasetConfig(random_input_len=200, random_output_len=50), load=load)
    return SimulationConfig(engine=engine_config(**schedule), model=LLAMA, accelerator="nvidia-h100-80gb",
                            bench=bench, num_kv_blocks=blocks)


# --- the cost model ------------------------------------------------------------------------------------------------


def test_weights_term_does_not_depend_on_the_batch() -> None:
    model = CostModel(LLAMA, H100)
    assert model.step(decode_shape(1, 500)).weights_s == model.step(decode_shape(256, 500)).weights_s > 0


def test_kv_term_is_linear_in_the_context() -> None:
    model = CostModel(LLAMA, H100)
    one, two = model.step(decode_shape(64, 500)), model.step(decode_shape(64, 1000))
    assert two.kv_s == pytest.approx(2 * one.kv_s)
    # the whole KV of every attended token is read: 2 x layers x kv heads x head dim x 2 bytes per token
    per_token = 2 * LLAMA.num_layers * LLAMA.num_key_value_heads * LLAMA.head_dim * 2
    assert one.kv_s == pytest.approx(64 * 500 * per_token / (3350e9 * H100.efficiency.bandwidth))


def test_compute_term_is_linear_in_the_tokens() -> None:
    model = CostModel(LLAMA, H100)
    a, b = model.step(prefill_shape([1] * 1000)), model.step(prefill_shape([1] * 2000))
    assert b.compute_s == pytest.approx(2 * a.compute_s)
    # 2 FLOPs per parameter per token (the LM head once per sampled row, attention per attended pair)
    flops = 2 * (LLAMA.num_layers * LLAMA.params_per_layer + LLAMA.vocab_size * LLAMA.hidden_size)
    flops += 4 * LLAMA.num_layers * LLAMA.q_size
    assert a.compute_s == pytest.approx(1000 * flops / (989e12 * H100.efficiency.compute))


def test_prefill_is_compute_bound_and_decode_memory_bound_on_a_gpu() -> None:
    model = CostModel(LLAMA, H100, params=CostParams())  # no host overheads: the device's roofline alone
    assert model.step(prefill_shape([2048] * 4)).bound == "compute"
    assert model.step(decode_shape(8, 1000)).bound == "memory"


def test_more_cards_cut_the_weights_term_and_add_communication() -> None:
    one, two = CostModel(LLAMA, H100, 1), CostModel(LLAMA, H100, 2)
    shape = decode_shape(64, 800)
    a, b = one.step(shape), two.step(shape)
    assert b.weights_s == pytest.approx(a.weights_s / 2)
    assert b.compute_s == pytest.approx(a.compute_s / 2)
    assert a.comm_s == 0 and b.comm_s > 0


def test_the_all_reduce_latency_is_the_links_not_the_engines() -> None:
    """Each link kind has its own latency (catalog LINK_LATENCIES): a 910B3 (HCCS) and a 910B4 (PCIe) take their
    link's, whatever the engine; a decode step of 64 tokens on 2 cards pays (2 x 32 + 1) = 65 all-reduces, each that
    latency plus 2 (n-1)/n x 64 x 4096 x 2 bytes over the link: written out below for 100 us and 64 GB/s x 0.5."""
    b3, b4 = Hardware.of(get_accelerator("ascend-910b3")), Hardware.of(get_accelerator("ascend-910b4"))
    assert b3.allreduce_us == LINK_LATENCIES["hccs"].allreduce_us
    assert b4.allreduce_us == LINK_LATENCIES["pcie"].allreduce_us
    with pytest.raises(ValueError, match="allreduce_latency_us"):
        CostParams.model_validate({"allreduce_latency_us": 30.0})  # no engine term of that name any more
    eff = b4.efficiency.model_copy(update={"link": 0.5})
    card = Hardware.of(get_accelerator("ascend-910b4"), eff, allreduce_us=100.0)
    for engine in ("mindie", "vllm"):
        step = CostModel(LLAMA, card, 2, ENGINE_PROFILES[engine].params).step(decode_shape(64, 800))
        assert step.comm_s == pytest.approx(65 * (100e-6 + 64 * 4096 * 2 / 32e9))  # 116.4 us each: 7.57 ms


def test_host_work_overlaps_the_device_and_paces_large_batches() -> None:
    params = CostParams(launch_us_per_layer=5000.0 / LLAMA.num_layers, per_seq_host_ms=0.2)
    model = CostModel(LLAMA, H100, params=params)
    small, large = model.step(decode_shape(4, 500)), model.step(decode_shape(400, 500))
    assert small.bound == "memory" and large.bound == "host"
    assert small.total_s == pytest.approx(0.005 + small.device_s)
    assert large.total_s == pytest.approx(0.005 + 400 * 0.0002)
    assert model.step_time(decode_shape(400, 500)) == pytest.approx(large.total_s)


def test_every_catalog_card_but_the_cpu_has_cited_datasheet_figures_and_a_fitted_family() -> None:
    for name, acc in ACCELERATORS.items():
        figures = acc.simulation_figures()
        if name == "cpu":
            assert figures is None  # its figures come from a fit on the machine (npuserve.sim.cpu_profile)
            continue
        assert figures is not None and figures.source == "datasheet" and acc.source, name
        assert acc.link in ("hccs", "nvlink", "pcie") and acc.family in EFFICIENCIES, name
    # the msmodeling tiers (1.6 TiB/s on 64 GB parts, 0.8 TiB/s and PCIe on the 32 GB one), written out
    b3, b4 = get_accelerator("ascend-910b3"), get_accelerator("ascend-910b4")
    assert (b3.memory_bandwidth_gbps, b3.peak_tflops_16bit, b3.link, b3.interconnect_gbps) == (1759.2, 294.9, "hccs",
                                                                                               196.0)
    assert (b4.memory_bandwidth_gbps, b4.peak_tflops_16bit, b4.link, b4.interconnect_gbps) == (879.6, 245.8, "pcie",
                                                                                               64.0)
    assert "msmodeling" in b3.source and "A2_313T_64G" in b3.source


# --- lengths and load ----------------------------------------------------------------------------------------------


def test_drawn_output_lengths_keep_their_mean_under_the_cap() -> None:
    rng = random.Random(1)
    lengths = [draw_output(346, 0.5, 512, rng) for _ in range(20000)]
    assert max(lengths) == 512 and min(lengths) >= 1
    assert sum(lengths) / len(lengths) == pytest.approx(346, rel=0.02)


def test_random_prompts_run_to_their_drawn_lengths() -> None:
    load = LoadConfig(num_prompts=4)
    bench = sim_config(load).bench
    assert all(r.output_tokens == r.max_tokens == 50 for r in draw_requests(bench, 4))
    assert all(r.prompt_tokens == 200 for r in draw_requests(bench, 4))


def test_gsm8k_prompts_are_estimated_and_outputs_drawn_around_the_mean(tmp_path: Path) -> None:
    path = tmp_path / "gsm8k.jsonl"
    path.write_text('{"question": "' + "x" * 400 + '", "answer": "1"}\n')
    dataset = DatasetConfig(name=DatasetName.GSM8K, path=path, max_output_len=512)
    bench = sim_config(LoadConfig(num_prompts=2000), dataset=dataset).bench
    capped = draw_requests(bench, 5)
    assert all(r.prompt_tokens == 100 and r.output_tokens == 512 for r in capped)  # no mean given: to the cap
    drawn = draw_requests(bench, 2000, OutputLengths(mean=300))
    assert sum(r.output_tokens for r in drawn) / 2000 == pytest.approx(300, rel=0.05)
    ignoring = bench.model_copy(update={"ignore_eos": True})
    assert all(r.output_tokens == 512 for r in draw_requests(ignoring, 20, OutputLengths(mean=300)))


def test_open_loop_sends_at_the_load_generators_offsets() -> None:
    load = LoadConfig(num_prompts=30, request_rate=5.0, burstiness=0.7, seed=3)
    result = simulate(sim_config(load))
    # the async runner seeds its arrivals with seed + 1
    expected = list(itertools.islice(iter_send_offsets(5.0, 0.7, random.Random(4)), 30))
    assert sorted(r.t0 for r in result.bench.records) == pytest.approx(expected)


def test_closed_loop_users_wait_their_think_time() -> None:
    load = LoadConfig(num_prompts=20, max_concurrency=2, think_time_s=(1.0, 1.0))
    records = sorted(simulate(sim_config(load)).bench.records, key=lambda r: r.t0)
    by_user: dict[int | None, list[tuple[float, float]]] = {}
    for r in records:
        assert r.end is not None
        by_user.setdefault(r.user, []).append((r.t0, r.end))
    assert set(by_user) == {0, 1}
    for spans in by_user.values():
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert start == pytest.approx(end + 1.0)


def test_open_loop_with_a_concurrency_limit_never_exceeds_it() -> None:
    load = LoadConfig(num_prompts=40, max_concurrency=3)
    records = simulate(sim_config(load)).bench.records
    events = sorted([(r.t0, 1) for r in records] + [(r.end or 0.0, -1) for r in records], key=lambda e: (e[0], e[1]))
    in_flight = peak = 0
    for _, delta in events:
        in_flight += delta
        peak = max(peak, in_flight)
    assert peak == 3


def test_duration_mode_stops_sending_at_the_deadline() -> None:
    load = LoadConfig(num_prompts=5, duration_s=20.0, max_concurrency=4)
    records = simulate(sim_config(load)).bench.records
    assert len(records) > 5  # the dataset was cycled
    assert max(r.t0 for r in records) <= 20.0


def test_duration_with_an_unbounded_rate_is_refused() -> None:
    with pytest.raises(ValueError, match="without end"):
        LoadDriver(LoadConfig(num_prompts=5, duration_s=10.0), 5)


# --- runs ------------------------------------------------------------------------------------------------------------


def test_a_run_conserves_requests_and_records_them_as_a_streaming_client_would() -> None:
    load = LoadConfig(num_prompts=200, max_concurrency=64, warmup_requests=8)
    result = simulate(sim_config(load, maxBatchSize=32, maxPrefillBatchSize=16))
    bench = result.bench
    assert bench.simulated and bench.token_source is TokenCountSource.SIMULATED
    assert len(bench.records) == 208 and len(bench.measured) == 200
    assert sorted(r.index for r in bench.records) == list(range(208))
    for r in bench.measured:
        assert r.ok and r.output_tokens == 50 == len(r.chunk_times)
        assert r.chunk_times == sorted(r.chunk_times) and r.chunk_times[0] > r.t0 >= 0
        assert r.server is not None and r.server.ttft_ms == pytest.approx((r.chunk_times[0] - r.t0) * 1e3, abs=1e-3)
        assert 1 <= (r.server.mean_decode_batch_size or 0) <= 32
    assert all(r.t0 < 0 for r in bench.records if r.warmup)  # warm-up ran before the measured phase's start
    metrics = compute_metrics(bench.records, bench.duration_s)
    assert metrics.completed == 200 and metrics.total_output_tokens == 200 * 50
    assert "PrefillBatchsize" in render_mindie(bench, metrics)
    assert "Output token throughput" in render_vllm(bench, metrics)
    busy = sum(s.cost.total_s for s in result.steps)
    assert 0 < busy <= bench.duration_s + 1e-9  # the clock advanced only by priced steps (and idle gaps)


def test_kv_pressure_preempts_yet_every_request_finishes() -> None:
    load = LoadConfig(num_prompts=120, max_concurrency=120)
    dataset = DatasetConfig(random_input_len=300, random_output_len=400)
    result = simulate(sim_config(load, blocks=40, dataset=dataset, maxBatchSize=100, maxPrefillBatchSize=50))
    assert all(r.ok and r.output_tokens == 400 for r in result.bench.records)
    assert result.num_preemptions > 0


def test_a_prompt_over_max_input_len_is_refused_like_the_server_does() -> None:
    requests = [SimRequest(3000, 10, 10), SimRequest(100, 10, 10)]
    result = simulate(sim_config(LoadConfig(num_prompts=2)), requests)
    refused = [r for r in result.bench.records if not r.ok]
    assert len(refused) == 1 and refused[0].status == 400 and "maxInputTokenLen" in (refused[0].error or "")


def test_a_thousand_requests_complete() -> None:
    result = simulate(sim_config(LoadConfig(num_prompts=1000, max_concurrency=256), maxBatchSize=256,
                                 maxPrefillBatchSize=64).model_copy(update={"keep_steps": False}))
    assert sum(r.ok for r in result.bench.records) == 1000 and not result.steps


def test_ttft_with_prefill_first_grows_with_max_batch_size_at_the_tuners_load() -> None:
    # The tuner's benchmark load (docs/simulator.md#npuserve-tune---simulate): maxBatchSize - 1 users, so a larger
    # batch means longer steps to wait out before a prefill.
    ttft = []
    for batch in (50, 100, 200):
        load = LoadConfig(num_prompts=600, max_concurrency=batch - 1)
        result = simulate(sim_config(load, maxBatchSize=batch, maxPrefillBatchSize=batch // 2,
                                     supportSelectBatch=False))
        ttft.append(compute_metrics(result.bench.records, result.bench.duration_s).ttft_ms.mean)
    assert ttft[0] < ttft[1] < ttft[2]


def test_sweep_runs_one_config_per_batch_on_the_same_requests() -> None:
    config = sim_config(LoadConfig(num_prompts=100, max_concurrency=100))
    runs = sweep(config, [16, 64])
    assert [b for b, _ in runs] == [16, 64]
    assert [r.bench.config.load.num_prompts for _, r in runs] == [100, 100]
    throughput = [compute_metrics(r.bench.records, r.bench.duration_s).output_throughput for _, r in runs]
    assert throughput[1] > throughput[0]


