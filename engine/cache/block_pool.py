"""One pool of fixed-size pages (attention blocks or recurrent-state slots) for one cache group.

Ownership: the group's manager allocates and frees; the pool owns ref counts, the free queue and the
hash -> block map, and nothing else. Block 0 is the null block: never handed out, never freed.

    free queue (eviction order, front first):  [b7 (no hash)] [b3 (hash h3)] [b9 (hash h9)] ...
    allocate(n)  pops from the front, dropping a popped block's hash (eviction);
    free(ids)    appends cached blocks to the back (callers pass a request's blocks tail first, so tails go
                 first) and puts blocks without a hash at the front: they hold nothing reusable, so they are
                 handed out before any cached block is evicted;
    touch(ids)   takes cached blocks out of the queue (ref 0 -> 1) or adds a reference.

Blocks in the queue with a hash are *cached* (reusable on a hit, evictable); without one they are *free*.

Two eviction modes:
- standalone (no `listener`): `allocate` evicts cached blocks from the queue front (LRU, as drawn above);
- policy-driven (a `PoolListener` attached, see reclaim.py): the listener is told when a cached block becomes
  unreferenced (`on_release`) or referenced again (`on_acquire`) and chooses victims itself (`evict`); `allocate`
  then only hands out free (hashless) blocks and never evicts on its own.

Arena pools (overlay.py) subclass this: they set `_watch` and hear every reference and free transition
(`_on_ref`, `_on_unref`, `_on_plain`), because their pages share memory with another pool's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Protocol

from hybridpd.engine.cache.events import CacheEventLog
from hybridpd.engine.cache.specs import NULL_BLOCK_ID


class PoolExhaustedError(RuntimeError):
    pass


class PoolListener(Protocol):
    def on_release(self, pool: BlockPool, block_id: int) -> None:
        """A cached block's last reference went away: it is now evictable."""

    def on_acquire(self, pool: BlockPool, block_id: int) -> None:
        """An unreferenced cached block got a reference: it is no longer evictable."""


