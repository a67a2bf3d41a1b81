"""The hybrid cache manager: one manager per group, reconciled into one answer per request.

Hit search: attention left to right over full blocks; recurrent right to left over checkpoint boundaries within
the attention hit; the hit is the longest length every group agrees on, capped at N-1 (a request must compute at
least its last token to sample). Only real blocks count.

Memory: with a `budget_bytes` (the planner always gives one) cached blocks and cached checkpoints share one byte
budget with the running requests' pages; `Reclaimer` (reclaim.py) frees room by the policy's eviction order, and
`Admission` (admission.py) decides where checkpoints are saved. A layout with neither budget nor policy runs the
pre-v2 behaviour (fixed-interval checkpoints, each pool LRU on its own).

Ownership: the scheduler calls this (single thread); the PD adapters call the transfer methods on the step thread.
Tensor-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.cache.admission import Admission, CachePolicy
from engine.cache.block_pool import BlockPool
from engine.cache.hashing import extend_block_hashes, extra_keys
from engine.cache.managers import AttentionManager, RecurrentManager
from engine.cache.reclaim import Reclaimer
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
    budget_bytes: int | None = None
    """Bytes that held pages (in use + cached, both pools) may take together. None: the pools' sizes only."""
    policy: CachePolicy | None = None
    """None: CachePolicy.fixed_interval(checkpoint_interval), the pre-v2 behaviour."""

    def resolved_policy(self) -> CachePolicy:
        return self.policy if self.policy is not None else CachePolicy.fixed_interval(self.checkpoint_interval)


