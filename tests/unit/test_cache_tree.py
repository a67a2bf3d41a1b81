"""The cache tree on tiny pools (no model): node links, the leaf rule, GreedyDual ageing, and `check_integrity`
catching a corrupted tree (engine/cache/tree.py).

    prompt P + [1]:   n0 -- n1 -- n2        3 full blocks (block 4 tokens), a checkpoint at n2 (prompt end 12)
    prompt P + [2]:   the same chain: a hit, no new node
"""

from __future__ import annotations

import pytest
from hybridpd.engine.cache.tree import BLOCK as BLOCK_ITEM
from hybridpd.engine.cache.tree import STATE as STATE_ITEM

from tests.unit.test_cache_v2 import BLOCK, STATE, P, make, serve


def test_a_node_per_cached_block_and_only_leaves_queued() -> None:
    s = make()
    a, _ = serve(s, "a", P + [1])
    tree, chain = s.cache.tree, s.cache.attention.pool  # type: ignore[union-attr]
    n0, n1, n2 = (tree.nodes[h] for h in a.block_hashes[:3])
    assert (n0.parent, n1.parent, n2.parent) == (None, n0, n1) and list(n1.kids.values()) == [n2]
    assert [n.tokens for n in (n0, n1, n2)] == [4, 8, 12]
    queued = tree.queued[BLOCK_ITEM]
    assert chain.lookup(n2.hash) in queued  # the leaf
    assert chain.lookup(n0.hash) not in queued and chain.lookup(n1.hash) not in queued  # they have kids
    b, _ = serve(s, "b", P + [2])
    assert b.num_cached_tokens == 12 and len(tree.nodes) == 3  # a hit adds no node
    s.cache.check_integrity()


def test_clock_rises_to_each_evicted_priority() -> None:
    s = make(budget=2 * STATE + 8 * BLOCK)
    a, _ = serve(s, "a", P + [1])
    tree = s.cache.tree
    low = tree._lowest()
    assert low is not None and tree.clock == 0.0
    serve(s, "b", list(range(500, 528)))  # needs the whole budget: a's cache goes
    assert s.cache.recurrent.pool.lookup(a.block_hashes[2]) is None  # type: ignore[union-attr]
    assert tree.state.num_evictions >= 1 and tree.clock >= low[2] > 0.0  # the checkpoint's value lifted it
    s.cache.check_integrity()


def test_lowest_checkpoint_under_a_block_is_the_lowest_queued_one() -> None:
    """With a (dead-end) block at the top of the heap, `_lowest(STATE)` answers from the checkpoints' own heap: the
    same item a scan of every queued checkpoint finds (priority, then release order), also after re-queues."""
    s = make()
    tree = s.cache.tree
    for i in range(6):
        serve(s, f"r{i}", list(range(100 * i, 100 * i + 13 + 4 * i)))
    queued = tree.queued[STATE_ITEM]
    assert len(queued) >= 3
    for slot in list(queued)[:2]:  # re-queued at their priorities: stale entries in both heaps
        tree._queue(STATE_ITEM, slot, queued[slot][2], queued[slot][0])
    leaf = next(iter(tree.queued[BLOCK_ITEM]))
    tree._queue(BLOCK_ITEM, leaf, tree.clock, tree.clock - 1.0)  # a leaf block below every checkpoint
    top = tree._lowest()
    assert top is not None and top[0] == BLOCK_ITEM  # the path under test
    slot, entry = min(queued.items(), key=lambda kv: kv[1][:2])
    assert tree._lowest(STATE_ITEM) == (STATE_ITEM, slot, entry[0])
    s.cache.check_integrity()


@pytest.mark.parametrize("corruption", ["parent link", "queued non-leaf", "stray node", "checkpoint heap"])
def test_check_integrity_catches_a_corrupted_tree(corruption: str) -> None:
    s = make()
    a, _ = serve(s, "a", P + [1])
    tree, chain = s.cache.tree, s.cache.attention.pool  # type: ignore[union-attr]
    n0, n1, _ = (tree.nodes[h] for h in a.block_hashes[:3])
    if corruption == "parent link":
        del n0.kids[n1.hash]
    elif corruption == "queued non-leaf":
        tree._push(BLOCK_ITEM, chain.lookup(n0.hash), n0.hash)  # type: ignore[arg-type]
    elif corruption == "checkpoint heap":
        assert tree.queued[STATE_ITEM]
        tree._state_heap.clear()
    else:
        tree._node(b"x" * 16, 4)
    with pytest.raises(AssertionError):
        s.cache.check_integrity()


def test_one_heap_ages_old_popularity_out() -> None:
    """Leaf blocks and checkpoints share one GreedyDual heap: a checkpoint restored (popular) before the clock rose
    goes before a newer one and before a hot leaf block, though it is worth more per byte (ageing: by value alone
    the newer, shallower checkpoint would go first)."""
    s = make()
    tree, chain, state = s.cache.tree, s.cache.attention.pool, s.cache.recurrent.pool  # type: ignore[union-attr]
    x, _ = serve(s, "x", list(range(200, 241)))  # 41 tokens: a deep checkpoint at 40, worth more per byte
    a, _ = serve(s, "a", P + [1])  # checkpoint at 12
    serve(s, "a2", P + [2])  # restores it: a hit at clock 0
    hx, ha = x.block_hashes[9], a.block_hashes[2]
    sx, sa = state.lookup(hx), state.lookup(ha)
    assert sx is not None and sa is not None and tree.nodes[ha].last_hit is not None
    assert tree._value(STATE_ITEM, hx) > tree._value(STATE_ITEM, ha) > 0.0
    assert {key & 1 for _, _, key in tree._heap} == {BLOCK_ITEM, STATE_ITEM}  # one heap, both kinds
    tree.evict(STATE_ITEM, sx, tree.queued[STATE_ITEM][sx][0])  # the clock rises to x's priority
    old = tree.queued[STATE_ITEM][sa][0]
    assert tree.clock > old
    c, _ = serve(s, "c", list(range(300, 309)))  # a checkpoint at 8, released now: less value, a higher base
    hc = c.block_hashes[1]
    assert tree._value(STATE_ITEM, ha) > tree._value(STATE_ITEM, hc) > 0.0
    sc, leaf_c = state.lookup(hc), chain.lookup(hc)
    assert sc is not None and leaf_c in tree.queued[BLOCK_ITEM]
    assert tree.queued[STATE_ITEM][sc][0] > old and tree.queued[BLOCK_ITEM][leaf_c][0] > old  # type: ignore[index]
    low = tree._lowest()
    assert low is not None and tree.pool_of[low[0]].block_hash[low[1]] == ha  # a's block or a's checkpoint
    tree._evict_victim(low)
    assert state.lookup(ha) is None and state.lookup(hc) == sc and chain.lookup(hc) == leaf_c
    assert tree.clock >= old
    s.cache.check_integrity()
