"""The hybrid cache manager: what the scheduler and the transfer adapters ask of the prefix cache.

Every attention group shares one block table per request and every recurrent group one running slot (the arena
puts block j of every attention group in page j and one state of every recurrent group in a slot, arena.py), so
the manager keeps one list of pages and one slot per request and hands each group the same ids. Hit search: the
longest run of cached blocks, then (recurrent layers) the deepest cached checkpoint within it, capped at N-1.
Memory: `CacheTree` (tree.py) evicts, `Admission` (admission.py) picks checkpoints. A checkpoint is saved by a
row copy after the step (the running slot at a chunk's end, a staging slot the kernels wrote inside it) and
restored by one before the step: the runner runs `take_saves` / `take_restores`.

Ownership: the scheduler calls this; the PD adapters call the transfer methods, on the step thread. Tensor-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from hybridpd.engine.cache.admission import Admission, CachePolicy
from hybridpd.engine.cache.arena import STAGING_SLOTS
from hybridpd.engine.cache.events import CacheEventLog
from hybridpd.engine.cache.hashing import append_block_hashes, extra_keys
from hybridpd.engine.cache.pools import PagePool, SlotPool
from hybridpd.engine.cache.specs import PAD_SLOT_ID, CacheGroup
from hybridpd.engine.cache.tree import CacheTree, Node
from hybridpd.engine.request import Request

Tables = tuple[tuple[tuple[int, tuple[int, ...]], ...], tuple[tuple[int, int], ...]]
"""((attention group id, block table), ...), ((recurrent group id, running slot), ...): what a step reads."""
Inside = tuple[tuple[int, tuple[tuple[int, int], ...]], ...]
"""((recurrent group id, ((num_tokens, staging slot), ...)), ...): checkpoints the kernels write inside a chunk."""
Copy = tuple[int, tuple[int, ...]]
"""(slot, the pages of a checkpoint): a save copies the slot to the pages, a restore the pages to the slot."""


@dataclass(frozen=True)
class PoolLayout:
    """From the planner (`CapacityPlan.layout`): the arena's ids, tensor-free."""

    num_pages: int  # the null page 0 included
    num_slots: int  # the null slot 0, running slots and STAGING_SLOTS staging ones (0: no recurrent group)
    checkpoint_interval: int
    block_size: int
    pages_per_state: int = 1
    policy: CachePolicy | None = None  # None: CachePolicy(interval=checkpoint_interval)
    max_checkpoints: int | None = None


@dataclass
class PrefixHit:
    num_tokens: int = 0
    blocks: tuple[int, ...] = ()  # the cached pages serving `num_tokens` (attention groups)
    checkpoint: Node | None = None  # the checkpoint restored at `num_tokens` (recurrent groups)
    group_hits: dict[str, int] = field(default_factory=dict)  # label -> what its group alone could serve


@dataclass
class TransferAllocation:
    local_hit_tokens: int
    first_block_index: int  # in the request's block tables: the first block the transfer fills
    block_ids: dict[int, list[int]]  # attention group id -> destination blocks from first_block_index on
    state_slots: dict[int, int]  # recurrent group id -> the request's running slot (the transfer writes it)


@dataclass(frozen=True)
class ReservedCheckpoint:
    """Pages reserved for a checkpoint that a transfer brings (its k pages, the state of every recurrent group)."""

    num_tokens: int
    pages: tuple[int, ...]
    block_hash: bytes


@dataclass
class PendingCheckpoint:
    req_id: str
    num_tokens: int
    pages: tuple[int, ...]
    block_hash: bytes
    rolling: bool = False  # a request end written while decoding: it replaces the request's previous one
    branch: bool = False  # at the request's branch point (admission.py)


