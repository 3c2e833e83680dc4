"""A FAKE of torch_npu's cache and attention operations, for tests: plain torch on the CPU, no NPU kernel.

Each op computes its documented semantics in float32 and refuses what the real operation refuses, each rule cited
where it is checked. Sources, by short name:

- [schema]: the ops' schemas in Ascend/op-plugin, per release branch (7.0.0, 7.1.0, 7.2.0, 7.3.0, 26.0.0, 26.1.0):
  `op_plugin/ops/atb/*.cpp` (`m.def(...)` of the ATB ops) and `op_plugin/config/op_plugin_functions.yaml`
  (`npu_scatter_pa_kv_cache`); the C++ shows which tensors go to the kernel from the host (`Input(t, true)`).
- [atb-pa]: ATB PagedAttentionOperation constraints (hiascend CANN docs, ascendtb_01_0198 in CANN 9.0.0/9.1.0;
  ascendtb_01_0070 in CANN 8.0.RC2): block_size % 16 == 0, block_size x head_size <= 128 x 128, head_size in
  (0, 256], block ids in [0, num_blocks), block_size <= 128 with parallel decoding (CALC_TYPE_SPEC, the splitfuse
  op), max_num_blocks_per_seq >= ceil(max(contextLens) / block_size).
- [atb-prefix]: ATB SelfAttention, calcType PREFIX_ENCODER (ascendtb_01_0266, CANN 9.0.0/9.1.0): block size 128,
  prefix (kvSeqLen - seqLen) 128-aligned, K/V head size <= 128 and 16-aligned, block x head <= 128 x 128, the
  NORM_COMPRESS mask [128, 128], seqLen and kvSeqLen int32 on the host.
- [atb-sa]: ATB SelfAttentionOperation constraints (ascendtb_01_0076, CANN 8.0.RC2) and PA_ENCODER inputs
  (ascendtb_01_0265/0281): mask [maxSeqLen, maxSeqLen]; only Atlas inference products (310P) need the mask at the
  real max_seq_len, so an A2/A3 card reads the top-left [S, S] of a larger mask; GQA head_size in (0, 256].
- [splitfuse-test]: op-plugin `test/test_custom_ops/test_atb_paged_attention_splitfuse.py` (7.3.0): the mask is
  [sum(query lens), max(context lens)], row r additive (0 where token r sees the key, -10000 where not);
  vllm-project/vllm-ascend v0.9.1 `attention/attention.py` (get_splitfuse_attn_mask) builds the same rows by
  position (float16: the float32 minimum; bfloat16: -10000).
- [vllm-ascend]: vllm-project/vllm-ascend v0.9.1 and v0.11.0 `attention/attention_v1.py`, the production calls
  (keywords, int32 host lengths, the masks' value conventions: float16 the float32 minimum, bfloat16 1).
- [scatter]: op-plugin `op_plugin/ops/opapi/ScatterPaKvCacheNpuOpApi.cpp`: 7.2.0 and 7.3.0 pass cache_mode "PA_NZ"
  to aclnnScatterPaKvCache whatever the caller wants (no argument), 26.0.0 takes `cache_mode` with the schema
  default 'PA_NZ'; the op does not exist before 7.2.0.

Stricter than the schemas in one way, on purpose: the arguments are keyword-only (the schemas also take them by
position), so a misnamed or missing argument fails here as it would fail on a card under any other name.

What it cannot check: host versus device placement (everything is on the CPU), the kernels' real numerics (it
computes in float32 and rounds once), the FRACTAL_NZ layout (it holds ND caches only), limits no source states.
"""

from __future__ import annotations

import torch

ACTIVATION_DTYPES = (torch.float16, torch.bfloat16)
CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.int8)  # the cache write's documented dtypes on A2/A3
COMPRESSED_MASK_SIZE = 128  # [atb-prefix] NORM_COMPRESS
PAGED_BLOCK_MULTIPLE = 16  # [atb-pa]
MAX_BLOCK_X_HEAD = 128 * 128  # [atb-pa], [atb-prefix]
MAX_HEAD_SIZE = 256  # [atb-pa], [atb-sa]
SPLITFUSE_MAX_BLOCK = 128  # [atb-pa] parallel decoding
PREFIX_BLOCK = 128  # [atb-prefix]
PREFIX_MAX_HEAD = 128  # [atb-prefix]
PREFIX_ALIGN = 128  # [atb-prefix]
SPLITFUSE_MASKED_AT_MOST = -9984.0  # [splitfuse-test]: -10000 as bfloat16 holds it; a masked entry is this or below
NNAL_MISSING = ("Please check that the nnal package is installed. Please run 'source set_env.sh' in the NNAL "
                "installation path.")  # torch_npu's message (op-plugin op_plugin/python/atb/_atb_ops.py)


