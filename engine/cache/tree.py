"""What the prefix cache keeps, and what it lets go: admission and eviction in one picture.

    admission.py picks where a request saves a state ([s@h]: a checkpoint, the state after block h):
        r:  h0  h1  h2  h3 | h4' h5' | decode ...       branch point: the end of the longest prefix seen
            \\___ hit ___/  ^ branch  ^ prompt end       before; prompt end; while decoding, a rolling
                                                        request end at each block boundary (replacing the last)
    the tree: a Node per cached block hash (page ids stay in the pools)
        root -- h0 -- h1 -- h2 -- h3 -- h4' -- h5'
                      |           \\-- h4 -- h5
                    [s@h1]      [s@h3]    [s@h5]  [s@h5']
    one heap: leaf blocks nobody references (h5, h5') + checkpoints nobody references ([s@h1], [s@h3], ...)
        priority = clock when released + compute saved per byte (0: a dead-end block, a superseded checkpoint);
        evict the lowest; clock := its priority, so old popularity ages out (GreedyDual)
    the arena (overlay.py): a checkpoint needs a free range of k blocks; with none, `make_room` evicts the lowest
        checkpoint, or the unreferenced range whose blocks (with the subtrees below them and the checkpoints they
        name) lose less per byte; a checkpoint that served a hit lately stays and the new one is skipped

Evicting a block takes the unreferenced checkpoint named by it (its chain is gone); evicting a checkpoint re-queues
its block (a dead end now). Every other group's page h (a rider) leaves with its leader's page h, so one queued item
stands for the pages of every group at one hash. Invariants are stated at the fields (`check_integrity`).

Ownership: the coordinator calls `make_room` before every allocation; the pools call `on_release` / `on_acquire`;
the managers tell it what was cached. Single-threaded (the step loop). Tensor-free.
"""

from __future__ import annotations

import heapq
from operator import itemgetter
from typing import TYPE_CHECKING

from hybridpd.engine.cache.block_pool import BlockPool

if TYPE_CHECKING:
    from hybridpd.engine.cache.overlay import Overlay

BLOCK, STATE = 0, 1
"""The two kinds of evictable items (a heap entry's key is page << 1 | kind)."""
ATTENTION_QUADRATIC_TOKENS = 8192
"""Context length at which a token's attention FLOPs equal its linear FLOPs, roughly (shapes flops_saved only)."""
REFERENCE_TOKENS = 4096
"""A state restoring this many tokens alone is valued 1.0 per its bytes (the value scale)."""
MAX_ANCHOR_WALK = 64
"""Ancestors an anchor search visits before it counts the whole prefix as this entry's (see `_anchor`)."""
RANGE_CANDIDATES = 4
"""Ranges a checkpoint's room prices, the longest unused first (pricing walks blocks and subtrees)."""
MAX_RANGE_SUBTREE = 128
"""Nodes a range's price walks below one block before it calls the block priceless (a hot shared prefix)."""
SERVED_TURNOVERS = 4
"""How long a hit protects a checkpoint against new ones: this many turnovers of the checkpoint ids..."""
SERVED_TRIES = 3 * SERVED_TURNOVERS
"""... and at most this many turnovers' worth of checkpoints tried (cached or refused): while every new checkpoint
is refused none is cached, and a hit that no longer recurs must still grow old (a hot prefix that stopped)."""
INF = float("inf")
_ORDER = itemgetter(1)


def flops_saved(tokens: int) -> float:
    """Relative compute a hit on a `tokens`-long prefix saves: linear per token plus attention's quadratic term."""
    return tokens + tokens * tokens / (2 * ATTENTION_QUADRATIC_TOKENS)


