"""The FAKE torch_npu's MoE and MLA ops (tests/fake_npu_moe.py, tests/fake_npu_mla.py): each line has the ops its
op-plugin branch has, each op computes its documented example semantics and refuses a wrong index layout, head
count, dtype or default as the card would."""

from __future__ import annotations

import pytest
import torch

from tests.fake_npu_mla import KV_LORA, ROPE_DIM
from tests.fake_torch_npu import RELEASES, FakeNPUError, FakeTorchNPU, install_fake_torch_npu

I32, I64, F16 = torch.int32, torch.int64, torch.float16


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_each_line_has_the_moe_and_mla_ops_of_its_branch(monkeypatch: pytest.MonkeyPatch, release: str) -> None:
    ops = install_fake_torch_npu(monkeypatch, release=release).module
    for name in ("npu_moe_gating_top_k_softmax", "npu_moe_gating_top_k", "npu_moe_init_routing_v2",
                 "npu_grouped_matmul", "npu_moe_finalize_routing", "npu_kv_rmsnorm_rope_cache",
                 "npu_fused_infer_attention_score"):
        assert callable(getattr(ops, name, None)), name
    assert hasattr(ops, "npu_moe_token_unpermute") == (release != "7.0.0")  # 7.1.0 on


# --- gating ----------------------------------------------------------------------------------------------------


def test_gating_softmax_is_topk_of_softmax_with_k_major_row_idx(fake: FakeTorchNPU) -> None:
    x = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0], [2.0, 2.5, 0.0, 1.0]])
    y, ids, row_idx = fake.module.npu_moe_gating_top_k_softmax(x, None, k=2)
    values, expected_ids = torch.softmax(x, -1).topk(2)
    torch.testing.assert_close(y, values)  # not renormalised: rows do not sum to 1
    assert ids.dtype == I32 and torch.equal(ids, expected_ids.to(I32))
    assert row_idx.dtype == I32 and row_idx.tolist() == [[0, 3], [1, 4], [2, 5]]  # row_idx[i, k] = k*N + i
    with pytest.raises(FakeNPUError, match="k 5"):
        fake.module.npu_moe_gating_top_k_softmax(x, None, k=5)
    with pytest.raises(FakeNPUError, match="dtype"):
        fake.module.npu_moe_gating_top_k_softmax(x.double(), None, k=1)


