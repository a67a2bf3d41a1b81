"""The hybrid cache manager: one manager per group, reconciled into one answer per request.

Hit search: attention left to right over full blocks; recurrent right to left over checkpoint boundaries within
the attention hit; the hit is the longest length every group agrees on, capped at N-1 (a request must compute at
least its last token to sample). Only real blocks count.

Ownership: the scheduler calls this (single thread). Tensor-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.cache.block_pool import BlockPool
from engine.cache.hashing import extend_block_hashes, extra_keys
from engine.cache.managers import AttentionManager, RecurrentManager
from engine.cache.specs import PAD_SLOT_ID, CacheGroup
from engine.request import Request


@dataclass
class PrefixHit:
    num_tokens: int = 0
    attention_blocks: list[int] = field(default_factory=list)
    checkpoint_slot: int | None = None
    group_hits: dict[str, int] = field(default_factory=dict)
    """What each group alone could serve (for per-group counters)."""


@dataclass
class TransferAllocation:
    local_hit_tokens: int
    first_block_index: int
    """Index (in the request's block table) of the first block the transfer fills."""
    block_ids: list[int]
    """Destination blocks, in order, for block indices first_block_index ..."""
    state_slot: int


@dataclass
class GroupCounters:
    queries: int = 0
    hits: int = 0


@dataclass(frozen=True)
class PoolLayout:
    """Discovered at start-up from the planner: blocks per attention pool, slots per state pool."""

    attention_blocks: int
    state_slots: int
    checkpoint_interval: int
    block_size: int


class HybridCacheManager:
    def __init__(self, groups: list[CacheGroup], layout: PoolLayout, enable_prefix_caching: bool = True) -> None:
        attn = [g for g in groups if g.is_attention]
        rec = [g for g in groups if not g.is_attention]
        if len(attn) > 1 or len(rec) > 1:
            raise ValueError("hybridpd supports at most one attention group and one recurrent group per model")
        self.groups = groups
        self.block_size = layout.block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.attention: AttentionManager | None = None
        self.recurrent: RecurrentManager | None = None
        self.pools: dict[int, BlockPool] = {}
        if attn:
            pool = BlockPool(layout.attention_blocks, f"group{attn[0].group_id}:attention")
            self.pools[attn[0].group_id] = pool
            self.attention = AttentionManager(attn[0], pool, layout.block_size)
        if rec:
            pool = BlockPool(layout.state_slots, f"group{rec[0].group_id}:{rec[0].kind}")
            self.pools[rec[0].group_id] = pool
            self.recurrent = RecurrentManager(rec[0], pool, layout.block_size, layout.checkpoint_interval)
        self.counters: dict[str, GroupCounters] = {g.kind: GroupCounters() for g in groups}
        self.external_counters: dict[str, GroupCounters] = {g.kind: GroupCounters() for g in groups}
        self._pending_copies: list[tuple[int, int]] = []

    # -- hashing -------------------------------------------------------------------------------------------------
    def update_hashes(self, req: Request) -> None:
        if req.num_tokens // self.block_size <= len(req.block_hashes):
            return  # no newly full block: skip building all_token_ids (a copy of every token, each call)
        extend_block_hashes(req.block_hashes, req.all_token_ids, self.block_size, extra_keys(req.cache_salt))

    # -- hit search ----------------------------------------------------------------------------------------------
    def find_prefix_hit(self, req: Request, max_tokens: int | None = None, count: bool = True) -> PrefixHit:
        """Longest prefix every group holds, capped at N-1 (or max_tokens).

        Counters: every group's queries grow by the request's tokens; each group's hits by what that group could
        serve on its own (attention: its left-to-right run; recurrent: its checkpoint within that run), so a
        group that never hits (seed 004) shows up as such. The request uses the agreed (shortest) length."""
        if max_tokens is None:
            max_tokens = max(0, min(req.num_tokens, req.target_tokens) - 1)
        if not self.enable_prefix_caching:
            return PrefixHit()
        self.update_hashes(req)
        hit = PrefixHit(num_tokens=max_tokens)
        blocks: list[int] = []
        if self.attention is not None:
            blocks = self.attention.find_hit(req.block_hashes, max_tokens)
            hit.num_tokens = len(blocks) * self.block_size
            hit.group_hits[self.attention.group.kind] = hit.num_tokens
        if self.recurrent is not None:
            hit.num_tokens, hit.checkpoint_slot = self.recurrent.find_hit(req.block_hashes, hit.num_tokens)
            hit.group_hits[self.recurrent.group.kind] = hit.num_tokens
        hit.attention_blocks = blocks[: hit.num_tokens // self.block_size]
        if count:
            self.count_hit(req, hit)
        return hit

    def count_hit(self, req: Request, hit: PrefixHit) -> None:
        for kind, c in self.counters.items():
            c.queries += req.num_tokens
            c.hits += hit.group_hits.get(kind, 0)

    # -- allocation ----------------------------------------------------------------------------------------------
    def can_allocate(self, req: Request, num_tokens: int, hit: PrefixHit | None = None) -> bool:
        hit = hit or PrefixHit()
        if self.attention is not None:
            need = self.attention.blocks_needed(req.request_id, num_tokens, hit.attention_blocks)
            if need > self.attention.pool.num_free:
                return False
        if self.recurrent is not None:
            if self.recurrent.slots_needed(req.request_id, hit.checkpoint_slot) > self.recurrent.pool.num_free:
                return False
        return True

    def allocate(self, req: Request, num_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Make the request's caches cover `num_tokens` tokens. New requests take `hit` (blocks + checkpoint).
        Returns False (changing nothing) when the pools cannot cover it."""
        if not self.can_allocate(req, num_tokens, hit):
            return False
        hit = hit or PrefixHit()
        if self.attention is not None:
            self.attention.allocate(req.request_id, num_tokens, hit.attention_blocks)
        if self.recurrent is not None:
            _, copy = self.recurrent.allocate(req.request_id, hit.checkpoint_slot)
            if copy is not None:
                self._pending_copies.append(copy)
        return True

    def plan_checkpoints(self, req: Request, start: int, end: int) -> list[tuple[int, int]]:
        if self.recurrent is None or not self.enable_prefix_caching:
            return []
        self.update_hashes(req)
        return self.recurrent.plan_checkpoints(req.request_id, req.block_hashes, start, end)

    def take_state_copies(self) -> list[tuple[int, int]]:
        out, self._pending_copies = self._pending_copies, []
        return out

    def take_fresh_blocks(self) -> list[int]:
        return self.attention.take_fresh_blocks() if self.attention is not None else []

    # -- after a step --------------------------------------------------------------------------------------------
    def on_step_done(self, computed: list[Request]) -> None:
        """Hash the blocks that filled this step and publish the checkpoints it wrote."""
        if self.enable_prefix_caching and self.attention is not None:
            for req in computed:
                if req.request_id in self.attention.req_blocks:
                    self.update_hashes(req)
                    self.attention.cache_full_blocks(req.request_id, req.block_hashes, req.num_computed_tokens)
        if self.recurrent is not None:
            self.recurrent.release_step_refs()

    def on_step_failed(self) -> None:
        """The step's forward raised: nothing it wrote is published (its requests are ended by the caller)."""
        if self.recurrent is not None:
            self.recurrent.drop_step_refs()

    def free(self, req: Request) -> None:
        if self.attention is not None:
            self.attention.free(req.request_id)
        if self.recurrent is not None:
            self.recurrent.free(req.request_id)

    # -- disaggregation (consumer side) ---------------------------------------------------------------------------
    def allocate_for_transfer(self, req: Request, num_external_tokens: int) -> TransferAllocation | None:
        """Hold caches for a request whose first `num_external_tokens` tokens arrive from a producer.

        The local prefix hit (attention blocks only: the running state comes from the producer, so no checkpoint
        copy is queued) is kept; blocks for the rest are allocated and are *not* zeroed (the transfer overwrites
        them; the caller zeroes the unfilled tail of the last one). Returns None when the pools cannot hold it."""
        hit = self.find_prefix_hit(req, max_tokens=num_external_tokens, count=False)
        hit.checkpoint_slot = None
        if not self.allocate(req, num_external_tokens, hit):
            return None
        self.count_hit(req, hit)
        bs = self.block_size
        first = hit.num_tokens // bs
        blocks = self.block_ids(req.request_id)
        pulled = blocks[first:]
        if self.attention is not None and pulled:
            keep = set(pulled)
            self.attention.fresh_blocks = [b for b in self.attention.fresh_blocks if b not in keep]
        return TransferAllocation(
            local_hit_tokens=hit.num_tokens, first_block_index=first, block_ids=pulled,
            state_slot=self.state_slot(req.request_id),
        )

    def count_external(self, req: Request, num_external_tokens: int) -> None:
        for c in self.external_counters.values():
            c.queries += req.num_tokens
            c.hits += num_external_tokens

    def publish_transferred(self, req: Request, num_tokens: int) -> None:
        """After a completed pull: hash and cache the now-valid full blocks so later requests hit them."""
        if self.enable_prefix_caching and self.attention is not None:
            self.update_hashes(req)
            self.attention.cache_full_blocks(req.request_id, req.block_hashes, num_tokens)

    def reserve_checkpoint(self, req: Request, num_tokens: int) -> tuple[int, bytes] | None:
        """Reserve a state slot for the checkpoint after `num_tokens` tokens (to be pulled from the producer).
        None if checkpoints are off, the boundary is not aligned, it is cached already, or no slot is free.
        The caller publishes it with `publish_checkpoint` once the data has arrived, or `drop_checkpoint`."""
        rec = self.recurrent
        if rec is None or not self.enable_prefix_caching or num_tokens <= 0 or num_tokens % rec.interval:
            return None
        self.update_hashes(req)
        if num_tokens // self.block_size > len(req.block_hashes):
            return None
        h = req.block_hashes[num_tokens // self.block_size - 1]
        if rec.pool.lookup(h) is not None or rec.pool.num_free == 0:
            return None
        return rec.pool.allocate(1)[0], h

    def publish_checkpoint(self, slot: int, block_hash: bytes) -> None:
        assert self.recurrent is not None
        self.recurrent.pool.cache(slot, block_hash)
        self.recurrent.pool.free([slot])

    def drop_checkpoint(self, slot: int) -> None:
        assert self.recurrent is not None
        self.recurrent.pool.free([slot])

    # -- views for the runner ------------------------------------------------------------------------------------
    def block_ids(self, req_id: str) -> list[int]:
        return self.attention.req_blocks.get(req_id, []) if self.attention is not None else []

    def state_slot(self, req_id: str) -> int:
        if self.recurrent is None:
            return PAD_SLOT_ID
        return self.recurrent.running_slot.get(req_id, PAD_SLOT_ID)

    # -- observability -------------------------------------------------------------------------------------------
    def usage(self) -> dict[str, float]:
        return {g.kind: self.pools[g.group_id].usage() for g in self.groups}

    def pool_stats(self) -> list[dict[str, object]]:
        out = []
        for g in self.groups:
            pool = self.pools[g.group_id]
            s: dict[str, object] = {"group_id": g.group_id, "kind": g.kind, **pool.stats()}
            out.append(s)
        return out

    def check_integrity(self) -> None:
        for pool in self.pools.values():
            pool.check_integrity()
