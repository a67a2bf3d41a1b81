"""Checkpoint slots that share memory with attention blocks (arena.py): the pools, and a movable boundary between them.

    attention blocks   0 1 .. k-1 | k .. 2k-1 | ... | C*k .. (C+1)*k-1      range c = blocks [c*k, (c+1)*k)
    state slots        0 1 .. S F | F+1       | ... | F+C                   checkpoint slot F + c covers range c
                       attention: lowest free block first -->   <-- checkpoints: highest free range first

The rule: a held checkpoint slot (pending, cached, pinned or reserved) and a held attention block (in use or
cached) never share memory. A checkpoint slot is taken only over a *free range* (all k blocks free in every
attention pool); the overlay then references those blocks (`cover`) until the slot is free again (`uncover`), so
the budget charges a checkpoint the k blocks it covers. Attention grows up from block 1 and checkpoints down from
range C, so they meet at a boundary: the highest range no checkpoint holds (`boundary`). With no free range, the
cache tree (tree.py, `make_room`) evicts the lowest checkpoint or the boundary range's cached blocks, whichever
loses less. Running slots (1 .. S) are reserved memory: a running slot is taken there first.

Several groups: every attention pool has the same ids (block j of every group is one arena page) and every state
pool too; range c is held while any state pool holds slot F + c, and a rider state pool takes a range its leader
holds already (one range serves every group's checkpoint at one hash).

Ownership: the coordinator builds the pools and one `Overlay`; the pools update its counters; the tree asks it for
ranges. Single-threaded (the step loop). Tensor-free.
"""

from __future__ import annotations

import heapq

from hybridpd.engine.cache.arena import ArenaLayout
from hybridpd.engine.cache.block_pool import BlockPool, PoolExhaustedError


