"""Per-group cache managers: what differs between attention and recurrent layers lives here, not in the scheduler.

Ownership: `HybridCacheManager` (coordinator.py) owns one manager per group and calls them; each manager owns its
requests' block lists / slots in its own `BlockPool`. Single-threaded (the engine's step loop).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.cache.block_pool import BlockPool
from engine.cache.reclaim import Reclaimer
from engine.cache.specs import CacheGroup


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class AttentionManager:
    """Paged KV blocks: a request holds ceil(tokens / block_size) blocks; full blocks are hashed and cached."""

    def __init__(self, group: CacheGroup, pool: BlockPool, block_size: int) -> None:
        self.group = group
        self.pool = pool
        self.block_size = block_size
        self.reclaimer: Reclaimer | None = None
        """Set by the coordinator when pages are evicted by policy: told about every block named."""
        self.req_blocks: dict[str, list[int]] = {}
        self.num_hashed: dict[str, int] = {}
        self.fresh_blocks: list[int] = []
        """Blocks allocated since the last drain (not prefix hits). Drained every step, zeroing on or off."""

    def find_hit(self, block_hashes: list[bytes], max_tokens: int) -> list[int]:
        """Left to right: longest run of cached full blocks, at most max_tokens tokens."""
        hit: list[int] = []
        for h in block_hashes[: max_tokens // self.block_size]:
            b = self.pool.lookup(h)
            if b is None:
                break
            hit.append(b)
        return hit

    def blocks_needed(self, req_id: str, num_tokens: int, hit: list[int]) -> int:
        """Free pool blocks an allocation for num_tokens would consume (hit blocks leaving the queue included)."""
        have = len(self.req_blocks.get(req_id, ())) or len(hit)
        new = max(0, cdiv(num_tokens, self.block_size) - have)
        return new + sum(1 for b in hit if self.pool.ref_cnt[b] == 0)

    def adopt(self, req_id: str, hit: list[int]) -> bool:
        """Give a new request its hit blocks (referenced from now on). False if it already holds blocks."""
        if req_id in self.req_blocks:
            return False
        self.pool.touch(hit)
        self.req_blocks[req_id] = list(hit)
        self.num_hashed[req_id] = len(hit)
        return True

    def new_blocks_needed(self, req_id: str, num_tokens: int) -> int:
        return max(0, cdiv(num_tokens, self.block_size) - len(self.req_blocks.get(req_id, ())))

    def allocate(self, req_id: str, num_tokens: int, hit: list[int]) -> list[int]:
        self.adopt(req_id, hit)
        blocks = self.req_blocks[req_id]
        new = cdiv(num_tokens, self.block_size) - len(blocks)
        if new > 0:
            fresh = self.pool.allocate(new)
            blocks.extend(fresh)
            self.fresh_blocks.extend(fresh)
            return fresh
        return []

    def cache_full_blocks(self, req_id: str, block_hashes: list[bytes], num_computed: int) -> None:
        blocks = self.req_blocks[req_id]
        n_full = min(num_computed // self.block_size, len(block_hashes), len(blocks))
        rc, pool = self.reclaimer, self.pool
        for i in range(self.num_hashed[req_id], n_full):
            h = block_hashes[i]
            if pool.cache(blocks[i], h):
                if rc is not None:
                    rc.on_block_cached(h, block_hashes[i - 1] if i else None, (i + 1) * self.block_size)
            elif rc is not None:
                other = pool.lookup(h)
                if other is not None and other != blocks[i] and pool.ref_cnt[other] == 0 and pool.block_hash[
                        blocks[i]] is None:
                    rc.on_acquire(pool, other)  # out of the eviction queue: it is about to become free
                    pool.rename(other, blocks[i])  # our live copy takes the name: the chain stays evictable
        self.num_hashed[req_id] = max(self.num_hashed[req_id], n_full)

    def free(self, req_id: str) -> None:
        blocks = self.req_blocks.pop(req_id, None)
        self.num_hashed.pop(req_id, None)
        if blocks:
            self.pool.free(reversed(blocks))  # tail first: the least shareable blocks are evicted first

    def take_fresh_blocks(self) -> list[int]:
        out, self.fresh_blocks = self.fresh_blocks, []
        return out


@dataclass
class PendingCheckpoint:
    req_id: str
    num_tokens: int
    slot: int
    block_hash: bytes
    rolling: bool = False
    """A request-end checkpoint written while decoding: it replaces the request's previous one when published."""


