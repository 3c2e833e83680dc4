"""KV block pool and manager: allocation, prefix cache, append, free, swap, usage. No torch."""

from __future__ import annotations

import pytest

from npuserve.engine.kvcache import BlockPool, KVCacheManager, NoFreeBlocksError, chain_hash
from npuserve.engine.sequence import SamplingParams, Sequence

BS = 4


def seq(tokens: list[int]) -> Sequence:
    return Sequence(prompt_token_ids=list(tokens), sampling=SamplingParams(), arrival_time=0.0)


def computed(kv: KVCacheManager, s: Sequence) -> None:
    """What the scheduler does after a step: every token but the newest is computed."""
    s.num_cached_tokens = s.num_tokens
    kv.cache_computed(s)


# --- BlockPool ---------------------------------------------------------------------------------------------------


def test_pool_allocates_each_block_once_and_refuses_when_empty() -> None:
    pool = BlockPool(3)
    ids = {pool.allocate() for _ in range(3)}
    assert ids == {0, 1, 2}
    assert pool.num_free == 0 and pool.num_used == 3
    with pytest.raises(NoFreeBlocksError):
        pool.allocate()


def test_pool_release_twice_is_an_error() -> None:
    pool = BlockPool(1)
    b = pool.allocate()
    pool.release(b)
    with pytest.raises(RuntimeError):
        pool.release(b)


def test_pool_freed_block_keeps_hash_until_reused() -> None:
    pool = BlockPool(2)
    a = pool.allocate()
    h = chain_hash(None, [1, 2])
    pool.register(a, h, None, [1, 2])
    pool.release(a)
    assert pool.lookup(h, None, [1, 2]) == a  # still findable while free
    # Unhashed free blocks are handed out before cached ones.
    b = pool.allocate()
    assert b != a
    assert pool.lookup(h, None, [1, 2]) == a
    c = pool.allocate()  # only the cached block is left: reusing it evicts the entry
    assert c == a
    assert pool.lookup(h, None, [1, 2]) is None


def test_pool_lookup_confirms_tokens_and_parent() -> None:
    pool = BlockPool(1)
    a = pool.allocate()
    h = chain_hash(None, [1, 2])
    pool.register(a, h, None, [1, 2])
    assert pool.lookup(h, None, [1, 3]) is None  # same key, other tokens: a collision is a miss
    assert pool.lookup(h, 12345, [1, 2]) is None


def test_chain_hash_covers_the_parent() -> None:
    assert chain_hash(1, [5, 6]) != chain_hash(2, [5, 6])
    assert chain_hash(None, [5, 6]) == chain_hash(None, (5, 6))


# --- allocate / prefix cache ---------------------------------------------------------------------------------------


def test_allocate_covers_all_tokens() -> None:
    kv = KVCacheManager(10, 0, BS)
    s = seq(list(range(9)))
    assert kv.can_allocate(s)
    kv.allocate(s)
    assert len(s.block_table) == 3 and len(set(s.block_table)) == 3
    assert s.num_cached_tokens == 0
    assert kv.num_used_blocks == 3 and kv.device.num_free == 7
    assert kv.usage == pytest.approx(0.3)


def test_cannot_allocate_beyond_free_blocks() -> None:
    kv = KVCacheManager(2, 0, BS)
    s = seq(list(range(9)))
    assert not kv.can_allocate(s)
    assert not kv.can_ever_fit(s.num_tokens)
    with pytest.raises(RuntimeError):
        kv.allocate(s)
    assert kv.device.num_free == 2


def test_prefix_hit_shares_computed_blocks() -> None:
    kv = KVCacheManager(10, 0, BS)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    kv.allocate(a)
    computed(kv, a)
    b = seq([1, 2, 3, 4, 5, 6, 7, 8, 100, 101])
    kv.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.num_cached_tokens == 2 * BS
    assert b.block_table[2] not in a.block_table
    assert kv.device.blocks[a.block_table[0]].ref_count == 2


def test_prefix_not_hit_before_it_is_computed() -> None:
    kv = KVCacheManager(10, 0, BS)
    a = seq(list(range(9)))
    kv.allocate(a)  # not computed yet: nothing registered
    b = seq(list(range(9)))
    kv.allocate(b)
    assert b.num_cached_tokens == 0
    assert not set(a.block_table) & set(b.block_table)


def test_prefix_hit_never_covers_the_last_token() -> None:
    kv = KVCacheManager(10, 0, BS)
    a = seq(list(range(8)))  # exactly two full blocks
    kv.allocate(a)
    computed(kv, a)
    b = seq(list(range(8)))  # the same prompt: its last token must still be computed
    kv.allocate(b)
    assert b.num_cached_tokens == BS
    assert b.num_cached_tokens < b.num_tokens
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]


def test_freed_blocks_still_hit_and_count_as_free() -> None:
    kv = KVCacheManager(4, 0, BS)
    a = seq(list(range(9)))
    kv.allocate(a)
    computed(kv, a)
    kv.free(a)
    assert kv.device.num_free == 4
    b = seq([*range(8), 50])
    assert kv.can_allocate(b)
    kv.allocate(b)
    assert b.num_cached_tokens == 2 * BS
    assert kv.device.num_free == 1