class Node:
    """One cached block hash: it exists exactly while the chain (first attention group) caches the hash or the lead
    recurrent group holds a checkpoint named by it. Page ids stay in the pools. Nodes that leave the tree are reused
    (`CacheTree._spare`): one object per block would make work for the garbage collector."""

    __slots__ = ("hash", "tokens", "parent", "kids", "kid", "ckpt", "last_hit", "last_try", "demoted")

    def __init__(self) -> None:
        self.hash = b""
        self.tokens = 0
        """Prefix length (tokens) at the end of this block."""
        self.parent: Node | None = None
        """The chain-cached node of the block before (None: the first block, or its parent was evicted): `parent`
        and `kids` link chain-cached nodes only, so a cached chain never has a hole."""
        self.kids: dict[bytes, Node] = {}
        """Chain-cached nodes whose parent this is; a block with kids is not evictable (not queued)."""
        self.kid: Node | None = None
        """The one node in `kids` when there is exactly one, else None."""
        self.ckpt = False
        """The lead state pool names a checkpoint `hash` (cached or in use)."""
        self.last_hit: int | None = None
        """`num_states_cached` when a request last took this node's checkpoint (or, attention-only, its block)."""
        self.last_try = 0
        """`num_states_cached + num_checkpoints_skipped` then."""
        self.demoted = False
        """A deeper checkpoint of the same request supersedes this one on an unbranched path: valued 0."""


