"""One memory budget for attention blocks and recurrent states, and the policy that frees room in it.

    budget >= sum over pools of (pages held: in use + cached) * page bytes        (checked by check_integrity)

    attention chain (block hashes)        h0 -- h1 -- h2 -- h3            cached blocks, linked parent -> child
                                                      \\-- h2' -- h3'
    checkpoints (state after the block)          [s@h1]       [s@h3]  [s@h3']

Consistency between blocks and states ("value" policy):
- only *leaf* blocks (no cached child) are evictable, so a cached chain never has a hole;
- evicting a block also evicts the unreferenced checkpoint named by it (a state whose chain is gone is useless);
- a leaf block with no checkpoint at its end is a dead end (no hit can stop there) and is valued 0, so it goes
  first; when a checkpoint is evicted, the block it ended on is re-queued as such;
- everything else is ordered by eviction.py: recency + compute saved per byte; a checkpoint that a deeper one of
  the same request supersedes on an unbranched path is `demote`d to recency only.
Hash-only bookkeeping (parent, children, tokens) lives here; the pools keep their ids, refs and hash maps.

Several groups: the first attention pool is the *chain* (the tree above is built from its blocks; only its blocks
are queued) and the first state pool *leads* the checkpoints (only its slots are queued). Every other pool *rides
along*: its page named h exists only while its leader holds h (managers.py names it only then), is never queued on
its own, and leaves with its leader's page (`_drop_riders`: evicting the chain's block h drops every other
attention group's block h, and the lead checkpoint h the other recurrent groups' checkpoints h). A rider page that
is released after its leader lost h is dropped at once. So one queue entry stands for a unit (the page of every
group at one hash), valued by the bytes of the whole unit, and the budget counts every pool's pages:

    hash h:   chain block  [g0: b7]   riders [g1: b7']          lead state [g2: s3]   riders [g3: s5]
              queued (leaf rule)      evicted with g0's b7     queued               evicted with g2's s3

One arena (overlay.py): checkpoint slots share memory with ranges of k attention blocks. The budget is then the
memory itself (a held checkpoint holds its k blocks, so it is charged k blocks); a checkpoint needs a *free range*,
and when there is none `make_room` evicts the lowest-priority checkpoint (its range comes free) when that is the
lowest page of all; else the range with no referenced block whose eviction loses least, priced per byte like a
page (the remaining worth, priority - clock, of its blocks, the subtrees below them and the checkpoints they name:
`_pick_range`), when it is cheaper than the lowest checkpoint (`_evict_range`: a block takes its cached
descendants with it, a chain below it being unreachable); else that checkpoint, unless it served a hit recently
(within the last `served_window` checkpoints cached: popularity ages out): then the new checkpoint (admission's
guess) is skipped, as it is when nothing can go (`num_checkpoints_skipped`). When
attention is short, evicting a checkpoint frees k blocks, so both queues are candidates.

The "lru" policy (the baselines) queues every unreferenced cached page by release order, across both pools, with
no leaf rule and no cascade (vLLM's free-queue order).

Ownership: the coordinator owns one Reclaimer and calls `make_room` before every allocation; the pools call
`on_release` / `on_acquire` (this is their listener). Single-threaded (the step loop). Tensor-free.
"""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING

from hybridpd.engine.cache.block_pool import BlockPool
from hybridpd.engine.cache.eviction import EvictionQueue, ValueModel

if TYPE_CHECKING:
    from hybridpd.engine.cache.overlay import Overlay

POLICIES = ("value", "lru")
MAX_ANCHOR_WALK = 64
"""Blocks an anchor search walks up before it counts the whole prefix as this entry's (see `_anchor`)."""
RANGE_CANDIDATES = 4
"""Ranges a checkpoint's room prices, the longest unused first (pricing walks blocks and subtrees)."""
MAX_RANGE_SUBTREE = 128
"""Nodes a range's price walks below one block before it calls the block priceless (a hot shared prefix)."""
SERVED_TURNOVERS = 4
"""How long a hit protects a checkpoint against new ones: this many turnovers of the checkpoint ids (cached
checkpoints counted). On `current` (benchmarks/cache_manager.py) 4 and 8 keep every decision, 2 loses 0.6 % of the
hits: recurring prefixes are restored about every 400-2,200 checkpoints there."""
_NO_JUMP = b"/no jump/"
"""`_jump.get` default (compared by identity; never a block hash, which is 16 bytes)."""


