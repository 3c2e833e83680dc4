"""The torch_npu stack the npu backend finds at start-up: which op-plugin release line the installed torch_npu
belongs to (the supported matrix), which of the backend's operations it has, and the one argument whose presence
changes a call (`npu_scatter_pa_kv_cache`'s `cache_mode`).

The matrix (SUPPORTED_RELEASES) is Ascend/pytorch's `COMPATIBILITY.en.md` (TorchNPU / PyTorch / CANN, master of
2026-08) restricted to the op-plugin lines whose operations the backend's calls were checked against (Ascend/op-plugin
branches 7.0.0 to 26.1.0: `op_plugin/python/atb/_atb_ops.py`, the ATB ops' schemas in `op_plugin/ops/atb/*.cpp`,
`op_plugin/config/op_plugin_functions.yaml`). NNAL (libatb.so, the ATB operators) ships with CANN under the same
version. A torch_npu outside the table is not refused: its operations are looked at directly and a warning says
the stack is untested.

torch_npu exposes its `npu` namespace ops as `torch.ops.npu.<op>` packets, whose `default._schema.arguments` name the
arguments; that is how `cache_mode` is found. The ATB ops (`_npu_*`) are Python functions until their first call
loads libatb.so and puts the `torch.ops.atb.<op>` packets in their place (op-plugin `_atb_ops.py`, `_patch_atb_ops`),
so at detection only their presence is looked at; `npuserve doctor` reads their schemas after the first call.

The MoE and MLA ops (MOE_OPS, MLA_OPS) are required only by a model that has MoE layers or multi-head latent
attention: a dense model runs on a stack without them. The line that first has each (op-plugin
`op_plugin_functions.yaml` per branch; shared/notes/moe-mla-lws.md): `npu_moe_gating_top_k_softmax` and
`npu_moe_finalize_routing` 6.0.rc2; `npu_moe_gating_top_k`, `npu_moe_init_routing_v2`, `npu_grouped_matmul` with a
Tensor group_list, `npu_kv_rmsnorm_rope_cache`, `npu_fused_infer_attention_score` with query_rope/key_rope 7.0.0;
`npu_moe_token_unpermute` 7.1.0. So every supported line has them all but token_unpermute, whose place 7.0.0's
MoE takes `npu_moe_finalize_routing` (`NPUStack.moe_combine_op`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

SCATTER_OP = "npu_scatter_pa_kv_cache"
RESHAPE_AND_CACHE_OP = "_npu_reshape_and_cache"
FLASH_OP = "_npu_flash_attention"
PREFIX_OP = "_npu_flash_attention_qlens"
DECODE_OP = "_npu_paged_attention"
SPLITFUSE_OP = "_npu_paged_attention_splitfuse"
FUSED_OPS = ("npu_rms_norm", "npu_rotary_mul", "npu_swiglu")
# Every op the backend calls, the cache write aside (scatter where it takes cache_mode, else reshape-and-cache).
ATTENTION_OPS = (FLASH_OP, PREFIX_OP, DECODE_OP, SPLITFUSE_OP)
REQUIRED_OPS = (RESHAPE_AND_CACHE_OP, *ATTENTION_OPS, *FUSED_OPS)

GATING_SOFTMAX_OP = "npu_moe_gating_top_k_softmax"
GATING_TOP_K_OP = "npu_moe_gating_top_k"
INIT_ROUTING_OP = "npu_moe_init_routing_v2"
GROUPED_MATMUL_OP = "npu_grouped_matmul"
UNPERMUTE_OP = "npu_moe_token_unpermute"
FINALIZE_OP = "npu_moe_finalize_routing"
KV_RMSNORM_ROPE_CACHE_OP = "npu_kv_rmsnorm_rope_cache"
FIA_OP = "npu_fused_infer_attention_score"
# The MoE chain without its combine step (token_unpermute where the line has it, else finalize_routing).
MOE_OPS = (GATING_SOFTMAX_OP, GATING_TOP_K_OP, INIT_ROUTING_OP, GROUPED_MATMUL_OP, "npu_swiglu")
MOE_COMBINE_OPS = (UNPERMUTE_OP, FINALIZE_OP)
MLA_OPS = (KV_RMSNORM_ROPE_CACHE_OP, FIA_OP)
# The int8 (W8A8) ops (engine/backends/npu_int8.py), required only by a model with int8 layers.
QUANTIZE_OP = "npu_quantize"
DYNAMIC_QUANT_OP = "npu_dynamic_quant"
QUANT_MATMUL_OP = "npu_quant_matmul"
TRANS_QUANT_PARAM_OP = "npu_trans_quant_param"
INT8_LINEAR_OPS = (QUANTIZE_OP, DYNAMIC_QUANT_OP, QUANT_MATMUL_OP, TRANS_QUANT_PARAM_OP)
INT8_MOE_OPS = (DYNAMIC_QUANT_OP, GROUPED_MATMUL_OP)
# The first op-plugin line with each MoE/MLA op (under the schema the backend calls).
FIRST_LINE: dict[str, str] = {
    GATING_SOFTMAX_OP: "6.0.rc2", FINALIZE_OP: "6.0.rc2", GATING_TOP_K_OP: "7.0.0", INIT_ROUTING_OP: "7.0.0",
    GROUPED_MATMUL_OP: "7.0.0", KV_RMSNORM_ROPE_CACHE_OP: "7.0.0", FIA_OP: "7.0.0", UNPERMUTE_OP: "7.1.0",
    QUANTIZE_OP: "6.0.rc2", QUANT_MATMUL_OP: "6.0.rc2", TRANS_QUANT_PARAM_OP: "6.0.rc2", DYNAMIC_QUANT_OP: "6.0.rc3",
}


# The keywords the backend passes to each op: argument names of the ops' schemas in every supported line (op-plugin
# `op_plugin/ops/atb/*.cpp` m.def, `op_plugin_functions.yaml`); the fused kernels take their tensors by position.
KEYWORDS: dict[str, frozenset[str]] = {
    RESHAPE_AND_CACHE_OP: frozenset({"key", "value", "key_cache", "value_cache", "slot_indices"}),
    SCATTER_OP: frozenset({"key", "value", "key_cache", "value_cache", "slot_mapping", "cache_mode"}),
    FLASH_OP: frozenset({"query", "key", "value", "mask", "seq_len", "scale_value", "num_heads", "num_kv_heads",
                         "out"}),
    PREFIX_OP: frozenset({"query", "key_cache", "value_cache", "block_table", "mask", "seq_len", "context_lens",
                          "num_kv_heads", "num_heads", "scale_value", "out"}),
    DECODE_OP: frozenset({"query", "key_cache", "value_cache", "num_kv_heads", "num_heads", "scale_value",
                          "block_table", "context_lens", "out"}),
    SPLITFUSE_OP: frozenset({"query", "key_cache", "value_cache", "block_table", "context_lens", "mask", "seq_len",
                             "num_kv_heads", "num_heads", "scale_value", "out"}),
    "npu_rms_norm": frozenset({"epsilon"}),
    "npu_rotary_mul": frozenset(),
    "npu_swiglu": frozenset({"dim"}),
    GATING_SOFTMAX_OP: frozenset({"x", "finished", "k"}),
    GATING_TOP_K_OP: frozenset({"x", "k", "bias", "k_group", "group_count", "group_select_mode", "renorm",
                                "norm_type", "routed_scaling_factor", "eps"}),
    INIT_ROUTING_OP: frozenset({"x", "expert_idx", "active_num", "expert_num", "expert_tokens_num_type",
                                "expert_tokens_num_flag", "quant_mode"}),
    GROUPED_MATMUL_OP: frozenset({"x", "weight", "group_list", "split_item", "group_type", "group_list_type"}),
    UNPERMUTE_OP: frozenset({"permuted_tokens", "sorted_indices", "probs"}),
    FINALIZE_OP: frozenset({"expanded_permuted_rows", "skip1", "skip2", "bias", "scales", "expanded_src_to_dst_row",
                            "export_for_source_row", "drop_pad_mode"}),
    # its seven tensors go by position, as vllm-ascend passes them
    KV_RMSNORM_ROPE_CACHE_OP: frozenset({"epsilon", "cache_mode", "is_output_kv"}),
    FIA_OP: frozenset({"query_rope", "key_rope", "num_heads", "num_key_value_heads", "input_layout", "scale",
                       "antiquant_mode", "block_table", "block_size", "actual_seq_lengths_kv"}),
    # the int8 ops (npu_int8.py): their tensors, and npu_quantize's dtype/axis/div_mode, go by position, as
    # vllm-ascend passes them
    QUANTIZE_OP: frozenset(),
    DYNAMIC_QUANT_OP: frozenset(),
    TRANS_QUANT_PARAM_OP: frozenset(),
    QUANT_MATMUL_OP: frozenset({"pertoken_scale", "bias", "output_dtype"}),
}


@dataclass(frozen=True)
class OpPluginRelease:
    """One Ascend Extension for PyTorch release line: its op-plugin branch, the CANN (and NNAL) it pairs with, and
    the torch_npu packages of the line with the torch each needs (the torch_npu version without its `.postN`)."""

    name: str
    cann: str
    torch_npu: tuple[str, ...]
    scatter_cache_mode: bool  # npu_scatter_pa_kv_cache takes `cache_mode` (op_plugin_functions.yaml)


SUPPORTED_RELEASES: tuple[OpPluginRelease, ...] = (
    OpPluginRelease("7.0.0", "8.1.RC1", ("2.5.1", "2.4.0.post4", "2.3.1.post6"), scatter_cache_mode=False),
    OpPluginRelease("7.1.0", "8.2.RC1", ("2.6.0", "2.5.1.post1"), scatter_cache_mode=False),
    OpPluginRelease("7.2.0", "8.3.RC1", ("2.8.0", "2.7.1", "2.6.0.post3"), scatter_cache_mode=False),
    OpPluginRelease("7.3.0", "8.5.0", ("2.9.0", "2.8.0.post2", "2.7.1.post2", "2.6.0.post5"),
                    scatter_cache_mode=False),
    OpPluginRelease("26.0.0", "9.0.0", ("2.9.0.post2", "2.8.0.post4", "2.7.1.post4"), scatter_cache_mode=True),
    OpPluginRelease("26.1.0", "9.1.0", ("2.12.0", "2.11.0", "2.10.0.post4", "2.9.0.post6", "2.7.1.post8"),
                    scatter_cache_mode=True),
)


def base_version(version: str) -> str:
    """`2.8.0.post2+git1a2b3c4` -> `2.8.0.post2` (a source build appends the commit)."""
    return version.split("+", 1)[0].strip()


def release_of(torch_npu_version: str) -> OpPluginRelease | None:
    version = base_version(torch_npu_version)
    return next((r for r in SUPPORTED_RELEASES if version in r.torch_npu), None)


def torch_for(torch_npu_version: str) -> str:
    """The torch a torch_npu needs: its own version without `.postN` (Ascend/pytorch's naming rule)."""
    return re.sub(r"\.post\d+$", "", base_version(torch_npu_version))


def argument_names(op: Any) -> frozenset[str] | None:
    """The argument names of a `torch.ops` packet's default overload, or None when the op carries no schema."""
    schema = getattr(getattr(op, "default", None), "_schema", None)
    arguments = getattr(schema, "arguments", None)
    if arguments is None:
        return None
    return frozenset(str(getattr(a, "name", "")) for a in arguments)


def signature_problem(name: str, op: Any) -> str | None:
    """Why `op` cannot take the keywords the backend passes it, or None (also when it carries no schema to read)."""
    names = argument_names(op)
    if names is None:
        return None
    missing = sorted(KEYWORDS[name] - names)
    return f"its schema lacks {', '.join(missing)}" if missing else None


@dataclass(frozen=True)
class NPUStack:
    """What torch_npu offers the backend: its version, the release line (None outside the matrix), the ops present,
    and whether the scatter write takes `cache_mode` (else the backend writes through `_npu_reshape_and_cache`)."""

    torch_version: str
    torch_npu_version: str
    release: OpPluginRelease | None
    present: frozenset[str]
    scatter_cache_mode: bool

    def used_ops(self) -> tuple[str, ...]:
        """Every op the backend calls on this stack (the cache write it chose, the attention and fused kernels)."""
        return (self.cache_write_op, *ATTENTION_OPS, *FUSED_OPS)

    @property
    def cache_write_op(self) -> str:
        return SCATTER_OP if self.scatter_cache_mode else RESHAPE_AND_CACHE_OP

    @property
    def moe_combine_op(self) -> str:
        """`npu_moe_token_unpermute` where the line has it (7.1.0 on), else `npu_moe_finalize_routing`."""
        return UNPERMUTE_OP if UNPERMUTE_OP in self.present else FINALIZE_OP

    def moe_ops(self) -> tuple[str, ...]:
        """The ops a MoE layer calls on this stack (the gating op used depends on the model's routing rule)."""
        return (*MOE_OPS, self.moe_combine_op)

    def missing_moe(self) -> list[str]:
        return [op for op in self.moe_ops() if op not in self.present]

    def missing_int8(self, *, linear: bool, experts: bool) -> list[str]:
        """The int8 ops a model with int8 linear layers and/or int8 experts calls that this stack lacks."""
        wanted = (INT8_LINEAR_OPS if linear else ()) + (INT8_MOE_OPS if experts else ())
        return sorted({op for op in wanted if op not in self.present})

    def missing_mla(self) -> list[str]:
        return [op for op in MLA_OPS if op not in self.present]

    def missing(self) -> list[str]:
        needed = [op for op in REQUIRED_OPS if op != RESHAPE_AND_CACHE_OP] + [self.cache_write_op]
        return [op for op in needed if op not in self.present]

    def torch_mismatch(self) -> str | None:
        """Why torch does not fit this torch_npu, or None."""
        wanted = torch_for(self.torch_npu_version)
        if base_version(self.torch_version) != wanted:
            return f"torch {self.torch_version} with torch_npu {self.torch_npu_version}, which needs torch {wanted}"
        return None

    def describe(self) -> str:
        line = f"op-plugin {self.release.name}, CANN {self.release.cann}" if self.release else "outside the matrix"
        return f"torch_npu {self.torch_npu_version} ({line}), torch {self.torch_version}"


def detect(ops: Any, torch_version: str) -> NPUStack:
    """The stack behind the imported torch_npu module `ops`."""
    version = str(getattr(ops, "__version__", "unknown"))
    release = release_of(version)
    present = frozenset(op for op in (*REQUIRED_OPS, SCATTER_OP, *MOE_OPS, *MOE_COMBINE_OPS, *MLA_OPS, *INT8_LINEAR_OPS)
                        if callable(getattr(ops, op, None)))
    scatter_mode = False
    if SCATTER_OP in present:
        names = argument_names(getattr(ops, SCATTER_OP))
        scatter_mode = "cache_mode" in names if names is not None else bool(release and release.scatter_cache_mode)
    return NPUStack(torch_version=torch_version, torch_npu_version=version, release=release, present=present,
                    scatter_cache_mode=scatter_mode)


def matrix_lines() -> list[str]:
    """The supported matrix, one line per release line (for messages and `npuserve doctor`)."""
    return [f"op-plugin {r.name}: torch_npu {' / '.join(r.torch_npu)} with CANN and NNAL {r.cann}"
            for r in SUPPORTED_RELEASES]
