"""A KV-starved run, as real engines show it (docs/simulator.md#a-kv-starved-run): a cache too small for the batch caps
the running batch at what the cache holds, whatever maxBatchSize says; past that cap a larger maxBatchSize buys no
throughput, sequences are preempted (and recomputed), and the throughput is a fraction of what the same engine does
with a cache that holds the batch. GPUStack's Qwen3-8B 32K-prompt run on one 910B (9 tok/s: about 290K tokens of cache
against 3.2M asked for) and the MindIE guide's maxBatchSize sweeps are such runs.

The numbers written out: LLaMA3-8B's KV is 2 x 32 layers x 8 KV heads x 128 x 2 bytes = 128 KiB per token, a block
of 128 tokens 16 MiB; a request of 3000 prompt and 1000 output tokens ends at 4000 tokens = 32 blocks (24 for its
prompt). 300 blocks hold 12 prompts, at most 9 requests at full length: the running batch cannot pass 12.
"""

from __future__ import annotations

import pytest

from npuserve.loadgen.metrics import compute_metrics
from npuserve.sim.cost_model import FITTED_COST_PARAMS
from npuserve.sim.engine import SimulationResult, simulate
from npuserve.sim.published import Lengths, PublishedPoint, point_config, point_requests

STARVED_BLOCKS, AMPLE_BLOCKS = 300, 100_000
BATCHES = (8, 16, 32, 64)


def run(blocks: int, max_batch: int) -> SimulationResult:
    point = PublishedPoint("kv-starved", "test", "written out", "llama3-8b", "ascend-910b3", 1, "mindie",
                           Lengths("fixed", 3000, 1000), 96, {}, max_batch=max_batch, max_prefill_tokens=16384,
                           max_prefill_batch=max_batch, concurrency=64)
    return simulate(point_config(point, FITTED_COST_PARAMS, blocks=blocks), point_requests(point))


def figures(result: SimulationResult) -> tuple[float, float, int]:
    """(output tok/s, mean running batch of a decode step, preemptions)."""
    metrics = compute_metrics(result.bench.records, result.bench.duration_s)
    batches = [r.server.mean_decode_batch_size for r in result.bench.measured
               if r.server is not None and r.server.mean_decode_batch_size is not None]
    return metrics.output_throughput, sum(batches) / len(batches), result.num_preemptions


@pytest.fixture(scope="module")
def sweeps() -> dict[int, dict[int, tuple[float, float, int]]]:
    return {blocks: {b: figures(run(blocks, b)) for b in BATCHES} for blocks in (STARVED_BLOCKS, AMPLE_BLOCKS)}


def test_the_cache_caps_the_running_batch(sweeps: dict[int, dict[int, tuple[float, float, int]]]) -> None:
    starved, ample = sweeps[STARVED_BLOCKS], sweeps[AMPLE_BLOCKS]
    for b in BATCHES[1:]:
        assert starved[b][1] <= 12  # 300 blocks / 24 blocks per prompt
        assert ample[b][1] > 0.75 * b  # the same schedule with room: the batch fills


def test_past_the_cap_a_larger_batch_buys_nothing_and_sequences_are_preempted(
        sweeps: dict[int, dict[int, tuple[float, float, int]]]) -> None:
    starved, ample = sweeps[STARVED_BLOCKS], sweeps[AMPLE_BLOCKS]
    assert all(starved[b][2] > 0 for b in (32, 64))  # preempted (recomputed) past the cap
    assert all(ample[b][2] == 0 for b in BATCHES)
    assert max(starved[b][0] for b in (16, 32, 64)) <= 1.05 * starved[16][0]  # flat past the cap
    # with room the throughput keeps rising with the batch; starved, it is a fraction of that
    assert ample[64][0] > 1.5 * ample[16][0]
    assert starved[64][0] < 0.5 * ample[64][0]
