"""What tests read off a cache pool beyond its public state: the pool's own references, the free pages."""

from __future__ import annotations

from hybridpd.engine.cache.block_pool import BlockPool
from hybridpd.engine.cache.overlay import ArenaAttentionPool, ArenaStatePool


def own_refs(pool: BlockPool, page: int) -> int:
    """References the pool itself holds on a page: a block of a range a checkpoint covers, the arena's pinned slot."""
    if isinstance(pool, ArenaAttentionPool) and pool.overlay is not None:
        return int(pool.overlay.range_ids[page] in pool.overlay.held)
    if isinstance(pool, ArenaStatePool):
        return int(bool(pool._pinned) and page == pool.first_overlay)
    return 0


def free_order(pool: BlockPool) -> list[int]:
    """A plain pool's unreferenced pages: the free ones (next handed out first), then the cached ones (release
    order)."""
    return [*reversed(pool._free), *pool._idle]


def free_pages(pool: BlockPool) -> set[int]:
    """Pages nobody references and no name holds (what an allocation may hand out)."""
    return {b for b in range(1, pool.num_blocks) if not pool.ref_cnt[b] and pool.block_hash[b] is None}


def slot_blocks(arena: object, slot: int) -> range:
    """The attention blocks an arena's checkpoint slot shares memory with (empty for running slots)."""
    c = slot - arena.first_overlay_slot  # type: ignore[attr-defined]
    if not arena.state_bytes or c < 1:  # type: ignore[attr-defined]
        return range(0)
    k = arena.blocks_per_slot  # type: ignore[attr-defined]
    return range(c * k, (c + 1) * k)