class FakeNPUError(RuntimeError):
    """What the real operation would refuse (an ACL/ATB error on hardware)."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise FakeNPUError(message)


def tensor(name: str, t: object, *, ndim: int, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    require(isinstance(t, torch.Tensor), f"{name}: expected a tensor, got {type(t).__name__}")
    assert isinstance(t, torch.Tensor)
    require(t.dim() == ndim, f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    require(t.dtype in dtypes, f"{name}: dtype {t.dtype} not supported (takes {', '.join(map(str, dtypes))})")
    require(t.is_contiguous(), f"{name}: must be contiguous (shape {tuple(t.shape)}, strides {t.stride()})")
    return t


def integer(name: str, value: object) -> int:
    require(isinstance(value, int) and not isinstance(value, bool), f"{name}: expected an int, got {value!r}")
    assert isinstance(value, int)
    return value


def _scale(value: object) -> float:
    require(isinstance(value, float | int) and not isinstance(value, bool), f"scale_value: expected a float, "
            f"got {value!r}")
    assert isinstance(value, float | int)
    return float(value)


def _heads(query: torch.Tensor, num_heads: object, num_kv_heads: object, kv_heads_seen: int) -> tuple[int, int]:
    heads, kv_heads = integer("num_heads", num_heads), integer("num_kv_heads", num_kv_heads)
    require(heads == query.shape[1], f"num_heads {heads} but query has {query.shape[1]} heads")
    require(kv_heads == kv_heads_seen, f"num_kv_heads {kv_heads} but the keys have {kv_heads_seen} heads")
    require(kv_heads > 0 and heads % kv_heads == 0, f"num_heads {heads} is not a multiple of num_kv_heads {kv_heads}")
    require(0 < query.shape[2] <= MAX_HEAD_SIZE, f"head size {query.shape[2]} outside (0, {MAX_HEAD_SIZE}]")
    return heads, kv_heads


def _out(out: object, query: torch.Tensor) -> torch.Tensor:
    t = tensor("out", out, ndim=query.dim(), dtypes=(query.dtype,))
    require(t.shape == query.shape, f"out: shape {tuple(t.shape)}, expected the query's {tuple(query.shape)}")
    return t


def _lens(name: str, t: object, batch: int | None = None) -> torch.Tensor:
    """Per-sequence lengths: int32 (on the host, which the fake cannot tell from the device)."""
    lens = tensor(name, t, ndim=1, dtypes=(torch.int32,))
    if batch is not None:
        require(lens.shape[0] == batch, f"{name}: {lens.shape[0]} lengths for {batch} sequences")
    require(bool((lens > 0).all()), f"{name}: every length must be positive, got {lens.tolist()}")
    return lens


def _mask_is_causal(mask: torch.Tensor) -> torch.Tensor:
    """The mask's masked positions, by the dtype's convention [vllm-ascend] (float16: the float32 minimum, -inf
    once cast; bfloat16: 1); anything else is refused."""
    values = mask.float()
    if mask.dtype == torch.float16:
        masked = values <= torch.finfo(torch.float16).min
        require(bool(((values == 0) | masked).all()), "mask: a float16 mask holds 0 or the float32 minimum (-inf)")
    else:
        masked = values == 1
        require(bool(((values == 0) | masked).all()), "mask: a bfloat16 mask holds 0 or 1 (1 = masked)")
    return masked


def _cache(name: str, t: object, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A paged cache `(num_blocks, block_size, kv_heads, head_dim)`, ND."""
    return tensor(name, t, ndim=4, dtypes=(dtype,) if dtype is not None else CACHE_DTYPES)


