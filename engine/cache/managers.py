"""Per-group cache managers: what differs between attention and recurrent layers lives here, not in the scheduler.

Both kinds answer the same calls (`find_hit_tokens`, `hit_pages`, `holds`, `new_pages_needed`, `pin_hit`,
`unpin_hit`, `allocate`, `free`, `req_pages`, `disown`), so the coordinator loops over a list of them and never asks
which kind it holds; a model may have several groups of each kind, each with its own pool and ids.

Leaders and riders: all pages are named by the same chained block hashes. The first attention group is the *chain*
(its cached blocks are the nodes of the cache tree, tree.py); the first recurrent group leads the checkpoints.
Every other group *rides along*: it names a page `h` only while its leader holds `h` (`leader`), and the tree
evicts it together with its leader's page, so a rider that lost a page only shortens hits.

Ownership: `HybridCacheManager` owns one manager per group; each owns its requests' block lists / slots in its own
`BlockPool`. Single-threaded (the engine's step loop).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hybridpd.engine.cache.block_pool import BlockPool
from hybridpd.engine.cache.specs import CacheGroup
from hybridpd.engine.cache.tree import STATE, CacheTree


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class AttentionManager:
    """Paged KV blocks: a request holds ceil(tokens / block_size) blocks; full blocks are hashed and cached."""

    def __init__(self, group: CacheGroup, pool: BlockPool, block_size: int, leader: BlockPool | None = None) -> None:
        self.group = group
        self.pool = pool
        self.block_size = block_size
        self.leader = leader
        """The chain's pool when this group rides along (a block is named h only while the chain holds h)."""
        self.tree: CacheTree | None = None
        """Set on the chain only: told about every block named."""
        self.req_blocks: dict[str, list[int]] = {}
        self.num_hashed: dict[str, int] = {}
        self.fresh_blocks: list[int] = []
        """Blocks allocated since the last drain (not prefix hits). Drained every step, zeroing on or off."""

    def find_hit_tokens(self, block_hashes: list[bytes], max_tokens: int) -> int:
        """Left to right: the longest run of cached full blocks, at most max_tokens tokens."""
        n, cached = 0, self.pool.cached
        for h in block_hashes[: max_tokens // self.block_size]:
            if h not in cached:
                break
            n += 1
        return n * self.block_size

    def hit_pages(self, block_hashes: list[bytes], num_tokens: int) -> tuple[int, ...]:
        """The cached blocks serving exactly `num_tokens` (a length `find_hit_tokens` returned)."""
        out = tuple(map(self.pool.cached.get, block_hashes[: num_tokens // self.block_size]))
        assert None not in out
        return out  # type: ignore[return-value]

    def holds(self, req_id: str) -> bool:
        return req_id in self.req_blocks

    def req_pages(self, req_id: str) -> tuple[int, ...]:
        return tuple(self.req_blocks.get(req_id, ()))

    def disown(self, req_id: str, holder: str) -> None:
        """Move the request's blocks to `holder` (a quarantine key): they stay in use, the request holds nothing."""
        if req_id in self.req_blocks:
            self.req_blocks[holder] = self.req_blocks.pop(req_id)
            self.num_hashed[holder] = self.num_hashed.pop(req_id)

    def pin_hit(self, req_id: str, hit: Sequence[int]) -> bool:
        """Give a new request its hit blocks (referenced from now on). False if it already holds blocks."""
        if req_id in self.req_blocks:
            return False
        self.pool.touch(hit)
        self.req_blocks[req_id] = list(hit)
        self.num_hashed[req_id] = len(hit)
        return True

    def unpin_hit(self, req_id: str, hit: Sequence[int]) -> None:
        self.free(req_id)

    def new_pages_needed(self, req_id: str, num_tokens: int) -> int:
        new = -(-num_tokens // self.block_size) - len(self.req_blocks.get(req_id, ()))  # cdiv, inlined
        return new if new > 0 else 0

    def allocate(self, req_id: str, num_tokens: int, hit: Sequence[int]) -> None:
        """Cover num_tokens (a new request takes its pinned hit blocks); the tree made room."""
        blocks = self.req_blocks.get(req_id)
        if blocks is None:
            self.pin_hit(req_id, hit)
            blocks = self.req_blocks[req_id]
        new = cdiv(num_tokens, self.block_size) - len(blocks)
        if new > 0:
            fresh = self.pool.allocate(new)
            blocks.extend(fresh)
            self.fresh_blocks.extend(fresh)

    def cache_full_blocks(self, req_id: str, block_hashes: list[bytes], num_computed: int) -> None:
        """Name the request's blocks that filled since the last call (riders: only what the chain holds)."""
        done = self.num_hashed[req_id]
        blocks = self.req_blocks[req_id]
        n_full = min(num_computed // self.block_size, len(block_hashes), len(blocks))
        if n_full <= done:
            return  # no block filled since the last call (most decode steps)
        tree, pool, leader, bs = self.tree, self.pool, self.leader, self.block_size
        name = pool.cache
        for i in range(done, n_full):
            h = block_hashes[i]
            if leader is not None and h not in leader.cached:
                continue  # riders name only what the chain holds (the chain was cached first)
            if name(blocks[i], h):
                if tree is not None:
                    tree.on_block_cached(h, block_hashes[i - 1] if i else None, (i + 1) * bs)
                continue
            other = pool.cached.get(h)  # a recomputed block: our live copy takes the name, the old one is freed
            if (
                other is not None
                and other != blocks[i]
                and not pool.ref_cnt[other]
                and pool.block_hash[blocks[i]] is None
            ):
                if tree is not None:
                    tree.on_acquire(pool, other)  # out of the eviction queue: it is about to become free
                pool.rename(other, blocks[i])
        self.num_hashed[req_id] = n_full

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
    """Recurrent state: one running slot per request; checkpoints (the state after a block boundary, named by the
    chain's hash there) in other slots of the same pool, evictable when unreferenced.

    `align` is the boundary granularity (block_size, or a fixed interval). The coordinator decides which boundaries
    get one (`Admission`) and reserves each in every recurrent group at once (`reserve`). A checkpoint slot is
    referenced by the request writing it until its step ran, and by a request restoring from it until its copy into
    the running slot ran (`release_step_refs`)."""

    def __init__(
        self, group: CacheGroup, pool: BlockPool, block_size: int, align: int, leader: BlockPool | None = None
    ) -> None:
        if align <= 0 or align % block_size:
            raise ValueError(f"checkpoint_interval {align} is not a multiple of block_size {block_size}")
        self.group = group
        self.pool = pool
        self.block_size = block_size
        self.align = align
        self.leader = leader
        """The lead recurrent group's pool when this group rides along (it publishes h only while the lead has h)."""
        self.tree: CacheTree | None = None
        """Set on the lead group only (riders follow their lead's page in the tree)."""
        self.running_slot: dict[str, int] = {}
        self.step_refs: list[int] = []
        self.pending: list[PendingCheckpoint] = []
        self.copies: list[tuple[int, int]] = []
        """(checkpoint slot, running slot) restores queued by `allocate`, drained by the coordinator every step."""
        self.rolling: dict[str, bytes] = {}
        """request -> hash of its published request-end checkpoint (dropped when a later one replaces it)."""
        self.superseded: dict[str, list[bytes]] = {}
        """request -> checkpoints on its own path (the one it restored, its prompt end) that its first request-end
        checkpoint supersedes (demoted in the tree unless they are branch points)."""
        self.num_admitted = 0

    def find_hit_tokens(self, block_hashes: list[bytes], max_tokens: int) -> int:
        """Right to left over checkpoint boundaries <= max_tokens: the deepest one cached (0: none)."""
        b = (min(max_tokens, len(block_hashes) * self.block_size) // self.align) * self.align
        cached, step, bs = self.pool.cached, self.align, self.block_size
        while b > 0 and block_hashes[b // bs - 1] not in cached:
            b -= step
        return max(b, 0)

    def hit_pages(self, block_hashes: list[bytes], num_tokens: int) -> tuple[int, ...]:
        return (self.pool.cached[block_hashes[num_tokens // self.block_size - 1]],) if num_tokens > 0 else ()

    def holds(self, req_id: str) -> bool:
        return req_id in self.running_slot

    def req_pages(self, req_id: str) -> tuple[int, ...]:
        slot = self.running_slot.get(req_id)
        return () if slot is None else (slot,)

    def disown(self, req_id: str, holder: str) -> None:
        self.rolling.pop(req_id, None)
        self.superseded.pop(req_id, None)
        if req_id in self.running_slot:
            self.running_slot[holder] = self.running_slot.pop(req_id)

    def new_pages_needed(self, req_id: str, num_tokens: int) -> int:
        return 0 if req_id in self.running_slot else 1

    def pin_hit(self, req_id: str, hit: Sequence[int]) -> bool:
        """Protect the checkpoint a new request restores from until its copy ran."""
        if req_id in self.running_slot or not hit:
            return False
        self.pool.touch(hit)
        self.step_refs.extend(hit)
        return True

    def unpin_hit(self, req_id: str, hit: Sequence[int]) -> None:
        for s in hit:
            self.step_refs.remove(s)
        self.pool.free(hit)

    def allocate(self, req_id: str, num_tokens: int, hit: Sequence[int]) -> None:
        """A new request's running slot; with a (pinned) hit, queue the copy checkpoint -> running slot."""
        if req_id not in self.running_slot:
            slot = self.running_slot[req_id] = self.pool.allocate(1)[0]
            if hit:
                self.copies.append((hit[0], slot))

    def take_copies(self) -> list[tuple[int, int]]:
        out, self.copies = self.copies, []
        return out

    def is_planned(self, h: bytes) -> bool:
        """Cached already, or to be written by a step in flight."""
        return h in self.pool.cached or any(p.block_hash == h for p in self.pending)

    def reserve(self, req_id: str, num_tokens: int, h: bytes, rolling: bool = False) -> int:
        """A slot for the checkpoint after `num_tokens` tokens (named `h`), written this step (room was made)."""
        slot = self.pool.allocate_checkpoint(1)[0]
        self.pending.append(PendingCheckpoint(req_id, num_tokens, slot, h, rolling))
        return slot

    def release_step_refs(self) -> None:
        """After a step ran: publish written checkpoints (cached, unreferenced) and drop restore references."""
        for p in self.pending:
            if self.publish(p.slot, p.block_hash, p.num_tokens) and p.rolling:
                self._replace_rolling(p.req_id, p.block_hash)
        self.drop_step_refs()  # the published ones stay cached: freeing only drops this step's references

    def publish(self, slot: int, h: bytes, num_tokens: int) -> bool:
        """Name a written checkpoint `h` (a rider only where its lead group did: alone it serves no hit); True if
        it is cached now."""
        if (self.leader is not None and h not in self.leader.cached) or not self.pool.cache(slot, h):
            return False
        self.num_admitted += 1
        if self.tree is not None:
            self.tree.on_state_cached(h, num_tokens)
        return True

    def drop_step_refs(self) -> None:
        """A step failed: its checkpoints were not (fully) written. Free their slots unpublished, drop restores."""
        self.pool.free(p.slot for p in self.pending)
        self.pool.free(self.step_refs)
        self.pending, self.step_refs = [], []

    def _replace_rolling(self, req_id: str, h: bytes) -> None:
        prev = self.rolling.get(req_id)
        self.rolling[req_id] = h
        if self.tree is not None:
            for old in self.superseded.pop(req_id, ()):
                self.tree.demote(old)
        slot = self.pool.lookup(prev) if prev is not None else None
        if slot is None or self.pool.ref_cnt[slot] != 0:
            return
        if self.tree is not None:
            self.tree.evict(STATE, slot, count=False)
        else:
            self.pool.evict(slot, count=False)

    def free(self, req_id: str) -> None:
        self.rolling.pop(req_id, None)
        self.superseded.pop(req_id, None)
        slot = self.running_slot.pop(req_id, None)
        if slot is not None:
            self.pool.free([slot])


GroupManager = AttentionManager | RecurrentManager
"""What the coordinator loops over."""
