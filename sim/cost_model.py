"""Step time of one engine step from first principles: every term physical and bounded (docs/simulator.md). Pure
arithmetic.

A step reads every weight of the card's shard once, reads (and writes) the KV of every token its sequences attend
to, computes the FLOPs of the tokens it runs, waits for the host's kernel launches, and does host-side work per
sequence; with tensor parallel it all-reduces each layer's activations. Per card, with tensor parallel over
`world_size` cards, `eff` the card family's fitted achieved fractions of its datasheet figures (catalog
`Efficiency`), the all-reduce latency the link kind's (`LINK_LATENCIES`), the host terms the engine's (`CostParams`,
`ENGINE_PROFILES`, in npuserve/catalog/engines.py):

    weights_s  = weight bytes read / world_size / (datasheet bandwidth x eff.bandwidth)   dense: same for any batch
    kv_s       = context tokens x KV bytes per token per card / (same bandwidth)          linear in context
    compute_s  = (2 x active layer params x tokens + 2 x LM-head params x sampled rows
                  + 2 x layers x heads x (qk + v head dims) x attended pairs) / world_size
                  / (datasheet 16-bit FLOP/s x eff.compute)
    comm_s     = (2 x layers + 1) all-reduces x (the link's all-reduce latency
                  + 2 (n-1)/n x tokens x hidden bytes / (link bandwidth x eff.link))
    host_s     = per_seq_host x sequences         the host's per-request work: inputs, sampling, outputs
    launch_s   = layers x launch_per_layer        launches the device waits for (eager engines), overlapping nothing
    swap_s     = swapped blocks x block bytes per card / host link bandwidth

    device_s   = max(weights_s + kv_s, compute_s) + comm_s
    total_s    = launch_s + max(device_s, host_s) + swap_s

Memory traffic and compute overlap on the device (the roofline's max): a decode step is bandwidth-bound, a prefill
step of a few thousand tokens compute-bound. The host prepares and post-processes a step while the device runs
(MindIE's and vLLM's asynchronous scheduling), so the step takes the longer of the two: small batches are paced by
the device, large ones by the host. Each free parameter has a bound from a measurement (the host terms' in
npuserve/catalog/engines.py, the efficiencies' `EFFICIENCY_BOUNDS` and the all-reduce latency's
`ALLREDUCE_LATENCY_US_BOUNDS` in npuserve/catalog/accelerators.py), so no fit can explain a run with a figure no
card or engine has.

Mixture of experts and latent attention (docs/simulator.md, "MoE and MLA"): the FLOPs of a token are its active
parameters' (top-k and shared experts, not all of them: `ModelSpec.active_layer_parameters`); the weights a step
reads are the dense parts plus the experts its tokens touch (`ModelSpec.step_weight_bytes`, the expert-touch rule
`E x (1 - (1 - k/E)^tokens)` per MoE layer, the same rule the planner's TPOT floor uses), so the weights term grows
with the tokens of the step until every expert is read; MLA's KV per token is the latent and the rope key, whole on
every card (`ModelSpec.kv_bytes_per_block`), and a decode step reads only that cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The engines' host terms are catalog data (npuserve/catalog/engines.py), importable from here as they always were.
from npuserve.catalog.accelerators import (
    EFFICIENCIES,
    Accelerator,
    Efficiency,
    LinkKind,
    allreduce_latency_us,
    efficiency_of,
)
from npuserve.catalog.engines import DEFAULT_ENGINE as DEFAULT_ENGINE
from npuserve.catalog.engines import ENGINE_PROFILES as ENGINE_PROFILES
from npuserve.catalog.engines import FITTED_COST_PARAMS as FITTED_COST_PARAMS
from npuserve.catalog.engines import LAUNCH_US_PER_LAYER_BOUND as LAUNCH_US_PER_LAYER_BOUND
from npuserve.catalog.engines import PER_SEQ_HOST_MS_BOUND as PER_SEQ_HOST_MS_BOUND
from npuserve.catalog.engines import CostParams as CostParams
from npuserve.catalog.engines import EngineProfile as EngineProfile
from npuserve.modelspec import ModelSpec

GB = 1e9
TERA = 1e12


@dataclass(frozen=True, slots=True)
class Hardware:
    """What the cost model needs of one card: its datasheet figures (or, for the host CPU, fitted ones), the link
    kind and its all-reduce latency, and the achieved fractions the cost model applies to them."""

    name: str
    bandwidth_gbps: float
    tflops: float
    interconnect_gbps: float
    source: str  # "datasheet" or "fitted"
    link: LinkKind = "pcie"
    efficiency: Efficiency = field(default_factory=lambda: EFFICIENCIES["cpu"])
    allreduce_us: float = 0.0  # one all-reduce's fixed latency over the link (catalog LINK_LATENCIES)

    @classmethod
    def of(cls, accelerator: Accelerator, efficiency: Efficiency | None = None,
           allreduce_us: float | None = None) -> Hardware:
        figures = accelerator.simulation_figures()
        if figures is None:
            raise ValueError(f"accelerator {accelerator.name!r} has no datasheet bandwidth/compute figures to "
                             "simulate it with (the host CPU's come from a fit: npuserve.sim.cpu_profile)")
        return cls(accelerator.name, figures.memory_bandwidth_gbps, figures.tflops_16bit, figures.interconnect_gbps,
                   figures.source, figures.link, efficiency or efficiency_of(accelerator),
                   allreduce_latency_us(figures.link) if allreduce_us is None else allreduce_us)


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one step runs, as the cost model needs it (built from a SchedulerOutput by the runner)."""

    num_seqs: int  # sequences in the step
    new_tokens: int  # tokens computed (prompt tokens of a prefill, one per decoding sequence)
    context_tokens: int  # tokens whose KV the step reads or writes (every attended position, new ones included)
    attended_pairs: int  # (query token, key token) pairs of attention
    sampled_rows: int  # rows that go through the LM head
    swapped_blocks: int = 0  # blocks copied between device and host (both directions)


