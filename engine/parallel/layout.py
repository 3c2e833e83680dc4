"""Which slice of the model one tensor-parallel rank holds: pure numbers from the spec, the rank and the world size.

Column-parallel QKV and gate-up (each rank a contiguous run of heads / intermediate rows), row-parallel o_proj and
down_proj (the matching input columns), vocab-parallel embedding and LM head (rows padded to an equal count per
rank, so the logits gather concatenates equal pieces). KV heads are split across ranks when there are at least as
many as ranks, and replicated (one per rank, the one its query heads use) when there are fewer.

Latent attention (DeepSeek): each rank holds its heads' rows of `q_b_proj`/`q_proj` and `kv_b_proj` and the matching
input columns of `o_proj` (`v_head_dim` per head); the latent projections are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

from npuserve.modelspec import ModelSpec


class TensorParallelLayoutError(ValueError):
    """The model cannot be split over this many ranks; the message names the dimension."""


@dataclass(frozen=True, slots=True)
class TPLayout:
    rank: int
    world_size: int
    head_dim: int
    heads: int  # query heads on this rank
    kv_heads: int  # KV heads on this rank
    first_head: int
    first_kv_head: int
    intermediate: int  # MLP rows on this rank
    vocab_size: int  # the model's whole vocabulary
    vocab_rows: int  # embedding / LM-head rows per rank (padded: the last rank may hold fewer real ones)
    mla_v_dim: int = 0  # latent attention: v_head_dim (o_proj's input columns per head); 0 without MLA
    mla_kv_b_dim: int = 0  # latent attention: kv_b_proj's rows per head (qk_nope_head_dim + v_head_dim)
    moe_intermediate: int = 0  # each routed expert's intermediate rows on this rank (0: not an MoE model)
    shared_intermediate: int = 0  # the shared expert's intermediate rows on this rank (0: none)

    @classmethod
    def of(cls, spec: ModelSpec, rank: int = 0, world_size: int = 1) -> TPLayout:
        if not 0 <= rank < world_size:
            raise TensorParallelLayoutError(f"rank {rank} is outside worldSize {world_size}")
        heads, kv_heads, inter = spec.num_attention_heads, spec.num_key_value_heads, spec.intermediate_size
        problems = []
        if heads % world_size:
            problems.append(f"num_attention_heads {heads}")
        moe = spec.moe
        dense_layers = moe is None or len(spec.moe_layers) < spec.num_layers
        if dense_layers and inter % world_size:
            problems.append(f"intermediate_size {inter}")
        if moe is not None and moe.moe_intermediate_size % world_size:
            problems.append(f"moe_intermediate_size {moe.moe_intermediate_size}")
        if moe is not None and moe.shared_expert_intermediate_size % world_size:
            problems.append(f"shared_expert_intermediate_size {moe.shared_expert_intermediate_size}")
        if kv_heads >= world_size and kv_heads % world_size:
            problems.append(f"num_key_value_heads {kv_heads}")
        if kv_heads < world_size and world_size % kv_heads:
            problems.append(f"num_key_value_heads {kv_heads} (fewer than the ranks, and not dividing them)")
        if problems:
            raise TensorParallelLayoutError(
                f"worldSize {world_size} does not divide the model's {', '.join(problems)}")
        local_heads = heads // world_size
        if kv_heads >= world_size:
            local_kv, first_kv = kv_heads // world_size, rank * (kv_heads // world_size)
        else:  # replicated: the KV head of this rank's query heads
            local_kv, first_kv = 1, (rank * local_heads) // (heads // kv_heads)
        return cls(rank=rank, world_size=world_size, head_dim=spec.head_dim, heads=local_heads, kv_heads=local_kv,
                   first_head=rank * local_heads, first_kv_head=first_kv, intermediate=inter // world_size,
                   vocab_size=spec.vocab_size, vocab_rows=-(-spec.vocab_size // world_size),
                   mla_v_dim=spec.mla.v_head_dim if spec.mla is not None else 0,
                   mla_kv_b_dim=spec.mla.qk_nope_head_dim + spec.mla.v_head_dim if spec.mla is not None else 0,
                   moe_intermediate=moe.moe_intermediate_size // world_size if moe is not None else 0,
                   shared_intermediate=moe.shared_expert_intermediate_size // world_size if moe is not None else 0)

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows

    @property
    def vocab_real_rows(self) -> int:
        """Rows of this rank's vocabulary slice that are real tokens (the rest pads to `vocab_rows`)."""
        return max(0, min(self.vocab_rows, self.vocab_size - self.vocab_start))

    def hf_slice(self, name: str) -> tuple[int, int, int] | None:
        """The slice of an HF checkpoint tensor this rank reads, as (dim, start, length); None: all of it."""
        if self.mla_v_dim:
            if ".self_attn.q_b_proj." in name:
                return 0, self.first_head * self.head_dim, self.q_size
            if ".self_attn.kv_b_proj." in name:
                return 0, self.first_head * self.mla_kv_b_dim, self.heads * self.mla_kv_b_dim
            if name.endswith(".self_attn.o_proj.weight"):
                return 1, self.first_head * self.mla_v_dim, self.heads * self.mla_v_dim
        if ".self_attn.q_proj." in name:
            return 0, self.first_head * self.head_dim, self.q_size
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            return 0, self.first_kv_head * self.head_dim, self.kv_size
        if ".mlp.experts." in name:  # a routed expert's gate_proj / up_proj / down_proj
            return (1 if name.endswith(".down_proj.weight") else 0), self.rank * self.moe_intermediate, \
                self.moe_intermediate
        if ".mlp.shared_expert." in name or ".mlp.shared_experts." in name:  # Qwen2-MoE, DeepSeek
            return (1 if name.endswith(".down_proj.weight") else 0), self.rank * self.shared_intermediate, \
                self.shared_intermediate
        if ".mlp.gate_proj." in name or ".mlp.up_proj." in name:
            return 0, self.rank * self.intermediate, self.intermediate
        if name.endswith(".self_attn.o_proj.weight"):
            return 1, self.first_head * self.head_dim, self.q_size
        if name.endswith(".mlp.down_proj.weight"):
            return 1, self.rank * self.intermediate, self.intermediate
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return 0, self.vocab_start, self.vocab_real_rows
        return None
