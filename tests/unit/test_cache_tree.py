"""The cache tree on a tiny arena (no model): node links, the leaf rule, GreedyDual ageing over one heap of blocks
and checkpoints, the checkpoint cap's victim, and `check_integrity` catching a corrupted tree (engine/cache/tree.py).

Block 4 tokens; a page is 64 bytes (one attention block), a Mamba-2 state 160 bytes: a checkpoint takes k = 3 pages.

    prompt P + [1]:   n0 -- n1 -- n2        3 full blocks, a checkpoint at n2 (prompt end 12)
    prompt P + [2]:   the same chain: a hit, no new node
"""

from __future__ import annotations

import pytest
from hybridpd.engine.cache.admission import CachePolicy
from hybridpd.engine.cache.arena import STAGING_SLOTS
from hybridpd.engine.cache.coordinator import HybridCacheManager, PoolLayout
from hybridpd.engine.cache.specs import CacheGroup, FullAttentionSpec, RecurrentStateSpec
from hybridpd.engine.cache.tree import BLOCK, STATE, CacheTree
from hybridpd.engine.config import SchedulerConfig
from hybridpd.engine.request import Request
from hybridpd.engine.sampling_params import SamplingParams
from hybridpd.engine.scheduler import Scheduler

from tests.support.pool_views import checkpoint_pages, free_pages, page_bytes

BS = 4
ATTN = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_dim=2, dtype="float32")  # 64 B/layer
MAMBA = RecurrentStateSpec("mamba2", (4, 3), "float32", (2, 4), "float32")  # 80 B/layer
GROUPS = [CacheGroup(0, ATTN, (0,)), CacheGroup(1, MAMBA, (1, 2))]
K = -(-page_bytes(GROUPS[1:]) // page_bytes(GROUPS[:1]))
P = list(range(100, 112))


def make(num_pages: int = 64, max_num_seqs: int = 2, policy: CachePolicy | None = None) -> Scheduler:
    layout = PoolLayout(num_pages, 1 + max_num_seqs + STAGING_SLOTS, 0, BS, K, policy or CachePolicy())
    return Scheduler(SchedulerConfig(max_num_seqs, 64), HybridCacheManager(GROUPS, layout))


def serve(s: Scheduler, rid: str, tokens: list[int], max_tokens: int = 1) -> Request:
    req = Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens))
    s.add_request(req)
    while s.num_unfinished:
        out = s.schedule()
        for r in s.update_from_output(out, {q.request_id: (7, 0.0) for q in out.seqs if q.sample}):
            if len(r.output_token_ids) >= r.sampling_params.max_tokens:
                s.finish(r, "length")
        s.cache.check_integrity()
    return req


def live(tree: CacheTree) -> dict[tuple[int, int], float]:
    """(kind, id(node)) -> priority of every live heap entry."""
    return {(kind, id(node)): prio for prio, order, kind, node in tree._heap if node.queued[kind] == order}


def test_a_node_per_cached_block_and_only_leaves_queued() -> None:
    assert K == 3
    s = make()
    a = serve(s, "a", P + [1])
    tree = s.cache.tree
    n0, n1, n2 = (tree.nodes[h] for h in a.block_hashes[:3])
    assert (n0.parent, n1.parent, n2.parent) == (None, n0, n1) and list(n1.kids.values()) == [n2] and n1.kid is n2
    assert [n.tokens for n in (n0, n1, n2)] == [4, 8, 12]
    assert all(n.page for n in (n0, n1, n2)) and len({n0.page, n1.page, n2.page}) == 3
    assert n2.ckpt is not None and len(n2.ckpt) == K and n0.ckpt is None and n1.ckpt is None
    assert set(n2.ckpt) == checkpoint_pages(s.cache) and not set(n2.ckpt) & {n0.page, n1.page, n2.page}
    assert n2.queued[BLOCK] and n2.queued[STATE]  # the leaf, and the unreferenced checkpoint
    assert not n0.queued[BLOCK] and not n1.queued[BLOCK]  # they have kids
    b = serve(s, "b", P + [2])
    assert b.num_cached_tokens == 12 and len(tree.nodes) == 3  # a hit adds no node
    s.cache.check_integrity()


def test_clock_rises_to_each_evicted_priority() -> None:
    s = make(num_pages=1 + 8)  # 8 pages: a's 3 cached blocks + its checkpoint (3 pages) leave 2 free
    a = serve(s, "a", P + [1])
    tree = s.cache.tree
    assert len(free_pages(s.cache)) == 8 - 3 - K
    low = tree._lowest()
    assert low is not None and tree.clock == 0.0 and low[2] > 0.0  # a's checkpoint (or its leaf) has value
    b = serve(s, "b", list(range(500, 528)))  # 7 blocks: needs nearly every page, a's cache goes
    assert b.num_cached_tokens == 0
    node = tree.nodes.get(a.block_hashes[2])
    assert node is None or node.ckpt is None  # a's checkpoint was evicted
    assert tree.num_evictions[STATE] >= 1 and tree.clock >= low[2] > 0.0  # the checkpoint's value lifted it
    s.cache.check_integrity()


