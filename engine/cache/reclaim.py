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

The "lru" policy (the baselines) queues every unreferenced cached page by release order, across both pools, with
no leaf rule and no cascade (vLLM's free-queue order).

Ownership: the coordinator owns one Reclaimer and calls `make_room` before every allocation; the pools call
`on_release` / `on_acquire` (this is their listener). Single-threaded (the step loop). Tensor-free.
"""

from __future__ import annotations

import itertools

from engine.cache.block_pool import BlockPool
from engine.cache.eviction import EvictionQueue, ValueModel

POLICIES = ("value", "lru")
MAX_ANCHOR_WALK = 64
"""Blocks an anchor search walks up before it counts the whole prefix as this entry's (see `_anchor`)."""


class Reclaimer:
    def __init__(
        self, attention: list[BlockPool], state: list[BlockPool], budget_bytes: int, policy: str = "value",
        alpha: float = 1.0, block_size: int = 16,
    ) -> None:
        """`attention` / `state`: every group's pool of that kind, the leader (chain / lead state) first."""
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
        self.unit_bytes = {id(g[0]): sum(p.page_bytes for p in g) for g in (attention, state) if g}
        """leader pool -> bytes of one unit (its page and its riders' pages at the same hash)."""
        ref_bytes = self.unit_bytes[id(self.state if self.state is not None else self.attention)]
        self.values = ValueModel(ref_bytes, alpha)
        self.clock = 0.0
        """Recency (GreedyDual): the priority of the last page evicted; pages released now are queued above it."""
        self.parent: dict[bytes, bytes] = {}
        self.children: dict[bytes, int] = {}
        self.tokens: dict[bytes, int] = {}
        """Prefix length (tokens) at the end of the block / at the checkpoint named by a hash."""
        self.hits: dict[bytes, int] = {}
        """Times a cached page named by a hash was taken by a request (restored / reused)."""
        self.demoted: set[bytes] = set()
        """Checkpoints a deeper one on the same unbranched path supersedes: valued 0 (recency only)."""
        self.block_size = block_size
        self.base: dict[tuple[int, int], float] = {}
        """(pool, page) -> clock when it was queued (its recency)."""
        self._since_refresh = 0
        self._jump: dict[bytes, tuple[bytes | None, int]] = {}
        self._epoch = 0
        self.evicted_bytes = {"attention": 0, "state": 0}
        self.num_evicted = {"attention": 0, "state": 0}
        for p in self.pools:
            p.listener = self

    # -- budget ------------------------------------------------------------------------------------------------
    def held_bytes(self) -> int:
        return sum(p.num_held * p.page_bytes for p in self.pools)

    def make_room(self, needs: list[tuple[BlockPool, int]]) -> bool:
        """Evict the lowest-priority pages until every pool has `n` free ids and the budget has room for all of
        them. False when it cannot (what was evicted stays evicted: it was only cache)."""
        extra = sum(n * p.page_bytes for p, n in needs)
        if extra == 0:
            return True
        while True:
            short = [p for p, n in needs if p.num_plain < n]
            if not short and self.held_bytes() + extra <= self.budget_bytes:
                return True
            victim = self._lowest(list({id(q): q for q in (self.leader_of[id(p)] for p in short)}.values())
                                  if short else self.leaders)
            if victim is None:
                return False
            self.evict(*victim)
            self._since_refresh += 1
            if self.policy == "value" and self._since_refresh > max(1024, 4 * self.num_queued()):
                self.refresh()

    def num_queued(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def refresh(self) -> None:
        """Recompute every queued page's value against the tree as it is now (keeping its recency)."""
        self._since_refresh = 0
        for p in self.leaders:
            key = id(p)
            self.queues[key].reprioritize(
                lambda page, p=p, key=key: self.base[(key, page)] + self._value(p, p.block_hash[page]))

    def _lowest(self, pools: list[BlockPool]) -> tuple[BlockPool, int, float] | None:
        best = None
        for p in pools:
            top = self.queues[id(p)].peek()
            if top is not None and (best is None or top[:2] < best[0][:2]):
                best = (top, p)
        if best is None:
            return None
        (prio, _, page), pool = best
        return pool, page, prio

    def evictable_bytes(self) -> int:
        return sum(len(self.queues[id(p)]) * self.unit_bytes[id(p)] for p in self.leaders)

    # -- eviction ----------------------------------------------------------------------------------------------
    def evict(self, pool: BlockPool, page: int, prio: float | None = None, count: bool = True) -> None:
        """Drop an unreferenced cached page (count=False: a deliberate drop, e.g. a superseded checkpoint)."""
        h = pool.block_hash[page]
        assert h is not None
        self.queues[id(pool)].discard(page)
        self.base.pop((id(pool), page), None)
        if count:
            pool.evict(page)
            kind = "attention" if pool is self.attention else "state"
            self.num_evicted[kind] += 1
            self.evicted_bytes[kind] += pool.page_bytes
        else:
            pool.uncache(page)
        self._drop_riders(pool, h, count)
        if self.policy == "lru":
            return
        if prio is not None:
            self.clock = max(self.clock, prio)
        if pool is self.attention:
            self._unlink(h)
            if self.state is not None:
                slot = self.state.lookup(h)
                if slot is not None and self.state.ref_cnt[slot] == 0:
                    self.evict(self.state, slot)  # its chain is gone: the state is useless
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
        parent = self.parent.pop(h, None)
        if parent is None:
            return
        left = self.children[parent] - 1
        if left:
            self.children[parent] = left
        else:
            del self.children[parent]
            self._requeue_block(parent)  # a new leaf

    def _forget(self, h: bytes) -> None:
        in_attn = self.attention is not None and self.attention.lookup(h) is not None
        in_state = self.state is not None and self.state.lookup(h) is not None
        if not in_attn and not in_state:
            self._jump.pop(h, None)
            self.tokens.pop(h, None)
            self.hits.pop(h, None)
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
            self.hits[h] = self.hits.get(h, 0) + 1  # a restore (or, attention-only, a block reuse)
            self.demoted.discard(h)  # restored: a real reuse point after all

    def on_block_cached(self, h: bytes, parent: bytes | None, tokens: int) -> None:
        """An attention block was named `h` (its chain parent is `parent`, None for the first block)."""
        self.tokens[h] = tokens
        if self.policy == "lru" or parent is None or self.attention is None or h in self.parent:
            return
        pb = self.attention.lookup(parent)
        if pb is None:
            return  # the parent is gone: this block heads an unreachable chain and stays a leaf
        self.parent[h] = parent
        n = self.children[parent] = self.children.get(parent, 0) + 1
        if n == 2:
            self._epoch += 1  # a new branch point: walks that skipped over it are out of date
        self.queues[id(self.attention)].discard(pb)  # no longer a leaf

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
        if self.policy == "value":
            if self.children.get(h):
                self._epoch += 1  # a checkpoint mid-chain: walks that skipped over it are out of date
            self._requeue_block(h)

    def _requeue_block(self, h: bytes) -> None:
        if self.attention is None or self.policy == "lru":
            return
        b = self.attention.lookup(h)
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
            if self.state.lookup(h) is None:
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
        skips the plain stretch in one step; past MAX_ANCHOR_WALK plain blocks it stops and answers 0. A node that
        becomes interesting with descendants below it (a new
        branch, a checkpoint saved mid-chain) bumps `_epoch`, which invalidates every jump."""
        parent, children, jump, epoch = self.parent, self.children, self._jump, self._epoch
        states = self.state.cached if self.state is not None else {}
        path = []
        p = parent.get(h)
        while p is not None:
            if children.get(p, 0) >= 2 or p in states:
                break
            path.append(p)
            if len(path) > MAX_ANCHOR_WALK:
                p = None  # a long plain stretch: count it all (as if from the root)
                break
            j = jump.get(p)
            p = j[0] if j is not None and j[1] == epoch else parent.get(p)
        for x in path:
            jump[x] = (p, epoch)
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