def test_prefix_caching_off_never_hits() -> None:
    kv = KVCacheManager(10, 0, BS, enable_prefix_caching=False)
    a = seq(list(range(9)))
    kv.allocate(a)
    computed(kv, a)
    b = seq(list(range(9)))
    kv.allocate(b)
    assert b.num_cached_tokens == 0


def test_different_prefix_same_block_tokens_is_a_miss() -> None:
    kv = KVCacheManager(10, 0, BS)
    a = seq([1, 1, 1, 1, 7, 7, 7, 7, 0])
    kv.allocate(a)
    computed(kv, a)
    b = seq([2, 2, 2, 2, 7, 7, 7, 7, 0])  # block 1 has the same tokens, but a different prefix
    kv.allocate(b)
    assert b.num_cached_tokens == 0


# --- append ------------------------------------------------------------------------------------------------------


def test_append_adds_a_block_only_when_the_last_is_full() -> None:
    kv = KVCacheManager(3, 0, BS)
    s = seq([1, 2, 3])
    kv.allocate(s)
    s.token_ids.append(4)
    assert kv.append(s) and len(s.block_table) == 1
    s.token_ids.append(5)
    assert kv.append(s) and len(s.block_table) == 2


def test_append_fails_without_free_blocks() -> None:
    kv = KVCacheManager(1, 0, BS)
    s = seq([1, 2, 3, 4])
    kv.allocate(s)
    s.token_ids.append(5)
    assert not kv.append(s)
    assert len(s.block_table) == 1


def test_decode_registers_a_block_once_it_is_full_and_computed() -> None:
    kv = KVCacheManager(10, 0, BS)
    a = seq([1, 2, 3])
    kv.allocate(a)
    computed(kv, a)
    a.token_ids.append(4)  # the sampled token; computed by the next decode step
    kv.append(a)
    computed(kv, a)
    a.token_ids.append(5)
    b = seq([1, 2, 3, 4, 9])
    kv.allocate(b)
    assert b.block_table[0] == a.block_table[0]


# --- free ----------------------------------------------------------------------------------------------------------


def test_free_releases_everything_and_is_idempotent() -> None:
    kv = KVCacheManager(5, 5, BS)
    s = seq(list(range(10)))
    kv.allocate(s)
    kv.free(s)
    kv.free(s)
    assert kv.device.num_free == 5 and s.block_table == []


# --- swap ----------------------------------------------------------------------------------------------------------


def test_swap_out_and_in_round_trip() -> None:
    kv = KVCacheManager(4, 4, BS)
    s = seq(list(range(7)))
    kv.allocate(s)
    device_before = list(s.block_table)
    out = kv.swap_out(s)
    assert [d for d, _ in out] == device_before
    assert s.block_table == [] and len(s.host_block_table) == 2
    assert kv.device.num_free == 4 and kv.host.num_free == 2
    back = kv.swap_in(s)
    assert [h for h, _ in back] == [h for _, h in out]
    assert len(s.block_table) == 2 and s.host_block_table == []
    # The host blocks are released only at the next step, after their copies ran.
    assert kv.host.num_free == 2
    kv.begin_step()
    assert kv.host.num_free == 4


def test_swap_out_refused_without_host_room() -> None:
    kv = KVCacheManager(4, 1, BS)
    s = seq(list(range(7)))
    kv.allocate(s)
    assert not kv.can_swap_out(s)
    with pytest.raises(RuntimeError):
        kv.swap_out(s)


def test_swap_in_needs_room_for_the_next_token() -> None:
    kv = KVCacheManager(3, 4, BS)
    s = seq(list(range(8)))
    kv.allocate(s)
    kv.swap_out(s)
    s.token_ids.append(9)  # 9 tokens: 3 blocks after swap-in
    other = seq([1])
    kv.allocate(other)
    assert not kv.can_swap_in(s)
    kv.free(other)
    assert kv.can_swap_in(s)


def test_swap_out_of_a_shared_prefix_keeps_the_other_owner() -> None:
    kv = KVCacheManager(10, 10, BS)
    a = seq(list(range(9)))
    kv.allocate(a)
    computed(kv, a)
    b = seq(list(range(9)))
    kv.allocate(b)
    shared = a.block_table[0]
    kv.swap_out(b)
    assert kv.device.blocks[shared].ref_count == 1
    assert not kv.device.is_free(shared)


def test_usage_figures() -> None:
    kv = KVCacheManager(8, 4, BS)
    assert kv.usage == 0.0 and kv.free_fraction == 1.0
    s = seq(list(range(8)))
    kv.allocate(s)
    assert kv.num_used_blocks == 2
    assert kv.usage == pytest.approx(0.25)
    kv.swap_out(s)
    assert kv.usage == 0.0 and kv.host.num_used == 2  # its blocks moved to the host
    empty = KVCacheManager(0, 0, BS)
    assert empty.usage == 0.0
