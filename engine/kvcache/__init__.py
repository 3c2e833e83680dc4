"""Paged KV cache bookkeeping (DESIGN.md 3.2): block pool with prefix cache, and the per-sequence manager."""

from .block_pool import Block, BlockPool, NoFreeBlocksError, chain_hash
from .manager import KVCacheManager

__all__ = ["Block", "BlockPool", "KVCacheManager", "NoFreeBlocksError", "chain_hash"]
