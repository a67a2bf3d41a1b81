"""What tests read off the cache beyond its public state: a pool's own references and free pages, page sizes, the
block hashes of a token list."""

from __future__ import annotations

from collections.abc import Sequence

from hybridpd.engine.cache.arena import _page_parts
from hybridpd.engine.cache.block_pool import BlockPool
from hybridpd.engine.cache.hashing import append_block_hashes
from hybridpd.engine.cache.overlay import ArenaAttentionPool, ArenaStatePool
from hybridpd.engine.cache.specs import CacheGroup


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


def page_bytes(groups: list[CacheGroup]) -> int:
    """Bytes of one arena page of these groups (attention: a block; recurrent: a state slot before rounding)."""
    return _page_parts(groups)[1]


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int, extra: bytes = b"") -> None:
    """Append hashes for every newly full block of `token_ids` (a request's tokens so far) to `hashes`."""
    start, num_full = len(hashes), len(token_ids) // block_size
    if num_full > start:
        append_block_hashes(hashes, token_ids[start * block_size : num_full * block_size], block_size, extra)
