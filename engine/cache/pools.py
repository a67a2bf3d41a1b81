"""The two id spaces of the arena (arena.py), each knowing which ids are free and nothing more:
pages 1 .. P-1 (an attention block, referenced by the requests that hold it; or one k-th of a checkpoint, count 1)
and state slots 1 .. n-1 (a running request's state, or a staging slot). Id 0 is null. The cache manager
(coordinator.py) takes and gives back; the tree (tree.py) evicts. Single-threaded (the step loop). Tensor-free."""

from __future__ import annotations

import heapq
from collections.abc import Iterable


class PoolExhaustedError(RuntimeError):
    pass


class PagePool:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(f"the arena needs at least 2 pages (page 0 is the null block), got {num_pages}")
        self.num_pages = num_pages
        self.ref = [0] * num_pages
        self.ref[0] = 1  # the null page: pinned forever
        self.free: list[int] = list(range(num_pages - 1, 0, -1))  # the last one is handed out next: 1, 2, 3, ...
        self.num_checkpoint_pages = 0

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    def take(self, n: int) -> list[int]:
        """n free pages, each referenced once (the tree made room first)."""
        free = self.free
        if n > len(free):
            raise PoolExhaustedError(f"asked for {n} pages, {len(free)} free")
        out = free[len(free) - n :][::-1]
        del free[len(free) - n :]
        for p in out:
            self.ref[p] = 1
        return out

    def give_back(self, pages: Iterable[int]) -> None:
        """Pages nobody holds or names any more."""
        for p in pages:
            assert self.ref[p] <= 1 and p, p
            self.ref[p] = 0
            self.free.append(p)


class SlotPool:
    """State slots 1 .. n-1; the lowest free one is handed out first."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.free = list(range(1, num_slots))
        self.held = [False] * num_slots

    @property
    def capacity(self) -> int:
        return max(0, self.num_slots - 1)

    def take(self) -> int | None:
        if not self.free:
            return None
        s = heapq.heappop(self.free)
        self.held[s] = True
        return s

    def give_back(self, slot: int) -> None:
        assert self.held[slot], slot
        self.held[slot] = False
        heapq.heappush(self.free, slot)