def test_checkpoint_cap_evicts_the_lowest_queued_checkpoint() -> None:
    """With a cap on checkpoints (`max_checkpoints`), `make_room(.., checkpoint=True)` evicts the lowest queued
    checkpoint, not the lowest item: `_lowest_checkpoint` skips a leaf block below every checkpoint and stale heap
    entries (re-queued items)."""
    s = make()
    tree = s.cache.tree
    for i in range(6):
        serve(s, f"r{i}", list(range(100 * i, 100 * i + 13 + 4 * i)))
    ckpts = [n for n in tree.nodes.values() if n.queued[STATE]]
    assert len(ckpts) >= 3
    for j, n in enumerate(ckpts):  # re-queued at priorities of our choosing: stale entries left behind
        tree._queue(STATE, n, n.base[STATE], 100.0 + (j * 7) % len(ckpts))
    lowest = min(ckpts, key=lambda n: live(tree)[(STATE, id(n))])
    leaf = next(n for n in tree.nodes.values() if n.queued[BLOCK])
    tree._queue(BLOCK, leaf, tree.clock, -1.0)  # a leaf block below every checkpoint
    top = tree._lowest()
    assert top is not None and top[0] == BLOCK and top[1] is leaf  # the path under test
    found = tree._lowest_checkpoint()
    assert found is not None and found[0] is lowest and found[1] == live(tree)[(STATE, id(lowest))]
    assert len(tree._heap) > tree.num_queued  # stale entries were there to skip
    tree.max_checkpoints = tree.num_checkpoints
    before = tree.num_checkpoints
    h = lowest.hash
    assert tree.make_room(0, checkpoint=True)
    assert tree.num_checkpoints == before - 1 and (h not in tree.nodes or tree.nodes[h].ckpt is None)
    assert leaf.page and leaf.queued[BLOCK]  # the lower block stayed: the cap only takes checkpoints
    s.cache.check_integrity()


@pytest.mark.parametrize(
    "corruption", ["parent link", "queued non-leaf", "stray node", "heap", "free page named", "checkpoint count"]
)
def test_check_integrity_catches_a_corrupted_tree(corruption: str) -> None:
    s = make()
    a = serve(s, "a", P + [1])
    s.cache.check_integrity()
    tree = s.cache.tree
    n0, n1, n2 = (tree.nodes[h] for h in a.block_hashes[:3])
    if corruption == "parent link":
        del n0.kids[n1.hash]
    elif corruption == "queued non-leaf":
        tree._queue(BLOCK, n0, 0.0, 0.0)
    elif corruption == "heap":
        assert tree.num_queued
        tree._heap.clear()
    elif corruption == "free page named":
        tree.pages.free.append(n1.page)
    elif corruption == "checkpoint count":
        tree.num_checkpoints += 1
    else:
        tree.node(b"x" * 16, 4)  # a node naming nothing
    with pytest.raises(AssertionError):
        s.cache.check_integrity()


def test_one_heap_ages_old_popularity_out() -> None:
    """Leaf blocks and checkpoints share one GreedyDual heap: a checkpoint restored (popular) before the clock rose
    goes before a newer one and before a newer leaf block, though it is worth more per page (ageing: by value alone
    the newer, shallower checkpoint would go first)."""
    s = make()
    tree = s.cache.tree
    x = serve(s, "x", list(range(200, 241)))  # 41 tokens: a deep checkpoint at 40, worth more per page
    a = serve(s, "a", P + [1])  # checkpoint at 12
    a2 = serve(s, "a2", P + [2])  # restores it: a hit at clock 0
    assert a2.num_cached_tokens == 12
    nx, na = tree.nodes[x.block_hashes[9]], tree.nodes[a.block_hashes[2]]
    assert nx.ckpt is not None and na.ckpt is not None
    assert tree._value(STATE, nx) > tree._value(STATE, na) > 0.0
    assert {kind for _, _, kind, _ in tree._heap} == {BLOCK, STATE}  # one heap, both kinds
    tree._evict_victim(STATE, nx, live(tree)[(STATE, id(nx))])  # the clock rises to x's priority
    old = live(tree)[(STATE, id(na))]
    assert tree.clock > old and nx.ckpt is None
    c = serve(s, "c", list(range(300, 309)))  # a checkpoint at 8, released now: less value, a higher base
    nc = tree.nodes[c.block_hashes[1]]
    assert nc.ckpt is not None and tree._value(STATE, na) > tree._value(STATE, nc) > 0.0
    prios = live(tree)
    assert prios[(STATE, id(nc))] > old and prios[(BLOCK, id(nc))] > old
    low = tree._lowest()
    assert low is not None and low[1] is na  # a's block or a's checkpoint
    tree._evict_victim(*low)
    assert na.ckpt is None and nc.ckpt is not None and nc.page  # a's checkpoint went (with its block, or alone)
    assert tree.clock >= old
    s.cache.check_integrity()


def test_blocks_and_checkpoints_trade_pages() -> None:
    """One page pool: a checkpoint's k pages, once evicted, hold attention blocks, and blocks evicted make room for
    a checkpoint (no ranges: any k free pages)."""
    s = make(num_pages=1 + 9)
    a = serve(s, "a", P + [1])
    node = s.cache.tree.nodes[a.block_hashes[2]]
    assert node.ckpt is not None
    ckpt = set(node.ckpt)
    b = serve(s, "b", list(range(500, 536)))  # 9 blocks: every page of the arena
    assert b.num_cached_tokens == 0
    assert ckpt <= {n.page for n in s.cache.tree.nodes.values() if n.page} | free_pages(s.cache)
    assert node.hash not in s.cache.tree.nodes or s.cache.tree.nodes[node.hash].ckpt is None
    blocks_of_b = {s.cache.tree.nodes[h].page for h in b.block_hashes if h in s.cache.tree.nodes}
    assert ckpt & blocks_of_b  # b's blocks took the checkpoint's pages
    s.cache.check_integrity()
