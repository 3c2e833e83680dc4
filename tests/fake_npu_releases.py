"""The FAKE torch_npu's releases, for tests: which operations each op-plugin release line has, under which
signature, and the torch_npu and CANN versions that ship it.

Sources:
- operations and arguments: Ascend/op-plugin, per release branch: `op_plugin/python/atb/_atb_ops.py` (API_LIST:
  `_npu_reshape_and_cache`, `_npu_flash_attention`, `_npu_flash_attention_qlens`, `_npu_paged_attention`,
  `_npu_paged_attention_splitfuse` in every branch from 7.0.0; `_npu_paged_attention_get_workspace` from 7.2.0),
  the ATB ops' `m.def(...)` schemas (`_npu_paged_attention` gains `*, Tensor? workspace=None` in 7.2.0), and
  `op_plugin/config/op_plugin_functions.yaml` (`npu_scatter_pa_kv_cache` first appears in 7.2.0 without
  `cache_mode`; 26.0.0 adds `str? cache_mode='PA_NZ'`; the fused kernels in every branch);
- the MoE and MLA ops (tests/fake_npu_moe.py, tests/fake_npu_mla.py): the first op-plugin branch whose
  `op_plugin_functions.yaml` has each schema (shared/notes/moe-mla-lws.md): `npu_moe_gating_top_k_softmax`,
  `npu_moe_finalize_routing` from 6.0.rc2, so in every line here; `npu_moe_gating_top_k`,
  `npu_moe_init_routing_v2`, `npu_grouped_matmul` with a Tensor group_list, `npu_kv_rmsnorm_rope_cache` and
  `npu_fused_infer_attention_score` with query_rope/key_rope from 7.0.0; `npu_moe_token_unpermute` from 7.1.0.
  `npu_moe_init_routing_v2`'s quant_mode defaults to 0 in 7.0.0-7.3.0 and to -1 from 26.0.0 (which adds x_dtype);
- the int8 ops (tests/fake_npu_quant.py): `npu_quantize`, `npu_quant_matmul`, `npu_trans_quant_param` in every
  line (6.0.rc2's yaml has them); `npu_dynamic_quant` from 6.0.rc3; `npu_trans_quant_param` takes `round_mode` from
  7.1.0, `npu_quant_matmul` `group_sizes` from 7.1.0 and `x1_dtype`... `y_scale` from 26.0.0, `npu_dynamic_quant`
  `quant_mode`/`dst_type_max` from 26.0.0;
- versions: Ascend/pytorch `COMPATIBILITY.en.md` (master, 2026-08), the TorchNPU / PyTorch / CANN table: one
  torch_npu of each line stands for it here.

The fake stands for the hardware and its software stack; it does not import the engine's own table of the same facts
(engine/backends/npu_stack.py), so the two are checked against each other by the tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tests import fake_npu_attention as attention
from tests import fake_npu_fused as fused
from tests import fake_npu_mla as mla
from tests import fake_npu_moe as moe
from tests import fake_npu_quant as quant


@dataclass(frozen=True)
class FakeRelease:
    name: str  # the op-plugin release line (the Ascend Extension for PyTorch version)
    torch_npu: str  # `torch_npu.__version__` of one package of the line
    cann: str  # the CANN (and NNAL) version the line pairs with
    scatter: Callable[..., None] | None  # npu_scatter_pa_kv_cache as the line has it, or None when absent
    paged_workspace: bool  # `_npu_paged_attention` takes `workspace=`
    token_unpermute: bool = True  # `npu_moe_token_unpermute` exists (7.1.0 on)
    routing_quant_default: int = 0  # npu_moe_init_routing_v2's quant_mode default (0 until 7.3.0, -1 from 26.0.0)

    def ops(self) -> dict[str, Callable[..., Any]]:
        found: dict[str, Callable[..., Any]] = {
            "_npu_reshape_and_cache": attention._npu_reshape_and_cache,
            "_npu_flash_attention": attention._npu_flash_attention,
            "_npu_flash_attention_qlens": attention._npu_flash_attention_qlens,
            "_npu_paged_attention": (attention._npu_paged_attention_workspace if self.paged_workspace
                                     else attention._npu_paged_attention),
            "_npu_paged_attention_splitfuse": attention._npu_paged_attention_splitfuse,
            "npu_rms_norm": fused.npu_rms_norm,
            "npu_swiglu": fused.npu_swiglu,
            "npu_rotary_mul": fused.npu_rotary_mul,
        }
        if self.scatter is not None:
            found["npu_scatter_pa_kv_cache"] = self.scatter
        found.update({
            "npu_moe_gating_top_k_softmax": moe.npu_moe_gating_top_k_softmax,
            "npu_moe_gating_top_k": moe.npu_moe_gating_top_k,
            "npu_moe_init_routing_v2": (moe.npu_moe_init_routing_v2_quant0 if self.routing_quant_default == 0
                                        else moe.npu_moe_init_routing_v2),
            "npu_grouped_matmul": moe.npu_grouped_matmul,
            "npu_moe_finalize_routing": moe.npu_moe_finalize_routing,
            "npu_kv_rmsnorm_rope_cache": mla.npu_kv_rmsnorm_rope_cache,
            "npu_fused_infer_attention_score": mla.npu_fused_infer_attention_score,
        })
        if self.token_unpermute:
            found["npu_moe_token_unpermute"] = moe.npu_moe_token_unpermute
        found.update(quant.quant_ops(self.name))  # its grouped matmul takes int8 too, else the float one's
        return found


RELEASES: dict[str, FakeRelease] = {r.name: r for r in (
    FakeRelease("7.0.0", "2.5.1", "8.1.RC1", None, paged_workspace=False, token_unpermute=False),
    FakeRelease("7.1.0", "2.6.0", "8.2.RC1", None, paged_workspace=False),
    FakeRelease("7.2.0", "2.7.1", "8.3.RC1", attention.npu_scatter_pa_kv_cache_pa_nz, paged_workspace=True),
    FakeRelease("7.3.0", "2.8.0.post2", "8.5.0", attention.npu_scatter_pa_kv_cache_pa_nz, paged_workspace=True),
    FakeRelease("26.0.0", "2.8.0.post4", "9.0.0", attention.npu_scatter_pa_kv_cache, paged_workspace=True,
                routing_quant_default=-1),
    FakeRelease("26.1.0", "2.10.0.post4", "9.1.0", attention.npu_scatter_pa_kv_cache, paged_workspace=True,
                routing_quant_default=-1),
)}
ATB_OPS = frozenset({"_npu_reshape_and_cache", "_npu_flash_attention", "_npu_flash_attention_qlens",
                     "_npu_paged_attention", "_npu_paged_attention_splitfuse"})  # loaded from NNAL's libatb.so
