"""A FAKE of torch_npu, for tests. It is not torch_npu and runs no NPU kernel.

It implements in plain torch, on the CPU, the documented semantics of exactly the torch_npu operations the `npu`
backend (engine/backends/npu.py) calls, and it refuses what the real operations would refuse. The attention and
cache ops, with the signatures ../shared/notes/torch-npu-ops.md records (as vllm-ascend calls them):

- `npu_scatter_pa_kv_cache(*, key, value, key_cache, value_cache, slot_mapping, cache_mode)`
- `_npu_flash_attention(*, query, key, value, mask, seq_len, scale_value, num_heads, num_kv_heads, out)`
- `_npu_flash_attention_qlens(*, query, key_cache, value_cache, block_table, mask, seq_len, context_lens,
  num_kv_heads, num_heads, scale_value, out)`
- `_npu_paged_attention(*, query, key_cache, value_cache, num_kv_heads, num_heads, scale_value, block_table,
  context_lens, out)`

Checked as hardware would: keyword-only arguments under their documented names (a positional or missing argument
is a TypeError), dtypes (float16/bfloat16 activations and caches; int32 slots, lengths and block tables), shapes,
contiguity, the mask's layout and values, slot and block ranges, and `out=` written in place (the ops return
None, so a caller that ignores `out` reads garbage).

The fused kernels, with the prototypes, formulas and limits of Ascend's torch_npu API reference (op-plugin
docs/context; the notes do not cover them), positional or by keyword as documented, returning their results:

- `npu_rms_norm(self, gamma, epsilon=1e-06) -> (y, rstd)`: `y = x / sqrt(mean(x^2) + eps) * gamma` over gamma's
  trailing dimensions, rstd the float32 reciprocal; x of 2-8 dimensions; gamma in x's dtype.
- `npu_swiglu(input, dim=-1)`: `silu(A) * B`, A and B the first and second halves along `dim`; contiguous input.
- `npu_rotary_mul(input, r1, r2, rotary_mode="half")`: `r1 * x + r2 * cat(-x2, x1)` (x1, x2 the halves of the last
  dimension); 4-dimensional, r1/r2 in one of the documented broadcast layouts (1S1D for BSND, ...), values in
  [-1, 1], D even and below 896. The fake takes r1 and r2 in the input's dtype only, and "half" mode only.

What it cannot check: which tensors live on the host and which on the device (everything is on the CPU here), the
kernels' real numerics (it computes in float32 and rounds once), limits the references do not state, speed,
memory, HCCL and graphs.

`install_fake_torch_npu(monkeypatch)` puts the fake in `sys.modules["torch_npu"]` and attaches a fake `torch.npu`
(`device_count`, `set_device`, `current_device`, `mem_get_info`, `synchronize`); the "npu" device is the CPU
(`FakeTorchNPU.device`): tensors stay on the CPU.
"""

from __future__ import annotations

import os
import sys
import types
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

GiB = 1024**3
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16)
CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.int8)  # the cache write's documented dtypes on A2/A3
COMPRESSED_MASK_SIZE = 128  # `_npu_flash_attention_qlens`'s mask: the compressed causal mask, as sglang passes it
VISIBLE_DEVICES_ENV = "ASCEND_RT_VISIBLE_DEVICES"


