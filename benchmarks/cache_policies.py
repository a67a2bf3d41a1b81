"""Baseline cache policies, for comparison only (the engine runs one policy: engine/cache/tree.py).

- `LruTree`: the engine's tree with every value 0, so the GreedyDual order is release order (LRU) over the
  evictable items (leaf blocks, unreferenced checkpoints); blocks and checkpoints stay consistent as in the engine.
- `fixed_interval(n)`: vLLM-style admission, a checkpoint every n tokens of every request (prefill and decode).

`benchmarks/cache_manager.py` and the tests that compare policies build their caches with these.
"""

from __future__ import annotations

from hybridpd.engine.cache.admission import CachePolicy
from hybridpd.engine.cache.block_pool import BlockPool
from hybridpd.engine.cache.tree import CacheTree


class LruTree(CacheTree):
    """Evict in release order: the tree's GreedyDual priority with every value 0."""

    def _value(self, pool: BlockPool, h: bytes | None) -> float:
        return 0.0


def fixed_interval(interval: int) -> CachePolicy:
    """A checkpoint every `interval` tokens (a multiple of the block size), prefill and decode."""
    return CachePolicy(admission="interval", interval=interval)
