"""The hybrid cache manager: one manager per group (managers.py), reconciled into one answer per request.

Groups: any number of attention and recurrent groups, each with its own pool and ids; the runner gets one block
table per attention group and one slot per recurrent group. Hit search: each group answers the longest prefix it
serves within a bound, the bound shrinks to the shortest answer until every group agrees, capped at N-1.
Memory: `CacheTree` (tree.py) evicts, `Admission` (admission.py) picks checkpoints, and with an `arena` checkpoint
slots share memory with attention blocks (overlay.py).

Ownership: the scheduler calls this; the PD adapters call the transfer methods, on the step thread. Tensor-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from hybridpd.engine.cache.admission import Admission, CachePolicy
from hybridpd.engine.cache.arena import ArenaLayout
from hybridpd.engine.cache.block_pool import BlockPool
from hybridpd.engine.cache.events import CacheEventLog
from hybridpd.engine.cache.hashing import append_block_hashes, extra_keys
from hybridpd.engine.cache.managers import AttentionManager, GroupManager, PendingCheckpoint, RecurrentManager
from hybridpd.engine.cache.overlay import ArenaAttentionPool, ArenaStatePool, Overlay
from hybridpd.engine.cache.specs import PAD_SLOT_ID, CacheGroup
from hybridpd.engine.cache.tree import CacheTree
from hybridpd.engine.request import Request

Tables = tuple[tuple[tuple[int, tuple[int, ...]], ...], tuple[tuple[int, int], ...]]
"""((attention group id, block table), ...), ((recurrent group id, running slot), ...): what a step reads."""


@dataclass
class PrefixHit:
    num_tokens: int = 0
    pages: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """Group id -> its cached pages serving the `num_tokens` every group agreed on (attention: blocks in order;
    recurrent: the checkpoint slot, none when num_tokens is 0)."""
    group_hits: dict[str, int] = field(default_factory=dict)
    """What each group alone could serve (for per-group counters), by group label."""


@dataclass
class TransferAllocation:
    local_hit_tokens: int
    first_block_index: int
    """Index (in the request's block tables) of the first block the transfer fills."""
    block_ids: dict[int, list[int]]
    """Attention group id -> destination blocks, in order, for block indices first_block_index ..."""
    state_slots: dict[int, int]
    """Recurrent group id -> the request's running slot (the transfer writes it)."""


@dataclass(frozen=True)
class ReservedCheckpoint:
    """State slots (one per recurrent group) reserved for a checkpoint that a transfer brings."""

    num_tokens: int
    slots: dict[int, int]
    block_hash: bytes


@dataclass
class GroupCounters:
    queries: int = 0
    hits: int = 0


@dataclass(frozen=True)
class PoolLayout:
    """From the planner: blocks per attention pool, slots per state pool (every group of a kind gets that many)."""

    attention_blocks: int
    state_slots: int
    checkpoint_interval: int
    block_size: int
    budget_bytes: int | None = None
    """Bytes that held pages (in use + cached, all pools) may take together. None: the pools' sizes only."""
    policy: CachePolicy | None = None
    """None: CachePolicy(interval=checkpoint_interval)."""
    arena: ArenaLayout | None = None
    """One arena backs both kinds (checkpoint slots overlay attention blocks)."""


class HybridCacheManager:
    def __init__(
        self,
        groups: list[CacheGroup],
        layout: PoolLayout,
        enable_prefix_caching: bool = True,
        tree_cls: type[CacheTree] = CacheTree,
        admission_cls: type[Admission] = Admission,
    ) -> None:
        """`tree_cls`, `admission_cls`: the engine's policy (benchmarks/cache_policies.py swaps in its baselines)."""
        self.groups = groups
        self.block_size = layout.block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.policy = layout.policy if layout.policy is not None else CachePolicy(layout.checkpoint_interval)
        self.admission = admission_cls(self.policy, layout.block_size)
        kinds = [g.kind for g in groups]  # a group's name in counters: its kind, or kind:id when kinds repeat
        self.labels = {g.group_id: g.kind if kinds.count(g.kind) == 1 else f"{g.kind}:{g.group_id}" for g in groups}
        self.blocks: list[AttentionManager] = []
        """Attention groups' managers; the first is the chain (its blocks are the tree's nodes)."""
        self.states: list[RecurrentManager] = []
        """Recurrent groups' managers; the first leads the checkpoints, the others ride along."""
        self.pools: dict[int, BlockPool] = {}
        self.events = CacheEventLog()
        """Stored / removed per group by block hash (events.py), drained by the worker's cache-event stream."""
        self._build_managers(groups, layout)
        self.managers: list[GroupManager] = [*self.blocks, *self.states]
        self._block_gids = [(m, m.group.group_id) for m in self.blocks]
        self._state_gids = [(m, m.group.group_id) for m in self.states]
        self._gids: list[tuple[GroupManager, int]] = [*self._block_gids, *self._state_gids]
        self._one_state = [(m.pool, 1) for m in self.states]
        self._no_checkpoints = tuple((gid, ()) for _, gid in self._state_gids)
        """`checkpoint_plan` of a chunk with no boundary: every recurrent group, no checkpoint."""
        self._alloc_order = self._gids if layout.arena is None else [*self._state_gids, *self._block_gids]
        """Arena: states first, so a running slot that falls back to a checkpoint range (quarantined slots, or
        imports beyond max_num_seqs) takes its range before attention takes the blocks around it."""
        self.overlay, self.tree = self._build_tree(layout, tree_cls)
        self._tables: dict[str, Tables] = {}
        """request -> `seq_tables` as last built: dropped when its pages change (`allocate`, `free`, `quarantine`)."""
        self._covers: dict[str, int] = {}
        """request -> tokens its pages cover in every group after its last allocation (`allocate`'s fast path)."""
        self._targets: dict[str, list[int]] = {}
        """request -> checkpoint boundaries still to save (`Admission.admit`), ascending."""
        self._noted: dict[str, int] = {}
        """request -> how many of its block hashes the admission has seen."""
        self.quarantined: list[str] = []
        """Holders of pages a transfer could not cancel (see `quarantine`)."""
        self.counters = {self.labels[g.group_id]: GroupCounters() for g in groups}
        self.external_counters = {self.labels[g.group_id]: GroupCounters() for g in groups}

    def _build_tree(self, layout: PoolLayout, tree_cls: type[CacheTree]) -> tuple[Overlay | None, CacheTree]:
        """The arena's overlay (when the layout has one) and the cache tree over every pool, the leaders told."""
        overlay = None
        if layout.arena is not None and self.states:
            overlay = Overlay(layout.arena, [m.pool for m in self.blocks], [m.pool for m in self.states])  # type: ignore[misc]
        budget = layout.budget_bytes
        if budget is None:
            budget = sum(p.capacity * p.page_bytes for p in self.pools.values())
        tree = tree_cls(
            [m.pool for m in self.blocks],
            [m.pool for m in self.states],
            budget,
            self.policy.alpha,
            layout.block_size,
            overlay,
        )
        for leader in [*self.blocks[:1], *self.states[:1]]:
            leader.tree = tree
        return overlay, tree

    def _build_managers(self, groups: list[CacheGroup], layout: PoolLayout) -> None:
        """One pool and one manager per group (arena pools when the layout has an arena), leaders first."""
        arena = layout.arena
        for g in groups:
            pool: BlockPool
            size = g.page_bytes_all_layers
            if g.is_attention:
                name = f"group{g.group_id}:attention"
                arena_pool = arena is not None and arena.state_bytes
                pool = (ArenaAttentionPool if arena_pool else BlockPool)(layout.attention_blocks, name, size)
                lead = self.blocks[0].pool if self.blocks else None
                self.blocks.append(AttentionManager(g, pool, layout.block_size, leader=lead))
            else:
                name = f"group{g.group_id}:{g.kind}"
                if arena is not None:
                    pool = ArenaStatePool(layout.state_slots, arena.running_slots, name, size)
                else:
                    pool = BlockPool(layout.state_slots, name, size)
                lead = self.states[0].pool if self.states else None
                self.states.append(RecurrentManager(g, pool, layout.block_size, self.admission.align, leader=lead))
            pool.events, pool.event_group = self.events, g.group_id
            self.pools[g.group_id] = pool

    @property
    def attention(self) -> AttentionManager | None:
        """The chain (first attention group), or None for a model without attention."""
        return self.blocks[0] if self.blocks else None

    @property
    def recurrent(self) -> RecurrentManager | None:
        """The lead recurrent group, or None for a model without recurrent layers."""
        return self.states[0] if self.states else None

    # -- hashing and hit search ----------------------------------------------------------------------------------
    def update_hashes(self, req: Request) -> None:
        bs, hashes = self.block_size, req.block_hashes
        num_full = req.num_tokens // bs
        if num_full > len(hashes):  # not all_token_ids: that copies every token
            append_block_hashes(
                hashes, req.token_slice(len(hashes) * bs, num_full * bs), bs, extra_keys(req.cache_salt)
            )

    def find_prefix_hit(self, req: Request, max_tokens: int | None = None, count: bool = True) -> PrefixHit:
        """Longest prefix every group holds, capped at N-1 (or max_tokens). Counters: every group's queries grow by
        the request's tokens, its hits by what it alone could serve within the groups before it."""
        if max_tokens is None:
            max_tokens = max(0, min(req.num_tokens, req.target_tokens) - 1)
        if not self.enable_prefix_caching:
            return PrefixHit()
        self.update_hashes(req)
        hashes = req.block_hashes
        n = max_tokens if self.managers else 0
        if self.blocks:
            n = min(n, len(hashes) * self.block_size) // self.block_size * self.block_size
        hit = self._agreed_hit(self.managers, hashes, n)
        if count:
            self.count_hit(req, hit)
        return hit

    def _agreed_hit(self, managers: list[GroupManager], hashes: list[bytes], n: int) -> PrefixHit:
        """The longest prefix of at most n tokens that every one of `managers` serves, with its pages;
        `group_hits`: each group's own first answer."""
        hit, agreed = PrefixHit(), n
        for m in managers:
            n = m.find_hit_tokens(hashes, n)
            hit.group_hits[self.labels[m.group.group_id]] = n
        while n != agreed:  # each pass can only shrink n; it stops once every group serves n
            agreed = n
            for m in managers:
                n = m.find_hit_tokens(hashes, n)
        hit.num_tokens = n
        hit.pages = {m.group.group_id: m.hit_pages(hashes, n) for m in managers}
        return hit

    def count_hit(self, req: Request, hit: PrefixHit) -> None:
        for label, c in self.counters.items():
            c.queries += req.num_tokens
            c.hits += hit.group_hits.get(label, 0)

    # -- allocation ----------------------------------------------------------------------------------------------
    def allocate(self, req: Request, num_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Make the request's caches cover `num_tokens` tokens. New requests take `hit` (blocks + checkpoint).
        Returns False (holding nothing new) when the pools / the budget cannot cover it even after evicting cache."""
        rid = req.request_id
        if 0 < num_tokens <= self._covers.get(rid, 0):
            return True  # every group holds the request and covers num_tokens already (most decode steps)
        if num_tokens > 0 and self.managers and not self._grows(rid, num_tokens):
            return True
        self._tables.pop(rid, None)
        pages = hit.pages if hit is not None else {}
        new = not any(m.holds(rid) for m in self.managers)
        if (new or num_tokens > 0 or self._grows(rid, num_tokens)) and not self._make_room(rid, num_tokens, pages):
            return False
        for m, gid in self._alloc_order:
            m.allocate(rid, num_tokens, pages.get(gid, ()))
        if new:
            self._admit(req, hit.num_tokens if hit is not None else 0)
        if self.managers:
            self._covers[rid] = min([len(m.req_blocks[rid]) * self.block_size for m in self.blocks], default=1 << 62)
        return True

    def _grows(self, rid: str, num_tokens: int) -> bool:
        """Some group needs new pages to cover num_tokens (most decode steps: none)."""
        for m in self.managers:
            if m.new_pages_needed(rid, num_tokens):
                return True
        return False

    def _make_room(self, rid: str, num_tokens: int, pages: dict[int, tuple[int, ...]]) -> bool:
        """Pin the hit's `pages` (so eviction cannot take them), then evict until the new pages fit; undo the pins
        on failure."""
        pinned = [(m, gid) for m, gid in self._gids if m.pin_hit(rid, pages.get(gid, ()))]
        if self.tree.make_room([(m.pool, m.new_pages_needed(rid, num_tokens)) for m in self.managers]):
            return True
        for m, gid in pinned:
            m.unpin_hit(rid, pages.get(gid, ()))
        return False

    def _admit(self, req: Request, hit_tokens: int) -> None:
        """A request got its first caches: decide its checkpoint boundaries, then remember its prompt's blocks."""
        if not self.enable_prefix_caching:
            return
        self.update_hashes(req)
        plan = self.admission.admit(req.block_hashes, hit_tokens, min(req.num_prompt_tokens, req.target_tokens))
        if plan is None:
            return  # the admission keeps nothing per request
        targets, own = plan
        if self.states:
            if targets:
                self._targets[req.request_id] = targets
            self.states[0].superseded[req.request_id] = [req.block_hashes[b // self.block_size - 1] for b in own]
        self._note(req)

    def _note(self, req: Request) -> None:
        done = self._noted.get(req.request_id, 0)
        if len(req.block_hashes) > done:
            self.admission.note(req.block_hashes[done:])
            self._noted[req.request_id] = len(req.block_hashes)

    # -- checkpoints of a step -----------------------------------------------------------------------------------
    def checkpoint_plan(
        self, req: Request, start: int, end: int
    ) -> tuple[tuple[int, tuple[tuple[int, int], ...]], ...]:
        """Checkpoint slots for the chunk (start, end], written by the runner this step: ((recurrent group id,
        ((num_tokens, slot), ...)), ...), the same boundaries in every group."""
        if self.checkpoint_kind(req, end) is None:
            return self._no_checkpoints  # most decode steps
        self.update_hashes(req)
        due, rolling = self.admission.due(self._targets.get(req.request_id), start, end, req.num_prompt_tokens)
        return tuple([(gid, tuple(c)) for gid, c in self._reserve(req, due, rolling).items()])

    def checkpoint_kind(self, req: Request, end: int, start: int | None = None) -> str | None:
        """What `checkpoint_plan` of a chunk (start, end] could save (read-only): None, "rolling" (only the
        request-end checkpoint of a decode row at a block boundary) or "planned" (any other). A step scheduled
        before its input token is known (asynchronous scheduling) cannot plan one: the boundary's hash needs that
        token; a rolling one is planned one step late instead (engine/async_step.py). `start` None: any chunk
        ending at `end` (with a fixed interval, one that may hold a block boundary)."""
        if not self.states or not self.enable_prefix_caching:
            return None
        targets = self._targets.get(req.request_id)
        if targets and targets[0] <= end:
            return "planned"
        if self.admission.every_chunk:  # every block boundary past the prompt is saved (Admission.due)
            return "planned" if start is None or start // self.block_size < end // self.block_size else None
        return None if end % self.block_size else "rolling"

    def pending_marks(self) -> list[int]:
        """How many checkpoints each recurrent group has pending (to publish at the next `on_step_done`)."""
        return [len(m.pending) for m in self.states]

    def hold_pending(self, marks: list[int]) -> list[list[PendingCheckpoint]]:
        """Take the checkpoints planned since `pending_marks()` gave `marks` out of the next `on_step_done` (their
        copy runs after the step in flight: they are published after the step after it); `release_held` puts them
        back."""
        held = [m.pending[k:] for m, k in zip(self.states, marks, strict=True)]
        for m, k in zip(self.states, marks, strict=True):
            del m.pending[k:]
        return held

    def release_held(self, held: list[list[PendingCheckpoint]]) -> None:
        for m, h in zip(self.states, held, strict=True):
            m.pending.extend(h)

    def _reserve(self, req: Request, boundaries: list[int], rolling: int | None) -> dict[int, list[tuple[int, int]]]:
        """A slot in every recurrent group for each boundary (and the rolling request-end one) not cached or
        pending yet; best effort: a boundary is skipped when no room can be made."""
        todo = [(b, False) for b in boundaries] + ([(rolling, True)] if rolling is not None else [])
        out: dict[int, list[tuple[int, int]]] = {gid: [] for _, gid in self._state_gids}
        hashes = req.block_hashes
        for b, is_rolling in todo:
            if b // self.block_size > len(hashes):
                break
            h = hashes[b // self.block_size - 1]
            if self.states[0].is_planned(h):
                continue
            if not self._state_room():
                break
            for m, gid in self._state_gids:
                out[gid].append((b, m.reserve(req.request_id, b, h, is_rolling)))
        return out

    def _state_room(self) -> bool:
        """One free checkpoint slot in every recurrent group (evicting cache)."""
        return self.tree.make_room(self._one_state, checkpoint=True)

    def take_group_state_copies(self) -> dict[int, list[tuple[int, int]]]:
        """{recurrent group id: [(checkpoint slot, running slot)]} restores to run before the forward (drained)."""
        return {gid: m.take_copies() for m, gid in self._state_gids}

    def take_group_fresh_blocks(self) -> dict[int, list[int]]:
        return {gid: m.take_fresh_blocks() for m, gid in self._block_gids}

    # -- after a step --------------------------------------------------------------------------------------------
    def on_step_done(self, computed: list[Request]) -> None:
        """Hash the blocks that filled this step (the chain first: riders name only what it holds) and publish the
        checkpoints it wrote (the lead group first, likewise)."""
        if self.enable_prefix_caching and self.blocks:
            held, bs, noted = self.blocks[0].req_blocks, self.block_size, self._noted
            for req in computed:
                rid = req.request_id
                if rid not in held:
                    continue
                hashes = req.block_hashes
                if req.num_tokens // bs > len(hashes):
                    self.update_hashes(req)
                computed_blocks = req.num_computed_tokens // bs
                for m in self.blocks:
                    if computed_blocks > m.num_hashed[rid]:  # else no block filled (most decode steps)
                        m.cache_full_blocks(rid, hashes, req.num_computed_tokens)
                if rid in noted and len(hashes) > noted[rid]:
                    self._note(req)  # decoded blocks too: a later prompt may branch off an answer
        for rm in self.states:
            rm.release_step_refs()

    def on_step_failed(self) -> None:
        """The step's forward raised: nothing it wrote is published (its requests are ended by the caller)."""
        for m in self.states:
            m.drop_step_refs()

    def _forget(self, rid: str) -> None:
        for memo in (self._tables, self._covers, self._targets, self._noted):
            memo.pop(rid, None)

    def free(self, req: Request) -> None:
        self._forget(req.request_id)
        for m in self.managers:
            m.free(req.request_id)

    # -- disaggregation (producer side) ---------------------------------------------------------------------------
    def find_checkpoint(self, req: Request, max_tokens: int) -> tuple[int, dict[int, int]] | None:
        """The deepest checkpoint <= max_tokens that every recurrent group holds: (tokens, {group id: slot})."""
        if not self.states or not self.enable_prefix_caching:
            return None
        self.update_hashes(req)
        hit = self._agreed_hit(self.states, req.block_hashes, max_tokens)  # type: ignore[arg-type]
        return (hit.num_tokens, {g: p[0] for g, p in hit.pages.items()}) if hit.num_tokens > 0 else None

    def pin_checkpoint(self, slots: dict[int, int]) -> None:
        """Reference a cached checkpoint (an export holds it for a consumer) until `unpin_checkpoint`."""
        for m, gid in self._state_gids:
            m.pool.touch([slots[gid]])

    def unpin_checkpoint(self, slots: Mapping[int, int]) -> None:
        for m, gid in self._state_gids:
            m.pool.free([slots[gid]])

    # -- disaggregation (consumer side) ---------------------------------------------------------------------------
    def quarantine(self, req: Request, checkpoint: ReservedCheckpoint | None = None) -> str:
        """A READ may still write the request's pages (and `checkpoint`'s): keep them in use forever under a holder
        of their own (never handed out again, never hashed), so the request id holds nothing and may compute
        afresh. Returns the holder."""
        holder = f"quarantine:{req.request_id}:{len(self.quarantined)}"
        self.quarantined.append(holder)  # `checkpoint`'s slots stay held: nobody frees them
        self._forget(req.request_id)
        for m in self.managers:
            m.disown(req.request_id, holder)
        return holder

    def allocate_for_transfer(self, req: Request, num_external_tokens: int) -> TransferAllocation | None:
        """Hold caches for a request whose first `num_external_tokens` tokens arrive from a producer: the local
        attention hit is kept (no checkpoint copy: the running states come from the producer); the rest is
        allocated and *not* zeroed (the transfer overwrites it). None when the pools cannot hold it."""
        hit = self.find_transfer_hit(req, num_external_tokens)
        if not self.allocate(req, num_external_tokens, hit):
            return None
        self.count_hit(req, hit)
        first = hit.num_tokens // self.block_size
        pulled: dict[int, list[int]] = {}
        for am, gid in self._block_gids:
            ids = pulled[gid] = am.req_blocks[req.request_id][first:]
            keep = set(ids)
            am.fresh_blocks = [b for b in am.fresh_blocks if b not in keep]
        return TransferAllocation(
            local_hit_tokens=hit.num_tokens,
            first_block_index=first,
            block_ids=pulled,
            state_slots={gid: m.running_slot[req.request_id] for m, gid in self._state_gids},
        )

    def find_transfer_hit(self, req: Request, max_tokens: int) -> PrefixHit:
        """A consumer's own prefix for a transfer: the longest run of blocks every attention group holds, within
        `max_tokens` (D's checkpoints never bound it). `group_hits`: each attention group's own run, each
        recurrent group's deepest checkpoint within the agreed run (for the per-group metrics)."""
        if not self.enable_prefix_caching or not self.blocks:
            return PrefixHit()
        self.update_hashes(req)
        hashes, bs = req.block_hashes, self.block_size
        hit = self._agreed_hit(self.blocks, hashes, min(max_tokens, len(hashes) * bs) // bs * bs)  # type: ignore[arg-type]
        for sm, gid in self._state_gids:
            hit.group_hits[self.labels[gid]] = sm.find_hit_tokens(hashes, hit.num_tokens)
        return hit

    def count_external(self, req: Request, num_external_tokens: int) -> None:
        for c in self.external_counters.values():
            c.queries += req.num_tokens
            c.hits += num_external_tokens

    def publish_transferred(self, req: Request, num_tokens: int) -> None:
        """After a completed pull: hash and cache the now-valid full blocks so later requests hit them."""
        if self.enable_prefix_caching and self.blocks:
            self.update_hashes(req)
            for m in self.blocks:
                m.cache_full_blocks(req.request_id, req.block_hashes, num_tokens)

    def reserve_checkpoint(self, req: Request, num_tokens: int) -> ReservedCheckpoint | None:
        """Reserve a slot in every recurrent group for the checkpoint after `num_tokens` tokens (pulled from the
        producer; `publish_checkpoint` once it arrived, or `drop_checkpoint`). None if checkpoints are off, the
        boundary is not aligned, it is cached already, or no slot is free."""
        if not self.states or not self.enable_prefix_caching or num_tokens <= 0 or num_tokens % self.states[0].align:
            return None
        self.update_hashes(req)
        if num_tokens // self.block_size > len(req.block_hashes):
            return None
        h = req.block_hashes[num_tokens // self.block_size - 1]
        if h in self.states[0].pool.cached or not self._state_room():
            return None
        slots = {gid: m.pool.allocate_checkpoint(1)[0] for m, gid in self._state_gids}
        return ReservedCheckpoint(num_tokens, slots, h)

    def publish_checkpoint(self, ckpt: ReservedCheckpoint) -> None:
        """The pulled checkpoint arrived: cache it (the lead group first) and release the reservation."""
        for m, gid in self._state_gids:
            m.publish(ckpt.slots[gid], ckpt.block_hash, ckpt.num_tokens)
        self.drop_checkpoint(ckpt)

    def drop_checkpoint(self, ckpt: ReservedCheckpoint) -> None:
        self.unpin_checkpoint(ckpt.slots)

    # -- views for the runner ------------------------------------------------------------------------------------
    def seq_tables(self, req_id: str) -> Tables:
        """The request's block tables and running slots, built again only after its pages changed."""
        tables = self._tables.get(req_id)
        if tables is None:
            tables = self._tables[req_id] = (
                tuple([(gid, m.req_pages(req_id)) for m, gid in self._block_gids]),
                tuple([(gid, m.running_slot.get(req_id, PAD_SLOT_ID)) for m, gid in self._state_gids]),
            )
        return tables

    def group_block_ids(self, req_id: str) -> dict[int, tuple[int, ...]]:
        """Attention group id -> the request's block table in that group."""
        return dict(self.seq_tables(req_id)[0])

    def group_state_slots(self, req_id: str) -> dict[int, int]:
        """Recurrent group id -> the request's running slot in that group (PAD_SLOT_ID if none)."""
        return dict(self.seq_tables(req_id)[1])

    def req_pages(self, req_id: str) -> dict[int, tuple[int, ...]]:
        """Group id -> every page the request holds (what a transfer moves)."""
        return {gid: m.req_pages(req_id) for m, gid in self._gids}

    def cached_hashes(self) -> dict[int, set[bytes]]:
        """Group id -> the hashes a hit search finds now: what replaying every event of `events` gives (the
        cache-event stream's resync snapshot)."""
        return {gid: set(p.cached) for gid, p in self.pools.items()}

    # -- observability -------------------------------------------------------------------------------------------
    def usage(self) -> dict[str, float]:
        return {self.labels[gid]: p.usage() for gid, p in self.pools.items()}

    def pool_stats(self) -> list[dict[str, object]]:
        return [{"group_id": g.group_id, "kind": g.kind, **self.pools[g.group_id].stats()} for g in self.groups]

    def cache_stats(self) -> dict[str, object]:
        """Admissions, evictions and bytes held per group (by label: running vs cached), and the budget."""
        out: dict[str, object] = {"policy": {"admission": self.admission.name, "interval": self.policy.interval}}
        for gid, pool in self.pools.items():
            s = pool.stats()
            out[self.labels[gid]] = {
                "bytes_in_use": s["in_use"] * pool.page_bytes,
                "bytes_cached": s["cached"] * pool.page_bytes,
                "evictions": pool.num_evictions,
            }
        if self.states:
            out["checkpoints_admitted"] = self.states[0].num_admitted
        out["budget_bytes"] = self.tree.budget_bytes
        out["held_bytes"] = self.tree.held_bytes()
        if self.overlay is not None:
            out["arena"] = {
                "checkpoint_ranges": self.overlay.num_ranges,
                "ranges_held": len(self.overlay.held),
                "free_ranges": self.overlay.num_free_ranges,
                "range_evictions": self.overlay.num_range_evictions,
                "checkpoints_skipped": self.tree.num_checkpoints_skipped,
            }
        return out

    def check_integrity(self) -> None:
        for pool in self.pools.values():
            pool.check_integrity()
        self.tree.check_integrity()
