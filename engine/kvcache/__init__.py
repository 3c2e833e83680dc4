"""Paged KV cache bookkeeping (docs/engine.md#the-kv-cache): block pool with prefix cache, and the per-sequence
manager."""

from .block_pool import Block, BlockPool, NoFreeBlocksError, chain_hash
from .manager import KVCacheManager

__all__ = ["Block", "BlockPool", "KVCacheManager", "NoFreeBlocksError", "chain_hash"]