class FakeNPUError(RuntimeError):
    """What the real operation would refuse (an ACL/ATB error on hardware)."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise FakeNPUError(message)


def _tensor(name: str, t: object, *, ndim: int, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    _require(isinstance(t, torch.Tensor), f"{name}: expected a tensor, got {type(t).__name__}")
    assert isinstance(t, torch.Tensor)
    _require(t.dim() == ndim, f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    _require(t.dtype in dtypes, f"{name}: dtype {t.dtype} not supported (takes {', '.join(map(str, dtypes))})")
    _require(t.is_contiguous(), f"{name}: must be contiguous (shape {tuple(t.shape)}, strides {t.stride()})")
    return t


def _int(name: str, value: object) -> int:
    _require(isinstance(value, int) and not isinstance(value, bool), f"{name}: expected an int, got {value!r}")
    assert isinstance(value, int)
    return value


def _scale(value: object) -> float:
    _require(isinstance(value, float | int) and not isinstance(value, bool), f"scale_value: expected a float, "
             f"got {value!r}")
    assert isinstance(value, float | int)
    return float(value)


def _heads(query: torch.Tensor, num_heads: object, num_kv_heads: object, kv_heads_seen: int) -> tuple[int, int]:
    heads, kv_heads = _int("num_heads", num_heads), _int("num_kv_heads", num_kv_heads)
    _require(heads == query.shape[1], f"num_heads {heads} but query has {query.shape[1]} heads")
    _require(kv_heads == kv_heads_seen, f"num_kv_heads {kv_heads} but the keys have {kv_heads_seen} heads")
    _require(kv_heads > 0 and heads % kv_heads == 0, f"num_heads {heads} is not a multiple of num_kv_heads {kv_heads}")
    return heads, kv_heads


def _out(out: object, query: torch.Tensor) -> torch.Tensor:
    t = _tensor("out", out, ndim=query.dim(), dtypes=(query.dtype,))
    _require(t.shape == query.shape, f"out: shape {tuple(t.shape)}, expected the query's {tuple(query.shape)}")
    return t


def _lens(name: str, t: object, batch: int | None = None) -> torch.Tensor:
    """Per-sequence lengths: int32 (on the host, which the fake cannot tell from the device)."""
    lens = _tensor(name, t, ndim=1, dtypes=(torch.int32,))
    if batch is not None:
        _require(lens.shape[0] == batch, f"{name}: {lens.shape[0]} lengths for {batch} sequences")
    _require(bool((lens > 0).all()), f"{name}: every length must be positive, got {lens.tolist()}")
    return lens


def _mask_is_causal(mask: torch.Tensor) -> torch.Tensor:
    """The mask's masked positions, from the dtype's convention (float16: a very negative additive value, -inf once
    the float32 minimum is cast; bfloat16: 1); anything else is refused."""
    values = mask.float()
    if mask.dtype == torch.float16:
        masked = values <= torch.finfo(torch.float16).min
        _require(bool(((values == 0) | masked).all()), "mask: a float16 mask holds 0 or the float32 minimum (-inf)")
    else:
        masked = values == 1
        _require(bool(((values == 0) | masked).all()), "mask: a bfloat16 mask holds 0 or 1 (1 = masked)")
    return masked


def _cache(name: str, t: object, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A paged cache `(num_blocks, block_size, kv_heads, head_dim)` ("Norm" layout)."""
    cache = _tensor(name, t, ndim=4, dtypes=(dtype,) if dtype is not None else CACHE_DTYPES)
    return cache


