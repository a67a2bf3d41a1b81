"""Checkpoint slots that share memory with attention blocks (arena.py): the pools, and the rule that keeps them apart.

    attention blocks   0 1 .. k-1 | k .. 2k-1 | 2k .. 3k-1 | ...      range c = blocks [c*k, (c+1)*k)
    state slots        0 1 .. S F | F+1       | F+2        | ...      checkpoint slot F + c covers range c

A held checkpoint slot (pending, cached, pinned or reserved) and a held attention block (in use or cached) never
share memory: a checkpoint slot is taken only over a *free range* (all k blocks free in every attention pool),
whose blocks the overlay then references (`cover`) until the slot is free again (`uncover`); the budget charges a
checkpoint the k blocks it covers. Attention blocks are handed out clustered (outside every range first, then the
range in use, then ranges that hold a referenced block, free ranges last), so ranges with no referenced block, the
only ones whose cached blocks the tree (`make_room`) may evict for a checkpoint, stay as many as they can. Running
slots (1 .. S) are reserved memory. Several groups: block j (slot s) is one arena page of every attention (state)
pool; range c is held while any state pool holds slot F + c, and a rider takes a range its leader holds already.

Ownership: the coordinator builds the pools and one `Overlay`; the pools update its counters; the tree asks it for
ranges. Single-threaded (the step loop). Tensor-free.
"""

from __future__ import annotations

import heapq
import itertools

from hybridpd.engine.cache.arena import ArenaLayout
from hybridpd.engine.cache.block_pool import BlockPool, PoolExhaustedError

PICK_SAMPLE = 32
"""Ranges with free blocks an allocation compares (the best of a sample: a full scan cost as much as the rest of
the cache manager on a workload with no reuse)."""


