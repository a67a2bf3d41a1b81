"""The cache tree on tiny pools (no model): node links, the leaf rule, GreedyDual ageing, and `check_integrity`
catching a corrupted tree (engine/cache/tree.py).

    prompt P + [1]:   n0 -- n1 -- n2        3 full blocks (block 4 tokens), a checkpoint at n2 (prompt end 12)
    prompt P + [2]:   the same chain: a hit, no new node
"""

from __future__ import annotations

import pytest
from hybridpd.engine.cache.tree import BLOCK as BLOCK_ITEM

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
    assert tree.num_evicted["state"] >= 1 and tree.clock >= low[2] > 0.0  # the checkpoint's value lifted it
    s.cache.check_integrity()


@pytest.mark.parametrize("corruption", ["parent link", "queued non-leaf", "stray node"])
def test_check_integrity_catches_a_corrupted_tree(corruption: str) -> None:
    s = make()
    a, _ = serve(s, "a", P + [1])
    tree, chain = s.cache.tree, s.cache.attention.pool  # type: ignore[union-attr]
    n0, n1, _ = (tree.nodes[h] for h in a.block_hashes[:3])
    if corruption == "parent link":
        del n0.kids[n1.hash]
    elif corruption == "queued non-leaf":
        tree._push(BLOCK_ITEM, chain.lookup(n0.hash), n0.hash)  # type: ignore[arg-type]
    else:
        tree._node(b"x" * 16, 4)
    with pytest.raises(AssertionError):
        s.cache.check_integrity()
