"""A FAKE of torch_npu's multi-head latent attention operations, for tests: plain torch on the CPU, no NPU kernel.

Sources (shared/notes/moe-mla-lws.md, section B): Ascend/op-plugin `op_plugin_functions.yaml` per branch and the
torch_npu API pages `torch_npu-npu_kv_rmsnorm_rope_cache.md` / `torch_npu-npu_fused_infer_attention_score.md`; the
KvRmsNormRopeCache operator's documented formula (Ascend ops-transformer `posembedding/kv_rms_norm_rope_cache`
README: the rope half is de-interleaved, `x1 = x[..., ::2]`, `x2 = x[..., 1::2]`, then `cat(x1, x2) * cos +
cat(-x2, x1) * sin`); vllm-project/vllm-ascend v0.11.0 `attention/mla_v1.py` for the production calls.

- `npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, index, k_cache, ckv_cache, *, k_rope_scale, c_kv_scale,
  k_rope_offset, c_kv_offset, epsilon=1e-5, cache_mode='Norm', is_output_kv=False) -> 4 tensors` (7.0.0): kv
  `(B, 1, S, 512 + 64)` float16/bfloat16; the first 512 channels RMS-normalised with gamma `(512,)`, the last 64
  rotated as above with cos/sin `(B, 1, S, 64)`; cache_mode "PA" (also "PA_BNSD"): index int64 `(B*S,)` slots
  (negative: skipped), k_cache the rope cache `(blocks, block_size, 1, 64)`, ckv_cache the latent cache `(blocks,
  block_size, 1, 512)`, written in place; returns (k_cache, ckv_cache, k_rope, c_kv), the last two only with
  is_output_kv (shaped as kv's, `(B, 1, S, 64)` and `(B, 1, S, 512)`). The fake implements the ND "PA" modes
  without quantisation; "PA_NZ", "Norm" and the scales are refused as not implemented.
- `npu_fused_infer_attention_score(query, key, value, *, ..., query_rope, key_rope, ...) -> (out, lse)` (query_rope
  and key_rope since 7.0.0): the fake implements its MLA paged decode only, under the doc's MLA constraints: KV
  heads 1; query heads in {1, 2, 4, 8, 16, 32, 64, 128}; query D 512 (or 128); rope D 64; sparse_mode 0; no
  softmax_lse; PageAttention with block_size a multiple of 16 and <= 1024, block_table int32, actual_seq_lengths_kv
  one length per sequence; input_layout "BNSD" (query `(B, N, 1, D)`, key `(blocks, 1, block_size, D)` or `(blocks,
  block_size, D)`). Scores `(q . c_kv + q_rope . k_rope) * scale`, values = value (the latent). Other layouts
  ("TND" is legal) and the non-MLA uses are refused as not implemented by the fake.

What it cannot check: the kernels' numerics, the NZ layouts, the workspace of graph capture.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.fake_npu_attention import integer, require

MLA_DTYPES = (torch.float16, torch.bfloat16)
KV_LORA = 512  # npu_kv_rmsnorm_rope_cache: gamma (512,) ; FIA MLA: query D 512
FIA_QUERY_DIMS = (512, 128)  # FIA MLA: "query D is 512 (or 128)"
ROPE_DIM = 64
FIA_QUERY_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
FIA_BLOCK_MULTIPLE = 16
FIA_MAX_BLOCK = 1024


def _t(name: str, t: object, ndim: int, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    require(isinstance(t, torch.Tensor), f"{name}: expected a tensor, got {type(t).__name__}")
    assert isinstance(t, torch.Tensor)
    require(t.dim() == ndim, f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    require(t.dtype in dtypes, f"{name}: dtype {t.dtype} not supported (takes {', '.join(map(str, dtypes))})")
    return t


def npu_kv_rmsnorm_rope_cache(kv: torch.Tensor, gamma: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                              index: torch.Tensor, k_cache: torch.Tensor, ckv_cache: torch.Tensor, *,
                              k_rope_scale: Any = None, c_kv_scale: Any = None, k_rope_offset: Any = None,
                              c_kv_offset: Any = None, epsilon: float = 1e-5, cache_mode: str = "Norm",
                              is_output_kv: bool = False) -> tuple[Any, Any, Any, Any]:
    x = _t("kv", kv, 4, MLA_DTYPES)
    batch, heads, seq, dim = x.shape
    require(heads == 1, f"kv: N = {heads}, the op takes (B, 1, S, D)")
    g = _t("gamma", gamma, 1, (x.dtype,))
    require(g.shape[0] == KV_LORA, f"gamma: {g.shape[0]} channels, the op normalises {KV_LORA}")
    require(dim == KV_LORA + ROPE_DIM, f"kv: D = {dim}, the op takes {KV_LORA} + {ROPE_DIM} (rope)")
    for name, table in (("cos", cos), ("sin", sin)):
        c = _t(name, table, 4, (x.dtype,))
        require(tuple(c.shape) == (batch, 1, seq, ROPE_DIM), f"{name}: shape {tuple(c.shape)}, expected "
                                                              f"{(batch, 1, seq, ROPE_DIM)}")
    require(all(s is None for s in (k_rope_scale, c_kv_scale, k_rope_offset, c_kv_offset)),
            "quantisation scales: the fake implements none")
    require(isinstance(epsilon, float), f"epsilon: expected a float, got {epsilon!r}")
    require(cache_mode in ("Norm", "PA", "PA_BNSD", "PA_NZ", "PA_BLK_BNSD", "PA_BLK_NZ"),
            f"cache_mode {cache_mode!r}: not a mode of the op")
    require(cache_mode in ("PA", "PA_BNSD"), f"cache_mode {cache_mode!r}: the fake implements the ND PA modes")
    slots = _t("index", index, 1, (torch.int64,))
    require(slots.shape[0] == batch * seq, f"index: {slots.shape[0]} slots for {batch * seq} tokens")
    rope_cache = _t("k_cache", k_cache, 4, (x.dtype,))
    latent_cache = _t("ckv_cache", ckv_cache, 4, (x.dtype,))
    require(rope_cache.shape[2] == 1 and rope_cache.shape[3] == ROPE_DIM,
            f"k_cache: shape {tuple(rope_cache.shape)}, expected (blocks, block_size, 1, {ROPE_DIM})")
    require(latent_cache.shape[2] == 1 and latent_cache.shape[3] == KV_LORA,
            f"ckv_cache: shape {tuple(latent_cache.shape)}, expected (blocks, block_size, 1, {KV_LORA})")
    require(latent_cache.shape[:2] == rope_cache.shape[:2], "k_cache and ckv_cache: different blocks")
    capacity = latent_cache.shape[0] * latent_cache.shape[1]
    require(bool((slots < capacity).all()), f"index: slots beyond the cache's {capacity}")
    xf = x.float()
    c = xf[..., :KV_LORA]
    normed = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + epsilon) * g.float()
    pe = xf[..., KV_LORA:]
    halves = torch.cat((pe[..., ::2], pe[..., 1::2]), dim=-1)
    h1, h2 = halves.chunk(2, dim=-1)
    rotated = halves * cos.float() + torch.cat((-h2, h1), dim=-1) * sin.float()
    c_out, k_out = normed.to(x.dtype), rotated.to(x.dtype)
    valid = slots >= 0
    flat_latent = latent_cache.view(-1, KV_LORA)
    flat_rope = rope_cache.view(-1, ROPE_DIM)
    flat_latent[slots[valid]] = c_out.reshape(-1, KV_LORA)[valid]
    flat_rope[slots[valid]] = k_out.reshape(-1, ROPE_DIM)[valid]
    if is_output_kv:
        return rope_cache, latent_cache, k_out, c_out
    return rope_cache, latent_cache, None, None


def npu_fused_infer_attention_score(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, pse_shift: Any = None, atten_mask: Any = None,
    actual_seq_lengths: Any = None, actual_seq_lengths_kv: Any = None, dequant_scale1: Any = None,
    quant_scale1: Any = None, dequant_scale2: Any = None, quant_scale2: Any = None, quant_offset2: Any = None,
    antiquant_scale: Any = None, antiquant_offset: Any = None, block_table: Any = None,
    query_padding_size: Any = None, kv_padding_size: Any = None, key_antiquant_scale: Any = None,
    key_antiquant_offset: Any = None, value_antiquant_scale: Any = None, value_antiquant_offset: Any = None,
    key_shared_prefix: Any = None, value_shared_prefix: Any = None, actual_shared_prefix_len: Any = None,
    query_rope: Any = None, key_rope: Any = None, key_rope_antiquant_scale: Any = None, num_heads: int = 1,
    scale: float = 1.0, pre_tokens: int = 2147483647, next_tokens: int = 2147483647, input_layout: str = "BSH",
    num_key_value_heads: int = 0, sparse_mode: int = 0, inner_precise: int = 0, block_size: int = 0,
    antiquant_mode: int = 0, softmax_lse_flag: bool = False, key_antiquant_mode: int = 0,
    value_antiquant_mode: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MLA paged decode (module docstring): (out `(B, N, 1, D)` in the query's dtype, an empty lse)."""
    require(query_rope is not None and key_rope is not None,
            "query_rope/key_rope: the fake implements the MLA path (both given) only")
    require(input_layout in ("BSH", "BSND", "BNSD", "TND", "NTD", "BNSD_BSND", "TND_NTD", "NTD_TND"),
            f"input_layout {input_layout!r}: not a layout of the op")
    require(input_layout == "BNSD", f"input_layout {input_layout!r}: the fake implements BNSD (TND is legal)")
    q = _t("query", query, 4, MLA_DTYPES)
    batch, heads, seq, dim = q.shape
    require(seq == 1, f"query: S = {seq}, the fake implements decode (S = 1)")
    require(integer("num_heads", num_heads) == heads, f"num_heads {num_heads} but query has {heads} heads")
    require(heads in FIA_QUERY_HEADS, f"query: N = {heads}, MLA takes N in {FIA_QUERY_HEADS}")
    require(integer("num_key_value_heads", num_key_value_heads) == 1,
            f"num_key_value_heads {num_key_value_heads}: MLA takes 1")
    require(dim in FIA_QUERY_DIMS, f"query: D = {dim}, MLA takes {' or '.join(map(str, FIA_QUERY_DIMS))}")
    qr = _t("query_rope", query_rope, 4, (q.dtype,))
    require(tuple(qr.shape) == (batch, heads, 1, ROPE_DIM), f"query_rope: shape {tuple(qr.shape)}, expected "
                                                              f"{(batch, heads, 1, ROPE_DIM)} (rope D 64)")
    require(all(a is None for a in (pse_shift, atten_mask, actual_seq_lengths, dequant_scale1, quant_scale1,
                                    dequant_scale2, quant_scale2, quant_offset2, antiquant_scale, antiquant_offset,
                                    query_padding_size, kv_padding_size, key_antiquant_scale, key_antiquant_offset,
                                    value_antiquant_scale, value_antiquant_offset, key_shared_prefix,
                                    value_shared_prefix, actual_shared_prefix_len, key_rope_antiquant_scale)),
            "masks, quantisation, shared prefixes: the fake's MLA decode implements none")
    require(integer("sparse_mode", sparse_mode) in (0, 3, 4), f"sparse_mode {sparse_mode}: MLA takes 0, 3 or 4")
    require(sparse_mode == 0, "sparse_mode: decode without a mask is 0")
    require(not softmax_lse_flag, "softmax_lse_flag: MLA has no softmax_lse")
    require(integer("antiquant_mode", antiquant_mode) == 0, "antiquant_mode: 0 without quantisation")
    require(isinstance(scale, float), f"scale: expected a float, got {scale!r}")

    def paged(name: str, t: object, width: int) -> torch.Tensor:
        c = t if isinstance(t, torch.Tensor) and t.dim() == 3 else _t(name, t, 4, (q.dtype,))
        assert isinstance(c, torch.Tensor)
        require(c.dtype == q.dtype, f"{name}: dtype {c.dtype}, the query's is {q.dtype}")
        if c.dim() == 4:
            require(c.shape[1] == 1, f"{name}: shape {tuple(c.shape)}, KV heads must be 1 (blocks, 1, bs, D)")
            c = c.reshape(c.shape[0], c.shape[2], c.shape[3])
        require(c.shape[-1] == width, f"{name}: D = {c.shape[-1]}, expected {width}")
        return c

    k, v, kr = paged("key", key, dim), paged("value", value, dim), paged("key_rope", key_rope, ROPE_DIM)
    blocks, bs = k.shape[0], k.shape[1]
    require(v.shape == k.shape and kr.shape[:2] == k.shape[:2], "key, value, key_rope: different blocks")
    require(integer("block_size", block_size) == bs, f"block_size {block_size}, the cache's blocks hold {bs}")
    require(bs % FIA_BLOCK_MULTIPLE == 0 and 0 < bs <= FIA_MAX_BLOCK,
            f"block_size {bs}: a multiple of {FIA_BLOCK_MULTIPLE} and at most {FIA_MAX_BLOCK}")
    table = _t("block_table", block_table, 2, (torch.int32,))
    require(table.shape[0] == batch, f"block_table: {table.shape[0]} rows for {batch} sequences")
    require(isinstance(actual_seq_lengths_kv, list | tuple) and len(actual_seq_lengths_kv) == batch
            and all(isinstance(n, int) and n > 0 for n in actual_seq_lengths_kv),
            f"actual_seq_lengths_kv: one positive int per sequence, got {actual_seq_lengths_kv!r}")
    out = torch.empty(batch, heads, 1, dim, dtype=torch.float32)
    for b, length in enumerate(actual_seq_lengths_kv):
        needed = -(-length // bs)
        require(needed <= table.shape[1], f"block_table: {table.shape[1]} blocks for {length} tokens")
        ids = table[b, :needed].long()
        require(bool(((ids >= 0) & (ids < blocks)).all()), f"block_table row {b}: block ids outside the cache")
        ck = k.index_select(0, ids).reshape(-1, dim)[:length].float()
        cv = v.index_select(0, ids).reshape(-1, dim)[:length].float()
        pe = kr.index_select(0, ids).reshape(-1, ROPE_DIM)[:length].float()
        scores = (q[b, :, 0].float() @ ck.t() + qr[b, :, 0].float() @ pe.t()) * scale
        out[b, :, 0] = torch.softmax(scores, dim=-1) @ cv
    return out.to(q.dtype), torch.empty(0, dtype=torch.float32)
