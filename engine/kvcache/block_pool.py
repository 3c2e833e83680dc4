"""A pool of fixed-size KV blocks: free list, reference counts and the prefix cache. No torch.

A block is free when no sequence holds it (ref count 0). A full block whose KV has been computed may be
registered under a chained hash (`chain_hash`): the hash of block i covers the hash of block i-1 and the
block's own token ids, so equal hashes mean equal prefixes up to hash collisions, and a hit is confirmed against
the stored parent hash and token ids. A freed block keeps its hash and stays findable until the free list hands
it out again; the free list reuses blocks without a hash first, then hashed ones least recently freed first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def chain_hash(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """The prefix-cache key of a full block. Python's hash of ints and tuples is not salted, so it is stable."""
    return hash((parent_hash, tuple(token_ids)))


class NoFreeBlocksError(RuntimeError):
    """Asked for a block when none is free; callers check `num_free` first."""


class Block:
    __slots__ = ("block_hash", "block_id", "parent_hash", "ref_count", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None
        self.parent_hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion order is reuse order: unhashed blocks go to the front, hashed ones to the back (LRU).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds, cached ones included: a cached free block is reused when needed."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self.blocks) - len(self._free)

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    def allocate(self) -> int:
        """A fresh block with ref count 1; evicts its old prefix-cache entry if it had one."""
        if not self._free:
            raise NoFreeBlocksError("no free KV block")
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
            block.block_hash = None
            block.parent_hash = None
            block.token_ids = ()
        block.ref_count = 1
        return block_id

    def share(self, block_id: int) -> None:
        """Take one more reference on a block (a prefix-cache hit)."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"block {block_id} released more often than taken")
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None
            if block.block_hash is None:
                self._free.move_to_end(block_id, last=False)

    def lookup(self, block_hash: int, parent_hash: int | None, token_ids: Sequence[int]) -> int | None:
        """The block cached under `block_hash`, if its stored parent hash and tokens match exactly."""
        block_id = self._cached.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.parent_hash != parent_hash or block.token_ids != tuple(token_ids):
            return None  # a hash collision: treat as a miss
        return block_id

    def register(self, block_id: int, block_hash: int, parent_hash: int | None, token_ids: Sequence[int]) -> None:
        """Make a full, computed block findable. A second block with the same content stays unregistered."""
        if not self.enable_prefix_caching:
            return
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        block.parent_hash = parent_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block_id
