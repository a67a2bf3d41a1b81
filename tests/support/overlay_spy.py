"""Counts, through the arena's own entry points, how often memory changes kind: a block handed out over memory a
checkpoint held before, and a checkpoint taken over memory blocks held before (tests of engine/cache/overlay.py)."""

from __future__ import annotations

from collections import Counter
from typing import Any


def spy_overlay(pool: Any, overlay: Any) -> Counter[str]:
    """Wrap `pool.allocate` and `overlay.hold`; the returned counter grows "block_over_checkpoint" and
    "checkpoint_over_block" as the cache runs."""
    used: set[int] = set()
    covered: set[int] = set()
    seen = Counter[str]()
    alloc, hold = pool.allocate, overlay.hold

    def spy_alloc(n: int) -> list[int]:
        out = alloc(n)
        seen["block_over_checkpoint"] += len(set(out) & covered)
        used.update(out)
        return out

    def spy_hold(p: Any, c: int) -> None:
        seen["checkpoint_over_block"] += overlay.holders[c] == 0 and bool(set(overlay.blocks_of(c)) & used)
        hold(p, c)
        covered.update(overlay.blocks_of(c))

    pool.allocate = spy_alloc
    overlay.hold = spy_hold
    return seen
