"""The CPU engine as a calibration source (docs/simulator.md, "The CPU engine as a source"): the profile fitted on
model A (`cpu_profile`) predicts a run it never saw, model B served under a closed-loop load, and the prediction is
compared with what a client measured.

Measured as a user would: `npuserve serve` in its own process (torch threads fixed by OMP_NUM_THREADS, so the
client's interpreter does not share a GIL with the engine) and this project's load generator (`run_benchmark`: the
code behind `npuserve bench`) against it. Predicted with `simulate()`: accelerator "cpu" with the fitted Hardware and
host terms (the bandwidth the fit's memory curve gives at model B's weight bytes: `CpuProfile.hardware_for`),
the KV blocks the engine reports on /info, the same schedule, load and requests (each measured request's prompt and
output token counts, warm-ups first).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from npuserve.engine.model.dummy import write_dummy_model
from npuserve.engine_contract import FLAG_CONFIG, FLAG_HOST, FLAG_PORT, INFO_PATH, READY_PATH
from npuserve.loadgen.config import BenchConfig, DatasetConfig, DatasetName, LoadConfig
from npuserve.loadgen.metrics import compute_metrics
from npuserve.loadgen.result import BenchResult
from npuserve.loadgen.run import run_benchmark
from npuserve.mindie_config import MindIEConfig, minimal_config
from npuserve.modelspec import ModelSpec

from .cost_model import LAUNCH_US_PER_LAYER_BOUND, PER_SEQ_HOST_MS_BOUND, CostParams, Hardware
from .cpu_memory import CURVE_ROWS
from .cpu_profile import THREADS, CpuProfile, fit_cpu_profile, model_spec, weight_bytes
from .engine import SimulationConfig, SimulationResult, simulate
from .runner import SimRequest

# Model B, the one predicted: 1.5x the layers, 1.5x the hidden size, another GQA ratio (12 heads over 4 KV heads,
# 3:1 against model A's 2:1) and a wider MLP: 3.5x model A's weights (157 MB of float32).
PREDICTED_MODEL: dict[str, object] = {"num_layers": 6, "hidden_size": 768, "num_attention_heads": 12,
                                      "num_key_value_heads": 4, "head_dim": 64, "intermediate_size": 2048,
                                      "dtype": "float32"}


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """The predicted run's load: a closed loop of `users`, fixed lengths, ignore_eos (every request runs to its
    output length), the engine's batch limit equal to the users so nothing waits on the schedule alone."""

    users: int = 6
    num_prompts: int = 36
    warmup_requests: int = 6
    input_len: int = 96
    output_len: int = 48
    range_ratio: float = 0.0
    think_time_s: tuple[float, float] | None = (0.05, 0.3)
    seed: int = 0

    def bench(self, url: str) -> BenchConfig:
        return BenchConfig(base_url=url, ignore_eos=True,
                           dataset=DatasetConfig(name=DatasetName.RANDOM, random_input_len=self.input_len,
                                                 random_output_len=self.output_len,
                                                 random_range_ratio=self.range_ratio),
                           load=LoadConfig(num_prompts=self.num_prompts, max_concurrency=self.users,
                                           warmup_requests=self.warmup_requests, seed=self.seed,
                                           think_time_s=self.think_time_s))

    def engine(self, model_dir: Path) -> MindIEConfig:
        return minimal_config(model_dir, max_seq_len=2 * (self.input_len + self.output_len) + 64,
                              maxBatchSize=self.users, maxPrefillBatchSize=self.users)


@dataclass(frozen=True)
class ServedRun:
    """What the client measured, and what the engine said it ran (its /info)."""

    result: BenchResult
    config: MindIEConfig
    kv_blocks: int
    kv_host_blocks: int


@dataclass(frozen=True, slots=True)
class CpuSourceRow:
    """One figure of the predicted run: measured by the client, predicted by the simulator."""

    source: str
    figure: str
    measured: float
    predicted: float

    @property
    def error(self) -> float:
        return self.predicted / self.measured - 1.0


@dataclass(frozen=True, slots=True)
class FittedTerm:
    """One fitted figure of the CPU profile, its bound and where it comes from."""

    name: str
    value: float
    unit: str
    bound: str
    source: str


