"""Baseline cache policies, for comparison only (the engine runs one policy: engine/cache/admission.py and tree.py).

- `LruTree`: LRU over every unreferenced cached page (vLLM's free-queue order): release order, no leaf rule, blocks
  and checkpoints evicted independently.
- `IntervalAdmission`: vLLM-style admission, a checkpoint every `policy.interval` tokens of every request (prefill
  and decode) and nowhere else; recurrent hits only at those boundaries.

`benchmarks/cache_manager.py` and the tests that compare policies build their caches with these:
`HybridCacheManager(groups, layout, tree_cls=LruTree, admission_cls=IntervalAdmission)`.
"""

from __future__ import annotations

from hybridpd.engine.cache.admission import Admission, CachePolicy
from hybridpd.engine.cache.tree import STATE, CacheTree


class LruTree(CacheTree):
    """vLLM's free-queue order: every unreferenced cached page (block or checkpoint) in release order, with no leaf
    rule, no cascade between a block and its checkpoint, and no protection of checkpoints that served hits. The
    tree's nodes stay unlinked, so every block is a leaf; priorities are the clock (values 0), so ties go by
    release order."""

    def _value(self, kind: int, h: bytes | None) -> float:
        return 0.0

    def on_block_cached(self, h: bytes, parent: bytes | None, tokens: int) -> None:
        self._node(h, tokens)

    def _requeue_block(self, h: bytes) -> None:
        pass

    def demote(self, h: bytes) -> None:
        pass

    def _since_hit(self, slot: int) -> int | None:
        return None

    def evict(self, kind: int, page: int, prio: float | None = None, count: bool = True) -> None:
        pool = self.pool_of[kind]
        assert pool is not None
        h = pool.block_hash[page]
        assert h is not None
        self._discard(kind, page)
        pool.evict(page, count)
        self._drop_riders(kind, h, count)
        if all(p is None or p.lookup(h) is None for p in self.pool_of):
            del self.nodes[h]
        elif kind == STATE:
            self.nodes[h].ckpt = False


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
