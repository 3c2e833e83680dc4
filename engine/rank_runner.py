"""One rank's model runner, built the same way on rank 0 and on the others: the backend on the rank's card, the
distributed world (when there are several ranks), the rank's slice of the weights, the KV plan every rank agrees
on, the runner.

KV sizing with `npuMemSize` -1 on a device (MindIE's behaviour): after the weights are loaded, a warm-up prefill
of `maxPrefillTokens` tokens runs over a few scratch blocks; the free memory measured then, times
NPU_MEMORY_FRACTION, less the warm-up's peak where the backend measures it (npu: it empties its allocator's cache
before reading free memory, so the peak is set aside explicitly; elsewhere the warm-up's blocks stay cached and
count as used), is the KV budget. Every rank plans its own and all take the smallest, so the scheduler's blocks exist
on every card. On npu the engine runs `npuserve doctor`'s start-up checks on the rank's card first.

The batch the KV pool's CPU cap and the decode graphs are sized for is the config's `batch_size_limit`
(`npuserve.maxBatchSizeLimit`, else `maxBatchSize`): every maxBatchSize a live schedule may set runs with the same
KV room and replays a graph.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from npuserve.engine.backends import Backend, get_backend
from npuserve.engine.model.base import CausalLM
from npuserve.engine.model.loader import TORCH_DTYPES, load_model
from npuserve.engine.model.served_scheme import served_spec
from npuserve.engine.parallel.comm import SINGLE_RANK, TensorParallel, connect
from npuserve.engine.parallel.layout import TPLayout
from npuserve.engine.parallel.step_message import StepChannel
from npuserve.engine.runner import KVPlan, ModelRunner, plan_kv_blocks
from npuserve.engine_contract import RankInfo
from npuserve.mindie_config import EngineEnvironment, MindIEConfig, NpuserveExtensions
from npuserve.modelspec import ModelSpec

log = logging.getLogger(__name__)


@dataclass(slots=True)
class BuiltRank:
    spec: ModelSpec
    backend: Backend
    dtype: torch.dtype
    model: CausalLM
    kv_plan: KVPlan
    runner: ModelRunner
    tp: TensorParallel
    channel: StepChannel | None  # several ranks: rank 0 sends on it, the others receive
    load_seconds: float
    ranks: list[RankInfo]  # every rank's place and own KV plan before the agreement, by rank


def _profile_activations(model: CausalLM, backend: Backend, dtype: torch.dtype, config: MindIEConfig) -> int:
    """A prefill of the largest step the scheduler may run, over scratch blocks, so that the KV budget leaves room
    for its activations: their peak in bytes where the backend measures it, else 0 (its blocks then stay in the
    allocator's cache, counted as used)."""
    schedule = config.schedule
    max_seq_len = config.BackendConfig.ModelDeployConfig.maxSeqLen
    tokens = max(1, min(schedule.maxPrefillTokens, max_seq_len - 1, model.spec.max_position_embeddings - 1))
    blocks = math.ceil((tokens + 2) / schedule.cacheBlockSize)
    scratch = KVPlan(blocks, 0, schedule.cacheBlockSize, 0, "warm-up scratch")
    runner = ModelRunner(model, backend, scratch, dtype, max_seq_len=max_seq_len)
    peak = backend.measure_peak(lambda: runner.warmup(tokens))
    backend.synchronize()
    return peak


def _agree(plan: KVPlan, tp: TensorParallel, node_rank: int = 0) -> tuple[KVPlan, list[RankInfo]]:
    """Every rank takes the smallest rank's block counts; returns the agreed plan and each rank's own (for /info),
    gathered on the host group."""
    own = RankInfo(rank=tp.rank, node_rank=node_rank, host=socket.gethostname(), kv_blocks=plan.num_blocks,
                   kv_host_blocks=plan.num_host_blocks)
    if tp.world_size == 1:
        return plan, [own]
    import torch.distributed as dist

    gathered: list[object] = [None] * tp.world_size
    dist.all_gather_object(gathered, own.model_dump(), group=tp.control)
    ranks = sorted((RankInfo.model_validate(r) for r in gathered), key=lambda r: r.rank)
    blocks, host = min(r.kv_blocks for r in ranks), min(r.kv_host_blocks for r in ranks)
    if (blocks, host) == (plan.num_blocks, plan.num_host_blocks):
        return plan, ranks
    return dataclasses.replace(plan, num_blocks=blocks, num_host_blocks=host,
                               source=f"{plan.source}; the smallest of the {tp.world_size} ranks"), ranks


def build_rank_runner(config: MindIEConfig, model_dir: str | Path, *, seed: int, rank: int = 0,
                      init_method: str | None = None, env: EngineEnvironment | None = None,
                      num_kv_blocks: int | None = None, num_host_blocks: int | None = None,
                      cards_per_pod: int | None = None, store: object = None) -> BuiltRank:
    """Rank `rank`'s runner. `cards_per_pod`: the ranks of one pod when the replica spans pods (the rank's card
    and its NUMA share are numbered within its pod: local index rank % cards_per_pod); `store`: the world's
    TCPStore where this process made it (a group's leader), instead of `init_method`."""
    env = env or EngineEnvironment.from_environ()
    ext = config.npuserve or NpuserveExtensions()
    folder = Path(model_dir)
    # the engine config's npuserve.quantization against the checkpoint (or the dummy weights' scheme)
    spec = served_spec(ModelSpec.from_pretrained(folder), ext.quantization, ext.loadFormat == "dummy")
    world_size = config.model.worldSize
    per_pod = cards_per_pod or world_size
    local_rank, node_rank = rank % per_pod, rank // per_pod
    layout = TPLayout.of(spec, rank, world_size)  # before anything is loaded: a model that does not split fails fast
    ids = config.BackendConfig.npuDeviceIds[0] if config.BackendConfig.npuDeviceIds else None
    backend = get_backend(ext.device, local_rank, ids)  # npuDeviceIds number the pod's own cards
    if backend.name == "npu":  # npuserve doctor's op checks and smoke tests on this rank's card, before anything loads
        from npuserve.engine.backends.npu import NPUBackend
        from npuserve.engine.doctor import preflight

        assert isinstance(backend, NPUBackend)
        preflight(backend, spec)
    tp, channel = SINGLE_RANK, None
    if world_size > 1:
        if init_method is None and store is None:
            raise ValueError(f"worldSize {world_size} needs the ranks' rendezvous address")
        tp = connect(rank, world_size, init_method, backend.dist_backend, store=store)
        channel = StepChannel(tp.control)
    dtype = TORCH_DTYPES[spec.dtype if ext.dtype == "auto" else ext.dtype]
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    load_format = "dummy" if ext.loadFormat == "dummy" else "safetensors"
    model = load_model(spec, folder, dtype, backend.device, load_format, seed=seed, layout=layout, tp=tp)
    backend.prepare_model(model)
    load_seconds = time.perf_counter() - t0
    schedule = config.schedule
    activations = 0
    if config.model.npuMemSize <= 0 and backend.name != "cpu" and num_kv_blocks is None:
        activations = _profile_activations(model, backend, dtype, config)
    plan = plan_kv_blocks(
        spec, backend, block_size=schedule.cacheBlockSize, dtype=dtype, npu_mem_size_gib=config.model.npuMemSize,
        cpu_mem_size_gib=config.model.cpuMemSize, max_batch_size=config.batch_size_limit,
        max_seq_len=config.BackendConfig.ModelDeployConfig.maxSeqLen, memory_fraction=env.npu_memory_fraction,
        world_size=world_size, activation_bytes=activations,
    )
    if num_kv_blocks is not None or num_host_blocks is not None:  # tests and benchmarks pin the pool sizes
        plan = dataclasses.replace(
            plan, num_blocks=plan.num_blocks if num_kv_blocks is None else num_kv_blocks,
            num_host_blocks=plan.num_host_blocks if num_host_blocks is None else num_host_blocks,
            source="set by the caller")
    plan, ranks = _agree(plan, tp, node_rank)
    runner = ModelRunner(model, backend, plan, dtype, ext.logprobsMode, channel=channel if rank == 0 else None,
                         graph_batch_size=config.batch_size_limit,
                         max_seq_len=config.BackendConfig.ModelDeployConfig.maxSeqLen)
    return BuiltRank(spec, backend, dtype, model, plan, runner, tp, channel, load_seconds, ranks)
