"""Paged KV cache bookkeeping for sequences: prefill allocation with prefix hits, one block per appended
`block_size` tokens, the swap plan between device and host blocks, usage figures. No torch: this only decides
which block ids a sequence owns; the runner turns block tables into tensors and copies.

Contract with the scheduler (the only caller in the engine):
- `allocate(seq)` before a prefill: `seq.block_table` covers `seq.num_tokens`; `seq.num_cached_tokens` is the
  prefix-cache hit (whole blocks, never every token: the last token is always computed so there are logits).
- `append(seq)` before a decode step: the block table covers `seq.num_tokens` (one new block when the last one
  is full). Returns False when no block is free.
- `cache_computed(seq)` after a step: registers the full blocks whose KV is now computed
  (`seq.num_cached_tokens`), so only computed KV is ever a prefix hit.
- `fork(parent, child)` right after the parent's first prefill (n > 1): the child shares the parent's full
  blocks (one more reference each) and gets a fresh block for the partly filled last one, returned as a
  (parent block, child block) pair for the runner to copy. That is copy-on-write whose write is certain: the
  child's first token goes into that block at its next step, so the copy is made at once. `fork_blocks(seq)` is
  the blocks the forks will take: `allocate` takes them with the parent's (held aside, in no block table, until
  the fork or the parent's end), so nothing can take them while the prompt is prefilled, chunk by chunk or at once.
  Afterwards each sequence of the group is an ordinary one: preempted, swapped (its own host copy of every block,
  shared or not), recomputed or freed on its own; a shared block returns to the free list with its last owner.
- A sequence that asks for prompt logprobs never gets prefix-cache hits (every prompt position must be computed).
- `swap_out(seq)` / `swap_in(seq)` return (src, dst) block pairs for the runner to copy. Host blocks that
  `swap_in` empties are released at the next `begin_step()`, so a swap-out in the same step cannot overwrite
  them before they are copied back.
"""

from __future__ import annotations

from ..sequence import Sequence
from .block_pool import BlockPool, chain_hash


