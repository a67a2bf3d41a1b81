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
from hybridpd.engine.cache.tree import BLOCK, CacheTree, Node


class LruTree(CacheTree):
    """vLLM's free-queue order: every unreferenced cached item (block or checkpoint) in release order, with no leaf
    rule and no cascade between a block and its checkpoint. Blocks stay unlinked, so every block is a leaf;
    priorities are the clock (values 0), so ties go by release order."""

    def _value(self, kind: int, node: Node) -> float:
        return 0.0

    def name_block(self, h: bytes, parent: bytes | None, tokens: int, page: int) -> bool:
        return super().name_block(h, None, tokens, page)

    def _requeue_block(self, node: Node) -> None:
        pass

    def demote(self, h: bytes) -> None:
        pass

    def evict_block(self, node: Node) -> None:
        page = node.page
        self._dequeue(BLOCK, node)
        node.page = 0
        self.page_node[page] = None
        self.pages.give_back((page,))
        self._report(False, BLOCK, node.hash)
        if node.ckpt is None:
            self._drop(node)


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