class ArenaAttentionPool(BlockPool):
    """Attention blocks of the arena: free blocks are kept per range and handed out clustered (`_take_free`)."""

    def __init__(self, num_blocks: int, name: str = "pool", page_bytes: int = 0) -> None:
        super().__init__(num_blocks, name, page_bytes)
        self.overlay: Overlay | None = None
        self._plain_sets: list[set[int]] = []
        """Free blocks per range (index 0: blocks outside every range), filled by `bind`."""
        self._with_plain: set[int] = set()
        """Ranges (>= 1) with a free block."""
        self._last = 0
        self._score_base = 2
        self.num_overlaid = 0
        """Blocks referenced by the overlay (covered by a held checkpoint slot)."""

    def bind(self, overlay: Overlay) -> None:
        self.overlay = overlay
        self._score_base = overlay.num_ranges + overlay.full + 2  # > every range index and every nref
        self._plain_sets = [set() for _ in range(overlay.num_ranges + 1)]
        for b in reversed(self._free):
            c = overlay.range_ids[b]
            self._plain_sets[c].add(b)
            if c:
                self._with_plain.add(c)
        self._free.clear()

    def _take_free(self, n: int) -> list[int]:
        """Free blocks, clustered (see the module docstring)."""
        out: list[int] = []
        window: list[tuple[int, int]] = []
        rest: list[int] = []
        while len(out) < n:
            c = self._pick_range(window, rest, n - len(out))
            plain = self._plain_sets[c]
            m = min(len(plain), n - len(out))
            out += [plain.pop() for _ in range(m)]
            if c:
                self._referenced_free(c, m)
        return out

    def _referenced_free(self, c: int, m: int) -> None:
        """m free blocks of range c (>= 1) got their first reference (they left `_plain_sets[c]`)."""
        ov = self.overlay
        assert ov is not None
        ov.nref[c] += m
        ov.unreferenced.discard(c)
        if ov.nplain[c] == ov.full:
            ov.num_free_ranges -= 1
        ov.nplain[c] -= m
        if not self._plain_sets[c]:
            self._with_plain.discard(c)

    def _pick_range(self, window: list[tuple[int, int]], rest: list[int], want: int) -> int:
        """Range 0 while it has free blocks; else the range in use; else, of the first PICK_SAMPLE ranges with free
        blocks, the best by (has a referenced block, wholly free last, more referenced blocks, higher range) as one
        integer to maximise. Kept over one `_take_free`, where ranges only leave the set (the one taken, emptied) and
        no other range's counts change: `window`, a heap of (-score, range) of the first PICK_SAMPLE in the set's
        order, and `rest`, the next ones, last first (scored when they enter the window)."""
        sets = self._plain_sets
        if sets[0]:
            return 0
        ov = self.overlay
        assert ov is not None
        nref, free, full = ov.nref, ov.nplain, ov.full
        last = self._last
        if last and sets[last] and nref[last]:
            return last
        m = self._score_base
        score = lambda c: -((m + nref[c]) * m + c if nref[c] else (c if free[c] == full else m + c))  # noqa: E731
        if not window:  # (PICK_SAMPLE + want ranges: each pick empties one, at most `want` picks are left)
            ranges = list(itertools.islice(self._with_plain, PICK_SAMPLE + want))
            window[:] = [(score(c), c) for c in ranges[:PICK_SAMPLE]]
            heapq.heapify(window)
            rest[:] = ranges[: PICK_SAMPLE - 1 : -1]
        best = heapq.heappop(window)[1] if window else 0
        if rest:
            c = rest.pop()
            heapq.heappush(window, (score(c), c))
        self._last = best
        return best

    def _on_ref(self, block_id: int, was_plain: bool) -> None:
        ov = self.overlay
        assert ov is not None
        c = ov.range_ids[block_id]
        if was_plain:
            self._plain_sets[c].discard(block_id)
            if c:
                self._referenced_free(c, 1)
        elif c:  # a cached block, referenced again
            ov.nref[c] += 1
            ov.unreferenced.discard(c)

    def _on_unref(self, block_id: int, now_plain: bool) -> None:
        ov = self.overlay
        assert ov is not None
        c = ov.range_ids[block_id]
        if c:
            ov.nref[c] -= 1
            if not ov.nref[c]:
                ov.unreferenced.add(c)
            if not now_plain:
                ov.clock += 1
                ov.age[c] = ov.clock
                return
        elif not now_plain:
            return
        self._on_plain(block_id)

    def _on_plain(self, block_id: int) -> None:
        ov = self.overlay
        c = ov.range_ids[block_id]  # type: ignore[union-attr]
        self._plain_sets[c].add(block_id)
        if c:
            self._with_plain.add(c)
            if ov.nplain[c] + 1 < ov.full:  # type: ignore[union-attr]
                ov.nplain[c] += 1  # type: ignore[union-attr]
            else:
                ov.plain_in(c)  # type: ignore[union-attr]  # (the range is wholly free now)

    def _is_free(self, block_id: int) -> bool:
        c = self.overlay.range_ids[block_id] if self.overlay is not None else 0
        return block_id in self._plain_sets[c] if self._plain_sets else False

    def cover(self, c: int) -> None:
        """The overlay takes free range c (a checkpoint slot over it is held): its blocks are referenced by it."""
        ov = self.overlay
        assert ov is not None
        blocks = ov.blocks_of(c)
        self.ref_cnt[blocks.start : blocks.stop] = [1] * ov.k
        self.num_plain -= ov.k
        self.num_overlaid += ov.k
        self._plain_sets[c].clear()
        self._with_plain.discard(c)

    def uncover(self, c: int) -> None:
        """The overlay gives range c back: its blocks are free again."""
        ov = self.overlay
        assert ov is not None
        blocks = ov.blocks_of(c)
        self.ref_cnt[blocks.start : blocks.stop] = [0] * ov.k
        self.num_plain += ov.k
        self.num_overlaid -= ov.k
        self._plain_sets[c].update(blocks)
        self._with_plain.add(c)

    @property
    def num_own(self) -> int:
        return self.num_overlaid

    def stats(self) -> dict[str, int]:
        return {**super().stats(), "overlaid": self.num_overlaid}


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

    def available(self, checkpoint: bool) -> int:
        """Ids an allocation can take now without evicting (`checkpoint`: for `allocate_checkpoint`)."""
        assert self.overlay is not None
        overlay = self.overlay.available(self)
        return overlay if checkpoint else overlay + len(self._running_free)

    @property
    def num_own(self) -> int:
        return self._pinned

    def stats(self) -> dict[str, int]:
        return {**super().stats(), "pinned": self._pinned}

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
            self.overlay.hold(self, s - self.first_overlay)  # type: ignore[union-attr]
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
            self.overlay.release(self, slot - self.first_overlay)

    def _is_free(self, slot: int) -> bool:
        if slot < self.first_overlay:
            return slot in self._running_free
        return slot > self.first_overlay and not self.ref_cnt[slot] and self.block_hash[slot] is None

    def check_integrity(self) -> None:
        super().check_integrity()
        held = sum(
            1
            for s in range(self.first_overlay + 1, self.num_blocks)
            if self.ref_cnt[s] or self.block_hash[s] is not None
        )
        assert held == self.num_overlay_held, (self.name, held, self.num_overlay_held)