def test_gating_top_k_groups_by_top2_sum_and_biases_the_choice_only(fake: FakeTorchNPU) -> None:
    # 8 experts in 4 groups of 2; the bias makes expert 7 chosen though its score is low
    x = torch.tensor([[2.0, 1.5, -1.0, -1.0, 0.5, 0.4, -3.0, -2.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 3.0])
    y, ids, norm_out = fake.module.npu_moe_gating_top_k(
        x, 2, bias=bias, k_group=2, group_count=4, group_select_mode=1, renorm=0, norm_type=1,
        routed_scaling_factor=2.5, eps=1e-20)
    assert sorted(ids[0].tolist()) == [0, 7]  # group 0 (top-2 sum) and group 3 (biased) kept
    s = torch.sigmoid(x[0])
    w = torch.stack([s[i] for i in ids[0].tolist()])
    torch.testing.assert_close(y[0], w / w.sum() * 2.5)  # the un-biased scores, normalised, scaled
    assert norm_out.dtype == torch.float32 and ids.dtype == I32
    kwargs = dict(k_group=2, group_count=4, group_select_mode=1, norm_type=1)
    with pytest.raises(FakeNPUError, match="renorm"):
        fake.module.npu_moe_gating_top_k(x, 2, renorm=1, **kwargs)
    with pytest.raises(FakeNPUError, match="dimensions"):
        fake.module.npu_moe_gating_top_k(x.view(1, 1, 8), 2, **kwargs)
    with pytest.raises(FakeNPUError, match="at most 2048"):
        fake.module.npu_moe_gating_top_k(torch.zeros(1, 4096), 2, norm_type=1)


# --- dispatch, grouped matmul, combine ----------------------------------------------------------------------------


def _route(fake: FakeTorchNPU, ids: torch.Tensor, x: torch.Tensor, **extra: object) -> tuple[torch.Tensor, ...]:
    return fake.module.npu_moe_init_routing_v2(x, ids, active_num=ids.numel(), expert_num=4,
                                               expert_tokens_num_type=1, expert_tokens_num_flag=True, **extra)


def test_init_routing_v2_sorts_by_expert_with_a_token_major_gather_index(fake: FakeTorchNPU) -> None:
    x = torch.arange(3 * 2, dtype=torch.float32).view(3, 2)
    ids = torch.tensor([[2, 0], [1, 2], [0, 3]], dtype=I32)
    expanded, row_idx, counts, _ = _route(fake, ids, x, quant_mode=-1)
    # slots i*K+k by expert, stable: expert 0 <- slots 1, 4; 1 <- 2; 2 <- 0, 3; 3 <- 5
    assert row_idx.dtype == I32 and row_idx.tolist() == [3, 0, 2, 4, 1, 5]  # row_idx[slot] = sorted position
    assert torch.equal(expanded, x[[0, 2, 1, 0, 1, 2]])
    assert counts.dtype == I64 and counts.tolist() == [2, 1, 2, 1]


def test_init_routing_v2_refuses_int64_ids_and_the_7x_default_quant_mode(fake: FakeTorchNPU,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    x, ids = torch.randn(3, 2), torch.tensor([[2, 0], [1, 2], [0, 3]], dtype=I32)
    with pytest.raises(FakeNPUError, match="int32"):
        _route(fake, ids.long(), x, quant_mode=-1)
    with pytest.raises(FakeNPUError, match=r"quant_mode 0 .*needs scale"):  # 7.3.0: the default is 0 (static)
        _route(fake, ids, x)
    newer = install_fake_torch_npu(monkeypatch, release="26.0.0")
    assert _route(newer, ids, x)[2].tolist() == [2, 1, 2, 1]  # 26.0.0: the default is -1


def test_grouped_matmul_multiplies_each_group_by_its_k_by_n_weight(fake: FakeTorchNPU) -> None:
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 3, generator=gen), torch.randn(2, 3, 4, generator=gen)  # (E, K, N)
    counts = torch.tensor([2, 3], dtype=I64)
    out = fake.module.npu_grouped_matmul([x], [w], group_list=counts, split_item=2, group_type=0,
                                         group_list_type=1)[0]
    torch.testing.assert_close(out, torch.cat([x[:2] @ w[0], x[2:] @ w[1]]))
    cumsum = fake.module.npu_grouped_matmul([x], [w], group_list=counts.cumsum(0), split_item=2, group_type=0,
                                            group_list_type=0)[0]
    torch.testing.assert_close(cumsum, out)
    with pytest.raises(FakeNPUError, match="must be transposed"):  # an (E, N, K) weight
        fake.module.npu_grouped_matmul([x], [w.transpose(1, 2).contiguous()], group_list=counts, split_item=2,
                                       group_type=0, group_list_type=1)
    with pytest.raises(FakeNPUError, match="int64"):
        fake.module.npu_grouped_matmul([x], [w], group_list=counts.int(), split_item=2, group_type=0,
                                       group_list_type=1)


def test_unpermute_gathers_by_the_routing_index_and_finalize_mode_0_reads_it_k_major(fake: FakeTorchNPU) -> None:
    x = torch.randn(3, 2)
    ids = torch.tensor([[2, 0], [1, 2], [0, 3]], dtype=I32)
    expanded, row_idx, _, _ = _route(fake, ids, x, quant_mode=-1)
    probs = torch.tensor([[0.5, 0.25], [1.0, 2.0], [3.0, 0.0]])
    expected = x * probs.sum(-1, keepdim=True)  # expanded rows are copies of x: the weighted sum of the copies
    torch.testing.assert_close(fake.module.npu_moe_token_unpermute(expanded, row_idx, probs), expected)
    with pytest.raises(FakeNPUError, match="int32"):
        fake.module.npu_moe_token_unpermute(expanded, row_idx.long(), probs)
    rows = torch.randn(6, 2)  # distinct rows: a layout mistake shows
    reference = fake.module.npu_moe_token_unpermute(rows, row_idx, probs)
    k_major = row_idx.view(3, 2).t().reshape(-1).contiguous()
    finalize = fake.module.npu_moe_finalize_routing
    torch.testing.assert_close(finalize(rows, None, None, None, probs, k_major, ids, drop_pad_mode=0), reference)
    torch.testing.assert_close(finalize(rows, None, None, None, probs, row_idx, ids, drop_pad_mode=2), reference)
    assert not torch.allclose(finalize(rows, None, None, None, probs, row_idx, ids, drop_pad_mode=0), reference)


# --- MLA --------------------------------------------------------------------------------------------------------


def _kv_inputs(tokens: int, blocks: int = 4, block: int = 16) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    angles = torch.rand(tokens, ROPE_DIM // 2, generator=gen) * 6
    return dict(kv=torch.randn(tokens, 1, 1, KV_LORA + ROPE_DIM, generator=gen).half(),
                gamma=(1 + 0.1 * torch.randn(KV_LORA, generator=gen)).half(),
                cos=torch.cat([angles.cos()] * 2, -1).view(tokens, 1, 1, ROPE_DIM).half(),
                sin=torch.cat([angles.sin()] * 2, -1).view(tokens, 1, 1, ROPE_DIM).half(),
                index=torch.tensor([5, 17, 40][:tokens], dtype=I64),
                k_cache=torch.zeros(blocks, block, 1, ROPE_DIM, dtype=F16),
                ckv_cache=torch.zeros(blocks, block, 1, KV_LORA, dtype=F16))


def test_kv_rmsnorm_rope_cache_normalises_rotates_interleaved_and_writes_both_caches(fake: FakeTorchNPU) -> None:
    a = _kv_inputs(3)
    _, _, k_pe, c_kv = fake.module.npu_kv_rmsnorm_rope_cache(*a.values(), epsilon=1e-6, cache_mode="PA",
                                                             is_output_kv=True)
    kv = a["kv"].float().view(3, -1)
    c = kv[:, :KV_LORA]
    torch.testing.assert_close(c_kv.view(3, -1).float(), c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6)
                               * a["gamma"].float(), atol=2e-2, rtol=1e-2)
    pe = kv[:, KV_LORA:]
    deinterleaved = torch.cat([pe[:, ::2], pe[:, 1::2]], -1)  # channel 2i pairs with 2i+1
    x1, x2 = deinterleaved.chunk(2, -1)
    cos, sin = a["cos"].float().view(3, -1), a["sin"].float().view(3, -1)
    torch.testing.assert_close(k_pe.view(3, -1).float(), deinterleaved * cos + torch.cat([-x2, x1], -1) * sin,
                               atol=2e-2, rtol=1e-2)
    assert torch.equal(a["ckv_cache"].view(-1, KV_LORA)[[5, 17, 40]], c_kv.view(3, -1))
    assert torch.equal(a["k_cache"].view(-1, ROPE_DIM)[[5, 17, 40]], k_pe.view(3, -1))


@pytest.mark.parametrize(("change", "message"), [
    ({"index": torch.tensor([5, 17, 40], dtype=I32)}, "int64"),
    ({"kv": torch.randn(3, 1, 1, 64 + ROPE_DIM).half()}, "D = 128"),
    ({"k_cache": torch.zeros(4, 16, 1, KV_LORA, dtype=F16)}, "k_cache"),  # the caches swapped
])
def test_kv_rmsnorm_rope_cache_refuses_what_the_op_refuses(fake: FakeTorchNPU, change: dict[str, torch.Tensor],
                                                           message: str) -> None:
    a = {**_kv_inputs(3), **change}
    with pytest.raises(FakeNPUError, match=message):
        fake.module.npu_kv_rmsnorm_rope_cache(*a.values(), cache_mode="PA")


def _fia_inputs(heads: int = 4, dim: int = KV_LORA) -> dict[str, object]:
    gen = torch.Generator().manual_seed(4)
    blocks, block = 6, 16
    latent = torch.randn(blocks, block, 1, dim, generator=gen).half()
    rope = torch.randn(blocks, block, 1, ROPE_DIM, generator=gen).half()
    return dict(query=torch.randn(2, heads, 1, dim, generator=gen).half(),
                key=latent.view(blocks, 1, block, dim), value=latent.view(blocks, 1, block, dim),
                query_rope=torch.randn(2, heads, 1, ROPE_DIM, generator=gen).half(),
                key_rope=rope.view(blocks, 1, block, ROPE_DIM), num_heads=heads, num_key_value_heads=1,
                input_layout="BNSD", scale=0.1, block_table=torch.tensor([[4, 1], [0, 5]], dtype=I32),
                block_size=block, actual_seq_lengths_kv=[20, 3])


def test_fia_mla_decode_attends_over_latent_and_rope_caches(fake: FakeTorchNPU) -> None:
    a = _fia_inputs()
    out = fake.module.npu_fused_infer_attention_score(a.pop("query"), a.pop("key"), a.pop("value"), **a)[0]
    b = _fia_inputs()
    latent, rope = b["key"].view(-1, KV_LORA), b["key_rope"].view(-1, ROPE_DIM)  # type: ignore[union-attr]
    q, qr = b["query"], b["query_rope"]
    for seq, (blocks, length) in enumerate([([4, 1], 20), ([0, 5], 3)]):
        rows = torch.cat([torch.arange(16) + 16 * blk for blk in blocks])[:length]
        scores = (q[seq, :, 0].float() @ latent[rows].float().t()  # type: ignore[index]
                  + qr[seq, :, 0].float() @ rope[rows].float().t()) * 0.1  # type: ignore[index]
        torch.testing.assert_close(out[seq, :, 0].float(), torch.softmax(scores, -1) @ latent[rows].float(),
                                   atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize(("change", "message"), [
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"block_table": torch.tensor([[4, 1], [0, 5]])}, "int32"),
    ({"input_layout": "BSH"}, "BNSD"),
])
def test_fia_refuses_what_mla_decode_refuses(fake: FakeTorchNPU, change: dict[str, object], message: str) -> None:
    a = {**_fia_inputs(), **change}
    with pytest.raises(FakeNPUError, match=message):
        fake.module.npu_fused_infer_attention_score(a.pop("query"), a.pop("key"), a.pop("value"), **a)


def test_fia_refuses_a_head_count_or_width_mla_does_not_take(fake: FakeTorchNPU) -> None:
    a = _fia_inputs(heads=6)
    with pytest.raises(FakeNPUError, match="N = 6"):
        fake.module.npu_fused_infer_attention_score(a.pop("query"), a.pop("key"), a.pop("value"), **a)
    a = _fia_inputs(dim=64)
    with pytest.raises(FakeNPUError, match="D = 64"):
        fake.module.npu_fused_infer_attention_score(a.pop("query"), a.pop("key"), a.pop("value"), **a)
