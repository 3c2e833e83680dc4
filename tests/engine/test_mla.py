"""Multi-head latent attention pieces: the backend's MLA reference (two caches, the cache write, the absorbed decode,
the expanded prefill) against plain expanded attention, and YaRN's rope and softmax scale against transformers."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from npuserve.engine.backends.base import AttentionMetadata, rms_norm, rope_rotate  # noqa: E402
from npuserve.engine.backends.cpu import CPUBackend  # noqa: E402

RANK, ROPE, NOPE, VDIM, HEADS, BLOCK = 24, 8, 12, 10, 4, 4


def _meta(context_lens: list[int], query_lens: list[int], tables: list[list[int]], block_size: int = BLOCK,
          is_prefill: bool = False) -> AttentionMetadata:
    slots: list[int] = []
    starts = [0]
    for ctx, new, table in zip(context_lens, query_lens, tables, strict=True):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx - new, ctx)]
        starts.append(starts[-1] + new)
    width = max(len(t) for t in tables)
    return AttentionMetadata(
        is_prefill=is_prefill, slot_mapping=torch.tensor(slots), cache={},
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        context_lens=torch.tensor(context_lens), query_lens=torch.tensor(query_lens), query_start=starts,
        max_query_len=max(query_lens), max_context_len=max(context_lens))


def _fill(backend: CPUBackend, latent: torch.Tensor, rope: torch.Tensor, meta: AttentionMetadata,
          gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = meta.slot_mapping.numel()
    kv_a = torch.randn(tokens, RANK + ROPE, generator=gen)
    angles = torch.rand(tokens, ROPE // 2, generator=gen) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    gamma = 1 + 0.1 * torch.randn(RANK, generator=gen)
    return backend.mla_write_cache(kv_a, gamma, 1e-6, cos, sin, meta.slot_mapping, latent, rope, True)


def test_cache_layout_and_write() -> None:
    backend = CPUBackend()
    caches = backend.allocate_mla_cache(2, 6, BLOCK, RANK, ROPE, torch.float32)
    assert len(caches) == 2
    latent, rope = caches[0]
    assert latent.shape == (6, BLOCK, 1, RANK) and rope.shape == (6, BLOCK, 1, ROPE)
    assert latent.is_contiguous() and rope.is_contiguous()
    gen = torch.Generator().manual_seed(0)
    kv_a = torch.randn(3, RANK + ROPE, generator=gen)
    gamma = torch.rand(RANK, generator=gen) + 0.5
    angles = torch.rand(3, ROPE // 2, generator=gen)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    slots = torch.tensor([5, 0, 13])
    c_kv, k_pe = backend.mla_write_cache(kv_a, gamma, 1e-6, cos, sin, slots, latent, rope, True)
    normed = kv_a[:, :RANK] / kv_a[:, :RANK].pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * gamma
    torch.testing.assert_close(c_kv, normed)
    # interleaved: channels (2i, 2i+1) rotate by angle i, the result laid out evens then odds
    pe = kv_a[:, RANK:]
    even, odd = pe[:, 0::2], pe[:, 1::2]
    expected = torch.cat([even * angles.cos() - odd * angles.sin(), odd * angles.cos() + even * angles.sin()], -1)
    torch.testing.assert_close(k_pe, expected)
    torch.testing.assert_close(latent.view(-1, RANK)[slots], c_kv)
    torch.testing.assert_close(rope.view(-1, ROPE)[slots], k_pe)
    assert latent.view(-1, RANK)[1].abs().sum() == 0  # nothing else written
    # neox: channel i pairs with i + ROPE/2
    neox = rope_rotate(pe, cos, sin, False)
    first, second = pe[:, : ROPE // 2], pe[:, ROPE // 2 :]
    torch.testing.assert_close(neox, torch.cat([first * angles.cos() - second * angles.sin(),
                                                second * angles.cos() + first * angles.sin()], -1))


def _expanded(q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor, w_uk: torch.Tensor,
              w_uv: torch.Tensor, scale: float, visible: int) -> torch.Tensor:
    """One query token (N heads) over `visible` context rows, with per-head K and V expanded from the latent."""
    k_nope = torch.einsum("lr,npr->nlp", c_kv[:visible], w_uk)
    v = torch.einsum("lr,nvr->nlv", c_kv[:visible], w_uv)
    k = torch.cat([k_nope, k_pe[:visible].unsqueeze(0).expand(HEADS, -1, -1)], -1)
    q = torch.cat([q_nope, q_pe], -1)  # (N, d)
    scores = torch.einsum("nd,nld->nl", q, k) * scale
    return torch.einsum("nl,nlv->nv", scores.softmax(-1), v)


def test_absorbed_decode_equals_expanded_attention() -> None:
    backend, gen = CPUBackend(), torch.Generator().manual_seed(1)
    latent, rope = backend.allocate_mla_cache(1, 12, BLOCK, RANK, ROPE, torch.float32)[0]
    lens, tables = [5, 1, 11], [[3, 7], [0], [9, 2, 4]]
    _fill(backend, latent, rope, _meta(lens, lens, tables, is_prefill=True), gen)
    w_uk, w_uv = torch.randn(HEADS, NOPE, RANK, generator=gen), torch.randn(HEADS, VDIM, RANK, generator=gen)
    q_nope = torch.randn(3, HEADS, NOPE, generator=gen)
    q_pe = torch.randn(3, HEADS, ROPE, generator=gen)
    scale = 0.3
    meta = _meta(lens, [1, 1, 1], tables)
    q_latent = torch.einsum("bnp,npr->bnr", q_nope, w_uk)
    out = backend.mla_decode_attention(q_latent, q_pe, latent, rope, meta, scale)
    assert out.shape == (3, HEADS, RANK)
    got = torch.einsum("bnr,nvr->bnv", out, w_uv)
    c_all, pe_all = backend.mla_gather_context(latent, rope, meta)
    start = 0
    for b, length in enumerate(lens):
        want = _expanded(q_nope[b], q_pe[b], c_all[start:], pe_all[start:], w_uk, w_uv, scale, length)
        torch.testing.assert_close(got[b], want, rtol=1e-4, atol=1e-4)
        start += length


def test_expanded_prefill_over_a_cached_prefix() -> None:
    """Two sequences whose first tokens are already cached: the new tokens attend causally over prefix + themselves,
    each as the decode of that token would."""
    backend, gen = CPUBackend(), torch.Generator().manual_seed(2)
    latent, rope = backend.allocate_mla_cache(1, 12, BLOCK, RANK, ROPE, torch.float32)[0]
    lens, new, tables = [9, 6], [3, 6], [[5, 1, 8], [2, 6]]
    _fill(backend, latent, rope, _meta(lens, lens, tables, is_prefill=True), gen)
    meta = _meta(lens, new, tables, is_prefill=True)
    w_uk, w_uv = torch.randn(HEADS, NOPE, RANK, generator=gen), torch.randn(HEADS, VDIM, RANK, generator=gen)
    q_nope = torch.randn(sum(new), HEADS, NOPE, generator=gen)
    q_pe = torch.randn(sum(new), HEADS, ROPE, generator=gen)
    c_all, pe_all = backend.mla_gather_context(latent, rope, meta)
    assert c_all.shape == (sum(lens), RANK)
    k = torch.cat([torch.einsum("lr,npr->lnp", c_all, w_uk), pe_all.unsqueeze(1).expand(-1, HEADS, -1)], -1)
    v = torch.einsum("lr,nvr->lnv", c_all, w_uv)
    out = backend.mla_prefill_attention(torch.cat([q_nope, q_pe], -1), k, v, meta, 0.2)
    row, start = 0, 0
    for length, n in zip(lens, new, strict=True):
        for i in range(n):
            want = _expanded(q_nope[row], q_pe[row], c_all[start:], pe_all[start:], w_uk, w_uv, 0.2,
                             length - n + i + 1)
            torch.testing.assert_close(out[row], want, rtol=1e-4, atol=1e-4)
            row += 1
        start += length


def test_rms_norm_matches_float32_reference() -> None:
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    gamma = torch.ones(8)
    want = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16).float()
    torch.testing.assert_close(rms_norm(x, gamma, 1e-6), want)
    assert math.isclose(float(rms_norm(torch.tensor([[3.0, 4.0]]), torch.ones(2), 0.0).pow(2).mean()), 1.0,
                        rel_tol=1e-6)


@pytest.mark.parametrize(("factor", "mscale", "mscale_all_dim", "original"),
                         [(4.0, 1.0, 1.0, 128), (40.0, 0.707, 0.707, 4096), (8.0, 1.0, 0.0, 256), (16.0, 0.5, 1.0, 64)])
def test_yarn_tables_and_scale_match_transformers(factor: float, mscale: float, mscale_all_dim: float,
                                                   original: int) -> None:
    transformers = pytest.importorskip("transformers")
    from npuserve.engine.model.layers import RotaryEmbedding, mla_softmax_scale

    rope = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original, "beta_fast": 32,
            "beta_slow": 1, "mscale": mscale, "mscale_all_dim": mscale_all_dim, "rope_theta": 10000.0}
    config = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=16,
        v_head_dim=16, max_position_embeddings=original * int(factor), rope_parameters=rope)
    theirs = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3RotaryEmbedding(config)
    positions = torch.tensor([[0, 1, 7, 100, original - 1, original * int(factor) - 1]])
    cos, sin = theirs(torch.zeros(1, dtype=torch.float32), positions)
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    ours = RotaryEmbedding(16, original * int(factor), 10000.0, scaling)
    our_cos, our_sin = ours.cos_sin(positions[0])
    torch.testing.assert_close(our_cos, cos[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(our_sin, sin[0], rtol=1e-5, atol=1e-6)
    attention = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention(config, 0)
    assert math.isclose(mla_softmax_scale(32, scaling), attention.scaling, rel_tol=1e-12)
    assert mla_softmax_scale(32, None) == 32**-0.5
