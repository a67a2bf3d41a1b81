"""Eviction order: a priority queue per pool over its evictable (unreferenced, cached) pages, and the value model.

    priority = base + alpha * value          (GreedyDual-Size: recency through the base, value per byte on top)
    base     = the clock when the page was last released (a restore or a reuse re-releases it); clock = the
               priority of the last page evicted, so it only grows and what was used recently ranks higher
    value    = (flops_saved(t) - flops_saved(a)) / bytes, normalised so a 4,096-token state alone scores 1.0;
               a = the nearest cached ancestor state or branch point (the compute only this entry saves),
               bytes = the state plus the blocks between a and t; 0 for a dead-end block and for a checkpoint
               a deeper one of the same request supersedes on an unbranched path (reclaim.py, `demote`)

This is Marconi's "recency + alpha * FLOP efficiency" (MLSys 2025) in a heap-friendly form: Marconi normalises
recency and efficiency over every candidate at each eviction (O(n)); here the clock carries recency, so a victim
is found in O(log n), and values are recomputed once per queue turnover (the tree under an entry changes as
branches appear). Ties break by release order; with every value 0 this is exactly LRU, which is how the LRU
baseline runs.

Ownership: `Reclaimer` (reclaim.py) owns one `EvictionQueue` per pool and is the only caller. Tensor-free.
"""

from __future__ import annotations

import heapq
import itertools

ATTENTION_QUADRATIC_TOKENS = 8192
"""Context length at which a token's attention FLOPs equal its linear (projection/MLP/scan) FLOPs, roughly, for the
hybrid models we serve; only the shape of flops_saved() depends on it."""

REFERENCE_TOKENS = 4096


def flops_saved(tokens: int) -> float:
    """Relative compute a hit on a `tokens`-long prefix saves: linear per token plus attention's quadratic term."""
    return tokens + tokens * tokens / (2 * ATTENTION_QUADRATIC_TOKENS)


class ValueModel:
    """value = alpha * ((flops_saved(tokens) - flops_saved(anchor)) / bytes) / (flops_saved(4096) / reference_bytes)."""

    def __init__(self, reference_bytes: int, alpha: float = 1.0) -> None:
        self.alpha = alpha
        self._scale = alpha * max(reference_bytes, 1) / flops_saved(REFERENCE_TOKENS)

    def value(self, tokens: int, nbytes: int, anchor: int = 0) -> float:
        """Compute saved per byte by an entry covering tokens (anchor, tokens]."""
        if tokens <= anchor:
            return 0.0
        return self._scale * (flops_saved(tokens) - flops_saved(anchor)) / max(nbytes, 1)


class EvictionQueue:
    """Min-heap of (priority, release order, page) with lazy deletion: `discard` forgets a page in O(1); stale heap
    entries are skipped when they reach the top."""

    def __init__(self, order: itertools.count | None = None) -> None:
        self._heap: list[tuple[float, int, int]] = []
        self._live: dict[int, int] = {}  # page -> release order of its current entry
        self.priority: dict[int, float] = {}
        """page -> its current priority (live entries)."""
        self._order = order if order is not None else itertools.count()
        """Release counter; queues that share one compare their ties across pools in release order."""
        self.version = 0
        """Counts the calls that may change the queue."""

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, page: int) -> bool:
        return page in self._live

    def push(self, page: int, priority: float) -> None:
        self.version += 1
        seq = next(self._order)
        self._live[page] = seq
        self.priority[page] = priority
        heapq.heappush(self._heap, (priority, seq, page))
        if len(self._heap) > 4 * len(self._live) + 64:  # too many stale entries: rebuild
            self._heap = [e for e in self._heap if self._live.get(e[2]) == e[1]]
            heapq.heapify(self._heap)

    def discard(self, page: int) -> None:
        self.version += 1
        self._live.pop(page, None)
        self.priority.pop(page, None)

    def peek(self) -> tuple[float, int, int] | None:
        """(priority, release order, page) of the next victim, or None."""
        heap, live = self._heap, self._live
        while heap:
            prio, seq, page = heap[0]
            if live.get(page) == seq:
                return prio, seq, page
            heapq.heappop(heap)
        return None

    def pop(self) -> int:
        self.version += 1
        entry = self.peek()
        assert entry is not None
        heapq.heappop(self._heap)
        del self._live[entry[2]]
        self.priority.pop(entry[2], None)
        return entry[2]

    def pages(self) -> set[int]:
        return set(self._live)

    def reprioritize(self, priority_of: object) -> None:
        """Recompute every live entry's priority (`priority_of(page)`), keeping release order for ties."""
        self.version += 1
        self._heap = [(priority_of(page), seq, page) for page, seq in self._live.items()]  # type: ignore[operator]
        heapq.heapify(self._heap)
        self.priority = {page: prio for prio, _, page in self._heap}
