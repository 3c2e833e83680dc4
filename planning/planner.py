"""The plan: the MindIE tuning guide's arithmetic, automated (docs/planning.md#the-steps). Pure: spec + catalogs ->
Plan.

Every number the plan holds is appended to `Plan.explain` with its formula and inputs, so `kubectl describe` and
`npuserve plan` explain themselves. Memory is counted in GiB (2^30 bytes): the guide's "GB" are `npu-smi`'s MB
divided by 1024. Arithmetic on memory is exact (fractions), so a floor never lands one short on a rounding error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from pydantic import ValidationError

from npuserve.catalog.accelerators import GIB, get_accelerator
from npuserve.catalog.models import get_model_preset
from npuserve.engine_contract import NPU_MEMORY_FRACTION_ENV, SCHEDULE_FIELD_BY_NAME, unservable
from npuserve.mindie_config import (
    DEFAULT_MAX_PREFILL_TOKENS,
    ScheduleSection,
)
from npuserve.modelspec import MLASpec, ModelSpec, MoESpec
from npuserve.npu_contract import NPU_BLOCK_RULE, NPU_MLA_BLOCK_RULE, block_size_problem
from npuserve.planning.api import (
    NOT_QUANTIZED,
    Architecture,
    ExplainEntry,
    InferenceServiceSpec,
    Plan,
    PlanSchedule,
    Range,
)

# Used when the catalog has no idle-memory measurement for the card and the spec sets no reservedGiB: the guide
# measured 3.4 GiB held at idle on a 64 GiB 910B3; rounded up so the plan errs on the side of fitting.
DEFAULT_RESERVED_GIB = 4.0
DEFAULT_CACHE_BLOCK_SIZE = 128
DEFAULT_CPU_MEM_SIZE_GIB = 5
MINDIE_MAX_BATCH_SIZE = 5000  # MindIE's documented upper bound of maxBatchSize
PREFILL_TOKENS_CAP = DEFAULT_MAX_PREFILL_TOKENS  # 8192, the guide's cap on maxPrefillTokens
MIN_BATCH = 1  # worldSize search: the pool must hold at least this many requests of maximum length
MAX_REPLICAS = 10000  # spec.replicas' upper bound


def planned_prefill_tokens(prefill_batch: int, mean_input_tokens: int, max_input_tokens: int) -> int:
    """maxPrefillTokens by the guide's rule (step 5): min(8192, maxPrefillBatchSize x mean input), raised to
    maxInputTokens so the longest prompt can prefill. The tuner applies the same rule at each batch it tries."""
    return max(max_input_tokens, min(PREFILL_TOKENS_CAP, prefill_batch * mean_input_tokens))


class PlanError(ValueError):
    """The spec cannot be planned; the message says which field to change."""


@dataclass(frozen=True)
class _Memory:
    world_size: int
    npu_mem_size_gib: int
    block_bytes: int
    total_blocks: int
    kv_heads_per_card: int


def _gib(value: Fraction | float) -> float:
    return round(float(value), 3)


def _frac(value: float) -> Fraction:
    return Fraction(str(value))


class _Planner:
    def __init__(self, spec: InferenceServiceSpec) -> None:
        self.spec = spec
        self.explain: list[ExplainEntry] = []
        self.warnings: list[str] = []
        self.pinned = spec.engine.schedule.pinned()
        self.accelerator = get_accelerator(spec.accelerator.type)
        self.cards_per_node = cards_per_node(spec)
        self.model = model_spec(spec)
        self.block_size = int(self.pinned.get("cacheBlockSize", DEFAULT_CACHE_BLOCK_SIZE))

    def add(
        self, step: int, name: str, value: float | bool, formula: str, unit: str = "", note: str = "",
        **inputs: float | Fraction,
    ) -> None:
        self.explain.append(
            ExplainEntry(step=step, name=name, value=value, unit=unit, formula=formula,
                         inputs={k: float(v) for k, v in inputs.items()},
                         note=note)
        )

    # --- inputs ----------------------------------------------------------------------------------------------

    def weights(self) -> tuple[Fraction, int]:
        arch = self.spec.model.architecture
        m = self.model
        params = arch.parameters if arch is not None and arch.parameters else m.num_parameters
        source = "spec.model.architecture.parameters" if arch is not None and arch.parameters else (
            "counted from the architecture (embeddings, attention, MLP, norms, LM head)"
        )
        if m.quantization is None:
            weight_bytes = Fraction(params * m.dtype_bytes)
        else:
            weight_bytes = self.quantized_weight_bytes(params)
        if m.moe is not None:  # every expert is held, whichever a token chooses
            source += (f"; every expert counted ({m.moe.num_experts} routed per MoE layer x {len(m.moe_layers)} "
                       f"layers); a token computes with {m.active_parameters / 1e9:.2f} B of them (top "
                       f"{m.moe.num_experts_per_tok}, shared experts, dense parts, LM head)")
        weights = weight_bytes / GIB
        if m.quantization is None:
            self.add(0, "weightsGiB", _gib(weights), "numParameters x dtypeBytes / 2^30", "GiB",
                     f"parameters {source}", numParameters=params, dtypeBytes=m.dtype_bytes)
            return weights, params
        saving = m.quantization_saving
        scale = Fraction(params, m.num_parameters)
        note = (f"{m.quantization.name}: {m.quantized_parameters:,} parameters of the decoder layers' linear modules "
                f"stored as int8 with {m.quantization.row_overhead_bytes()} bytes of scales per output row (saving "
                f"{saving / GIB:.3f} GiB of the {m.dtype} weights); embeddings, LM head, norms"
                f"{' and MoE routers' if m.moe is not None else ''} stay {m.dtype}; parameters {source}")
        if scale != 1:
            note += (f"; the saving scaled by numParameters / counted parameters ({params:,} / "
                     f"{m.num_parameters:,}), so the published count keeps its share of int8")
        self.add(0, "weightsGiB", _gib(weights),
                 "(numParameters x dtypeBytes - quantizationSaving x numParameters / countedParameters) / 2^30",
                 "GiB", note, numParameters=params, dtypeBytes=m.dtype_bytes, quantizationSaving=saving,
                 countedParameters=m.num_parameters)
        return weights, params

    def quantized_weight_bytes(self, params: int) -> Fraction:
        """Weight bytes as stored under the scheme (ModelSpec.weight_bytes), for `params` parameters: a published
        count other than the architecture's keeps the counted model's share of int8 (the saving scaled)."""
        m = self.model
        return Fraction(params * m.dtype_bytes) - Fraction(m.quantization_saving * params, m.num_parameters)

    def card_memory(self) -> tuple[Fraction, Fraction, Fraction]:
        acc, spec = self.accelerator, self.spec.accelerator
        if spec.memoryGiB is not None:
            memory, memory_note = _frac(spec.memoryGiB), "spec.accelerator.memoryGiB"
        elif acc.memory_bytes is not None:
            memory, memory_note = Fraction(acc.memory_bytes, GIB), f"catalog: {acc.name}"
        else:  # pragma: no cover - the spec validator requires memoryGiB for the cpu
            raise PlanError(f"spec.accelerator.memoryGiB is required: the catalog has no memory size for {acc.name}")
        if spec.reservedGiB is not None:
            reserved, reserved_note = _frac(spec.reservedGiB), "spec.accelerator.reservedGiB"
        elif acc.idle_memory_bytes is not None:
            reserved, reserved_note = Fraction(acc.idle_memory_bytes, GIB), f"catalog: {acc.name} idle memory"
        else:
            reserved = _frac(DEFAULT_RESERVED_GIB)
            reserved_note = (
                f"default {DEFAULT_RESERVED_GIB:g} GiB: the catalog has no idle measurement for {acc.name} (the guide "
                "measured 3.4 GiB at idle on a 64 GiB 910B3, rounded up); set spec.accelerator.reservedGiB to the "
                "idle usage `npu-smi info` or `nvidia-smi` shows"
            )
            self.warnings.append(f"reservedGiB: {reserved_note}")
        fraction = _frac(spec.memoryFraction)
        self.add(0, "cardMemoryGiB", _gib(memory), "memory per card", "GiB", memory_note)
        self.add(0, "reservedGiB", _gib(reserved), "memory a card holds at idle", "GiB", reserved_note)
        self.add(0, "memoryFraction", float(fraction), NPU_MEMORY_FRACTION_ENV, "",
                 "share of the free memory given to the KV cache (spec.accelerator.memoryFraction)")
        return memory, reserved, fraction

    def block_size_rule(self) -> None:
        """cacheBlockSize, checked against the engine's kernels on the card (npuserve.npu_contract): a pinned one
        they cannot take is refused, the default one with this model's head size is a warning (the engine refuses
        it at start-up)."""
        device = self.accelerator.npu_device_type
        note = "pinned in spec.engine.schedule" if "cacheBlockSize" in self.pinned else "MindIE default"
        latent = self.model.mla is not None
        if device == "npu":
            note += f"; on npu: {NPU_MLA_BLOCK_RULE if latent else NPU_BLOCK_RULE}"
        self.add(0, "schedule.cacheBlockSize", self.block_size, "tokens per KV block (MindIE cacheBlockSize)", "tokens",
                 note)
        problem = block_size_problem(device, self.block_size, self.model.head_dim, latent_attention=latent)
        if problem is None:
            return
        if "cacheBlockSize" in self.pinned:
            raise PlanError(f"spec.engine.schedule.cacheBlockSize: {problem}")
        self.warnings.append(f"cacheBlockSize: {problem}; the engine refuses it at start-up")

    # --- steps 1-2: memory and blocks --------------------------------------------------------------------------

    def memory_for(
        self, world_size: int, memory: Fraction, reserved: Fraction, fraction: Fraction, weights: Fraction
    ) -> _Memory:
        free = memory - reserved - weights / world_size
        npu_mem = math.floor(free * fraction) if free > 0 else 0
        block_bytes = self.model.kv_bytes_per_block(self.block_size, world_size)
        total = (npu_mem * GIB) // block_bytes if npu_mem > 0 else 0
        kv_heads = max(1, self.model.num_key_value_heads // world_size)
        return _Memory(world_size, npu_mem, block_bytes, total, kv_heads)

    def blocks_per_request(self) -> Range:
        w, b = self.spec.workload, self.block_size
        inp = math.ceil(w.avgInputTokens / b)
        return Range(min=inp, avg=inp + math.ceil(w.avgOutputTokens / b), max=inp + math.ceil(w.maxOutputTokens / b))

    def check_world_size(self, world_size: int) -> str | None:
        """Why a card count cannot serve this model, or None."""
        m = self.model
        heads, kv = m.num_attention_heads, m.num_key_value_heads
        if heads % world_size:
            return f"{world_size} does not divide the {heads} attention heads"
        # latent attention has no key-value heads: every card holds the whole latent
        if m.mla is None and kv % world_size and world_size % kv:
            return f"{world_size} neither divides nor is a multiple of the {kv} key-value heads"
        if m.moe is not None:  # tensor parallel splits each expert's intermediate size over the cards
            for name, size in (("moe_intermediate_size", m.moe.moe_intermediate_size),
                               ("shared expert intermediate size", m.moe.shared_expert_intermediate_size)):
                if size % world_size:
                    return f"{world_size} does not divide the {size} {name} (each expert is split over the cards)"
        per_node = self.cards_per_node
        if per_node and world_size > per_node and world_size % per_node:
            return f"{world_size} cards span nodes of {per_node} cards but are not a multiple of {per_node}"
        return None

    def world_size(self, memory: Fraction, reserved: Fraction, fraction: Fraction, weights: Fraction) -> _Memory:
        need = self.blocks_per_request().max * MIN_BATCH
        cards = self.spec.accelerator.cards
        if cards is not None:
            reason = self.check_world_size(cards)
            if reason:
                raise PlanError(f"spec.accelerator.cards: {reason}")
            mem = self.memory_for(cards, memory, reserved, fraction, weights)
            self.add(1, "worldSize", cards, "spec.accelerator.cards", "cards", "set in the spec")
            return mem
        rejected: list[str] = []
        for candidate in range(1, self.model.num_attention_heads + 1):
            if self.check_world_size(candidate):
                continue
            mem = self.memory_for(candidate, memory, reserved, fraction, weights)
            if mem.total_blocks >= need:
                note = "smallest card count that divides the attention heads and holds the weights with room for "
                note += f"{MIN_BATCH} request(s) of maximum length"
                if rejected:
                    note += "; rejected: " + "; ".join(rejected)
                self.add(1, "worldSize", candidate,
                         "min n dividing numAttentionHeads with totalBlocks(n) >= blocksPerRequest.max x minBatch",
                         "cards", note, numAttentionHeads=self.model.num_attention_heads,
                         blocksPerRequestMax=need // MIN_BATCH, minBatch=MIN_BATCH)
                return mem
            if mem.npu_mem_size_gib < 1:
                rejected.append(f"{candidate} card(s) give 0 blocks ({_gib(weights / candidate):g} GiB of weights per "
                                f"card leave no KV memory on {_gib(memory):g} GiB)")
            else:
                rejected.append(f"{candidate} card(s) give {mem.total_blocks} blocks (npuMemSize "
                                f"{mem.npu_mem_size_gib})")
        raise PlanError(
            f"spec.accelerator: the model ({_gib(weights)} GiB of weights) fits on no card count of "
            f"{self.accelerator.name} that divides its {self.model.num_attention_heads} attention heads; "
            "choose a larger accelerator or shorter requests"
        )

    # --- the whole plan -----------------------------------------------------------------------------------------

    def plan(self) -> Plan:
        spec, w = self.spec, self.spec.workload
        weights, params = self.weights()
        memory, reserved, fraction = self.card_memory()
        self.block_size_rule()
        mem = self.world_size(memory, reserved, fraction, weights)
        ws = mem.world_size

        per_node = self.cards_per_node
        nodes = ws // per_node if per_node and ws > per_node else 1
        source = ("spec.accelerator.cardsPerNode" if self.spec.accelerator.cardsPerNode is not None else
                  f"the catalog's {self.accelerator.name}" if per_node else f"{self.accelerator.name} has none")
        self.add(1, "nodes", nodes, "worldSize / cardsPerNode when worldSize > cardsPerNode, else 1", "pods",
                 (f"one replica spans {nodes} nodes of {per_node} cards: a LeaderWorkerSet of {nodes} pods, one per "
                  f"node, {ws // nodes} cards each (rank r in pod r div {ws // nodes})" if nodes > 1 else
                  "one pod per replica") + f"; cardsPerNode: {source}", worldSize=ws, cardsPerNode=per_node or 0)
        self.add(1, "cardsPerPod", ws // nodes, "worldSize / nodes", "cards", worldSize=ws, nodes=nodes)

        if mem.npu_mem_size_gib < 1:
            raise PlanError(
                f"spec.accelerator.cards: {ws} card(s) of {_gib(memory)} GiB leave no memory for the KV cache after "
                f"{_gib(reserved)} GiB reserved and {_gib(weights / ws)} GiB of weights per card; use more cards"
            )
        self.add(1, "npuMemSizeGiB", mem.npu_mem_size_gib,
                 "floor((cardMemoryGiB - reservedGiB - weightsGiB / worldSize) x memoryFraction)", "GiB",
                 "MindIE ModelConfig.npuMemSize: KV cache per card", cardMemoryGiB=memory, reservedGiB=reserved,
                 weightsGiB=_gib(weights), worldSize=ws, memoryFraction=fraction)
        m = self.model
        if m.mla is not None:
            self.add(2, "blockBytesPerCard", mem.block_bytes,
                     "numLayers x cacheBlockSize x (kvLoraRank + qkRopeHeadDim) x dtypeBytes", "bytes",
                     "latent attention: one block's normed latent and rope key, shared by all heads, so every card "
                     "holds the whole of it (the same at any worldSize: more cards free weight memory only)",
                     numLayers=m.num_layers, cacheBlockSize=self.block_size, kvLoraRank=m.mla.kv_lora_rank,
                     qkRopeHeadDim=m.mla.qk_rope_head_dim, dtypeBytes=m.dtype_bytes)
        else:
            self.add(2, "blockBytesPerCard", mem.block_bytes,
                     "2 x numLayers x cacheBlockSize x kvHeadsPerCard x headDim x dtypeBytes", "bytes",
                     "K and V of one block on one card; kvHeadsPerCard = max(1, numKeyValueHeads / worldSize)",
                     numLayers=m.num_layers, cacheBlockSize=self.block_size, kvHeadsPerCard=mem.kv_heads_per_card,
                     headDim=m.head_dim, dtypeBytes=m.dtype_bytes)
        self.add(2, "totalBlocks", mem.total_blocks, "floor(npuMemSizeGiB x 2^30 / blockBytesPerCard)", "blocks",
                 "the engine reports the blocks it actually allocated in /info", npuMemSizeGiB=mem.npu_mem_size_gib,
                 blockBytesPerCard=mem.block_bytes)

        bpr = self.blocks_per_request()
        b = self.block_size
        self.add(3, "blocksPerRequest.min", bpr.min, "ceil(avgInputTokens / cacheBlockSize)", "blocks",
                 avgInputTokens=w.avgInputTokens, cacheBlockSize=b)
        self.add(3, "blocksPerRequest.avg", bpr.avg,
                 "ceil(avgInputTokens / cacheBlockSize) + ceil(avgOutputTokens / cacheBlockSize)", "blocks",
                 avgInputTokens=w.avgInputTokens, avgOutputTokens=w.avgOutputTokens, cacheBlockSize=b)
        self.add(3, "blocksPerRequest.max", bpr.max,
                 "ceil(avgInputTokens / cacheBlockSize) + ceil(maxOutputTokens / cacheBlockSize)", "blocks",
                 avgInputTokens=w.avgInputTokens, maxOutputTokens=w.maxOutputTokens, cacheBlockSize=b)

        total = mem.total_blocks
        mbs = Range(min=total // bpr.max, avg=total // bpr.avg, max=total // bpr.min)
        if mbs.min < 1:
            raise PlanError(
                f"spec.accelerator.cards: {total} KV blocks cannot hold one request of maximum length "
                f"({bpr.max} blocks); use more cards or lower spec.workload.maxOutputTokens"
            )
        longest = math.ceil(w.maxInputTokens / b) + math.ceil(w.maxOutputTokens / b)
        self.add(4, "maxBatchSize.min", mbs.min, "floor(totalBlocks / blocksPerRequest.max)", "requests",
                 "every request at the average input and its maximum output, no preemption (at the maximum input "
                 f"too, {w.maxInputTokens} + {w.maxOutputTokens} tokens: {total // longest}); not a floor: a latency "
                 "SLO may need a smaller batch, and the tuner goes below it down to 1",
                 totalBlocks=total, blocksPerRequestMax=bpr.max)
        self.add(4, "maxBatchSize.avg", mbs.avg, "floor(totalBlocks / blocksPerRequest.avg)", "requests",
                 "the starting point", totalBlocks=total, blocksPerRequestAvg=bpr.avg)
        self.add(4, "maxBatchSize.max", mbs.max, "floor(totalBlocks / blocksPerRequest.min)", "requests",
                 "the memory bound: only the prompts in memory; no tuned maxBatchSize goes above it",
                 totalBlocks=total, blocksPerRequestMin=bpr.min)

        schedule = self.schedule(mbs, bpr, mem)
        max_seq_len = w.maxInputTokens + w.maxOutputTokens
        if max_seq_len > m.max_position_embeddings:
            raise PlanError(
                f"spec.workload: maxInputTokens + maxOutputTokens = {max_seq_len} exceeds the model's "
                f"{m.max_position_embeddings} positions (max_position_embeddings)"
            )
        self.add(5, "maxSeqLen", max_seq_len, "maxInputTokens + maxOutputTokens", "tokens",
                 "MindIE ModelDeployConfig.maxSeqLen", maxInputTokens=w.maxInputTokens,
                 maxOutputTokens=w.maxOutputTokens)
        self.add(5, "maxInputTokenLen", w.maxInputTokens, "spec.workload.maxInputTokens", "tokens",
                 "MindIE ModelDeployConfig.maxInputTokenLen")

        memory_bound, cpu_mem = self.swap(schedule, mbs, bpr, mem)
        concurrency, replicas = self.replicas(schedule, mbs)
        plan = Plan(
            model=spec.model.name, preset=spec.model.preset, accelerator=self.accelerator.name,
            objective=spec.slo.objective, worldSize=ws, nodes=nodes, cardsPerPod=ws // nodes,
            cardMemoryGiB=_gib(memory), reservedGiB=_gib(reserved), memoryFraction=float(fraction),
            weightsGiB=_gib(weights), quantization=m.quantization.name if m.quantization is not None else NOT_QUANTIZED,
            npuMemSizeGiB=mem.npu_mem_size_gib, cpuMemSizeGiB=cpu_mem,
            blockBytesPerCard=mem.block_bytes, totalBlocks=total, blocksPerRequest=bpr, maxBatchSize=mbs,
            maxSeqLen=max_seq_len, maxInputTokenLen=w.maxInputTokens, memoryBound=memory_bound,
            schedule=schedule, pinned=sorted(self.pinned), concurrencyPerReplica=concurrency, replicas=replicas,
            explain=sorted(self.explain, key=lambda e: e.step), warnings=self.warnings,
        )
        _check_schedule(plan)
        plan.warnings.extend(self.slo_warnings(ws, weights, params))
        why = servability(plan)
        if why is not None:
            plan.warnings.append(f"engine: {why}; the operator writes this plan to the status and deploys nothing "
                                 f"(condition Deployed=False, reason EngineCannotServe)")
        return plan

    def slo_warnings(self, world_size: int, weights: Fraction, params: int) -> list[str]:
        """SLOs below what the cards can physically do: a decode step reads every weight once (TPOT at least the
        weights over the cards' memory bandwidth), a prefill computes 2 x parameters FLOPs per prompt token (TTFT at
        least that over their peak compute). Published figures, else the catalog's fitted ones (named).

        The weights a decode step of one sequence reads are `ModelSpec.step_weight_bytes(1)` (the simulator's rule):
        the decoder layers and the LM head as stored (int8 with its scales under a quantization scheme), not the
        embedding table (a lookup); a mixture of experts reads the dense parts and the top-k experts of each MoE
        layer, not the others (the expert-touch rule at one token). A published parameter count
        (spec.model.architecture.parameters) scales it by the weights' ratio to the counted ones. A prompt token
        computes with the active parameters only, at the card's 16-bit rate even when quantized: the catalog has no
        int8 TOPS figure for the cards (docs/planning.md, "Quantized weights")."""
        acc, slo, warnings = self.accelerator, self.spec.slo, []
        bandwidth, bw_kind = acc.memory_bandwidth_gbps, "datasheet"
        m = self.model
        if slo.tpotMs is not None and bandwidth:
            read = m.step_weight_bytes(1) * float(weights * GIB / m.weight_bytes)
            what = (f"{read / GIB:.3g} GiB of the {_gib(weights):g} GiB of weights (all but the embedding table)"
                    if m.moe is None else
                    f"{read / GIB:.3g} GiB of the {_gib(weights):g} GiB of weights (the dense parts and the top "
                    f"{m.moe.num_experts_per_tok} experts of each MoE layer)")
            floor_ms = read / (bandwidth * 1e9 * world_size) * 1000
            if slo.tpotMs < floor_ms:
                warnings.append(
                    f"spec.slo.tpotMs {slo.tpotMs:g} ms is below {floor_ms:.2f} ms, the time one decode step takes to "
                    f"read {what} once at {bandwidth:g} GB/s ({bw_kind}) on each of "
                    f"{world_size} card(s): no batch size can meet it")
        tflops, fl_kind = acc.peak_tflops_16bit, "datasheet"
        if slo.ttftMs is not None and tflops:
            # a dense model's FLOPs per token from its parameters (spec.model.architecture.parameters included)
            flop_params = float(m.active_parameters) if m.moe is not None else float(params)
            tokens = self.spec.workload.avgInputTokens
            floor_ms = 2 * flop_params * tokens / (tflops * 1e12 * world_size) * 1000
            if slo.ttftMs < floor_ms:
                warnings.append(
                    f"spec.slo.ttftMs {slo.ttftMs:g} ms is below {floor_ms:.2f} ms, the time the prefill of an average "
                    f"prompt ({tokens} tokens) takes at {tflops:g} TFLOP/s ({fl_kind}) on each of {world_size} "
                    "card(s): no schedule can meet it")
        return warnings

    # --- step 5: the schedule ----------------------------------------------------------------------------------

    def _pin_or(self, name: str, value: int | bool) -> int | bool:
        pinned: int | bool = self.pinned.get(name, value)
        return pinned

    def schedule(self, mbs: Range, bpr: Range, mem: _Memory) -> PlanSchedule:
        w, objective = self.spec.workload, self.spec.slo.objective
        pinned_note = "pinned in spec.engine.schedule"

        if "maxBatchSize" in self.pinned:
            max_batch = int(self.pinned["maxBatchSize"])
            self.add(5, "schedule.maxBatchSize", max_batch, "spec.engine.schedule.maxBatchSize", "requests",
                     pinned_note)
            if max_batch > mbs.max:
                self.warnings.append(
                    f"spec.engine.schedule.maxBatchSize {max_batch} exceeds maxBatchSize.max {mbs.max}: even the "
                    "prompts alone do not fit in the KV cache; requests will be preempted"
                )
        else:
            max_batch = min(mbs.avg, MINDIE_MAX_BATCH_SIZE)
            note = "the tuner's starting point"
            if mbs.avg > MINDIE_MAX_BATCH_SIZE:
                note += f"; capped at MindIE's limit of {MINDIE_MAX_BATCH_SIZE}"
            self.add(5, "schedule.maxBatchSize", max_batch, "min(maxBatchSize.avg, 5000)", "requests", note,
                     maxBatchSizeAvg=mbs.avg)

        if "maxPrefillBatchSize" in self.pinned:
            prefill_batch = int(self.pinned["maxPrefillBatchSize"])
            self.add(5, "schedule.maxPrefillBatchSize", prefill_batch, "spec.engine.schedule.maxPrefillBatchSize",
                     "requests", pinned_note)
        else:
            prefill_batch = max(1, max_batch // 2)
            self.add(5, "schedule.maxPrefillBatchSize", prefill_batch, "max(1, floor(maxBatchSize / 2))", "requests",
                     "at least 1: MindIE reads 0 as maxBatchSize", maxBatchSize=max_batch)

        if "maxPrefillTokens" in self.pinned:
            prefill_tokens = int(self.pinned["maxPrefillTokens"])
            self.add(5, "schedule.maxPrefillTokens", prefill_tokens, "spec.engine.schedule.maxPrefillTokens",
                     "tokens", pinned_note)
        else:
            prefill_tokens = planned_prefill_tokens(prefill_batch, w.avgInputTokens, w.maxInputTokens)
            self.add(5, "schedule.maxPrefillTokens", prefill_tokens,
                     "max(maxInputTokens, min(8192, maxPrefillBatchSize x avgInputTokens))", "tokens",
                     "raised to maxInputTokens when below it: MindIE requires maxPrefillTokens >= maxInputTokenLen "
                     "so the longest prompt can prefill",
                     maxInputTokens=w.maxInputTokens, maxPrefillBatchSize=prefill_batch,
                     avgInputTokens=w.avgInputTokens)

        if "supportSelectBatch" in self.pinned:
            select = bool(self.pinned["supportSelectBatch"])
            self.add(6, "schedule.supportSelectBatch", select, "spec.engine.schedule.supportSelectBatch", "",
                     pinned_note)
        else:
            select = objective != "firstTokenAndDecode"
            self.add(6, "schedule.supportSelectBatch", select,
                     "objective in (throughput, decodeLatency)", "",
                     f"objective {objective}: "
                     + ("TTFT is bound, so prefill is not held back for decode" if not select
                        else "throughput-oriented: decode steps may be chosen over prefill while requests wait"))

        max_iter = w.maxOutputTokens
        self.add(5, "schedule.maxIterTimes", max_iter, "spec.workload.maxOutputTokens", "tokens",
                 "MindIE maxIterTimes: the most tokens one request generates")
        values: dict[str, int] = {}
        for name in ("prefillTimeMsPerReq", "decodeTimeMsPerReq", "maxQueueDelayMicroseconds"):
            value = int(self._pin_or(name, SCHEDULE_FIELD_BY_NAME[name].default))
            values[name] = value
            self.add(6, f"schedule.{name}", value, f"spec.engine.schedule.{name}" if name in self.pinned else
                     "MindIE default", "", pinned_note if name in self.pinned else "")
        try:
            return PlanSchedule(
                cacheBlockSize=self.block_size, maxBatchSize=max_batch, maxPrefillBatchSize=prefill_batch,
                maxPrefillTokens=prefill_tokens, maxIterTimes=max_iter, maxPreemptCount=0, supportSelectBatch=select,
                **values,
            )
        except ValidationError as e:  # a derived value out of MindIE's range: name the spec field it comes from
            raise PlanError(_derived_error(e)) from e

    # --- step 6: swap ------------------------------------------------------------------------------------------

    def swap(self, schedule: PlanSchedule, mbs: Range, bpr: Range, mem: _Memory) -> tuple[bool, int]:
        demand = schedule.maxBatchSize * bpr.avg
        memory_bound = demand > mem.total_blocks
        self.add(6, "memoryBound", memory_bound, "maxBatchSize x blocksPerRequest.avg > totalBlocks", "",
                 "a batch of average requests overflows the KV cache: preemption is expected in steady state"
                 if memory_bound else "a batch of average requests fits; only long tails preempt",
                 maxBatchSize=schedule.maxBatchSize, blocksPerRequestAvg=bpr.avg, totalBlocks=mem.total_blocks)
        if not memory_bound:
            cpu_mem = DEFAULT_CPU_MEM_SIZE_GIB
            self.add(6, "cpuMemSizeGiB", cpu_mem, "5 unless memory-bound", "GiB", "MindIE default cpuMemSize")
        else:
            overflow = demand - mem.total_blocks
            cpu_mem = max(DEFAULT_CPU_MEM_SIZE_GIB, math.ceil(overflow * mem.block_bytes / GIB))
            self.add(6, "cpuMemSizeGiB", cpu_mem,
                     "max(5, ceil((maxBatchSize x blocksPerRequest.avg - totalBlocks) x blockBytesPerCard / 2^30))",
                     "GiB", "memory-bound: host memory for the blocks that overflow the KV cache",
                     maxBatchSize=schedule.maxBatchSize, blocksPerRequestAvg=bpr.avg, totalBlocks=mem.total_blocks,
                     blockBytesPerCard=mem.block_bytes)
        if "maxPreemptCount" in self.pinned:
            preempt = int(self.pinned["maxPreemptCount"])
            self.add(6, "schedule.maxPreemptCount", preempt, "spec.engine.schedule.maxPreemptCount", "requests",
                     "pinned in spec.engine.schedule")
        elif not memory_bound:
            preempt = 0
            self.add(6, "schedule.maxPreemptCount", preempt, "0 unless memory-bound", "requests",
                     "preempted requests are recomputed, not swapped")
        else:
            preempt = min(schedule.maxBatchSize, math.ceil(schedule.maxBatchSize / schedule.cacheBlockSize))
            self.add(6, "schedule.maxPreemptCount", preempt, "min(maxBatchSize, ceil(maxBatchSize / cacheBlockSize))",
                     "requests", "memory-bound: swap out about as many requests per step as cross a block boundary "
                     "in one decode step", maxBatchSize=schedule.maxBatchSize, cacheBlockSize=schedule.cacheBlockSize)
        schedule.maxPreemptCount = preempt
        return memory_bound, cpu_mem

    # --- step 7: replicas --------------------------------------------------------------------------------------

    def replicas(self, schedule: PlanSchedule, mbs: Range) -> tuple[int, int]:
        spec = self.spec
        capacity = spec.capacity
        if capacity is not None and capacity.concurrencyPerReplica is not None:
            concurrency = capacity.concurrencyPerReplica
            self.add(7, "concurrencyPerReplica", concurrency, "spec.capacity.concurrencyPerReplica", "requests")
        else:
            concurrency = min(schedule.maxBatchSize, mbs.min)
            self.add(7, "concurrencyPerReplica", concurrency, "min(schedule.maxBatchSize, maxBatchSize.min)",
                     "requests", "requests one replica holds with every request at the average input and its "
                     "maximum output (the guide's capacity planning)", maxBatchSize=schedule.maxBatchSize,
                     maxBatchSizeMin=mbs.min)
        if spec.replicas is not None:
            replicas = spec.replicas
            self.add(7, "replicas", replicas, "spec.replicas", "replicas",
                     "set in the spec" if capacity is None else
                     "set through the scale subresource (by the operator from the measured capacity: "
                     "status.capacity)")
        elif capacity is not None:
            replicas = min(max(math.ceil(capacity.targetConcurrentUsers / concurrency), capacity.minReplicas),
                           capacity.maxReplicas or MAX_REPLICAS)
            self.add(7, "replicas", replicas,
                     "ceil(targetConcurrentUsers / concurrencyPerReplica), within [minReplicas, maxReplicas]",
                     "replicas", "rounded up, so every user is served; autotune replaces it with the measured "
                     "capacity", targetConcurrentUsers=capacity.targetConcurrentUsers,
                     concurrencyPerReplica=concurrency, minReplicas=capacity.minReplicas,
                     maxReplicas=capacity.maxReplicas or MAX_REPLICAS)
        else:
            replicas = 1
            self.add(7, "replicas", replicas, "1 (neither spec.replicas nor spec.capacity is set)", "replicas")
        return concurrency, replicas


# spec.model.architecture (the CRD's camelCase) <-> ModelSpec (HF config.json's names), both directions from here.
ARCHITECTURE_FIELDS = {
    "modelType": "model_type", "numLayers": "num_layers", "hiddenSize": "hidden_size",
    "numAttentionHeads": "num_attention_heads", "numKeyValueHeads": "num_key_value_heads",
    "intermediateSize": "intermediate_size", "vocabSize": "vocab_size",
    "maxPositionEmbeddings": "max_position_embeddings", "dtype": "dtype",
}


# The MoE and MLA fields (optional; set together, the CRD's rules say which go with which modelType).
MOE_ARCHITECTURE_FIELDS = {"numExperts": "num_experts", "numExpertsPerToken": "num_experts_per_tok",
                           "moeIntermediateSize": "moe_intermediate_size"}
MLA_ARCHITECTURE_FIELDS = {"qLoraRank": "q_lora_rank", "kvLoraRank": "kv_lora_rank",
                           "qkNopeHeadDim": "qk_nope_head_dim", "qkRopeHeadDim": "qk_rope_head_dim",
                           "vHeadDim": "v_head_dim"}


def _moe_from_architecture(arch: Architecture) -> MoESpec | None:
    if arch.numExperts is None:
        return None
    kind, shared, first = arch.modelType, arch.sharedExpertIntermediateSize or 0, arch.firstDenseLayers or 0
    qwen, v3 = kind in ("qwen2_moe", "qwen3_moe"), kind == "deepseek_v3"
    return MoESpec(
        **{name: getattr(arch, field) for field, name in MOE_ARCHITECTURE_FIELDS.items()},
        shared_expert_intermediate_size=shared, shared_expert_gate=kind == "qwen2_moe" and shared > 0,
        # as transformers reads a config.json without the key: DeepSeek-V3 renormalises, the others do not
        norm_topk_prob=v3 if arch.normTopkProb is None else arch.normTopkProb,
        # DeepSeek-V3's router kind (its grouping and scaling do not change a plan: defaults, one group)
        scoring_func="sigmoid" if v3 else "softmax", topk_method="noaux_tc" if v3 else "greedy",
        first_k_dense_replace=0 if qwen else first, mlp_only_layers=tuple(range(first)) if qwen else (),
    )


def _spec_from_architecture(arch: Architecture) -> ModelSpec:
    mla = None
    if arch.kvLoraRank is not None:
        mla = MLASpec.model_validate({name: getattr(arch, field) for field, name in MLA_ARCHITECTURE_FIELDS.items()})
    head_dim = arch.headDim
    if mla is not None:
        head_dim = mla.qk_head_dim
    elif head_dim is None:
        if arch.hiddenSize % arch.numAttentionHeads:
            raise PlanError(
                "spec.model.architecture.headDim is required: hiddenSize does not divide by numAttentionHeads"
            )
        head_dim = arch.hiddenSize // arch.numAttentionHeads
    return ModelSpec(
        **{name: getattr(arch, field) for field, name in ARCHITECTURE_FIELDS.items()}, head_dim=head_dim,
        attention_bias=arch.modelType in ("qwen2", "qwen2_moe"), qk_norm=arch.modelType in ("qwen3", "qwen3_moe"),
        moe=_moe_from_architecture(arch), mla=mla,
    )


def architecture_of(spec: ModelSpec) -> Architecture:
    """An inline spec.model.architecture for a model outside the catalog (`npuserve simulate --model-config`). A
    mixture of experts keeps what planning reads (experts, top-k, sizes, shared experts, dense layers, norm_topk_prob);
    the router's grouping and scaling are not API fields. Raises PlanError for an MoE layer pattern the API cannot
    write (Qwen's mlp_only_layers other than the first n layers, decoder_sparse_step above 1)."""
    fields = {**{field: getattr(spec, name) for field, name in ARCHITECTURE_FIELDS.items()}, "headDim": spec.head_dim}
    moe, mla = spec.moe, spec.mla
    if moe is not None:
        fields.update({field: getattr(moe, name) for field, name in MOE_ARCHITECTURE_FIELDS.items()})
        fields["normTopkProb"] = moe.norm_topk_prob
        if moe.shared_expert_intermediate_size:
            fields["sharedExpertIntermediateSize"] = moe.shared_expert_intermediate_size
        dense = [i for i in range(spec.num_layers) if i not in spec.moe_layers]
        if dense != list(range(len(dense))):
            raise PlanError(f"{spec.model_type}: MoE layers other than all but the first n (dense layers {dense}) "
                            "cannot be written as spec.model.architecture (firstDenseLayers)")
        if dense:
            fields["firstDenseLayers"] = len(dense)
    if mla is not None:
        fields.update({field: getattr(mla, name) for field, name in MLA_ARCHITECTURE_FIELDS.items()
                       if getattr(mla, name) is not None})
    return Architecture.model_validate(fields)


def model_spec(spec: InferenceServiceSpec) -> ModelSpec:
    """The architecture the spec names (preset or inline), with spec.model.quantization's scheme (its standard
    coverage: every decoder linear layer but the MoE router int8)."""
    source = spec.model
    if source.preset is not None:
        model = get_model_preset(source.preset)
    else:
        assert source.architecture is not None
        model = _spec_from_architecture(source.architecture)
    if source.quantization is not None:
        model = model.model_copy(update={"quantization": source.quantization.scheme()})
    return model


def cards_per_node(spec: InferenceServiceSpec) -> int | None:
    """The cards one node gives a pod: spec.accelerator.cardsPerNode, else the catalog's (None: the cards never span
    nodes, as on cpu unless the spec says otherwise)."""
    return spec.accelerator.cardsPerNode or get_accelerator(spec.accelerator.type).cards_per_node


def servability(plan: Plan) -> str | None:
    """Why the bundled engine cannot serve this plan (a device it lacks), or None."""
    return unservable(get_accelerator(plan.accelerator).npu_device_type, plan.worldSize)


def _check_schedule(plan: Plan) -> None:
    """The chosen ScheduleConfig must be one MindIE accepts (pinned values may break its cross-field rules)."""
    s = plan.schedule
    try:
        ScheduleSection.model_validate(s.model_dump())
    except ValueError as e:
        raise PlanError(f"spec.engine.schedule: the resulting ScheduleConfig is invalid: {e}") from e
    if s.maxPrefillTokens < plan.maxInputTokenLen:
        raise PlanError(
            f"spec.engine.schedule.maxPrefillTokens ({s.maxPrefillTokens}) must be at least "
            f"spec.workload.maxInputTokens ({plan.maxInputTokenLen}), or the longest prompt cannot prefill"
        )
    if s.maxIterTimes > plan.maxSeqLen:  # pragma: no cover - maxSeqLen includes maxOutputTokens
        raise PlanError("maxIterTimes exceeds maxSeqLen")


# The spec field each planned ScheduleConfig value comes from (an error names it, not the internal value).
DERIVED_FROM = {
    "maxPrefillTokens": "spec.workload.maxInputTokens (maxPrefillTokens is raised to the longest prompt)",
    "maxIterTimes": "spec.workload.maxOutputTokens (maxIterTimes)",
    "maxBatchSize": "spec.engine.schedule.maxBatchSize, or the KV memory (spec.accelerator)",
    "maxPrefillBatchSize": "spec.engine.schedule.maxPrefillBatchSize",
}


def _derived_error(error: ValidationError) -> str:
    parts = []
    for item in error.errors():
        name = str(item["loc"][0]) if item["loc"] else ""
        source = DERIVED_FROM.get(name, f"spec.engine.schedule.{name}")
        parts.append(f"{source}: the planned {name} {item.get('input')!r} is out of range: "
                     f"{item['msg'].removeprefix('Value error, ')}")
    return "; ".join(parts)


def plan(spec: InferenceServiceSpec) -> Plan:
    """The plan of one InferenceService spec. Raises PlanError with the field to change when it cannot fit."""
    return _Planner(spec).plan()
