"""PagePool and SlotPool (engine/cache/pools.py) on tiny pools: exact ids, free order, reference counts; then the
page pool under the cache manager, where blocks and checkpoints share it.

    fresh page pool of 6:  null [0]   free (next first): 1 2 3 4 5
    fresh slot pool of 5:  null [0]   free (lowest first): 1 2 3 4
"""

from __future__ import annotations

import pytest
from hybridpd.engine.cache.coordinator import HybridCacheManager, PoolLayout
from hybridpd.engine.cache.pools import PagePool, PoolExhaustedError, SlotPool
from hybridpd.engine.cache.specs import NULL_BLOCK_ID, CacheGroup, FullAttentionSpec, RecurrentStateSpec
from hybridpd.engine.request import Request
from hybridpd.engine.sampling_params import SamplingParams


def free_order(pool: PagePool) -> list[int]:
    """The free pages in the order `take` hands them out."""
    return pool.free[::-1]


# -- PagePool -------------------------------------------------------------------------------------------------------
def test_fresh_page_pool_hands_out_ids_in_order() -> None:
    pool = PagePool(6)
    assert pool.capacity == 5 and len(pool.free) == 5 and pool.num_checkpoint_pages == 0
    assert free_order(pool) == [1, 2, 3, 4, 5]
    assert pool.take(2) == [1, 2]
    assert pool.take(3) == [3, 4, 5]
    assert pool.free == [] and pool.ref == [1, 1, 1, 1, 1, 1]


def test_null_page_is_never_handed_out_nor_given_back() -> None:
    pool = PagePool(6)
    got = pool.take(5)
    assert NULL_BLOCK_ID not in got and pool.ref[NULL_BLOCK_ID] == 1
    with pytest.raises(PoolExhaustedError, match="asked for 1 pages, 0 free"):
        pool.take(1)
    with pytest.raises(AssertionError):
        pool.give_back([NULL_BLOCK_ID])
    assert pool.ref[NULL_BLOCK_ID] == 1 and NULL_BLOCK_ID not in pool.free
    pool.give_back(reversed(got))
    assert sorted(pool.take(5)) == [1, 2, 3, 4, 5]  # after churn the null page is still never handed out


def test_failed_take_changes_nothing() -> None:
    pool = PagePool(6)
    pool.take(4)
    with pytest.raises(PoolExhaustedError, match="asked for 2 pages, 1 free"):
        pool.take(2)
    assert free_order(pool) == [5] and pool.ref[5] == 0
    assert pool.take(1) == [5]


def test_given_back_pages_are_handed_out_next_last_first() -> None:
    pool = PagePool(6)
    assert pool.take(3) == [1, 2, 3]
    pool.give_back([3, 1])
    assert pool.ref[1] == pool.ref[3] == 0 and pool.ref[2] == 1
    assert free_order(pool) == [1, 3, 4, 5]
    assert pool.take(1) == [1]
    assert pool.take(2) == [3, 4]
    assert pool.take(1) == [5]


def test_a_page_still_referenced_twice_cannot_be_given_back() -> None:
    pool = PagePool(4)
    (p,) = pool.take(1)
    pool.ref[p] += 1  # a second request holds it (the manager counts holders in `ref`)
    with pytest.raises(AssertionError):
        pool.give_back([p])
    pool.ref[p] -= 1
    pool.give_back([p])
    assert pool.ref[p] == 0 and free_order(pool)[0] == p


def test_page_pool_needs_a_real_page() -> None:
    with pytest.raises(ValueError, match="at least 2 pages"):
        PagePool(1)
    pool = PagePool(2)
    assert pool.capacity == 1 and pool.take(1) == [1]


# -- SlotPool -------------------------------------------------------------------------------------------------------
def test_slot_pool_hands_out_the_lowest_free_slot() -> None:
    slots = SlotPool(5)
    assert slots.capacity == 4
    assert [slots.take() for _ in range(4)] == [1, 2, 3, 4]
    assert slots.take() is None  # exhausted: None, not an exception (the caller waits)
    assert slots.held == [False, True, True, True, True]
    slots.give_back(3)
    slots.give_back(2)
    assert slots.held == [False, True, False, False, True]
    assert slots.take() == 2 and slots.take() == 3 and slots.take() is None


def test_slot_pool_refuses_a_double_give_back_and_the_null_slot() -> None:
    slots = SlotPool(3)
    s = slots.take()
    assert s == 1
    slots.give_back(s)
    with pytest.raises(AssertionError):
        slots.give_back(s)
    with pytest.raises(AssertionError):
        slots.give_back(0)  # the null slot is never held
    assert sorted(slots.free) == [1, 2]


def test_an_empty_slot_pool_has_no_slot() -> None:
    for n in (0, 1):  # no recurrent group (0), or only the null slot
        slots = SlotPool(n)
        assert slots.capacity == 0 and slots.take() is None


# -- the page pool under the cache manager -------------------------------------------------------------------------
BS = 4
ATTN = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_dim=2, dtype="float32")
MAMBA = RecurrentStateSpec("mamba2", (4, 3), "float32", (2, 4), "float32")
GROUPS = [CacheGroup(0, ATTN, (0,)), CacheGroup(1, MAMBA, (1, 2))]


