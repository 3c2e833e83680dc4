"""The model runner: owns the model and the paged KV cache, runs one scheduler step, samples on the device.

It takes a `StepInput` (tensors and plain per-row values: `step_input.py`), which the step builder makes from the
scheduled sequences on the scheduler's side; it never reads a `Sequence` or a grammar. Swaps are block copies
between the device cache and a host cache of the same layout, done before the model runs (swap out first, then
swap in). A fork's copy-on-write block copies are device-to-device; they come in the step after the one that
forked and are done first, before the swaps and the forward, so nothing reuses a block before it is copied. One
`execute` per step does it all (`move_blocks` alone when a step has moves but nothing to run).

A sequence about to fork (n > 1, at its first prefill) gets its last logits row repeated once per choice
(`sample_rows`), each row sampled with that choice's seed. Prompt logprobs, when a sequence asks for them at its
first prefill, are computed from the hidden states of every prompt position (in the step's chunks), on the device;
only the prompt tokens' logprobs and ranks, and the top k, leave it.

Tensor parallel: rank 0's runner holds a `StepChannel` and sends each operation (forward, swap, block copy) to the
other ranks before doing it; their runners `follow` it: the same forward over their slice of the model and of the
KV heads, the same logits rows (gathered to rank 0), the same block copies on their own caches. Only rank 0
samples. A forward travels as a delta against every rank's mirror of the batch's rows (`parallel/batch_delta.py`):
rank 0's step builder makes it with the runner's `delta_sender`, and every rank builds its flat batch from its
mirror the same way.

Each runner records the operation it last started (`progress`): the step watchdog and a fatal error name it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch

from npuserve.engine.backends.base import Backend
from npuserve.engine.batch import FlatBatch, ScratchRow, build_decode, build_prefill
from npuserve.engine.decode_graphs import DecodeGraphs
from npuserve.engine.guided_mask import apply_bitmask
from npuserve.engine.model.base import CausalLM
from npuserve.engine.parallel.batch_delta import BatchKind, BatchMirror, DeltaSender
from npuserve.engine.parallel.step_message import Op, StepChannel, StepMessage
from npuserve.engine.sampler import Sampler, SamplerOutput
from npuserve.engine.sequence import PromptLogprob, SamplingParams
from npuserve.engine.step_input import PromptLogprobChunk, StepInput
from npuserve.mindie_config import LogprobsMode
from npuserve.modelspec import ModelSpec

log = logging.getLogger(__name__)

GiB = 1024**3


@dataclass(frozen=True, slots=True)
class KVPlan:
    num_blocks: int
    num_host_blocks: int
    block_size: int
    bytes_per_block: int
    source: str  # how num_blocks was chosen, for the log and /info


def plan_kv_blocks(
    spec: ModelSpec,
    backend: Backend,
    *,
    block_size: int,
    dtype: torch.dtype,
    npu_mem_size_gib: int,
    cpu_mem_size_gib: int,
    max_batch_size: int,
    max_seq_len: int,
    memory_fraction: float = 0.8,
    world_size: int = 1,
    activation_bytes: int = 0,
) -> KVPlan:
    """KV blocks on the device and on the host.

    `npuMemSize` > 0: that many GiB. -1 (auto): free memory x NPU_MEMORY_FRACTION, less `activation_bytes` (a
    warm-up's peak, which the backend measured: `Backend.measure_peak`); on the CPU backend no more
    than `max_batch_size x maxSeqLen` tokens can use (plus one block per sequence of slack; `max_batch_size` is
    the largest batch the engine may run, npuserve.maxBatchSizeLimit, not the start-up one), and never more than
    half of the host's available memory, so a development box is not swallowed by the cache. Host (swap) blocks
    from `cpuMemSize` GiB, likewise capped on the CPU by what the batch could use. Blocks are per rank: a block
    holds this rank's KV heads (`world_size`), and on the CPU the ranks share the host's memory.
    """
    per_block = spec.kv_bytes_per_block(block_size, world_size=world_size, dtype=str(dtype).removeprefix("torch."))
    usable_blocks = max_batch_size * (math.ceil(max_seq_len / block_size) + 1)
    if npu_mem_size_gib > 0:
        num_blocks = (npu_mem_size_gib * GiB) // per_block
        source = f"npuMemSize {npu_mem_size_gib} GiB"
    else:
        free = backend.memory_info().free_bytes
        budget = int(free * memory_fraction) - activation_bytes
        if backend.name == "cpu":
            budget = min(budget, free // 2) // world_size
        num_blocks = max(0, budget) // per_block
        source = f"auto: {memory_fraction:.2f} of {free / GiB:.1f} GiB free"
        if activation_bytes:
            source += f", less the warm-up's {activation_bytes / GiB:.2f} GiB peak"
        if backend.name == "cpu" and num_blocks > usable_blocks:
            num_blocks = usable_blocks
            source += (f", capped at {max_batch_size} requests (npuserve.maxBatchSizeLimit, else maxBatchSize) x "
                       f"maxSeqLen {max_seq_len} ({usable_blocks} blocks)")
    host_blocks = (cpu_mem_size_gib * GiB) // per_block
    if backend.name == "cpu":
        host_blocks = min(host_blocks, usable_blocks)
    if num_blocks < 1:
        raise MemoryError(f"no room for a single KV block of {per_block} bytes ({source})")
    return KVPlan(int(num_blocks), int(host_blocks), block_size, per_block, source)


def _block_tensors(caches: list[Any]) -> list[torch.Tensor]:
    """The tensors `Backend.copy_blocks` moves blocks of, each with the block axis at 1: the dense caches as they
    are, each MLA layer's latent and rope caches as `(1, blocks, ...)` views (a copy into a view lands in the cache)."""
    tensors: list[torch.Tensor] = []
    for cache in caches:
        if isinstance(cache, torch.Tensor):
            tensors.append(cache)
        else:
            tensors.extend(part.unsqueeze(0) for part in cache)
    return tensors


@dataclass(slots=True)
class OperationProgress:
    """The operation a runner last started, numbered (on rank 0 the number of operations sent to the other ranks
    so far), and how far it got: "sending" it to the other ranks, "running" it, or "done". Written by the step
    thread only; other threads (the watchdog) read it, and a torn read shows a stale name at worst."""

    op: str = "no operation yet"  # the step message's operation (FORWARD, SWAP, COPY, CAPTURE)
    detail: str = ""
    number: int = 0
    phase: str = "done"
    started: float = 0.0  # time.monotonic()

    def start(self, op: str, detail: str, phase: str) -> None:
        self.op, self.detail, self.phase, self.started = op, detail, phase, time.monotonic()
        self.number += 1

    @property
    def name(self) -> str:
        return self.op if self.number == 0 else f"{self.op} #{self.number}"

    def describe(self, now: float | None = None) -> str:
        if self.number == 0:
            return self.name
        ago = (time.monotonic() if now is None else now) - self.started
        state = {"sending": "while sending it to the other ranks", "running": "and has not finished it",
                 "done": "and finished it"}.get(self.phase, self.phase)
        detail = f" ({self.detail})" if self.detail else ""
        return f"{self.name}{detail}, started {ago:.1f} s ago {state}"


class ModelRunner:
    def __init__(self, model: CausalLM, backend: Backend, plan: KVPlan, kv_dtype: torch.dtype,
                 logprobs_mode: LogprobsMode = "processed_logprobs", channel: StepChannel | None = None,
                 graph_batch_size: int = 0, max_seq_len: int = 0) -> None:
        """`graph_batch_size` > 0 (with `max_seq_len`): decode graphs up to that batch when the backend has them;
        their pad rows write into one scratch KV block past the plan's, which the KV manager never hands out."""
        self.model = model
        self.spec = model.spec
        self.backend = backend
        self.block_size = plan.block_size
        self.num_blocks = plan.num_blocks
        self.num_host_blocks = plan.num_host_blocks
        self.num_kv_heads = model.layout.kv_heads  # this rank's
        self.channel = channel  # rank 0 of several: where each operation goes to the other ranks first
        # rank 0 of several: the forward's delta and batch (the step builder's too); the other ranks: their mirror
        self.delta_sender = DeltaSender() if channel is not None else None
        self.mirror = BatchMirror()
        # no decode graphs for latent attention yet: they are captured over the dense cache's kernels
        graphs = graph_batch_size > 0 and self.spec.mla is None and backend.new_decode_graph() is not None
        backend.configure(block_size=plan.block_size, head_dim=self.spec.head_dim,
                          max_seq_len=max_seq_len or self.spec.max_position_embeddings)
        self.kv_dtype = kv_dtype
        # per layer: the dense (2, blocks, block_size, kv_heads, head_dim) tensor, or MLA's (latent, rope) pair
        self.kv_caches: list[Any] = self._allocate(plan.num_blocks + int(graphs), None)
        self._kv_blocks = _block_tensors(self.kv_caches)
        self.decode_graphs: DecodeGraphs | None = None
        if graphs:
            self.decode_graphs = DecodeGraphs(model, backend, max_batch_size=graph_batch_size,
                                              max_blocks_per_seq=math.ceil(max_seq_len / plan.block_size),
                                              block_size=plan.block_size, scratch_block=plan.num_blocks)
        self._host_kv_caches: list[Any] | None = None  # allocated at the first swap-out
        self._host_kv_blocks: list[torch.Tensor] = []
        model.bind_backend(backend)  # attention layers and MoE blocks
        for layer, cache in zip(model.attention_layers(), self.kv_caches, strict=True):
            layer.kv_cache = cache
        self.sampler = Sampler(logprobs_mode)
        self.progress = OperationProgress()

    # --- one step -----------------------------------------------------------------------------------------------

    def _allocate(self, num_blocks: int, device: torch.device | None) -> list[Any]:
        mla = self.spec.mla
        if mla is not None:
            return list(self.backend.allocate_mla_cache(self.spec.num_layers, num_blocks, self.block_size,
                                                        mla.kv_lora_rank, mla.qk_rope_head_dim, self.kv_dtype,
                                                        device=device))
        return self.backend.allocate_kv_cache(self.spec.num_layers, num_blocks, self.block_size, self.num_kv_heads,
                                              self.spec.head_dim, self.kv_dtype, device=device)

    @property
    def host_kv_caches(self) -> list[Any]:
        """The host (swap) cache, same layout as the device one; allocated on first use."""
        if self._host_kv_caches is None:
            if not self.num_host_blocks:
                raise RuntimeError("a swap was planned but no host KV blocks exist (cpuMemSize 0)")
            self._host_kv_caches = self._allocate(self.num_host_blocks, torch.device("cpu"))
            self._host_kv_blocks = _block_tensors(self._host_kv_caches)
        return self._host_kv_caches

    @property
    def host_kv_blocks(self) -> list[torch.Tensor]:
        """`host_kv_caches` as `copy_blocks` takes them (`_block_tensors`)."""
        self.host_kv_caches  # noqa: B018 (allocates on first use)
        return self._host_kv_blocks

    def _begin(self, msg: StepMessage, detail: str) -> None:
        """Records the operation, then sends it to the other ranks (rank 0 of several) before running it here."""
        self.progress.start(msg.op.name, detail, "sending" if self.channel is not None else "running")
        if self.channel is not None:
            self.channel.send(msg)
            self.progress.phase = "running"

    def move_blocks(self, copies: Seq[tuple[int, int]], swap_out: Seq[tuple[int, int]],
                    swap_in: Seq[tuple[int, int]]) -> None:
        """A step's block moves, in order: fork copies (device -> device), swap out, swap in."""
        self._move_blocks(copies, swap_out, swap_in)

    def _move_blocks(self, copies: Seq[tuple[int, int]], swap_out: Seq[tuple[int, int]],
                     swap_in: Seq[tuple[int, int]]) -> None:
        if copies:
            self._begin(StepMessage(Op.COPY, pairs=list(copies)), f"{len(copies)} blocks")
            self.backend.copy_blocks(self._kv_blocks, self._kv_blocks, list(copies))
            self.progress.phase = "done"
        if swap_out or swap_in:
            self._begin(StepMessage(Op.SWAP, pairs=list(swap_out), pairs_in=list(swap_in)),
                        f"{len(swap_out)} blocks out, {len(swap_in)} in")
            self._swap(swap_out, swap_in)
            self.progress.phase = "done"

    def _swap(self, swap_out: Seq[tuple[int, int]], swap_in: Seq[tuple[int, int]]) -> None:
        if swap_out:
            self.backend.copy_blocks(self._kv_blocks, self.host_kv_blocks, list(swap_out))
        if swap_in:
            self.backend.copy_blocks(self.host_kv_blocks, self._kv_blocks, list(swap_in))

    @torch.inference_mode()
    def follow(self, msg: StepMessage) -> None:
        """A rank other than 0: rank 0's operation on this rank's slice (the logits gathered to rank 0)."""
        self.progress.start(msg.op.name, "", "running")
        if msg.op is Op.FORWARD:
            assert msg.delta is not None
            batch = self.mirror.build(msg.delta, self.block_size, self.backend.device)
            hidden = self._forward(batch)
            self.model.compute_logits(hidden.index_select(0, batch.logits_indices))
            for lo, hi in msg.logit_rows:
                self.model.compute_logits(hidden[lo:hi])
        elif msg.op is Op.SWAP:
            self._swap(msg.pairs, msg.pairs_in)
        elif msg.op is Op.COPY:
            self.backend.copy_blocks(self._kv_blocks, self._kv_blocks, list(msg.pairs))
        elif msg.op is Op.CAPTURE:
            self.capture_graphs()
        self.progress.phase = "done"

    def _forward(self, batch: FlatBatch) -> torch.Tensor:
        """The model's hidden states: a captured decode graph's when one holds the batch, else eagerly."""
        hidden = self.decode_graphs.run(batch) if self.decode_graphs is not None else None
        if hidden is None:
            hidden = self.model(batch.input_ids, batch.positions, batch.meta)
        return hidden

    def capture_graphs(self) -> None:
        """Captures the decode graphs (every rank at once: the all-reduces are captured too)."""
        if self.decode_graphs is not None:
            if self.channel is not None or self.progress.phase != "running":  # rank 0, or alone (not following)
                self._begin(StepMessage(Op.CAPTURE), "decode graphs")
            self.decode_graphs.capture()
            self.progress.phase = "done"

    @torch.inference_mode()
    def execute(self, step: StepInput) -> SamplerOutput:
        """The step's block moves, then the model over its batch; samples one token per sampled row, in order."""
        self._move_blocks(step.block_copies, step.swap_out, step.swap_in)
        batch = step.batch
        chunks = step.prompt_logprob_chunks
        seqs, kind = len(batch.meta.query_start) - 1, "prefill" if batch.meta.is_prefill else "decode"
        if self.channel is not None and step.delta is None:
            raise RuntimeError("a tensor-parallel step needs its batch as a delta (StepBuilder with delta_sender)")
        self._begin(StepMessage(Op.FORWARD, delta=step.delta, logit_rows=[(c.row_lo, c.row_hi) for c in chunks]),
                    f"{kind}: {seqs} sequence{'s' * (seqs != 1)}, {batch.input_ids.numel()} tokens")
        hidden = self._forward(batch)
        logits = self.model.compute_logits(hidden.index_select(0, batch.logits_indices))
        prompt_logprobs = self._prompt_logprobs(step, hidden) if step.computes_prompt else {}
        if step.guided_bitmask is not None:  # structured output: the grammar's mask, before sampling
            apply_bitmask(logits, step.guided_rows, step.guided_bitmask)
        if step.sample_rows is not None:  # a forking prefill: its (masked) row once per choice
            logits = logits.index_select(0, torch.tensor(step.sample_rows, device=logits.device))
        out = self.sampler(logits, step.params, step.positions, step.seeds, step.history)
        out.prompt_logprobs = prompt_logprobs
        self.progress.phase = "done"
        return out

    def _prompt_logprobs(self, step: StepInput, hidden: torch.Tensor) -> dict[int, list[PromptLogprob]]:
        """seq_id -> the logprobs of the prompt tokens this step's rows predict (raw distribution), following those
        the sequence already has: tokens 1..L-1 in all, over one prefill or its chunks."""
        result: dict[int, list[PromptLogprob]] = {seq_id: [] for seq_id in step.prompt_logprob_seq_ids}
        for c in step.prompt_logprob_chunks:
            result.setdefault(c.seq_id, []).extend(self._chunk_logprobs(c, hidden))
        return result

    def _chunk_logprobs(self, c: PromptLogprobChunk, hidden: torch.Tensor) -> list[PromptLogprob]:
        lp = torch.log_softmax(self.model.compute_logits(hidden[c.row_lo : c.row_hi]).float(), dim=-1)
        targets = torch.tensor(c.targets, device=lp.device).unsqueeze(1)
        token_lp = lp.gather(1, targets)
        ranks = (lp > token_lp).sum(dim=-1) + 1
        tops: list[tuple[tuple[int, float], ...]] = [()] * (c.row_hi - c.row_lo)
        if c.top_k:
            values, ids = lp.topk(min(c.top_k, lp.shape[1]), dim=-1)
            tops = [tuple(zip(r_ids, r_vals, strict=True))
                    for r_ids, r_vals in zip(ids.tolist(), values.tolist(), strict=True)]
        return [PromptLogprob(lp_, rank, top)
                for lp_, rank, top in zip(token_lp.squeeze(1).tolist(), ranks.tolist(), tops, strict=True)]

    def _scratch_step(self, row: ScratchRow, kind: BatchKind, position: int) -> StepInput:
        greedy, device = [SamplingParams(temperature=0.0)], self.backend.device
        if self.delta_sender is not None:
            delta, batch = self.delta_sender.build([row], kind, self.block_size, device)
            return StepInput(batch, greedy, [position], [None], delta=delta)
        batch = build_decode([row], self.block_size, device) if kind is BatchKind.DECODE else \
            build_prefill([row], self.block_size, device)
        return StepInput(batch, greedy, [position], [None])

    # --- warm-up ------------------------------------------------------------------------------------------------

    def warmup(self, num_tokens: int = 16) -> None:
        """A prefill and a decode over scratch blocks before serving (the cache holds nothing yet), then the decode
        graphs' capture."""
        num_tokens = max(1, min(num_tokens, self.num_blocks * self.block_size - 1))
        blocks = list(range(math.ceil((num_tokens + 1) / self.block_size)))
        row = ScratchRow([1] * num_tokens, blocks)
        self.execute(self._scratch_step(row, BatchKind.PREFILL, num_tokens))
        row = ScratchRow([1] * (num_tokens + 1), blocks, num_cached_tokens=num_tokens)
        self.execute(self._scratch_step(row, BatchKind.DECODE, num_tokens + 1))
        self.capture_graphs()  # every bucket runs once before it is captured
        self.backend.synchronize()
