"""Baseline cache policies, for comparison only (the engine runs one policy: engine/cache/admission.py and tree.py).

- `LruTree`: the engine's tree with every value 0, so the GreedyDual order is release order (LRU) over the
  evictable items (leaf blocks, unreferenced checkpoints); blocks and checkpoints stay consistent as in the engine.
- `IntervalAdmission`: vLLM-style admission, a checkpoint every `policy.interval` tokens of every request (prefill
  and decode) and nowhere else; recurrent hits only at those boundaries.

`benchmarks/cache_manager.py` and the tests that compare policies build their caches with these:
`HybridCacheManager(groups, layout, tree_cls=LruTree, admission_cls=IntervalAdmission)`.
"""

from __future__ import annotations

from hybridpd.engine.cache.admission import Admission, CachePolicy
from hybridpd.engine.cache.block_pool import BlockPool
from hybridpd.engine.cache.tree import CacheTree


class LruTree(CacheTree):
    """Evict in release order: the tree's GreedyDual priority with every value 0."""

    def _value(self, pool: BlockPool, h: bytes | None) -> float:
        return 0.0


class IntervalAdmission(Admission):
    """A checkpoint at every multiple of `policy.interval` (> 0) tokens, prefill and decode; nothing per request."""

    name = "interval"

    def __init__(self, policy: CachePolicy, block_size: int) -> None:
        if policy.interval <= 0:
            raise ValueError("interval admission needs checkpoint_interval > 0")
        super().__init__(policy, block_size)
        self.every_chunk = True

    @property
    def align(self) -> int:
        return self.policy.interval

    def admit(self, hashes: list[bytes], hit_tokens: int, prompt_end: int) -> tuple[list[int], list[int]] | None:
        return None

    def due(self, targets: list[int] | None, start: int, end: int, prompt_tokens: int) -> tuple[list[int], int | None]:
        step = self.policy.interval
        return list(range((start // step + 1) * step, end + 1, step)), None

    def note(self, hashes: list[bytes]) -> None:
        pass


def fixed_interval(interval: int) -> tuple[CachePolicy, type[Admission]]:
    """The vLLM-style baseline's (policy, admission class): a checkpoint every `interval` tokens."""
    return CachePolicy(interval=interval), IntervalAdmission