class HybridCacheManager:
    def __init__(self, groups: list[CacheGroup], layout: PoolLayout, enable_prefix_caching: bool = True) -> None:
        attn = [g for g in groups if g.is_attention]
        rec = [g for g in groups if not g.is_attention]
        if len(attn) > 1 or len(rec) > 1:
            raise ValueError("hybridpd supports at most one attention group and one recurrent group per model")
        self.groups = groups
        self.block_size = layout.block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.policy = layout.resolved_policy()
        self.policy.validate(layout.block_size)
        self.admission = Admission(self.policy, layout.block_size)
        self.attention: AttentionManager | None = None
        self.recurrent: RecurrentManager | None = None
        self.pools: dict[int, BlockPool] = {}
        if attn:
            name = f"group{attn[0].group_id}:attention"
            pool = BlockPool(layout.attention_blocks, name, attn[0].page_bytes_all_layers)
            self.pools[attn[0].group_id] = pool
            self.attention = AttentionManager(attn[0], pool, layout.block_size)
        if rec:
            pool = BlockPool(layout.state_slots, f"group{rec[0].group_id}:{rec[0].kind}", rec[0].page_bytes_all_layers)
            self.pools[rec[0].group_id] = pool
            self.recurrent = RecurrentManager(rec[0], pool, layout.block_size, self.admission.align)
        self.reclaimer: Reclaimer | None = None
        if layout.budget_bytes is not None or layout.policy is not None:
            budget = layout.budget_bytes
            if budget is None:
                budget = sum(p.capacity * p.page_bytes for p in self.pools.values())
            self.reclaimer = Reclaimer(
                self.attention.pool if self.attention else None, self.recurrent.pool if self.recurrent else None,
                budget, self.policy.eviction, self.policy.alpha, layout.block_size,
            )
            for m in (self.attention, self.recurrent):
                if m is not None:
                    m.reclaimer = self.reclaimer
        self._targets: dict[str, list[int]] = {}
        """request -> checkpoint boundaries still to save (admission "reuse"), ascending."""
        self._noted: dict[str, int] = {}
        """request -> how many of its block hashes the admission has seen."""
        self._reserved: dict[int, int] = {}
        """checkpoint slot reserved for a pull -> its boundary (tokens)."""
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
        Returns False (holding nothing new) when the pools / the budget cannot cover it even after evicting cache."""
        hit = hit or PrefixHit()
        rid = req.request_id
        new = self.attention is None or rid not in self.attention.req_blocks
        if self.recurrent is not None:
            new = rid not in self.recurrent.running_slot
        if self.reclaimer is None:
            if not self.can_allocate(req, num_tokens, hit):
                return False
        elif new or (self.attention is not None and self.attention.new_blocks_needed(rid, num_tokens)):
            if not self._make_room(req, num_tokens, hit):
                return False
        if self.attention is not None:
            self.attention.allocate(rid, num_tokens, hit.attention_blocks)
        if self.recurrent is not None:
            _, copy = self.recurrent.allocate(rid, hit.checkpoint_slot, pinned=self.reclaimer is not None)
            if copy is not None:
                self._pending_copies.append(copy)
        if new:
            self._admit(req, hit.num_tokens)
        return True

    def _make_room(self, req: Request, num_tokens: int, hit: PrefixHit) -> bool:
        """Pin the hit (so eviction cannot take it), then evict until the new pages fit; undo the pins on failure."""
        rid = req.request_id
        adopted = self.attention is not None and self.attention.adopt(rid, hit.attention_blocks)
        pinned = False
        needs: list[tuple[BlockPool, int]] = []
        if self.attention is not None:
            needs.append((self.attention.pool, self.attention.new_blocks_needed(rid, num_tokens)))
        if self.recurrent is not None and rid not in self.recurrent.running_slot:
            if hit.checkpoint_slot is not None:
                self.recurrent.pin_hit(hit.checkpoint_slot)
                pinned = True
            needs.append((self.recurrent.pool, 1))
        assert self.reclaimer is not None
        if self.reclaimer.make_room(needs):
            return True
        if adopted:
            self.attention.free(rid)  # type: ignore[union-attr]
        if pinned:
            self.recurrent.unpin_hit(hit.checkpoint_slot)  # type: ignore[union-attr, arg-type]
        return False

    def _admit(self, req: Request, hit_tokens: int) -> None:
        """A request got its first caches: decide its checkpoint boundaries, then remember its prompt's blocks."""
        if not self.enable_prefix_caching or self.policy.admission != "reuse":
            return
        self.update_hashes(req)
        if self.recurrent is not None:
            prompt_end = min(req.num_prompt_tokens, req.target_tokens)
            targets = self.admission.targets(req.block_hashes, hit_tokens, prompt_end)
            last = (prompt_end - 1) // self.block_size * self.block_size  # an identical prompt hits here (N-1 cap)
            if hit_tokens < last and last not in targets:
                targets = sorted([*targets, last])
            if targets:
                self._targets[req.request_id] = targets
            bs, hashes = self.block_size, req.block_hashes
            own = [b for b in (hit_tokens, last, prompt_end // bs * bs) if 0 < b <= len(hashes) * bs]
            self.recurrent.superseded[req.request_id] = [hashes[b // bs - 1] for b in own]
        self._note(req)

    def _note(self, req: Request) -> None:
        done = self._noted.get(req.request_id, 0)
        if len(req.block_hashes) > done:
            self.admission.note(req.block_hashes[done:])
            self._noted[req.request_id] = len(req.block_hashes)

    def plan_checkpoints(self, req: Request, start: int, end: int) -> list[tuple[int, int]]:
        """Checkpoint slots for the chunk (start, end]: [(num_tokens, slot)], written by the runner this step."""
        if self.recurrent is None or not self.enable_prefix_caching:
            return []
        if self.policy.admission == "interval":
            self.update_hashes(req)
            return self.recurrent.plan_checkpoints(req.request_id, req.block_hashes, start, end)
        targets = self._targets.get(req.request_id)
        if end % self.block_size and not self.policy.interval and (not targets or targets[0] > end):
            return []  # most decode steps: no boundary here
        self.update_hashes(req)
        due: list[int] = []
        while targets and targets[0] <= end:
            b = targets.pop(0)
            if b > start:
                due.append(b)
        if self.policy.interval:
            due = sorted(set(due) | {b for b in self.recurrent.interval_boundaries(start, end)
                                     if b > req.num_prompt_tokens})
        rolling = end if self.admission.decode_boundary(end, req.num_prompt_tokens) and end not in due else None
        return self.recurrent.plan(req.request_id, req.block_hashes, due, rolling)

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
                    if req.request_id in self._noted:
                        self._note(req)  # decoded blocks too: a later prompt may branch off an answer
        if self.recurrent is not None:
            self.recurrent.release_step_refs()

    def on_step_failed(self) -> None:
        """The step's forward raised: nothing it wrote is published (its requests are ended by the caller)."""
        if self.recurrent is not None:
            self.recurrent.drop_step_refs()

    def free(self, req: Request) -> None:
        rid = req.request_id
        self._targets.pop(rid, None)
        self._noted.pop(rid, None)
        if self.attention is not None:
            self.attention.free(rid)
        if self.recurrent is not None:
            self.recurrent.free(rid)

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
        if rec is None or not self.enable_prefix_caching or num_tokens <= 0 or num_tokens % rec.align:
            return None
        self.update_hashes(req)
        if num_tokens // self.block_size > len(req.block_hashes):
            return None
        h = req.block_hashes[num_tokens // self.block_size - 1]
        if rec.pool.lookup(h) is not None or not rec._room():
            return None
        slot = rec.pool.allocate(1)[0]
        self._reserved[slot] = num_tokens
        return slot, h

    def publish_checkpoint(self, slot: int, block_hash: bytes) -> None:
        """The pulled checkpoint arrived: cache it (D keeps what it pulls) and release the reservation."""
        assert self.recurrent is not None
        tokens = self._reserved.pop(slot, 0)
        if self.recurrent.pool.cache(slot, block_hash):
            self.recurrent.num_admitted += 1
            if self.reclaimer is not None:
                self.reclaimer.on_state_cached(block_hash, tokens)
        self.recurrent.pool.free([slot])

    def drop_checkpoint(self, slot: int) -> None:
        assert self.recurrent is not None
        self._reserved.pop(slot, None)
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

    def cache_stats(self) -> dict[str, object]:
        """Admissions, evictions and bytes held by kind (running vs cached), and the budget."""
        out: dict[str, object] = {"policy": {"admission": self.policy.admission, "eviction": self.policy.eviction,
                                             "interval": self.policy.interval}}
        for g in self.groups:
            pool = self.pools[g.group_id]
            s = pool.stats()
            out[g.kind] = {"bytes_in_use": s["in_use"] * pool.page_bytes, "bytes_cached": s["cached"] * pool.page_bytes,
                           "evictions": pool.num_evictions}
        if self.recurrent is not None:
            out["checkpoints_admitted"] = self.recurrent.num_admitted
        if self.reclaimer is not None:
            out["budget_bytes"] = self.reclaimer.budget_bytes
            out["held_bytes"] = self.reclaimer.held_bytes()
        return out

    def check_integrity(self) -> None:
        for pool in self.pools.values():
            pool.check_integrity()
        if self.reclaimer is not None:
            self.reclaimer.check_integrity()