class ArenaAttentionPool(BlockPool):
    """Attention blocks of the arena: free blocks are handed out lowest id first."""

    def __init__(self, num_blocks: int, name: str = "pool", page_bytes: int = 0) -> None:
        super().__init__(num_blocks, name, page_bytes)
        self.overlay: Overlay | None = None
        self._order = list(range(1, num_blocks))
        """Min-heap over `_free` (entries not in `_free` are stale and skipped)."""
        self.num_overlaid = 0
        """Blocks referenced by the overlay (covered by a held checkpoint slot)."""

    def _take_free(self, n: int) -> list[int]:
        out, order, free = [], self._order, self._free
        while len(out) < n:
            b = heapq.heappop(order)
            if b in free:
                del free[b]
                out.append(b)
                self.overlay.busy(b, 1)  # type: ignore[union-attr]
        return out

    def _on_ref(self, block_id: int, was_plain: bool) -> None:
        if was_plain:
            del self._free[block_id]
            self.overlay.busy(block_id, 1)  # type: ignore[union-attr]

    def _on_unref(self, block_id: int, now_plain: bool) -> None:
        if now_plain:
            self._on_plain(block_id)

    def _on_plain(self, block_id: int) -> None:
        self._free[block_id] = None
        heapq.heappush(self._order, block_id)
        self.overlay.busy(block_id, -1)  # type: ignore[union-attr]
        if len(self._order) > 2 * self.num_blocks:  # mostly stale: rebuild
            self._order = sorted(self._free)

    def cover(self, blocks: range) -> None:
        """The overlay takes these free blocks (a checkpoint slot over them is held): it references them."""
        for b in blocks:
            del self._free[b]
        self.ref_cnt[blocks.start : blocks.stop] = [1] * len(blocks)
        self.num_plain -= len(blocks)
        self.num_overlaid += len(blocks)

    def uncover(self, blocks: range) -> None:
        """The overlay gives these blocks back: free again."""
        self.ref_cnt[blocks.start : blocks.stop] = [0] * len(blocks)
        self.num_plain += len(blocks)
        self.num_overlaid -= len(blocks)
        for b in blocks:
            self._free[b] = None
            heapq.heappush(self._order, b)

    def free_block_ids(self) -> list[int]:
        return sorted(self._free)

    def own_refs(self, block_id: int) -> int:
        ov = self.overlay
        return int(ov is not None and block_id // ov.k in ov.held)

    def stats(self) -> dict[str, int]:
        s = super().stats()
        s["in_use"] -= self.num_overlaid
        s["overlaid"] = self.num_overlaid
        return s


class ArenaStatePool(BlockPool):
    """State slots of the arena: 1 .. S reserved for running requests, F = S + 1 pinned (it would cover the null
    block), F + c the checkpoint over range c (taken only through the overlay)."""

    def __init__(self, num_slots: int, running_slots: int, name: str = "pool", page_bytes: int = 0) -> None:
        super().__init__(num_slots, name, page_bytes)
        self.first_overlay = 1 + running_slots
        self.overlay: Overlay | None = None
        self._free.clear()
        self._pinned = int(self.first_overlay < num_slots)
        if self._pinned:
            self.ref_cnt[self.first_overlay] = 1
            self.num_plain -= 1
        self._running_free = list(range(1, min(self.first_overlay, num_slots)))
        self.num_overlay_held = 0
        """Checkpoint slots held (referenced or cached)."""

    def available(self, checkpoint: bool = False) -> int:
        assert self.overlay is not None
        overlay = self.overlay.available(self)
        return overlay if checkpoint else overlay + len(self._running_free)

    def free_block_ids(self) -> list[int]:
        return [b for b in range(1, self.num_blocks) if not self.ref_cnt[b]]

    def own_refs(self, block_id: int) -> int:
        return int(bool(self._pinned) and block_id == self.first_overlay)

    def stats(self) -> dict[str, int]:
        s = super().stats()
        s["in_use"] -= self._pinned
        s["pinned"] = self._pinned
        return s

    def overlay_needed(self, n: int, checkpoint: bool) -> int:
        """Checkpoint ranges an allocation of n ids takes (running slots come from the reserved ones first)."""
        return n if checkpoint else max(0, n - len(self._running_free))

    def held_bytes(self) -> int:
        """Running slots only: a checkpoint's memory is charged as the attention blocks it covers."""
        return (self.num_held - self._pinned - self.num_overlay_held) * self.page_bytes

    def allocate(self, n: int) -> list[int]:
        """Running slots: the reserved ones first, then (rarely: quarantined slots) a checkpoint range."""
        out: list[int] = []
        while len(out) < n:
            if self._running_free:
                out.append(self._take(heapq.heappop(self._running_free)))
            else:
                out += self.allocate_checkpoint(1)
        return out

    def allocate_checkpoint(self, n: int) -> list[int]:
        assert self.overlay is not None
        out: list[int] = []
        for _ in range(n):
            c = self.overlay.pick_range(self)
            if c is None:
                self.free(out)
                raise PoolExhaustedError(f"{self.name}: no free checkpoint range")
            out.append(self._take(self.first_overlay + c))
        return out

    def _take(self, s: int) -> int:
        self.version += 1
        assert self.ref_cnt[s] == 0 and self.block_hash[s] is None, (self.name, s)
        self.num_plain -= 1
        self.ref_cnt[s] = 1
        if s > self.first_overlay:
            self.num_overlay_held += 1
            self.overlay.hold(s - self.first_overlay)  # type: ignore[union-attr]
        return s

    def _on_ref(self, slot: int, was_plain: bool) -> None:
        assert not was_plain, (self.name, slot, "free slots are taken by `allocate` only")

    def _on_unref(self, slot: int, now_plain: bool) -> None:
        if now_plain:
            self._on_plain(slot)

    def _on_plain(self, slot: int) -> None:
        if slot < self.first_overlay:
            heapq.heappush(self._running_free, slot)
        elif slot > self.first_overlay and self.overlay is not None:
            self.num_overlay_held -= 1
            self.overlay.release(slot - self.first_overlay)

    def _is_free(self, slot: int) -> bool:
        if slot < self.first_overlay:
            return slot in self._running_free
        return slot > self.first_overlay and not self.ref_cnt[slot] and self.block_hash[slot] is None

    def check_integrity(self) -> None:
        super().check_integrity()
        held = sum(1 for s in range(self.first_overlay + 1, self.num_blocks) if not self._is_free(s))
        assert held == self.num_overlay_held, (self.name, held, self.num_overlay_held)


class Overlay:
    """Which ranges are free, held by checkpoints, or busy with attention blocks (see the module docstring)."""

    def __init__(self, arena: ArenaLayout, attention: list[ArenaAttentionPool], states: list[ArenaStatePool]) -> None:
        self.k = arena.blocks_per_slot
        self.num_ranges = arena.checkpoint_slots
        """C: ranges 1 .. C (range 0 holds the null block and is never a checkpoint's)."""
        self.attention = attention
        self.states = states
        n = self.num_ranges + 1
        self.num_busy = [0] * n
        """Held (in use or cached) attention blocks in each range, every pool; a range is free while 0 and not held."""
        self.holders = [0] * n
        """State pools holding each range's slot; the range is `held` (its blocks covered) while > 0."""
        self.held: set[int] = set()
        self._free_heap = [-c for c in range(n - 1, 0, -1)]
        """Max-heap (negated) of free ranges; entries of ranges no longer free are stale and skipped."""
        self.num_free_ranges = self.num_ranges
        self.num_range_evictions = 0
        """Boundary ranges whose cached blocks were evicted to make room for a checkpoint."""
        for p in attention:
            p.overlay = self
        for s in states:
            s.overlay = self

    def blocks_of(self, c: int) -> range:
        return range(c * self.k, (c + 1) * self.k)

    def busy(self, block_id: int, delta: int) -> None:
        """An attention block became held (delta 1) or free (-1)."""
        c = block_id // self.k
        if not 1 <= c <= self.num_ranges:
            return
        n = self.num_busy[c] = self.num_busy[c] + delta
        if n == 0:
            self.num_free_ranges += 1
            heapq.heappush(self._free_heap, -c)
        elif n == 1 and delta == 1:
            self.num_free_ranges -= 1

    def boundary(self) -> int | None:
        """The highest range no checkpoint holds (where attention meets the checkpoints), None if all are held."""
        c = self.num_ranges
        while c in self.held:
            c -= 1
        return c or None

    def _shared(self, pool: ArenaStatePool) -> list[int]:
        """Ranges another state pool holds whose slot is free in `pool` (a rider's checkpoint shares them)."""
        if len(self.states) == 1:
            return []
        return sorted(c for c in self.held if pool._is_free(pool.first_overlay + c))

    def available(self, pool: ArenaStatePool) -> int:
        return self.num_free_ranges + len(self._shared(pool))

    def pick_range(self, pool: ArenaStatePool) -> int | None:
        """The range for a new checkpoint of `pool`: one another group holds already, else the highest free one."""
        shared = self._shared(pool)
        if shared:
            return shared[0]
        heap = self._free_heap
        while heap and (self.num_busy[-heap[0]] or -heap[0] in self.held):
            heapq.heappop(heap)
        return -heap[0] if heap else None

    def hold(self, c: int) -> None:
        self.holders[c] += 1
        if self.holders[c] == 1:
            assert not self.num_busy[c] and c not in self.held, (c, "range not free")
            self.held.add(c)
            self.num_free_ranges -= 1
            for p in self.attention:
                p.cover(self.blocks_of(c))

    def release(self, c: int) -> None:
        self.holders[c] -= 1
        if self.holders[c] == 0:
            self.held.discard(c)
            for p in self.attention:
                p.uncover(self.blocks_of(c))
            self.num_free_ranges += 1
            heapq.heappush(self._free_heap, -c)

    def check_integrity(self) -> None:
        """Counters match the pools; a held range's blocks are referenced by the overlay alone (free of any name),
        and a range is held exactly while some state pool holds its slot."""
        free = 0
        for c in range(1, self.num_ranges + 1):
            blocks = self.blocks_of(c)
            holders = sum(1 for s in self.states if not s._is_free(s.first_overlay + c))
            assert holders == self.holders[c] and (c in self.held) == (holders > 0), (c, holders, self.holders[c])
            if holders:
                assert all(p.ref_cnt[b] == 1 and p.block_hash[b] is None for p in self.attention for b in blocks), c
                continue
            busy = sum(1 for p in self.attention for b in blocks if not p._is_free(b))
            assert busy == self.num_busy[c], (c, busy, self.num_busy[c])
            free += not busy
            assert busy or -c in self._free_heap, (c, "a free range is in the heap")
        assert free == self.num_free_ranges, (free, self.num_free_ranges)
        for p in self.attention:
            assert p.num_overlaid == self.k * len(self.held), p.name
            assert set(p._free) <= set(p._order), p.name