def _positions_to_slots(block_table: torch.Tensor, row: int, length: int, block_size: int,
                        num_blocks: int) -> torch.Tensor:
    positions = torch.arange(length)
    columns = positions // block_size
    _require(int(columns.max()) < block_table.shape[1],
             f"block_table row {row}: {block_table.shape[1]} blocks cannot hold {length} tokens of {block_size}")
    blocks = block_table[row].long().index_select(0, columns)
    _require(bool(((blocks >= 0) & (blocks < num_blocks)).all()),
             f"block_table row {row}: block ids {sorted(set(blocks.tolist()))} outside 0..{num_blocks - 1}")
    return blocks * block_size + positions % block_size


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            masked: torch.Tensor | None) -> torch.Tensor:
    """q `(Lq, H, D)`, k/v `(Lk, KVH, D)`, masked `(Lq, Lk)` bool or None; float32 math, GQA by head // group."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    if masked is not None:
        scores = scores.masked_fill(masked.unsqueeze(0), float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), vf)


# --- the operations --------------------------------------------------------------------------------------------


def npu_scatter_pa_kv_cache(*, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, slot_mapping: torch.Tensor, cache_mode: str = "Norm") -> None:
    """Writes row i of key/value at slot `slot_mapping[i]` (block = slot // block_size, offset = slot % block_size)
    of the caches, in place. Negative slots are skipped; slots must be distinct and below blocks x block_size."""
    _require(cache_mode == "Norm", f"cache_mode {cache_mode!r}: the fake implements the 'Norm' layout only")
    k = _tensor("key", key, ndim=3, dtypes=CACHE_DTYPES)
    v = _tensor("value", value, ndim=3, dtypes=CACHE_DTYPES)
    kc = _cache("key_cache", key_cache, k.dtype)
    vc = _cache("value_cache", value_cache, v.dtype)
    slots = _tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int32,))
    _require(k.shape[0] == v.shape[0] == slots.shape[0],
             f"key {tuple(k.shape)}, value {tuple(v.shape)} and slot_mapping {tuple(slots.shape)} disagree on tokens")
    _require(k.shape[1:] == kc.shape[2:], f"key rows {tuple(k.shape[1:])} do not fit key_cache {tuple(kc.shape)}")
    _require(v.shape[1:] == vc.shape[2:], f"value rows {tuple(v.shape[1:])} do not fit value_cache {tuple(vc.shape)}")
    _require(kc.shape[:2] == vc.shape[:2], "key_cache and value_cache differ in blocks or block size")
    num_slots = kc.shape[0] * kc.shape[1]
    valid = slots >= 0
    live = slots[valid].long()
    _require(bool((live < num_slots).all()), f"slot_mapping: slots {live[live >= num_slots].tolist()} >= {num_slots}")
    _require(len(set(live.tolist())) == live.numel(), "slot_mapping: a slot appears twice")
    kc.view(num_slots, *kc.shape[2:]).index_copy_(0, live, k[valid])
    vc.view(num_slots, *vc.shape[2:]).index_copy_(0, live, v[valid])


def _npu_flash_attention(*, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                         seq_len: torch.Tensor, scale_value: float, num_heads: int, num_kv_heads: int,
                         out: torch.Tensor) -> None:
    """Prefill without a cache: the flat tokens of each sequence (lengths `seq_len`) attend to their own keys, with
    `mask[:L, :L]` applied (the `[S, S]` causal mask, S at least the longest sequence)."""
    q = _tensor("query", query, ndim=3, dtypes=ACTIVATION_DTYPES)
    k = _tensor("key", key, ndim=3, dtypes=(q.dtype,))
    v = _tensor("value", value, ndim=3, dtypes=(q.dtype,))
    _require(k.shape == v.shape and k.shape[0] == q.shape[0] and k.shape[2] == q.shape[2],
             f"query {tuple(q.shape)}, key {tuple(k.shape)}, value {tuple(v.shape)} do not fit")
    _heads(q, num_heads, num_kv_heads, k.shape[1])
    scale = _scale(scale_value)
    result = _out(out, q)
    lens = _lens("seq_len", seq_len)
    _require(int(lens.sum()) == q.shape[0], f"seq_len sums to {int(lens.sum())}, query has {q.shape[0]} tokens")
    m = _tensor("mask", mask, ndim=2, dtypes=(q.dtype,))
    longest = int(lens.max())
    _require(m.shape[0] == m.shape[1] >= longest, f"mask {tuple(m.shape)}: expected [S, S] with S >= {longest}")
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
    q = _tensor("query", query, ndim=3, dtypes=ACTIVATION_DTYPES)
    kc = _cache("key_cache", key_cache, q.dtype)
    vc = _cache("value_cache", value_cache, q.dtype)
    _require(kc.shape == vc.shape and kc.shape[3] == q.shape[2],
             f"key_cache {tuple(kc.shape)}, value_cache {tuple(vc.shape)}, query {tuple(q.shape)} do not fit")
    _heads(q, num_heads, num_kv_heads, kc.shape[2])
    return q, kc, vc, _scale(scale_value), _out(out, q)


def _npu_flash_attention_qlens(*, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                               block_table: torch.Tensor, mask: torch.Tensor, seq_len: torch.Tensor,
                               context_lens: torch.Tensor, num_kv_heads: int, num_heads: int, scale_value: float,
                               out: torch.Tensor) -> None:
    """Prefill with prefix-cache hits: sequence b's `seq_len[b]` new tokens (flat in `query`) are the last of its
    `context_lens[b]` cached tokens (read through `block_table[b]`); new token i sees cached tokens
    0..context-query+i. `mask` is the compressed causal mask (128 x 128), the causal rule being the kernel's."""
    q, kc, vc, scale, result = _paged_inputs(query, key_cache, value_cache, num_heads, num_kv_heads, scale_value, out)
    tables = _tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,))
    qlens = _lens("seq_len", seq_len, tables.shape[0])
    ctx = _lens("context_lens", context_lens, tables.shape[0])
    _require(int(qlens.sum()) == q.shape[0], f"seq_len sums to {int(qlens.sum())}, query has {q.shape[0]} tokens")
    _require(bool((ctx >= qlens).all()), f"context_lens {ctx.tolist()} shorter than seq_len {qlens.tolist()}")
    m = _tensor("mask", mask, ndim=2, dtypes=(q.dtype,))
    _require(tuple(m.shape) == (COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE),
             f"mask {tuple(m.shape)}: expected the compressed [{COMPRESSED_MASK_SIZE}, {COMPRESSED_MASK_SIZE}] mask")
    expected = torch.ones(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, dtype=torch.bool).triu(1)
    _require(bool((_mask_is_causal(m) == expected).all()), "mask: not the causal (upper-triangular) mask")
    num_blocks, block_size = kc.shape[0], kc.shape[1]
    flat_k = kc.view(num_blocks * block_size, *kc.shape[2:])
    flat_v = vc.view(num_blocks * block_size, *vc.shape[2:])
    start = 0
    for b, (qlen, clen) in enumerate(zip(qlens.tolist(), ctx.tolist(), strict=True)):
        slots = _positions_to_slots(tables, b, clen, block_size, num_blocks)
        first = clen - qlen
        masked = torch.arange(clen).view(1, -1) > (first + torch.arange(qlen)).view(-1, 1)
        rows = slice(start, start + qlen)
        result[rows] = _attend(q[rows], flat_k.index_select(0, slots), flat_v.index_select(0, slots), scale,
                               masked).to(result.dtype)
        start += qlen