def manager(pages: int, slots: int = 5, k: int = 3, groups: list[CacheGroup] = GROUPS) -> HybridCacheManager:
    return HybridCacheManager(groups, PoolLayout(pages, slots, 0, BS, k))


def computed(cache: HybridCacheManager, req: Request, n: int) -> None:
    """`n` tokens of `req` computed and the step done (its blocks named, its checkpoints published)."""
    req.num_computed_tokens = n
    cache.on_step_done([req])


def test_blocks_reference_pages_and_a_cached_block_is_not_free() -> None:
    cache = manager(8, groups=GROUPS[:1])
    pool = cache.pages
    a = Request("a", list(range(12)), SamplingParams(max_tokens=1))
    assert cache.allocate(a, 12)
    assert cache.req_blocks["a"] == [1, 2, 3] and [pool.ref[p] for p in (1, 2, 3)] == [1, 1, 1]
    computed(cache, a, 12)
    cache.free(a)  # named: cached, unreferenced, evictable; not free
    assert [pool.ref[p] for p in (1, 2, 3)] == [0, 0, 0] and free_order(pool) == [4, 5, 6, 7]
    b = Request("b", list(range(10)) + [99, 98], SamplingParams(max_tokens=1))
    hit = cache.find_prefix_hit(b)
    assert hit.num_tokens == 8 and hit.blocks == (1, 2)
    assert cache.allocate(b, 12, hit)  # the hit references 1 and 2 again; the new block is a free page
    assert cache.req_blocks["b"] == [1, 2, 4] and pool.ref[1] == pool.ref[2] == 1 and pool.ref[3] == 0
    assert cache.num_in_use == 3
    cache.check_integrity()


def test_only_the_tree_evicts_and_an_evicted_page_is_handed_out_next() -> None:
    cache = manager(5, groups=GROUPS[:1])  # 4 usable pages
    pool = cache.pages
    a = Request("a", list(range(12)), SamplingParams(max_tokens=1))
    assert cache.allocate(a, 12)
    computed(cache, a, 12)
    cache.free(a)
    with pytest.raises(PoolExhaustedError):
        pool.take(2)  # the pool itself never evicts: 1 free page
    b = Request("b", list(range(100, 108)), SamplingParams(max_tokens=1))
    assert cache.allocate(b, 8)  # 2 pages: the tree evicts a's leaf block (page 3), handed out first, then page 4
    assert cache.req_blocks["b"] == [3, 4] and cache.tree.num_evictions == [1, 0]
    assert cache.find_prefix_hit(Request("a2", list(range(13)), SamplingParams(max_tokens=1))).num_tokens == 8
    cache.check_integrity()


def test_checkpoints_and_blocks_share_the_pages() -> None:
    """A checkpoint takes k = 3 pages (reference 1: its node holds them); evicting it gives them to blocks."""
    cache = manager(8)  # 7 usable pages
    pool = cache.pages
    a = Request("a", list(range(10)), SamplingParams(max_tokens=1))  # prompt end checkpoint at 8
    assert cache.allocate(a, 10)
    assert cache.req_blocks["a"] == [1, 2, 3] and cache.running_slot["a"] == 1
    cache.checkpoint_plan(a, 0, 8)
    (save,) = cache.take_saves()
    assert save == (1, (4, 5, 6))  # the running slot to 3 free pages
    computed(cache, a, 8)
    assert cache.tree.num_checkpoints == 1 and pool.num_checkpoint_pages == 3
    assert [pool.ref[p] for p in (4, 5, 6)] == [1, 1, 1] and cache.num_in_use == 3
    assert cache.tree.ckpt_node.get(4).ckpt == (4, 5, 6)  # type: ignore[union-attr]
    stats = {s["kind"]: s for s in cache.pool_stats()}
    assert stats["attention"] == {"group_id": 0, "kind": "attention", "total": 7, "free": 1, "in_use": 3,
                                  "cached": 3}
    assert stats["mamba2"] == {"group_id": 1, "kind": "mamba2", "total": 4, "free": 3, "in_use": 1, "cached": 1}
    cache.free(a)
    cache.check_integrity()
    big = Request("big", list(range(500, 528)), SamplingParams(max_tokens=1))
    assert cache.allocate(big, 28)  # 7 pages: every cached block and the checkpoint go
    assert sorted(cache.req_blocks["big"]) == list(range(1, 8)) and pool.num_checkpoint_pages == 0
    assert cache.tree.num_checkpoints == 0 and cache.tree.num_evictions[1] == 1
    cache.check_integrity()


def test_integrity_check_catches_a_miscounted_page() -> None:
    cache = manager(6, groups=GROUPS[:1])
    a = Request("a", list(range(8)), SamplingParams(max_tokens=1))
    assert cache.allocate(a, 8)
    cache.check_integrity()
    cache.pages.ref[1] = 2  # one reference more than the requests listing it
    with pytest.raises(AssertionError):
        cache.check_integrity()
    cache.pages.ref[1] = 1
    cache.pages.free.append(1)  # a referenced page on the free list
    with pytest.raises(AssertionError):
        cache.check_integrity()
    cache.pages.free.pop()
    cache.num_in_use += 1  # an in-use count that no longer matches the requests' pages
    with pytest.raises(AssertionError):
        cache.check_integrity()