@dataclass(frozen=True)
class CpuCalibration:
    profile: CpuProfile
    served: ServedRun
    predicted: SimulationResult
    load: LoadPlan

    @property
    def rows(self) -> list[CpuSourceRow]:
        return cpu_source_rows(self.served, self.predicted, self.load)

    @property
    def terms(self) -> list[FittedTerm]:
        return fitted_terms(self.profile)


@contextlib.contextmanager
def serve_process(config_path: Path, threads: int) -> Iterator[str]:
    """`npuserve serve` on a free loopback port in its own process, `threads` torch threads; yields its URL."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [str(Path(sys.executable).parent / "npuserve"), "serve", FLAG_CONFIG, str(config_path),
               FLAG_HOST, "127.0.0.1", FLAG_PORT, str(port), "--log-level", "warning"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + READY_PATH, timeout=1).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"npuserve serve did not start (exit {proc.poll()})")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def measure_served(model_dir: Path, load: LoadPlan, threads: int) -> ServedRun:
    config = load.engine(model_dir)
    config_path = model_dir.parent / "cpu-validation-config.json"
    config.save(config_path)
    with serve_process(config_path, threads) as url:
        info: dict[str, Any] = httpx.get(url + INFO_PATH, timeout=10).json()
        result = asyncio.run(run_benchmark(load.bench(url)))
    return ServedRun(result, config, int(info["kv_blocks"]), int(info["kv_host_blocks"]))


def predict(served: ServedRun, profile: CpuProfile, load: LoadPlan, *, params: CostParams | None = None,
            hardware: Hardware | None = None) -> SimulationResult:
    """The simulator's run of the served one: same engine config, blocks, load and requests (`params`/`hardware`
    replace the fitted ones: the test's deliberately wrong term). The fitted Hardware is model B's
    (`CpuProfile.hardware_for`)."""
    records = sorted(served.result.records, key=lambda r: r.index)
    requests = [SimRequest(r.prompt_tokens or load.input_len, r.output_tokens or load.output_len,
                           r.output_tokens or load.output_len) for r in records]
    spec = predicted_spec(profile)
    config = SimulationConfig(engine=served.config, model=spec, accelerator="cpu", bench=served.result.config,
                              num_kv_blocks=served.kv_blocks, num_host_blocks=served.kv_host_blocks,
                              cost=params or profile.params, hardware=hardware or profile.hardware_for(spec))
    return simulate(config, requests)


def cpu_source_rows(served: ServedRun, predicted: SimulationResult, load: LoadPlan) -> list[CpuSourceRow]:
    """Measured vs predicted: mean TTFT, mean TPOT, output tok/s of the predicted run."""
    real = compute_metrics(served.result.records, served.result.duration_s)
    sim = compute_metrics(predicted.bench.records, predicted.bench.duration_s)
    source = (f"cpu engine, model B ({PREDICTED_MODEL['num_layers']} layers, hidden {PREDICTED_MODEL['hidden_size']}"
              f"), {load.users} users, {load.input_len} in / {load.output_len} out")
    return [CpuSourceRow(source, "TTFT mean (ms)", real.ttft_ms.mean, sim.ttft_ms.mean),
            CpuSourceRow(source, "TPOT mean (ms)", real.tpot_ms.mean, sim.tpot_ms.mean),
            CpuSourceRow(source, "output tok/s", real.output_throughput, sim.output_throughput)]


def predicted_spec(profile: CpuProfile) -> ModelSpec:
    """Model B as the engine loads it (the dummy writer's special ids, which model A's load shows)."""
    return model_spec(PREDICTED_MODEL).model_copy(update={"bos_token_id": profile.model.bos_token_id,
                                                          "eos_token_id": profile.model.eos_token_id})


def fitted_terms(profile: CpuProfile) -> list[FittedTerm]:
    plan = profile.plan
    on = (f"fitted on model A ({profile.model.num_layers} layers, hidden {profile.model.hidden_size}, "
          f"{profile.model.dtype}), batch {min(plan.batches)}-{max(plan.batches)}, prompts "
          f"{'/'.join(map(str, plan.prompt_lengths))}, {profile.threads} torch thread(s)")
    hw, p = profile.hardware, profile.params
    model_b = predicted_spec(profile)

    def measured(spec: ModelSpec) -> str:
        return f"measured with the fit: the memory curve at {weight_bytes(spec) / 1e6:.0f} MB ({CURVE_ROWS} rows)"

    return [FittedTerm("bandwidth_gbps", hw.bandwidth_gbps, "GB/s", "> 0", measured(profile.model)),
            FittedTerm("bandwidth_gbps, model B", profile.hardware_for(model_b).bandwidth_gbps, "GB/s", "> 0",
                       measured(model_b)),
            FittedTerm("tflops", hw.tflops, "TFLOP/s", "> 0", on),
            FittedTerm("launch_us_per_layer", p.launch_us_per_layer, "us", f"<= {LAUNCH_US_PER_LAYER_BOUND:g}", on),
            FittedTerm("per_seq_host_ms", p.per_seq_host_ms, "ms", f"<= {PER_SEQ_HOST_MS_BOUND:g}", on)]


def run_cpu_calibration(workdir: Path, load: LoadPlan | None = None, *, profile: CpuProfile | None = None,
                        threads: int | None = None) -> CpuCalibration:
    """Fits the profile on model A (unless given), serves model B under `load` halfway through the fit's rounds (so
    both see the shared machine alike), predicts it."""
    load = load or LoadPlan()
    model_dir = write_dummy_model(model_spec(PREDICTED_MODEL), workdir / "cpu-predicted-model", seed=load.seed)
    runs: list[ServedRun] = []

    def serve() -> None:
        runs.append(measure_served(model_dir, load, threads or (profile.threads if profile else THREADS)))

    if profile is None:
        profile = fit_cpu_profile(workdir, threads=threads or THREADS, between=serve)
    else:
        serve()
    served = runs[0]
    return CpuCalibration(profile, served, predict(served, profile, load), load)


def median_abs_error(rows: list[CpuSourceRow]) -> float:
    return statistics.median(abs(r.error) for r in rows)


def cpu_report(calibration: CpuCalibration) -> str:
    """The calibration as text: each term with its bound and source, the memory curve, the fit's in-sample residuals
    and the prediction table (benchmarks/cpu_calibration.py, the test's `-s` output)."""
    profile = calibration.profile
    lines = ["CPU profile (bandwidth measured, the rest fitted; efficiency 1.0: the figures are the CPU's whole)",
             f"  {'term':22s} {'value':>10s} {'unit':8s} {'bound':10s} source"]
    for term in calibration.terms:
        lines.append(f"  {term.name:22s} {term.value:10.4g} {term.unit:8s} {term.bound:10s} {term.source}")
    curve = profile.memory
    points = zip(curve.sizes, curve.gbps, strict=True)
    lines += ["", f"Memory curve (F.linear of {CURVE_ROWS} rows over 4 MiB float32 matrices, the fit's rounds' median)",
              "  " + "  ".join(f"{size / 2**20:.0f} MiB {gbps:.1f}" for size, gbps in points) + " GB/s"]
    lines += ["", f"In sample (model A's steps; median |error| {profile.median_abs_error:.1%})",
              f"  {'step':26s} {'measured ms':>12s} {'model ms':>10s} {'error':>8s}"]
    for r in profile.residuals:
        lines.append(f"  {r.label:26s} {r.measured_s * 1e3:12.2f} {r.predicted_s * 1e3:10.2f} {r.error:+8.1%}")
    rows = calibration.rows
    lines += ["", f"Predicted out of sample: {rows[0].source}; KV blocks {calibration.served.kv_blocks} (the "
              f"engine's /info); median |error| {median_abs_error(rows):.1%}, worst "
              f"{max(abs(r.error) for r in rows):.1%} (targets 15% / 25%)",
              f"  {'figure':16s} {'measured':>10s} {'predicted':>10s} {'error':>8s}"]
    for row in rows:
        lines.append(f"  {row.figure:16s} {row.measured:10.2f} {row.predicted:10.2f} {row.error:+8.1%}")
    return "\n".join(lines)