@dataclass
class GroupCounters:
    queries: int = 0
    hits: int = 0


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
        self.block_size = bs = layout.block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.policy = layout.policy if layout.policy is not None else CachePolicy(layout.checkpoint_interval)
        self.admission = admission_cls(self.policy, bs)
        self.align = self.admission.align
        kinds = [g.kind for g in groups]  # a group's name in counters: its kind, or kind:id when kinds repeat
        self.labels = {g.group_id: g.kind if kinds.count(g.kind) == 1 else f"{g.kind}:{g.group_id}" for g in groups}
        self.attention_groups = [g.group_id for g in groups if g.is_attention]
        self.recurrent_groups = [g.group_id for g in groups if not g.is_attention]
        self.has_blocks, self.has_states = bool(self.attention_groups), bool(self.recurrent_groups)
        self.events = CacheEventLog()  # drained by the worker's cache-event stream (events.py)
        self.pages = PagePool(layout.num_pages)
        self.slots = SlotPool(layout.num_slots if self.has_states else 0)
        self.k = layout.pages_per_state if self.has_states else 0
        self.max_running = max(1, layout.num_slots - 1 - STAGING_SLOTS)
        self.tree = tree_cls(self.pages, self.events, (tuple(self.attention_groups), tuple(self.recurrent_groups)),
                             self.k, bs, self.policy.alpha)
        self.tree.max_checkpoints = layout.max_checkpoints
        self._branch: dict[str, int] = {}
        """request -> its branch point (`Admission.last_branch`): a checkpoint there is a branch point for good."""
        self.req_blocks: dict[str, list[int]] = {}
        self.num_hashed: dict[str, int] = {}
        self.running_slot: dict[str, int] = {}
        self.num_in_use = 0  # pages that requests reference as attention blocks
        self.fresh: list[int] = []  # pages allocated since the last drain (not prefix hits): zeroed before use
        self.restores: list[Copy] = []  # before the next forward
        self.saves: list[Copy] = []  # after it
        self.pending: list[PendingCheckpoint] = []  # written by the step in flight, published by `on_step_done`
        self.step_pins: list[Node] = []  # checkpoints it restores (referenced until it ran)
        self.staging: list[int] = []  # staging slots it writes (freed after it)
        self.rolling: dict[str, bytes] = {}
        """request -> hash of its published request-end checkpoint (dropped when a later one replaces it)."""
        self.superseded: dict[str, list[bytes]] = {}
        """request -> checkpoints on its own path (the one it restored, its prompt end) that its first request-end
        checkpoint supersedes (demoted in the tree unless they are branch points)."""
        self.num_admitted = 0
        self._tables: dict[str, Tables] = {}  # request -> `seq_tables` as last built (dropped when its pages change)
        self._covers: dict[str, int] = {}  # request -> tokens its blocks cover (`allocate`'s fast path)
        self._targets: dict[str, list[int]] = {}  # request -> checkpoint boundaries still to save, ascending
        self._noted: dict[str, int] = {}  # request -> how many of its block hashes the admission has seen
        self._no_checkpoints = tuple((gid, ()) for gid in self.recurrent_groups)
        self.quarantined: list[str] = []
        self.counters = {self.labels[g.group_id]: GroupCounters() for g in groups}
        self.external_counters = {self.labels[g.group_id]: GroupCounters() for g in groups}

    # -- hashing and hit search ----------------------------------------------------------------------------------
    def update_hashes(self, req: Request) -> None:
        bs, hashes = self.block_size, req.block_hashes
        num_full = req.num_tokens // bs
        if num_full > len(hashes):  # not all_token_ids: that copies every token
            append_block_hashes(
                hashes, req.token_slice(len(hashes) * bs, num_full * bs), bs, extra_keys(req.cache_salt)
            )

    def find_prefix_hit(self, req: Request, max_tokens: int | None = None, count: bool = True) -> PrefixHit:
        """Longest prefix every group holds, capped at N-1 (or max_tokens); counted (`count_hit`) when `count`."""
        if max_tokens is None:
            max_tokens = max(0, min(req.num_tokens, req.target_tokens) - 1)
        if not self.enable_prefix_caching:
            return PrefixHit()
        self.update_hashes(req)
        hit = self._hit(req.block_hashes, max_tokens, self.has_states)
        if count:
            self.count_hit(req, hit)
        return hit

    def _hit(self, hashes: list[bytes], max_tokens: int, with_state: bool) -> PrefixHit:
        """The attention run within max_tokens, then (`with_state`) the deepest checkpoint within it."""
        bs, nodes = self.block_size, self.tree.nodes
        limit = min(max_tokens, len(hashes) * bs) // bs
        blocks: list[int] = []
        if self.has_blocks:
            for h in hashes[:limit]:
                node = nodes.get(h)
                if node is None or not node.page:
                    break
                blocks.append(node.page)
        n = len(blocks) * bs if self.has_blocks else limit * bs
        hit = PrefixHit(group_hits={self.labels[g]: n for g in self.attention_groups})
        if with_state:
            n, hit.checkpoint = self._deepest_checkpoint(hashes, n)
            hit.group_hits.update({self.labels[g]: n for g in self.recurrent_groups})
        hit.num_tokens, hit.blocks = n, tuple(blocks[: n // bs])
        return hit

    def _deepest_checkpoint(self, hashes: list[bytes], max_tokens: int) -> tuple[int, Node | None]:
        bs, step, nodes = self.block_size, self.align, self.tree.nodes
        b = min(max_tokens, len(hashes) * bs) // step * step
        while b > 0:
            node = nodes.get(hashes[b // bs - 1])
            if node is not None and node.ckpt is not None:
                return b, node
            b -= step
        return 0, None

    def count_hit(self, req: Request, hit: PrefixHit) -> None:  # queries: the request's tokens; hits: its group's
        for label, c in self.counters.items():
            c.queries += req.num_tokens
            c.hits += hit.group_hits.get(label, 0)

    # -- allocation ----------------------------------------------------------------------------------------------
    def allocate(self, req: Request, num_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Make the request's caches cover `num_tokens` tokens (a new request takes `hit`); False (holding nothing
        new) when the pages cannot, even after evicting cache."""
        rid = req.request_id
        if 0 < num_tokens <= self._covers.get(rid, 0):
            return True  # covered already (most decode steps)
        new = rid not in self.req_blocks and rid not in self.running_slot
        hit = hit if hit is not None and new else PrefixHit()
        held = self.req_blocks.get(rid)
        need = -(-num_tokens // self.block_size) - (len(held) if held is not None else len(hit.blocks))
        need = need if self.has_blocks and need > 0 else 0
        if not new and not need:
            self._covers[rid] = len(held) * self.block_size if held is not None else 1 << 62
            return True
        self._tables.pop(rid, None)
        if new and not self._start(rid, hit):
            return False
        if need and not self.tree.make_room(need):
            if new:
                self._unstart(rid, hit)
            return False
        if need:
            pages = self.pages.take(need)
            self.num_in_use += need
            self.req_blocks[rid].extend(pages)
            self.fresh.extend(pages)
        if new:
            self._admit(req, hit.num_tokens)
        self._covers[rid] = len(self.req_blocks[rid]) * self.block_size if self.has_blocks else 1 << 62
        return True

    def _start(self, rid: str, hit: PrefixHit) -> bool:
        """A new request: its running slot, its hit's blocks referenced and its checkpoint restored."""
        slot = None
        if self.has_states:
            slot = self.slots.take()
            if slot is None:
                return False
            self.running_slot[rid] = slot
        if self.has_blocks:
            self._touch(hit.blocks)
            self.req_blocks[rid] = list(hit.blocks)
            self.num_hashed[rid] = len(hit.blocks)
        if hit.checkpoint is not None and slot is not None:
            self.tree.pin_checkpoint(hit.checkpoint)
            self.step_pins.append(hit.checkpoint)
            self.restores.append((slot, hit.checkpoint.ckpt))  # type: ignore[arg-type]
        return True

    def _unstart(self, rid: str, hit: PrefixHit) -> None:  # (no room for the request's new blocks)
        if hit.checkpoint is not None and rid in self.running_slot:
            self.restores.pop()
            self.step_pins.pop()
            self.tree.unpin_checkpoint(hit.checkpoint)
        self._free_pages(rid)

    def _touch(self, pages: Sequence[int]) -> None:
        ref, page_node = self.pages.ref, self.tree.page_node
        for p in pages:
            if not ref[p]:
                self.num_in_use += 1
                self.tree.acquired(page_node[p])  # type: ignore[arg-type]
            ref[p] += 1

    def _free_pages(self, rid: str) -> None:
        """Drop the request's references (tail first: the least shareable blocks are evicted first) and slot."""
        blocks = self.req_blocks.pop(rid, None)
        self.num_hashed.pop(rid, None)
        if blocks:
            ref, page_node, free, tree = self.pages.ref, self.tree.page_node, self.pages.free, self.tree
            for p in reversed(blocks):
                n = ref[p] = ref[p] - 1
                if n:
                    continue
                self.num_in_use -= 1
                node = page_node[p]
                if node is None:
                    free.append(p)
                else:
                    tree.released(node)
        slot = self.running_slot.pop(rid, None)
        if slot is not None:
            self.slots.give_back(slot)

    def _admit(self, req: Request, hit_tokens: int) -> None:
        """A request got its first caches: decide its checkpoint boundaries, then remember its prompt's blocks."""
        if not self.enable_prefix_caching:
            return
        self.update_hashes(req)
        plan = self.admission.admit(req.block_hashes, hit_tokens, min(req.num_prompt_tokens, req.target_tokens))
        if plan is None:
            return  # the admission keeps nothing per request
        targets, own = plan
        if self.has_states:
            if self.admission.last_branch is not None:
                self._branch[req.request_id] = self.admission.last_branch
            if targets:
                self._targets[req.request_id] = targets
            self.superseded[req.request_id] = [req.block_hashes[b // self.block_size - 1] for b in own]
        self._note(req)

    def _note(self, req: Request) -> None:
        done = self._noted.get(req.request_id, 0)
        if len(req.block_hashes) > done:
            self.admission.note(req.block_hashes[done:])
            self._noted[req.request_id] = len(req.block_hashes)

    # -- checkpoints of a step -----------------------------------------------------------------------------------
    def checkpoint_plan(self, req: Request, start: int, end: int) -> tuple[Inside, int]:
        """Reserve the checkpoints the chunk (start, end] saves. Returns what the kernels write this step: ((recurrent
        group id, ((num_tokens, staging slot), ...)), ...), the boundaries inside the chunk, the same in every group,
        and where the chunk ends: at a boundary inside it when no staging slot is free (the checkpoint is then the
        running state at the chunk's end; the rest of the chunk runs next step). Each checkpoint's save (its slot to
        its pages) runs after the step."""
        if self.checkpoint_kind(req, end) is None:
            return self._no_checkpoints, end  # most decode steps
        self.update_hashes(req)
        rid = req.request_id
        due, rolling = self.admission.due(self._targets.get(rid), start, end, req.num_prompt_tokens)
        todo = [(b, False) for b in due] + ([(rolling, True)] if rolling is not None else [])
        inside: list[tuple[int, int]] = []
        hashes, bs = req.block_hashes, self.block_size
        for i, (b, is_rolling) in enumerate(todo):
            if b // bs > len(hashes):
                break
            h = hashes[b // bs - 1]
            if self._is_planned(h):
                continue
            if not self.tree.make_room(self.k, checkpoint=True):
                break  # best effort: no room now (before any staging slot is taken or the chunk cut)
            slot = self.running_slot[rid] if b == end else self._staging_slot()
            if slot is None:  # the chunk ends here instead; the boundaries past it wait for the next chunks
                if rid in self._targets:  # (an admission keeping no targets derives them from each chunk)
                    self._targets[rid][:0] = [x for x, r in todo[i + 1 :] if not r]
                end, slot = b, self.running_slot[rid]
            pages = self._take_checkpoint_pages()
            self.pending.append(PendingCheckpoint(rid, b, pages, h, is_rolling, b == self._branch.get(rid)))
            self.saves.append((slot, pages))
            if b < end:
                self.staging.append(slot)
                inside.append((b, slot))
            if b == end:
                break
        return (tuple((gid, tuple(inside)) for gid in self.recurrent_groups) if inside else self._no_checkpoints), end

    def _take_checkpoint_pages(self) -> tuple[int, ...]:
        """k pages for a checkpoint (room was made); counted as reserved until named or given back."""
        self.tree.num_reserved += 1
        return tuple(self.pages.take(self.k))

    def _settle(self, pages: tuple[int, ...], h: bytes, tokens: int, branch: bool = False) -> bool:
        """A reserved checkpoint was written (`h` set) or not (empty `h`): name it, else give its pages back."""
        self.tree.num_reserved -= 1
        if h and self.tree.name_checkpoint(h, tokens, pages, branch):
            self.num_admitted += 1
            return True
        self.pages.give_back(pages)
        return False

    def _staging_slot(self) -> int | None:
        """A free slot for a checkpoint inside a chunk, unless new requests may still need it for running."""
        if len(self.slots.free) <= max(0, self.max_running - len(self.running_slot)):
            return None
        return self.slots.take()

    def _is_planned(self, h: bytes) -> bool:
        """Cached already, or to be written by a step in flight."""
        node = self.tree.nodes.get(h)
        return (node is not None and node.ckpt is not None) or any(p.block_hash == h for p in self.pending)

    def checkpoint_kind(self, req: Request, end: int, start: int | None = None) -> str | None:
        """What `checkpoint_plan` of a chunk (start, end] could save (read-only): None, "rolling" (only the
        request-end checkpoint of a decode row at a block boundary) or "planned" (any other). A step scheduled
        before its input token is known (asynchronous scheduling) cannot plan one: the boundary's hash needs that
        token; a rolling one is planned one step late instead (engine/async_step.py). `start` None: any chunk
        ending at `end` (with a fixed interval, one that may hold a block boundary)."""
        if not self.has_states or not self.enable_prefix_caching:
            return None
        targets = self._targets.get(req.request_id)
        if targets and targets[0] <= end:
            return "planned"
        if self.admission.every_chunk:  # every block boundary past the prompt is saved (Admission.due)
            return "planned" if start is None or start // self.block_size < end // self.block_size else None
        return None if end % self.block_size else "rolling"

    def pending_marks(self) -> int:
        return len(self.pending)

    def hold_pending(self, mark: int) -> list[PendingCheckpoint]:
        """Keep the checkpoints planned since `pending_marks()` gave `mark` out of the next `on_step_done` (copied
        after the step in flight, they are published after the step after it); `release_held` puts them back."""
        held, self.pending = self.pending[mark:], self.pending[:mark]
        return held

    def release_held(self, held: list[PendingCheckpoint]) -> None:
        self.pending.extend(held)

    def take_restores(self) -> tuple[Copy, ...]:
        out, self.restores = tuple(self.restores), []  # run before the step's forward
        return out

    def take_saves(self) -> tuple[Copy, ...]:
        out, self.saves = tuple(self.saves), []  # run after it
        return out

    def take_fresh_blocks(self) -> tuple[int, ...]:
        out, self.fresh = tuple(self.fresh), []
        return out

    # -- after a step --------------------------------------------------------------------------------------------
    def on_step_done(self, computed: list[Request]) -> None:
        """Name the blocks that filled this step, then publish the checkpoints it wrote."""
        if self.enable_prefix_caching and self.has_blocks:
            bs, noted = self.block_size, self._noted
            for req in computed:
                rid = req.request_id
                if rid not in self.req_blocks:
                    continue
                if req.num_tokens // bs > len(req.block_hashes):
                    self.update_hashes(req)
                if req.num_computed_tokens // bs > self.num_hashed[rid]:  # else no block filled (most decode steps)
                    self._name_blocks(rid, req.block_hashes, req.num_computed_tokens)
                if rid in noted and len(req.block_hashes) > noted[rid]:
                    self._note(req)  # decoded blocks too: a later prompt may branch off an answer
        for p in self.pending:
            if self._settle(p.pages, p.block_hash, p.num_tokens, p.branch) and p.rolling:
                self._replace_rolling(p.req_id, p.block_hash)
        self.pending = []
        self._end_step()

    def _end_step(self) -> None:
        for node in self.step_pins:
            self.tree.unpin_checkpoint(node)
        for slot in self.staging:
            self.slots.give_back(slot)
        self.step_pins, self.staging = [], []

    def on_step_failed(self) -> None:
        """The step's forward raised: nothing it wrote is published (its requests are ended by the caller)."""
        for p in self.pending:
            self._settle(p.pages, b"", 0)
        self.pending, self.saves = [], []
        self._end_step()

    def _name_blocks(self, rid: str, hashes: list[bytes], num_computed: int) -> None:
        """Name the request's blocks that filled since the last call; a block cached elsewhere already gives its
        name to our live copy when nobody references the old one."""
        blocks, tree, bs = self.req_blocks[rid], self.tree, self.block_size
        n_full = min(num_computed // bs, len(hashes), len(blocks))
        page_node, ref = tree.page_node, self.pages.ref
        for i in range(self.num_hashed[rid], n_full):
            page = blocks[i]
            if page_node[page] is not None or tree.name_block(hashes[i], hashes[i - 1] if i else None, (i + 1) * bs,
                                                              page):
                continue
            node = tree.nodes[hashes[i]]
            if not ref[node.page]:
                tree.rename_block(node, page)
        self.num_hashed[rid] = n_full

    def _replace_rolling(self, req_id: str, h: bytes) -> None:
        prev = self.rolling.get(req_id)
        self.rolling[req_id] = h
        for old in self.superseded.pop(req_id, ()):
            self.tree.demote(old)
        node = self.tree.nodes.get(prev) if prev is not None else None
        if node is not None and node.ckpt is not None and not node.ckpt_refs:
            self.tree.evict_checkpoint(node)
            self.tree.revalue(self.tree.nodes[h])  # its anchor was the one just dropped: worth more now

    def _forget(self, rid: str) -> None:
        for memo in (self._tables, self._covers, self._targets, self._noted, self.rolling, self.superseded,
                     self._branch, self.num_hashed):
            memo.pop(rid, None)

    def free(self, req: Request) -> None:
        self._forget(req.request_id)
        self._free_pages(req.request_id)

    # -- disaggregation (producer side) ---------------------------------------------------------------------------
    def find_checkpoint(self, req: Request, max_tokens: int) -> tuple[int, tuple[int, ...]] | None:
        """The deepest cached checkpoint <= max_tokens: (tokens, its pages)."""
        if not self.has_states or not self.enable_prefix_caching:
            return None
        self.update_hashes(req)
        n, node = self._deepest_checkpoint(req.block_hashes, max_tokens)
        return (n, node.ckpt) if node is not None else None  # type: ignore[return-value]

    def pin_checkpoint(self, pages: tuple[int, ...]) -> None:
        """Reference a cached checkpoint (an export holds it for a consumer) until `unpin_checkpoint`."""
        self.tree.pin_checkpoint(self.tree.ckpt_node[pages[0]])

    def unpin_checkpoint(self, pages: tuple[int, ...]) -> None:
        self.tree.unpin_checkpoint(self.tree.ckpt_node[pages[0]])

    # -- disaggregation (consumer side) ---------------------------------------------------------------------------
    def quarantine(self, req: Request, checkpoint: ReservedCheckpoint | None = None) -> str:
        """A READ may still write the request's pages (and `checkpoint`'s): keep them in use forever under a holder
        of their own (never handed out again, never named), so the request id holds nothing and may compute
        afresh. Returns the holder."""
        rid = req.request_id
        holder = f"quarantine:{rid}:{len(self.quarantined)}"
        self.quarantined.append(holder)  # `checkpoint`'s pages stay taken: nobody gives them back
        if checkpoint is not None:
            self.tree.num_reserved -= 1  # (not a checkpoint any more: pages lost to a READ that may still land)
        self._forget(rid)
        if rid in self.req_blocks:
            self.req_blocks[holder] = self.req_blocks.pop(rid)
        if rid in self.running_slot:
            self.running_slot[holder] = self.running_slot.pop(rid)
        return holder

    def allocate_for_transfer(self, req: Request, num_external_tokens: int) -> TransferAllocation | None:
        """Hold caches for a request whose first `num_external_tokens` tokens arrive from a producer: the local
        attention hit is kept (no checkpoint copy: the running states come from the producer); the rest is
        allocated and *not* zeroed (the transfer overwrites it). None when the pages cannot hold it."""
        hit = self.find_transfer_hit(req, num_external_tokens)
        if not self.allocate(req, num_external_tokens, hit):
            return None
        self.count_hit(req, hit)
        first = hit.num_tokens // self.block_size
        pulled = self.req_blocks.get(req.request_id, [])[first:]
        keep = set(pulled)
        self.fresh = [b for b in self.fresh if b not in keep]
        slot = self.running_slot.get(req.request_id, PAD_SLOT_ID)
        return TransferAllocation(
            local_hit_tokens=hit.num_tokens,
            first_block_index=first,
            block_ids={gid: list(pulled) for gid in self.attention_groups},
            state_slots={gid: slot for gid in self.recurrent_groups},
        )

    def find_transfer_hit(self, req: Request, max_tokens: int) -> PrefixHit:
        """A consumer's own prefix for a transfer: the longest run of cached blocks within `max_tokens` (our
        checkpoints never bound it). `group_hits`: the run, and for the recurrent groups the deepest checkpoint
        within it (for the per-group metrics)."""
        if not self.enable_prefix_caching or not self.has_blocks:
            return PrefixHit()
        self.update_hashes(req)
        hit = self._hit(req.block_hashes, max_tokens, False)
        n, _ = self._deepest_checkpoint(req.block_hashes, hit.num_tokens) if self.has_states else (0, None)
        hit.group_hits.update({self.labels[g]: n for g in self.recurrent_groups})
        return hit

    def count_external(self, req: Request, num_external_tokens: int) -> None:
        for c in self.external_counters.values():
            c.queries += req.num_tokens
            c.hits += num_external_tokens

    def publish_transferred(self, req: Request, num_tokens: int) -> None:
        """After a completed pull: name the now-valid full blocks so later requests hit them."""
        if self.enable_prefix_caching and self.has_blocks and req.request_id in self.req_blocks:
            self.update_hashes(req)
            self._name_blocks(req.request_id, req.block_hashes, num_tokens)

    def reserve_checkpoint(self, req: Request, num_tokens: int) -> ReservedCheckpoint | None:
        """Reserve pages for the checkpoint after `num_tokens` tokens (pulled from the producer;
        `publish_checkpoint` once it arrived, or `drop_checkpoint`). None if checkpoints are off, the boundary is not
        aligned, it is cached already, or no room can be made."""
        if not self.has_states or not self.enable_prefix_caching or num_tokens <= 0 or num_tokens % self.align:
            return None
        self.update_hashes(req)
        if num_tokens // self.block_size > len(req.block_hashes):
            return None
        h = req.block_hashes[num_tokens // self.block_size - 1]
        if self._is_planned(h) or not self.tree.make_room(self.k, checkpoint=True):
            return None
        pages = self._take_checkpoint_pages()  # (one may be listed fresh, freed since: a READ fills it, not zeroed)
        self.fresh = [b for b in self.fresh if b not in pages]
        return ReservedCheckpoint(num_tokens, pages, h)

    def publish_checkpoint(self, ckpt: ReservedCheckpoint) -> None:
        """The pulled checkpoint arrived: cache it."""
        self._settle(ckpt.pages, ckpt.block_hash, ckpt.num_tokens)

    def drop_checkpoint(self, ckpt: ReservedCheckpoint) -> None:
        self._settle(ckpt.pages, b"", 0)

    # -- views for the runner ------------------------------------------------------------------------------------
    def seq_tables(self, req_id: str) -> Tables:
        """The request's block tables and running slots, built again only after its pages changed."""
        tables = self._tables.get(req_id)
        if tables is None:
            blocks = tuple(self.req_blocks.get(req_id, ()))
            slot = self.running_slot.get(req_id, PAD_SLOT_ID)
            tables = self._tables[req_id] = (
                tuple([(gid, blocks) for gid in self.attention_groups]),
                tuple([(gid, slot) for gid in self.recurrent_groups]),
            )
        return tables

    def req_pages(self, req_id: str) -> dict[int, tuple[int, ...]]:
        """Group id -> every page the request holds (what a transfer moves)."""
        blocks, slots = self.seq_tables(req_id)
        return {**dict(blocks), **{gid: (s,) for gid, s in slots if s != PAD_SLOT_ID}}

    def cached_hashes(self) -> dict[int, set[bytes]]:
        """Group id -> the hashes a hit search finds now: what replaying every event of `events` gives (the
        cache-event stream's resync snapshot)."""
        nodes = self.tree.nodes.values()
        blocks = {n.hash for n in nodes if n.page}
        states = {n.hash for n in nodes if n.ckpt is not None}
        return {**{g: set(blocks) for g in self.attention_groups}, **{g: set(states) for g in self.recurrent_groups}}

    # -- observability -------------------------------------------------------------------------------------------
    def pool_stats(self) -> list[dict[str, object]]:
        """Per group, O(1): attention groups count pages (free, in use by requests, cached: blocks and checkpoints),
        recurrent groups count slots (free, in use) and cached checkpoints."""
        pages, slots, out = self.pages, self.slots, []
        for g in self.groups:
            total, free, use = (pages.capacity, len(pages.free), self.num_in_use) if g.is_attention else (
                slots.capacity, len(slots.free), slots.capacity - len(slots.free))
            cached = total - free - use if g.is_attention else self.tree.num_checkpoints
            out.append({"group_id": g.group_id, "kind": g.kind, "total": total, "free": free, "in_use": use,
                        "cached": cached})
        return out

    def usage(self) -> dict[str, float]:
        """The share of each group's ids that requests hold (vLLM's `kv_cache_usage`; cached content counts as free,
        an idle engine reads 0). For metrics only; no decision reads it."""
        return {self.labels[s["group_id"]]: s["in_use"] / max(1, s["total"]) for s in self.pool_stats()}  # type: ignore[index, operator]

    def cache_stats(self) -> dict[str, object]:
        """Admissions, evictions and bytes held per group (by label: running vs cached)."""
        tree, pages = self.tree, self.pages
        cached_blocks = pages.capacity - len(pages.free) - self.num_in_use - pages.num_checkpoint_pages
        out: dict[str, object] = {"policy": {"admission": self.admission.name, "interval": self.policy.interval},
                                  "checkpoints_admitted": self.num_admitted, "checkpoints_cached": tree.num_checkpoints,
                                  "checkpoint_pages": pages.num_checkpoint_pages}
        for g, s in zip(self.groups, self.pool_stats(), strict=True):
            cached = cached_blocks if g.is_attention else tree.num_checkpoints
            out[self.labels[g.group_id]] = {"bytes_in_use": s["in_use"] * g.page_bytes_all_layers,  # type: ignore[operator]
                                            "bytes_cached": cached * g.page_bytes_all_layers,
                                            "evictions": tree.num_evictions[not g.is_attention]}
        return out

    def check_integrity(self) -> None:
        """The tree's invariants; a page's references are the requests listing it (an attention block), or 1 for a
        checkpoint's page (cached, pending, reserved for a transfer, quarantined); each held slot: one holder."""
        self.tree.check_integrity()
        counts = [0] * self.pages.num_pages
        for p in (q for blocks in self.req_blocks.values() for q in blocks):
            counts[p] += 1
        assert self.num_in_use == sum(1 for c in counts if c), "pages in use"
        ref, named = self.pages.ref, self.tree.page_node
        for p in range(1, self.pages.num_pages):  # (a page referenced by no holder: a checkpoint's, never a block)
            assert ref[p] == counts[p] or (not counts[p] and ref[p] == 1 and named[p] is None), (p, ref[p], counts[p])
        ckpt = [q for node in self.tree.nodes.values() for q in node.ckpt or ()]
        assert len(ckpt) == self.pages.num_checkpoint_pages and not any(counts[q] for q in ckpt)
        pend = [q for c in self.pending for q in c.pages]  # reserved, on no block nor cached checkpoint
        assert len(set(pend + ckpt)) == len(pend) + len(ckpt) and all(ref[q] == 1 and named[q] is None for q in pend)
        assert self.tree.num_reserved >= len(self.pending), "a pending checkpoint is reserved"
        held = [*self.running_slot.values(), *self.staging]  # each held slot: one holder
        assert sorted(held) == [s for s in range(1, self.slots.num_slots) if self.slots.held[s]], "slots"
