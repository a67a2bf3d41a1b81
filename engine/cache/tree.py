"""What the prefix cache keeps, and what it lets go: one tree of cached blocks and checkpoints, one eviction heap.

    admission.py picks where a request saves a state ([s@h]: a checkpoint, the state after block h):
        r:  h0  h1  h2  h3 | h4' h5' | decode ...       branch point: the end of the longest prefix seen
            \\___ hit ___/  ^ branch  ^ prompt end       before; prompt end; while decoding, a rolling
                                                        request end at each block boundary (replacing the last)
    the tree: a Node per block hash, holding its attention page and its checkpoint's k pages (either may be absent)
        root -- h0 -- h1 -- h2 -- h3 -- h4' -- h5'
                      |           \\-- h4 -- h5
                    [s@h1]      [s@h3]    [s@h5]  [s@h5']
    one heap: leaf blocks nobody references (h5, h5') + checkpoints nobody references ([s@h1], [s@h3], ...)
        priority = clock when released + compute saved per page (0: a dead-end block, a superseded checkpoint);
        evict the lowest until the pages asked for are free; clock := its priority, so old popularity ages out
        (GreedyDual)

Evicting a block takes the unreferenced checkpoint at it (its chain is gone); evicting a checkpoint re-queues its
block (a dead end now). A block takes one page of the pool (pools.py), a checkpoint k: they trade memory page by
page as the workload asks. The cache manager (coordinator.py) calls `make_room` before every allocation and tells
the tree what was named, released and taken again. Single-threaded (the step loop). Tensor-free.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from hybridpd.engine.cache.events import CacheEventLog
from hybridpd.engine.cache.pools import PagePool

BLOCK, STATE = 0, 1
ATTENTION_QUADRATIC_TOKENS = 8192
"""Context length at which a token's attention FLOPs equal its linear FLOPs, roughly (shapes flops_saved only)."""
REFERENCE_TOKENS = 4096
"""A state restoring this many tokens alone is valued 1.0 per its pages (the value scale)."""
MAX_ANCHOR_WALK = 64
"""Ancestors an anchor search visits before it counts the whole prefix as this entry's (see `_anchor`)."""


def flops_saved(tokens: int) -> float:
    """Relative compute a hit on a `tokens`-long prefix saves: linear per token plus attention's quadratic term."""
    return tokens + tokens * tokens / (2 * ATTENTION_QUADRATIC_TOKENS)


class Node:
    """One block hash. It exists exactly while it names a cached attention page (`page`) or a checkpoint (`ckpt`).
    Nodes that leave the tree are reused (`CacheTree._spare`): one object per block would make work for the garbage
    collector."""

    __slots__ = ("hash", "tokens", "parent", "kids", "kid", "page", "ckpt", "ckpt_refs", "demoted", "branched",
                 "queued", "base")

    def __init__(self) -> None:
        self.hash = b""
        self.tokens = 0
        """Prefix length (tokens) at the end of this block."""
        self.parent: Node | None = None
        """The node of the block before, while both name a page (None: the first block, or the block before was not
        cached when this one was): `parent` and `kids` link cached blocks only, so a cached chain has no hole."""
        self.kids: dict[bytes, Node] = {}  # a block with kids is not evictable (not queued)
        self.kid: Node | None = None  # the one node in `kids` when there is exactly one, else None
        self.page = 0  # the attention page holding this block (0: none)
        self.ckpt: tuple[int, ...] | None = None  # the pages of the checkpoint after this block, or None
        self.ckpt_refs = 0  # its holders: a restore until its copy ran, an export until its lease ended
        self.demoted = False  # a deeper checkpoint of the same request supersedes it off a branch point: valued 0
        self.branched = False
        """Prompts have branched here: two cached blocks hung below it at once, or a request's branch point
        (admission.py) put its checkpoint here. A branch point is never demoted, even once its branches are gone."""
        self.queued = [0, 0]
        """Kind -> the order of its live heap entry (0: not queued): an unreferenced leaf block (no kids), an
        unreferenced checkpoint."""
        self.base = [0.0, 0.0]  # kind -> the clock when it was queued (its recency; `refresh` re-values on top)