class Reclaimer:
    def __init__(
        self, attention: list[BlockPool], state: list[BlockPool], budget_bytes: int, policy: str = "value",
        alpha: float = 1.0, block_size: int = 16, overlay: Overlay | None = None,
    ) -> None:
        """`attention` / `state`: every group's pool of that kind, the leader (chain / lead state) first.
        `overlay`: the arena's, when checkpoint slots share memory with attention blocks."""
        if policy not in POLICIES:
            raise ValueError(f"eviction policy must be one of {POLICIES}, got {policy!r}")
        self.attention: BlockPool | None = attention[0] if attention else None
        self.state: BlockPool | None = state[0] if state else None
        self.riders: dict[int, list[BlockPool]] = {id(g[0]): g[1:] for g in (attention, state) if g}
        """leader pool -> the pools whose pages ride along with its pages."""
        self.leader_of: dict[int, BlockPool] = {id(p): g[0] for g in (attention, state) for p in g}
        self.pools = [*attention, *state]
        self.leaders = [p for p in (self.attention, self.state) if p is not None]
        self.budget_bytes = budget_bytes
        self.policy = policy
        order = itertools.count()  # one release order for both pools: ties compare across them
        self.queues: dict[int, EvictionQueue] = {id(p): EvictionQueue(order) for p in self.leaders}
        self._chain_queue = self.queues[id(self.attention)] if self.attention is not None else None
        self._capacity_bytes = sum(p.capacity * p.page_bytes for p in self.pools)
        """Bytes of every page of every pool: held = this - the free (plain) pages' bytes."""
        self.unit_bytes = {id(g[0]): sum(p.page_bytes for p in g) for g in (attention, state) if g}
        """leader pool -> bytes of one unit (its page and its riders' pages at the same hash)."""
        self.overlay = overlay
        self.attention_pools = list(attention)
        self._state_ids = {id(p) for p in state}
        if overlay is not None and self.state is not None and self.attention is not None:
            self.unit_bytes[id(self.state)] = overlay.k * self.unit_bytes[id(self.attention)]  # what it covers
        self.kids: dict[bytes, set[bytes]] | None = {} if overlay is not None and policy == "value" else None
        """Arena, "value": parent -> cached children (a range eviction takes a block's subtree)."""
        self.num_checkpoints_skipped = 0
        """Arena: checkpoints not taken because no range could be freed (each only costs hits)."""
        self._failed_room: tuple[tuple[tuple[int, int], ...], int] | None = None
        """Arena: (needs, `_version()`) of the last checkpoint's room that failed: until a pool or a queue changes,
        the next one fails the same way (`_make_room_arena`)."""
        ref_bytes = self.unit_bytes[id(self.state if self.state is not None else self.attention)]
        self.values = ValueModel(ref_bytes, alpha)
        self.clock = 0.0
        """Recency (GreedyDual): the priority of the last page evicted; pages released now are queued above it."""
        self.parent: dict[bytes, bytes] = {}
        self.children: dict[bytes, int] = {}
        self.tokens: dict[bytes, int] = {}
        """Prefix length (tokens) at the end of the block / at the checkpoint named by a hash."""
        self.last_hit: dict[bytes, int] = {}
        """hash -> `num_states_cached` when a request last took its cached page (a restore / a reuse)."""
        self.num_states_cached = 0
        """Checkpoints cached so far: the clock that ages a checkpoint's hits (see `_served`)."""
        self.served_window = SERVED_TURNOVERS * (overlay.num_ranges if overlay is not None
                                                 else (state[0].capacity if state else 0))
        """A checkpoint that served a hit within the last this many checkpoints cached outranks a new one; older
        hits no longer count (a workload shift ages them out)."""
        self.demoted: set[bytes] = set()
        """Checkpoints a deeper one on the same unbranched path supersedes: valued 0 (recency only)."""
        self.block_size = block_size
        self.base: dict[tuple[int, int], float] = {}
        """(pool, page) -> clock when it was queued (its recency)."""
        self._since_refresh = 0
        self._jump: dict[bytes, bytes | None] = {}
        """Anchor walks: node -> where the last walk through it ended (see `_anchor`); cleared when a node with
        descendants becomes a branch point or a checkpoint (a walk that skipped over it is out of date)."""
        self._down: dict[bytes, tuple[bytes, int, int]] = {}
        """Range pricing: a *plain* node (one child, no checkpoint: it adds no credit) -> (a node further down its
        plain stretch, the nodes a walk pops to get there, that node's link stamp); see `_plain_stretch`."""
        self._linked: dict[bytes, int] = {}
        """node -> stamp of the moment it was linked under its parent (a new stamp each time it is linked)."""
        self._link_order = itertools.count()
        self._going: set[bytes] = set()
        """`_evict_subtree`: the blocks it is evicting (deepest first)."""
        self.evicted_bytes = {"attention": 0, "state": 0}
        self.num_evicted = {"attention": 0, "state": 0}
        for p in self.pools:
            p.listener = self

    # -- budget ------------------------------------------------------------------------------------------------
    def held_bytes(self) -> int:
        """Bytes of the pages that hold something (in use or cached), every pool."""
        if self.overlay is not None:
            return sum(p.held_bytes() for p in self.pools)
        held = self._capacity_bytes
        for p in self.pools:
            held -= p.num_plain * p.page_bytes
        return held

    def make_room(self, needs: list[tuple[BlockPool, int]], checkpoint: bool = False) -> bool:
        """Evict the lowest-priority pages until every pool has `n` free ids and the budget has room for all of
        them. False when it cannot (what was evicted stays evicted: it was only cache). `checkpoint`: the state
        pools' ids are for checkpoints (arena: not the running slots)."""
        if self.overlay is not None:
            return self._make_room_arena(needs, checkpoint)
        extra = sum(n * p.page_bytes for p, n in needs)
        if extra == 0:
            return True
        room = self.budget_bytes - extra
        value = self.policy == "value"
        while True:
            short = [p for p, n in needs if p.num_plain < n]
            if not short and self.held_bytes() <= room:
                return True
            victim = self._lowest(self._leaders_of(short) if short else self.leaders)
            if victim is None:
                return False
            self.evict(*victim)
            self._since_refresh += 1
            if value and self._since_refresh > 1024 and self._since_refresh > 4 * self.num_queued():
                self.refresh()

    def _make_room_arena(self, needs: list[tuple[BlockPool, int]], checkpoint: bool) -> bool:
        """Free ids are memory here (the pools' counts are the budget): see the module docstring."""
        if checkpoint:
            asked = tuple((id(p), n) for p, n in needs)
            if self._failed_room == (asked, self._version()):
                self.num_checkpoints_skipped += 1  # nothing changed since the same room failed: it fails again
                return False
        value = self.policy == "value"
        states = self._state_ids
        k = self.overlay.k  # type: ignore[union-attr]
        state_needs = [(p, n) for p, n in needs if n and id(p) in states]  # (n = 0 takes no range, is never short)
        attn_needs = [(p, n) for p, n in needs if n and id(p) not in states]
        leaders = self.leaders
        while True:
            # ranges the state pools will take (riders share their leader's): their blocks are not for attention
            ranges = 0
            state_short = False
            for p, n in state_needs:
                r = p.overlay_needed(n, checkpoint)  # type: ignore[attr-defined]
                if r > ranges:
                    ranges = r
                if n and not state_short and p.available(checkpoint) < n:
                    state_short = True
            if not state_short:
                # Evictions only free ids and ranges, and never a running slot: the state pools stay served and
                # take the same ranges, so only attention is left to fill.
                return self._fill_attention(attn_needs, k * ranges)
            victim = self._lowest(leaders)
            if victim is None or victim[0] is not self.state:
                lowest_state = self._lowest([self.state]) if self.state is not None else None
                c = self._pick_range(lowest_state[2] if lowest_state is not None else None, not checkpoint)
                if c is not None:
                    self._evict_range(c)
                    continue
                victim = lowest_state
                if checkpoint and victim is not None and value and self._served(victim[1]):
                    if self._stale(victim[1]):  # kept on an old hit: the refused newcomer ranked below it,
                        self.clock = max(self.clock, victim[2])  # so time moves on (old popularity ages out)
                    victim = None  # a checkpoint that served a hit lately stays; the new, speculative one is skipped
            if victim is None:
                if checkpoint:
                    self.num_checkpoints_skipped += 1
                    self._failed_room = (asked, self._version())
                return False
            self._evict_victim(victim)

    def _fill_attention(self, attn_needs: list[tuple[BlockPool, int]], taken: int) -> bool:
        """Arena: evict the lowest pages (either queue) until every attention pool has its `n` free blocks besides
        the `taken` ones the state pools' new ranges cover. False when nothing is left to evict."""
        leaders = self.leaders
        for p, n in attn_needs:
            while p.num_plain - taken < n:  # (an eviction never takes free blocks away: earlier pools stay served)
                victim = self._lowest(leaders)
                if victim is None:
                    return False
                self._evict_victim(victim)
        return True

    def _evict_victim(self, victim: tuple[BlockPool, int, float]) -> None:
        """Evict `_lowest`'s answer; every so many evictions, re-value the queues (`refresh`)."""
        self.evict(*victim)
        self._since_refresh += 1
        if self.policy == "value" and self._since_refresh > 1024 and self._since_refresh > 4 * self.num_queued():
            self.refresh()

    def _version(self) -> int:
        """Grows with every call that may change a pool or a queue. What a checkpoint's room reads (free ids and
        ranges, queue priorities, the clock, the tree, hits) changes only through such calls."""
        v = 0
        for p in self.pools:
            v += p.version
        for q in self.queues.values():
            v += q.version
        return v

    def _served(self, slot: int) -> bool:
        """The lead state pool's cached checkpoint in `slot` was restored within the last `served_window`
        checkpoints cached, and no deeper checkpoint of the request that restored it has superseded it since
        (`demote`: a chat turn's restored state, once the turn saved its own, serves nobody)."""
        h = self.state.block_hash[slot] if self.state is not None else None
        last = self.last_hit.get(h) if h is not None else None
        if last is None or h in self.demoted:
            return False
        return self.num_states_cached - last <= self.served_window

    def _stale(self, slot: int) -> bool:
        """The checkpoint in `slot` was last restored more than one turnover of the checkpoint ids ago."""
        h = self.state.block_hash[slot] if self.state is not None else None
        last = self.last_hit.get(h) if h is not None else None
        return last is not None and SERVED_TURNOVERS * (self.num_states_cached - last) > self.served_window

    def _pick_range(self, below: float | None, priceless_ok: bool) -> int | None:
        """The range whose cached blocks to evict for a checkpoint: among those with no referenced block (the
        RANGE_CANDIDATES longest unused), the one whose eviction loses least, priced per byte like a page: the
        credit (priority - clock, GreedyDual's remaining worth) of every page that goes with it (its queued blocks
        and, under a block with children, the subtree's blocks and the checkpoints they name), times their bytes,
        over the range's bytes; a subtree past MAX_RANGE_SUBTREE nodes, or a referenced checkpoint in it, makes it
        priceless. Ties: the longest unused, then the most free blocks. None when there is none, when it costs
        more than `below` (the lowest cached checkpoint's priority: that one goes instead), or when only priceless
        ones are left and not `priceless_ok` (a checkpoint is skipped rather than a hot prefix evicted; a running
        slot takes one)."""
        ov = self.overlay
        assert ov is not None
        inf = float("inf")
        bound = inf if below is None else max(0.0, below - self.clock)
        best, best_key = None, (inf, 0, 0)
        age, nplain = ov.age, ov.nplain
        candidates = ov.eligible_ranges()
        if len(candidates) > RANGE_CANDIDATES:  # price the longest unused only
            # == nsmallest(key=(age, -nplain)), which is stable: ties in ascending range order, as c breaks them
            keyed = [(age[c], -nplain[c], c) for c in candidates]
            candidates = [t[2] for t in heapq.nsmallest(RANGE_CANDIDATES, keyed)]
        for c in candidates:
            cost = self._range_cost(c, bound)
            if cost > bound:
                continue
            key = (cost, age[c], -nplain[c])
            if best is None or key < best_key:
                best, best_key = c, key
                bound = cost
        if best is not None and best_key[0] == inf and not priceless_ok:
            return None
        return best

    def _range_cost(self, c: int, bound: float) -> float:
        """Credit per byte that evicting range c loses (see `_pick_range`); stops early past `bound`.

        One walk per block (or per subtree, for a block with children): the credit of every cached page met,
        plus its checkpoint's; locals bound once, as this is the hot loop of a checkpoint's room."""
        chain, ov = self.attention, self.overlay
        assert ov is not None and chain is not None
        names, cached, parent_of = chain.block_hash, chain.cached, self.parent.get
        blocks = ov.blocks_of(c)
        lo, hi = blocks.start, blocks.stop
        total = ov.k * self.unit_bytes[id(chain)]
        limit = bound * total
        credit = 0.0
        inf = float("inf")
        clock = self.clock
        prio_of = self.queues[id(chain)].priority.get
        ub_a = self.unit_bytes[id(chain)]
        state = self.state
        slot_of = state.cached.get if state is not None else None
        sprio_of = self.queues[id(state)].priority.get if state is not None else None
        ub_s = self.unit_bytes[id(state)] if state is not None else 0

        def page_credit(page: int, h: bytes) -> float:
            """The remaining worth of cached page `page` named `h`, plus its checkpoint's (inf: pinned)."""
            pr = prio_of(page)
            one = 0.0 if pr is None else max(0.0, pr - clock) * ub_a
            if slot_of is not None:
                slot = slot_of(h)
                if slot is not None:
                    sp = sprio_of(slot)  # type: ignore[misc]
                    one = inf if sp is None else one + max(0.0, sp - clock) * ub_s
            return one

        kids = self.kids
        kids_of = kids.get if kids is not None else None
        children_of = self.children.get
        down_of, linked_of = self._down.get, self._linked.get
        for b in blocks:  # (indexed: most walks stop early, a slice of the whole range would be wasted)
            h = names[b]
            if h is None:
                continue
            if kids_of is None or not children_of(h):
                credit += page_credit(b, h)
            else:
                p = parent_of(h)
                pb = cached.get(p) if p is not None else None
                if pb is not None and lo <= pb < hi:
                    continue  # its parent is in this range too: the parent's subtree covers it
                sub_limit = limit - credit
                sub, stack, seen, over = 0.0, [h], 0, False
                while stack and not over:
                    x = stack.pop()
                    seen += 1
                    while True:  # x, then down its plain stretches (no credit there: popped, not priced)
                        jump = down_of(x)
                        if jump is not None and linked_of(jump[0]) == jump[2]:
                            x = jump[0]
                            seen += jump[1]
                            continue
                        if seen > MAX_RANGE_SUBTREE:
                            sub, over = inf, True
                            break
                        page = cached.get(x)
                        if page is not None:
                            sub += page_credit(page, x)
                            if sub > sub_limit:
                                over = True
                                break
                        ks = kids_of(x)
                        if not ks:
                            break
                        if len(ks) == 1 and (slot_of is None or slot_of(x) is None):
                            x, pops = self._plain_stretch(x, ks)
                            seen += pops
                            continue
                        stack.extend(ks)
                        break
                credit += sub
            if credit > limit:
                return credit / total
        return credit / total

    def _plain_stretch(self, x: bytes, kids: set[bytes]) -> tuple[bytes, int]:
        """Plain node x (its only child in `kids`): the first node below it that is not plain (or the one where
        MAX_RANGE_SUBTREE pops end any walk), and the pops a subtree walk makes from x to reach it. Remembered in
        `_down` for every plain node passed, so the next walk jumps there.

        A jump stays exact while its target keeps its link stamp: a node of the stretch loses its child or leaves
        only after everything below it did (the target included: it is unlinked, and linked again with a new
        stamp), and a node of the stretch with a child can become a branch point or a checkpoint only through
        `_structure_changed`, which drops every jump."""
        state = self.state.cached if self.state is not None else {}
        kids_of = self.kids.get  # type: ignore[union-attr]
        path = [x]
        (z,) = kids
        while len(path) <= MAX_RANGE_SUBTREE:
            ks = kids_of(z)
            if ks is None or len(ks) != 1 or z in state:
                break
            path.append(z)
            (z,) = ks
        stamp, n = self._linked[z], len(path)
        down = self._down
        for i, p in enumerate(path):
            down[p] = (z, n - i, stamp)
        return z, n

    def _check_stretches(self) -> None:
        """Every jump still in force (its target keeps its stamp) skips exactly its pops over plain nodes."""
        assert self.kids is not None
        state = self.state.cached if self.state is not None else {}
        for x, (z, pops, stamp) in self._down.items():
            if self._linked.get(z) != stamp:
                continue  # out of date: never taken
            y, n = x, 0
            while y != z:
                ks = self.kids.get(y)
                assert ks is not None and len(ks) == 1 and y not in state, ("jump over a node that is not plain", x)
                (y,) = ks
                n += 1
                assert n <= pops, ("jump longer than its stretch", x)
            assert n == pops, ("jump shorter than its stretch", x)

    def _structure_changed(self) -> None:
        """A node with descendants became a branch point or a checkpoint: walks that skipped over it (anchor
        walks up, pricing walks down) are out of date."""
        self._jump.clear()
        self._down.clear()

    def _evict_range(self, c: int) -> None:
        """Evict every cached block of range c (no block in it is referenced), in every attention pool."""
        assert self.overlay is not None
        self.overlay.num_range_evictions += 1
        blocks = self.overlay.blocks_of(c)
        chain = self.attention
        for pool in self.attention_pools:
            for b in blocks:
                h = pool.block_hash[b]
                if h is None or pool.ref_cnt[b]:
                    continue
                if pool is not chain:
                    pool.evict(b)  # a rider's page alone: its group only serves shorter hits
                    self.evicted_bytes["attention"] += pool.page_bytes
                elif self.kids is not None:
                    self._evict_subtree(h)
                else:
                    self.evict(pool, b)

    def _evict_subtree(self, h: bytes) -> None:
        """Evict the chain's block h and every unreferenced cached block below it (deepest first); a referenced
        one stays, cut off as the head of an unreachable chain."""
        assert self.kids is not None and self.attention is not None
        order, stack = [], [h]
        while stack:
            x = stack.pop()
            order.append(x)
            stack.extend(self.kids.get(x, ()))
        chain = self.attention
        self._going = set(order)
        for x in reversed(order):
            page = chain.cached.get(x)
            if page is None:
                continue
            if chain.ref_cnt[page] == 0:
                self.evict(chain, page)
            else:
                self._unlink(x)
        self._going = set()

    def _leaders_of(self, pools: list[BlockPool]) -> list[BlockPool]:
        """The distinct leaders of `pools` (a rider's pages are freed by evicting its leader's)."""
        if len(pools) == 1:
            return [self.leader_of[id(pools[0])]]
        return list({id(q): q for q in (self.leader_of[id(p)] for p in pools)}.values())

    def num_queued(self) -> int:
        n = 0  # a loop, not sum(genexpr): asked after every eviction past 1024 since a refresh
        for q in self.queues.values():
            n += len(q)
        return n

    def refresh(self) -> None:
        """Recompute every queued page's value against the tree as it is now (keeping its recency)."""
        self._since_refresh = 0
        base, value = self.base, self._value
        for p in self.leaders:
            key, names = id(p), p.block_hash
            self.queues[key].reprioritize(lambda page: base[(key, page)] + value(p, names[page]))  # noqa: B023

    def _lowest(self, pools: list[BlockPool]) -> tuple[BlockPool, int, float] | None:
        """(pool, page, priority) of the next victim among `pools`' queues: the lowest (priority, release order);
        release orders are unique across queues (one counter), so whole entries compare the same way."""
        best = best_pool = None
        queues = self.queues
        for p in pools:
            top = queues[id(p)].peek()
            if top is not None and (best is None or top < best):
                best, best_pool = top, p
        if best is None:
            return None
        return best_pool, best[2], best[0]  # type: ignore[return-value]

    # -- eviction ----------------------------------------------------------------------------------------------
    def evict(self, pool: BlockPool, page: int, prio: float | None = None, count: bool = True) -> None:
        """Drop an unreferenced cached page (count=False: a deliberate drop, e.g. a superseded checkpoint)."""
        h = pool.block_hash[page]
        assert h is not None
        key = id(pool)
        self.queues[key].discard(page)
        self.base.pop((key, page), None)
        chain = pool is self.attention
        if count:
            pool.evict(page)
            kind = "attention" if chain else "state"
            self.num_evicted[kind] += 1
            self.evicted_bytes[kind] += pool.page_bytes
        else:
            pool.uncache(page)
        if self.riders.get(key):
            self._drop_riders(pool, h, count)
        if self.policy == "lru":
            return
        if prio is not None and prio > self.clock:
            self.clock = prio
        if chain:
            self._unlink(h)
            state = self.state
            if state is not None:
                slot = state.cached.get(h)
                if slot is not None and state.ref_cnt[slot] == 0:
                    self.evict(state, slot)  # its chain is gone: the state is useless
        else:
            self._requeue_block(h)  # the block it ended on may now be a dead end
        self._forget(h)

    def _drop_riders(self, leader: BlockPool, h: bytes, count: bool) -> None:
        """The leader's page h is gone: every rider's page h goes too (in use or not: it just loses its name)."""
        for rider in self.riders.get(id(leader), ()):
            page = rider.lookup(h)
            if page is None:
                continue
            if count and rider.ref_cnt[page] == 0:
                rider.evict(page)
                kind = "attention" if leader is self.attention else "state"
                self.evicted_bytes[kind] += rider.page_bytes
            else:
                rider.uncache(page)

    def _unlink(self, h: bytes) -> None:
        self._down.pop(h, None)
        parent = self.parent.pop(h, None)
        if parent is None:
            return
        del self._linked[h]
        if self.kids is not None:
            kids = self.kids[parent]
            kids.discard(h)
            if not kids:
                del self.kids[parent]
        left = self.children[parent] - 1
        if left:
            self.children[parent] = left
        else:
            del self.children[parent]
            if parent in self._going and (self.state is None or parent not in self.state.cached):
                return  # a dead end that this subtree eviction takes next: queuing it would change nothing
            self._requeue_block(parent)  # a new leaf

    def _forget(self, h: bytes) -> None:
        in_attn = self.attention is not None and h in self.attention.cached
        in_state = self.state is not None and h in self.state.cached
        if not in_attn and not in_state:
            self._jump.pop(h, None)
            self.tokens.pop(h, None)
            self.last_hit.pop(h, None)
            self.demoted.discard(h)

    # -- events from the pools and the managers ---------------------------------------------------------------
    def on_release(self, pool: BlockPool, page: int) -> None:
        h = pool.block_hash[page]
        assert h is not None
        if id(pool) not in self.queues:  # a rider: leaves with its leader's page, or now if the leader lost h
            if self.leader_of[id(pool)].lookup(h) is None:
                pool.uncache(page)
            return
        if pool is self.attention and self.policy == "value" and self.children.get(h):
            return  # not a leaf: queued when its last child goes
        self._push(pool, page, h)

    def on_acquire(self, pool: BlockPool, page: int) -> None:
        if id(pool) not in self.queues:
            return  # a rider: never queued
        self.queues[id(pool)].discard(page)
        self.base.pop((id(pool), page), None)
        h = pool.block_hash[page]
        if h is not None and self.policy == "value" and (pool is self.state or self.state is None):
            self.last_hit[h] = self.num_states_cached  # a restore (or, attention-only, a block reuse)
            self.demoted.discard(h)  # restored: a real reuse point after all

    def on_block_cached(self, h: bytes, parent: bytes | None, tokens: int) -> None:
        """An attention block was named `h` (its chain parent is `parent`, None for the first block)."""
        self.tokens[h] = tokens
        if self.policy == "lru" or parent is None or self._chain_queue is None or h in self.parent:
            return
        pb = self.attention.cached.get(parent)  # type: ignore[union-attr]
        if pb is None:
            return  # the parent is gone: this block heads an unreachable chain and stays a leaf
        self.parent[h] = parent
        self._linked[h] = next(self._link_order)
        if self.kids is not None:
            kids = self.kids.get(parent)
            if kids is None:
                self.kids[parent] = {h}
            else:
                kids.add(h)
        n = self.children[parent] = self.children.get(parent, 0) + 1
        if n == 2:
            self._structure_changed()  # a new branch point
        self._chain_queue.discard(pb)  # no longer a leaf

    def demote(self, h: bytes) -> None:
        """The checkpoint named `h` lies on a path a deeper checkpoint of the same request now ends, with no branch
        at `h`: a request reaching `h` goes on to the deeper one, so `h` keeps only its recency (Marconi: states
        off branch points are rarely reused). Restoring it later undoes this."""
        if self.policy != "value" or self.state is None or self.children.get(h, 0) > 1:
            return
        slot = self.state.lookup(h)
        if slot is None:
            return
        self.demoted.add(h)
        key = id(self.state)
        if slot in self.queues[key]:
            self.queues[key].push(slot, self.base[(key, slot)])
        self._requeue_block(h)

    def on_state_cached(self, h: bytes, tokens: int) -> None:
        """A checkpoint (state after `tokens` tokens) was named `h`: the block it ends on is no dead end now."""
        self.tokens[h] = tokens
        self.num_states_cached += 1
        if self.policy == "value":
            if self.children.get(h):
                self._structure_changed()  # a checkpoint mid-chain
            self._requeue_block(h)

    def _requeue_block(self, h: bytes) -> None:
        if self.attention is None or self.policy == "lru":
            return
        b = self.attention.cached.get(h)
        if b is not None and self.attention.ref_cnt[b] == 0 and not self.children.get(h):
            self._push(self.attention, b, h)

    def _push(self, pool: BlockPool, page: int, h: bytes) -> None:
        if self.policy == "lru":
            self.queues[id(pool)].push(page, 0.0)  # ties: release order
            return
        base = self.base[(id(pool), page)] = self.clock
        self.queues[id(pool)].push(page, base + self._value(pool, h))

    def _value(self, pool: BlockPool, h: bytes | None) -> float:
        """Compute saved per byte by keeping page `h` of `pool` (0 for a dead-end block)."""
        if h is None or h in self.demoted:
            return 0.0
        if pool is self.attention and self.state is not None:
            if h not in self.state.cached:
                return 0.0  # dead end: no hit can stop here
            pool = self.state  # a leaf block with a checkpoint is valued as that checkpoint
        tokens, anchor = self.tokens.get(h, 0), self._anchor(h)
        nbytes = self.unit_bytes[id(pool)]
        if self.attention is not None:
            nbytes += (tokens - anchor) // self.block_size * self.unit_bytes[id(self.attention)]
        return self.values.value(tokens, nbytes, anchor)

    def _anchor(self, h: bytes) -> int:
        """Tokens at the nearest ancestor that is a cached checkpoint or a branch point (0: the root): what a hit
        would fall back to without `h`.

        Walks up the chain; `_jump[x]` remembers, per walk, the ancestor the walk from x ended at, so the next walk
        skips the plain stretch in one step; past MAX_ANCHOR_WALK visited plain nodes it stops and answers 0. A node
        that becomes interesting with descendants below it (a new branch, a checkpoint saved mid-chain) clears
        every jump."""
        parent_of, children, jump = self.parent.get, self.children.get, self._jump
        jump_of = jump.get
        states = self.state.cached if self.state is not None else {}
        path: list[bytes] = []
        visit = path.append
        left = MAX_ANCHOR_WALK + 1
        p = parent_of(h)
        while p is not None:
            if children(p, 0) >= 2 or p in states:
                break
            visit(p)
            left -= 1
            if not left:
                p = None  # a long plain stretch: count it all (as if from the root)
                break
            nxt = jump_of(p, _NO_JUMP)
            p = parent_of(p) if nxt is _NO_JUMP else nxt
        if path:
            jump.update(dict.fromkeys(path, p))
        return self.tokens.get(p, 0) if p is not None else 0

    # -- integrity ---------------------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Budget respected; each queue holds exactly its pool's evictable pages; chain links consistent; a rider's
        page named h only where its leader holds h."""
        assert self.held_bytes() <= self.budget_bytes, (self.held_bytes(), self.budget_bytes)
        for leader_id, riders in self.riders.items():
            for r in riders:
                leader = self.leader_of[id(r)]
                assert id(leader) == leader_id
                for name in r.cached:
                    assert leader.lookup(name) is not None, (r.name, "names a page its leader lost")
        for p in self.leaders:
            queued = self.queues[id(p)].pages()
            for b in queued:
                assert p.ref_cnt[b] == 0 and p.block_hash[b] is not None, (p.name, b)
            for b in p.free_block_ids():
                h = p.block_hash[b]
                if h is None:
                    continue
                leaf = self.policy == "lru" or p is not self.attention or not self.children.get(h)
                assert (b in queued) == leaf, (p.name, b, leaf)
        if self.attention is not None:
            counts: dict[bytes, int] = {}
            for h, parent in self.parent.items():
                assert self.attention.lookup(h) is not None and self.attention.lookup(parent) is not None
                counts[parent] = counts.get(parent, 0) + 1
            assert counts == self.children, "child counts out of date"
            if self.kids is not None:
                assert {p: len(k) for p, k in self.kids.items()} == self.children, "children out of date"
                for h, ks in self.kids.items():
                    assert all(self.parent[k] == h for k in ks)
                assert self._linked.keys() == self.parent.keys(), "link stamps out of date"
                self._check_stretches()
        if self.overlay is not None:
            self.overlay.check_integrity()
