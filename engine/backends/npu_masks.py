"""The attention masks the Ascend kernels read, in the conventions of their production callers.

- The causal mask `[size, size]` (`_npu_flash_attention`: ATB SelfAttention PA_ENCODER, MASK_TYPE_NORM; and the
  prefix-encoder kernel's compressed `[128, 128]` one): masked positions above the diagonal hold the float32 minimum
  in float16 (-inf once cast) and 1 in bfloat16, as vllm-project/vllm-ascend (v0.9.1 `attention/attention.py`
  generate_attn_mask) and sgl-project/sglang (`layers/attention/ascend_backend.py` gen_attention_mask) build them.
  On Atlas A2/A3 the flash kernel reads the top-left `[S, S]` of a larger mask (ATB SelfAttentionOperation
  constraints, ascendtb_01_0076: only Atlas inference products need the mask at the real max_seq_len), so one mask
  at the longest sequence serves every step.
- The SplitFuse mask `[tokens, longest context]` (`_npu_paged_attention_splitfuse`: ATB PagedAttention with
  MASK_TYPE_SPEC), additive per query token: 0 where the token sees the key (key position <= its own), a large
  negative where not: -inf in float16 (vllm-ascend v0.9.1 get_splitfuse_attn_mask: the float32 minimum), -10000 in
  bfloat16 (vllm-ascend's mask scale factor; op-plugin 7.3.0 `test/test_custom_ops/
  test_atb_paged_attention_splitfuse.py` builds -10000).
"""

from __future__ import annotations

import torch

KERNEL_DTYPES = (torch.float16, torch.bfloat16)  # ATB flash and paged attention: float16 and bfloat16
SPLITFUSE_MASKED = {torch.float16: float("-inf"), torch.bfloat16: -10000.0}


def check_kernel_dtype(dtype: torch.dtype) -> None:
    if dtype not in KERNEL_DTYPES:
        raise ValueError(f"the Ascend attention kernels take float16 or bfloat16, not {dtype}")


def causal_mask(size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`[size, size]`, the positions above the diagonal masked in the dtype's convention, contiguous."""
    check_kernel_dtype(dtype)
    above = torch.ones(size, size, dtype=torch.bool).triu_(1)
    fill = torch.finfo(torch.float32).min if dtype == torch.float16 else 1.0
    mask = torch.zeros(size, size, dtype=torch.float32).masked_fill_(above, fill)
    return mask.to(dtype=dtype).to(device).contiguous()


def splitfuse_mask(positions: torch.Tensor, longest_context: int, dtype: torch.dtype) -> torch.Tensor:
    """`[len(positions), longest_context]` on the positions' device: row r masks every key after position
    `positions[r]` (the query token's own)."""
    check_kernel_dtype(dtype)
    keys = torch.arange(longest_context, device=positions.device)
    masked = keys.view(1, -1) > positions.view(-1, 1)
    mask = torch.zeros(masked.shape, dtype=dtype, device=positions.device)
    return mask.masked_fill_(masked, SPLITFUSE_MASKED[dtype])