class RecurrentManager:
    """Recurrent state: one running slot per request; checkpoints (the state after a block boundary) in other slots
    of the same pool, named by the attention hash chain at that boundary, evictable when unreferenced (by the
    coordinator's Reclaimer, or LRU by the pool itself when there is none).

    `align` is the boundary granularity: block_size when checkpoints go where reuse happens, the interval for
    fixed-interval checkpoints. Which boundaries get one is the coordinator's `Admission`'s call.

    A checkpoint slot is referenced by the request writing it until the step that writes it has run, and by a
    request restoring from it until its copy into the running slot has run (`release_step_refs`)."""

    def __init__(self, group: CacheGroup, pool: BlockPool, block_size: int, align: int) -> None:
        if align <= 0 or align % block_size:
            raise ValueError(f"checkpoint_interval {align} is not a multiple of block_size {block_size}")
        self.group = group
        self.pool = pool
        self.block_size = block_size
        self.align = align
        self.interval = align  # pre-v2 name, still read by callers
        self.reclaimer: Reclaimer | None = None
        self.running_slot: dict[str, int] = {}
        self.step_refs: list[int] = []
        self.pending: list[PendingCheckpoint] = []
        self.rolling: dict[str, bytes] = {}
        """request -> hash of its published request-end checkpoint (dropped when a later one replaces it)."""
        self.superseded: dict[str, list[bytes]] = {}
        """request -> checkpoints on its own path (the one it restored, its prompt end) that its first request-end
        checkpoint supersedes (demoted in the Reclaimer unless they are branch points)."""
        self.num_admitted = 0

    def find_hit(self, block_hashes: list[bytes], max_tokens: int) -> tuple[int, int | None]:
        """Right to left over checkpoint boundaries <= max_tokens: (tokens, checkpoint slot) or (0, None)."""
        b = (min(max_tokens, len(block_hashes) * self.block_size) // self.align) * self.align
        lookup, step, bs = self.pool.cached.get, self.align, self.block_size
        while b > 0:
            slot = lookup(block_hashes[b // bs - 1])
            if slot is not None:
                return b, slot
            b -= step
        return 0, None

    def slots_needed(self, req_id: str, hit_slot: int | None) -> int:
        if req_id in self.running_slot:
            return 0
        return 1 + (1 if hit_slot is not None and self.pool.ref_cnt[hit_slot] == 0 else 0)

    def pin_hit(self, hit_slot: int) -> None:
        """Protect a checkpoint a new request restores from until its copy ran."""
        self.pool.touch([hit_slot])
        self.step_refs.append(hit_slot)

    def unpin_hit(self, hit_slot: int) -> None:
        self.step_refs.remove(hit_slot)
        self.pool.free([hit_slot])

    def allocate(self, req_id: str, hit_slot: int | None, pinned: bool = False) -> tuple[int, tuple[int, int] | None]:
        """Give a new request its running slot. Returns (slot, copy) where copy = (checkpoint slot, running slot)
        must run before the request's first forward. `pinned`: the caller already ran `pin_hit`."""
        if req_id in self.running_slot:
            return self.running_slot[req_id], None
        if hit_slot is not None and not pinned:
            self.pin_hit(hit_slot)
        slot = self.pool.allocate(1)[0]
        self.running_slot[req_id] = slot
        return slot, ((hit_slot, slot) if hit_slot is not None else None)

    def interval_boundaries(self, start: int, end: int) -> list[int]:
        first = (start // self.align + 1) * self.align
        return list(range(first, end + 1, self.align))

    def plan(self, req_id: str, block_hashes: list[bytes], boundaries: list[int], rolling: int | None = None
             ) -> list[tuple[int, int]]:
        """Reserve a slot for each boundary (and the rolling request-end one) whose content is not cached or
        pending yet. Returns [(num_tokens, slot)]; best effort: a boundary is skipped when no room can be made."""
        out = []
        todo = [(b, False) for b in boundaries] + ([(rolling, True)] if rolling is not None else [])
        for b, is_rolling in todo:
            if b // self.block_size > len(block_hashes):
                break
            h = block_hashes[b // self.block_size - 1]
            if self.pool.lookup(h) is not None or self._pending_hash(h):
                continue
            if not self._room():
                break
            slot = self.pool.allocate(1)[0]
            self.pending.append(PendingCheckpoint(req_id, b, slot, h, is_rolling))
            out.append((b, slot))
        return out

    def _room(self) -> bool:
        if self.reclaimer is not None:
            return self.reclaimer.make_room([(self.pool, 1)])
        return self.pool.num_free > 0

    def plan_checkpoints(
        self, req_id: str, block_hashes: list[bytes], start: int, end: int
    ) -> list[tuple[int, int]]:
        """Fixed-interval planning: boundaries in (start, end] at multiples of the interval."""
        return self.plan(req_id, block_hashes, self.interval_boundaries(start, end))

    def _pending_hash(self, h: bytes) -> bool:
        return any(p.block_hash == h for p in self.pending)

    def release_step_refs(self) -> None:
        """After a step ran: publish written checkpoints (cached, unreferenced) and drop restore references."""
        rc = self.reclaimer
        for p in self.pending:
            if not self.pool.cache(p.slot, p.block_hash):
                continue
            self.num_admitted += 1
            if rc is not None:
                rc.on_state_cached(p.block_hash, p.num_tokens)
            if p.rolling:
                self._replace_rolling(p.req_id, p.block_hash)
        self.drop_step_refs()  # the published ones stay cached: freeing only drops this step's references

    def drop_step_refs(self) -> None:
        """A step failed: its checkpoints were not (fully) written. Free their slots unpublished, drop restores
        (`EngineCore.step` -> `HybridCacheManager.on_step_failed`; tests/unit/test_pd_handoff.py)."""
        self.pool.free(p.slot for p in self.pending)
        self.pool.free(self.step_refs)
        self.pending, self.step_refs = [], []

    def _replace_rolling(self, req_id: str, h: bytes) -> None:
        prev = self.rolling.get(req_id)
        self.rolling[req_id] = h
        if self.reclaimer is not None:
            for old in self.superseded.pop(req_id, ()):
                self.reclaimer.demote(old)
        slot = self.pool.lookup(prev) if prev is not None else None
        if slot is None or self.pool.ref_cnt[slot] != 0:
            return
        if self.reclaimer is not None:
            self.reclaimer.evict(self.pool, slot, count=False)
        else:
            self.pool.uncache(slot)

    def free(self, req_id: str) -> None:
        self.rolling.pop(req_id, None)
        self.superseded.pop(req_id, None)
        slot = self.running_slot.pop(req_id, None)
        if slot is not None:
            self.pool.free([slot])