@dataclass(frozen=True, slots=True)
class StepCost:
    """One step's time and each term of it, in seconds (the breakdown a user can inspect)."""

    weights_s: float
    kv_s: float
    compute_s: float
    comm_s: float
    host_s: float
    launch_s: float
    swap_s: float

    @property
    def memory_s(self) -> float:
        return self.weights_s + self.kv_s

    @property
    def device_s(self) -> float:
        return max(self.memory_s, self.compute_s) + self.comm_s

    @property
    def bound(self) -> str:
        """What set the step's pace: 'memory' or 'compute' (the device's roofline), or 'host'."""
        if self.host_s > self.device_s:
            return "host"
        return "memory" if self.memory_s >= self.compute_s else "compute"

    @property
    def total_s(self) -> float:
        return self.launch_s + max(self.device_s, self.host_s) + self.swap_s


class CostModel:
    """Step times of one model on `world_size` cards of one accelerator. Per-step arithmetic only: the constants of
    the model and the hardware are folded once here, so a step costs a few multiplications."""

    def __init__(self, model: ModelSpec, hardware: Hardware, world_size: int = 1, params: CostParams | None = None,
                 *, block_size: int = 128) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.model = model
        self.hardware = hardware
        self.world_size = world_size
        self.params = params or FITTED_COST_PARAMS
        p = self.params
        n = world_size
        dtype = model.dtype_bytes
        lm_head_params = model.vocab_size * model.hidden_size
        eff = hardware.efficiency
        bandwidth = hardware.bandwidth_gbps * GB * eff.bandwidth
        flops = hardware.tflops * TERA * eff.compute
        # The embedding table is gathered row by row (a lookup), the LM head read whole: count it once, as weights.
        # Dense: every weight at any batch. MoE: the experts the step's tokens touch (model.step_weight_bytes).
        self.weight_bytes_per_card = model.step_weight_bytes(1 << 62) / n  # all of them (every expert touched)
        self.kv_bytes_per_token_per_card = model.kv_bytes_per_block(1, n)
        self.block_bytes_per_card = model.kv_bytes_per_block(block_size, n)
        self._bandwidth = bandwidth
        self._moe = model.moe is not None
        self._weights_s_of: dict[int, float] = {}  # MoE: weights_s by the tokens of the step
        self._weights_s = self.weight_bytes_per_card / bandwidth
        self._kv_s_per_token = self.kv_bytes_per_token_per_card / bandwidth
        self._s_per_token = 2.0 * model.active_layer_parameters / n / flops
        self._s_per_row = 2.0 * lm_head_params / n / flops
        # QK^T over the query/key head size and PV over the value head size, per head (dense: 4 x q_size; MLA's
        # prefill as vllm-ascend runs it, expanded: qk 192, v 128; its absorbed decode is bandwidth-bound)
        v_head_dim = model.mla.v_head_dim if model.mla is not None else model.head_dim
        self._s_per_pair = (2.0 * model.num_layers * model.num_attention_heads * (model.head_dim + v_head_dim)
                            / n / flops)
        self._launch_s = model.num_layers * p.launch_us_per_layer / 1e6
        self._seq_host_s = p.per_seq_host_ms / 1e3
        if n > 1:
            all_reduces = 2 * model.num_layers + 1  # after attention and after the MLP of each layer; the LM head
            link = hardware.interconnect_gbps * GB * eff.link
            self._comm_fixed_s = all_reduces * hardware.allreduce_us / 1e6
            self._comm_s_per_token = all_reduces * 2.0 * (n - 1) / n * model.hidden_size * dtype / link
        else:
            self._comm_fixed_s = self._comm_s_per_token = 0.0
        self._swap_s_per_block = self.block_bytes_per_card / (p.host_link_gbps * GB)

    def weights_s(self, tokens: int) -> float:
        """Seconds to read the weights a step of `tokens` tokens touches (dense: all of them, at any batch)."""
        if not self._moe:
            return self._weights_s
        seconds = self._weights_s_of.get(tokens)
        if seconds is None:
            seconds = self.model.step_weight_bytes(tokens) / self.world_size / self._bandwidth
            self._weights_s_of[tokens] = seconds
        return seconds

    def step(self, shape: StepShape) -> StepCost:
        return StepCost(
            weights_s=self.weights_s(shape.new_tokens),
            kv_s=shape.context_tokens * self._kv_s_per_token,
            compute_s=(shape.new_tokens * self._s_per_token + shape.sampled_rows * self._s_per_row
                       + shape.attended_pairs * self._s_per_pair),
            comm_s=self._comm_fixed_s + shape.new_tokens * self._comm_s_per_token,
            host_s=shape.num_seqs * self._seq_host_s,
            launch_s=self._launch_s,
            swap_s=shape.swapped_blocks * self._swap_s_per_block,
        )

    def step_time(self, shape: StepShape) -> float:
        """`step(shape).total_s` without building the breakdown (the runner's hot path)."""
        memory = self.weights_s(shape.new_tokens) + shape.context_tokens * self._kv_s_per_token
        compute = (shape.new_tokens * self._s_per_token + shape.sampled_rows * self._s_per_row
                   + shape.attended_pairs * self._s_per_pair)
        device = max(memory, compute) + self._comm_fixed_s + shape.new_tokens * self._comm_s_per_token
        return (self._launch_s + max(device, shape.num_seqs * self._seq_host_s)
                + shape.swapped_blocks * self._swap_s_per_block)