class CacheTree:
    def __init__(self, pages: PagePool, events: CacheEventLog, groups: tuple[tuple[int, ...], tuple[int, ...]],
                 pages_per_state: int, block_size: int, alpha: float = 1.0) -> None:
        """`groups`: the attention and the recurrent group ids (events are reported for each); `pages_per_state`:
        k, the pages of one checkpoint."""
        self.pages = pages
        self.events = events
        self.groups = groups
        self.has_blocks = bool(groups[0])
        self.has_states = bool(groups[1])
        self.k = pages_per_state
        self.block_size = block_size
        self.unit = (1, max(pages_per_state, 1))  # kind -> pages of one item
        self._scale = alpha * self.unit[STATE if self.has_states else BLOCK] / flops_saved(REFERENCE_TOKENS)
        self.nodes: dict[bytes, Node] = {}
        self.page_node: list[Node | None] = [None] * pages.num_pages  # page -> the node naming its block
        self.ckpt_node: dict[int, Node] = {}  # a cached checkpoint's first page -> its node
        self._heap: list[tuple[float, int, int, Node]] = []
        """(priority, order, kind, node): one lazy min-heap; entries whose order is not `node.queued[kind]` are
        stale."""
        self._order = 0
        self.num_queued = 0
        self.clock = 0.0
        self.num_checkpoints = 0  # cached (named)
        self.num_reserved = 0
        """Checkpoints whose pages are taken but not named yet (a step writing them, a transfer bringing one): the
        cap counts them too."""
        self.max_checkpoints: int | None = None
        self.num_evictions = [0, 0]
        self._since_refresh = 0
        self._spare = [Node() for _ in range(pages.num_pages)]  # (made up front: not on the step loop)

    # -- the heap ------------------------------------------------------------------------------------------------
    def _queue(self, kind: int, node: Node, base: float, priority: float) -> None:
        if not node.queued[kind]:
            self.num_queued += 1
        self._order = order = self._order + 1
        node.queued[kind], node.base[kind] = order, base
        heap = self._heap
        heapq.heappush(heap, (priority, order, kind, node))
        if len(heap) > 4 * self.num_queued + 64:  # mostly stale: rebuild
            self._rebuild()

    def _dequeue(self, kind: int, node: Node) -> None:
        if node.queued[kind]:
            node.queued[kind] = 0
            self.num_queued -= 1

    def _rebuild(self, priority_of: Callable[[int, Node], float] | None = None) -> None:
        """The heap again from the live entries (each at `priority_of(kind, node)` when given), orders kept."""
        heap = [e for e in self._heap if e[3].queued[e[2]] == e[1]]
        if priority_of is not None:
            heap = [(priority_of(kind, node), order, kind, node) for _, order, kind, node in heap]
        heapq.heapify(heap)
        self._heap = heap

    def _lowest(self) -> tuple[int, Node, float] | None:
        heap = self._heap
        while heap:
            prio, order, kind, node = heap[0]
            if node.queued[kind] == order:
                return kind, node, prio
            heapq.heappop(heap)
        return None

    def refresh(self) -> None:
        """Re-value every queued item against the tree as it is now (keeping its recency)."""
        self._since_refresh = 0
        self._rebuild(lambda kind, node: node.base[kind] + self._value(kind, node))

    # -- making room ---------------------------------------------------------------------------------------------
    def make_room(self, n: int, checkpoint: bool = False) -> bool:
        """Evict the lowest items until `n` pages are free (and, for a `checkpoint`, one more checkpoint is under
        `max_checkpoints`); False when it cannot (what went stays gone: it was cache)."""
        free = self.pages.free
        if checkpoint and self.max_checkpoints is not None:
            while self.num_checkpoints + self.num_reserved >= self.max_checkpoints:
                victim = self._lowest_checkpoint()
                if victim is None:
                    return False
                self._evict_victim(STATE, victim[0], victim[1])
        while len(free) < n:
            victim = self._lowest()
            if victim is None:
                return False
            self._evict_victim(victim[0], victim[1], victim[2])
        return True

    def _lowest_checkpoint(self) -> tuple[Node, float] | None:
        """The lowest queued checkpoint (a scan: only with a cap on checkpoints)."""
        best = None
        for prio, order, kind, node in self._heap:
            if kind == STATE and node.queued[STATE] == order and (best is None or (prio, order) < best[:2]):
                best = (prio, order, node)
        return (best[2], best[0]) if best is not None else None

    def _evict_victim(self, kind: int, node: Node, prio: float) -> None:
        """Evict a queued item; the clock rises to its priority; once per queue turnover, re-value (`refresh`)."""
        if prio > self.clock:
            self.clock = prio
        self.num_evictions[kind] += 1
        if kind == BLOCK:
            self.evict_block(node)
        else:
            self.evict_checkpoint(node)
        self._since_refresh += 1
        if self._since_refresh > 1024 and self._since_refresh > 4 * self.num_queued:
            self.refresh()

    # -- eviction ----------------------------------------------------------------------------------------------
    def evict_block(self, node: Node) -> None:
        """The unreferenced block goes, with the unreferenced checkpoint at it (its chain is gone)."""
        page, queued = node.page, node.queued  # (`_dequeue`, `give_back`, `_report`, inlined: once per block)
        if queued[BLOCK]:
            queued[BLOCK] = 0
            self.num_queued -= 1
        node.page = 0
        self.page_node[page] = None
        self.pages.ref[page] = 0
        self.pages.free.append(page)
        for gid in self.groups[BLOCK]:
            self.events.append(False, gid, node.hash)
        self._unlink(node)
        if node.ckpt is not None and not node.ckpt_refs:
            self.num_evictions[STATE] += 1
            self.evict_checkpoint(node)
        elif node.ckpt is None:
            self._drop(node)

    def evict_checkpoint(self, node: Node) -> None:
        """The unreferenced checkpoint goes; the block it ended on may be a dead end now."""
        assert node.ckpt is not None and not node.ckpt_refs
        self._dequeue(STATE, node)
        self.pages.give_back(node.ckpt)
        self.pages.num_checkpoint_pages -= len(node.ckpt)
        del self.ckpt_node[node.ckpt[0]]
        node.ckpt = None
        self.num_checkpoints -= 1
        self._report(False, STATE, node.hash)
        if node.page:
            self._requeue_block(node)
        else:
            self._drop(node)

    def _drop(self, node: Node) -> None:
        del self.nodes[node.hash]
        node.parent = node.kid = None
        node.kids.clear()
        self._spare.append(node)

    def _unlink(self, node: Node) -> None:
        parent = node.parent
        if parent is None:
            return
        node.parent = None
        kids = parent.kids
        del kids[node.hash]
        parent.kid = next(iter(kids.values())) if len(kids) == 1 else None
        if not kids and parent.page and not self.pages.ref[parent.page]:
            self._push_block(parent)  # a new leaf

    def _report(self, stored: bool, kind: int, h: bytes) -> None:
        for gid in self.groups[kind]:
            self.events.append(stored, gid, h)

    # -- what the cache manager tells it ------------------------------------------------------------------------
    def node(self, h: bytes, tokens: int) -> Node:
        node = self.nodes.get(h)
        if node is None:
            node = self.nodes[h] = self._spare.pop() if self._spare else Node()
            node.hash, node.tokens, node.demoted, node.branched = h, tokens, False, False
        return node

    def name_block(self, h: bytes, parent: bytes | None, tokens: int, page: int) -> bool:
        """A request's filled block `page` holds `h` (after `parent`, None for the first block). False when `h` is
        cached already (in another page)."""
        node = self.nodes.get(h)  # (`node`, `_report`, inlined: once per block)
        if node is None:
            node = self.nodes[h] = self._spare.pop() if self._spare else Node()
            node.hash, node.tokens, node.demoted, node.branched = h, tokens, False, False
        elif node.page:
            return False
        node.page = page
        self.page_node[page] = node
        for gid in self.groups[BLOCK]:
            self.events.append(True, gid, h)
        up = self.nodes.get(parent) if parent is not None else None
        if up is not None and up.page:
            node.parent = up
            up.kids[h] = node
            up.kid = node if len(up.kids) == 1 else None
            up.branched = up.branched or up.kid is None
            self._dequeue(BLOCK, up)  # no longer a leaf
        return True

    def rename_block(self, node: Node, page: int) -> None:
        """A request recomputed `node`'s unreferenced block into `page`: the live copy takes the name."""
        old = node.page
        self._dequeue(BLOCK, node)
        self.page_node[old] = None
        self.pages.give_back((old,))
        node.page = page
        self.page_node[page] = node

    def released(self, node: Node) -> None:
        """A cached block lost its last reference."""
        if not node.kids:
            self._push_block(node)

    def acquired(self, node: Node) -> None:
        """A cached block is referenced again (a hit)."""
        self._dequeue(BLOCK, node)
        if not self.has_states:
            node.demoted = False

    def name_checkpoint(self, h: bytes, tokens: int, pages: tuple[int, ...], branch: bool = False) -> bool:
        """A written checkpoint (the state after `tokens`, at block `h`) is cached in `pages` (unreferenced now).
        False when one is cached at `h` already."""
        node = self.node(h, tokens)
        if node.ckpt is not None:
            return False
        node.ckpt, node.ckpt_refs = pages, 0
        node.branched = node.branched or branch
        self.ckpt_node[pages[0]] = node
        self.num_checkpoints += 1
        self.pages.num_checkpoint_pages += len(pages)
        self._report(True, STATE, h)
        self._push(STATE, node)
        self._requeue_block(node)  # no dead end now
        return True

    def pin_checkpoint(self, node: Node) -> None:
        if not node.ckpt_refs:
            self._dequeue(STATE, node)
            node.demoted = False  # restored (or exported): a real reuse point after all
        node.ckpt_refs += 1

    def unpin_checkpoint(self, node: Node) -> None:
        node.ckpt_refs -= 1
        if not node.ckpt_refs:  # unheld: queued, or (its chain gone: no hit can reach it) dropped
            self.evict_checkpoint(node) if self.has_blocks and not node.page else self._push(STATE, node)

    def revalue(self, node: Node) -> None:
        """Queue `node`'s items again at their value now (the tree around them changed)."""
        for kind in (k for k in (BLOCK, STATE) if node.queued[k]):
            self._queue(kind, node, node.base[kind], node.base[kind] + self._value(kind, node))

    def demote(self, h: bytes) -> None:
        """The checkpoint `h` lies on a path a deeper checkpoint of the same request now ends, with no branch at
        `h`: it keeps only its recency (Marconi: states off branch points are rarely reused). A restore undoes it;
        a branch point (`Node.branched`) is never demoted."""
        node = self.nodes.get(h)
        if node is None or node.ckpt is None or node.branched or len(node.kids) > 1:
            return
        node.demoted = True
        if node.queued[STATE]:
            base = node.base[STATE]
            self._queue(STATE, node, base, base)
        self._requeue_block(node)

    def _requeue_block(self, node: Node) -> None:
        if node.page and not self.pages.ref[node.page] and not node.kids:
            self._push_block(node)

    def _push_block(self, node: Node) -> None:
        """Queue a leaf block; a dead end (no checkpoint at it, recurrent groups present) is worth 0 without asking
        `_value`: most blocks, once per block released or left as a leaf."""
        clock = self.clock
        if self.has_states and node.ckpt is None:
            self._queue(BLOCK, node, clock, clock)
        else:
            self._queue(BLOCK, node, clock, clock + self._value(BLOCK, node))

    def _push(self, kind: int, node: Node) -> None:
        clock = self.clock
        self._queue(kind, node, clock, clock + self._value(kind, node))

    # -- value -------------------------------------------------------------------------------------------------
    def _value(self, kind: int, node: Node) -> float:
        """Compute saved per page by keeping `node`'s item of `kind` (0 for a dead-end block or a demoted
        checkpoint): the FLOPs between the nearest anchor and this boundary, over its pages and the blocks between."""
        if node.demoted:
            return 0.0
        if kind == BLOCK and self.has_states:
            if node.ckpt is None:
                return 0.0  # dead end: no hit can stop here
            kind = STATE  # a leaf block with a checkpoint is valued as that checkpoint
        tokens, anchor = node.tokens, self._anchor(node)
        if tokens <= anchor:
            return 0.0
        pages = self.unit[kind]
        if self.has_blocks:
            pages += (tokens - anchor) // self.block_size
        return self._scale * (flops_saved(tokens) - flops_saved(anchor)) / pages

    def _anchor(self, node: Node) -> int:
        """Tokens at the nearest ancestor that is a cached checkpoint or a branch point (0: the root, or none within
        MAX_ANCHOR_WALK ancestors): what a hit would fall back to without this entry."""
        p = node.parent
        for _ in range(MAX_ANCHOR_WALK):
            if p is None:
                return 0
            if p.kid is None or p.ckpt is not None:  # (p has a kid, the node below: no `kid` means several)
                return p.tokens
            p = p.parent
        return 0

    # -- integrity ---------------------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """The invariants stated at the fields."""
        ref, pool = self.pages.ref, self.pages
        owned = [0] * pool.num_pages
        queued = 0
        for h, node in self.nodes.items():
            assert node.hash == h and (node.page or node.ckpt is not None), "a node names a page or a checkpoint"
            if node.page:
                assert self.page_node[node.page] is node
                owned[node.page] += 1
                leaf = not ref[node.page] and not node.kids
                assert bool(node.queued[BLOCK]) == leaf, (h, "a block is queued exactly while an unreferenced leaf")
            else:
                assert not node.queued[BLOCK] and not node.kids
            if node.ckpt is not None:
                for p in node.ckpt:
                    owned[p] += 1
                    assert ref[p] == 1
                assert bool(node.queued[STATE]) == (not node.ckpt_refs), (h, "a checkpoint is queued while unheld")
            else:
                assert not node.queued[STATE] and not node.ckpt_refs
            queued += bool(node.queued[BLOCK]) + bool(node.queued[STATE])
            if node.parent is not None:
                assert node.parent.kids.get(h) is node and node.parent.page and node.page
            assert all(k.parent is node for k in node.kids.values())
            assert node.kid is (next(iter(node.kids.values())) if len(node.kids) == 1 else None), "the one kid"
        assert queued == self.num_queued
        live = {(order, kind) for _, order, kind, node in self._heap if node.queued[kind] == order}
        assert len(live) == queued, "every queued item has its heap entry"
        assert max(owned) <= 1, "a page belongs to one node at most"
        assert all(n is None or n.page == p for p, n in enumerate(self.page_node)), "page -> node naming it"
        assert self.ckpt_node == {n.ckpt[0]: n for n in self.nodes.values() if n.ckpt}, "first page -> checkpoint"
        cap = self.max_checkpoints if self.max_checkpoints is not None else self.num_checkpoints + self.num_reserved
        assert 0 <= self.num_reserved <= cap - self.num_checkpoints, "checkpoints reserved, and under the cap"
        free = set(pool.free)
        assert len(free) == len(pool.free) and 0 not in free
        for p in range(1, pool.num_pages):
            assert (p in free) == (ref[p] == 0 and not owned[p]), (p, "free: nobody references or names it")
        assert self.num_checkpoints == sum(n.ckpt is not None for n in self.nodes.values())
