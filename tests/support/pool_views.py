"""What tests read off the cache beyond its public state: free pages, page sizes, the block hashes of a token list."""

from __future__ import annotations

from collections.abc import Sequence

from hybridpd.engine.cache.arena import _page_parts
from hybridpd.engine.cache.coordinator import HybridCacheManager
from hybridpd.engine.cache.hashing import append_block_hashes
from hybridpd.engine.cache.specs import CacheGroup


def free_pages(cache: HybridCacheManager) -> set[int]:
    """Pages nobody references and nothing names (what an allocation may hand out)."""
    return set(cache.pages.free)


def cached_blocks(cache: HybridCacheManager) -> set[int]:
    """Pages named as cached attention blocks (referenced or not)."""
    return {n.page for n in cache.tree.nodes.values() if n.page}


def checkpoint_pages(cache: HybridCacheManager) -> set[int]:
    """Pages of cached checkpoints."""
    return {p for n in cache.tree.nodes.values() for p in n.ckpt or ()}


def page_bytes(groups: list[CacheGroup]) -> int:
    """Bytes of one arena page of these groups (attention: a block of every group; recurrent: a state, padded)."""
    return _page_parts(groups)[1]


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int, extra: bytes = b"") -> None:
    """Append hashes for every newly full block of `token_ids` (a request's tokens so far) to `hashes`."""
    start, num_full = len(hashes), len(token_ids) // block_size
    if num_full > start:
        append_block_hashes(hashes, token_ids[start * block_size : num_full * block_size], block_size, extra)