def _paged_block_size(cache: torch.Tensor, *, max_block: int | None = None) -> int:
    """[atb-pa]: the paged kernels' block-size and head-size limits."""
    block, head = cache.shape[1], cache.shape[3]
    require(block % PAGED_BLOCK_MULTIPLE == 0, f"block size {block}: the paged-attention kernel takes a multiple of "
            f"{PAGED_BLOCK_MULTIPLE}")
    require(block * head <= MAX_BLOCK_X_HEAD, f"block size {block} x head size {head} = {block * head} exceeds "
            f"{MAX_BLOCK_X_HEAD} (128 x 128)")
    if max_block is not None:
        require(block <= max_block, f"block size {block}: parallel decoding (splitfuse) takes at most {max_block}")
    return block


def _positions_to_slots(block_table: torch.Tensor, row: int, length: int, block_size: int,
                        num_blocks: int) -> torch.Tensor:
    positions = torch.arange(length)
    columns = positions // block_size
    require(int(columns.max()) < block_table.shape[1],
            f"block_table row {row}: {block_table.shape[1]} blocks cannot hold {length} tokens of {block_size}")
    blocks = block_table[row].long().index_select(0, columns)
    require(bool(((blocks >= 0) & (blocks < num_blocks)).all()),
            f"block_table row {row}: block ids {sorted(set(blocks.tolist()))} outside 0..{num_blocks - 1}")
    return blocks * block_size + positions % block_size


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, masked: torch.Tensor | None = None,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """q `(Lq, H, D)`, k/v `(Lk, KVH, D)`; `masked` `(Lq, Lk)` bool or an additive `bias` `(Lq, Lk)`; float32 math,
    GQA by head // group."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    if masked is not None:
        scores = scores.masked_fill(masked.unsqueeze(0), float("-inf"))
    if bias is not None:
        scores = scores + bias.float().unsqueeze(0)
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), vf)


# --- the cache write -----------------------------------------------------------------------------------------------


def _write_cache(key: object, value: object, key_cache: object, value_cache: object, slots_name: str,
                 slots: object) -> None:
    """Row i of key/value into slot `slots[i]` (block = slot // block_size, offset = slot % block_size) of the ND
    caches, in place. Negative slots are skipped; slots must be distinct and below blocks x block_size."""
    k = tensor("key", key, ndim=3, dtypes=CACHE_DTYPES)
    v = tensor("value", value, ndim=3, dtypes=CACHE_DTYPES)
    kc = _cache("key_cache", key_cache, k.dtype)
    vc = _cache("value_cache", value_cache, v.dtype)
    s = tensor(slots_name, slots, ndim=1, dtypes=(torch.int32,))
    require(k.shape[0] == v.shape[0] == s.shape[0],
            f"key {tuple(k.shape)}, value {tuple(v.shape)} and {slots_name} {tuple(s.shape)} disagree on tokens")
    require(k.shape[1:] == kc.shape[2:], f"key rows {tuple(k.shape[1:])} do not fit key_cache {tuple(kc.shape)}")
    require(v.shape[1:] == vc.shape[2:], f"value rows {tuple(v.shape[1:])} do not fit value_cache {tuple(vc.shape)}")
    require(kc.shape[:2] == vc.shape[:2], "key_cache and value_cache differ in blocks or block size")
    num_slots = kc.shape[0] * kc.shape[1]
    valid = s >= 0
    live = s[valid].long()
    require(bool((live < num_slots).all()), f"{slots_name}: slots {live[live >= num_slots].tolist()} >= {num_slots}")
    require(len(set(live.tolist())) == live.numel(), f"{slots_name}: a slot appears twice")
    kc.view(num_slots, *kc.shape[2:]).index_copy_(0, live, k[valid])
    vc.view(num_slots, *vc.shape[2:]).index_copy_(0, live, v[valid])


def _npu_reshape_and_cache(*, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, slot_indices: torch.Tensor) -> None:
    """ATB ReshapeAndCache [schema] (every release from 7.0.0): an ND cache gets the ND layout (the op reads the
    caches' format; an NZ-formatted cache would get NZ). int32 slots [vllm-ascend]."""
    _write_cache(key, value, key_cache, value_cache, "slot_indices", slot_indices)


def npu_scatter_pa_kv_cache_pa_nz(*, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                                  value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                                  compress_lens: torch.Tensor | None = None,
                                  compress_seq_offsets: torch.Tensor | None = None,
                                  seq_lens: torch.Tensor | None = None) -> None:
    """op-plugin 7.2.0 and 7.3.0 [scatter]: no `cache_mode` argument; the op writes the PA_NZ layout whatever the
    cache is, so an ND cache gets rows it cannot read back. Refused here: the fake holds ND caches only."""
    tensor("key_cache", key_cache, ndim=4, dtypes=CACHE_DTYPES)
    raise FakeNPUError("npu_scatter_pa_kv_cache (op-plugin 7.2.0/7.3.0) hard-codes cache_mode 'PA_NZ': it would "
                       "write the FRACTAL_NZ layout into this ND cache (blocks, block_size, kv_heads, head_dim)")


def npu_scatter_pa_kv_cache(*, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                            compress_lens: torch.Tensor | None = None,
                            compress_seq_offsets: torch.Tensor | None = None, seq_lens: torch.Tensor | None = None,
                            cache_mode: str | None = "PA_NZ") -> None:
    """op-plugin 26.0.0 on [scatter]: `cache_mode` defaults to 'PA_NZ' (the schema's default); "Norm" writes the
    ND layout. The fake implements "Norm" only and refuses PA_NZ into its ND caches."""
    require(compress_lens is None and compress_seq_offsets is None and seq_lens is None,
            "compress_lens / compress_seq_offsets / seq_lens: the fake implements the uncompressed write only")
    require(cache_mode in ("Norm", "PA_NZ"), f"cache_mode {cache_mode!r}: takes 'Norm' or 'PA_NZ'")
    require(cache_mode == "Norm", f"cache_mode {cache_mode!r} (the default) writes the FRACTAL_NZ layout; this cache "
            "is ND (blocks, block_size, kv_heads, head_dim): pass cache_mode='Norm'")
    _write_cache(key, value, key_cache, value_cache, "slot_mapping", slot_mapping)


# --- attention -----------------------------------------------------------------------------------------------------


def _npu_flash_attention(*, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                         seq_len: torch.Tensor, scale_value: float, num_heads: int, num_kv_heads: int,
                         out: torch.Tensor) -> None:
    """ATB SelfAttention PA_ENCODER, MASK_TYPE_NORM [schema]: the flat tokens of each sequence (lengths `seq_len`)
    attend to their own keys through `mask[:L, :L]` of the `[S, S]` causal mask, S at least the longest sequence
    [atb-sa]."""
    q = tensor("query", query, ndim=3, dtypes=ACTIVATION_DTYPES)
    k = tensor("key", key, ndim=3, dtypes=(q.dtype,))
    v = tensor("value", value, ndim=3, dtypes=(q.dtype,))
    require(k.shape == v.shape and k.shape[0] == q.shape[0] and k.shape[2] == q.shape[2],
            f"query {tuple(q.shape)}, key {tuple(k.shape)}, value {tuple(v.shape)} do not fit")
    _heads(q, num_heads, num_kv_heads, k.shape[1])
    scale = _scale(scale_value)
    result = _out(out, q)
    lens = _lens("seq_len", seq_len)
    require(int(lens.sum()) == q.shape[0], f"seq_len sums to {int(lens.sum())}, query has {q.shape[0]} tokens")
    m = tensor("mask", mask, ndim=2, dtypes=(q.dtype,))
    longest = int(lens.max())
    require(m.shape[0] == m.shape[1] >= longest, f"mask {tuple(m.shape)}: expected [S, S] with S >= {longest}")
    masked = _mask_is_causal(m)
    start = 0
    for length in lens.tolist():
        rows = slice(start, start + length)
        result[rows] = _attend(q[rows], k[rows], v[rows], scale, masked[:length, :length]).to(result.dtype)
        start += length


def _paged_inputs(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, num_heads: int,
                  num_kv_heads: int, scale_value: float, out: torch.Tensor,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, torch.Tensor]:
    """The checks the paged kernels make of their query, caches, head counts, scale and output alike."""
    q = tensor("query", query, ndim=3, dtypes=ACTIVATION_DTYPES)
    kc = _cache("key_cache", key_cache, q.dtype)
    vc = _cache("value_cache", value_cache, q.dtype)
    require(kc.shape == vc.shape and kc.shape[3] == q.shape[2],
            f"key_cache {tuple(kc.shape)}, value_cache {tuple(vc.shape)}, query {tuple(q.shape)} do not fit")
    _heads(q, num_heads, num_kv_heads, kc.shape[2])
    return q, kc, vc, _scale(scale_value), _out(out, q)


def _flat(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(cache.shape[0] * cache.shape[1], *cache.shape[2:])


def _npu_flash_attention_qlens(*, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                               block_table: torch.Tensor, mask: torch.Tensor, seq_len: torch.Tensor,
                               context_lens: torch.Tensor, num_kv_heads: int, num_heads: int, scale_value: float,
                               out: torch.Tensor) -> None:
    """ATB SelfAttention PREFIX_ENCODER, NORM_COMPRESS [schema]: sequence b's `seq_len[b]` new tokens (flat in
    `query`) are the last of its `context_lens[b]` cached tokens (read through `block_table[b]`); new token i sees
    cached tokens 0..context-query+i. The limits are [atb-prefix]'s: block 128, the prefix 128-aligned, head size at
    most 128 and 16-aligned, the compressed [128, 128] mask."""
    q, kc, vc, scale, result = _paged_inputs(query, key_cache, value_cache, num_heads, num_kv_heads, scale_value, out)
    num_blocks, block_size, head = kc.shape[0], kc.shape[1], kc.shape[3]
    require(block_size == PREFIX_BLOCK, f"block size {block_size}: the prefix-encoder kernel takes exactly "
            f"{PREFIX_BLOCK}")
    require(head <= PREFIX_MAX_HEAD and head % 16 == 0, f"head size {head}: the prefix-encoder kernel takes a "
            f"multiple of 16 up to {PREFIX_MAX_HEAD}")
    tables = tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,))
    qlens = _lens("seq_len", seq_len, tables.shape[0])
    ctx = _lens("context_lens", context_lens, tables.shape[0])
    require(int(qlens.sum()) == q.shape[0], f"seq_len sums to {int(qlens.sum())}, query has {q.shape[0]} tokens")
    require(bool((ctx >= qlens).all()), f"context_lens {ctx.tolist()} shorter than seq_len {qlens.tolist()}")
    prefixes = (ctx - qlens).tolist()
    require(all(p % PREFIX_ALIGN == 0 for p in prefixes), f"prefix lengths {prefixes} (context_lens - seq_len): "
            f"the prefix-encoder kernel takes {PREFIX_ALIGN}-aligned prefixes only")
    m = tensor("mask", mask, ndim=2, dtypes=(q.dtype,))
    require(tuple(m.shape) == (COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE),
            f"mask {tuple(m.shape)}: expected the compressed [{COMPRESSED_MASK_SIZE}, {COMPRESSED_MASK_SIZE}] mask")
    expected = torch.ones(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, dtype=torch.bool).triu(1)
    require(bool((_mask_is_causal(m) == expected).all()), "mask: not the causal (upper-triangular) mask")
    flat_k, flat_v = _flat(kc), _flat(vc)
    start = 0
    for b, (qlen, clen) in enumerate(zip(qlens.tolist(), ctx.tolist(), strict=True)):
        slots = _positions_to_slots(tables, b, clen, block_size, num_blocks)
        first = clen - qlen
        masked = torch.arange(clen).view(1, -1) > (first + torch.arange(qlen)).view(-1, 1)
        rows = slice(start, start + qlen)
        result[rows] = _attend(q[rows], flat_k.index_select(0, slots), flat_v.index_select(0, slots), scale,
                               masked).to(result.dtype)
        start += qlen


def _decode(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, scale: float, result: torch.Tensor,
            block_table: object, context_lens: object) -> None:
    num_blocks, block_size = kc.shape[0], _paged_block_size(kc)
    tables = tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,))
    require(tables.shape[0] == q.shape[0], f"block_table has {tables.shape[0]} rows for {q.shape[0]} queries")
    ctx = _lens("context_lens", context_lens, q.shape[0])
    flat_k, flat_v = _flat(kc), _flat(vc)
    for b, clen in enumerate(ctx.tolist()):
        slots = _positions_to_slots(tables, b, clen, block_size, num_blocks)
        result[b : b + 1] = _attend(q[b : b + 1], flat_k.index_select(0, slots), flat_v.index_select(0, slots),
                                    scale).to(result.dtype)