def _npu_paged_attention(*, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         num_kv_heads: int, num_heads: int, scale_value: float, block_table: torch.Tensor,
                         context_lens: torch.Tensor, out: torch.Tensor) -> None:
    """Decode: query row b (one token) attends to the `context_lens[b]` tokens of `block_table[b]`."""
    q, kc, vc, scale, result = _paged_inputs(query, key_cache, value_cache, num_heads, num_kv_heads, scale_value, out)
    tables = _tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,))
    _require(tables.shape[0] == q.shape[0], f"block_table has {tables.shape[0]} rows for {q.shape[0]} queries")
    ctx = _lens("context_lens", context_lens, q.shape[0])
    num_blocks, block_size = kc.shape[0], kc.shape[1]
    flat_k = kc.view(num_blocks * block_size, *kc.shape[2:])
    flat_v = vc.view(num_blocks * block_size, *vc.shape[2:])
    for b, clen in enumerate(ctx.tolist()):
        slots = _positions_to_slots(tables, b, clen, block_size, num_blocks)
        result[b : b + 1] = _attend(q[b : b + 1], flat_k.index_select(0, slots), flat_v.index_select(0, slots),
                                    scale, None).to(result.dtype)


# --- the fused kernels -----------------------------------------------------------------------------------------

FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ROTARY_MAX_HEAD_DIM = 896  # "D < 896, and a multiple of 2" (npu_rotary_mul, half mode, A2/A3)
ROTARY_MAX_BROADCAST = 1000  # "B, N < 1000"
# npu_rotary_mul's r1/r2 layouts, per input layout (BSND: 1S1D, BS1D, BSND; BNSD: 11SD, B1SD, BNSD; SBND: S11D,
# SB1D, SBND), as which of the three leading dimensions r1 spans (True) or broadcasts (False).
ROTARY_LAYOUTS = frozenset({(False, True, False), (True, True, False), (True, True, True), (False, False, True),
                            (True, False, True), (True, False, False)})


