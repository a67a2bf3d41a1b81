"""One pool of fixed-size pages (attention blocks or recurrent-state slots) for one cache group.

Ownership: the group's manager allocates and frees; the pool owns ref counts, the names (hash -> page map) and
which ids are free, nothing else; the cache tree (tree.py) is its listener and the only one that evicts. Page 0 is
the null page: never handed out, never freed. Every page is in exactly one state:

    free      unreferenced, no name      `allocate` hands these out (the last one freed first)
    cached    unreferenced, named        findable by a hit; the tree evicts it (it becomes free)
    in use    referenced (ref_cnt > 0)   named or not; `touch` references a cached page again

Arena pools (overlay.py) replace where free ids live (`_take_free`, `_on_ref`, `_on_unref`,
`_on_plain`) because their pages share memory with another pool's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from hybridpd.engine.cache.events import CacheEventLog
from hybridpd.engine.cache.specs import NULL_BLOCK_ID

if TYPE_CHECKING:
    from hybridpd.engine.cache.tree import CacheTree


class PoolExhaustedError(RuntimeError):
    pass


class BlockPool:
    events: CacheEventLog | None = None
    """Where names that become findable (`cache`) or stop being findable are reported, as group `event_group`."""
    event_group: int = 0
    listener: CacheTree
    """The cache tree: hears `on_release` (a cached page is evictable now) and `on_acquire` (referenced again)."""

    def __init__(self, num_blocks: int, name: str = "pool", page_bytes: int = 0) -> None:
        if num_blocks < 2:
            raise ValueError(f"{name}: a pool needs at least 2 blocks (block 0 is the null block), got {num_blocks}")
        self.name = name
        self.num_blocks = num_blocks
        self.page_bytes = page_bytes
        """Bytes one page (all layers of the group) holds: what the budget charges."""
        self.ref_cnt = [0] * num_blocks
        self.ref_cnt[NULL_BLOCK_ID] = 1  # pinned forever
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        """hash -> the page named by it (cached or in use)."""
        self._free: dict[int, None] = dict.fromkeys(range(num_blocks - 1, 0, -1))
        """Free pages; the last one is handed out next (so a fresh pool hands out 1, 2, 3, ...)."""
        self._idle: dict[int, None] = {}
        """Cached pages (unreferenced, named), in release order."""
        self.num_plain = num_blocks - 1
        """Free pages (unreferenced, no name): what an allocation can take without evicting."""
        self.num_evictions = 0
        self.version = 0
        """Counts the calls that may change the pool (the tree's "nothing changed since" test)."""

    # -- queries -----------------------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.num_blocks - 1  # the null page excluded

    @property
    def num_free(self) -> int:
        """Pages nobody references (free + cached)."""
        return self.num_plain + len(self._idle)

    @property
    def num_referenced(self) -> int:
        """Pages with ref_cnt > 0 (the null page excluded), O(1): every page is free, cached or referenced, and the
        free and cached counts change with every ref count that leaves or reaches 0 (`check_integrity` compares
        it with a scan)."""
        return self.capacity - self.num_free

    @property
    def num_own(self) -> int:
        """Referenced pages that no request holds (arena pools: what the arena itself references)."""
        return 0

    @property
    def num_in_use(self) -> int:
        """Pages that requests reference (running ones, or a prefill's pages kept for a transfer)."""
        return self.num_referenced - self.num_own

    def usage(self) -> float:
        """The share of the pages that requests reference (vLLM's `kv_cache_usage`): cached content is evictable,
        so it counts as free, and an idle engine reads 0. For metrics only; no decision reads it."""
        return self.num_in_use / self.capacity

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    @property
    def num_held(self) -> int:
        """Pages that hold something (in use or cached)."""
        return self.capacity - self.num_plain

    def held_bytes(self) -> int:
        return self.num_held * self.page_bytes

    # -- mutation ----------------------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """`n` free pages, referenced once each (never evicts: the tree makes room first)."""
        self.version += 1
        if n > self.num_plain:
            raise PoolExhaustedError(f"{self.name}: asked for {n} blocks, {self.num_plain} free")
        out = self._take_free(n)
        ref = self.ref_cnt
        for b in out:
            ref[b] = 1
        self.num_plain -= n
        return out

    def allocate_checkpoint(self, n: int) -> list[int]:
        return self.allocate(n)  # (arena state pools take checkpoint ids from the overlay region)

    def touch(self, block_ids: Iterable[int]) -> None:
        self.version += 1
        for b in block_ids:
            if b == NULL_BLOCK_ID:
                continue
            if self.ref_cnt[b] == 0:
                plain = self.block_hash[b] is None
                if plain:
                    self.num_plain -= 1
                else:
                    del self._idle[b]
                    self.listener.on_acquire(self, b)
                self._on_ref(b, plain)
            self.ref_cnt[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        self.version += 1
        ref, names = self.ref_cnt, self.block_hash
        for b in block_ids:
            if b == NULL_BLOCK_ID:
                continue
            n = ref[b]
            if n <= 0:
                raise RuntimeError(f"{self.name}: double free of block {b}")
            ref[b] = n = n - 1
            if n:
                continue
            if names[b] is None:  # nothing to keep: free
                self.num_plain += 1
                self._on_unref(b, True)
            else:
                self._idle[b] = None
                self._on_unref(b, False)
                self.listener.on_release(self, b)

    def cache(self, block_id: int, block_hash: bytes) -> bool:
        """Record that `block_id` holds the content named by `block_hash`. Returns False (and changes nothing)
        when another page already holds that content or this page is already named."""
        self.version += 1
        if block_id == NULL_BLOCK_ID or block_hash in self.cached or self.block_hash[block_id] is not None:
            return False
        self.block_hash[block_id] = block_hash
        self.cached[block_hash] = block_id
        if self.events is not None:
            self.events.append(True, self.event_group, block_hash)
        return True

    def rename(self, src: int, dst: int) -> None:
        """Move the name of cached `src` to unnamed `dst` (a recomputed copy of it); `src` becomes free."""
        self.version += 1
        h = self.block_hash[src]
        assert h is not None and self.ref_cnt[src] == 0 and self.block_hash[dst] is None and dst != NULL_BLOCK_ID
        self.block_hash[src] = None
        del self._idle[src]
        self.num_plain += 1
        self.block_hash[dst] = h
        self.cached[h] = dst
        self._on_plain(src)

    def evict(self, block_id: int, count: bool = True) -> None:
        """The page's name goes (`count`: an eviction, not a deliberate drop); an unreferenced page becomes free."""
        self.version += 1
        h = self.block_hash[block_id]
        if h is None:
            return
        self.block_hash[block_id] = None
        if self.cached.get(h) == block_id:
            del self.cached[h]
            if self.events is not None:
                self.events.append(False, self.event_group, h)
        if count:
            self.num_evictions += 1
        if self.ref_cnt[block_id] == 0:
            del self._idle[block_id]
            self.num_plain += 1
            self._on_plain(block_id)

    # -- where free ids live (arena pools replace these) ------------------------------------------------------
    def _take_free(self, n: int) -> list[int]:
        pop = self._free.popitem
        return [pop()[0] for _ in range(n)]

    def _on_ref(self, block_id: int, was_plain: bool) -> None:
        """An unreferenced page got its first reference (it was free when `was_plain`, else cached)."""
        if was_plain:
            del self._free[block_id]

    def _on_unref(self, block_id: int, now_plain: bool) -> None:
        """A page lost its last reference (it is free when `now_plain`, else cached)."""
        if now_plain:
            self._free[block_id] = None

    def _on_plain(self, block_id: int) -> None:
        """A cached page lost its name: it is free now."""
        self._free[block_id] = None

    def _is_free(self, block_id: int) -> bool:
        return block_id in self._free

    # -- integrity ---------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Page counts by state, O(1) (no scan: metrics read it at every scrape)."""
        return {"total": self.capacity, "free": self.num_plain, "cached": len(self._idle), "in_use": self.num_in_use}

    def check_integrity(self) -> None:
        """Every page is in exactly one state (free, cached, in use); the counts match a scan of the pages; the hash
        map names what the pages say."""
        referenced = sum(1 for b in range(1, self.num_blocks) if self.ref_cnt[b] > 0)
        assert referenced == self.num_referenced, (self.name, referenced, self.num_referenced)
        s = self.stats()
        assert s["free"] + s["cached"] + s["in_use"] + self.num_own == s["total"], (self.name, s)
        assert self.ref_cnt[NULL_BLOCK_ID] >= 1 and not self._is_free(NULL_BLOCK_ID), self.name
        for b in range(1, self.num_blocks):
            ref, named = self.ref_cnt[b], self.block_hash[b] is not None
            assert ref >= 0, (self.name, b)
            assert self._is_free(b) == (ref == 0 and not named), (self.name, b, ref)
            assert (b in self._idle) == (ref == 0 and named), (self.name, b, ref)
        for h, b in self.cached.items():
            assert self.block_hash[b] == h, (self.name, b)
        assert sum(h is not None for h in self.block_hash) == len(self.cached), self.name