def _npu_paged_attention(*, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         num_kv_heads: int, num_heads: int, scale_value: float, block_table: torch.Tensor,
                         context_lens: torch.Tensor, out: torch.Tensor) -> None:
    """ATB PagedAttention, decode [schema] (7.0.0, 7.1.0): query row b (one token) attends to the
    `context_lens[b]` tokens of `block_table[b]`, within [atb-pa]'s block and head limits."""
    q, kc, vc, scale, result = _paged_inputs(query, key_cache, value_cache, num_heads, num_kv_heads, scale_value, out)
    _decode(q, kc, vc, scale, result, block_table, context_lens)


def _npu_paged_attention_workspace(*, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                   num_kv_heads: int, num_heads: int, scale_value: float, block_table: torch.Tensor,
                                   context_lens: torch.Tensor, out: torch.Tensor,
                                   workspace: torch.Tensor | None = None) -> None:
    """As `_npu_paged_attention`, with 7.2.0's added keyword-only `workspace` [schema] (for graph capture: a
    preallocated workspace; None runs as before)."""
    require(workspace is None, "workspace: the fake runs without a preallocated workspace only")
    _npu_paged_attention(query=query, key_cache=key_cache, value_cache=value_cache, num_kv_heads=num_kv_heads,
                         num_heads=num_heads, scale_value=scale_value, block_table=block_table,
                         context_lens=context_lens, out=out)