def _shaped(name: str, t: object, *, dims: range, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    """A tensor of `dims` dimensions and one of `dtypes` (contiguity not demanded: the references do not)."""
    _require(isinstance(t, torch.Tensor), f"{name}: expected a tensor, got {type(t).__name__}")
    assert isinstance(t, torch.Tensor)
    _require(t.dim() in dims, f"{name}: {t.dim()} dimensions (takes {dims.start}-{dims.stop - 1})")
    _require(t.dtype in dtypes, f"{name}: dtype {t.dtype} not supported (takes {', '.join(map(str, dtypes))})")
    _require(t.numel() > 0, f"{name}: empty")
    return t


def npu_rms_norm(self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-06) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over gamma's trailing dimensions of `self` (ATen's name for the input): `(y, rstd)`, y in the input's
    dtype, rstd = 1 / sqrt(mean(x^2) + epsilon) in float32, shaped as the input with those dimensions 1."""
    x = _shaped("self", self, dims=range(2, 9), dtypes=FUSED_DTYPES)
    g = _shaped("gamma", gamma, dims=range(1, x.dim() + 1), dtypes=(x.dtype,))
    _require(tuple(x.shape[x.dim() - g.dim():]) == tuple(g.shape),
             f"gamma {tuple(g.shape)} is not the trailing dimensions of self {tuple(x.shape)}")
    _require(isinstance(epsilon, float), f"epsilon: expected a float, got {epsilon!r}")
    reduced = tuple(range(x.dim() - g.dim(), x.dim()))
    rstd = torch.rsqrt(x.float().pow(2).mean(dim=reduced, keepdim=True) + epsilon)
    return (x.float() * rstd * g.float()).to(x.dtype), rstd


def npu_swiglu(input: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """`silu(A) * B`, A and B the first and second halves of `input` along `dim`, in the input's dtype."""
    x = _shaped("input", input, dims=range(1, 9), dtypes=FUSED_DTYPES)
    _require(x.is_contiguous(), f"input: must be contiguous (shape {tuple(x.shape)}, strides {x.stride()})")
    axis = _int("dim", dim)
    _require(-x.dim() <= axis < x.dim(), f"dim {axis} outside [{-x.dim()}, {x.dim() - 1}]")
    _require(x.shape[axis] % 2 == 0, f"input: dimension {axis} of size {x.shape[axis]} does not halve")
    a, b = x.float().chunk(2, dim=axis)
    return (torch.nn.functional.silu(a) * b).to(x.dtype)