class Overlay:
    """Per-range counters over the attention pools and the state pools' holds (see the module docstring)."""

    def __init__(self, arena: ArenaLayout, attention: list[ArenaAttentionPool], states: list[ArenaStatePool]) -> None:
        self.k = arena.blocks_per_slot
        self.num_ranges = arena.checkpoint_slots
        """C: ranges 1 .. C (range 0 holds the null block and is never a checkpoint's)."""
        self.attention = attention
        self.states = states
        self.full = self.k * len(attention)
        """Free blocks of a whole range (every attention pool)."""
        n = self.num_ranges + 1
        self.nplain = [self.full] * n
        self.nref = [0] * n
        self.unreferenced = set(range(1, n))
        """Ranges with no referenced block (nref 0): the ones whose cached blocks may be evicted."""
        self.holders = [0] * n
        self.held: set[int] = set()
        self.age = [-1] * n
        """When a cached block of each range was last released (a counter; -1: none since it was wholly free):
        the longest unused ranges go first among equals (`CacheTree._pick_range`)."""
        self.clock = 0
        self._free_heap = list(range(1, n))
        self.num_free_ranges = self.num_ranges
        self.num_range_evictions = 0
        """Ranges whose cached blocks were evicted to make room for a checkpoint."""
        self.range_ids = [c for c in range(n) for _ in range(self.k)]
        """Attention block -> its range (0: outside every range)."""
        self.range_ids += [0] * (max(p.num_blocks for p in attention) - len(self.range_ids))
        for p in attention:
            p.bind(self)
        for s in states:
            s.overlay = self

    def blocks_of(self, c: int) -> range:
        return range(c * self.k, (c + 1) * self.k)

    def plain_in(self, c: int, n: int = 1) -> None:
        """n blocks of range c became free."""
        self.nplain[c] += n
        if self.nplain[c] == self.full:
            self.num_free_ranges += 1
            self.age[c] = -1
            heapq.heappush(self._free_heap, c)

    def _shared(self, pool: ArenaStatePool) -> list[int]:
        """Ranges another state pool holds whose slot is free in `pool` (a rider's checkpoint shares them)."""
        if len(self.states) == 1:
            return []
        first = pool.first_overlay
        return sorted(c for c in self.held if not pool.ref_cnt[first + c] and pool.block_hash[first + c] is None)

    def available(self, pool: ArenaStatePool) -> int:
        return self.num_free_ranges + len(self._shared(pool))

    def pick_range(self, pool: ArenaStatePool) -> int | None:
        """The range for a new checkpoint of `pool`: one another group holds already, else the lowest free one."""
        shared = self._shared(pool)
        if shared:
            return shared[0]
        heap = self._free_heap
        while heap:
            c = heap[0]
            if self.nplain[c] == self.full:
                return c  # stays in the heap: it is skipped as stale once held
            heapq.heappop(heap)
        return None

    def hold(self, pool: ArenaStatePool, c: int) -> None:
        self.holders[c] += 1
        if self.holders[c] == 1:
            assert self.nplain[c] == self.full, (pool.name, c, "range not free")
            self.held.add(c)
            self.num_free_ranges -= 1
            self.nplain[c] = 0
            for p in self.attention:
                p.cover(c)
            self.nref[c] = self.full
            self.unreferenced.discard(c)

    def release(self, pool: ArenaStatePool, c: int) -> None:
        self.holders[c] -= 1
        if self.holders[c] == 0:
            self.held.discard(c)
            for p in self.attention:
                p.uncover(c)
            self.nref[c] = 0
            self.unreferenced.add(c)
            self.plain_in(c, self.full)

    def check_integrity(self) -> None:
        """Counters match the pools; a held range's blocks are referenced by the overlay alone (free of any
        name), and a range is held exactly while some state pool holds its slot."""
        for c in range(1, self.num_ranges + 1):
            blocks = self.blocks_of(c)
            plain = sum(1 for p in self.attention for b in blocks if not p.ref_cnt[b] and p.block_hash[b] is None)
            ref = sum(1 for p in self.attention for b in blocks if p.ref_cnt[b])
            assert (plain, ref) == (self.nplain[c], self.nref[c]), (c, plain, ref, self.nplain[c], self.nref[c])
            holders = sum(
                1
                for s in self.states
                if s.ref_cnt[s.first_overlay + c] or s.block_hash[s.first_overlay + c] is not None
            )
            assert holders == self.holders[c] and (c in self.held) == (holders > 0), (c, holders, self.holders[c])
            if holders:
                for p in self.attention:
                    assert all(p.ref_cnt[b] == 1 and p.block_hash[b] is None for b in blocks), (p.name, c)
        assert self.unreferenced == {c for c in range(1, self.num_ranges + 1) if not self.nref[c]}, "unreferenced"
        assert self.num_free_ranges == sum(1 for c in range(1, self.num_ranges + 1) if self.nplain[c] == self.full)
        for p in self.attention:
            assert p.num_overlaid == self.k * len(self.held), p.name
            assert p._with_plain == {c for c in range(1, self.num_ranges + 1) if p._plain_sets[c]}, p.name