def _npu_paged_attention_splitfuse(*, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                   block_table: torch.Tensor, context_lens: torch.Tensor, mask: torch.Tensor,
                                   seq_len: torch.Tensor, num_kv_heads: int, num_heads: int, scale_value: float,
                                   out: torch.Tensor) -> None:
    """ATB PagedAttention with CALC_TYPE_SPEC / MASK_TYPE_SPEC [schema] (every release from 7.0.0): sequence b's
    `seq_len[b]` query rows (flat in `query`; 1 for a decode) are the last of its `context_lens[b]` tokens in the
    cache, any prefix. Row r's scores get `mask[r, :context]` added [splitfuse-test], so the caller's mask decides
    what each row sees; limits [atb-pa] with parallel decoding's block size <= 128."""
    q, kc, vc, scale, result = _paged_inputs(query, key_cache, value_cache, num_heads, num_kv_heads, scale_value, out)
    num_blocks, block_size = kc.shape[0], _paged_block_size(kc, max_block=SPLITFUSE_MAX_BLOCK)
    tables = tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,))
    qlens = _lens("seq_len", seq_len, tables.shape[0])
    ctx = _lens("context_lens", context_lens, tables.shape[0])
    require(int(qlens.sum()) == q.shape[0], f"seq_len sums to {int(qlens.sum())}, query has {q.shape[0]} tokens")
    require(bool((ctx >= qlens).all()), f"context_lens {ctx.tolist()} shorter than seq_len {qlens.tolist()}")
    m = tensor("mask", mask, ndim=2, dtypes=(q.dtype,))
    longest = int(ctx.max())
    require(tuple(m.shape) == (q.shape[0], longest),
            f"mask {tuple(m.shape)}: expected [query tokens, longest context] = [{q.shape[0]}, {longest}]")
    values = m.float()
    require(bool(((values == 0) | (values <= SPLITFUSE_MASKED_AT_MOST)).all()),
            f"mask: an additive mask holds 0 (seen) or at most {SPLITFUSE_MASKED_AT_MOST:g} (masked)")
    flat_k, flat_v = _flat(kc), _flat(vc)
    start = 0
    for b, (qlen, clen) in enumerate(zip(qlens.tolist(), ctx.tolist(), strict=True)):
        slots = _positions_to_slots(tables, b, clen, block_size, num_blocks)
        rows = slice(start, start + qlen)
        result[rows] = _attend(q[rows], flat_k.index_select(0, slots), flat_v.index_select(0, slots), scale,
                               bias=m[rows, :clen]).to(result.dtype)
        start += qlen
