"""Property test of the KV manager: over random allocate/compute/fork/append/free/swap/abort sequences, no block is
owned twice (a shared block always holds the same full prefix block for every owner: prefix hits and forks share
only full blocks, a fork's partial block is the child's own copy), none leaks, and the pools' reference counts and
free lists agree with the sequences' block tables."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from npuserve.engine.kvcache import KVCacheManager
from npuserve.engine.sequence import SamplingParams, Sequence

BS = 3
# A tiny alphabet and short prompts so prefixes repeat and the prefix cache is hit often.
tokens = st.lists(st.integers(0, 2), min_size=1, max_size=14)


class KVMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(num_device_blocks=12, num_host_blocks=6, block_size=BS)
        self.live: dict[int, Sequence] = {}

    def _new(self, prompt: list[int]) -> Sequence:
        return Sequence(prompt_token_ids=prompt, sampling=SamplingParams(), arrival_time=0.0)

    @rule(target=seqs, prompt=tokens, n=st.sampled_from([1, 1, 2, 3]))
    def allocate(self, prompt: list[int], n: int) -> Sequence:
        s = Sequence(prompt_token_ids=prompt, sampling=SamplingParams(n=n), arrival_time=0.0)
        if self.kv.can_allocate(s):
            self.kv.allocate(s)
            assert s.num_cached_tokens < s.num_tokens
            assert s.num_cached_tokens % BS == 0
            self.live[s.seq_id] = s
        return s

    @rule(s=seqs)
    def compute(self, s: Sequence) -> None:
        if s.seq_id in self.live and s.block_table:
            s.num_cached_tokens = s.num_tokens
            self.kv.cache_computed(s)

    @rule(target=seqs, s=seqs)
    def fork(self, s: Sequence) -> Sequence:
        """After the prefill (the prompt computed, nothing appended yet): its n - 1 children, as `Scheduler.update`;
        the partial-block copies come from the blocks `allocate` set aside."""
        if s.seq_id not in self.live or not s.block_table or not s.num_forks_pending or s.num_output_tokens:
            return s
        s.num_cached_tokens = s.num_tokens
        self.kv.cache_computed(s)
        used = self.kv.device.num_used
        set_aside = s.seq_id in self.kv._fork_spares  # (a swap-out gave them back; the fork then allocates)
        child = s
        for index in range(1, s.num_forks_pending + 1):
            child = s.fork(index)
            copies = self.kv.fork(s, child)
            partial = s.num_tokens % BS != 0
            assert len(copies) == int(partial)
            if partial:
                assert copies[0] == (s.block_table[-1], child.block_table[-1])
            assert child.block_table[: s.num_tokens // BS] == s.block_table[: s.num_tokens // BS]
            self.live[child.seq_id] = child
        s.num_forks_pending = 0
        if set_aside:
            assert self.kv.device.num_used == used  # the copies used the blocks set aside, nothing more
        assert s.seq_id not in self.kv._fork_spares
        return child

    @rule(s=seqs, token=st.integers(0, 2))
    def append(self, s: Sequence, token: int) -> None:
        if s.seq_id not in self.live or not s.block_table:
            return
        s.token_ids.append(token)
        if not self.kv.append(s):
            s.token_ids.pop()

    @rule(s=seqs)
    def swap_out(self, s: Sequence) -> None:
        if s.seq_id in self.live and s.block_table and self.kv.can_swap_out(s):
            pairs = self.kv.swap_out(s)
            assert len({h for _, h in pairs}) == len(pairs)

    @rule(s=seqs)
    def swap_in(self, s: Sequence) -> None:
        if s.seq_id in self.live and s.host_block_table and self.kv.can_swap_in(s):
            self.kv.swap_in(s)
            assert self.kv.append(s)

    @rule(s=consumes(seqs))
    def free(self, s: Sequence) -> None:
        # Also an abort: a sequence may be freed in any state, running or swapped.
        if self.live.pop(s.seq_id, None) is not None:
            self.kv.free(s)

    @rule()
    def begin_step(self) -> None:
        self.kv.begin_step()

    @precondition(lambda self: bool(self.live))
    @rule()
    def free_all(self) -> None:
        for s in self.live.values():
            self.kv.free(s)
        self.live.clear()
        self.kv.begin_step()
        assert self.kv.device.num_free == self.kv.device.num_blocks
        assert self.kv.host.num_free == self.kv.host.num_blocks

    @invariant()
    def device_refs_match_tables(self) -> None:
        owners: Counter[int] = Counter()
        for s in self.live.values():
            assert len(set(s.block_table)) == len(s.block_table), "a block twice in one table"
            owners.update(s.block_table)
            if s.block_table:
                assert len(s.block_table) * BS >= s.num_tokens, "block table does not cover the tokens"
        spares = Counter(self.kv.spare_blocks())  # set aside for forks not made yet
        assert not set(spares) & set(owners) and all(c == 1 for c in spares.values())
        for block in self.kv.device.blocks:
            assert block.ref_count == owners[block.block_id] + spares[block.block_id]
            assert self.kv.device.is_free(block.block_id) == (block.ref_count == 0)
        assert self.kv.device.num_free + len(owners) + len(spares) == self.kv.device.num_blocks

    @invariant()
    def shared_blocks_hold_one_full_prefix(self) -> None:
        content: dict[int, set[tuple[int, tuple[int, ...]]]] = {}
        for s in self.live.values():
            for i, b in enumerate(s.block_table):
                if self.kv.device.blocks[b].ref_count > 1:
                    content.setdefault(b, set()).add((i, tuple(s.token_ids[: (i + 1) * BS])))
        for b, seen in content.items():
            assert len(seen) == 1, f"block {b} shared by sequences with different prefixes: {seen}"
            (i, prefix) = next(iter(seen))
            assert len(prefix) == (i + 1) * BS, f"shared block {b} is not full"

    @invariant()
    def host_blocks_owned_once(self) -> None:
        owners: Counter[int] = Counter()
        for s in self.live.values():
            owners.update(s.host_block_table)
            assert not (s.block_table and s.host_block_table), "a sequence both on device and on host"
        assert all(n == 1 for n in owners.values()), "a host block owned twice"
        pending = set(self.kv._host_pending_release)
        assert not pending & set(owners)
        for block in self.kv.host.blocks:
            expected = 1 if block.block_id in owners or block.block_id in pending else 0
            assert block.ref_count == expected

    def teardown(self) -> None:
        for s in self.live.values():
            self.kv.free(s)
        self.kv.begin_step()
        assert self.kv.device.num_free == self.kv.device.num_blocks, "device block leaked"
        assert self.kv.host.num_free == self.kv.host.num_blocks, "host block leaked"


KVMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestKVManager = KVMachine.TestCase