class BlockPool:
    events: CacheEventLog | None = None
    """Set by the cache manager: every hash that becomes findable (`cache`) or stops being findable is reported."""
    event_group: int = 0
    """The pool's cache group id in those events."""

    def __init__(self, num_blocks: int, name: str = "pool", page_bytes: int = 0) -> None:
        if num_blocks < 2:
            raise ValueError(f"{name}: a pool needs at least 2 blocks (block 0 is the null block), got {num_blocks}")
        self.name = name
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        self._queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.ref_cnt[NULL_BLOCK_ID] = 1  # pinned forever
        self.num_evictions = 0
        self.page_bytes = page_bytes
        """Bytes one block (all layers of the group) holds; used by the shared budget (budget.py)."""
        self.num_plain = num_blocks - 1
        """Unreferenced blocks without a hash (free; allocating them evicts nothing)."""
        self.listener: PoolListener | None = None
        self._watch = False
        """Arena pools: call the `_on_*` hooks below on every reference / free transition."""
        self.version = 0
        """Counts the calls that may change the pool (the Reclaimer's "nothing changed since" test)."""

    # -- queries -----------------------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Usable blocks (the null block excluded)."""
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now (free + cached-evictable)."""
        return len(self._queue)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.capacity

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    @property
    def num_held(self) -> int:
        """Blocks that hold something (in use or cached): what the shared budget charges for."""
        return self.capacity - self.num_plain

    def available(self, checkpoint: bool = False) -> int:
        """Ids an allocation can take now without evicting anything (policy-driven pools: the free ones).
        `checkpoint`: for `allocate_checkpoint` (arena state pools keep running slots apart)."""
        return self.num_plain

    def own_refs(self, block_id: int) -> int:
        """References the pool itself holds on a page (arena pools: the overlay's cover, the pinned slot)."""
        return 0

    def held_bytes(self) -> int:
        """Bytes of memory the held pages take (what the shared budget charges)."""
        return self.num_held * self.page_bytes

    def free_block_ids(self) -> list[int]:
        """Blocks nobody references (free or cached), in eviction order. For poisoning tests and zeroing."""
        return list(self._queue)

    # -- mutation ----------------------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        self.version += 1
        avail = self.num_plain if self.listener is not None else len(self._queue)
        if n > avail:
            raise PoolExhaustedError(f"{self.name}: asked for {n} blocks, {avail} free")
        out = []
        pop, names, ref = self._queue.popitem, self.block_hash, self.ref_cnt
        for _ in range(n):
            block_id, _ = pop(last=False)
            if names[block_id] is None:
                self.num_plain -= 1
            else:
                self._evict_hash(block_id)
            ref[block_id] = 1
            out.append(block_id)
        return out

    def allocate_checkpoint(self, n: int) -> list[int]:
        """Ids for checkpoints (arena state pools take them from the overlay region)."""
        return self.allocate(n)

    # -- arena hooks (no-ops here) -----------------------------------------------------------------------------
    def _on_ref(self, block_id: int, was_plain: bool) -> None:
        """An unreferenced page got its first reference (it was free when `was_plain`, else cached)."""

    def _on_unref(self, block_id: int, now_plain: bool) -> None:
        """A page lost its last reference (it is free when `now_plain`, else cached)."""

    def _on_plain(self, block_id: int) -> None:
        """An unreferenced cached page lost its name: it is free now."""

    def touch(self, block_ids: Iterable[int]) -> None:
        self.version += 1
        for b in block_ids:
            if b == NULL_BLOCK_ID:
                continue
            if self.ref_cnt[b] == 0:
                del self._queue[b]
                plain = self.block_hash[b] is None
                if plain:
                    self.num_plain -= 1
                elif self.listener is not None:
                    self.listener.on_acquire(self, b)
                if self._watch:
                    self._on_ref(b, plain)
            self.ref_cnt[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        self.version += 1
        ref, names, queue, listener, watch = self.ref_cnt, self.block_hash, self._queue, self.listener, self._watch
        for b in block_ids:
            if b == NULL_BLOCK_ID:
                continue
            n = ref[b]
            if n <= 0:
                raise RuntimeError(f"{self.name}: double free of block {b}")
            ref[b] = n = n - 1
            if n == 0:
                queue[b] = None
                if names[b] is None:  # nothing to keep: reuse before evicting cached content
                    queue.move_to_end(b, last=False)
                    self.num_plain += 1
                    if watch:
                        self._on_unref(b, True)
                else:
                    if watch:
                        self._on_unref(b, False)
                    if listener is not None:
                        listener.on_release(self, b)

    def cache(self, block_id: int, block_hash: bytes) -> bool:
        """Record that `block_id` holds the content named by `block_hash`. Returns False (and changes nothing)
        when another block already holds that content or this block is already named."""
        self.version += 1
        if block_id == NULL_BLOCK_ID or block_hash in self.cached or self.block_hash[block_id] is not None:
            return False
        self.block_hash[block_id] = block_hash
        self.cached[block_hash] = block_id
        if self.events is not None:
            self.events.stored(self.event_group, block_hash)
        return True

    def rename(self, src: int, dst: int) -> None:
        """Move the name (hash) of unreferenced cached `src` to unnamed `dst`, which holds the same content; `src`
        becomes free. Used when a request recomputed a cached block: its live copy takes over the name."""
        self.version += 1
        h = self.block_hash[src]
        assert h is not None and self.ref_cnt[src] == 0 and self.block_hash[dst] is None and dst != NULL_BLOCK_ID
        self.block_hash[src] = None
        self._queue.move_to_end(src, last=False)
        self.num_plain += 1
        self.block_hash[dst] = h
        self.cached[h] = dst
        if self._watch:
            self._on_plain(src)

    def uncache(self, block_id: int) -> None:
        """Forget the block's content without counting an eviction (an unreferenced block becomes free)."""
        self._drop(block_id, count=False)

    def evict(self, block_id: int) -> None:
        """Policy-driven eviction of one unreferenced cached block: its hash goes, it becomes free."""
        assert self.ref_cnt[block_id] == 0 and self.block_hash[block_id] is not None, (self.name, block_id)
        self._drop(block_id, count=True)

    def _drop(self, block_id: int, count: bool) -> None:
        self.version += 1
        had = self.block_hash[block_id] is not None
        self._evict_hash(block_id, count=count)
        if had and self.ref_cnt[block_id] == 0:
            self._queue.move_to_end(block_id, last=False)
            self.num_plain += 1
            if self._watch:
                self._on_plain(block_id)

    def _evict_hash(self, block_id: int, count: bool = True) -> None:
        h = self.block_hash[block_id]
        if h is not None:
            self.block_hash[block_id] = None
            if self.cached.get(h) == block_id:
                del self.cached[h]
                if self.events is not None:
                    self.events.removed(self.event_group, h)
            if count:
                self.num_evictions += 1

    # -- integrity ---------------------------------------------------------------------------------------------
    def _queued(self, block_id: int) -> bool:
        """Whether the block belongs in the free queue: unreferenced (arena attention pools keep more there)."""
        return self.ref_cnt[block_id] == 0

    def stats(self) -> dict[str, int]:
        cached = sum(1 for b in self._queue if self.block_hash[b] is not None)
        in_use = sum(1 for b in range(1, self.num_blocks) if self.ref_cnt[b] > 0)
        return {"total": self.capacity, "free": len(self._queue) - cached, "cached": cached, "in_use": in_use}

    def check_integrity(self) -> None:
        """free + cached + in use == total; queue holds exactly the unreferenced blocks; hash map consistent."""
        s = self.stats()
        own = s.get("overlaid", 0) + s.get("pinned", 0)  # arena pools: what the arena itself holds
        assert s["free"] + s["cached"] + s["in_use"] + own == s["total"], (self.name, s)
        assert self.ref_cnt[NULL_BLOCK_ID] >= 1 and NULL_BLOCK_ID not in self._queue, self.name
        for b in range(1, self.num_blocks):
            assert self.ref_cnt[b] >= 0, (self.name, b)
            assert self._queued(b) == (b in self._queue), (self.name, b, self.ref_cnt[b])
        for h, b in self.cached.items():
            assert self.block_hash[b] == h, (self.name, b)
        assert sum(h is not None for h in self.block_hash) == len(self.cached), self.name
        assert s["free"] == self.num_plain, (self.name, s, self.num_plain)