class KVCacheManager:
    def __init__(
        self,
        num_device_blocks: int,
        num_host_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.device = BlockPool(num_device_blocks, enable_prefix_caching)
        self.host = BlockPool(num_host_blocks, enable_prefix_caching=False)
        self._hashes: dict[int, list[int]] = {}  # seq_id -> chained hashes of its full blocks
        self._num_registered: dict[int, int] = {}  # seq_id -> leading blocks already in the prefix cache
        self._host_pending_release: list[int] = []
        self._fork_spares: dict[int, list[int]] = {}  # seq_id -> blocks held for its forks' partial-block copies
        self.prefix_hits = 0  # blocks that allocate found in the prefix cache

    # --- figures -----------------------------------------------------------------------------------------------

    @property
    def num_device_blocks(self) -> int:
        return self.device.num_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.device.num_used

    @property
    def usage(self) -> float:
        """Fraction of device blocks held by sequences, 0..1 (`npuserve:kv_cache_usage_perc`)."""
        total = self.device.num_blocks
        return self.device.num_used / total if total else 0.0

    @property
    def free_fraction(self) -> float:
        total = self.device.num_blocks
        return self.device.num_free / total if total else 0.0

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether `num_tokens` fit the whole device cache at all (else the request can never run)."""
        return self.blocks_for(num_tokens) <= self.device.num_blocks

    # --- prefix hashes -----------------------------------------------------------------------------------------

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """The chained hashes of the first `num_blocks` full blocks, extended lazily (tokens only grow)."""
        hashes = self._hashes.setdefault(seq.seq_id, [])
        bs = self.block_size
        tokens = seq.token_ids
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(chain_hash(hashes[-1] if hashes else None, tokens[i * bs : (i + 1) * bs]))
        return hashes

    def _match_prefix(self, seq: Sequence) -> list[int]:
        if not self.enable_prefix_caching or seq.sampling.prompt_logprobs is not None:
            return []
        bs = self.block_size
        # Never a hit on the block holding the last token: it must be computed to get logits.
        max_blocks = (seq.num_tokens - 1) // bs
        if max_blocks <= 0:
            return []
        hashes = self._block_hashes(seq, max_blocks)
        tokens = seq.token_ids
        hits: list[int] = []
        for i in range(max_blocks):
            block_id = self.device.lookup(hashes[i], hashes[i - 1] if i else None, tokens[i * bs : (i + 1) * bs])
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    # --- prefill -----------------------------------------------------------------------------------------------

    def _allocation_cost(self, seq: Sequence, hits: list[int]) -> int:
        """Free blocks an allocation consumes: new blocks plus hits that sit in the free list."""
        fresh = self.blocks_for(seq.num_tokens) - len(hits)
        return fresh + sum(1 for b in hits if self.device.is_free(b))

    def prefix_hit_tokens(self, seq: Sequence) -> int:
        """Tokens `allocate(seq)` would find in the prefix cache now (whole blocks)."""
        return len(self._match_prefix(seq)) * self.block_size

    def can_allocate(self, seq: Sequence) -> bool:
        """Room for the prefill of `seq` and its forks' blocks."""
        cost = self._allocation_cost(seq, self._match_prefix(seq)) + self.fork_blocks(seq)
        return cost <= self.device.num_free

    def allocate(self, seq: Sequence) -> None:
        """Blocks for a prefill of all `seq.num_tokens` (a new prompt, or prompt + output after recompute)."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already holds blocks")
        hits = self._match_prefix(seq)
        if self._allocation_cost(seq, hits) > self.device.num_free:
            raise RuntimeError(f"not enough free KV blocks for sequence {seq.seq_id}")
        self.prefix_hits += len(hits)
        for block_id in hits:
            self.device.share(block_id)
        table = list(hits)
        for _ in range(self.blocks_for(seq.num_tokens) - len(hits)):
            table.append(self.device.allocate())
        seq.block_table = table
        seq.num_cached_tokens = len(hits) * self.block_size
        self._num_registered[seq.seq_id] = len(hits)
        if self.fork_blocks(seq):
            self._fork_spares[seq.seq_id] = [self.device.allocate() for _ in range(self.fork_blocks(seq))]

    # --- fork (n > 1) -------------------------------------------------------------------------------------------

    def fork_blocks(self, seq: Sequence) -> int:
        """Free blocks the forks of `seq` will take after its prefill: one per child when its last block is partial."""
        return seq.num_forks_pending if seq.num_tokens % self.block_size else 0

    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, int]]:
        """The child shares the parent's full blocks and gets its own copy of a partial last one (see above)."""
        if child.block_table or child.host_block_table:
            raise RuntimeError(f"sequence {child.seq_id} already holds blocks")
        full = parent.num_tokens // self.block_size
        table = parent.block_table
        if len(table) * self.block_size < parent.num_tokens:
            raise RuntimeError(f"sequence {parent.seq_id} holds no blocks to fork")
        for block_id in table[:full]:
            self.device.share(block_id)
        child.block_table = list(table[:full])
        copies: list[tuple[int, int]] = []
        if full < len(table):
            spares = self._fork_spares.get(parent.seq_id)
            if not spares and not self.device.num_free:
                for block_id in reversed(child.block_table):
                    self.device.release(block_id)
                child.block_table = []
                raise RuntimeError(f"no free KV block to fork sequence {parent.seq_id}")
            block_id = spares.pop() if spares else self.device.allocate()
            if spares is not None and not spares:
                del self._fork_spares[parent.seq_id]
            child.block_table.append(block_id)
            copies.append((table[full], block_id))
        hashes = self._hashes.get(parent.seq_id)
        if hashes is not None:
            self._hashes[child.seq_id] = hashes[:full]
        self._num_registered[child.seq_id] = min(self._num_registered.get(parent.seq_id, 0), full)
        return copies

    # --- decode ------------------------------------------------------------------------------------------------

    def append(self, seq: Sequence) -> bool:
        """Make the block table cover `seq.num_tokens`; False (nothing changed) when no block is free."""
        table = seq.block_table
        if seq.num_tokens <= len(table) * self.block_size:
            return True
        if not self.device.num_free:
            return False
        table.append(self.device.allocate())
        return True

    def cache_computed(self, seq: Sequence) -> None:
        """Register the full blocks whose KV is computed (`seq.num_cached_tokens`) in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_cached_tokens // self.block_size, len(seq.block_table))
        done = self._num_registered.get(seq.seq_id, 0)
        if full <= done:
            return
        hashes = self._block_hashes(seq, full)
        bs = self.block_size
        tokens = seq.token_ids
        for i in range(done, full):
            self.device.register(
                seq.block_table[i], hashes[i], hashes[i - 1] if i else None, tokens[i * bs : (i + 1) * bs]
            )
        self._num_registered[seq.seq_id] = full

    # --- release -----------------------------------------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Release every block the sequence holds, device and host. Idempotent."""
        # Tail first, so the prefix blocks are the most recently freed and the last to be evicted.
        for block_id in reversed(seq.block_table):
            self.device.release(block_id)
        for block_id in seq.host_block_table:
            self.host.release(block_id)
        self._release_spares(seq)
        seq.block_table = []
        seq.host_block_table = []
        self._hashes.pop(seq.seq_id, None)
        self._num_registered.pop(seq.seq_id, None)

    def _release_spares(self, seq: Sequence) -> None:
        for block_id in self._fork_spares.pop(seq.seq_id, []):
            self.device.release(block_id)

    def spare_blocks(self) -> list[int]:
        """Blocks held for forks not yet made (owned by no block table)."""
        return [b for spares in self._fork_spares.values() for b in spares]

    # --- swap --------------------------------------------------------------------------------------------------

    def begin_step(self) -> None:
        """Release the host blocks emptied by the previous step's swap-ins (their copies have run)."""
        for block_id in self._host_pending_release:
            self.host.release(block_id)
        self._host_pending_release.clear()

    def can_swap_out(self, seq: Sequence) -> bool:
        return len(seq.block_table) <= self.host.num_free

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move the sequence's KV to host blocks; returns (device block, host block) copies."""
        if not self.can_swap_out(seq):
            raise RuntimeError(f"not enough free host blocks to swap out sequence {seq.seq_id}")
        pairs = [(block_id, self.host.allocate()) for block_id in seq.block_table]
        self._release_spares(seq)
        for block_id in reversed(seq.block_table):
            self.device.release(block_id)  # a shared prefix block stays with its other owners
        seq.host_block_table = [host for _, host in pairs]
        seq.block_table = []
        self._num_registered.pop(seq.seq_id, None)  # new device blocks after swap-in: register them again
        return pairs

    def can_swap_in(self, seq: Sequence) -> bool:
        """Room for the host blocks plus the block the next decode token may need."""
        need = max(len(seq.host_block_table), self.blocks_for(seq.num_tokens))
        return need <= self.device.num_free

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring the sequence's KV back; returns (host block, device block) copies."""
        if not self.can_swap_in(seq):
            raise RuntimeError(f"not enough free device blocks to swap in sequence {seq.seq_id}")
        pairs = [(host, self.device.allocate()) for host in seq.host_block_table]
        self._host_pending_release.extend(seq.host_block_table)
        seq.block_table = [device for _, device in pairs]
        seq.host_block_table = []
        return pairs