def npu_rotary_mul(input: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half") -> torch.Tensor:
    """Rotary embedding, "half" mode: `r1 * x + r2 * cat(-x2, x1)`, x1 and x2 the halves of the last dimension; r1
    (cos) and r2 (sin) broadcast over the input in one of the documented layouts."""
    _require(rotary_mode in ("half", "interleave"), f"rotary_mode {rotary_mode!r}: takes 'half' or 'interleave'")
    _require(rotary_mode == "half", "rotary_mode 'interleave': the fake implements 'half' only")
    x = _shaped("input", input, dims=range(4, 5), dtypes=FUSED_DTYPES)
    cos = _shaped("r1", r1, dims=range(4, 5), dtypes=(x.dtype,))
    sin = _shaped("r2", r2, dims=range(4, 5), dtypes=(x.dtype,))
    dim = x.shape[-1]
    _require(dim % 2 == 0 and dim < ROTARY_MAX_HEAD_DIM, f"input: D = {dim} (takes an even D below 896)")
    _require(cos.shape == sin.shape, f"r1 {tuple(cos.shape)} and r2 {tuple(sin.shape)} differ")
    _require(cos.shape[-1] == dim, f"r1 {tuple(cos.shape)}: last dimension is not the input's D = {dim}")
    leading = range(3)
    _require(all(cos.shape[i] in (1, x.shape[i]) for i in leading),
             f"r1 {tuple(cos.shape)} does not broadcast over input {tuple(x.shape)}")
    spans = [cos.shape[i] == x.shape[i] for i in leading]
    ones = [cos.shape[i] == 1 for i in leading]
    _require(any(all(spans[i] if full else ones[i] for i, full in enumerate(layout)) for layout in ROTARY_LAYOUTS),
             f"r1 {tuple(cos.shape)} for input {tuple(x.shape)}: not one of the documented layouts")
    _require(all(x.shape[i] < ROTARY_MAX_BROADCAST for i in leading if cos.shape[i] == 1 < x.shape[i]),
             f"input {tuple(x.shape)}: B and N must be below {ROTARY_MAX_BROADCAST}")
    _require(bool((cos.abs() <= 1).all() and (sin.abs() <= 1).all()), "r1, r2: values outside [-1, 1]")
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (cos.float() * xf + sin.float() * torch.cat((-x2, x1), dim=-1)).to(x.dtype)


OPS: dict[str, Callable[..., Any]] = {
    "npu_scatter_pa_kv_cache": npu_scatter_pa_kv_cache,
    "_npu_flash_attention": _npu_flash_attention,
    "_npu_flash_attention_qlens": _npu_flash_attention_qlens,
    "_npu_paged_attention": _npu_paged_attention,
    "npu_rms_norm": npu_rms_norm,
    "npu_swiglu": npu_swiglu,
    "npu_rotary_mul": npu_rotary_mul,
}


# --- torch.npu ---------------------------------------------------------------------------------------------------


@dataclass
class FakeNPUNamespace:
    """The fake `torch.npu`: `physical_cards` cards of `total_bytes`, `free_bytes` of them free; the visible ones
    are those `ASCEND_RT_VISIBLE_DEVICES` lists (read at each call), numbered 0..n-1."""

    physical_cards: int = 8
    total_bytes: int = 64 * GiB
    free_bytes: int = 60 * GiB
    current: int | None = None
    synchronize_calls: int = 0
    set_device_calls: list[int] = field(default_factory=list)

    def device_count(self) -> int:
        visible = os.environ.get(VISIBLE_DEVICES_ENV, "").strip()
        if not visible:
            return self.physical_cards
        return sum(1 for card in visible.split(",") if int(card) < self.physical_cards)

    def _index(self, device: object) -> int:
        if isinstance(device, str):
            _require(device.startswith("npu:") and device[4:].isdigit(), f"device {device!r}: expected 'npu:<n>'")
            device = int(device[4:])
        index = _int("device", device)
        _require(0 <= index < self.device_count(), f"device {index}: {self.device_count()} card(s) visible")
        return index

    def set_device(self, device: int | str) -> None:
        self.current = self._index(device)
        self.set_device_calls.append(self.current)

    def current_device(self) -> int:
        return 0 if self.current is None else self.current

    def mem_get_info(self, device: int | str | None = None) -> tuple[int, int]:
        if device is not None:
            self._index(device)
        return self.free_bytes, self.total_bytes

    def synchronize(self, device: int | str | None = None) -> None:
        if device is not None:
            self._index(device)
        self.synchronize_calls += 1


@dataclass
class FakeTorchNPU:
    """What `install_fake_torch_npu` installed: the module, the `torch.npu` namespace, and each op's call count
    (successful calls only)."""

    module: types.ModuleType
    npu: FakeNPUNamespace
    calls: Counter[str]
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # the fake's "npu" device


def _recording(name: str, op: Callable[..., Any], calls: Counter[str]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        result = op(*args, **kwargs)  # the op's own signature refuses misnamed (and, if keyword-only, positional) ones
        calls[name] += 1
        return result

    call.__name__ = call.__qualname__ = name
    call.__doc__ = op.__doc__
    return call


def install_fake_torch_npu(monkeypatch: pytest.MonkeyPatch, *, physical_cards: int = 8, total_bytes: int = 64 * GiB,
                           free_bytes: int = 60 * GiB) -> FakeTorchNPU:
    """Makes `import torch_npu` return the fake and `torch.npu` the fake namespace, until the test ends."""
    namespace = FakeNPUNamespace(physical_cards=physical_cards, total_bytes=total_bytes, free_bytes=free_bytes)
    calls: Counter[str] = Counter()
    module = types.ModuleType("torch_npu", "FAKE torch_npu (tests/fake_torch_npu.py): plain torch on the CPU")
    for name, op in OPS.items():
        setattr(module, name, _recording(name, op, calls))
    module.npu = namespace  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    monkeypatch.setattr(torch, "npu", namespace, raising=False)
    return FakeTorchNPU(module=module, npu=namespace, calls=calls)


__all__ = ["OPS", "FakeNPUError", "FakeNPUNamespace", "FakeTorchNPU", "install_fake_torch_npu"]
