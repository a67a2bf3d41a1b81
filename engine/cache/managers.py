"""Per-group cache managers: what differs between attention and recurrent layers lives here, not in the scheduler.

Ownership: `HybridCacheManager` (coordinator.py) owns one manager per group and calls them; each manager owns its
requests' block lists / slots in its own `BlockPool`. Single-threaded (the engine's step loop).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.cache.block_pool import BlockPool
from engine.cache.specs import CacheGroup


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class AttentionManager:
    """Paged KV blocks: a request holds ceil(tokens / block_size) blocks; full blocks are hashed and cached."""

    def __init__(self, group: CacheGroup, pool: BlockPool, block_size: int) -> None:
        self.group = group
        self.pool = pool
        self.block_size = block_size
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

    def allocate(self, req_id: str, num_tokens: int, hit: list[int]) -> list[int]:
        blocks = self.req_blocks.get(req_id)
        if blocks is None:
            self.pool.touch(hit)
            blocks = self.req_blocks[req_id] = list(hit)
            self.num_hashed[req_id] = len(hit)
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
        for i in range(self.num_hashed[req_id], n_full):
            self.pool.cache(blocks[i], block_hashes[i])
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


class RecurrentManager:
    """Recurrent state: one running slot per request; checkpoints (state after k * interval tokens) in other
    slots of the same pool, named by the attention hash chain at that boundary, evictable LRU when unreferenced.

    A checkpoint slot is referenced by the request writing it until the step that writes it has run, and by a
    request restoring from it until its copy into the running slot has run (`release_step_refs`)."""

    def __init__(self, group: CacheGroup, pool: BlockPool, block_size: int, checkpoint_interval: int) -> None:
        if checkpoint_interval % block_size:
            raise ValueError(f"checkpoint_interval {checkpoint_interval} is not a multiple of block_size {block_size}")
        self.group = group
        self.pool = pool
        self.block_size = block_size
        self.interval = checkpoint_interval
        self.running_slot: dict[str, int] = {}
        self.step_refs: list[int] = []
        self.pending: list[PendingCheckpoint] = []

    def find_hit(self, block_hashes: list[bytes], max_tokens: int) -> tuple[int, int | None]:
        """Right to left over checkpoint boundaries <= max_tokens: (tokens, checkpoint slot) or (0, None)."""
        b = (min(max_tokens, len(block_hashes) * self.block_size) // self.interval) * self.interval
        while b > 0:
            slot = self.pool.lookup(block_hashes[b // self.block_size - 1])
            if slot is not None:
                return b, slot
            b -= self.interval
        return 0, None

    def slots_needed(self, req_id: str, hit_slot: int | None) -> int:
        if req_id in self.running_slot:
            return 0
        return 1 + (1 if hit_slot is not None and self.pool.ref_cnt[hit_slot] == 0 else 0)

    def allocate(self, req_id: str, hit_slot: int | None) -> tuple[int, tuple[int, int] | None]:
        """Give a new request its running slot. Returns (slot, copy) where copy = (checkpoint slot, running slot)
        must run before the request's first forward."""
        if req_id in self.running_slot:
            return self.running_slot[req_id], None
        copy = None
        if hit_slot is not None:
            self.pool.touch([hit_slot])  # protect the checkpoint until the copy ran
            self.step_refs.append(hit_slot)
        slot = self.pool.allocate(1)[0]
        self.running_slot[req_id] = slot
        if hit_slot is not None:
            copy = (hit_slot, slot)
        return slot, copy

    def plan_checkpoints(
        self, req_id: str, block_hashes: list[bytes], start: int, end: int
    ) -> list[tuple[int, int]]:
        """Boundaries in (start, end] get a checkpoint slot if one is free and the content is not cached yet.
        Returns [(num_tokens, slot)]; best effort (skips when the pool has no free slot)."""
        out = []
        b = (start // self.interval + 1) * self.interval
        while b <= end and b // self.block_size <= len(block_hashes):
            h = block_hashes[b // self.block_size - 1]
            if self.pool.lookup(h) is None and self.pool.num_free > 0 and not self._pending_hash(h):
                slot = self.pool.allocate(1)[0]
                self.pending.append(PendingCheckpoint(req_id, b, slot, h))
                out.append((b, slot))
            b += self.interval
        return out

    def _pending_hash(self, h: bytes) -> bool:
        return any(p.block_hash == h for p in self.pending)

    def release_step_refs(self) -> None:
        """After a step ran: publish written checkpoints (cached, unreferenced) and drop restore references."""
        for p in self.pending:
            self.pool.cache(p.slot, p.block_hash)
        self.pool.free(p.slot for p in self.pending)
        self.pool.free(self.step_refs)
        self.pending, self.step_refs = [], []

    def drop_step_refs(self) -> None:
        """A step failed: its checkpoints were not (fully) written. Free their slots unpublished, drop restores."""
        self.pool.free(p.slot for p in self.pending)
        self.pool.free(self.step_refs)
        self.pending, self.step_refs = [], []

    def free(self, req_id: str) -> None:
        slot = self.running_slot.pop(req_id, None)
        if slot is not None:
            self.pool.free([slot])