class CacheTree:
    def __init__(
        self,
        attention: list[BlockPool],
        state: list[BlockPool],
        budget_bytes: int,
        alpha: float = 1.0,
        block_size: int = 16,
        overlay: Overlay | None = None,
    ) -> None:
        """`attention` / `state`: every group's pool of that kind, the leader (chain / lead state) first; the others
        ride along (a rider names h only while its leader does). `overlay`: the arena's, if there is one."""
        self.chain: BlockPool | None = attention[0] if attention else None
        self.state: BlockPool | None = state[0] if state else None
        self.pool_of = (self.chain, self.state)
        """Kind (BLOCK, STATE) -> the leader pool whose pages are queued."""
        self.kind_of = {id(p): k for k, p in enumerate(self.pool_of) if p is not None}
        self.pools = [*attention, *state]
        self.riders = [attention[1:], state[1:]]
        self.leader_of = {id(p): g[0] for g in (attention, state) for p in g}
        self._state_ids = {id(p) for p in state}
        self.budget_bytes = budget_bytes
        """Held pages (in use + cached, every pool) x page bytes never exceed this."""
        self.block_size = block_size
        self.overlay = overlay
        self.unit_bytes = [sum(p.page_bytes for p in g) for g in (attention, state)]
        """Kind -> bytes of one item (the leader's page and its riders' pages at one hash; arena: what it covers)."""
        if overlay is not None and state and attention:
            self.unit_bytes[STATE] = overlay.k * self.unit_bytes[BLOCK]
        self._scale = alpha * max(self.unit_bytes[STATE if state else BLOCK], 1) / flops_saved(REFERENCE_TOKENS)
        self.queued: tuple[dict[int, tuple[float, int, float]], ...] = ({}, {})
        """Kind -> {page: (priority, release order, clock when queued)}: the live entries of `_heap`; exactly the
        unreferenced leader pages that are checkpoints or leaf blocks (no kids)."""
        self._heap: list[tuple[float, int, int]] = []
        """(priority, release order, page << 1 | kind): one lazy min-heap; entries not in `queued` are stale."""
        self._state_heap: list[tuple[float, int, int]] = []
        """(priority, release order, slot): the checkpoints' entries again, so the lowest checkpoint under a block at
        the top of `_heap` is found without a scan (the arena prices ranges against it)."""
        self._order = 0
        self.version = 0
        """Counts changes to the queue (with the pools' versions: the failed-room memo's "nothing changed")."""
        self.nodes: dict[bytes, Node] = {}
        self._spare = [Node() for _ in range(sum(p.capacity for p in self.pool_of if p is not None))]
        """Nodes that left the tree (unlinked, no kids), reused by `_node`."""
        self.clock = 0.0
        self.num_states_cached = 0
        """Checkpoints cached so far: the clock that ages a checkpoint's hits (`_since_hit`)."""
        ids = overlay.num_ranges if overlay is not None else (self.state.capacity if self.state else 0)
        self.served_window = SERVED_TURNOVERS * ids
        self.served_tries = SERVED_TRIES * ids
        self.num_checkpoints_skipped = 0
        self._failed_room: tuple[object, int] | None = None
        """Arena: (needs, `_version()`) of the last checkpoint room that failed: it fails again until a change."""
        self._since_refresh = 0
        for p in self.pools:
            p.listener = self

    # -- the heap ------------------------------------------------------------------------------------------------
    def _queue(self, kind: int, page: int, base: float, priority: float) -> None:
        self.version += 1
        self._order = order = self._order + 1
        queued = self.queued
        queued[kind][page] = (priority, order, base)
        heap = self._heap
        heapq.heappush(heap, (priority, order, page << 1 | kind))
        if kind == STATE:
            states = self._state_heap
            heapq.heappush(states, (priority, order, page))
            if len(states) > 4 * len(queued[STATE]) + 64:  # mostly stale: rebuild both
                self._rebuild(lambda kind, page, entry: entry[0])
                return
        if len(heap) > 4 * (len(queued[0]) + len(queued[1])) + 64:  # mostly stale: rebuild
            self._rebuild(lambda kind, page, entry: entry[0])

    def _discard(self, kind: int, page: int) -> None:
        self.version += 1
        self.queued[kind].pop(page, None)

    def _rebuild(self, priority_of: object) -> None:
        """The heap again from the live entries, each at `priority_of(kind, page, entry)`, release order kept."""
        heap = []
        for kind, q in enumerate(self.queued):
            for page, entry in q.items():
                prio = priority_of(kind, page, entry)  # type: ignore[operator]
                q[page] = (prio, entry[1], entry[2])
                heap.append((prio, entry[1], page << 1 | kind))
        heapq.heapify(heap)
        self._heap = heap
        self._state_heap = [(prio, order, key >> 1) for prio, order, key in heap if key & 1 == STATE]
        heapq.heapify(self._state_heap)

    def _lowest(self, kind: int | None = None) -> tuple[int, int, float] | None:
        """(kind, page, priority) of the lowest queued item (of `kind` only, when given)."""
        heap, queued = self._heap, self.queued
        while heap:
            prio, order, key = heap[0]
            entry = queued[key & 1].get(key >> 1)
            if entry is not None and entry[1] == order:
                break
            heapq.heappop(heap)
        else:
            return None
        if kind is None or key & 1 == kind:
            return key & 1, key >> 1, prio
        if not queued[kind]:
            return None
        if kind == STATE:  # the top is a block: the checkpoints' own heap (same order: priority, release order)
            states, live = self._state_heap, queued[STATE]
            while states:
                prio, order, slot = states[0]
                entry = live.get(slot)
                if entry is not None and entry[1] == order:
                    return STATE, slot, prio
                heapq.heappop(states)
            return None
        page, entry = min(queued[kind].items(), key=_ORDER)  # the top is a checkpoint: scan the blocks' entries
        return kind, page, entry[0]

    def refresh(self) -> None:
        """Recompute every queued item's value against the tree as it is now (keeping its recency)."""
        self._since_refresh = 0
        self.version += 1
        names = [p.block_hash if p is not None else [] for p in self.pool_of]
        value = {names[STATE][s]: self._value(STATE, names[STATE][s]) for s in self.queued[STATE]}

        nodes, get_value, value_of = self.nodes, value.get, self._value
        dead_end = BLOCK if self.state is not None else -1  # (attention-only: every block is valued by its walk)

        def priority(kind: int, page: int, entry: tuple[float, int, float]) -> float:
            h = names[kind][page]  # a leaf block with a queued checkpoint is valued as that checkpoint
            v = get_value(h)
            if v is None:  # a dead-end block (no checkpoint at h) is worth 0: `_value` without the call
                v = 0.0 if kind == dead_end and not nodes[h].ckpt else value_of(kind, h)
            return entry[2] + v

        self._rebuild(priority)

    # -- budget ------------------------------------------------------------------------------------------------
    def held_bytes(self) -> int:
        """Bytes of the pages that hold something (in use or cached), every pool."""
        return sum(p.held_bytes() for p in self.pools)

    def make_room(self, needs: list[tuple[BlockPool, int]], checkpoint: bool = False) -> bool:
        """Evict the lowest items until every pool has its `n` free ids and the budget room for them; False when it
        cannot (what went stays gone: it was cache). `checkpoint`: state ids for checkpoints (not running slots)."""
        if self.overlay is not None:
            return self._make_room_arena(needs, checkpoint)
        if not any(n for _, n in needs):
            return True
        room = self.budget_bytes - sum(n * p.page_bytes for p, n in needs)
        while True:
            short = {self.kind_of[id(self.leader_of[id(p)])] for p, n in needs if p.num_plain < n}
            if not short and self.held_bytes() <= room:
                return True
            victim = self._lowest(short.pop() if len(short) == 1 else None)
            if victim is None:
                return False
            self._evict_victim(victim)

    def _make_room_arena(self, needs: list[tuple[BlockPool, int]], checkpoint: bool) -> bool:
        """State ids first (freeing ranges: `_arena_victim`), then the attention blocks besides the ranges taken."""
        asked = tuple((id(p), n) for p, n in needs) if checkpoint else ()
        if checkpoint and self._failed_room == (asked, self._version()):
            self.num_checkpoints_skipped += 1  # nothing changed since the same room failed: it fails again
            return False
        states = [(p, n) for p, n in needs if n and id(p) in self._state_ids]
        while not all(p.available(checkpoint) >= n for p, n in states):
            victim = self._arena_victim(checkpoint)
            if victim is None:
                if checkpoint:
                    self.num_checkpoints_skipped += 1
                    self._failed_room = (asked, self._version())
                return False
            if victim is not True:
                self._evict_victim(victim)  # type: ignore[arg-type]
        taken = self.overlay.k * max((p.overlay_needed(n, checkpoint) for p, n in states), default=0)  # type: ignore
        for p, n in needs:
            while n and id(p) not in self._state_ids and p.num_plain - taken < n:
                victim = self._lowest()
                if victim is None:
                    return False
                self._evict_victim(victim)
        return True

    def _arena_victim(self, checkpoint: bool) -> tuple[int, int, float] | bool | None:
        """What frees a range: the lowest checkpoint, or (True) a range evicted here; None: nothing may go."""
        victim = self._lowest()
        if victim is not None and victim[0] == STATE:
            return victim
        lowest = self._lowest(STATE) if self.state is not None else None
        c = self._pick_range(lowest[2] if lowest is not None else None, not checkpoint)
        if c is not None:
            self._evict_range(c)
            return True
        if checkpoint and lowest is not None:
            since = self._since_hit(lowest[1])
            if since is not None and self._tries_since_hit(lowest[1]) <= self.served_tries:  # it served a hit
                if SERVED_TURNOVERS * since > self.served_window:  # lately: it stays, the new, speculative one is
                    self.clock = max(self.clock, lowest[2])  # skipped; kept on an old hit, time moves on (old
                return None  # popularity ages out)
        return lowest

    def _evict_victim(self, victim: tuple[int, int, float]) -> None:
        """Evict `_lowest`'s answer; once per queue turnover, re-value the queue (`refresh`)."""
        self.evict(*victim)
        self._since_refresh += 1
        if self._since_refresh > 1024 and self._since_refresh > 4 * (len(self.queued[0]) + len(self.queued[1])):
            self.refresh()

    def _version(self) -> int:
        return sum(p.version for p in self.pools) + self.version

    def _since_hit(self, slot: int) -> int | None:
        """Checkpoints cached since the one in `slot` was last restored (None: never, or superseded since)."""
        node = self.nodes.get(self.state.block_hash[slot])  # type: ignore[union-attr, arg-type]
        if node is None or node.last_hit is None or node.demoted:
            return None
        return self.num_states_cached - node.last_hit

    def _tries_since_hit(self, slot: int) -> int:
        """Checkpoints cached or refused since the one in `slot` was last restored (it has been: `_since_hit`). The
        refused count too: while every new checkpoint is refused, a hit must still grow old."""
        node = self.nodes[self.state.block_hash[slot]]  # type: ignore[union-attr, index]
        return self.num_states_cached + self.num_checkpoints_skipped - node.last_try

    # -- ranges (arena) ----------------------------------------------------------------------------------------
    def _pick_range(self, below: float | None, priceless_ok: bool) -> int | None:
        """Among the RANGE_CANDIDATES longest unused ranges with no referenced block, the one whose eviction loses
        least per byte (ties: longest unused, most free blocks). None when none is cheaper than `below` (the lowest
        checkpoint's priority: that one goes instead), or only priceless ones are left and not `priceless_ok`."""
        ov = self.overlay
        assert ov is not None
        bound = INF if below is None else max(0.0, below - self.clock)
        age, nplain = ov.age, ov.nplain
        best, best_key = None, (INF, 0, 0)
        # no free range is left here, so the unreferenced ones each hold a cached block: ages are distinct clocks
        for c in sorted(ov.unreferenced, key=age.__getitem__)[:RANGE_CANDIDATES]:
            cost = self._range_cost(c, bound)
            key = (cost, age[c], -nplain[c])
            if cost <= bound and (best is None or key < best_key):
                best, best_key, bound = c, key, cost
        if best is not None and best_key[0] == INF and not priceless_ok:
            return None
        return best

    def _range_cost(self, c: int, bound: float) -> float:
        """Credit per byte that evicting range c loses: every cached block in it, with its subtree when it has
        kids (a block below an evicted one is unreachable), and the checkpoints they name; stops past `bound`."""
        chain, ov = self.chain, self.overlay
        assert chain is not None and ov is not None
        blocks = ov.blocks_of(c)
        total = ov.k * self.unit_bytes[BLOCK]
        limit, credit = bound * total, 0.0
        names, cached, nodes = chain.block_hash, chain.cached, self.nodes
        for h in names[blocks.start : blocks.stop]:
            if h is None:
                continue
            node = nodes[h]
            if node.kids and node.parent is not None and cached[node.parent.hash] in blocks:
                continue  # its parent, in the range too, covers it
            credit += self._subtree_credit(node, limit - credit)
            if credit > limit:
                break
        return credit / total

    def _subtree_credit(self, top: Node, limit: float) -> float:
        """Remaining worth (priority - clock) x bytes of `top`'s subtree: its queued blocks and the checkpoints
        they name; INF when one is referenced or past MAX_RANGE_SUBTREE nodes; stops once above `limit`."""
        cached, clock = self.chain.cached, self.clock  # type: ignore[union-attr]
        states = self.state.cached if self.state is not None else {}
        block_q, state_q = self.queued
        block_bytes, state_bytes = self.unit_bytes
        credit, stack, seen = 0.0, [top], 0
        pop, push = stack.pop, stack.extend
        while stack:
            node = pop()
            seen += 1
            kid = node.kid
            while kid is not None and not node.ckpt:  # a plain stretch: no credit, nothing queued
                if seen >= MAX_RANGE_SUBTREE:
                    return INF
                node, kid = kid, kid.kid  # (its one kid: the stack would pop it next)
                seen += 1
            if seen > MAX_RANGE_SUBTREE:
                return INF
            h, kids = node.hash, node.kids
            if kids:
                push(kids.values())
                if not node.ckpt:
                    continue  # not queued (it has kids) and no checkpoint: no credit
            entry = block_q.get(cached[h])
            one = (entry[0] - clock) * block_bytes if entry is not None and entry[0] > clock else 0.0
            slot = states.get(h)
            if slot is not None:
                entry = state_q.get(slot)
                if entry is None:
                    return INF  # a referenced checkpoint: the range is priceless
                if entry[0] > clock:
                    one += (entry[0] - clock) * state_bytes
            credit += one
            if credit > limit:
                return credit
        return credit

    def _evict_range(self, c: int) -> None:
        """Evict every cached block of range c (none is referenced) in every attention pool."""
        assert self.overlay is not None
        self.overlay.num_range_evictions += 1
        for pool in [self.chain, *self.riders[BLOCK]]:
            for b in self.overlay.blocks_of(c):
                h = pool.block_hash[b]
                if h is None or pool.ref_cnt[b]:
                    continue
                if pool is not self.chain:
                    pool.evict(b)  # a rider's page alone: its group only serves shorter hits
                else:
                    self._evict_subtree(self.nodes[h])

    def _evict_subtree(self, top: Node) -> None:
        """Evict the chain's block `top` and every unreferenced cached block below it, deepest first; a referenced
        one stays, cut off as the head of an unreachable chain."""
        order, stack = [], [top]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(node.kids.values())
        chain = self.chain
        assert chain is not None
        for node in reversed(order):
            page = chain.cached.get(node.hash)
            if page is None:
                continue
            if chain.ref_cnt[page] == 0:
                self.evict(BLOCK, page)
            else:
                self._unlink(node)

    # -- eviction ----------------------------------------------------------------------------------------------
    def evict(self, kind: int, page: int, prio: float | None = None, count: bool = True) -> None:
        """Drop an unreferenced cached page (count=False: a deliberate drop, e.g. a superseded checkpoint); the
        clock rises to `prio`, the evicted item's priority."""
        if prio is not None and prio > self.clock:
            self.clock = prio
        if kind == BLOCK:
            self._evict_block(page, count)
        else:
            self._evict_state(page, count)

    def _evict_block(self, page: int, count: bool) -> None:
        """The chain's page goes, with the unreferenced checkpoint named by it (its chain is gone)."""
        chain = self.chain
        h = chain.block_hash[page]  # type: ignore[union-attr]
        self.queued[BLOCK].pop(page, None)
        chain.evict(page, count)  # type: ignore[union-attr]
        if self.riders[BLOCK]:
            self._drop_riders(BLOCK, h, count)  # type: ignore[arg-type]
        node = self.nodes[h]  # type: ignore[index]
        if node.parent is not None:
            self._unlink(node)
        state = self.state
        slot = state.cached.get(h) if state is not None else None  # type: ignore[arg-type]
        if slot is None:
            self._spare.append(self.nodes.pop(h))  # type: ignore[arg-type]
        elif state.ref_cnt[slot] == 0:  # type: ignore[union-attr]
            self._evict_state(slot, True)  # takes the node
        # else: a referenced checkpoint keeps the node

    def _evict_state(self, slot: int, count: bool) -> None:
        """The lead state pool's checkpoint goes; the block it ended on may now be a dead end."""
        state = self.state
        h = state.block_hash[slot]  # type: ignore[union-attr]
        self.queued[STATE].pop(slot, None)
        state.evict(slot, count)  # type: ignore[union-attr]
        if self.riders[STATE]:
            self._drop_riders(STATE, h, count)  # type: ignore[arg-type]
        chain = self.chain
        if chain is None or h not in chain.cached:
            self._spare.append(self.nodes.pop(h))  # type: ignore[arg-type]
        else:
            self.nodes[h].ckpt = False  # type: ignore[index]
            self._requeue_block(h)  # type: ignore[arg-type]

    def _drop_riders(self, kind: int, h: bytes, count: bool) -> None:
        """The leader's page h is gone: every rider's page h goes too (in use or not: it just loses its name)."""
        for rider in self.riders[kind]:
            page = rider.lookup(h)
            if page is None:
                continue
            rider.evict(page, count and rider.ref_cnt[page] == 0)

    def _unlink(self, node: Node) -> None:
        parent = node.parent
        if parent is None:
            return
        node.parent = None
        kids = parent.kids
        del kids[node.hash]
        if kids:
            if len(kids) == 1:
                (parent.kid,) = kids.values()
            return
        parent.kid = None
        h = parent.hash
        chain = self.chain
        b = chain.cached.get(h)  # type: ignore[union-attr]
        if b is not None and chain.ref_cnt[b] == 0:  # type: ignore[union-attr]
            self._push_leaf(b, parent)  # a new leaf

    # -- events from the pools and the managers ---------------------------------------------------------------
    def on_release(self, pool: BlockPool, page: int) -> None:
        h = pool.block_hash[page]
        assert h is not None
        if pool is self.chain:
            node = self.nodes[h]
            if not node.kids:  # (else not a leaf: queued when its last kid goes)
                self._push_leaf(page, node)
        elif pool is self.state:
            self._push(STATE, page, h)
        elif self.leader_of[id(pool)].lookup(h) is None:  # a rider: leaves with its leader's page, or now if the
            pool.evict(page, count=False)  # leader lost h

    def on_acquire(self, pool: BlockPool, page: int) -> None:
        kind = self.kind_of.get(id(pool))
        if kind is None:
            return  # a rider: never queued
        self._discard(kind, page)
        h = pool.block_hash[page]
        if h is not None and (kind == STATE or self.state is None):
            node = self.nodes[h]
            node.last_hit = self.num_states_cached  # a restore (or, attention-only, a block reuse)
            node.last_try = self.num_states_cached + self.num_checkpoints_skipped
            node.demoted = False  # restored: a real reuse point after all

    def _node(self, h: bytes, tokens: int) -> Node:
        node = self.nodes.get(h)
        if node is None:
            node = self.nodes[h] = self._spare.pop() if self._spare else Node()
            node.hash, node.tokens, node.ckpt, node.last_hit, node.demoted = h, tokens, False, None, False
        return node

    def on_block_cached(self, h: bytes, parent: bytes | None, tokens: int) -> None:
        """The chain named a block `h` (its chain parent is `parent`, None for the first block)."""
        nodes = self.nodes
        node = nodes.get(h)
        if node is None:  # (`_node`, inlined: once per cached block)
            node = nodes[h] = self._spare.pop() if self._spare else Node()
            node.hash, node.tokens, node.ckpt, node.last_hit, node.demoted = h, tokens, False, None, False
        elif node.parent is not None:
            return  # linked already
        pb = self.chain.cached.get(parent) if parent is not None else None  # type: ignore[union-attr]
        if pb is None:
            return  # a first block, or the parent is gone (this block heads an unreachable chain)
        up = nodes[parent]  # type: ignore[index]
        node.parent = up
        kids = up.kids
        kids[h] = node
        up.kid = node if len(kids) == 1 else None
        self.queued[BLOCK].pop(pb, None)  # no longer a leaf

    def on_state_cached(self, h: bytes, tokens: int) -> None:
        """A checkpoint (state after `tokens` tokens) was named `h`: the block it ends on is no dead end now."""
        self._node(h, tokens).ckpt = True
        self.num_states_cached += 1
        self._requeue_block(h)

    def demote(self, h: bytes) -> None:
        """The checkpoint `h` lies on a path a deeper checkpoint of the same request now ends, with no branch at
        `h`: it keeps only its recency (Marconi: states off branch points are rarely reused). A restore undoes it."""
        node = self.nodes.get(h)
        slot = self.state.lookup(h) if self.state is not None else None
        if node is None or slot is None or len(node.kids) > 1:
            return
        node.demoted = True
        entry = self.queued[STATE].get(slot)
        if entry is not None:
            self._queue(STATE, slot, entry[2], entry[2])
        self._requeue_block(h)

    def _requeue_block(self, h: bytes) -> None:
        chain = self.chain
        b = chain.cached.get(h) if chain is not None else None
        if b is not None and chain.ref_cnt[b] == 0 and not self.nodes[h].kids:  # type: ignore[union-attr]
            self._push(BLOCK, b, h)

    def _push_leaf(self, page: int, node: Node) -> None:
        """`_push` of a leaf block; a dead end (no checkpoint at it, recurrent groups present) is worth 0 without
        asking `_value`: most blocks, once per block released or left as a leaf."""
        clock = self.clock
        if self.state is not None and not node.ckpt:
            self._queue(BLOCK, page, clock, clock)
        else:
            self._queue(BLOCK, page, clock, clock + self._value(BLOCK, node.hash))

    def _push(self, kind: int, page: int, h: bytes) -> None:
        clock = self.clock
        self._queue(kind, page, clock, clock + self._value(kind, h))

    # -- value -------------------------------------------------------------------------------------------------
    def _value(self, kind: int, h: bytes | None) -> float:
        """Compute saved per byte by keeping item `h` of `kind` (0 for a dead-end block or a demoted checkpoint):
        the FLOPs between the nearest anchor and this boundary, over the state plus the blocks in between."""
        node = self.nodes.get(h) if h is not None else None
        if node is None or node.demoted:
            return 0.0
        if kind == BLOCK and self.state is not None:
            if not node.ckpt:
                return 0.0  # dead end: no hit can stop here
            kind = STATE  # a leaf block with a checkpoint is valued as that checkpoint
        tokens, anchor = node.tokens, self._anchor(node)
        if tokens <= anchor:
            return 0.0
        nbytes = self.unit_bytes[kind]
        if self.chain is not None:
            nbytes += (tokens - anchor) // self.block_size * self.unit_bytes[BLOCK]
        return self._scale * (flops_saved(tokens) - flops_saved(anchor)) / max(nbytes, 1)

    def _anchor(self, node: Node) -> int:
        """Tokens at the nearest ancestor that is a cached checkpoint or a branch point (0: the root, or none within
        MAX_ANCHOR_WALK ancestors): what a hit would fall back to without this entry."""
        p = node.parent
        for _ in range(MAX_ANCHOR_WALK):
            if p is None:
                return 0
            if p.kid is None or p.ckpt:  # (p has a kid, the node below: no `kid` means several)
                return p.tokens
            p = p.parent
        return 0

    # -- integrity ---------------------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """The invariants of the module docstring."""
        assert self.held_bytes() <= self.budget_bytes, (self.held_bytes(), self.budget_bytes)
        for r in self.pools:
            leader = self.leader_of[id(r)]
            assert r is leader or all(leader.lookup(h) is not None for h in r.cached), (r.name, "rider names more")
        live = {
            (prio, order, page << 1 | kind)
            for kind, q in enumerate(self.queued)
            for page, (prio, order, _) in q.items()
        }
        assert live <= set(self._heap), "every queued item has its heap entry"
        states = {(prio, order, slot << 1 | STATE) for prio, order, slot in self._state_heap}
        assert {e for e in live if e[2] & 1 == STATE} <= states, "every queued checkpoint has its checkpoint-heap entry"
        for kind, p in enumerate(self.pool_of):
            if p is None:
                continue
            queued = self.queued[kind]
            assert all(p.ref_cnt[b] == 0 and p.block_hash[b] is not None for b in queued), p.name
            for b in range(1, p.num_blocks):
                h = p.block_hash[b]
                if h is not None and not p.ref_cnt[b]:
                    leaf = kind == STATE or not self.nodes[h].kids
                    assert (b in queued) == leaf, (p.name, b, leaf)
        names = {h for p in self.pool_of if p is not None for h in p.cached}
        assert names == self.nodes.keys(), "a node for every cached hash, and only those"
        for h, node in self.nodes.items():
            assert node.hash == h
            if node.parent is not None:
                assert node.parent.kids.get(h) is node and self.chain.lookup(h) is not None  # type: ignore[union-attr]
                assert self.chain.lookup(node.parent.hash) is not None  # type: ignore[union-attr]
            assert all(k.parent is node for k in node.kids.values())
            assert node.kid is (next(iter(node.kids.values())) if len(node.kids) == 1 else None), "the one kid"
            assert node.ckpt == (self.state is not None and h in self.state.cached), "ckpt"
        for n in self._spare:
            assert n.parent is None and not n.kids and n.kid is None and self.nodes.get(n.hash) is not n, "spare"
        if self.overlay is not None:
            self.overlay.check_integrity()
